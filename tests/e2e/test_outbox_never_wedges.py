"""The outbox never wedges: refused rows are parked, a failed loop restarts, stalls are seen."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)
from prometheus_client import REGISTRY

from cli.topics import ensure_topics
from devenv.harness.env import base_env, settings_env
from devenv.harness.jobs import ROOT
from runtime.metrics import OUTBOX_PARKED
from runtime.process import Process
from runtime.shutdown import Shutdown
from schemas.outbox import OutboxRow
from sinks.outbox import (
    LeaseLostError,
    OutboxPublisher,
    OutboxWatchdog,
    parked_rows,
    requeue_parked,
)
from sinks.outbox.table import read_cache, write_cache
from sinks.outbox.window import Target
from tests.conftest import SettingsFactory
from tests.support import consume_all, start_publisher

pytestmark = pytest.mark.e2e


def _rows(topic: str, count: int, *, big: dict[int, int] | None = None) -> list[OutboxRow]:
    """``count`` rows; ``big[i]`` makes row i's value that many (incompressible) bytes."""
    rows = []
    for i in range(count):
        size = (big or {}).get(i)
        value = os.urandom(size) if size else orjson.dumps({"n": i})
        rows.append(OutboxRow(uuid.uuid4(), topic, f"key-{i}".encode(), value, {}))
    return rows


def _insert(db: psycopg.Connection[Any], rows: list[OutboxRow], age_s: float = 60) -> int:
    """Insert ``rows`` as committed ``age_s`` seconds ago (a crash left them unpublished).

    One transaction; its txid.
    """
    with db.transaction(), db.cursor() as cur:
        cur.executemany(
            """INSERT INTO user_activity.outbox (id, topic, key, value, headers, created_at)
               VALUES (%s, %s, %s, %s, '{}'::jsonb, now() - make_interval(secs => %s))""",
            [(r.id, r.topic, r.key, r.value, age_s) for r in rows],
        )
        txid = cur.execute("SELECT pg_current_xact_id()::text").fetchone()
    assert txid is not None
    return int(txid[0])


def _state(db: psycopg.Connection[Any], rows: list[OutboxRow]) -> dict[uuid.UUID, tuple[Any, ...]]:
    """``id -> (published, parked, attempts, last_error)`` (parked rows: in outbox_parked)."""
    found = db.execute(
        """SELECT o.id,
                  NOT EXISTS (SELECT 1 FROM user_activity.outbox_unpublished u WHERE u.id = o.id)
                  AND (p.id IS NULL OR p.published_at IS NOT NULL),
                  p.id IS NOT NULL AND p.requeued_at IS NULL AND p.published_at IS NULL,
                  coalesce(p.attempts, 0), p.last_error
             FROM user_activity.outbox o
             LEFT JOIN user_activity.outbox_parked p ON p.id = o.id
            WHERE o.id = ANY(%s)""",
        ([r.id for r in rows],),
    ).fetchall()
    return {row[0]: row[1:] for row in found}


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _small_topic(admin: AdminClient, topic: str) -> str:
    """A 1-partition topic taking records of at most 20,000 bytes, once it has a leader.

    (A consumer assigned before the leader exists may reset to the end and miss records.)
    """
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "20000"})])[
        topic].result(30)
    deadline = time.monotonic() + 30
    while True:
        partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
        if partitions and all(p.leader >= 0 for p in partitions.values()):
            return topic
        assert time.monotonic() < deadline, f"{topic} has no leader"
        time.sleep(0.1)


def _parked(topic: str) -> float:
    return float(OUTBOX_PARKED.labels(topic=topic)._value.get())


