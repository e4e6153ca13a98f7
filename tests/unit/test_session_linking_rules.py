"""LinkOnce decisions and the session events they announce (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from uuid import UUID

import pytest

from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.linking import (
    ActiveSession,
    LinkOutcome,
    SessionChange,
    SessionEventKind,
    SessionTopics,
    build_session_event,
    decide,
    session_payload,
)
from schemas.kafka_record import SourceRecord
from schemas.sessions import SessionEndedEnvelope, SessionLinkedEnvelope, SessionStartedEnvelope

SESSION_ID = UUID("01938a4e-0000-7000-8000-000000000001")
EVENT_ID = UUID("01938a4e-0000-7000-8000-0000000000e1")
ANONYMOUS_ID = UUID("0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0")
USER_ID = UUID("7c9e6679-7425-40de-944b-e07fc1f90ae7")
OTHER_USER_ID = UUID("11111111-2222-4333-8444-555555555555")
TOPICS = SessionTopics("linked.v1", "started.v1", "ended.v1")
NOW = datetime(2026, 11, 29, 8, 0, 1, 500_000, tzinfo=UTC)
AT = datetime(2026, 11, 29, 11, 0, 0, 123_456, tzinfo=timezone(timedelta(hours=3)))
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def sign_in(*, traceparent: bool = True, correlation_id: str | None = "corr-9") -> SignInMessage:
    value = json.dumps({
        "MessageId": "01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11",
        "CreatedAt": "2026-11-29T08:00:00.123+00:00",
        "Version": 1,
        "AggregateId": str(USER_ID),
        "AggregateType": "User",
        "CorrelationId": correlation_id,
        "Payload": {"UserId": str(USER_ID), "AnonymousId": str(ANONYMOUS_ID),
                    "SignedInAt": "2026-11-29T11:00:00+03:00"},
    }).encode()
    headers = (("traceparent", TRACEPARENT),) if traceparent else ()
    decoded = decode_sign_in(SourceRecord("in", 0, 7, None, value, headers))
    assert isinstance(decoded, SignInMessage)
    return decoded


@pytest.mark.parametrize(
    ("active", "outcome"),
    [
        (None, LinkOutcome.STARTED),
        (ActiveSession(SESSION_ID, None), LinkOutcome.LINKED),
        (ActiveSession(SESSION_ID, USER_ID), LinkOutcome.ALREADY_LINKED),
        (ActiveSession(SESSION_ID, OTHER_USER_ID), LinkOutcome.RELINKED),
    ],
)
def test_a_sign_in_is_decided_on_the_devices_active_session(
    active: ActiveSession | None, outcome: LinkOutcome
) -> None:
    assert decide(active, USER_ID) is outcome


def test_session_linked_carries_exactly_the_seed_payload_keyed_by_the_session() -> None:
    change = SessionChange(SessionEventKind.LINKED, SESSION_ID, ANONYMOUS_ID, USER_ID, AT)

    row = build_session_event(change, sign_in(), message_id=EVENT_ID, topics=TOPICS, now=NOW)

    assert (row.id, row.topic, row.key) == (EVENT_ID, "linked.v1", str(SESSION_ID).encode())
    assert row.headers == {"traceparent": TRACEPARENT.decode()}
    value = json.loads(row.value)
    assert set(value["Payload"]) == {"SessionId", "AnonymousId", "UserId", "LinkedAt"}
    envelope = SessionLinkedEnvelope.model_validate_json(row.value)
    assert envelope.message_id == EVENT_ID
    assert envelope.created_at == NOW
    assert (envelope.version, envelope.aggregate_id, envelope.aggregate_type) == (
        1, str(SESSION_ID), "Session",
    )
    assert envelope.correlation_id == "corr-9"
    payload = envelope.payload
    assert (payload.session_id, payload.anonymous_id, payload.user_id) == (
        SESSION_ID, ANONYMOUS_ID, USER_ID,
    )
    assert payload.linked_at == AT
    assert value["Payload"]["LinkedAt"].endswith("+00:00")


def test_session_started_and_ended_are_minimal_and_go_to_their_topics() -> None:
    started = SessionChange(SessionEventKind.STARTED, SESSION_ID, ANONYMOUS_ID, USER_ID, AT)
    ended = SessionChange(SessionEventKind.ENDED, EVENT_ID, ANONYMOUS_ID, OTHER_USER_ID, AT)
    message = sign_in(traceparent=False, correlation_id=None)

    started_row = build_session_event(started, message, message_id=EVENT_ID, topics=TOPICS,
                                      now=NOW)
    ended_row = build_session_event(ended, message, message_id=SESSION_ID, topics=TOPICS, now=NOW)

    assert (started_row.topic, ended_row.topic) == ("started.v1", "ended.v1")
    assert started_row.headers == ended_row.headers == {}
    assert set(json.loads(started_row.value)["Payload"]) == {
        "SessionId", "AnonymousId", "UserId", "StartedAt",
    }
    assert set(json.loads(ended_row.value)["Payload"]) == {
        "SessionId", "AnonymousId", "UserId", "EndedAt",
    }
    assert SessionStartedEnvelope.model_validate_json(started_row.value).payload.started_at == AT
    ended_envelope = SessionEndedEnvelope.model_validate_json(ended_row.value)
    assert ended_envelope.payload.user_id == OTHER_USER_ID
    assert ended_envelope.aggregate_id == str(EVENT_ID)
    assert ended_envelope.correlation_id is None


def test_payload_timestamps_are_written_in_utc() -> None:
    change = SessionChange(SessionEventKind.ENDED, SESSION_ID, ANONYMOUS_ID, None, AT)

    payload = session_payload(change)

    assert payload["EndedAt"] == "2026-11-29T08:00:00.123456+00:00"
    assert payload["UserId"] is None
