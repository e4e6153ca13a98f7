"""Owner session resolution (INV-ACT-003, in event time) and the row's UserId, on real PostgreSQL.

``record_actions.sql`` resolves the session in the statement that writes the row
(``owner_session.sql``): the session that covered the action's OccurredAt first, then the
seed's rule. Also: session linking's lookup of a device's last sign-in reads one index entry,
however many sessions the device has.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore, owner_of
from dataflows.session_linking.sql import query as session_linking_query
from devenv.harness.sessions import insert_session
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord

pytestmark = pytest.mark.integration

NOW = datetime.now(UTC)


def _message(*, anonymous: uuid.UUID | None = None, user: uuid.UUID | None = None,
             at: datetime = NOW) -> Any:
    value = orjson.dumps({
        "MessageId": str(uuid.uuid4()), "CreatedAt": at.isoformat(), "Version": 1,
        "AggregateId": "f", "AggregateType": "Favorite",
        "Payload": {
            "FavoriteId": str(uuid.uuid4()), "PropertyObjectId": str(uuid.uuid4()),
            "AnonymousId": None if anonymous is None else str(anonymous),
            "UserId": None if user is None else str(user), "OccurredAt": at.isoformat(),
        },
    })
    message = decode_favorite(SourceRecord("t", 0, 0, b"k", value),
                              {"t": ActionType.ADD_TO_FAVORITES})
    assert isinstance(message, FavoriteMessage)
    return message


Owner = tuple[uuid.UUID | None, uuid.UUID | None]


def _resolve(db: psycopg.Connection[Any], messages: list[FavoriteMessage]) -> dict[Owner, Any]:
    outcome = FavoritesStore("t").record_batch(db, messages)
    assert len(outcome.recorded) + len(outcome.no_session) == len(messages)
    return {owner_of(a.message): a.event.session_id for a in outcome.recorded}


def _one(db: psycopg.Connection[Any], message: FavoriteMessage) -> uuid.UUID | None:
    return _resolve(db, [message]).get(owner_of(message))


def _session(db: psycopg.Connection[Any], *, device: uuid.UUID, started: datetime,
             ended: datetime | None = None, user: uuid.UUID | None = None,
             linked: datetime | None = None, last_activity: datetime | None = None) -> uuid.UUID:
    session_id = uuid.uuid4()
    db.execute(
        """INSERT INTO user_activity.sessions
             (id, anonymous_id, user_id, linked_at, linked_signed_in_at, status, started_at,
              last_activity_at, ended_at)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)""",
        (session_id, device, user, None if user is None else NOW, linked,
         "Active" if ended is None else "Ended", started, last_activity or started, ended))
    return session_id


def test_the_devices_active_session_wins_over_a_more_recent_ended_one(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    active = insert_session(db, anonymous_id=device, last_activity_at=NOW - timedelta(hours=5))
    insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW)

    assert _one(db, _message(anonymous=device)) == active


def test_without_an_active_session_the_latest_by_last_activity_is_taken(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW - timedelta(2))
    latest = insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW)

    assert _one(db, _message(anonymous=device)) == latest


def test_a_user_with_several_active_sessions_gets_the_latest_one(
    db: psycopg.Connection[Any],
) -> None:
    user = uuid.uuid4()
    insert_session(db, anonymous_id=uuid.uuid4(), user_id=user,
                   last_activity_at=NOW - timedelta(minutes=30))
    latest = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, last_activity_at=NOW)
    insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, status="Ended",
                   last_activity_at=NOW + timedelta(minutes=1))

    assert _one(db, _message(user=user)) == latest


def test_an_owner_without_any_session_resolves_to_nothing_and_none_is_created(
    db: psycopg.Connection[Any],
) -> None:
    device, user = uuid.uuid4(), uuid.uuid4()

    assert _one(db, _message(anonymous=device)) is None
    assert _one(db, _message(user=user)) is None
    count = db.execute(
        "SELECT count(*) FROM user_activity.sessions WHERE anonymous_id = %s OR user_id = %s",
        (device, user),
    ).fetchone()
    assert count == (0,)


def test_one_statement_resolves_a_batch_of_mixed_owners(
    db: psycopg.Connection[Any],
) -> None:
    devices = [uuid.uuid4() for _ in range(30)]
    users = [uuid.uuid4() for _ in range(30)]
    expected: dict[tuple[uuid.UUID | None, uuid.UUID | None], uuid.UUID] = {}
    for device, user in zip(devices, users, strict=True):
        expected[(device, None)] = insert_session(db, anonymous_id=device)
        expected[(None, user)] = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user)
    messages = [_message(anonymous=d) for d in devices] + [_message(user=u) for u in users]

    assert _resolve(db, messages) == expected


@pytest.mark.parametrize("linked", ["before", "after"])
def test_a_guest_action_gets_the_sessions_user_only_when_linked_by_its_sign_in_before_it(
    db: psycopg.Connection[Any], linked: str,
) -> None:
    """The UserId of a guest action (AC6), in the producers' clock: the linking SignedInAt."""
    device, user = uuid.uuid4(), uuid.uuid4()
    signed_in = NOW - timedelta(seconds=1) if linked == "before" else NOW + timedelta(seconds=1)
    session = _session(db, device=device, started=NOW - timedelta(hours=1), user=user,
                       linked=signed_in)

    outcome = FavoritesStore("t").record_batch(db, [_message(anonymous=device)])

    [action] = outcome.recorded
    expected = user if linked == "before" else None
    stored = db.execute("SELECT session_id, user_id FROM user_activity.action_events WHERE id = %s",
                        (action.event.id,)).fetchone()
    assert stored == (session, expected)
    assert orjson.loads(action.outbox.value)["Payload"]["UserId"] == (
        None if expected is None else str(expected))


