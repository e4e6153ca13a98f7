"""USER_ACTIVITY_PUBLISH_SESSION_LIFECYCLE: session-started/ended rows written, or none at all."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.linking import SessionTopics
from dataflows.session_linking.store import SessionLinksStore
from devenv.harness.messages import sign_in_envelope
from devenv.harness.sessions import insert_session
from schemas.kafka_record import SourceRecord

pytestmark = pytest.mark.integration

TOPICS = SessionTopics(linked="t.linked", started="t.started", ended="t.ended")


@pytest.fixture
def rolled_back(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection whose writes are rolled back: no outbox row for a topic nobody made."""
    with psycopg.connect(database_url) as conn:
        conn.execute("SELECT 1")  # in a transaction: link_batch's is a savepoint in it
        yield conn
        conn.rollback()


def _sign_in(user: uuid.UUID, device: uuid.UUID, at: datetime) -> SignInMessage:
    envelope = sign_in_envelope(user_id=user, anonymous_id=device, signed_in_at=at.isoformat())
    decoded = decode_sign_in(SourceRecord("t.signed-in", 0, 0, None, orjson.dumps(envelope)))
    assert isinstance(decoded, SignInMessage)
    return decoded


@pytest.mark.parametrize("lifecycle", [True, False])
def test_sessions_started_and_ended_are_announced_only_when_the_setting_says_so(
    rolled_back: psycopg.Connection[Any], lifecycle: bool,
) -> None:
    db = rolled_back
    new_device, guest_device, first, second = (uuid.uuid4() for _ in range(4))
    insert_session(db, anonymous_id=guest_device)
    now = datetime.now(UTC)
    store = SessionLinksStore(TOPICS, lifecycle=lifecycle)

    linked = store.link_batch(db, [  # starts a session; links the guest; re-links it
        _sign_in(first, new_device, now), _sign_in(first, guest_device, now),
        _sign_in(second, guest_device, now + timedelta(seconds=1))])
    results = linked.results

    topics = [row.topic for result in results for row in result.outbox]
    written = db.execute("SELECT topic FROM user_activity.outbox WHERE id = ANY(%s)",
                         ([row.id for result in results for row in result.outbox],)).fetchall()
    assert [r.outcome.value for r in results] == ["started", "linked", "relinked"]
    if lifecycle:
        assert topics == ["t.started", "t.linked", "t.ended", "t.started"]
    else:
        assert topics == ["t.linked"]
    assert sorted(topic for (topic,) in written) == sorted(topics)
    sessions = db.execute("SELECT count(*) FROM user_activity.sessions"
                          " WHERE anonymous_id = ANY(%s)", ([new_device, guest_device],)).fetchone()
    assert sessions == (3,)  # the sessions themselves do not depend on the setting
