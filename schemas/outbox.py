"""The outbox row every flow writes, and the headers it carries over from the source record.

Only a valid W3C ``traceparent`` is passed on: version 00 (lower-case hex, ids not all zeros),
or a later version's first 55 characters by the spec's forward-compatibility rule, passed on as
00. Anything else is dropped (the event goes without it, never dead-lettered); ``tracestate``
is never copied. A message sampled for tracing carries a :class:`MessageTrace`, and its event's
``traceparent`` names the message's ``handle`` span instead.
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
_FUTURE_VERSION = re.compile(
    rb"(?!ff)[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(?:-|\Z)"
)
"""A later version: its first 55 characters as in version 00, then the end or a dash."""
_ZERO_TRACE_ID = b"0" * 32
_ZERO_PARENT_ID = b"0" * 16


@dataclass(frozen=True, slots=True)
class MessageTrace:
    """The trace of a sampled message: ids chosen before its spans exist.

    ``parent_span_id``: the incoming span (0: a new trace); ``handle_span_id``: the id its
    ``handle`` span will get, named by the outbox row.
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
    """One ``user_activity.outbox`` row, produced as it is (never changed; not frozen: cheaper)."""

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
    """The headers an event inherits: a valid ``traceparent`` (``trace``: its ``handle`` span's)."""
    if trace is not None:
        return {TRACEPARENT: trace.traceparent}
    traceparent = record.header(TRACEPARENT)
    if traceparent is None:
        return {}
    valid = valid_traceparent(traceparent)
    if valid is None:
        return {}
    return {TRACEPARENT: valid}
