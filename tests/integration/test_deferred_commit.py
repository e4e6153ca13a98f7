"""The favorites sink's deferred commits against a real PostgreSQL.

A batch of at least ``sink_defer_min_batch`` messages is sent and ``write_batch`` returns before
the commit; the next ``write_batch`` (a tick, at the latest), ``snapshot()`` and ``close()`` wait
for it. A deferred
insert that fails is written again synchronously. A lock held by another connection on the
outbox table keeps the sent insert waiting inside PostgreSQL, so "not yet committed" is
observable.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import psycopg
import pytest

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.sink import _ActionHistoryPartition
from dataflows.favorite_actions.store import FavoritesStore
from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import insert_session
from runtime.process import Process
from runtime.settings import Settings
from runtime.ticks import TICK
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks import deferred_statement
from sinks.binary_codec import Int4Array, int4_element
from tests.chaos import outbox_locked as lock_outbox

pytestmark = pytest.mark.integration

ADDED = "favorite-added"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES}


def _messages(db: psycopg.Connection[Any], count: int) -> list[FavoriteMessage]:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    messages = []
    for offset in range(count):
        value = orjson.dumps(favorite_envelope(anonymous_id=device))
        message = decode_favorite(SourceRecord(ADDED, 0, offset, b"k", value), ACTION_TYPES)
        assert isinstance(message, FavoriteMessage)
        messages.append(message)
    return messages


def _recorded(database_url: str, messages: list[FavoriteMessage]) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM user_activity.action_events WHERE source_message_id = ANY(%s)",
            ([m.message_id for m in messages],),
        ).fetchone()
        return int(row[0]) if row else -1


@pytest.fixture
def outbox_locked(database_url: str) -> Iterator[threading.Event]:
    """Holds SHARE mode on the outbox (inserts wait) until the yielded event is set."""
    with lock_outbox(database_url) as release:
        yield release


def _partition(database_url: str, **overrides: Any) -> _ActionHistoryPartition:
    settings = Settings(
        database_url=database_url,
        kafka_bootstrap_servers="127.0.0.1:1",  # never used: no poison, no outbox publisher
        outbox_enabled=False,
        http_port=0,
        topic_action_tracked="t.deferred.action-tracked",
        **overrides,
    )
    return _ActionHistoryPartition(settings, Process(), None, f"deferred-{uuid.uuid4().hex[:6]}")


def _in_thread(call: Any) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_send_then_finish_records_like_record_batch(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    messages = _messages(db, 5)
    store = FavoritesStore("t.deferred.action-tracked")
    with psycopg.connect(database_url, autocommit=True) as conn:
        sent = store.send_batch(conn, [*messages, messages[0]])
        outcome = store.finish_batch(conn, sent)
        again = store.finish_batch(conn, store.send_batch(conn, messages))

    assert [a.message for a in outcome.recorded] == messages
    assert outcome.duplicates == [messages[0]]
    assert again.recorded == [] and again.duplicates == messages  # idempotent
    assert _recorded(database_url, messages) == 5


@pytest.mark.parametrize("deferred", [True, False], ids=["send-finish", "record_batch"])
def test_a_batch_sent_as_new_that_holds_a_recorded_message_is_written_again_whole(
    db: psycopg.Connection[Any], database_url: str, deferred: bool
) -> None:
    messages = _messages(db, 6)
    store = FavoritesStore("t.deferred.action-tracked")

    def write(conn: psycopg.Connection[Any], batch: list[FavoriteMessage]) -> Any:
        if deferred:
            return store.finish_batch(conn, store.send_batch(conn, batch))
        return store.record_batch(conn, batch)

    with psycopg.connect(database_url, autocommit=True) as conn:
        first = write(conn, messages[:2])  # new messages only: no ON CONFLICT, it passes
        # one recorded before (mark and source_message_id): sent as new, it conflicts, and
        # the batch goes again with ON CONFLICT; the next one goes with it at once
        mixed = write(conn, [messages[1], *messages[2:4]])
        third = write(conn, [messages[3], messages[4]])
        fourth = write(conn, [messages[5]])  # sent as new again (ConflictGuess)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    assert [a.message for a in first.recorded] == messages[:2]
    assert [a.message for a in mixed.recorded] == messages[2:4]
    assert mixed.duplicates == [messages[1]]
    assert [a.message for a in third.recorded] == [messages[4]]
    assert third.duplicates == [messages[3]]
    assert [a.message for a in fourth.recorded] == [messages[5]]
    assert _recorded(database_url, messages) == 6
    counts = db.execute(
        """SELECT (SELECT count(*) FROM user_activity.consumer_idempotency_marks
                    WHERE key = ANY(%(keys)s)),
                  (SELECT count(*) FROM user_activity.outbox o
                     JOIN user_activity.action_events e ON e.id = o.action_event_id
                    WHERE e.source_message_id = ANY(%(ids)s))""",
        {"keys": [m.idempotency_key for m in messages], "ids": [m.message_id for m in messages]},
    ).fetchone()
    assert counts == (6, 6)  # one mark and one outbox row each: the failed attempts left none


def test_a_large_batch_commits_by_the_snapshot_barrier(
    db: psycopg.Connection[Any], database_url: str, outbox_locked: threading.Event
) -> None:
    messages = _messages(db, 20)
    part = _partition(database_url, sink_defer_min_batch=10)
    try:
        part.write_batch(messages)  # sent; the insert waits for the outbox lock
        assert _recorded(database_url, messages) == 0
        snapped = _in_thread(part.snapshot)
        assert not snapped.wait(0.5)  # the epoch cannot close while the batch is uncommitted
        outbox_locked.set()
        assert snapped.wait(10)
        assert _recorded(database_url, messages) == 20
    finally:
        outbox_locked.set()
        part.close()


def test_a_small_batch_commits_before_write_batch_returns(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    messages = _messages(db, 5)
    part = _partition(database_url, sink_defer_min_batch=10)
    try:
        part.write_batch(messages)
        assert _recorded(database_url, messages) == 5
    finally:
        part.close()


def test_a_tick_finishes_the_batch_in_flight_when_no_write_follows(
    db: psycopg.Connection[Any], database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    messages = _messages(db, 20)
    part = _partition(database_url, sink_defer_min_batch=10)
    try:
        with caplog.at_level(logging.INFO):
            part.write_batch(messages)  # deferred
            assert "recorded" not in [r.getMessage() for r in caplog.records]
            part.write_batch([TICK])  # the input is caught up: only ticks follow
            assert part._in_flight is None
            assert [r.getMessage() for r in caplog.records].count("recorded") == 20
        assert _recorded(database_url, messages) == 20
    finally:
        part.close()


def test_the_next_write_batch_and_close_wait_for_the_batch_in_flight(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    first, second = _messages(db, 10), _messages(db, 10)
    part = _partition(database_url, sink_defer_min_batch=10)
    part.write_batch(first)
    part.write_batch(second)  # first waits for the commit of the batch in flight
    assert _recorded(database_url, first) == 10
    part.close()
    assert _recorded(database_url, second) == 10


def test_a_broken_deferred_insert_is_written_again_synchronously(
    db: psycopg.Connection[Any], database_url: str, outbox_locked: threading.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    messages = _messages(db, 12)
    part = _partition(database_url, sink_defer_min_batch=10, retry_initial_seconds=0.05)
    try:
        part.write_batch(messages)
        db.execute(  # the sink's connection dies with its insert waiting for the lock
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()",
            (part._db._application_name,),
        )
        outbox_locked.set()
        with caplog.at_level(logging.WARNING):
            part.snapshot()
        assert _recorded(database_url, messages) == 12
        assert "deferred-write-failed" in [r.getMessage() for r in caplog.records]
    finally:
        outbox_locked.set()
        part.close()


def test_a_failed_statement_raises_its_sqlstate(database_url: str) -> None:
    statement = deferred_statement.Positional.of("SELECT 1 / (%(zero)b::int[])[1]")
    zero = Int4Array([int4_element(0)], 1)
    with psycopg.connect(database_url, autocommit=True) as conn:
        deferred_statement.send(conn, statement, {"zero": zero})
        with pytest.raises(psycopg.errors.DivisionByZero):
            deferred_statement.finish(conn)
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection is usable again
