"""The outbox publisher: rows a crash left are published; two publishers never double-send.

Publication is a watermark of transaction snapshots (no per-row write): these tests also prove
it exact when transactions commit out of order, and when a crash falls between the broker's
acknowledgement and the watermark update.
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
from sinks.outbox import OutboxPublisher, window
from sinks.outbox.window import visible_in
from tests.conftest import SettingsFactory
from tests.support import consume_all, start_publisher

pytestmark = pytest.mark.e2e


def _committed_rows(db: psycopg.Connection[Any], topic: str, count: int) -> list[OutboxRow]:
    """Outbox rows as a sink leaves them when the process dies right after its commit."""
    rows = [
        OutboxRow(uuid.uuid4(), topic, f"key-{i}".encode(), orjson.dumps({"n": i}),
                  {"traceparent": f"00-{i:032x}-{i:016x}-01"})
        for i in range(count)
    ]
    with db.cursor() as cur:
        cur.executemany(
            """INSERT INTO user_activity.outbox (id, topic, key, value, headers, created_at)
               VALUES (%s, %s, %s, %s, %s::jsonb, now() - interval '1 minute')""",
            [(r.id, r.topic, r.key, r.value, orjson.dumps(r.headers).decode()) for r in rows],
        )
    return rows


def _unpublished(db: psycopg.Connection[Any], rows: list[OutboxRow]) -> int:
    found = db.execute(
        "SELECT count(*) FROM user_activity.outbox_unpublished WHERE id = ANY(%s)",
        ([r.id for r in rows],),
    ).fetchone()
    assert found is not None
    return int(found[0])


def test_rows_left_unpublished_by_a_crash_are_published_by_the_next_publisher(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    rows = _committed_rows(db, settings.topic_action_tracked, 50)
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
    rows = _committed_rows(db, settings.topic_action_tracked, 600)
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

    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=600)
    assert sum(published) >= 600  # one lease holder sent them (other tests' rows may come along)
    assert sorted(published)[0] == 0  # the other stood by
    assert len(consumed) == 600
    assert len({c.key for c in consumed}) == 600
    assert _unpublished(db, rows) == 0


def test_a_standby_publisher_takes_over_when_the_lease_holder_stops(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    first = OutboxPublisher(settings, process=Process(), name="outbox-a")
    second = OutboxPublisher(settings, process=Process(), name="outbox-b")
    stop_first = start_publisher(first)
    _wait_for(lambda: first.holds_lease, 10)
    stop_second = start_publisher(second)
    before = _committed_rows(db, settings.topic_action_tracked, 30)
    consume_all(settings, settings.topic_action_tracked, expect_at_least=30, timeout=10)
    assert not second.holds_lease

    stop_first()
    after = _committed_rows(db, settings.topic_action_tracked, 30)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=60,
                           timeout=15)
    took_over = second.holds_lease
    stop_second()

    assert took_over
    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in before + after)
    assert _unpublished(db, before + after) == 0


def test_offered_rows_are_published_without_waiting_for_the_poll(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_idle_poll_seconds=600)  # only the offer wakes it in time
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease, 10)
    time.sleep(0.5)  # the loop is now waiting out its ten-minute poll
    rows = _committed_rows(db, settings.topic_action_tracked, 20)

    publisher.offer(rows)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=20,
                           timeout=60)  # a liveness bound, far below the poll
    unpublished = _unpublished(db, rows)
    stop()

    assert len(consumed) == 20
    assert unpublished == 0


def test_a_transaction_committing_after_a_later_one_is_still_published(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], database_url: str
) -> None:
    settings = make_settings()
    topic = settings.topic_action_tracked
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease, 10)
    with psycopg.connect(database_url) as slow:  # begins first (lower txid), commits last
        slow.execute(
            "INSERT INTO user_activity.outbox (id, topic, key, value) VALUES (%s, %s, %s, %s)",
            (uuid.uuid4(), topic, b"slow", b"{}"),
        )
        fast = _committed_rows(db, topic, 5)  # a later transaction, committed first
        consume_all(settings, topic, expect_at_least=5, timeout=10)
        assert _watermark_moved_past(db, fast)
        slow.commit()
    consumed = consume_all(settings, topic, expect_at_least=6, timeout=10)
    stop()

    assert sorted(c.key or b"" for c in consumed) == sorted([b"slow", *(r.key for r in fast)])


def test_a_crash_between_the_acknowledgement_and_the_watermark_sends_the_rows_again(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(retry_initial_seconds=0.2)
    rows = _committed_rows(db, settings.topic_action_tracked, 40)
    publisher = OutboxPublisher(settings, process=Process())
    original = window.advance
    calls = {"n": 0}

    def dying_once(*args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # the rows are on the topic, the watermark not moved
            raise psycopg.OperationalError("connection lost before the watermark update")
        return original(*args, **kwargs)

    monkeypatch.setattr("sinks.outbox.publisher.advance", dying_once)
    stop = start_publisher(publisher)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=80,
                           timeout=20)
    stop()

    assert sorted(c.key or b"" for c in consumed) == sorted(2 * [r.key for r in rows])
    assert _unpublished(db, rows) == 0


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _watermark_moved_past(db: psycopg.Connection[Any], rows: list[OutboxRow]) -> bool:
    deadline = time.monotonic() + 10
    while _unpublished(db, rows):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_offer_arriving_after_a_window_sent_its_rows_sends_nothing_again(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    stop = start_publisher(publisher)
    _wait_for(lambda: publisher.holds_lease, 10)
    rows = _committed_rows(db, settings.topic_action_tracked, 20)  # committed, not yet offered
    assert _watermark_moved_past(db, rows)  # the poll's window sent them

    publisher.offer(rows)  # the sink's offer, late
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=20,
                           timeout=10, settle=2.0)
    stop()

    assert len(consumed) == 20


def test_a_window_leaves_rows_committed_within_the_grace_to_the_fast_path(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    try:
        publisher.drain()  # takes the lease; what earlier tests left is sent
        rows = _committed_rows(db, settings.topic_action_tracked, 5)  # committed, not offered
        publisher.expect(r.id for r in rows)  # as a sink announces a deferred statement's rows
        read_back = OUTBOX_READ_BACK._value.get()

        assert publisher.publish_committed(grace=0.8) == 0  # no snapshot 0.8 s old yet
        assert _unpublished(db, rows) == 5
        publisher.offer(rows[:3])
        assert publisher.publish_offered() == 3  # the fast path, from memory
        time.sleep(0.9)
        assert publisher.publish_committed(grace=0.8) == 5  # the window: all five delivered,
        assert OUTBOX_READ_BACK._value.get() - read_back == 2  # two of them read back
        assert _unpublished(db, rows) == 0
    finally:
        publisher.close()
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=5,
                           timeout=10, settle=1.0)
    assert {c.key for c in consumed} == {r.key for r in rows} and len(consumed) == 5


def test_a_recent_row_no_sink_here_announced_is_read_back_at_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """Another process's rows are never offered here: the window does not wait for them.

    So the watermark stays close behind the fast path (a crash of this process re-sends little).
    """
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    try:
        publisher.drain()
        ours = _committed_rows(db, settings.topic_action_tracked, 3)
        publisher.offer(ours)
        assert publisher.publish_offered() == 3
        theirs = _committed_rows(db, settings.topic_action_tracked, 2)  # not announced here
        read_back = OUTBOX_READ_BACK._value.get()

        assert publisher.publish_committed(grace=5.0) == 5  # no waiting for the grace
        assert OUTBOX_READ_BACK._value.get() - read_back == 2
        assert _unpublished(db, ours + theirs) == 0
    finally:
        publisher.close()
    _assert_on_the_topic_once(settings, ours + theirs)


def test_rows_offered_to_a_standby_are_not_sent_from_memory_once_it_takes_the_lease(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """A standby's own commits are sent by the holder, which reads them back.

    When the standby takes the lease later (the holder died), it must not send them again.
    """
    settings = make_settings()
    holder = OutboxPublisher(settings, process=Process())
    standby = OutboxPublisher(settings, process=Process())
    try:
        holder.drain()  # takes the lease
        rows = _committed_rows(db, settings.topic_action_tracked, 5)
        standby.offer(rows)  # its sink's commits while the other process holds the lease
        assert holder.publish_committed() == 5  # the holder reads them back and sends them
        holder.close()  # the lease is free
        assert standby._take_lease(force=True)
        assert standby.publish_offered() == 0  # nothing from memory: they are on the topic
        assert standby.publish_committed() == 0
    finally:
        holder.close()
        standby.close()
    _assert_on_the_topic_once(settings, rows)


def test_a_window_stops_before_a_recent_row_the_fast_path_has_not_sent(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    """A window whose first rows were sent early meets a later commit not yet offered.

    It moves the watermark past the first and leaves the other to the fast path (nothing read
    back), instead of reading it back from the table (the case of a full benchmark run).
    """
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    try:
        publisher.drain()
        first = _committed_rows(db, settings.topic_action_tracked, 5)
        publisher.offer(first)
        assert publisher.publish_offered() == 5
        later = _committed_rows(db, settings.topic_action_tracked, 5)  # committed, not offered
        publisher.expect(r.id for r in later)
        read_back = OUTBOX_READ_BACK._value.get()

        assert publisher.publish_committed(grace=5.0) == 5  # up to the first row not sent
        assert _behind_the_cursor(db, first) == 5 and _behind_the_cursor(db, later) == 0
        assert publisher.publish_committed(grace=5.0) == 0  # still within the grace: held
        publisher.offer(later)
        assert publisher.publish_offered() == 5
        assert publisher.publish_committed(grace=5.0) == 5  # the window resumes past them
        assert _unpublished(db, later) == 0
        assert OUTBOX_READ_BACK._value.get() == read_back  # every row went from memory
    finally:
        publisher.close()
    _assert_on_the_topic_once(settings, first + later)


def _assert_on_the_topic_once(settings: Settings, rows: list[OutboxRow]) -> None:
    """``rows`` are on the action-tracked topic, each once, and nothing else is."""
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=len(rows),
                           timeout=10, settle=1.0)
    assert sorted(c.key or b"" for c in consumed) == sorted(r.key for r in rows)


def _behind_the_cursor(db: psycopg.Connection[Any], rows: list[OutboxRow]) -> int:
    """Rows a window under way has passed (its cursor is at or after them)."""
    found = db.execute(
        """SELECT count(*) FROM user_activity.outbox o, user_activity.outbox_watermark w
            WHERE o.id = ANY(%s) AND w.target IS NOT NULL
              AND (o.txid, o.id) <= (w.after_txid, w.after_id)""",
        ([r.id for r in rows],),
    ).fetchone()
    assert found is not None
    return int(found[0])


def test_visible_in_agrees_with_postgresql(
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
    visible = visible_in(snap[0])
    for txid in range(in_progress - 3, in_progress + 4):
        expected = db.execute(
            "SELECT pg_visible_in_snapshot(%s::text::xid8, %s::pg_snapshot)", (str(txid), snap[0])
        ).fetchone()
        assert expected is not None
        assert visible(txid) is expected[0], (txid, snap[0])
    assert not visible(in_progress)  # in progress at the snapshot (in its xip list)


def test_the_snapshots_kept_for_the_grace_stay_few_while_every_window_is_sent_early(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    publisher = OutboxPublisher(settings, process=Process())
    try:
        publisher.drain()
        for _ in range(40):  # each window: every row sent by the fast path first
            rows = _committed_rows(db, settings.topic_action_tracked, 2)
            publisher.offer(rows)
            assert publisher.publish_offered() == 2
            assert publisher.publish_committed(grace=0.1) == 2
            time.sleep(0.02)
        kept = len(publisher._snapshots)
    finally:
        publisher.close()

    assert kept <= 8  # ~0.1 s of windows, not one per window for ever
