"""build_recorded_action: a favorites message + the owner's session -> the rows of one commit."""

from __future__ import annotations

import json
import pickle
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import UUID, SafeUUID, uuid4

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.records import ActionEventRow, ActionRowBuilder, RecordedAction
from dataflows.favorite_actions.store import FavoritesStore
from devenv.harness.sessions import LINKED_LONG_AGO
from schemas.favorites import ActionTrackedEnvelope, ActionType
from schemas.kafka_record import SourceRecord
from schemas.outbox import OutboxRow
from tests.rows import SessionSnapshot, build_recorded_action, build_with

ADDED_TOPIC = "pin.favorites.favorite-added.v1"
REMOVED_TOPIC = "pin.favorites.favorite-removed.v1"
ACTION_TRACKED_TOPIC = "pin.user-activity.action-tracked.v1"
ACTION_TYPES = {
    ADDED_TOPIC: ActionType.ADD_TO_FAVORITES,
    REMOVED_TOPIC: ActionType.REMOVE_FROM_FAVORITES,
}

MESSAGE_ID = UUID("01938a4e-7c1a-7cc3-9a55-3f2b1c0d9e11")
FAVORITE_ID = UUID("5d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
PROPERTY_OBJECT_ID = UUID("a1b2c3d4-e5f6-4789-abcd-ef0123456789")
PAYLOAD_ANONYMOUS_ID = UUID("0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0")
SESSION_ID = UUID("11111111-2222-4333-8444-555555555555")
SESSION_ANONYMOUS_ID = UUID("99999999-8888-4777-8666-555555555555")
SESSION_USER_ID = UUID("7c9e6679-7425-40de-944b-e07fc1f90ae7")
ACTION_EVENT_ID = UUID("01938a4f-0000-7000-8000-000000000001")
OUTBOX_MESSAGE_ID = UUID("01938a4f-0000-7000-8000-000000000002")
OCCURRED_AT = datetime(2026, 11, 29, 11, 0, 0, 123456, tzinfo=timezone(timedelta(hours=3)))
NOW = datetime(2027, 1, 1, 0, 0, 0, tzinfo=UTC)
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

PAYLOAD_FIELDS = {
    "ActionType",
    "SessionId",
    "AnonymousId",
    "UserId",
    "OccurredAt",
    "PropertyObjectId",
    "FavoriteId",
}
ENVELOPE_FIELDS = {
    "MessageId",
    "CreatedAt",
    "Version",
    "AggregateId",
    "AggregateType",
    "CorrelationId",
    "Payload",
}


def favorite_message(
    *,
    topic: str = ADDED_TOPIC,
    correlation_id: str | None = "corr-7",
    headers: tuple[tuple[str, bytes], ...] = (("traceparent", TRACEPARENT),),
    occurred_at: datetime = OCCURRED_AT,
) -> FavoriteMessage:
    value: dict[str, Any] = {
        "MessageId": str(MESSAGE_ID),
        "CreatedAt": "2026-11-29T08:00:05+00:00",
        "Version": 1,
        "AggregateId": str(FAVORITE_ID),
        "AggregateType": "Favorite",
        "CorrelationId": correlation_id,
        "Payload": {
            "FavoriteId": str(FAVORITE_ID),
            "PropertyObjectId": str(PROPERTY_OBJECT_ID),
            "UserId": None,
            "AnonymousId": str(PAYLOAD_ANONYMOUS_ID),
            "OccurredAt": occurred_at.isoformat(),
            "Note": "never copied",
        },
    }
    source = SourceRecord(
        topic=topic,
        partition=0,
        offset=7,
        key=str(FAVORITE_ID).encode(),
        value=json.dumps(value).encode(),
        headers=headers,
    )
    message = decode_favorite(source, ACTION_TYPES)
    assert isinstance(message, FavoriteMessage)
    return message


LINKED_SESSION = SessionSnapshot(SESSION_ID, SESSION_ANONYMOUS_ID, SESSION_USER_ID,
                                 LINKED_LONG_AGO)
GUEST_SESSION = SessionSnapshot(SESSION_ID, SESSION_ANONYMOUS_ID, None, None)


def record_action(
    message: FavoriteMessage | None = None, session: SessionSnapshot = LINKED_SESSION
) -> RecordedAction:
    return build_recorded_action(
        message or favorite_message(),
        session,
        action_event_id=ACTION_EVENT_ID,
        outbox_message_id=OUTBOX_MESSAGE_ID,
        topic=ACTION_TRACKED_TOPIC,
        now=NOW,
    )


# --- the action-tracked outbox value ---------------------------------------------------------


def test_outbox_value_parses_as_an_action_tracked_envelope() -> None:
    recorded = record_action()

    envelope = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value)

    assert envelope.message_id == OUTBOX_MESSAGE_ID
    assert envelope.payload.action_type is ActionType.ADD_TO_FAVORITES


