"""A large outbox backlog drains without holding up new events; a first page reads no old rows.

The backlog: rows committed while the broker could not take them. A window's first page must
not read the rows already published (docs/decisions.md: the backlog in slices).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from runtime.process import Process
from runtime.settings import Settings
from schemas.outbox import OutboxRow
from sinks.outbox import OutboxPublisher
from sinks.outbox.sql import query
from sinks.outbox.table import page_start
from tests.conftest import SettingsFactory
from tests.support import start_publisher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BACKLOG = 100_000
_PER_TRANSACTION = 1_000


def _backlog(db: psycopg.Connection[Any], topic: str, count: int) -> None:
    """``count`` committed rows (keys ``backlog-<n>``), ``_PER_TRANSACTION`` per transaction."""
    for start in range(0, count, _PER_TRANSACTION):
        db.execute(
            """INSERT INTO user_activity.outbox (id, topic, key, value, created_at)
               SELECT gen_random_uuid(), %s, convert_to('backlog-' || n, 'UTF8'), '\\x7b7d',
                      now() - interval '10 minutes'
                 FROM generate_series(%s::int, %s::int) n""",
            (topic, start, min(start + _PER_TRANSACTION, count) - 1),
        )


class _Arrivals(threading.Thread):
    """Reads ``topic`` from the beginning: backlog records seen when each other key arrived."""

    def __init__(self, settings: Settings, topic: str) -> None:
        super().__init__(daemon=True)
        self._config = {**settings.kafka_client_config(), "group.id": f"t-{uuid.uuid4()}",
                        "enable.auto.commit": False}
        self._topic = topic
        self.backlog = 0
        self.others: dict[bytes, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        consumer = Consumer(self._config)
        partitions = consumer.list_topics(self._topic, timeout=10).topics[self._topic].partitions
        consumer.assign([TopicPartition(self._topic, p, OFFSET_BEGINNING) for p in partitions])
        while not self.done.is_set():
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is None:
                    key = msg.key() or b""
                    if key.startswith(b"backlog-"):
                        self.backlog += 1
                    else:
                        self.others.setdefault(key, self.backlog)
        consumer.close()


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_rows_committed_during_a_backlog_drain_are_published_before_the_backlog_ends(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    topic = settings.topic_action_tracked
    _backlog(db, topic, BACKLOG)
    arrivals = _Arrivals(settings, topic)
    arrivals.start()
    publisher = OutboxPublisher(settings, process=Process())
    new_rows: list[OutboxRow] = []
    stop = start_publisher(publisher)
    try:
        _wait(lambda: arrivals.backlog >= 5_000, 60, "the drain to begin")
        for index in range(3):  # a sink's commits while the backlog drains, offered as it does
            row = OutboxRow(uuid.uuid4(), topic, f"new-{index}".encode(), b"{}", {})
            txid = db.execute("INSERT INTO user_activity.outbox (id, topic, key, value)"
                              " VALUES (%s, %s, %s, %s) RETURNING txid::text",
                              (row.id, row.topic, row.key, row.value)).fetchone()
            assert txid is not None
            publisher.offer(int(txid[0]), [row], ordered=False)  # as the favorites sinks do
            new_rows.append(row)
            time.sleep(0.3)
        _wait(lambda: arrivals.backlog >= BACKLOG and len(arrivals.others) == 3, 90,
              "the backlog and the new rows")
    finally:
        stop()
        arrivals.done.set()
        arrivals.join(10)

    seen_at = {key: arrivals.others[key] for key in (r.key for r in new_rows)}
    print(f"\n[backlog] backlog records on the topic when each new row arrived: {seen_at}")
    # before: each new row came after the whole window (seen with 100,000 backlog rows)
    assert all(seen < BACKLOG * 0.9 for seen in seen_at.values()), seen_at


def test_a_window_first_page_reads_no_published_rows(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings()
    _backlog(db, settings.topic_action_tracked, BACKLOG // 2)
    publisher = OutboxPublisher(settings, process=Process())
    try:
        publisher.drain()  # every row of the table is behind the watermark
    finally:
        publisher.close()
    found = db.execute("SELECT delivered::text, pg_current_snapshot()::text"
                       " FROM user_activity.outbox_watermark").fetchone()
    assert found is not None
    delivered, current = found
    after = (0, uuid.UUID(int=0))  # a new window: no row sent yet
    start = page_start(delivered, after)
    plan = db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query("page"), {
        "delivered": delivered, "target": current, "after_txid": str(after[0]),
        "after_id": after[1], "start_txid": str(start[0]), "start_id": start[1], "limit": 1000,
    }).fetchone()
    assert plan is not None
    buffers = plan[0][0]["Plan"]["Shared Hit Blocks"] + plan[0][0]["Plan"]["Shared Read Blocks"]
    print(f"\n[backlog] first page of an empty window: {buffers} buffers")
    # before: every index entry of the table (~700 buffers per 50,000 published rows)
    assert buffers < 100
