"""SL1-SL3, redelivery, replay and AC6 end to end on real Kafka and PostgreSQL.

user-signed-in records on a real topic -> the real flow -> sessions rows + session events.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
import pytest
from pydantic import BaseModel

from dataflows.favorite_actions import build_flow as build_favorites_flow
from dataflows.session_linking import build_flow
from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.linking import LinkOutcome, SessionTopics
from dataflows.session_linking.store import SessionLinksStore
from devenv.harness.messages import dotnet_time, favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from runtime.settings import Settings
from schemas.kafka_record import SourceRecord
from schemas.sessions import SessionEndedEnvelope, SessionLinkedEnvelope, SessionStartedEnvelope
from tests.chaos import fail_sign_in_batches_of
from tests.conftest import SettingsFactory
from tests.support import (
    Consumed,
    Produced,
    action_rows,
    consume_all,
    envelope_record,
    produce,
    run_flow,
)

pytestmark = pytest.mark.e2e

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def sign_in(settings: Settings, envelope: dict[str, Any], **kwargs: Any) -> Produced:
    return envelope_record(settings.topic_user_signed_in, envelope, **kwargs)


def session_events(
    settings: Settings, *, linked: int = 0, started: int = 0, ended: int = 0
) -> dict[str, list[Consumed]]:
    """Everything on the three session topics: waits for the expected counts, then settles."""
    return {
        topic: consume_all(settings, topic, expect_at_least=expected, settle=0.5)
        for topic, expected in (
            (settings.topic_session_linked, linked),
            (settings.topic_session_started, started),
            (settings.topic_session_ended, ended),
        )
    }


def outbox_counts(db: psycopg.Connection[Any], settings: Settings) -> dict[str, int]:
    """Outbox rows written for each session topic of this test (published or not)."""
    rows = db.execute(
        "SELECT topic, count(*) FROM user_activity.outbox WHERE topic = ANY(%s) GROUP BY topic",
        ([settings.topic_session_linked, settings.topic_session_started,
          settings.topic_session_ended],),
    ).fetchall()
    return {topic: count for topic, count in rows}


def parsed(records: list[Consumed], model: type[BaseModel]) -> list[Any]:
    return [model.model_validate_json(r.value or b"") for r in records]


def session_row(db: psycopg.Connection[Any], session_id: uuid.UUID) -> dict[str, Any]:
    with db.cursor(row_factory=psycopg.rows.dict_row) as cur:
        row = cur.execute(
            "SELECT * FROM user_activity.sessions WHERE id = %s", (session_id,)
        ).fetchone()
    assert row is not None
    return row


def device_sessions(db: psycopg.Connection[Any], anonymous_id: uuid.UUID) -> list[dict[str, Any]]:
    with db.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return list(cur.execute(
            "SELECT * FROM user_activity.sessions WHERE anonymous_id = %s ORDER BY started_at, id",
            (anonymous_id,),
        ).fetchall())


def test_guest_sign_in_links_the_session_and_publishes_exactly_one_session_linked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    envelope = sign_in_envelope(user_id=user, anonymous_id=anonymous)
    produce(settings, [sign_in(settings, envelope, headers=(("traceparent", TRACEPARENT),))])

    run_flow(build_flow, settings)

    row = session_row(db, session)
    assert (row["user_id"], row["status"]) == (user, "Active")
    assert row["linked_at"] is not None
    linked_records = consume_all(settings, settings.topic_session_linked, expect_at_least=1)
    assert len(linked_records) == 1
    record = linked_records[0]
    assert record.key == str(session).encode()
    assert record.header("traceparent") == TRACEPARENT
    assert set(record.json()["Payload"]) == {"SessionId", "AnonymousId", "UserId", "LinkedAt"}
    linked = SessionLinkedEnvelope.model_validate_json(record.value or b"")
    assert (linked.payload.session_id, linked.payload.anonymous_id, linked.payload.user_id) == (
        session, anonymous, user,
    )
    assert linked.payload.linked_at == row["linked_at"]
    assert (linked.aggregate_id, linked.aggregate_type, linked.version) == (
        str(session), "Session", 1,
    )
    assert linked.correlation_id == "corr-sign-in"
    assert linked.message_id.version == 7
    others = session_events(settings, linked=1)
    assert others[settings.topic_session_started] == []
    assert others[settings.topic_session_ended] == []


def test_sign_in_of_the_same_user_again_changes_nothing_and_publishes_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous, user_id=user)
    before = session_row(db, session)
    signed_in_at = dotnet_time(datetime.now(UTC))
    produce(settings, [sign_in(settings, sign_in_envelope(
        user_id=user, anonymous_id=anonymous, signed_in_at=signed_in_at))])

    run_flow(build_flow, settings)

    after = session_row(db, session)
    # Only the device's last applied SignedInAt moves (it decides whether a later-arriving
    # sign-in is late); the session itself is unchanged.
    assert after.pop("last_signed_in_at") == datetime.fromisoformat(signed_in_at)
    assert {k: v for k, v in before.items() if k != "last_signed_in_at"} == after
    assert len(device_sessions(db, anonymous)) == 1
    assert outbox_counts(db, settings) == {}
    assert all(records == [] for records in session_events(settings).values())


def test_sign_in_of_another_user_ends_the_session_and_starts_a_new_linked_one(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, first_user, second_user = new_id(), new_id(), new_id()
    old = insert_session(db, anonymous_id=anonymous, user_id=first_user)
    produce(settings, [sign_in(
        settings, sign_in_envelope(user_id=second_user, anonymous_id=anonymous),
        headers=(("traceparent", TRACEPARENT),),
    )])

    run_flow(build_flow, settings)

    ended_row, new_row = device_sessions(db, anonymous)
    assert ended_row["id"] == old
    assert (ended_row["status"], ended_row["user_id"]) == ("Ended", first_user)
    assert ended_row["ended_at"] is not None
    assert (new_row["status"], new_row["user_id"]) == ("Active", second_user)
    assert new_row["linked_at"] is not None
    assert uuid.UUID(str(new_row["id"])).version == 7
    events = session_events(settings, started=1, ended=1)
    assert events[settings.topic_session_linked] == []
    [ended_record] = events[settings.topic_session_ended]
    [started_record] = events[settings.topic_session_started]
    assert ended_record.key == str(old).encode()
    assert started_record.key == str(new_row["id"]).encode()
    assert started_record.header("traceparent") == TRACEPARENT
    [ended] = parsed([ended_record], SessionEndedEnvelope)
    [started] = parsed([started_record], SessionStartedEnvelope)
    assert (ended.payload.session_id, ended.payload.user_id) == (old, first_user)
    assert ended.payload.ended_at == ended_row["ended_at"]
    assert (started.payload.session_id, started.payload.user_id) == (new_row["id"], second_user)
    assert started.payload.anonymous_id == anonymous
    assert started.aggregate_type == ended.aggregate_type == "Session"


def test_redelivered_sign_in_publishes_session_linked_only_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    envelope = sign_in_envelope(user_id=user, anonymous_id=anonymous)
    produce(settings, [sign_in(settings, envelope, partition=0),
                       sign_in(settings, envelope, partition=4)])
    run_flow(build_flow, settings)
    linked_at = session_row(db, session)["linked_at"]
    produce(settings, [sign_in(settings, envelope)])  # redelivered after a restart: full replay

    run_flow(build_flow, settings)

    assert session_row(db, session)["linked_at"] == linked_at
    assert outbox_counts(db, settings) == {settings.topic_session_linked: 1}
    events = session_events(settings, linked=1)
    assert len(events[settings.topic_session_linked]) == 1
    assert events[settings.topic_session_started] == []
    assert events[settings.topic_session_ended] == []


def test_replayed_old_sign_in_does_not_end_the_newer_session(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, first_user, second_user = new_id(), new_id(), new_id()
    guest = insert_session(db, anonymous_id=anonymous)
    first = sign_in_envelope(user_id=first_user, anonymous_id=anonymous)
    second = sign_in_envelope(user_id=second_user, anonymous_id=anonymous)
    produce(settings, [sign_in(settings, first)])
    run_flow(build_flow, settings)
    produce(settings, [sign_in(settings, second)])
    run_flow(build_flow, settings)
    produce(settings, [sign_in(settings, first)])  # a backfill replays the old sign-in

    run_flow(build_flow, settings)

    sessions = device_sessions(db, anonymous)
    assert [(s["id"] == guest, s["status"], s["user_id"]) for s in sessions] == [
        (True, "Ended", first_user),
        (False, "Active", second_user),
    ]
    assert outbox_counts(db, settings) == {
        settings.topic_session_linked: 1,
        settings.topic_session_started: 1,
        settings.topic_session_ended: 1,
    }
    events = session_events(settings, linked=1, started=1, ended=1)
    assert len(events[settings.topic_session_linked]) == 1
    assert len(events[settings.topic_session_ended]) == 1
    assert len(events[settings.topic_session_started]) == 1


def test_sign_in_on_a_device_without_a_session_starts_a_linked_session(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    insert_session(db, anonymous_id=anonymous, status="Ended")
    produce(settings, [sign_in(settings, sign_in_envelope(user_id=user, anonymous_id=anonymous))])

    run_flow(build_flow, settings)

    active = [s for s in device_sessions(db, anonymous) if s["status"] == "Active"]
    assert len(active) == 1
    assert active[0]["user_id"] == user
    assert active[0]["linked_at"] is not None
    events = session_events(settings, started=1)
    assert events[settings.topic_session_linked] == []
    assert events[settings.topic_session_ended] == []
    [started] = parsed(events[settings.topic_session_started], SessionStartedEnvelope)
    assert (started.payload.session_id, started.payload.anonymous_id, started.payload.user_id) == (
        active[0]["id"], anonymous, user,
    )
    assert started.payload.started_at == active[0]["started_at"]


def test_guest_likes_show_in_the_users_history_after_the_sign_in_is_processed(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    insert_session(db, anonymous_id=anonymous)
    likes = [favorite_envelope(anonymous_id=anonymous) for _ in range(2)]
    produce(settings, [envelope_record(settings.topic_favorite_added, e) for e in likes])
    run_flow(build_favorites_flow, settings)
    rows = action_rows(db, [uuid.UUID(e["MessageId"]) for e in likes])
    assert [r["user_id"] for r in rows] == [None, None]
    history_query = (
        "SELECT id FROM user_activity.user_action_history WHERE history_user_id = %s ORDER BY id"
    )
    assert db.execute(history_query, (user,)).fetchall() == []
    produce(settings, [sign_in(settings, sign_in_envelope(user_id=user, anonymous_id=anonymous))])

    run_flow(build_flow, settings)

    history = db.execute(history_query, (user,)).fetchall()
    assert history == sorted((r["id"],) for r in rows)
    unchanged = action_rows(db, [uuid.UUID(e["MessageId"]) for e in likes])
    assert [r["user_id"] for r in unchanged] == [None, None]  # no backfill of the rows


def test_undecodable_sign_ins_go_to_the_dlq_and_the_others_are_linked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    missing_device = sign_in_envelope(user_id=user, anonymous_id=anonymous)
    del missing_device["Payload"]["AnonymousId"]
    produce(settings, [
        Produced(settings.topic_user_signed_in, b"k1", b"{not json",
                 (("traceparent", TRACEPARENT),), partition=1),
        Produced(settings.topic_user_signed_in, b"k2", orjson.dumps(missing_device), partition=1),
        sign_in(settings, sign_in_envelope(user_id=user, anonymous_id=anonymous), partition=1),
    ])

    run_flow(build_flow, settings)

    assert session_row(db, session)["user_id"] == user
    letters = consume_all(settings, settings.topic_session_linking_dlq, expect_at_least=2)
    by_key = {letter.key: letter for letter in letters}
    assert set(by_key) == {b"k1", b"k2"}
    assert by_key[b"k1"].value == b"{not json"
    assert by_key[b"k1"].header("x-dlq-reason") == b"invalid-json"
    assert by_key[b"k1"].header("traceparent") == TRACEPARENT
    assert by_key[b"k1"].header("x-source-topic") == settings.topic_user_signed_in.encode()
    assert by_key[b"k2"].header("x-dlq-reason") == b"schema-mismatch"
    assert len(consume_all(settings, settings.topic_session_linked, expect_at_least=1)) == 1


def test_a_sign_in_at_no_moment_of_years_1_to_9999_in_utc_is_dead_lettered_and_the_device_links_on(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    # .NET's default(DateTime) as a DateTimeOffset on a Moscow server: a moment of 1 BC, which
    # PostgreSQL stores and Python cannot read back. Applied, it became the device's last
    # SignedInAt and every later sign-in of the device was dead-lettered.
    settings = make_settings()
    anonymous, bogus_user, user = new_id(), new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    produce(settings, [
        sign_in(settings, sign_in_envelope(user_id=bogus_user, anonymous_id=anonymous,
                                           signed_in_at="0001-01-01T00:00:00+03:00")),
        sign_in(settings, sign_in_envelope(user_id=user, anonymous_id=anonymous)),
    ])

    run_flow(build_flow, settings)

    row = session_row(db, session)
    assert (row["user_id"], row["status"]) == (user, "Active")
    letters = consume_all(settings, settings.topic_session_linking_dlq, expect_at_least=1,
                          settle=0.5)
    assert [(letter.key, letter.header("x-dlq-reason")) for letter in letters] == [
        (str(bogus_user).encode(), b"schema-mismatch")]
    assert len(consume_all(settings, settings.topic_session_linked, expect_at_least=1)) == 1


def test_two_workers_link_every_device_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    devices = [(new_id(), new_id()) for _ in range(30)]
    sessions = [insert_session(db, anonymous_id=anonymous) for anonymous, _ in devices]
    envelopes = [sign_in_envelope(user_id=u, anonymous_id=a) for a, u in devices]
    produce(settings, [sign_in(settings, e) for e in envelopes + envelopes[:10]])

    run_flow(build_flow, settings, workers=2)

    assert [session_row(db, s)["user_id"] for s in sessions] == [u for _, u in devices]
    linked = parsed(
        consume_all(settings, settings.topic_session_linked, expect_at_least=30),
        SessionLinkedEnvelope,
    )
    assert sorted(str(e.payload.session_id) for e in linked) == sorted(str(s) for s in sessions)


def test_concurrent_sign_ins_on_one_guest_session_link_it_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str
) -> None:
    settings = make_settings()
    topics = SessionTopics(
        settings.topic_session_linked, settings.topic_session_started, settings.topic_session_ended
    )
    rounds = 10
    guests = [(new_id(), new_id(), new_id()) for _ in range(rounds)]
    sessions = [insert_session(db, anonymous_id=anonymous) for anonymous, _, _ in guests]
    results: dict[int, list[LinkOutcome]] = {i: [] for i in range(rounds)}

    at = dotnet_time(datetime.now(UTC))  # one instant: the two are in no defined order

    def message(anonymous: uuid.UUID, user: uuid.UUID) -> SignInMessage:
        value = orjson.dumps(sign_in_envelope(user_id=user, anonymous_id=anonymous,
                                              signed_in_at=at))
        decoded = decode_sign_in(SourceRecord(settings.topic_user_signed_in, 0, 0, None, value))
        assert isinstance(decoded, SignInMessage)
        return decoded

    def link(index: int, user: uuid.UUID, barrier: threading.Barrier) -> None:
        anonymous = guests[index][0]
        with psycopg.connect(database_url, autocommit=True) as conn:
            barrier.wait()
            [result] = SessionLinksStore(topics).link_batch(
                conn, [message(anonymous, user)]).results
            results[index].append(result.outcome)

    for index, (_anonymous, first_user, second_user) in enumerate(guests):
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=link, args=(index, u, barrier))
                   for u in (first_user, second_user)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

    try:
        for index, (anonymous, _first, _second) in enumerate(guests):
            assert sorted(results[index]) == sorted([LinkOutcome.LINKED, LinkOutcome.RELINKED])
            rows = device_sessions(db, anonymous)
            assert [r["status"] for r in rows] == ["Ended", "Active"]
            assert rows[0]["id"] == sessions[index]
        linked = db.execute(
            "SELECT count(*), count(DISTINCT key) FROM user_activity.outbox WHERE topic = %s",
            (settings.topic_session_linked,),
        ).fetchone()
        assert linked == (rounds, rounds)
    finally:  # these rows are not this test's to publish
        db.execute(
            "DELETE FROM user_activity.outbox WHERE topic = ANY(%s)",
            ([topics.linked, topics.started, topics.ended],),
        )


def test_a_sign_in_failing_three_times_is_dead_lettered_and_its_batch_mates_are_linked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings()
    good_device, poison_device, user = new_id(), new_id(), new_id()
    good_session = insert_session(db, anonymous_id=good_device)
    poison_session = insert_session(db, anonymous_id=poison_device)
    poison = sign_in_envelope(user_id=user, anonymous_id=poison_device)
    fail_sign_in_batches_of(monkeypatch, poison_device)
    produce(settings, [
        sign_in(settings, sign_in_envelope(user_id=user, anonymous_id=good_device), partition=2),
        sign_in(settings, poison, partition=2),
    ])

    run_flow(build_flow, settings)

    assert session_row(db, good_session)["user_id"] == user
    assert session_row(db, poison_session)["user_id"] is None
    [letter] = consume_all(settings, settings.topic_session_linking_dlq, expect_at_least=1)
    assert letter.json()["MessageId"] == poison["MessageId"]
    assert letter.header("x-dlq-reason") == b"processing-error"
    assert letter.header("x-exception-type") == b"RuntimeError"
    assert letter.header("x-attempts") == b"3"
    assert len(consume_all(settings, settings.topic_session_linked, expect_at_least=1)) == 1


def test_a_transient_database_failure_is_retried_and_nothing_is_dead_lettered(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    session = insert_session(db, anonymous_id=anonymous)
    link_batch = SessionLinksStore.link_batch
    failures = iter([psycopg.errors.SerializationFailure("x"), psycopg.OperationalError("down")])

    def flaky(store: SessionLinksStore, conn: Any, messages: list[SignInMessage]) -> Any:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return link_batch(store, conn, messages)

    monkeypatch.setattr(SessionLinksStore, "link_batch", flaky)
    produce(settings, [sign_in(settings, sign_in_envelope(user_id=user, anonymous_id=anonymous))])

    run_flow(build_flow, settings)

    assert session_row(db, session)["user_id"] == user
    assert len(consume_all(settings, settings.topic_session_linked, expect_at_least=1)) == 1
    assert consume_all(settings, settings.topic_session_linking_dlq, settle=0.5) == []


def test_a_sign_in_replayed_after_its_mark_expired_starts_no_second_session(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, user = new_id(), new_id()
    guest = insert_session(db, anonymous_id=anonymous,
                           last_activity_at=datetime.now(UTC) - timedelta(days=2))
    envelope = sign_in_envelope(user_id=user, anonymous_id=anonymous,
                                signed_in_at=dotnet_time(datetime.now(UTC) - timedelta(days=2)))
    produce(settings, [sign_in(settings, envelope)])
    run_flow(build_flow, settings)
    # days later: the session service ended the session, and the retention dropped the mark
    db.execute("UPDATE user_activity.sessions SET status = 'Ended', ended_at = now()"
               " WHERE id = %s", (guest,))
    db.execute("DELETE FROM user_activity.consumer_idempotency_marks WHERE key = %s",
               (f"user-activity-signed-in:{envelope['MessageId']}",))
    produce(settings, [sign_in(settings, envelope)])  # a backfill replays the old sign-in

    run_flow(build_flow, settings)

    sessions = device_sessions(db, anonymous)
    assert [(s["id"], s["status"], s["user_id"]) for s in sessions] == [(guest, "Ended", user)]
    assert outbox_counts(db, settings) == {settings.topic_session_linked: 1}
    events = session_events(settings, linked=1)
    assert len(events[settings.topic_session_linked]) == 1
    assert events[settings.topic_session_started] == []


def test_two_users_signed_in_at_one_instant_replayed_after_their_marks_expired_change_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    anonymous, first, second = new_id(), new_id(), new_id()
    insert_session(db, anonymous_id=anonymous,
                   last_activity_at=datetime.now(UTC) - timedelta(days=2))
    at = dotnet_time(datetime.now(UTC) - timedelta(days=2))
    envelopes = [sign_in_envelope(user_id=u, anonymous_id=anonymous, signed_in_at=at)
                 for u in (first, second)]
    produce(settings, [sign_in(settings, e) for e in envelopes])  # the same SignedInAt
    run_flow(build_flow, settings)  # one links the guest session, the other relinks
    before = device_sessions(db, anonymous)
    db.execute("UPDATE user_activity.sessions SET status = 'Ended', ended_at = now()"
               " WHERE anonymous_id = %s AND status = 'Active'", (anonymous,))
    db.execute("DELETE FROM user_activity.consumer_idempotency_marks WHERE key = ANY(%s)",
               ([f"user-activity-signed-in:{e['MessageId']}" for e in envelopes],))
    produce(settings, [sign_in(settings, e) for e in envelopes])  # replayed days later

    run_flow(build_flow, settings)

    after = device_sessions(db, anonymous)
    assert [(s["id"], s["status"]) for s in after] == [(s["id"], "Ended") for s in before]
    assert outbox_counts(db, settings) == {
        settings.topic_session_linked: 1, settings.topic_session_started: 1,
        settings.topic_session_ended: 1}
