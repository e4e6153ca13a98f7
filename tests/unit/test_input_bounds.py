"""Input bounds (docs/spec.md): what an input record can push into what we emit.

A ``CorrelationId`` over 256 characters is a contract violation (``schema-mismatch``) on both
flows and on both decode paths; an invalid or oversized ``traceparent`` is dropped and the
message processed; ``tracestate`` is never copied; an emitted value stays under 2.2 KB.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.linking import (
    SessionChange,
    SessionEventKind,
    SessionTopics,
    build_session_event,
)
from devenv.harness.sessions import LINKED_LONG_AGO
from schemas import MAX_CORRELATION_ID_LENGTH
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionTrackedEnvelope, ActionType
from schemas.kafka_record import SourceRecord
from schemas.outbox import (
    MAX_TRACEPARENT_INPUT_LENGTH,
    TRACEPARENT,
    TRACEPARENT_LENGTH,
    propagated_headers,
    valid_traceparent,
)
from schemas.sessions import SessionLinkedEnvelope
from tests.rows import SessionSnapshot, build_recorded_action

ADDED = "pin.favorites.favorite-added.v1"
SIGNED_IN = "pin.identity.user-signed-in.v1"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES}
MESSAGE_ID = UUID("01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11")
FAVORITE_ID = UUID("5d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
ANONYMOUS_ID = UUID("0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0")
USER_ID = UUID("7c9e6679-7425-40de-944b-e07fc1f90ae7")
SESSION_ID = UUID("3e4d5c6b-7a89-4b0c-8d1e-2f3a4b5c6d7e")
EVENT_ID = UUID("01938a4e-7c1a-7cc3-9a55-000000000001")
OUTBOX_ID = UUID("01938a4e-7c1a-7cc3-9a55-000000000002")
NOW = datetime(2026, 11, 29, 8, 0, 5, 123456, tzinfo=UTC)
TOPICS = SessionTopics("linked", "started", "ended")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
GOOD = f"00-{TRACE_ID}-{PARENT_ID}-01"
V00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def favorite(correlation_id: Any = "corr-1", *, slow_path: bool = False) -> dict[str, Any]:
    """A valid guest like; ``slow_path``: a braced MessageId, which only pydantic decodes."""
    message_id = "{" + str(MESSAGE_ID) + "}" if slow_path else str(MESSAGE_ID)
    return {
        "MessageId": message_id,
        "CreatedAt": "2026-11-29T08:00:00.123+00:00",
        "Version": 1,
        "AggregateId": str(FAVORITE_ID),
        "AggregateType": "Favorite",
        "CorrelationId": correlation_id,
        "Payload": {
            "FavoriteId": str(FAVORITE_ID),
            "PropertyObjectId": "a1b2c3d4-e5f6-4789-abcd-ef0123456789",
            "UserId": None,
            "AnonymousId": str(ANONYMOUS_ID),
            "OccurredAt": "2026-11-29T11:00:00.1234567+03:00",
        },
    }


def sign_in(correlation_id: Any = "corr-1") -> dict[str, Any]:
    return {
        "MessageId": str(MESSAGE_ID),
        "CreatedAt": "2026-11-29T08:00:00.123+00:00",
        "Version": 1,
        "AggregateId": str(USER_ID),
        "AggregateType": "User",
        "CorrelationId": correlation_id,
        "Payload": {
            "UserId": str(USER_ID),
            "AnonymousId": str(ANONYMOUS_ID),
            "SignedInAt": "2026-11-29T11:00:00+03:00",
        },
    }


def source(value: dict[str, Any], topic: str = ADDED,
           headers: tuple[tuple[str, bytes], ...] = ()) -> SourceRecord:
    return SourceRecord(topic, 1, 7, b"key", json.dumps(value, ensure_ascii=False).encode(),
                        headers)


def decoded_favorite(record: SourceRecord) -> FavoriteMessage:
    message = decode_favorite(record, ACTION_TYPES)
    assert isinstance(message, FavoriteMessage), message
    return message


def action_tracked(message: FavoriteMessage) -> Any:
    return build_recorded_action(
        message, SessionSnapshot(SESSION_ID, ANONYMOUS_ID, USER_ID, LINKED_LONG_AGO),
        action_event_id=EVENT_ID, outbox_message_id=OUTBOX_ID, topic="tracked", now=NOW,
    ).outbox


def session_linked(message: SignInMessage) -> Any:
    change = SessionChange(SessionEventKind.LINKED, SESSION_ID, ANONYMOUS_ID, USER_ID, NOW)
    return build_session_event(change, message, message_id=OUTBOX_ID, topics=TOPICS, now=NOW)


# ---- OccurredAt ------------------------------------------------------------------------------

EDGE_MOMENTS = ["0001-01-01T00:00:00Z", "0001-01-01T03:00:00+03:00", "9999-12-31T23:59:59.999999Z",
                "9999-12-31T20:59:59-03:00", "2026-11-29T11:00:00+14:00",
                "2026-11-29T11:00:00-14:00", "2026-11-29T11:00:00+05:45"]
"""Moments at the ends of years 1-9999 in UTC, and at the ends of .NET's offsets."""
NO_MOMENTS = ["0001-01-01T00:00:00+03:00", "0001-01-01T00:00:00+14:00",
              "9999-12-31T23:59:59.9999999-14:00", "9999-12-31T23:59:59-00:01",
              "2026-11-29T11:00:00+14:01", "2026-11-29T11:00:00-14:30",
              "2026-11-29T11:00:00.1234567+15:00", "2026-11-29T11:00:00+23:59"]
