"""The outbox publisher: every committed row reaches a read_committed reader exactly once.

Rows go out in Kafka transactions whose last record is the stream's progress: these tests
prove it exact when transactions commit out of order, when the fast path and a window meet,
when the PostgreSQL cache update fails after a commit, and across lease holders.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import psycopg
import pytest

from runtime.metrics import OUTBOX_READ_BACK
from runtime.process import Process
from runtime.settings import Settings
from schemas.outbox import OutboxRow
from sinks.outbox import OutboxPublisher
from sinks.outbox.progress import snapshot
from sinks.outbox.stream import read_progress
from tests.conftest import SettingsFactory
from tests.support import consume_all, start_publisher

pytestmark = pytest.mark.e2e


def _committed_rows(db: psycopg.Connection[Any], topic: str, count: int
                    ) -> tuple[int, list[OutboxRow]]:
    """Outbox rows committed in one transaction, as a sink leaves them; and its txid."""
    rows = [
        OutboxRow(uuid.uuid4(), topic, f"key-{uuid.uuid4().hex[:8]}-{i}".encode(),
                  orjson.dumps({"n": i}), {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"})
        for i in range(count)
    ]
    with db.transaction(), db.cursor() as cur:
        cur.executemany(
            """INSERT INTO user_activity.outbox (id, topic, key, value, headers, created_at)
               VALUES (%s, %s, %s, %s, %s::jsonb, now() - interval '1 minute')""",
            [(r.id, r.topic, r.key, r.value, orjson.dumps(r.headers).decode()) for r in rows],
        )
        txid = cur.execute("SELECT pg_current_xact_id()::text").fetchone()
    assert txid is not None
    return int(txid[0]), rows


def _unpublished(db: psycopg.Connection[Any], rows: list[OutboxRow]) -> int:
    found = db.execute(
        "SELECT count(*) FROM user_activity.outbox_unpublished WHERE id = ANY(%s)",
        ([r.id for r in rows],),
    ).fetchone()
    assert found is not None
    return int(found[0])


def _assert_on_the_topic_once(settings: Settings, rows: list[OutboxRow]) -> None:
    """``rows`` are on the action-tracked topic, each once, and nothing else is."""
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=len(rows),
                           timeout=30, settle=1.0)
    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_rows_left_unpublished_by_a_crash_are_published_by_the_next_publisher(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    _, rows = _committed_rows(db, settings.topic_action_tracked, 50)
    publisher = OutboxPublisher(settings, process=Process())

    stop = start_publisher(publisher)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=50)
    stop()

    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)
    assert {c.header("traceparent") for c in consumed} == {
        r.headers["traceparent"].encode() for r in rows
    }
    assert _unpublished(db, rows) == 0


def test_two_publishers_draining_the_same_rows_send_each_row_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_batch_size=50)
    _, rows = _committed_rows(db, settings.topic_action_tracked, 600)
    publishers = [OutboxPublisher(settings, process=Process(), name=f"outbox-{i}")
                  for i in range(2)]
    published: list[int] = []

    threads = [threading.Thread(target=lambda p=p: published.append(p.drain(wait_seconds=30)))
               for p in publishers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for publisher in publishers:
        publisher.close()

    assert sorted(published) == [0, 600]  # one lease holder sent them, the other stood by
    _assert_on_the_topic_once(settings, rows)
    assert _unpublished(db, rows) == 0


def test_a_standby_publisher_takes_over_when_the_lease_holder_stops(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    first = OutboxPublisher(settings, process=Process(), name="outbox-a")
    second = OutboxPublisher(settings, process=Process(), name="outbox-b")
    stop_first = start_publisher(first)
    _wait_for(lambda: first.holds_lease)
    stop_second = start_publisher(second)
    _, before = _committed_rows(db, settings.topic_action_tracked, 30)
    consume_all(settings, settings.topic_action_tracked, expect_at_least=30, timeout=30)
    assert not second.holds_lease

    stop_first()
    _, after = _committed_rows(db, settings.topic_action_tracked, 30)
    consume_all(settings, settings.topic_action_tracked, expect_at_least=60, timeout=30)
    took_over = second.holds_lease
    stop_second()

    assert took_over
    _assert_on_the_topic_once(settings, before + after)
    assert _unpublished(db, before + after) == 0


def test_offered_rows_are_published_without_waiting_for_the_poll(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_idle_poll_seconds=600)  # only the offer wakes it in time
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease)
    time.sleep(1.0)  # the loop is now waiting out its poll
    txid, rows = _committed_rows(db, settings.topic_action_tracked, 20)

    publisher.offer(txid, rows)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=20,
                           timeout=60)  # a liveness bound, far below the poll
    stop()

    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)


def test_a_transaction_committing_after_a_later_one_is_still_published(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str
) -> None:
    settings = make_settings()
    topic = settings.topic_action_tracked
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease)
    with psycopg.connect(database_url) as slow:  # begins first (lower txid), commits last
        slow.execute(
            "INSERT INTO user_activity.outbox (id, topic, key, value) VALUES (%s, %s, %s, %s)",
            (uuid.uuid4(), topic, b"slow", b"{}"),
        )
        _, fast = _committed_rows(db, topic, 5)  # a later transaction, committed first
        consume_all(settings, topic, expect_at_least=5, timeout=30)
        _wait_for(lambda: _unpublished(db, fast) == 0)
        slow.commit()
    consumed = consume_all(settings, topic, expect_at_least=6, timeout=30)
    stop()

    assert sorted(c.key or b"" for c in consumed) == sorted([b"slow", *(r.key for r in fast)])


def test_a_cache_update_lost_after_the_commit_sends_nothing_again(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(retry_initial_seconds=0.2)
    _, rows = _committed_rows(db, settings.topic_action_tracked, 40)
    publisher = OutboxPublisher(settings, process=Process())
    from sinks.outbox import sending as module

    original, calls = module.write_cache, {"n": 0}  # type: ignore[attr-defined]

    def dying_once(*args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 2:  # the rows' transaction committed in Kafka, the cache not updated
            raise psycopg.OperationalError("connection lost before the cache update")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "write_cache", dying_once)
    stop = start_publisher(publisher)
    consume_all(settings, settings.topic_action_tracked, expect_at_least=40, timeout=30)
    _wait_for(lambda: _unpublished(db, rows) == 0)
    stop()

    assert calls["n"] > 2
    _assert_on_the_topic_once(settings, rows)


def test_an_offer_arriving_after_a_window_sent_its_rows_sends_nothing_again(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease)
    txid, rows = _committed_rows(db, settings.topic_action_tracked, 20)  # not offered yet
    _wait_for(lambda: _unpublished(db, rows) == 0)  # the poll's window sent them

    publisher.offer(txid, rows)  # the sink's offer, late
    time.sleep(1.0)
    stop()

    _assert_on_the_topic_once(settings, rows)


def test_a_window_reads_back_only_the_rows_the_fast_path_did_not_send(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """Rows offered here go from memory; another process's rows are read back by a window."""
    settings = make_settings(outbox_fast_path_grace_seconds=2.0)  # the fast path's turn first
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease)
    _, first = _committed_rows(db, settings.topic_action_tracked, 1)
    _wait_for(lambda: _unpublished(db, first) == 0)  # the start's window: the fast path is on
    read_back = OUTBOX_READ_BACK._value.get()

    ours: list[OutboxRow] = []
    theirs: list[OutboxRow] = []
    for _ in range(10):
        txid, rows = _committed_rows(db, settings.topic_action_tracked, 3)
        publisher.offer(txid, rows)
        ours += rows
        theirs += _committed_rows(db, settings.topic_action_tracked, 2)[1]  # offered nowhere
        time.sleep(0.05)
    _wait_for(lambda: _unpublished(db, ours + theirs) == 0)
    read = OUTBOX_READ_BACK._value.get() - read_back
    stop()

    assert read == len(theirs)
    _assert_on_the_topic_once(settings, first + ours + theirs)


