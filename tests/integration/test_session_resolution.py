"""Owner session resolution (INV-ACT-003) in one query, against real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore, owner_of
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


def _resolve(db: psycopg.Connection[Any], message: FavoriteMessage) -> uuid.UUID | None:
    sessions = FavoritesStore("t").resolve_sessions(db, [message])
    found = sessions.get(owner_of(message))
    return None if found is None else found.session_id


def test_the_devices_active_session_wins_over_a_more_recent_ended_one(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    active = insert_session(db, anonymous_id=device, last_activity_at=NOW - timedelta(hours=5))
    insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW)

    assert _resolve(db, _message(anonymous=device)) == active


def test_without_an_active_session_the_latest_by_last_activity_is_taken(
    db: psycopg.Connection[Any],
) -> None:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW - timedelta(2))
    latest = insert_session(db, anonymous_id=device, status="Ended", last_activity_at=NOW)

    assert _resolve(db, _message(anonymous=device)) == latest


def test_a_user_with_several_active_sessions_gets_the_latest_one(
    db: psycopg.Connection[Any],
) -> None:
    user = uuid.uuid4()
    insert_session(db, anonymous_id=uuid.uuid4(), user_id=user,
                   last_activity_at=NOW - timedelta(minutes=30))
    latest = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, last_activity_at=NOW)
    insert_session(db, anonymous_id=uuid.uuid4(), user_id=user, status="Ended",
                   last_activity_at=NOW + timedelta(minutes=1))

    assert _resolve(db, _message(user=user)) == latest


def test_an_owner_without_any_session_resolves_to_nothing_and_none_is_created(
    db: psycopg.Connection[Any],
) -> None:
    device, user = uuid.uuid4(), uuid.uuid4()

    assert _resolve(db, _message(anonymous=device)) is None
    assert _resolve(db, _message(user=user)) is None
    count = db.execute(
        "SELECT count(*) FROM user_activity.sessions WHERE anonymous_id = %s OR user_id = %s",
        (device, user),
    ).fetchone()
    assert count == (0,)


def test_one_query_resolves_a_batch_of_mixed_owners(db: psycopg.Connection[Any]) -> None:
    devices = [uuid.uuid4() for _ in range(30)]
    users = [uuid.uuid4() for _ in range(30)]
    expected: dict[tuple[uuid.UUID | None, uuid.UUID | None], uuid.UUID] = {}
    for device, user in zip(devices, users, strict=True):
        expected[(device, None)] = insert_session(db, anonymous_id=device)
        expected[(None, user)] = insert_session(db, anonymous_id=uuid.uuid4(), user_id=user)
    messages = [_message(anonymous=d) for d in devices] + [_message(user=u) for u in users]

    sessions = FavoritesStore("t").resolve_sessions(db, messages)

    assert {owner: s.session_id for owner, s in sessions.items()} == expected
