"""decode_sign_in: each sign-in record becomes a message, an invalid skip or a dead letter."""

from __future__ import annotations

import json
import pickle
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest

from dataflows.envelopes import EMPTY_GUID
from dataflows.session_linking.decode import (
    InvalidSignIn,
    SignInMessage,
    decode_sign_in,
    sign_in_fields,
)
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import SourceRecord

TOPIC = "pin.identity.user-signed-in.v1"
MESSAGE_ID = UUID("01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11")
ANONYMOUS_ID = UUID("0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0")
USER_ID = UUID("7c9e6679-7425-40de-944b-e07fc1f90ae7")


def sign_in_value(**overrides: Any) -> dict[str, Any]:
    """A valid user-signed-in envelope; ``Payload__X`` overrides a payload field."""
    payload: dict[str, Any] = {
        "UserId": str(USER_ID),
        "AnonymousId": str(ANONYMOUS_ID).upper(),
        "SignedInAt": "2026-11-29T11:00:00.1234567+03:00",
    }
    envelope: dict[str, Any] = {
        "MessageId": str(MESSAGE_ID),
        "CreatedAt": "2026-11-29T08:00:00.123+00:00",
        "Version": 1,
        "AggregateId": str(USER_ID),
        "AggregateType": "User",
        "CorrelationId": "corr-1",
        "Payload": payload,
    }
    for name, value in overrides.items():
        if name.startswith("Payload__"):
            payload[name.removeprefix("Payload__")] = value
        else:
            envelope[name] = value
    return envelope


def record(value: bytes | None) -> SourceRecord:
    return SourceRecord(TOPIC, 2, 41, str(USER_ID).encode(), value)


def decode(envelope: dict[str, Any]) -> Any:
    return decode_sign_in(record(json.dumps(envelope).encode()))


def test_a_valid_sign_in_decodes_to_a_message_keyed_by_its_device() -> None:
    decoded = decode(sign_in_value(Payload__IpAddress="10.0.0.1", Unknown=1))

    assert isinstance(decoded, SignInMessage)
    assert (decoded.message_id, decoded.user_id, decoded.anonymous_id) == (
        MESSAGE_ID, USER_ID, ANONYMOUS_ID,
    )
    assert decoded.idempotency_key == f"user-activity-signed-in:{MESSAGE_ID}"
    assert decoded.dedup_id == MESSAGE_ID.bytes
    assert not decoded.version_mismatch


def test_another_contract_version_is_decoded_and_flagged() -> None:
    decoded = decode(sign_in_value(Version=2))

    assert isinstance(decoded, SignInMessage)
    assert decoded.version_mismatch


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, DlqReason.TOMBSTONE),
        (b"\xff\xfe", DlqReason.NOT_UTF8),
        (b"{not json", DlqReason.INVALID_JSON),
        (json.dumps(sign_in_value(Payload__AnonymousId=None)).encode(), DlqReason.SCHEMA_MISMATCH),
        (json.dumps(sign_in_value(Payload__UserId="nope")).encode(), DlqReason.SCHEMA_MISMATCH),
        (json.dumps(sign_in_value(Payload__SignedInAt="2026-11-29T11:00:00")).encode(),
         DlqReason.SCHEMA_MISMATCH),
        (json.dumps({"MessageId": str(MESSAGE_ID)}).encode(), DlqReason.SCHEMA_MISMATCH),
        # a valid local time that is no moment of years 1-9999 in UTC (1 BC; year 10000)
        (json.dumps(sign_in_value(Payload__SignedInAt="0001-01-01T00:00:00+03:00")).encode(),
         DlqReason.SCHEMA_MISMATCH),
        (json.dumps(sign_in_value(Payload__SignedInAt="9999-12-31T23:59:59-03:00")).encode(),
         DlqReason.SCHEMA_MISMATCH),
        # an offset no .NET DateTimeOffset holds (session-linked would carry it to CRM)
        (json.dumps(sign_in_value(Payload__SignedInAt="2026-11-29T11:00:00+15:00")).encode(),
         DlqReason.SCHEMA_MISMATCH),
    ],
)
def test_undecodable_records_become_dead_letters_with_a_reason(
    value: bytes | None, reason: DlqReason
) -> None:
    decoded = decode_sign_in(record(value))

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is reason
    assert decoded.record.value == value


@pytest.mark.parametrize("signed_in_at", ["0001-01-01T00:00:00Z", "0001-01-01T03:00:00+03:00",
                                          "9999-12-31T23:59:59.999999Z"])
