"""The outbox row every flow writes, and the headers it carries over from the source record.

Trace context (W3C Trace Context, https://www.w3.org/TR/trace-context/):

* ``traceparent`` is passed through only when it is valid. Version ``00``: exactly
  ``00-<32 hex>-<16 hex>-<2 hex>`` (55 characters, lower-case hex), trace-id and parent-id not
  all zeros. A future version (``01``-``fe``; ``ff`` is invalid) is read by the spec's
  forward-compatibility rule: 55 characters or more, the first 55 laid out as in version 00,
  followed by the end or a ``-``; we pass on what we understand, as version ``00`` with the same
  trace-id, parent-id and flags (55 characters; the rest is dropped). Anything else (malformed,
  upper-case hex, not ASCII, longer than :data:`MAX_TRACEPARENT_INPUT_LENGTH`, empty) is
  DROPPED: the event is emitted without it. A bad header is never a reason to dead-letter a
  valid message.
* ``tracestate`` is NOT passed through: we add no vendor entry of ours, and not copying it
  keeps every emitted header bounded (55 bytes in all).
* With tracing on (:mod:`runtime.tracing`) a **sampled** message carries a :class:`MessageTrace`
  and its event's ``traceparent`` names the message's ``handle`` span instead (same trace id,
  sampled); an unsampled message's event carries the incoming one as above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from uuid import UUID

from schemas.kafka_record import SourceRecord

TRACEPARENT = "traceparent"
"""The W3C trace-context header, passed through from the source record to what we emit."""

TRACEPARENT_LENGTH = 55
"""The length of a version-00 traceparent: the only form (and size) we emit."""

MAX_TRACEPARENT_INPUT_LENGTH = 512
"""A (future-version) traceparent longer than this is dropped unread."""

_VERSION_00 = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
"""Version 00, matched in full."""
_FUTURE_VERSION = re.compile(
    rb"(?!ff)[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(?:-|\Z)"
)
"""A later version: its first 55 characters as in version 00, then the end or a dash."""
_ZERO_TRACE_ID = b"0" * 32
_ZERO_PARENT_ID = b"0" * 16


@dataclass(frozen=True, slots=True)
class MessageTrace:
    """The trace of a sampled message (:mod:`runtime.tracing`): ids chosen before its spans exist.

    ``parent_span_id`` is the incoming ``traceparent``'s span (0: the message started a new
    trace); ``handle_span_id`` is the id its ``handle`` span will get, named by the outbox row.
    """

    trace_id: int
    parent_span_id: int
    handle_span_id: int

    @property
    def traceparent(self) -> str:
        """The version-00, sampled ``traceparent`` of the ``handle`` span (55 characters)."""
        return f"00-{self.trace_id:032x}-{self.handle_span_id:016x}-01"


@dataclass(slots=True)
class OutboxRow:
    """One ``user_activity.outbox`` row: the event's MessageId, topic, key, value, headers.

    Never changed once made; not ``frozen``, as :class:`~schemas.kafka_record.SourceRecord`
    (one per recorded event, and a frozen ``__init__`` costs about five times as much).

    The publisher produces a row as it is (``sinks.kafka_producer.Producible``: ``topic``,
    ``key``, ``value``, ``headers``; the headers dict is sent with its str values UTF-8 encoded).
    """

    id: UUID
    topic: str
    key: bytes
    value: bytes
    headers: dict[str, str]


def valid_traceparent(value: bytes) -> str | None:
    """``value`` as the version-00 traceparent we pass on, or None to drop it (module doc)."""
    size = len(value)
    if not TRACEPARENT_LENGTH <= size <= MAX_TRACEPARENT_INPUT_LENGTH:
        return None
    if value[:2] == b"00":
        match = _VERSION_00.fullmatch(value) if size == TRACEPARENT_LENGTH else None
    else:
        match = _FUTURE_VERSION.match(value)
    if match is None or match[1] == _ZERO_TRACE_ID or match[2] == _ZERO_PARENT_ID:
        return None
    return "00" + value[2:TRACEPARENT_LENGTH].decode("ascii")


def propagated_headers(record: SourceRecord, trace: MessageTrace | None = None) -> dict[str, str]:
    """The headers an event inherits from the record that caused it: a valid ``traceparent``.

    With ``trace`` (a sampled message), the ``traceparent`` of its ``handle`` span. Otherwise an
    invalid or oversized traceparent is dropped (see the module doc); ``tracestate`` and every
    other header are never copied.
    """
    if trace is not None:
        return {TRACEPARENT: trace.traceparent}
    traceparent = record.header(TRACEPARENT)
    if traceparent is None:
        return {}
    valid = valid_traceparent(traceparent)
    if valid is None:
        return {}
    return {TRACEPARENT: valid}