"""Valid local times that are no moment of years 1-9999 in UTC (1 BC, year 10000), or whose
offset a .NET DateTimeOffset cannot hold (more than 14 hours: both paths accepted +15:00 to
+23:59, and action-tracked carried it to a consumer that cannot parse it)."""


def _occurred_at(text: str, *, slow_path: bool) -> dict[str, Any]:
    value = favorite(slow_path=slow_path)
    value["Payload"]["OccurredAt"] = text
    return value


@pytest.mark.parametrize("slow_path", [False, True], ids=["msgspec", "pydantic"])
@pytest.mark.parametrize("text", EDGE_MOMENTS)
def test_a_favorite_at_the_ends_of_the_utc_years_is_recorded_and_announced_with_its_offset(
    text: str, slow_path: bool
) -> None:
    message = decoded_favorite(source(_occurred_at(text, slow_path=slow_path)))

    assert message.envelope.payload.occurred_at == datetime.fromisoformat(text)
    tracked = ActionTrackedEnvelope.model_validate_json(action_tracked(message).value)
    assert tracked.payload.occurred_at == datetime.fromisoformat(text)


@pytest.mark.parametrize("slow_path", [False, True], ids=["msgspec", "pydantic"])
@pytest.mark.parametrize("text", NO_MOMENTS)
def test_a_favorite_at_no_moment_of_the_utc_years_is_dead_lettered_as_schema_mismatch(
    text: str, slow_path: bool
) -> None:
    # Stored, it made the owner's whole history unreadable (psycopg, .NET), and a .NET consumer
    # cannot parse an event that carries it.
    record = source(_occurred_at(text, slow_path=slow_path))

    letter = decode_favorite(record, ACTION_TYPES)

    assert isinstance(letter, DeadLetter)
    assert (letter.reason, letter.exception_type) == (DlqReason.SCHEMA_MISMATCH, "ValidationError")


# ---- CorrelationId ---------------------------------------------------------------------------

BOUND_TEXTS = ["c", "é", "\U0001f600", "\x00", '"']
"""One, two and four UTF-8 bytes per character, and characters JSON escapes."""


@pytest.mark.parametrize("slow_path", [False, True], ids=["msgspec", "pydantic"])
@pytest.mark.parametrize("char", BOUND_TEXTS)
def test_a_favorite_with_a_correlation_id_of_exactly_256_characters_is_recorded_with_it(
    char: str, slow_path: bool
) -> None:
    correlation_id = char * MAX_CORRELATION_ID_LENGTH

    message = decoded_favorite(source(favorite(correlation_id, slow_path=slow_path)))

    assert message.envelope.correlation_id == correlation_id
    tracked = ActionTrackedEnvelope.model_validate_json(action_tracked(message).value)
    assert tracked.correlation_id == correlation_id


