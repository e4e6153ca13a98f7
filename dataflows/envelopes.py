"""Parse a record's value into an envelope model, or say why it is poison (pure, never raises)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar
from uuid import UUID

import orjson
from pydantic import BaseModel, ValidationError

from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import SourceRecord

EMPTY_GUID = UUID(int=0)  # Guid.Empty: never a valid id

E = TypeVar("E", bound=BaseModel)


_ID_MAX_LENGTH = 64  # longer "ids" are not ids: never logged


def partial_ids(value: bytes, payload_ids: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``MessageId`` and the ``payload_ids`` of a JSON envelope that failed the contract.

    Only string values of at most 64 characters of exactly these keys, so no payload text is
    ever logged; anything unreadable yields nothing.
    """
    try:
        document = orjson.loads(value)
    except orjson.JSONDecodeError:
        return ()
    if not isinstance(document, dict):
        return ()
    payload = document.get("Payload")
    sources = [("MessageId", document)]
    if isinstance(payload, dict):
        sources += [(name, payload) for name in payload_ids]
    return tuple((name, text) for name, source in sources
                 if isinstance(text := source.get(name), str) and len(text) <= _ID_MAX_LENGTH)


def parse_envelope(record: SourceRecord, model: type[E],
                   payload_ids: Sequence[str] = ()) -> E | DeadLetter:
    """``record.value`` validated as ``model``, or a dead letter with a stable reason code.

    Null -> ``tombstone``; not UTF-8 -> ``not-utf8``; not JSON -> ``invalid-json``; not the
    contract (bounds included) -> ``schema-mismatch``, carrying the ids that could be read.
    """
    if record.value is None:
        return DeadLetter.now(record, DlqReason.TOMBSTONE, "NoneType")
    try:
        record.value.decode("utf-8")
    except UnicodeDecodeError:
        return DeadLetter.now(record, DlqReason.NOT_UTF8, "UnicodeDecodeError")
    try:
        return model.model_validate_json(record.value)
    except ValidationError as exc:
        invalid_json = any(err["type"] == "json_invalid" for err in exc.errors())
        reason = DlqReason.INVALID_JSON if invalid_json else DlqReason.SCHEMA_MISMATCH
        ids = partial_ids(record.value, payload_ids) if reason is DlqReason.SCHEMA_MISMATCH else ()
        return DeadLetter.now(record, reason, "ValidationError", ids=ids)
