"""The envelope every topic's message value is wrapped in (SPEC §2)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, TypeVar
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, StringConstraints

from schemas.base import WireModel

CONTRACT_VERSION = 1
"""The contract version this service speaks; another version is logged and processed anyway."""

MAX_CORRELATION_ID_LENGTH = 256
"""The most characters (code points) a ``CorrelationId`` may have; a longer one is a contract
violation (``schema-mismatch``), decided when the envelope is decoded. It is copied into every
event we emit, so it is what keeps an emitted envelope small (see the table in :mod:`schemas`)."""

CorrelationId = Annotated[str, StringConstraints(max_length=MAX_CORRELATION_ID_LENGTH)]
"""A ``CorrelationId`` value: any text of at most :data:`MAX_CORRELATION_ID_LENGTH` characters."""

P = TypeVar("P", bound=BaseModel)


class Envelope(WireModel, Generic[P]):
    """``MessageId`` (the dedup key), ``CreatedAt``, ``Version``, the aggregate and a payload."""

    message_id: UUID
    created_at: AwareDatetime
    version: int
    aggregate_id: str
    aggregate_type: str
    correlation_id: CorrelationId | None = None
    payload: P


def utc_iso(moment: datetime) -> str:
    """Render an aware datetime the way .NET's DateTimeOffset reads it (offset kept)."""
    return moment.isoformat(timespec="microseconds")
