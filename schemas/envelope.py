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
"""The most characters (code points) a ``CorrelationId`` may have; a longer one is a contract
violation (``schema-mismatch``), decided when the envelope is decoded. It is copied into every
event we emit, so it is what keeps an emitted envelope small (see the table in :mod:`schemas`)."""

CorrelationId = Annotated[str, StringConstraints(max_length=MAX_CORRELATION_ID_LENGTH)]
"""A ``CorrelationId`` value: any text of at most :data:`MAX_CORRELATION_ID_LENGTH` characters."""

_ISO_DATE_START = r"^[0-9]{4}-"
"""How a text timestamp starts: its year and a hyphen. Unix time never does (no number has four
digits then a hyphen: ``1.0e-5`` has its hyphen after an ``e``)."""


class _IsoText:
    """In JSON, a timestamp is text starting as an ISO 8601 date (``YYYY-``), then parsed as usual.

    pydantic reads a string of digits (``"1733356800"``, ``"-1"``, ``"20240501"``, also with a
    fraction or an exponent: ``"1.0e-5"``) as Unix seconds or milliseconds in UTC, even in strict
    mode: no .NET producer writes a DateTimeOffset so, and taken as one it would move an event to
    another moment (``"20240501"`` is 1970-08-23). Every text pydantic parses as a date-time
    starts with ``YYYY-``, so the pattern refuses exactly the Unix-time forms; the text is then
    parsed by the very parser as before (pydantic's lax datetime: a strict one takes no Python
    ``str``, which is what the pattern step hands on). Both steps run in pydantic-core (about
    0.1 µs a field, no Python call). Python input (our own events built from datetimes) is
    validated as before, and the JSON Schema stays ``format: date-time``.
    """

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler,
    ) -> core_schema.CoreSchema:
        """The JSON path: ISO-looking text, then an aware datetime; the Python path unchanged."""
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
        """An aware datetime's schema (``type: string, format: date-time``), as before."""
        return handler(core_schema.datetime_schema(tz_constraint="aware"))


Timestamp = Annotated[datetime, _IsoText()]
"""A contract timestamp: an ISO 8601 date-time text with an offset (.NET's DateTimeOffset, e.g.
``2026-11-29T11:00:00.1234567+03:00``), parsed by pydantic as any aware datetime; never Unix
time, never a JSON number. Anything else is a ``schema-mismatch``."""


MAX_UTC_OFFSET = timedelta(hours=14)
"""The largest offset from UTC a .NET DateTimeOffset holds (either way): a larger one makes
``new DateTimeOffset(...)`` throw, and System.Text.Json refuses the text."""


def _a_moment_of_years_1_to_9999_in_utc(value: datetime) -> datetime:
    """``value`` when it is a moment of years 1-9999 in UTC with an offset of at most 14 hours.

    Else the contract is broken (an event carrying it is one a .NET consumer cannot parse).
    """
    offset = value.utcoffset()
    if offset is not None and abs(offset) > MAX_UTC_OFFSET:
        raise ValueError("an offset from UTC of more than 14 hours")
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("not a moment of years 1-9999 in UTC") from None
    return value


Moment = Annotated[Timestamp, AfterValidator(_a_moment_of_years_1_to_9999_in_utc)]
"""A :data:`Timestamp` that is a moment of years 1-9999 in UTC: what .NET's DateTimeOffset, psycopg
and Python's datetime can all hold. An offset can push a valid local time past either end:
``0001-01-01T00:00:00+03:00`` (.NET's ``default(DateTime)`` made a DateTimeOffset on a Moscow
server) is a moment of 1 BC. PostgreSQL stores it, but nothing of ours reads it back: a stored
one broke every later read of its row (a device's last sign-in, an owner's history), and an
event carrying it is one a .NET consumer cannot parse. Such a value is a ``schema-mismatch``."""

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
