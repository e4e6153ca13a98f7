"""The envelope every topic's message value is wrapped in (SPEC §2)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Generic, TypeVar
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from schemas.base import WireModel

CONTRACT_VERSION = 1
"""The contract version this service speaks; another version is logged and processed anyway."""

MAX_CORRELATION_ID_LENGTH = 256
"""The most characters a ``CorrelationId`` may have (longer: ``schema-mismatch``); it is copied
into every event we emit (docs/spec.md, Input bounds)."""

CorrelationId = Annotated[str, StringConstraints(max_length=MAX_CORRELATION_ID_LENGTH)]
"""A ``CorrelationId`` value: any text of at most :data:`MAX_CORRELATION_ID_LENGTH` characters."""

_ISO_DATE_START = r"^[0-9]{4}-"  # a year and a hyphen: no Unix-time text starts so


class _IsoText:
    """In JSON, a timestamp is text starting as an ISO 8601 date (``YYYY-``), then parsed as usual.

    pydantic reads a string of digits (``"20240501"``) as Unix time even in strict mode, moving
    the event to another moment; the pattern refuses exactly those forms. Python input and the
    JSON Schema (``format: date-time``) are unchanged.
    """

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler,
    ) -> core_schema.CoreSchema:
        return core_schema.json_or_python_schema(
            json_schema=core_schema.chain_schema([
                core_schema.str_schema(pattern=_ISO_DATE_START),
                core_schema.datetime_schema(tz_constraint="aware", strict=False),
            ]),
            python_schema=core_schema.datetime_schema(tz_constraint="aware"),
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler,
    ) -> JsonSchemaValue:
        return handler(core_schema.datetime_schema(tz_constraint="aware"))


Timestamp = Annotated[datetime, _IsoText()]
"""An ISO 8601 date-time text with an offset (.NET's DateTimeOffset); never Unix time, never a
JSON number. Anything else is a ``schema-mismatch``."""


MAX_UTC_OFFSET = timedelta(hours=14)
"""The largest offset from UTC a .NET DateTimeOffset holds (either way)."""


def _a_moment_of_years_1_to_9999_in_utc(value: datetime) -> datetime:
    """``value`` if it is a moment of years 1-9999 in UTC with an offset of at most 14 hours."""
    offset = value.utcoffset()
    if offset is not None and abs(offset) > MAX_UTC_OFFSET:
        raise ValueError("an offset from UTC of more than 14 hours")
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("not a moment of years 1-9999 in UTC") from None
    return value


Moment = Annotated[Timestamp, AfterValidator(_a_moment_of_years_1_to_9999_in_utc)]
"""A :data:`Timestamp` that is a moment of years 1-9999 in UTC, as .NET, psycopg and Python can
all hold (``0001-01-01T00:00:00+03:00`` is not); else a ``schema-mismatch``."""

P = TypeVar("P", bound=BaseModel)


class Envelope(WireModel, Generic[P]):
    """``MessageId`` (the dedup key), ``CreatedAt``, ``Version``, the aggregate and a payload."""

    message_id: UUID
    created_at: Timestamp
    version: int
    aggregate_id: str
    aggregate_type: str
    correlation_id: CorrelationId | None = None
    payload: P


def utc_iso(moment: datetime) -> str:
    """Render an aware datetime the way .NET's DateTimeOffset reads it (offset kept)."""
    return moment.isoformat(timespec="microseconds")