def test_outbox_value_has_exactly_the_spec_envelope_and_payload_fields() -> None:
    recorded = record_action()

    wire = orjson.loads(recorded.outbox.value)

    assert set(wire) == ENVELOPE_FIELDS
    assert set(wire["Payload"]) == PAYLOAD_FIELDS


def test_payload_note_is_not_copied_to_the_outbox_value() -> None:
    recorded = record_action()

    assert b"never copied" not in recorded.outbox.value
    assert b"Note" not in recorded.outbox.value


def test_envelope_announces_the_action_event_aggregate_at_version_1() -> None:
    recorded = record_action()

    envelope = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value)

    assert envelope.aggregate_type == "ActionEvent"
    assert envelope.aggregate_id == str(ACTION_EVENT_ID)
    assert envelope.version == 1
    assert envelope.created_at == NOW


@pytest.mark.parametrize("correlation_id", ["corr-7", None])
def test_correlation_id_is_copied_from_the_source_envelope(correlation_id: str | None) -> None:
    recorded = record_action(favorite_message(correlation_id=correlation_id))

    envelope = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value)

    assert envelope.correlation_id == correlation_id


def test_occurred_at_comes_from_the_payload_not_the_clock() -> None:
    recorded = record_action()

    envelope = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value)

    assert envelope.payload.occurred_at == OCCURRED_AT
    assert envelope.payload.occurred_at.utcoffset() == timedelta(hours=3)
    assert recorded.event.occurred_at == OCCURRED_AT
    assert recorded.event.occurred_at != NOW


def test_owner_ids_come_from_the_session_snapshot_not_the_payload() -> None:
    recorded = record_action(session=LINKED_SESSION)

    payload = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value).payload

    assert payload.session_id == SESSION_ID
    assert payload.anonymous_id == SESSION_ANONYMOUS_ID
    assert payload.user_id == SESSION_USER_ID
    assert (recorded.event.session_id, recorded.event.anonymous_id, recorded.event.user_id) == (
        SESSION_ID,
        SESSION_ANONYMOUS_ID,
        SESSION_USER_ID,
    )


@pytest.mark.parametrize(
    ("linked", "expected_user"),
    [(timedelta(seconds=-1), SESSION_USER_ID), (timedelta(0), SESSION_USER_ID),
     (timedelta(microseconds=1), None), (timedelta(hours=3), None)],
    ids=["linked-before", "linked-at-the-action", "linked-just-after", "linked-hours-later"],
)
def test_user_id_is_the_sessions_user_only_if_linked_by_the_time_of_the_action(
    linked: timedelta, expected_user: UUID | None,
) -> None:
    session = LINKED_SESSION._replace(linked_at=OCCURRED_AT + linked)

    recorded = record_action(session=session)

    assert recorded.event.user_id == expected_user
    wire = orjson.loads(recorded.outbox.value)["Payload"]
    assert wire["UserId"] == (None if expected_user is None else str(expected_user))
    assert wire["SessionId"] == str(SESSION_ID)  # the like still belongs to the session


def test_guest_session_yields_a_null_user_id() -> None:
    recorded = record_action(session=GUEST_SESSION)

    wire = orjson.loads(recorded.outbox.value)

    assert wire["Payload"]["UserId"] is None
    assert recorded.event.user_id is None


def test_property_object_and_favorite_ids_come_from_the_payload() -> None:
    recorded = record_action()

    payload = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value).payload

    assert payload.property_object_id == PROPERTY_OBJECT_ID
    assert payload.favorite_id == FAVORITE_ID


