"""A dead letter: the original record, why it failed, its Kafka headers and its reduced forms.

Pure: :meth:`DeadLetter.render` builds the record of one :class:`LetterForm`; :func:`next_form`
picks the next, smaller one after the DLQ topic refused a form with a record error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import IntEnum

from schemas.dlq import (
    HEADER_ATTEMPTS,
    HEADER_EXCEPTION_TYPE,
    HEADER_FAILED_AT,
    HEADER_ORIGINAL_SIZE,
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_TRUNCATED,
    DlqReason,
)
from schemas.kafka_record import SourceRecord

PER_HEADER_OVERHEAD = 10
"""Bytes a header costs on the wire besides its name and value (varint lengths, generous)."""


class LetterForm(IntEnum):
    """How much of the original a letter carries, from whole to bare (each smaller)."""

    WHOLE = 0
    """Original key, value and headers, plus the ``x-dlq-*`` / ``x-source-*`` headers."""
    TRUNCATED = 1
    """Original key and headers; the value cut to fit (or empty); ``x-dlq-truncated``."""
    NO_ORIGINAL_HEADERS = 2
    """The original headers dropped too (the value cut to the room left)."""
    NO_KEY = 3
    """The key dropped too: only the ``x-dlq-*`` / ``x-source-*`` headers and a cut value."""
    BARE = 4
    """No key, no original headers, empty value: the last resort, always small."""


@dataclass(frozen=True, slots=True)
class LetterRecord:
    """What to send for one form of a letter."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def protocol_margin(limit: int) -> int:
    """Bytes kept free under ``limit`` for the record batch's framing and zstd's overhead."""
    return 1024 + limit // 256


def headers_size(headers: Sequence[tuple[str, bytes]]) -> int:
    """The wire size of ``headers``, generously estimated."""
    return sum(len(name.encode()) + len(value) + PER_HEADER_OVERHEAD for name, value in headers)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record to dead-letter, with a stable reason code and the failure's class name."""

    record: SourceRecord
    reason: DlqReason
    exception_type: str
    attempts: int
    failed_at: datetime
    ids: tuple[tuple[str, str], ...] = ()
    """Ids of a partly decodable envelope, for the dead-letter log line only (never sent)."""

    @classmethod
    def now(
        cls, record: SourceRecord, reason: DlqReason, exception_type: str, attempts: int = 1,
        ids: tuple[tuple[str, str], ...] = (),
    ) -> DeadLetter:
        """A dead letter failed at the current UTC time."""
        return cls(record, reason, exception_type, attempts, datetime.now(UTC), ids)

    def dlq_headers(self) -> list[tuple[str, bytes]]:
        """The ``x-dlq-*`` / ``x-source-*`` headers only."""
        return [
            (HEADER_REASON, self.reason.value.encode()),
            (HEADER_SOURCE_TOPIC, self.record.topic.encode()),
            (HEADER_SOURCE_PARTITION, str(self.record.partition).encode()),
            (HEADER_SOURCE_OFFSET, str(self.record.offset).encode()),
            (HEADER_EXCEPTION_TYPE, self.exception_type.encode()),
            (HEADER_ATTEMPTS, str(self.attempts).encode()),
            (HEADER_FAILED_AT, self.failed_at.isoformat().encode()),
        ]

    def headers(self) -> list[tuple[str, bytes]]:
        """The original headers followed by the ``x-dlq-*`` / ``x-source-*`` headers."""
        return [*self.record.headers, *self.dlq_headers()]

    @property
    def original_size(self) -> int:
        """The original value's length in bytes (0 for a tombstone)."""
        return len(self.record.value or b"")

    def render(self, form: LetterForm, limit: int) -> LetterRecord:
        """The record to send in ``form``, its value cut to fit a ``limit``-byte topic."""
        if form is LetterForm.WHOLE:
            return LetterRecord(self.record.key, self.record.value, self.headers())
        key = self.record.key if form <= LetterForm.NO_ORIGINAL_HEADERS else None
        headers = [
            *(self.record.headers if form is LetterForm.TRUNCATED else ()),
            *self.dlq_headers(),
            (HEADER_TRUNCATED, b"true"),
            (HEADER_ORIGINAL_SIZE, str(self.original_size).encode()),
        ]
        value = self.record.value
        if value is not None:
            room = 0 if form is LetterForm.BARE else value_room(limit, key, headers)
            value = value[:room]
        return LetterRecord(key, value, headers)


def value_room(limit: int, key: bytes | None, headers: Sequence[tuple[str, bytes]]) -> int:
    """How many value bytes fit beside ``key`` and ``headers`` under ``limit`` (never < 0)."""
    return max(0, limit - protocol_margin(limit) - len(key or b"") - headers_size(headers))


def estimated_size(record: LetterRecord) -> int:
    """The uncompressed wire size of ``record`` (key + value + headers, no batch framing)."""
    return len(record.key or b"") + len(record.value or b"") + headers_size(record.headers)


def next_form(letter: DeadLetter, refused: LetterForm, limit: int) -> LetterForm | None:
    """The form to send after ``refused`` was rejected with a record error; None after BARE.

    Forms that cannot fit under ``limit`` even with an empty value are skipped; BARE is always
    offered (the broker has the last word).
    """
    for form in LetterForm:
        if form <= refused:
            continue
        if form is LetterForm.BARE:
            return form
        if estimated_size(letter.render(form, limit)) <= limit - protocol_margin(limit):
            return form
    return None
