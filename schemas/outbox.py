"""The outbox row every flow writes, and the headers it carries over from the source record."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from schemas.kafka_record import SourceRecord

TRACEPARENT = "traceparent"
"""The W3C trace-context header, passed through from the source record to what we emit."""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One ``user_activity.outbox`` row: the event's MessageId, topic, key, value, headers.

    The publisher produces a row as it is (``sinks.kafka_producer.Producible``: ``topic``,
    ``key``, ``value``, ``headers``; the headers dict is sent with its str values UTF-8 encoded).
    """

    id: UUID
    topic: str
    key: bytes
    value: bytes
    headers: dict[str, str]


def propagated_headers(record: SourceRecord) -> dict[str, str]:
    """The headers an event inherits from the record that caused it (``traceparent``)."""
    traceparent = record.header(TRACEPARENT)
    if traceparent is None:
        return {}
    return {TRACEPARENT: traceparent.decode("ascii", "replace")}