def test_rows_offered_to_a_standby_are_sent_once_after_it_takes_the_lease(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """A standby's own commits are sent by the holder; taking the lease later sends no copy."""
    settings = make_settings()
    holder = OutboxPublisher(settings, process=Process(), name="outbox-holder")
    standby = OutboxPublisher(settings, process=Process(), name="outbox-standby")
    try:
        assert holder.drain() == 0  # takes the lease
        txid, rows = _committed_rows(db, settings.topic_action_tracked, 5)
        standby.offer(txid, rows)  # its sink's commit while the other process holds the lease
        assert holder.drain() == 5  # the holder reads them back and sends them
        holder.close()  # the lease is free
        assert standby.drain() == 0  # it holds the lease now: nothing is left to send
        assert standby.holds_lease
    finally:
        holder.close()
        standby.close()
    _assert_on_the_topic_once(settings, rows)


def test_every_transaction_carries_the_progress_a_new_publisher_resumes_from(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    try:
        _, rows = _committed_rows(db, settings.topic_action_tracked, 7)
        assert publisher.drain() == 7
    finally:
        publisher.close()
    progress = read_progress(settings.kafka_client_config(), settings.topic_outbox_progress,
                             settings.outbox_transactional_id.encode())
    cache = db.execute("SELECT delivered::text FROM user_activity.outbox_watermark").fetchone()

    assert progress is not None and cache is not None
    assert progress.delivered == cache[0]  # the cache holds what Kafka committed
    assert progress.target is None and not progress.sent
    txids = db.execute("SELECT DISTINCT txid::text FROM user_activity.outbox WHERE id = ANY(%s)",
                       ([r.id for r in rows],)).fetchall()
    assert all(snapshot(progress.delivered).visible(int(t)) for (t,) in txids)


def test_snapshot_visibility_agrees_with_postgresql(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(database_url) as running, psycopg.connect(database_url) as done:
        row = running.execute("SELECT pg_current_xact_id()::text").fetchone()
        assert row is not None
        in_progress = int(row[0])
        done.execute("SELECT pg_current_xact_id()")
        done.commit()
        snap = db.execute("SELECT pg_current_snapshot()::text").fetchone()
        assert snap is not None
        running.commit()
    seen = snapshot(snap[0])
    for txid in range(in_progress - 3, in_progress + 4):
        expected = db.execute(
            "SELECT pg_visible_in_snapshot(%s::text::xid8, %s::pg_snapshot)", (str(txid), snap[0])
        ).fetchone()
        assert expected is not None
        assert seen.visible(txid) is expected[0], (txid, snap[0])
    assert not seen.visible(in_progress)  # in progress at the snapshot (in its xip list)


def test_the_snapshots_kept_for_the_grace_stay_few(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_fast_path_grace_seconds=0.1, outbox_idle_poll_seconds=0.01)
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease)
    kept: list[int] = []
    for _ in range(40):
        txid, rows = _committed_rows(db, settings.topic_action_tracked, 2)
        publisher.offer(txid, rows)
        kept.append(len(publisher._window._snapshots))
        time.sleep(0.02)
    stop()

    assert max(kept) <= 30  # ~0.1 s of cycles, not one per cycle for ever
