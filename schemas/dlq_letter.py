"""A dead letter: the original record plus why it failed, and its Kafka headers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from schemas.dlq import (
    HEADER_ATTEMPTS,
    HEADER_EXCEPTION_TYPE,
    HEADER_FAILED_AT,
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    DlqReason,
)
from schemas.kafka_record import SourceRecord


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record to dead-letter, with a stable reason code and the failure's class name."""

    record: SourceRecord
    reason: DlqReason
    exception_type: str
    attempts: int
    failed_at: datetime

    @classmethod
    def now(
        cls, record: SourceRecord, reason: DlqReason, exception_type: str, attempts: int = 1
    ) -> DeadLetter:
        """A dead letter failed at the current UTC time."""
        return cls(record, reason, exception_type, attempts, datetime.now(UTC))

    def headers(self) -> list[tuple[str, bytes]]:
        """The original headers followed by the ``x-dlq-*`` / ``x-source-*`` headers."""
        return [
            *self.record.headers,
            (HEADER_REASON, self.reason.value.encode()),
            (HEADER_SOURCE_TOPIC, self.record.topic.encode()),
            (HEADER_SOURCE_PARTITION, str(self.record.partition).encode()),
            (HEADER_SOURCE_OFFSET, str(self.record.offset).encode()),
            (HEADER_EXCEPTION_TYPE, self.exception_type.encode()),
            (HEADER_ATTEMPTS, str(self.attempts).encode()),
            (HEADER_FAILED_AT, self.failed_at.isoformat().encode()),
        ]