def test_a_row_the_broker_refuses_is_parked_and_every_row_behind_it_is_published(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    topic = settings.topic_action_tracked
    rows = _rows(topic, 30, big={10: 2_500_000})  # over the producer's 1 MB limit
    _insert(db, rows)
    parked_before = _parked(topic)
    publisher = OutboxPublisher(settings, process=Process())

    stop = start_publisher(publisher)
    consumed = consume_all(settings, topic, expect_at_least=29, timeout=30)
    _wait(lambda: _state(db, rows)[rows[10].id][1], 10, "the big row to be parked")
    stop()

    assert sorted(c.key or b"" for c in consumed) == sorted(
        r.key for i, r in enumerate(rows) if i != 10
    )
    state = _state(db, rows)
    assert all(state[r.id][0] for i, r in enumerate(rows) if i != 10)
    assert state[rows[10].id] == (False, True, 1, "MSG_SIZE_TOO_LARGE")
    assert _parked(topic) == parked_before + 1
    assert [row[0] for row in parked_rows(db) if row[1] == topic] == [rows[10].id]


def test_a_cache_update_on_a_stale_generation_moves_nothing(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """The watermark cache is written only on the generation its holder last wrote.

    A former lease holder (another moved it since) gets LeaseLostError and changes nothing.
    """
    cache = read_cache(db)
    ahead = cache.progress.window_done(cache.progress.delivered)
    with pytest.raises(LeaseLostError):
        write_cache(db, ahead, cache.generation - 1)
    assert read_cache(db) == cache
    assert write_cache(db, ahead, cache.generation) == cache.generation + 1
    assert read_cache(db).generation == cache.generation + 1


def test_a_row_set_aside_before_a_crash_is_never_sent_by_a_window(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """A row parked or held in PostgreSQL whose transaction never committed in Kafka.

    The publisher died between setting the rows aside and its Kafka commit: the next window
    reads them again, and sends neither (the held one goes from the held rows, once).
    """
    settings = make_settings()
    topic = settings.topic_action_tracked
    parked, held, plain = _rows(topic, 3)
    _insert(db, [parked, held, plain])
    db.execute("INSERT INTO user_activity.outbox_parked (id, topic, key, value, created_at,"
               " attempts, last_error) VALUES (%s, %s, %s, %s, now(), 1, 'MSG_SIZE_TOO_LARGE')",
               (parked.id, topic, parked.key, parked.value))
    db.execute("INSERT INTO user_activity.outbox_held (id, topic, key, value, created_at,"
               " last_error) VALUES (%s, %s, %s, %s, now(), 'TOPIC_AUTHORIZATION_FAILED')",
               (held.id, topic, held.key, held.value))
    publisher = OutboxPublisher(settings, process=Process())
    try:
        assert publisher.drain() == 2  # the plain row by a window, the held one from aside
    finally:
        publisher.close()

    consumed = consume_all(settings, topic, expect_at_least=2, settle=2.0)
    assert sorted(c.key or b"" for c in consumed) == sorted([held.key, plain.key])


def test_an_offered_row_the_broker_refuses_is_parked_on_the_fast_path(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_idle_poll_seconds=30)  # no poll in time: only the offer
    topic = settings.topic_action_tracked
    rows = _rows(topic, 5, big={2: 1_500_000})
    txid = _insert(db, rows, age_s=0)
    publisher = OutboxPublisher(settings, process=Process())

    stop = start_publisher(publisher)
    _wait(lambda: publisher.holds_lease, 30, "the lease")
    time.sleep(1.0)  # the start's window is done: the fast path is on
    publisher.offer(txid, rows)
    consumed = consume_all(settings, topic, expect_at_least=4, timeout=30)
    _wait(lambda: _state(db, rows)[rows[2].id][1], 10, "the big row to be parked")
    stop()

    assert len(consumed) == 4
    assert _state(db, rows)[rows[2].id] == (False, True, 1, "MSG_SIZE_TOO_LARGE")


def test_requeue_publishes_a_parked_row_once_the_topic_accepts_it(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str
) -> None:
    settings = make_settings()
    admin = AdminClient(settings.kafka_client_config())
    small = _small_topic(admin, f"{settings.topic_action_tracked}.small")
    row = _rows(small, 1, big={0: 60_000})  # the broker refuses it: over the topic's limit
    _insert(db, row)
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    try:
        _wait(lambda: _state(db, row)[row[0].id][1], 30, "the row to be parked")
        assert _state(db, row)[row[0].id][3] == "MSG_SIZE_TOO_LARGE"
        # the operator fixes the cause, then re-queues the row with the operator command
        resource = ConfigResource(
            ConfigResource.Type.TOPIC, small,
            incremental_configs=[ConfigEntry("max.message.bytes", "2000000",
                                             incremental_operation=AlterConfigOpType.SET)],
        )
        for future in admin.incremental_alter_configs([resource]).values():
            future.result(30)
        env = {**base_env(), **settings_env(settings)}
        done = subprocess.run(
            [sys.executable, "-m", "cli", "outbox", "requeue", "--id", str(row[0].id)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
        )
        assert "requeued 1 parked outbox row(s)" in done.stdout
        _wait(lambda: _state(db, row)[row[0].id][0], 30, "the requeued row to be published")
    finally:
        stop()
    assert [c.value for c in consume_all(settings, small, expect_at_least=1)] == [row[0].value]
    assert _state(db, row)[row[0].id][:3] == (True, False, 1)


def test_batch_mates_of_a_row_the_broker_refuses_are_published_not_parked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    admin = AdminClient(settings.kafka_client_config())
    small = _small_topic(admin, f"{settings.topic_action_tracked}.small")
    rows = _rows(small, 12, big={5: 60_000})  # the broker refuses the whole batch for row 5
    _insert(db, rows)
    publisher = OutboxPublisher(settings, process=Process())

    stop = start_publisher(publisher)
    consumed = consume_all(settings, small, expect_at_least=11, timeout=30)
    _wait(lambda: _state(db, rows)[rows[5].id][1], 10, "row 5 to be parked")
    stop()

    state = _state(db, rows)
    assert sorted(c.key or b"" for c in consumed) == sorted(
        r.key for i, r in enumerate(rows) if i != 5
    )
    assert [r.id for r in rows if state[r.id][1]] == [rows[5].id]
    assert all(state[r.id][0] for i, r in enumerate(rows) if i != 5)


def test_an_exception_inside_the_publish_loop_is_logged_once_and_restarts_the_job(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(retry_initial_seconds=0.2)
    topic = settings.topic_action_tracked
    stopping = Shutdown()
    publisher = OutboxPublisher(settings, process=Process(stopping=stopping))

    def failing(target: Target) -> int:
        raise RuntimeError("injected fault inside the publish loop")

    publisher._send_window = failing  # type: ignore[method-assign]
    rows = _rows(topic, 20)
    _insert(db, rows)

    publisher.run(threading.Event())  # returns: the job stops, to be started again
    publisher.close()
    restarted = OutboxPublisher(settings, process=Process())  # the next start's
    stop = start_publisher(restarted)
    consumed = consume_all(settings, topic, expect_at_least=20, timeout=30)
    stop()

    assert stopping.requested()  # a clean stop; its end (Shutdown.finish) exits 75
    assert stopping.signal == "the outbox publisher failed: RuntimeError"
    [failed] = [r for r in caplog.records if r.getMessage() == "outbox-publisher-failed"]
    assert failed.exc_info is not None and "injected fault" in str(failed.exc_info[1])
    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)


def test_readyz_reports_the_stall_while_a_committed_row_waits_unpublished(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_stall_seconds=2)
    rows = _rows(settings.topic_action_tracked, 1)
    _insert(db, rows, age_s=10)  # older than the threshold, and nobody publishes it
    process = Process()
    watchdog = OutboxWatchdog(settings, process=process)
    try:
        _wait(lambda: _measured(watchdog, process) == "stalled", 10, "the stall to be reported")
        assert "oldest unpublished outbox row" in dict(process.health.snapshot().stalled)["outbox"]
        # a publisher moves the watermark past it
        db.execute("UPDATE user_activity.outbox_watermark SET delivered = pg_current_snapshot(),"
                   " target = NULL, after_txid = NULL, after_id = NULL,"
                   " generation = generation + 1")
        _wait(lambda: _measured(watchdog, process) != "stalled", 10, "the stall to clear")
    finally:
        watchdog.close()


def _measured(watchdog: OutboxWatchdog, process: Process) -> str:
    """What the composition root's housekeeping does every few seconds: the health state after."""
    watchdog.measure()
    return process.health.snapshot().state


def test_a_requeued_row_whose_topic_is_gone_does_not_stop_the_other_rows(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """A requeued row whose topic is missing is held back for that topic alone.

    An operator requeued a parked row whose topic was deleted since: every send of it fails
    (retried with back-off, never parked again, never dropped); the other rows still go.
    """
    settings = make_settings()
    gone = f"{settings.topic_action_tracked}.gone"  # never created
    [stuck] = _rows(gone, 1)
    db.execute(
        "INSERT INTO user_activity.outbox_parked (id, topic, key, value, created_at, attempts,"
        " last_error) VALUES (%s, %s, %s, %s, now(), 1, 'MSG_SIZE_TOO_LARGE')",
        (stuck.id, stuck.topic, stuck.key, stuck.value))
    assert requeue_parked(db, [stuck.id]) == 1  # held for its topic, which does not exist
    rows = _rows(settings.topic_action_tracked, 20)
    _insert(db, rows)
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    try:
        consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=20,
                               timeout=20)
        _wait(lambda: all(state[0] for state in _state(db, rows).values()), 10,
              "the rows to be behind the watermark")
        held = db.execute("SELECT topic FROM user_activity.outbox_held WHERE id = %s",
                          (stuck.id,)).fetchall()
    finally:
        stop()
        db.execute("DELETE FROM user_activity.outbox_held WHERE id = %s", (stuck.id,))
        db.execute("DELETE FROM user_activity.outbox_parked WHERE id = %s", (stuck.id,))
    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)
    assert held == [(gone,)]


def test_a_watermark_copied_from_another_cluster_is_reset_and_every_row_is_sent(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watermark ahead of the server's transaction ids is reset: nothing is taken as sent.

    The database was copied logically (pg_dump and restore): the watermark came with it, the
    transaction ids started again below it, and every new row would look published. The reset
    makes every row of the table unpublished.
    """
    settings = make_settings()
    db.execute("UPDATE user_activity.outbox_watermark SET delivered ="
               " (x || ':' || x || ':')::pg_snapshot FROM (SELECT"
               " (pg_snapshot_xmax(pg_current_snapshot())::text::bigint + 1000000)::text"
               " AS x) ahead WHERE id = 1")
    rows = _rows(settings.topic_action_tracked, 10)
    _insert(db, rows)
    publisher = OutboxPublisher(settings, process=Process())
    try:
        with caplog.at_level(logging.ERROR, logger="sinks.outbox"):
            stop = start_publisher(publisher)
            consumed = consume_all(settings, settings.topic_action_tracked,
                                   expect_at_least=10, timeout=30)
            _wait(lambda: all(published for published, *_ in _state(db, rows).values()), 30,
                  "the rows behind the watermark")
    finally:
        stop()
    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)
    [line] = [r for r in caplog.records if r.getMessage() == "outbox-watermark-reset"]
    assert line.levelno == logging.ERROR


def _oldest_unpublished_gauge() -> float:
    value = REGISTRY.get_sample_value("user_activity_outbox_oldest_unpublished_seconds")
    assert value is not None
    return value


def test_a_lock_that_blocks_the_watchdogs_query_is_reported_as_a_stall(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str
) -> None:
    """A lock that blocks the watchdog's query is reported as the stall it may hide.

    A lock on the outbox's watermark (an ALTER TABLE, a VACUUM FULL, a migration waiting for
    its lock) blocks the publisher and the watchdog's own query alike.
    Before, the watchdog waited out the 30 s statement timeout and kept its last value: the
    gauge read 0 and ``/readyz`` said nothing about the outbox while nothing could be published.
    Now its query has its own short timeout, and a blocked one reports the most the age can be.
    """
    settings = make_settings(outbox_stall_seconds=2)
    process = Process()
    watchdog = OutboxWatchdog(settings, process=process)
    try:
        _wait(lambda: _measured(watchdog, process) != "stalled"
              and _oldest_unpublished_gauge() < 1, 10, "a first measurement of nothing pending")
        with psycopg.connect(database_url) as locker:  # a transaction holding the lock
            locker.execute("LOCK TABLE user_activity.outbox_watermark IN ACCESS EXCLUSIVE MODE")
            _wait(lambda: _measured(watchdog, process) == "stalled", 15, "the blocked outbox")
            reason = dict(process.health.snapshot().stalled)["outbox"]
            assert "its query has been blocked" in reason
            assert _oldest_unpublished_gauge() > 2
        _wait(lambda: _measured(watchdog, process) != "stalled", 10, "the stall to clear")
        assert _oldest_unpublished_gauge() < 2
    finally:
        watchdog.close()


def test_a_missing_topic_holds_back_only_its_own_rows_which_go_out_in_order_once_it_exists(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    tracked, missing = settings.topic_action_tracked, f"{settings.topic_action_tracked}.missing"
    made = [OutboxRow(uuid.uuid4(), tracked if i % 2 else missing, f"k-{i}".encode(), b"{}", {})
            for i in range(36)]
    rows, later = made[:30], made[30:]  # later: committed while the topic is held
    for start in range(0, 30, 10):  # three transactions
        _insert(db, rows[start : start + 10])
    process = Process()
    watchdog = OutboxWatchdog(settings, process=process)
    publisher = OutboxPublisher(settings, process=process)
    stop = start_publisher(publisher)
    try:
        _wait(lambda: len(_held(db, missing)) == 15, 30, "the missing topic's rows held back")
        _insert(db, later)
        consumed = consume_all(settings, tracked, expect_at_least=18, timeout=30)
        _wait(lambda: len(_held(db, missing)) == 18, 20, "later rows held behind them")
        watchdog.measure()
        held_for = REGISTRY.get_sample_value("user_activity_outbox_held_seconds",
                                             {"topic": missing})
        waiting = [r.id for r in rows + later if r.topic == missing]
        in_order = [row_id for (row_id,) in db.execute(
            "SELECT id FROM user_activity.outbox WHERE id = ANY(%s) ORDER BY txid, id",
            (waiting,)).fetchall()]
        assert _held(db, missing) == in_order

        ensure_topics(settings.kafka_client_config(), [missing], 1)  # the operator's fix
        _wait(lambda: not _held(db, missing), 30, "the held rows to be sent")
        sent = consume_all(settings, missing, expect_at_least=18, timeout=30, settle=1.0)
        watchdog.measure()
    finally:
        stop()
        watchdog.close()
        db.execute("DELETE FROM user_activity.outbox_held WHERE topic = %s", (missing,))

    by_key = {r.key: r.id for r in rows + later}
    assert sorted(c.key or b"" for c in consumed) == sorted(
        r.key for r in rows + later if r.topic == tracked)
    assert [by_key[c.key or b""] for c in sent] == in_order  # once each, in the outbox's order
    assert held_for is not None and held_for > 0
    assert REGISTRY.get_sample_value("user_activity_outbox_held_seconds",
                                     {"topic": missing}) == 0
    assert REGISTRY.get_sample_value("user_activity_outbox_held_total", {"topic": missing}) == 18


def _held(db: psycopg.Connection[Any], topic: str) -> list[uuid.UUID]:
    """The ids held back for ``topic``, in the order they are to be sent."""
    return [row_id for (row_id,) in db.execute(
        "SELECT id FROM user_activity.outbox_held WHERE topic = %s ORDER BY seq",
        (topic,)).fetchall()]


def test_a_new_lease_holder_sends_a_topics_new_rows_behind_the_rows_held_before(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    topic = f"{settings.topic_action_tracked}.one"  # refused before; accepted again now
    ensure_topics(settings.kafka_client_config(), [topic], 1)
    old, new = (OutboxRow(uuid.uuid4(), topic, key, b"{}", {}) for key in (b"old", b"new"))
    db.execute("INSERT INTO user_activity.outbox_held (id, topic, key, value, created_at,"
               " last_error) VALUES (%s, %s, %s, %s, now(), 'TOPIC_AUTHORIZATION_FAILED')",
               (old.id, old.topic, old.key, old.value))  # the previous lease holder's
    _insert(db, [new])
    publisher = OutboxPublisher(settings, process=Process())
    try:
        publisher.drain()
    finally:
        publisher.close()
        db.execute("DELETE FROM user_activity.outbox_held WHERE id = %s", (old.id,))

    assert [c.key for c in consume_all(settings, topic, expect_at_least=2)] == [b"old", b"new"]


def test_the_stream_without_its_progress_publishes_nothing_until_an_operator_adopts_the_watermark(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An upgrade from a release without transactions: rows wait until an operator adopts.

    A publisher moved the cache, Kafka has no progress of the stream: said once.
    """
    settings = make_settings(retry_max_seconds=0.5)
    before = _rows(settings.topic_action_tracked, 3)
    _insert(db, before)
    db.execute("UPDATE user_activity.outbox_watermark SET delivered = pg_current_snapshot(),"
               " generation = 7")  # the old release published those three
    waiting = _rows(settings.topic_action_tracked, 5)
    _insert(db, waiting)
    process = Process()
    publisher = OutboxPublisher(settings, process=process)
    with caplog.at_level(logging.INFO, logger="sinks.outbox"):
        stop = start_publisher(publisher)
        try:
            _wait(lambda: "outbox-progress" in dict(process.health.snapshot().stalled), 30,
                  "the missing progress to be said")
            nothing = consume_all(settings, settings.topic_action_tracked, settle=2.0)
            adopted = subprocess.run(
                [sys.executable, "-m", "cli", "outbox", "adopt-watermark"], cwd=ROOT,
                env={**base_env(), **settings_env(settings)}, capture_output=True, text=True,
                timeout=120, check=True)
            sent = consume_all(settings, settings.topic_action_tracked, expect_at_least=5)
            _wait(lambda: "outbox-progress" not in dict(process.health.snapshot().stalled), 30,
                  "the stall to clear")
        finally:
            stop()

    assert nothing == []
    assert "adopted the PostgreSQL watermark" in adopted.stdout
    assert sorted(c.key or b"" for c in sent) == sorted(r.key for r in waiting)
    said = [r for r in caplog.records if r.getMessage() == "outbox-progress-missing"]
    assert len(said) == 1
    # the command takes the lease: it never fences a publisher between its attempts
    assert not {r.getMessage() for r in caplog.records} & {
        "outbox-stream-fenced", "outbox-lease-superseded"}
    assert not process.stopping.requested()
