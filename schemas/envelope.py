"""The envelope every topic's message value is wrapped in (SPEC §2)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Generic, TypeVar
from uuid import UUID

from pydantic import AfterValidator, AwareDatetime, BaseModel, StringConstraints

from schemas.base import WireModel

CONTRACT_VERSION = 1
"""The contract version this service speaks; another version is logged and processed anyway."""

MAX_CORRELATION_ID_LENGTH = 256
"""The most characters (code points) a ``CorrelationId`` may have; a longer one is a contract
violation (``schema-mismatch``), decided when the envelope is decoded. It is copied into every
event we emit, so it is what keeps an emitted envelope small (see the table in :mod:`schemas`)."""

CorrelationId = Annotated[str, StringConstraints(max_length=MAX_CORRELATION_ID_LENGTH)]
"""A ``CorrelationId`` value: any text of at most :data:`MAX_CORRELATION_ID_LENGTH` characters."""



def _a_moment_of_years_1_to_9999_in_utc(value: datetime) -> datetime:
    """``value`` when it is a moment of years 1-9999 in UTC; else the contract is broken."""
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("not a moment of years 1-9999 in UTC") from None
    return value


Moment = Annotated[AwareDatetime, AfterValidator(_a_moment_of_years_1_to_9999_in_utc)]
"""An aware timestamp that is a moment of years 1-9999 in UTC: what .NET's DateTimeOffset, psycopg
and Python's datetime can all hold. An offset can push a valid local time past either end:
``0001-01-01T00:00:00+03:00`` (.NET's ``default(DateTime)`` made a DateTimeOffset on a Moscow
server) is a moment of 1 BC. PostgreSQL stores it, but nothing of ours reads it back: a stored
one broke every later read of its row (a device's last sign-in, an owner's history), and an
event carrying it is one a .NET consumer cannot parse. Such a value is a ``schema-mismatch``."""

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
