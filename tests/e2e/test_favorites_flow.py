"""AC1-AC6 end to end: real envelopes on real topics -> the real flow -> rows + action-tracked."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from dataflows.favorite_actions import build_flow
from dataflows.session_linking import build_flow as build_session_linking_flow
from devenv.harness.messages import favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from schemas.favorites import ActionTrackedEnvelope
from tests.conftest import SettingsFactory
from tests.support import action_rows, consume_all, envelope_record, produce, run_flow

pytestmark = pytest.mark.e2e

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _tracked(settings: Any, expect: int) -> list[ActionTrackedEnvelope]:
    return [
        ActionTrackedEnvelope.model_validate_json(c.value or b"")
        for c in consume_all(settings, settings.topic_action_tracked, expect_at_least=expect)
    ]


def test_favorite_added_with_an_active_session_records_a_row_and_publishes_action_tracked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous, user_id=user)
    envelope = favorite_envelope(anonymous_id=anonymous)
    produce(settings, [envelope_record(settings.topic_favorite_added, envelope,
                                       headers=(("traceparent", TRACEPARENT),))])

    run_flow(build_flow, settings)

    message_id = uuid.UUID(envelope["MessageId"])
    [row] = action_rows(db, [message_id])
    assert row["action_type"] == "AddToFavorites"
    assert (row["session_id"], row["anonymous_id"], row["user_id"]) == (session, anonymous, user)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=1)
    assert len(consumed) == 1
    tracked = ActionTrackedEnvelope.model_validate_json(consumed[0].value or b"")
    assert tracked.aggregate_id == str(row["id"])
    assert tracked.payload.action_type == "AddToFavorites"
    assert tracked.payload.session_id == session
    assert tracked.payload.user_id == user
    assert tracked.correlation_id == "corr-1"
    assert consumed[0].key == str(row["id"]).encode()
    assert consumed[0].header("traceparent") == TRACEPARENT


def test_favorite_removed_records_remove_from_favorites_and_publishes_it(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous = new_id()
    insert_session(db, anonymous_id=anonymous)
    envelope = favorite_envelope(anonymous_id=anonymous)
    produce(settings, [envelope_record(settings.topic_favorite_removed, envelope)])

    run_flow(build_flow, settings)

    [row] = action_rows(db, [uuid.UUID(envelope["MessageId"])])
    assert row["action_type"] == "RemoveFromFavorites"
    [tracked] = _tracked(settings, 1)
    assert tracked.payload.action_type == "RemoveFromFavorites"
    assert tracked.payload.favorite_id == uuid.UUID(envelope["Payload"]["FavoriteId"])


def test_redelivered_message_id_on_two_partitions_and_after_a_restart_records_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous = new_id()
    insert_session(db, anonymous_id=anonymous)
    envelope = favorite_envelope(anonymous_id=anonymous)
    record = envelope_record(settings.topic_favorite_added, envelope)
    produce(settings, [
        envelope_record(settings.topic_favorite_added, envelope, partition=0),
        envelope_record(settings.topic_favorite_added, envelope, partition=3),
    ])
    run_flow(build_flow, settings)
    produce(settings, [record])  # redelivered after the job's restart (no snapshot: full replay)

    run_flow(build_flow, settings)

    assert len(action_rows(db, [uuid.UUID(envelope["MessageId"])])) == 1
    tracked = _tracked(settings, 1)
    assert len({t.message_id for t in tracked}) == 1


def test_both_or_neither_owner_is_invalid_owner_with_no_row_and_no_dlq(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    insert_session(db, anonymous_id=anonymous, user_id=user)
    both = favorite_envelope(anonymous_id=anonymous, user_id=user)
    neither = favorite_envelope()
    produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in (both, neither)])

    run_flow(build_flow, settings)

    assert action_rows(db, [uuid.UUID(e["MessageId"]) for e in (both, neither)]) == []
    assert consume_all(settings, settings.topic_action_tracked, settle=0.5) == []
    assert consume_all(settings, settings.topic_favorites_dlq, settle=0.5) == []


def test_owner_without_any_session_is_skipped_with_no_row(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    envelope = favorite_envelope(user_id=new_id())
    produce(settings, [envelope_record(settings.topic_favorite_added, envelope)])

    run_flow(build_flow, settings)

    assert action_rows(db, [uuid.UUID(envelope["MessageId"])]) == []
    assert consume_all(settings, settings.topic_action_tracked, settle=0.5) == []


def test_guest_like_shows_in_the_users_history_after_the_session_is_linked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    envelope = favorite_envelope(anonymous_id=anonymous)
    produce(settings, [envelope_record(settings.topic_favorite_added, envelope)])

    run_flow(build_flow, settings)
    [row] = action_rows(db, [uuid.UUID(envelope["MessageId"])])
    assert (row["anonymous_id"], row["user_id"]) == (anonymous, None)
    [tracked] = _tracked(settings, 1)
    assert tracked.payload.user_id is None
    history_before = db.execute(
        "SELECT id FROM user_activity.user_action_history WHERE history_user_id = %s", (user,)
    ).fetchall()
    db.execute(
        "UPDATE user_activity.sessions SET user_id = %s, linked_at = now() WHERE id = %s",
        (user, session),
    )

    history = db.execute(
        "SELECT id FROM user_activity.user_action_history WHERE history_user_id = %s", (user,)
    ).fetchall()

    assert history_before == []
    assert history == [(row["id"],)]


def test_a_guest_like_processed_after_the_sign_in_keeps_a_null_user_id_a_later_like_the_user(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """AC6 with lag: the row's UserId is the session's user as of the action (linked_at)."""
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    before_sign_in = datetime.now(UTC) - timedelta(minutes=5)
    guest_like = favorite_envelope(anonymous_id=anonymous, occurred_at=before_sign_in.isoformat())
    produce(settings, [envelope_record(settings.topic_favorite_added, guest_like)])
    # The sign-in is applied by the real session-linking flow before the like is processed.
    produce(settings, [envelope_record(settings.topic_user_signed_in, sign_in_envelope(
        user_id=user, anonymous_id=anonymous))])
    run_flow(build_session_linking_flow, settings)
    linked = db.execute(
        "SELECT user_id, linked_at FROM user_activity.sessions WHERE id = %s", (session,)
    ).fetchone()
    assert linked is not None and linked[0] == user
    signed_in_like = favorite_envelope(
        anonymous_id=anonymous, occurred_at=(linked[1] + timedelta(seconds=1)).isoformat())
    produce(settings, [envelope_record(settings.topic_favorite_added, signed_in_like)])

    run_flow(build_flow, settings)  # the guest like is processed only now, after the link

    rows = {r["source_message_id"]: r for r in action_rows(
        db, [uuid.UUID(guest_like["MessageId"]), uuid.UUID(signed_in_like["MessageId"])])}
    guest_row = rows[uuid.UUID(guest_like["MessageId"])]
    later_row = rows[uuid.UUID(signed_in_like["MessageId"])]
    assert (guest_row["session_id"], guest_row["user_id"]) == (session, None)
    assert (later_row["session_id"], later_row["user_id"]) == (session, user)
    tracked = {t.payload.favorite_id: t.payload for t in _tracked(settings, 2)}
    assert tracked[uuid.UUID(guest_like["Payload"]["FavoriteId"])].user_id is None
    assert tracked[uuid.UUID(signed_in_like["Payload"]["FavoriteId"])].user_id == user
    history = {row_id for (row_id,) in db.execute(
        "SELECT id FROM user_activity.user_action_history WHERE history_user_id = %s", (user,)
    ).fetchall()}
    assert history == {guest_row["id"], later_row["id"]}  # both, through the linked session


def test_two_workers_record_every_message_exactly_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    owners = [new_id() for _ in range(20)]
    for owner in owners:
        insert_session(db, anonymous_id=owner)
    envelopes = [favorite_envelope(anonymous_id=owners[i % 20]) for i in range(200)]
    produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in envelopes])
    produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in envelopes[:50]])

    run_flow(build_flow, settings, workers=2)

    assert len(action_rows(db, [uuid.UUID(e["MessageId"]) for e in envelopes])) == 200
    tracked = _tracked(settings, 200)
    assert len({t.message_id for t in tracked}) == 200


def _retries() -> float:
    return REGISTRY.get_sample_value("user_activity_favorites_retries_total") or 0.0


def test_a_schema_the_code_does_not_match_pauses_the_stream_and_dead_letters_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str
) -> None:
    """A rollout or rollback half done: a column the statement writes is missing (42703).

    A class 42 error comes from the fixed SQL, not from a message, so every message would fail
    alike: the stream pauses and retries (it used to isolate and dead-letter every message),
    and once the schema matches again it records them all.
    """
    settings = make_settings()
    owner = new_id()
    insert_session(db, anonymous_id=owner)
    envelopes = [favorite_envelope(anonymous_id=owner) for _ in range(5)]
    produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in envelopes])
    rename = "ALTER TABLE user_activity.outbox RENAME COLUMN {} TO {}"
    db.execute(rename.format("correlation_id", "correlation_id_elsewhere"))
    before = _retries()
    restored = threading.Event()

    def restore_after_three_retries() -> None:
        deadline = time.monotonic() + 60
        while _retries() < before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(rename.format("correlation_id_elsewhere", "correlation_id"))
        restored.set()

    restorer = threading.Thread(target=restore_after_three_retries, daemon=True)
    restorer.start()
    try:
        run_flow(build_flow, settings)
    finally:
        restorer.join(90)
    assert restored.is_set()
    assert _retries() >= before + 3
    assert len(action_rows(db, [uuid.UUID(e["MessageId"]) for e in envelopes])) == 5
    assert len(_tracked(settings, 5)) == 5
    assert consume_all(settings, settings.topic_favorites_dlq, settle=0.5) == []


def test_a_dedup_window_bound_of_one_id_still_records_every_redelivered_message_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(dedup_max_ids=1, source_batch_size=4)  # one id per shard's window
    anonymous = new_id()
    insert_session(db, anonymous_id=anonymous)
    sent = [favorite_envelope(anonymous_id=anonymous) for _ in range(12)]
    produce(settings, [envelope_record(settings.topic_favorite_added, e, partition=0)
                       for e in sent])
    produce(settings, [envelope_record(settings.topic_favorite_added, e, partition=1)
                       for e in sent])  # each one redelivered
    forgotten = ("user_activity_dedup_forgotten_early_total", {"flow": "favorites"})
    duplicates = ("user_activity_favorites_skipped_total", {"reason": "duplicate"})
    before = [REGISTRY.get_sample_value(*m) or 0.0 for m in (forgotten, duplicates)]

    run_flow(build_flow, settings)

    ids = [uuid.UUID(e["MessageId"]) for e in sent]
    assert len(action_rows(db, ids)) == 12
    tracked = _tracked(settings, 12)
    assert sorted(t.payload.favorite_id for t in tracked) == sorted(
        uuid.UUID(e["Payload"]["FavoriteId"]) for e in sent)  # each once, none twice
    after = [REGISTRY.get_sample_value(*m) or 0.0 for m in (forgotten, duplicates)]
    assert after[0] - before[0] >= 11  # the window held one id: the others it forgot early
    assert after[1] - before[1] == 12  # the redeliveries: by the window, the batch or the database
