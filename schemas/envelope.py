"""The envelope every topic's message value is wrapped in (SPEC §2)."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, TypeVar
from uuid import UUID

from pydantic import AwareDatetime, BaseModel

from schemas.base import WireModel

CONTRACT_VERSION = 1
"""The contract version this service speaks; another version is logged and processed anyway."""

P = TypeVar("P", bound=BaseModel)


class Envelope(WireModel, Generic[P]):
    """``MessageId`` (the dedup key), ``CreatedAt``, ``Version``, the aggregate and a payload."""

    message_id: UUID
    created_at: AwareDatetime
    version: int
    aggregate_id: str
    aggregate_type: str
    correlation_id: str | None = None
    payload: P


def utc_iso(moment: datetime) -> str:
    """Render an aware datetime the way .NET's DateTimeOffset reads it (offset kept)."""
    return moment.isoformat(timespec="microseconds")