def test_a_sign_in_at_the_ends_of_the_utc_range_decodes(signed_in_at: str) -> None:
    decoded = decode(sign_in_value(Payload__SignedInAt=signed_in_at))

    assert isinstance(decoded, SignInMessage)
    assert decoded.signed_in_at == datetime.fromisoformat(signed_in_at)


@pytest.mark.parametrize("field", ["CreatedAt", "Payload__SignedInAt"])
@pytest.mark.parametrize("text", ["1733356800", "1733356800000", "1733356800.5", "-1", "20241205",
                                  "1.0e-5"])
def test_a_timestamp_written_as_unix_time_is_dead_lettered_as_a_schema_mismatch(
    field: str, text: str,
) -> None:
    decoded = decode(sign_in_value(**{field: text}))

    assert isinstance(decoded, DeadLetter)
    assert decoded.reason is DlqReason.SCHEMA_MISMATCH


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-29T11:00:00.1234567+03:00", "2026-11-29T11:00:00.123456+03:00"),  # truncated
        ("2026-11-29T11:00:00+03:00", "2026-11-29T11:00:00+03:00"),
        ("2026-11-29T08:00:00Z", "2026-11-29T08:00:00+00:00"),
    ],
)
def test_a_dotnet_signed_in_at_decodes_with_its_offset(text: str, expected: str) -> None:
    decoded = decode(sign_in_value(CreatedAt=text, Payload__SignedInAt=text))

    assert isinstance(decoded, SignInMessage)
    assert decoded.signed_in_at.isoformat() == expected
    assert decoded.envelope.created_at.isoformat() == expected


@pytest.mark.parametrize("field", ["MessageId", "Payload__UserId", "Payload__AnonymousId"])
def test_an_empty_guid_is_an_invalid_sign_in_not_a_dead_letter(field: str) -> None:
    decoded = decode(sign_in_value(**{field: str(EMPTY_GUID)}))

    assert isinstance(decoded, InvalidSignIn)


def test_log_fields_are_ids_and_the_source_only() -> None:
    decoded = decode(sign_in_value(Payload__UserAgent="Mozilla/5.0"))
    assert isinstance(decoded, SignInMessage)

    fields = sign_in_fields(decoded)

    assert fields == {
        "MessageId": str(MESSAGE_ID),
        "AnonymousId": str(ANONYMOUS_ID),
        "UserId": str(USER_ID),
        "source": f"{TOPIC}[2]@41",
    }


# ---- a SignedInAt in the future ---------------------------------------------------------------

SIGNED_IN_AT = datetime(2026, 11, 29, 8, 0, 0, 123456, tzinfo=UTC)  # the envelope's, in UTC


def _read(at: datetime, skew_seconds: float = 60.0) -> SignInMessage:
    message = decode_sign_in(record(json.dumps(sign_in_value()).encode()), at,
                             timedelta(seconds=skew_seconds))
    assert isinstance(message, SignInMessage)
    return message


def test_a_sign_in_within_the_skew_or_in_the_past_keeps_its_signed_in_at() -> None:
    assert _read(SIGNED_IN_AT + timedelta(hours=5)).signed_in_at == SIGNED_IN_AT
    assert _read(SIGNED_IN_AT - timedelta(seconds=59)).signed_in_at == SIGNED_IN_AT
    assert _read(SIGNED_IN_AT - timedelta(seconds=59)).adjusted_at is None
    assert decode(sign_in_value()).adjusted_at is None  # no clock given: never adjusted


def test_a_sign_in_beyond_the_skew_is_taken_as_read_when_the_job_read_it() -> None:
    # +03:00 written as Z: three hours ahead of the job's clock.
    now = SIGNED_IN_AT - timedelta(hours=3)

    message = _read(now)

    assert message.adjusted_at == now and message.signed_in_at == now
    assert message.envelope.payload.signed_in_at == SIGNED_IN_AT  # the claim is kept for logs


def test_an_adjusted_sign_in_survives_a_snapshot_and_one_from_an_older_snapshot_reads_back(
) -> None:
    now = SIGNED_IN_AT - timedelta(hours=3)
    message = _read(now)

    assert pickle.loads(pickle.dumps(message)).signed_in_at == now
    older = SignInMessage.__new__(SignInMessage)  # the state an earlier release pickled
    older.__setstate__([message.record, message.envelope, None])  # type: ignore[attr-defined]
    assert older.signed_in_at == SIGNED_IN_AT