@pytest.mark.parametrize("linked", ["before", "after"])
def test_a_users_own_action_carries_its_user_whenever_the_session_was_linked(
    db: psycopg.Connection[Any], linked: str,
) -> None:
    """A like whose payload says UserId = U is U's, in the row and in action-tracked.

    Before issue 41 it lost its user when the session's server-side linked_at was after its
    OccurredAt (a sign-in applied after the lateness, a replay, a backfill).
    """
    device, user = uuid.uuid4(), uuid.uuid4()
    link = NOW - timedelta(seconds=2) if linked == "before" else NOW + timedelta(seconds=5)
    session = insert_session(db, anonymous_id=device, user_id=user, linked_at=link)

    outcome = FavoritesStore("t").record_batch(db, [_message(user=user)])

    [action] = outcome.recorded
    stored = db.execute("SELECT session_id, user_id FROM user_activity.action_events WHERE id = %s",
                        (action.event.id,)).fetchone()
    assert stored == (session, user)
    assert (action.event.session_id, action.event.user_id) == (session, user)
    assert orjson.loads(action.outbox.value)["Payload"]["UserId"] == str(user)


def test_a_late_guest_action_lands_in_the_session_that_covered_it_not_the_current_one(
    db: psycopg.Connection[Any],
) -> None:
    """A guest like processed after the device was re-linked to another user (issue 41)."""
    device, first_user, second_user = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    relinked = NOW - timedelta(minutes=10)
    old = _session(db, device=device, started=NOW - timedelta(hours=2), ended=relinked,
                   user=first_user, linked=NOW - timedelta(hours=1))
    _session(db, device=device, started=relinked, user=second_user, linked=relinked)

    during_old = _message(anonymous=device, at=NOW - timedelta(minutes=30))
    before_link = _message(anonymous=device, at=NOW - timedelta(minutes=90))
    outcome = FavoritesStore("t").record_batch(db, [during_old, before_link])

    by_id = {a.message.envelope.message_id: a.event for a in outcome.recorded}
    assert (by_id[during_old.envelope.message_id].session_id,
            by_id[during_old.envelope.message_id].user_id) == (old, first_user)
    assert (by_id[before_link.envelope.message_id].session_id,
            by_id[before_link.envelope.message_id].user_id) == (old, None)
    history = db.execute(
        "SELECT history_user_id FROM user_activity.user_action_history WHERE source_message_id"
        " = ANY(%s)", ([during_old.envelope.message_id, before_link.envelope.message_id],),
    ).fetchall()
    assert {row[0] for row in history} == {first_user}


def test_a_users_action_anchors_to_the_session_that_was_its_own_at_the_time(
    db: psycopg.Connection[Any],
) -> None:
    user = uuid.uuid4()
    earlier = _session(db, device=uuid.uuid4(), started=NOW - timedelta(hours=3),
                       ended=NOW - timedelta(hours=1), user=user,
                       linked=NOW - timedelta(hours=3))
    _session(db, device=uuid.uuid4(), started=NOW - timedelta(minutes=30), user=user,
             linked=NOW - timedelta(minutes=30))

    assert _one(db, _message(user=user, at=NOW - timedelta(hours=2))) == earlier