@pytest.mark.parametrize("slow_path", [False, True], ids=["msgspec", "pydantic"])
@pytest.mark.parametrize(
    "correlation_id",
    [*(c * (MAX_CORRELATION_ID_LENGTH + 1) for c in BOUND_TEXTS), "x" * 1_000_000],
    ids=[*(f"257x{c!r}" for c in BOUND_TEXTS), "1MB"],
)
def test_a_favorite_with_a_longer_correlation_id_is_dead_lettered_as_schema_mismatch(
    correlation_id: str, slow_path: bool
) -> None:
    record = source(favorite(correlation_id, slow_path=slow_path))

    letter = decode_favorite(record, ACTION_TYPES)

    assert isinstance(letter, DeadLetter)
    assert (letter.reason, letter.exception_type) == (DlqReason.SCHEMA_MISMATCH, "ValidationError")
    assert letter.record is record


def test_a_sign_in_with_a_correlation_id_of_exactly_256_characters_is_linked_with_it() -> None:
    correlation_id = "\U0001f600" * MAX_CORRELATION_ID_LENGTH

    message = decode_sign_in(source(sign_in(correlation_id), SIGNED_IN))

    assert isinstance(message, SignInMessage)
    linked = SessionLinkedEnvelope.model_validate_json(session_linked(message).value)
    assert linked.correlation_id == correlation_id


@pytest.mark.parametrize("length", [MAX_CORRELATION_ID_LENGTH + 1, 900_000])
def test_a_sign_in_with_a_longer_correlation_id_is_dead_lettered_as_schema_mismatch(
    length: int,
) -> None:
    letter = decode_sign_in(source(sign_in("x" * length), SIGNED_IN))

    assert isinstance(letter, DeadLetter)
    assert letter.reason is DlqReason.SCHEMA_MISMATCH


def test_an_emitted_value_stays_under_2_2_kb_and_its_headers_under_56_bytes() -> None:
    worst = "\x00" * MAX_CORRELATION_ID_LENGTH  # each written as \u0000: 6 bytes
    future = ("7f" + GOOD[2:] + "-" + "z" * 400).encode()
    favorite_message = decoded_favorite(source(favorite(worst), headers=(
        (TRACEPARENT, future), ("tracestate", b"a=" + b"b" * 250), ("other", b"x" * 10_000),
    )))
    sign_in_message = decode_sign_in(source(sign_in(worst), SIGNED_IN, headers=(
        (TRACEPARENT, future),
    )))
    assert isinstance(sign_in_message, SignInMessage)

    rows = [action_tracked(favorite_message), session_linked(sign_in_message)]

    for row in rows:
        assert len(row.value) <= 2_200, len(row.value)
        assert row.headers == {TRACEPARENT: GOOD}
        assert sum(len(k) + len(v) for k, v in row.headers.items()) <= len(TRACEPARENT) + 55


# ---- traceparent -----------------------------------------------------------------------------

VALID = {
    "version 00": (GOOD, GOOD),
    "not sampled": (f"00-{TRACE_ID}-{PARENT_ID}-00", f"00-{TRACE_ID}-{PARENT_ID}-00"),
    "a future version, exactly 55": ("cc" + GOOD[2:], GOOD),
    "a future version with more fields": ("01" + GOOD[2:] + "-what-comes-next", GOOD),
    "a future version at the input bound": (
        "fe" + GOOD[2:] + "-" + "x" * (MAX_TRACEPARENT_INPUT_LENGTH - 56), GOOD),
}
INVALID: dict[str, bytes] = {
    "empty": b"",
    "too short": GOOD[:-1].encode(),
    "version 00 with more": (GOOD + "-01").encode(),
    "version 00, trailing newline": (GOOD + "\n").encode(),
    "version ff": ("ff" + GOOD[2:]).encode(),
    "upper-case hex": GOOD.upper().encode(),
    "upper-case version": ("0A" + GOOD[2:]).encode(),
    "all-zero trace-id": f"00-{'0' * 32}-{PARENT_ID}-01".encode(),
    "all-zero parent-id": f"00-{TRACE_ID}-{'0' * 16}-01".encode(),
    "not hex": GOOD.replace("4bf9", "4bg9").encode(),
    "wrong separators": GOOD.replace("-", "_").encode(),
    "a NUL inside": GOOD.replace("a6a3", "a\x00a3").encode(),
    "not UTF-8": b"\xff\xfe" + GOOD[2:].encode(),
    "UTF-8, not ASCII": GOOD.replace("4bf9", "4bé").encode(),
    "the old test value": b"00-abc-def-01",
    "a future version, no dash after 55": ("01" + GOOD[2:] + "x").encode(),
    "a future version over the input bound": (
        "fe" + GOOD[2:] + "-" + "x" * (MAX_TRACEPARENT_INPUT_LENGTH - 55)).encode(),
    "300 KB": ("01" + GOOD[2:] + "-" + "x" * 300_000).encode(),
}


