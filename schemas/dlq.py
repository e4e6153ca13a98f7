"""Dead-letter record headers and the stable reason codes (SPEC §2, §5).

A DLQ record carries the original key and value bytes unchanged and the original headers, plus
the headers below. Reason codes are part of the contract with on-call engineers: never rename.

A letter the DLQ topic cannot take whole (over its ``max.message.bytes``, or refused for what it
is) is sent reduced: marked ``x-dlq-truncated: true`` with ``x-original-size`` (the original
value's length in bytes), its value cut to what fits (or empty), and if that is still refused
without the original headers, then without the key. The full original stays on the source topic,
at the ``x-source-*`` coordinates.
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