def test_an_action_older_than_every_session_of_its_owner_follows_the_seed(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    active = _session(db, device=device, started=NOW - timedelta(hours=1))
    _session(db, device=device, started=NOW - timedelta(hours=3), ended=NOW - timedelta(hours=2),
             last_activity=NOW - timedelta(hours=2))

    assert _one(db, _message(anonymous=device, at=NOW - timedelta(days=1))) == active


def test_an_owner_without_a_session_waits_when_asked_and_a_redelivery_is_a_duplicate(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    message = _message(anonymous=device)
    store = FavoritesStore("t", wait_seconds=30)

    first = store.record_batch(db, [message])
    again = store.record_batch(db, [message])

    assert first.waiting == [message] and not first.no_session
    assert again.duplicates == [message] and not again.waiting
    swept = store.sweep_waiting(db)
    assert [w.idempotency_key for w in swept if w.session_id is None] == [message.idempotency_key]
    session = _session(db, device=device, started=NOW - timedelta(minutes=1))
    db.execute("UPDATE user_activity.waiting_actions SET retry_at = now()"
               " WHERE idempotency_key = %s", (message.idempotency_key,))
    [recorded] = [w for w in store.sweep_waiting(db)
                  if w.idempotency_key == message.idempotency_key]
    assert (recorded.session_id, recorded.inserted, recorded.given_up) == (session, True, False)
    assert db.execute("SELECT session_id FROM user_activity.action_events"
                      " WHERE source_message_id = %s", (message.envelope.message_id,)
                      ).fetchone() == (session,)


def test_a_waiting_action_past_its_wait_is_given_up(db: psycopg.Connection[Any]) -> None:
    message = _message(anonymous=uuid.uuid4())
    store = FavoritesStore("t", wait_seconds=30)
    store.record_batch(db, [message])
    db.execute("UPDATE user_activity.waiting_actions SET retry_at = now(), wait_until = now()"
               " WHERE idempotency_key = %s", (message.idempotency_key,))

    [given_up] = [w for w in store.sweep_waiting(db)
                  if w.idempotency_key == message.idempotency_key]

    assert (given_up.session_id, given_up.given_up) == (None, True)
    assert db.execute("SELECT count(*) FROM user_activity.waiting_actions WHERE idempotency_key"
                      " = %s", (message.idempotency_key,)).fetchone() == (0,)


_MANY_SESSIONS = """
INSERT INTO user_activity.sessions
       (id, anonymous_id, user_id, linked_at, status, started_at, last_activity_at, ended_at)
SELECT gen_random_uuid(), coalesce(%(device)s, gen_random_uuid()), %(user)s,
       CASE WHEN %(user)s::uuid IS NOT NULL THEN %(long_ago)s END, 'Ended',
       %(now)s - (g || ' min')::interval - interval '1 hour', %(now)s - (g || ' min')::interval,
       %(now)s
  FROM generate_series(1, %(count)s) g
"""


def test_a_hot_owners_batch_reads_a_few_index_entries_per_event_not_all_its_sessions(
    db: psycopg.Connection[Any],
) -> None:
    """A device and a user with 100,000 sessions each: 500 of their events resolve at once.

    Before migration 0011, each lookup read and sorted all of the owner's sessions (17 ms at
    100,000), so a batch of such an owner's events ran past the statement timeout, which is an
    outage to the sink: the batch was retried forever and the stream stalled for good. Now each
    lookup stops at its first index entry; the 5 s timeout here is two orders of magnitude above
    what the batch takes.
    """
    device, user = uuid.uuid4(), uuid.uuid4()
    for owner in ({"device": device, "user": None}, {"device": None, "user": user}):
        db.execute(_MANY_SESSIONS, {**owner, "count": 100_000, "now": NOW,
                                    "long_ago": NOW - timedelta(days=400)})
    latest_of_device = insert_session(db, anonymous_id=device, status="Ended",
                                      last_activity_at=NOW + timedelta(seconds=1))
    latest_of_user = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, status="Ended",
                                    last_activity_at=NOW + timedelta(seconds=1))
    db.execute("ANALYZE user_activity.sessions")
    messages = [_message(anonymous=device) for _ in range(250)]
    messages += [_message(user=user) for _ in range(250)]

    db.execute("SET statement_timeout = '5s'")
    try:
        resolved = _resolve(db, messages)
    finally:
        db.execute("RESET statement_timeout")

    assert resolved == {(device, None): latest_of_device, (None, user): latest_of_user}


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", []) for node in _plan_nodes(child))]


def test_a_devices_last_sign_in_is_found_by_one_index_entry_among_100_000_sessions(
    db: psycopg.Connection[Any],
) -> None:
    """Session linking finds a device's last sign-in without reading its other sessions.

    ``link_session_device_last.sql`` (each sign-in) used to read and sort every session of the
    device; ``ix_sessions_device_last_sign_in`` (migration 0011) gives the last one first.
    """
    device, user = uuid.uuid4(), uuid.uuid4()
    db.execute(_MANY_SESSIONS, {"device": device, "user": user, "count": 100_000, "now": NOW,
                                "long_ago": NOW - timedelta(days=400)})
    db.execute("UPDATE user_activity.sessions SET last_signed_in_at = last_activity_at"
               " WHERE anonymous_id = %s", (device,))
    db.execute("ANALYZE user_activity.sessions")
    params = {"anonymous_id": device, "user_id": user, "signed_in_at": NOW}

    row = db.execute(session_linking_query("link_session_device_last"), params).fetchone()
    (explained,) = db.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + session_linking_query("link_session_device_last"),
        params).fetchone()  # type: ignore[misc]

    assert row == (NOW - timedelta(minutes=1), user, False)
    nodes = _plan_nodes(explained[0]["Plan"])
    scans = [n for n in nodes if n.get("Relation Name") == "sessions"]
    assert {n["Index Name"] for n in scans} == {"ix_sessions_device_last_sign_in"}
    assert sum(n["Actual Rows"] * n["Actual Loops"] for n in scans) <= 1
    assert not [n for n in nodes if "Sort" in n["Node Type"]]
