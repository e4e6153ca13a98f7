"""Dead-letter record headers and the stable reason codes (SPEC §2, §5).

A DLQ record carries the original key, value and headers unchanged, plus the headers below.
A letter the DLQ topic refuses whole is sent reduced (``x-dlq-truncated``, ``x-original-size``,
the value cut to fit, then without the original headers, then without the key); the original
stays on the source topic at the ``x-source-*`` coordinates. Reason codes: never renamed.
"""

from __future__ import annotations

from enum import StrEnum

HEADER_REASON = "x-dlq-reason"
HEADER_SOURCE_TOPIC = "x-source-topic"
HEADER_SOURCE_PARTITION = "x-source-partition"
HEADER_SOURCE_OFFSET = "x-source-offset"
HEADER_EXCEPTION_TYPE = "x-exception-type"
HEADER_ATTEMPTS = "x-attempts"
HEADER_FAILED_AT = "x-failed-at"
HEADER_TRUNCATED = "x-dlq-truncated"
"""``true`` on a reduced letter: the value is cut (or empty), maybe the key/headers dropped."""
HEADER_ORIGINAL_SIZE = "x-original-size"
"""On a reduced letter: the original value's length in bytes (decimal)."""

DLQ_HEADERS = (
    HEADER_REASON,
    HEADER_SOURCE_TOPIC,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_OFFSET,
    HEADER_EXCEPTION_TYPE,
    HEADER_ATTEMPTS,
    HEADER_FAILED_AT,
)


class DlqReason(StrEnum):
    """Why a record was dead-lettered."""

    TOMBSTONE = "tombstone"
    """The value is null (a Kafka tombstone): there is no event to record."""
    NOT_UTF8 = "not-utf8"
    """The value bytes are not UTF-8."""
    INVALID_JSON = "invalid-json"
    """The value is UTF-8 but not a JSON document."""
    SCHEMA_MISMATCH = "schema-mismatch"
    """The JSON does not fit the envelope/payload contract (missing field, wrong type)."""
    DATA_ERROR = "data-error"
    """PostgreSQL rejected the message's data (SQLSTATE class 22 or 23, not the dedup race)."""
    PROCESSING_ERROR = "processing-error"
    """An unexpected exception for this one message, after the immediate attempts."""
