"""The fast decoder of favorites envelopes (msgspec), exactly as lenient as the pydantic contract.

:func:`decode_fast` returns a :class:`FavoriteWire` only for input that
:class:`schemas.favorites.FavoriteEnvelope` accepts, with the very values pydantic would
produce; anything else (invalid JSON, a schema mismatch, input outside the fast subset: braced
GUIDs, ``12:00Z`` times, years 1 and 9999, values that may pass pydantic's parser limits of
nesting depth and integer digits) returns None and the caller asks pydantic, which gives the
verdict and the DLQ reason. Timestamps are parsed here as pydantic does (fractions beyond
microseconds truncated). ``tests/unit/test_favorite_wire.py`` checks the equivalence.
"""

from __future__ import annotations

import re
import sys
from datetime import datetime
from typing import Annotated
from uuid import UUID

import msgspec

from schemas.envelope import MAX_CORRELATION_ID_LENGTH
from schemas.favorites import FavoriteEnvelope

_RFC3339 = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-](?:0\d|1[0-3]):[0-5]\d|[+-]14:00)",
    re.ASCII,
)
"""The timestamp form parsed here (offset minutes 00-59, at most 14 h); others go to pydantic."""

_CorrelationId = Annotated[str, msgspec.Meta(max_length=MAX_CORRELATION_ID_LENGTH)]

_JSON_MAX_DEPTH = 201  # the deepest nesting pydantic's JSON parser reads
_SHORTEST_ENVELOPE = 281  # every required field, 32-hex-digit GUIDs, 20-character times
_SHORTEST_TOO_DEEP = _SHORTEST_ENVELOPE + 2 * (_JSON_MAX_DEPTH - 1)  # 2 bytes per extra level
_MOST_DIGITS = sys.get_int_max_str_digits() or sys.maxsize  # pydantic refuses longer integers
_LONG_VALUE = min(_SHORTEST_TOO_DEEP, _MOST_DIGITS)

_fullmatch = _RFC3339.fullmatch
_EDGE_YEARS = ("0001-", "9999-")
_fromisoformat = datetime.fromisoformat


# gc=False: the structs hold only atoms and each other (no cycles); young collections skip them.
class FavoritePayloadWire(msgspec.Struct, frozen=True, rename="pascal", gc=False):
    """:class:`~schemas.favorites.FavoritePayload`, attribute for attribute."""

    favorite_id: UUID
    property_object_id: UUID
    occurred_at: datetime
    user_id: UUID | None = None
    anonymous_id: UUID | None = None


class FavoriteWire(msgspec.Struct, frozen=True, rename="pascal", gc=False):
    """:class:`~schemas.favorites.FavoriteEnvelope`, attribute for attribute (a decoded message)."""

    message_id: UUID
    created_at: datetime
    version: int
    aggregate_id: str
    aggregate_type: str
    payload: FavoritePayloadWire
    correlation_id: str | None = None


class _RawPayload(msgspec.Struct, frozen=True, rename="pascal", gc=False):
    favorite_id: UUID
    property_object_id: UUID
    occurred_at: str
    user_id: UUID | None = None
    anonymous_id: UUID | None = None


class _RawEnvelope(msgspec.Struct, frozen=True, rename="pascal", gc=False):
    message_id: UUID
    created_at: str
    version: int
    aggregate_id: str
    aggregate_type: str
    payload: _RawPayload
    correlation_id: _CorrelationId | None = None


_decode_raw = msgspec.json.Decoder(_RawEnvelope).decode


def _timestamp(text: str) -> datetime | None:
    """``text`` as an aware datetime if in the fast form, valid, not years 1 or 9999; else None."""
    if _fullmatch(text) is None or text.startswith(_EDGE_YEARS):
        return None
    try:
        return _fromisoformat(text)
    except ValueError:  # Feb 30, hour 24, second 60, offset 24:00: pydantic decides
        return None


def decode_fast(value: bytes) -> FavoriteWire | None:
    """``value`` (valid UTF-8) decoded, or None when only pydantic can tell (see module doc)."""
    if len(value) >= _LONG_VALUE and (
        len(value) > _MOST_DIGITS or value.count(b"[") + value.count(b"{") > _JSON_MAX_DEPTH
    ):
        return None  # maybe beyond pydantic's parser limits
    try:
        raw = _decode_raw(value)
    except (msgspec.DecodeError, RecursionError):  # also msgspec.ValidationError
        return None
    created_at = _timestamp(raw.created_at)
    payload = raw.payload
    occurred_at = _timestamp(payload.occurred_at)
    if created_at is None or occurred_at is None:
        return None
    return FavoriteWire(raw.message_id, created_at, raw.version, raw.aggregate_id,
                        raw.aggregate_type, FavoritePayloadWire(
                            payload.favorite_id, payload.property_object_id, occurred_at,
                            payload.user_id, payload.anonymous_id), raw.correlation_id)


def from_model(envelope: FavoriteEnvelope) -> FavoriteWire:
    """A pydantic-decoded envelope (the slow path) as the flow's message type."""
    payload = envelope.payload
    return FavoriteWire(envelope.message_id, envelope.created_at, envelope.version,
                        envelope.aggregate_id, envelope.aggregate_type, FavoritePayloadWire(
                            payload.favorite_id, payload.property_object_id, payload.occurred_at,
                            payload.user_id, payload.anonymous_id), envelope.correlation_id)
