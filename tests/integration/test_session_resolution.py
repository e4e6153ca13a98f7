"""Owner session resolution (INV-ACT-003), against real PostgreSQL.

Two statements resolve sessions: ``record_actions.sql``, which records (the session is resolved
in the statement that writes the row), and ``resolve_owner_sessions.sql``, the dry run's
preview. Each rule is checked on both (the ``resolve`` fixture). Also: session linking's lookup
of a device's last sign-in reads one index entry, however many sessions the device has.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
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


def _message(*, anonymous: uuid.UUID | None = None, user: uuid.UUID | None = None) -> Any:
    value = orjson.dumps({
        "MessageId": str(uuid.uuid4()), "CreatedAt": NOW.isoformat(), "Version": 1,
        "AggregateId": "f", "AggregateType": "Favorite",
        "Payload": {
            "FavoriteId": str(uuid.uuid4()), "PropertyObjectId": str(uuid.uuid4()),
            "AnonymousId": None if anonymous is None else str(anonymous),
            "UserId": None if user is None else str(user), "OccurredAt": NOW.isoformat(),
        },
    })
    message = decode_favorite(SourceRecord("t", 0, 0, b"k", value),
                              {"t": ActionType.ADD_TO_FAVORITES})
    assert isinstance(message, FavoriteMessage)
    return message


Owner = tuple[uuid.UUID | None, uuid.UUID | None]
Resolve = Callable[[psycopg.Connection[Any], list[FavoriteMessage]], dict[Owner, uuid.UUID]]


def _previewed(db: psycopg.Connection[Any], messages: list[FavoriteMessage]) -> dict[Owner, Any]:
    return {owner: s.session_id
            for owner, s in FavoritesStore("t").resolve_sessions(db, messages).items()}


def _recorded(db: psycopg.Connection[Any], messages: list[FavoriteMessage]) -> dict[Owner, Any]:
    outcome = FavoritesStore("t").record_batch(db, messages)
    assert len(outcome.recorded) + len(outcome.no_session) == len(messages)
    return {owner_of(a.message): a.event.session_id for a in outcome.recorded}


@pytest.fixture(params=[_recorded, _previewed], ids=["record_actions", "preview"])
def resolve(request: pytest.FixtureRequest) -> Resolve:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def _resolve(db: psycopg.Connection[Any], resolve: Resolve) -> Callable[..., uuid.UUID | None]:
    def one(_db: psycopg.Connection[Any], message: FavoriteMessage) -> uuid.UUID | None:
        return resolve(db, [message]).get(owner_of(message))

    return one


def test_the_devices_active_session_wins_over_a_more_recent_ended_one(
    db: psycopg.Connection[Any], _resolve: Callable[..., uuid.UUID | None],
) -> None:
    device = uuid.uuid4()
    active = insert_session(db, anonymous_id=device, last_activity_at=NOW - timedelta(hours=5))
    insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW)

    assert _resolve(db, _message(anonymous=device)) == active


def test_without_an_active_session_the_latest_by_last_activity_is_taken(
    db: psycopg.Connection[Any], _resolve: Callable[..., uuid.UUID | None],
) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW - timedelta(2))
    latest = insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW)

    assert _resolve(db, _message(anonymous=device)) == latest


def test_a_user_with_several_active_sessions_gets_the_latest_one(
    db: psycopg.Connection[Any], _resolve: Callable[..., uuid.UUID | None],
) -> None:
    user = uuid.uuid4()
    insert_session(db, anonymous_id=uuid.uuid4(), user_id=user,
                   last_activity_at=NOW - timedelta(minutes=30))
    latest = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, last_activity_at=NOW)
    insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, status="Ended",
                   last_activity_at=NOW + timedelta(minutes=1))

    assert _resolve(db, _message(user=user)) == latest


def test_an_owner_without_any_session_resolves_to_nothing_and_none_is_created(
    db: psycopg.Connection[Any], _resolve: Callable[..., uuid.UUID | None],
) -> None:
    device, user = uuid.uuid4(), uuid.uuid4()

    assert _resolve(db, _message(anonymous=device)) is None
    assert _resolve(db, _message(user=user)) is None
    count = db.execute(
        "SELECT count(*) FROM user_activity.sessions WHERE anonymous_id = %s OR user_id = %s",
        (device, user),
    ).fetchone()
    assert count == (0,)


def test_one_statement_resolves_a_batch_of_mixed_owners(
    db: psycopg.Connection[Any], resolve: Resolve,
) -> None:
    devices = [uuid.uuid4() for _ in range(30)]
    users = [uuid.uuid4() for _ in range(30)]
    expected: dict[tuple[uuid.UUID | None, uuid.UUID | None], uuid.UUID] = {}
    for device, user in zip(devices, users, strict=True):
        expected[(device, None)] = insert_session(db, anonymous_id=device)
        expected[(None, user)] = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user)
    messages = [_message(anonymous=d) for d in devices] + [_message(user=u) for u in users]

    assert resolve(db, messages) == expected


@pytest.mark.parametrize("linked", ["before", "after"])
def test_the_row_and_its_event_get_the_user_only_when_linked_by_the_action(
    db: psycopg.Connection[Any], linked: str,
) -> None:
    """The UserId as of OccurredAt (AC6), as the statement stores it and the event carries."""
    device, user = uuid.uuid4(), uuid.uuid4()
    link = NOW - timedelta(seconds=1) if linked == "before" else NOW + timedelta(seconds=1)
    session = insert_session(db, anonymous_id=device, user_id=user, linked_at=link)

    outcome = FavoritesStore("t").record_batch(  # by AnonymousId, and by UserId
        db, [_message(anonymous=device), _message(user=user)])

    expected = user if linked == "before" else None
    by_owner = {owner_of(a.message): a for a in outcome.recorded}
    for action in by_owner.values():
        stored = db.execute(
            "SELECT session_id, user_id FROM user_activity.action_events WHERE id = %s",
            (action.event.id,)).fetchone()
        assert stored == (session, expected)
        assert (action.event.session_id, action.event.user_id) == (session, expected)
        value = orjson.loads(action.outbox.value)["Payload"]
        assert value["SessionId"] == str(session)
        assert value["UserId"] == (None if expected is None else str(expected))
    assert len(by_owner) == 2


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
    db: psycopg.Connection[Any], resolve: Resolve,
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
        resolved = resolve(db, messages)
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
