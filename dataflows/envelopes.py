"""Parse a record's value into an envelope model, or say why it is poison (pure, never raises).

Shared by every flow: null value -> ``tombstone``; not UTF-8 -> ``not-utf8``; not JSON ->
``invalid-json``; JSON that does not fit the contract -> ``schema-mismatch``, a field over its
bound included (the contract models carry the bounds: the input-bounds table in :mod:`schemas`).
"""

from __future__ import annotations

from typing import TypeVar
from uuid import UUID

from pydantic import BaseModel, ValidationError

from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import SourceRecord

EMPTY_GUID = UUID(int=0)
"""``Guid.Empty``: never a valid id."""

E = TypeVar("E", bound=BaseModel)


def parse_envelope(record: SourceRecord, model: type[E]) -> E | DeadLetter:
    """``record.value`` validated as ``model``, or a dead letter with a stable reason code."""
    if record.value is None:
        return DeadLetter.now(record, DlqReason.TOMBSTONE, "NoneType")
    try:
        record.value.decode("utf-8")
    except UnicodeDecodeError:
        return DeadLetter.now(record, DlqReason.NOT_UTF8, "UnicodeDecodeError")
    try:
        return model.model_validate_json(record.value)
    except ValidationError as exc:
        reason = (
            DlqReason.INVALID_JSON
            if any(err["type"] == "json_invalid" for err in exc.errors())
            else DlqReason.SCHEMA_MISMATCH
        )
        return DeadLetter.now(record, reason, "ValidationError")