@pytest.mark.parametrize(("given", "passed"), VALID.values(), ids=list(VALID))
def test_a_valid_traceparent_is_passed_on_as_version_00(given: str, passed: str) -> None:
    message = decoded_favorite(source(favorite(), headers=((TRACEPARENT, given.encode()),)))

    assert action_tracked(message).headers == {TRACEPARENT: passed}


@pytest.mark.parametrize("traceparent", INVALID.values(), ids=list(INVALID))
def test_an_invalid_traceparent_is_dropped_and_the_favorite_is_recorded(
    traceparent: bytes,
) -> None:
    record = source(favorite(), headers=((TRACEPARENT, traceparent),))

    message = decoded_favorite(record)
    row = action_tracked(message)

    assert row.headers == {}
    assert ActionTrackedEnvelope.model_validate_json(row.value).correlation_id == "corr-1"


@pytest.mark.parametrize("traceparent", INVALID.values(), ids=list(INVALID))
def test_an_invalid_traceparent_is_dropped_and_the_sign_in_is_linked(traceparent: bytes) -> None:
    message = decode_sign_in(source(sign_in(), SIGNED_IN, headers=((TRACEPARENT, traceparent),)))

    assert isinstance(message, SignInMessage)
    assert session_linked(message).headers == {}


def test_tracestate_and_other_headers_are_never_passed_on() -> None:
    record = source(favorite(), headers=(
        ("tracestate", b"congo=t61rcWkgMzE"), ("baggage", b"k=v"), (TRACEPARENT, GOOD.encode()),
    ))

    assert propagated_headers(record) == {TRACEPARENT: GOOD}


def test_the_last_traceparent_header_decides() -> None:
    first_good = source(favorite(), headers=((TRACEPARENT, GOOD.encode()), (TRACEPARENT, b"x")))
    last_good = source(favorite(), headers=((TRACEPARENT, b"x"), (TRACEPARENT, GOOD.encode())))

    assert propagated_headers(first_good) == {}
    assert propagated_headers(last_good) == {TRACEPARENT: GOOD}


@settings(max_examples=500, deadline=None)
@given(value=st.one_of(
    st.binary(max_size=600),
    st.builds(lambda v, t, p, f, rest: f"{v}-{t}-{p}-{f}{rest}".encode(),
              st.text("0123456789abcdefABCDEF", min_size=2, max_size=2),
              st.text("0123456789abcdef", min_size=31, max_size=33),
              st.text("0123456789abcdef", min_size=15, max_size=17),
              st.text("0123456789abcdef", min_size=2, max_size=2),
              st.sampled_from(["", "-", "-x", "x", "\n"])),
))
def test_any_header_value_is_either_dropped_or_passed_on_as_a_valid_version_00(
    value: bytes,
) -> None:
    passed = valid_traceparent(value)

    if passed is not None:
        assert V00.fullmatch(passed) and len(passed) == TRACEPARENT_LENGTH
        assert passed[3:35] != "0" * 32 and passed[36:52] != "0" * 16
        assert passed[2:] == value[2:TRACEPARENT_LENGTH].decode()
        assert value[:2] != b"ff"