@pytest.mark.parametrize(
    ("topic", "action_type"),
    [(ADDED_TOPIC, ActionType.ADD_TO_FAVORITES), (REMOVED_TOPIC, ActionType.REMOVE_FROM_FAVORITES)],
)
def test_action_type_follows_the_source_topic(topic: str, action_type: ActionType) -> None:
    recorded = record_action(favorite_message(topic=topic))

    payload = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value).payload

    assert payload.action_type is action_type
    assert recorded.event.action_type == action_type.value


# --- the outbox row and the action event row -----------------------------------------------


def test_outbox_row_is_keyed_by_the_action_event_id_on_the_action_tracked_topic() -> None:
    recorded = record_action()

    assert recorded.outbox.key == str(ACTION_EVENT_ID).encode()
    assert recorded.outbox.id == OUTBOX_MESSAGE_ID
    assert recorded.outbox.topic == ACTION_TRACKED_TOPIC


def test_traceparent_header_is_propagated_when_present() -> None:
    recorded = record_action(favorite_message(headers=(("traceparent", TRACEPARENT),)))

    assert recorded.outbox.headers == {"traceparent": TRACEPARENT.decode()}


def test_no_traceparent_header_is_invented_when_absent() -> None:
    recorded = record_action(favorite_message(headers=(("x-other", b"1"),)))

    assert recorded.outbox.headers == {}


def test_action_event_row_records_the_source_message_and_its_own_id() -> None:
    recorded = record_action()

    assert recorded.event.id == ACTION_EVENT_ID
    assert recorded.event.source_message_id == MESSAGE_ID
    key = recorded.message.idempotency_key
    assert key == f"user-activity-favorites:AddToFavorites:{MESSAGE_ID}"


offsets = st.integers(min_value=-14 * 60, max_value=14 * 60).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)


@given(
    occurred_at=st.datetimes(  # local times from 2000-01-02: after LINKED_LONG_AGO at any offset
        min_value=datetime(2000, 1, 2), max_value=datetime(2100, 1, 1), timezones=offsets
    ),
    session_user_id=st.none() | st.uuids(),
    session_id=st.uuids(),
    session_anonymous_id=st.uuids(),
)
def test_outbox_payload_mirrors_the_event_row_for_any_session_and_time(
    occurred_at: datetime,
    session_user_id: UUID | None,
    session_id: UUID,
    session_anonymous_id: UUID,
) -> None:
    message = favorite_message(occurred_at=occurred_at)
    session = SessionSnapshot(session_id, session_anonymous_id, session_user_id,
                              None if session_user_id is None else LINKED_LONG_AGO)

    recorded = record_action(message, session)

    payload = ActionTrackedEnvelope.model_validate_json(recorded.outbox.value).payload
    event = recorded.event
    assert payload.session_id == event.session_id == session_id
    assert payload.anonymous_id == event.anonymous_id == session_anonymous_id
    assert payload.user_id == event.user_id == session_user_id
    assert payload.occurred_at == event.occurred_at == occurred_at
    assert payload.occurred_at.utcoffset() == occurred_at.utcoffset()


# --- byte compatibility with the previous mapping ---------------------------------------------


def reference_value(
    message: FavoriteMessage, session: SessionSnapshot, *, action_event_id: UUID,
    outbox_message_id: UUID, now: datetime,
) -> bytes:
    """The action-tracked value as the previous implementation rendered it (orjson of objects)."""
    payload = message.envelope.payload
    return orjson.dumps({
        "MessageId": outbox_message_id,
        "CreatedAt": now,
        "Version": 1,
        "AggregateId": action_event_id,
        "AggregateType": "ActionEvent",
        "CorrelationId": message.envelope.correlation_id,
        "Payload": {
            "ActionType": message.action_type.value,
            "SessionId": session.session_id,
            "AnonymousId": session.anonymous_id,
            "UserId": session.user_id,
            "OccurredAt": payload.occurred_at,
            "PropertyObjectId": payload.property_object_id,
            "FavoriteId": payload.favorite_id,
        },
    })


