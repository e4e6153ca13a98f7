"""The fast decoder of favorites envelopes (msgspec), exactly as lenient as the pydantic contract.

The contract is :class:`schemas.favorites.FavoriteEnvelope` (pydantic: the JSON Schema, the
reasons a message is poison). Decoding it costs about 3 µs per message, the largest single cost
on the worker thread; msgspec decodes the same envelope in about 1 µs. So the flow decodes with
msgspec first and asks pydantic only when msgspec says no:

* :func:`decode_fast` returns a :class:`FavoriteWire` only for input the contract accepts, with
  the very values pydantic would produce; anything else (invalid JSON, a schema mismatch, or
  valid input outside the fast subset: braced GUIDs, ``12:00Z`` times) returns ``None`` and
  the caller decodes with pydantic, which gives the verdict and the DLQ reason. Both read the
  PascalCase wire names only.
* Timestamps are the one place the two libraries differ: msgspec rounds fractions beyond
  microseconds (.NET writes seven digits), pydantic truncates them. So ``CreatedAt`` and
  ``OccurredAt`` are decoded as text and parsed here: an RFC 3339 form (``T``, ``Z`` or
  ``±HH:MM``) with :meth:`datetime.fromisoformat`, which truncates like pydantic.
* Timestamps in years 1 and 9999 are left to pydantic, which refuses those that are no moment of
  years 1-9999 in UTC (:data:`schemas.envelope.Moment`; CreatedAt is not held to it).
* Parser limits: pydantic's JSON parser (jiter) refuses, as invalid JSON, a document nested more
  than :data:`_JSON_MAX_DEPTH` levels deep and an integer of more digits than Python converts
  (``sys.get_int_max_str_digits()``, 4,300); msgspec reads both, in unknown fields too, and
  raises ``RecursionError`` on a document nested about 1,000 deep. So a value long enough to
  hold either (:data:`_SHORTEST_TOO_DEEP` bytes, the digit limit) is checked first: more
  opening brackets than the depth limit, or longer than the digit limit, and pydantic decides
  (``invalid-json``, as on every other path). A typical envelope (about 450 bytes) is shorter:
  one length comparison.
* Bounds: ``CorrelationId`` carries the contract's ``max_length``
  (:data:`~schemas.envelope.MAX_CORRELATION_ID_LENGTH` characters, counted as code points by
  both libraries) as ``msgspec.Meta``, so a longer one fails here too and pydantic dead-letters
  it with ``schema-mismatch``.

* The structs are not tracked by the cyclic garbage collector (``gc=False``): they hold only
  UUIDs, strings, numbers, datetimes and each other, so they can never be part of a reference
  cycle, and reference counting frees them. Tracked, the raw decode cost 2.7 µs per message
  instead of 2.0 (with the job's GC thresholds, :mod:`runtime.gc_tuning`): every young
  collection walks each envelope still in flight.

``tests/unit/test_favorite_wire.py`` checks the equivalence property-based, against pydantic.
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
"""The timestamp form parsed here; others go to pydantic (which may still accept them). The
offset's minutes are 00-59: :meth:`datetime.fromisoformat` reads ``+03:60`` as +04:00, which
pydantic refuses. The offset is at most 14 hours either way (.NET's DateTimeOffset: see
:data:`schemas.envelope.MAX_UTC_OFFSET`); a larger one is left to the contract, which refuses it
in OccurredAt."""

_CorrelationId = Annotated[str, msgspec.Meta(max_length=MAX_CORRELATION_ID_LENGTH)]
""":data:`schemas.envelope.CorrelationId`: the same bound, checked by the decoder."""

_JSON_MAX_DEPTH = 201
"""The deepest nesting pydantic's JSON parser reads (the envelope's own object is one level)."""
_SHORTEST_ENVELOPE = 281
"""The shortest value :func:`decode_fast` decodes: every required field, GUIDs of 32 hex digits,
times of 20 characters (``2026-11-29T11:00:00Z``), empty strings, no whitespace."""
_SHORTEST_TOO_DEEP = _SHORTEST_ENVELOPE + 2 * (_JSON_MAX_DEPTH - 1)
"""No shorter value is both an envelope and nested deeper than pydantic reads: each level beyond
the envelope's two objects takes two bytes (an opening and a closing bracket)."""
_MOST_DIGITS = sys.get_int_max_str_digits() or sys.maxsize
"""pydantic refuses an integer of more digits (Python's int-string limit; 0 means none)."""
_LONG_VALUE = min(_SHORTEST_TOO_DEEP, _MOST_DIGITS)

_fullmatch = _RFC3339.fullmatch
_EDGE_YEARS = ("0001-", "9999-")
_fromisoformat = datetime.fromisoformat


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
    """``text`` as an aware datetime when it is in the fast RFC 3339 form and valid, else None.

    Years 1 and 9999 go to pydantic: an offset can make them no moment of years 1-9999 in UTC
    (:data:`schemas.envelope.Moment`), which the contract refuses.
    """
    if _fullmatch(text) is None or text.startswith(_EDGE_YEARS):
        return None
    try:
        return _fromisoformat(text)
    except ValueError:  # Feb 30, hour 24, second 60, offset 24:00: pydantic decides
        return None


def decode_fast(value: bytes) -> FavoriteWire | None:
    """``value`` (valid UTF-8) decoded, or None when only pydantic can tell (see module doc)."""
    if len(value) >= _LONG_VALUE and (  # rare: a typical envelope is about 450 bytes
        len(value) > _MOST_DIGITS or value.count(b"[") + value.count(b"{") > _JSON_MAX_DEPTH
    ):
        return None  # maybe beyond pydantic's parser limits: pydantic decides (module doc)
    try:
        raw = _decode_raw(value)
    except (msgspec.DecodeError, RecursionError):  # also msgspec.ValidationError
        return None
    created_at = _timestamp(raw.created_at)
    payload = raw.payload
    occurred_at = _timestamp(payload.occurred_at)
    if created_at is None or occurred_at is None:
        return None
    return FavoriteWire(
        raw.message_id,
        created_at,
        raw.version,
        raw.aggregate_id,
        raw.aggregate_type,
        FavoritePayloadWire(
            payload.favorite_id,
            payload.property_object_id,
            occurred_at,
            payload.user_id,
            payload.anonymous_id,
        ),
        raw.correlation_id,
    )


def from_model(envelope: FavoriteEnvelope) -> FavoriteWire:
    """A pydantic-decoded envelope (the slow path) as the flow's message type."""
    payload = envelope.payload
    return FavoriteWire(
        envelope.message_id,
        envelope.created_at,
        envelope.version,
        envelope.aggregate_id,
        envelope.aggregate_type,
        FavoritePayloadWire(
            payload.favorite_id,
            payload.property_object_id,
            payload.occurred_at,
            payload.user_id,
            payload.anonymous_id,
        ),
        envelope.correlation_id,
    )
