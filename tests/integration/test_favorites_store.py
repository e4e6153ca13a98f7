"""FavoritesStore.record_batch against real PostgreSQL: what is written is what is returned."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.rows import dict_row

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore
from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import insert_session
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.outbox.table import Key, whole_rows

pytestmark = pytest.mark.integration

ADDED, REMOVED = "favorite-added", "favorite-removed"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES, REMOVED: ActionType.REMOVE_FROM_FAVORITES}
TOPIC = "t.action-tracked"
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _message(topic: str = ADDED, headers: tuple[tuple[str, bytes], ...] = (),
             **envelope: Any) -> FavoriteMessage:
    value = orjson.dumps(favorite_envelope(**envelope))
    message = decode_favorite(SourceRecord(topic, 0, 0, b"k", value, headers), ACTION_TYPES)
    assert isinstance(message, FavoriteMessage)
    return message


def _stored(db: psycopg.Connection[Any], message_ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
    with db.cursor(row_factory=dict_row) as cur:
        cur.execute(
            """SELECT e.*, o.id AS outbox_id, o.txid, o.topic, o.key, o.value, o.headers,
                      o.created_at AS outbox_created_at,
                      EXISTS (SELECT 1 FROM user_activity.outbox_unpublished u
                               WHERE u.id = o.id) AS unpublished
                 FROM user_activity.action_events e
                 JOIN user_activity.outbox o ON o.action_event_id = e.id
                WHERE e.source_message_id = ANY(%s)""",
            (message_ids,),
        )
        return {row["source_message_id"]: row for row in cur.fetchall()}


def test_rows_written_are_exactly_the_recorded_actions(db: psycopg.Connection[Any]) -> None:
    device, user = uuid.uuid4(), uuid.uuid4()
    device_session = insert_session(db, anonymous_id=device)
    user_session_device = uuid.uuid4()
    user_session = insert_session(db, anonymous_id=user_session_device, user_id=user)
    messages = [
        _message(anonymous_id=device, headers=(("traceparent", TRACEPARENT),)),
        _message(REMOVED, user_id=user, occurred_at="2026-11-29T08:00:00Z"),
        # a CorrelationId that JSON has to escape, and non-ASCII: stored byte for byte
        _message(anonymous_id=device, correlation_id='é "q" \\ \n \t \x00 \u2028 \U0001f600'),
        _message(anonymous_id=device, correlation_id=None, occurred_at="2026-11-29T08:00:00-05:30"),
    ]
    now = datetime(2027, 1, 1, tzinfo=UTC)

    outcome = FavoritesStore(TOPIC, clock=lambda: now).record_batch(db, messages)

    assert [a.message for a in outcome.recorded] == messages
    assert outcome.duplicates == [] and outcome.no_session == []
    stored = _stored(db, [m.message_id for m in messages])
    assert len(stored) == len(messages)
    for action in outcome.recorded:
        row = stored[action.message.message_id]
        event, outbox = action.event, action.outbox
        assert {k: row[k] for k in event._fields} == event._asdict()
        assert row["occurred_at"] == action.message.envelope.payload.occurred_at
        # a thin row (0008): no key or value stored; the publisher renders the same bytes
        assert (row["outbox_id"], row["topic"], row["key"], row["value"], row["headers"]) == (
            outbox.id, TOPIC, None, None, outbox.headers)
        assert row["outbox_created_at"] == now
        [whole] = whole_rows(db, [Key(int(row["txid"]), row["outbox_id"])])
        assert (whole.id, whole.topic, whole.key, whole.value, whole.headers) == (
            outbox.id, TOPIC, outbox.key, outbox.value, outbox.headers)
        assert outcome.txid == int(row["txid"])
        assert row["unpublished"]
        assert outbox.key == str(event.id).encode()
    assert stored[messages[0].message_id]["session_id"] == device_session
    assert stored[messages[0].message_id]["headers"] == {"traceparent": TRACEPARENT.decode()}
    assert stored[messages[1].message_id]["session_id"] == user_session
    assert stored[messages[1].message_id]["anonymous_id"] == user_session_device
    assert stored[messages[1].message_id]["action_type"] == "RemoveFromFavorites"
    marks = db.execute(
        "SELECT count(*) FROM user_activity.consumer_idempotency_marks WHERE key = ANY(%s)",
        ([m.idempotency_key for m in messages],),
    ).fetchone()
    assert marks == (len(messages),)


def test_duplicates_and_owners_without_a_session_are_reported_and_not_written(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    first = _message(anonymous_id=device)
    again = _message(anonymous_id=device, message_id=first.message_id)  # same MessageId, added
    removed_same_id = _message(REMOVED, anonymous_id=device, message_id=first.message_id)
    stranger = _message(anonymous_id=uuid.uuid4())
    fresh = _message(anonymous_id=device)
    store = FavoritesStore(TOPIC)

    outcome = store.record_batch(db, [first, again, stranger, removed_same_id, fresh])

    assert [a.message for a in outcome.recorded] == [first, fresh]
    # ``again``: same idempotency key in the batch; ``removed_same_id``: its source MessageId
    # is already recorded (the mark of another action type does not make it a new event)
    assert outcome.duplicates == [again, removed_same_id]
    assert outcome.no_session == [stranger]

    replay = store.record_batch(db, [fresh, stranger, first])

    assert replay.recorded == []
    assert replay.duplicates == [fresh, first]
    assert replay.no_session == [stranger]
    outbox = db.execute(
        "SELECT count(*) FROM user_activity.outbox WHERE id = ANY(%s)",
        ([a.outbox.id for a in outcome.recorded],),
    ).fetchone()
    assert outbox == (2,)
    assert len(_stored(db, [first.message_id, fresh.message_id])) == 2


def test_a_failing_batch_writes_nothing(db: psycopg.Connection[Any]) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    message = _message(anonymous_id=device)
    store = FavoritesStore(TOPIC, new_id=lambda: uuid.UUID(int=7))  # two rows, one outbox id

    with pytest.raises(psycopg.errors.UniqueViolation):
        store.record_batch(db, [message, _message(anonymous_id=device)])

    assert _stored(db, [message.message_id]) == {}
    marks = db.execute(
        "SELECT count(*) FROM user_activity.consumer_idempotency_marks WHERE key = %s",
        (message.idempotency_key,),
    ).fetchone()
    assert marks == (0,)


def test_a_redelivery_after_the_marks_day_boundary_records_nothing(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    message = _message(anonymous_id=device)
    store = FavoritesStore(TOPIC)
    assert len(store.record_batch(db, [message]).recorded) == 1
    # the mark was made on an earlier day (another daily partition): today's has none
    db.execute("UPDATE user_activity.consumer_idempotency_marks"
               " SET processed_on = processed_on - 1 WHERE key = %s", (message.idempotency_key,))

    again = store.record_batch(db, [message])

    assert again.recorded == [] and again.duplicates == [message]
    assert len(_stored(db, [message.message_id])) == 1  # one action row, one outbox row
    outbox = db.execute(
        "SELECT count(*) FROM user_activity.outbox o JOIN user_activity.action_events e"
        " ON o.action_event_id = e.id WHERE e.source_message_id = %s",
        (message.message_id,),
    ).fetchone()
    assert outbox == (1,)


def test_a_same_day_redelivery_writes_no_second_mark(db: psycopg.Connection[Any]) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    message = _message(anonymous_id=device)
    store = FavoritesStore(TOPIC)
    store.record_batch(db, [message])

    again = store.record_batch(db, [message])

    assert again.duplicates == [message]
    marks = db.execute(
        "SELECT count(*) FROM user_activity.consumer_idempotency_marks WHERE key = %s",
        (message.idempotency_key,),
    ).fetchone()
    assert marks == (1,)


# --- thin outbox rows (migration 0008): the window renders the fast path's bytes ----------------

_EXTREME_TIMES = st.sampled_from([
    # the first and the last moment of years 1-9999 in UTC, at the widest offsets (an offset
    # that takes either past its end is refused by the contract: schemas.envelope.Moment)
    "0001-01-01T14:00:00+14:00",
    "9999-12-31T09:59:59.999999-14:00",
    "2026-11-29T08:00:00.1234567+03:00",  # a 7-digit fraction (.NET)
    "2026-11-29T08:00:00Z",
    "2026-11-29T08:00:00+00:00",
    "2026-11-29T08:00:00-00:30",
])
_ANY_TIME = st.datetimes(
    min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
    # the offsets .NET can hold (schemas.envelope.MAX_UTC_OFFSET); beyond them: refused
    timezones=st.integers(-14 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m))),
).map(lambda moment: moment.isoformat())


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    occurred_at=_EXTREME_TIMES | _ANY_TIME,
    correlation_id=st.none() | st.text(st.characters(codec="utf-8"), max_size=64),
    linked=st.booleans(),
    now=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                     timezones=st.just(UTC)),
)
def test_a_thin_outbox_row_renders_to_the_bytes_the_sink_rendered(
    db: psycopg.Connection[Any], occurred_at: str, correlation_id: str | None, linked: bool,
    now: datetime,
) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device, user_id=uuid.uuid4() if linked else None)
    message = _message(anonymous_id=device, occurred_at=occurred_at,
                       correlation_id=correlation_id)

    [action] = FavoritesStore(TOPIC, clock=lambda: now).record_batch(db, [message]).recorded

    # (not e.*: psycopg cannot load an occurred_at before year 1 or after 9999 in UTC)
    keys = db.execute(
        "SELECT o.txid::text, o.id FROM user_activity.outbox o JOIN user_activity.action_events e"
        " ON o.action_event_id = e.id WHERE e.source_message_id = %s", (message.message_id,),
    ).fetchall()
    [whole] = whole_rows(db, [Key(int(txid), row_id) for txid, row_id in keys])
    outbox = action.outbox
    assert (whole.key, whole.value) == (outbox.key, outbox.value)
    wire = orjson.loads(whole.value)
    assert wire["Payload"]["OccurredAt"] == orjson.dumps(
        message.envelope.payload.occurred_at).decode()[1:-1]
    assert wire["CorrelationId"] == correlation_id