def test_outbox_value_is_byte_for_byte_the_documented_rendering() -> None:
    recorded = record_action()

    assert recorded.outbox.value == (
        b'{"MessageId":"01938a4f-0000-7000-8000-000000000002",'
        b'"CreatedAt":"2027-01-01T00:00:00+00:00","Version":1,'
        b'"AggregateId":"01938a4f-0000-7000-8000-000000000001","AggregateType":"ActionEvent",'
        b'"CorrelationId":"corr-7","Payload":{"ActionType":"AddToFavorites",'
        b'"SessionId":"11111111-2222-4333-8444-555555555555",'
        b'"AnonymousId":"99999999-8888-4777-8666-555555555555",'
        b'"UserId":"7c9e6679-7425-40de-944b-e07fc1f90ae7",'
        b'"OccurredAt":"2026-11-29T11:00:00.123456+03:00",'
        b'"PropertyObjectId":"a1b2c3d4-e5f6-4789-abcd-ef0123456789",'
        b'"FavoriteId":"5d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d"}}'
    )


@given(
    now=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                     timezones=st.just(UTC)),
    occurred_at=st.datetimes(  # local times from 2000-01-02: after LINKED_LONG_AGO at any offset
        min_value=datetime(2000, 1, 2), max_value=datetime(2100, 1, 1), timezones=offsets
    ),
    correlation_id=st.none() | st.text(st.characters(codec="utf-8"), max_size=256),
    session_user_id=st.none() | st.uuids(),
    ids=st.tuples(st.uuids(), st.uuids(), st.uuids(), st.uuids()),
)
def test_outbox_value_and_key_match_the_previous_rendering_for_any_input(
    now: datetime,
    occurred_at: datetime,
    correlation_id: str | None,
    session_user_id: UUID | None,
    ids: tuple[UUID, UUID, UUID, UUID],
) -> None:
    action_event_id, outbox_message_id, session_id, session_anonymous_id = ids
    message = favorite_message(occurred_at=occurred_at, correlation_id=correlation_id)
    session = SessionSnapshot(session_id, session_anonymous_id, session_user_id,
                              None if session_user_id is None else LINKED_LONG_AGO)

    recorded = build_recorded_action(
        message, session, action_event_id=action_event_id,
        outbox_message_id=outbox_message_id, topic=ACTION_TRACKED_TOPIC, now=now,
    )

    assert recorded.outbox.value == reference_value(
        message, session, action_event_id=action_event_id,
        outbox_message_id=outbox_message_id, now=now,
    )
    assert recorded.outbox.key == str(action_event_id).encode()


def test_several_actions_built_at_one_moment_share_created_at_and_nothing_else() -> None:
    builder = ActionRowBuilder(ACTION_TRACKED_TOPIC, NOW)
    message = favorite_message()

    first = build_with(builder, message, LINKED_SESSION, uuid4(), uuid4())
    second = build_with(builder, message, GUEST_SESSION, uuid4(), uuid4())

    assert orjson.loads(first.outbox.value)["CreatedAt"] == "2027-01-01T00:00:00+00:00"
    assert orjson.loads(second.outbox.value)["CreatedAt"] == "2027-01-01T00:00:00+00:00"
    assert first.event.id != second.event.id
    assert first.outbox.id != second.outbox.id
    assert orjson.loads(second.outbox.value)["Payload"]["UserId"] is None


# --- the shapes the sink relies on -------------------------------------------------------------


def test_recorded_action_exposes_what_the_sink_reads() -> None:
    message = favorite_message()
    recorded = record_action(message)

    assert recorded.message is message
    assert recorded.event.session_id == SESSION_ID
    assert isinstance(recorded.outbox, OutboxRow)


def test_event_row_fields_are_in_the_order_record_actions_sql_reads_them() -> None:
    assert ActionEventRow._fields == (
        "id", "action_type", "session_id", "anonymous_id", "user_id", "occurred_at",
        "property_object_id", "favorite_id", "source_message_id",
    )


def test_new_ids_are_distinct_time_ordered_uuid7s_that_behave_like_any_uuid() -> None:
    make_id = FavoritesStore(ACTION_TRACKED_TOPIC)._new_id  # the ids the store gives its rows
    ids = [make_id() for _ in range(1000)]

    assert len(set(ids)) == 1000
    assert ids == sorted(ids)
    for new_id in ids[:10]:
        assert new_id.version == 7
        assert new_id.is_safe is SafeUUID.unknown
        assert UUID(str(new_id)) == new_id
        assert hash(UUID(bytes=new_id.bytes)) == hash(new_id)
        assert pickle.loads(pickle.dumps(new_id)) == new_id
        assert orjson.dumps(new_id) == f'"{new_id}"'.encode()
