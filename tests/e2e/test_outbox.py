"""The outbox publisher: rows a crash left are published; two publishers never double-send."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import orjson
import psycopg
import pytest

from schemas.outbox import OutboxRow
from sinks.outbox import OutboxPublisher
from tests.conftest import SettingsFactory
from tests.support import consume_all

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
        "SELECT count(*) FROM user_activity.outbox WHERE id = ANY(%s) AND published_at IS NULL",
        ([r.id for r in rows],),
    ).fetchone()
    assert found is not None
    return int(found[0])


def test_rows_left_unpublished_by_a_crash_are_published_by_the_next_publisher(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_sweep_grace_seconds=5)
    rows = _committed_rows(db, settings.topic_action_tracked, 50)
    publisher = OutboxPublisher(settings)

    publisher.start()
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=50)
    publisher.stop()

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
    publishers = [OutboxPublisher(settings, name=f"outbox-{i}") for i in range(2)]
    published: list[int] = []

    threads = [threading.Thread(target=lambda p=p: published.append(p.drain()))
               for p in publishers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for publisher in publishers:
        publisher.stop()

    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=600)
    assert sum(published) == 600
    assert all(count > 0 for count in published)  # both took part
    assert len(consumed) == 600
    assert len({c.key for c in consumed}) == 600
    assert _unpublished(db, rows) == 0


def test_offered_rows_are_published_without_waiting_for_the_sweep(
    make_settings: SettingsFactory, db: psycopg.Connection[Any]
) -> None:
    settings = make_settings(outbox_sweep_grace_seconds=3600)  # the sweep never takes them
    rows = _committed_rows(db, settings.topic_action_tracked, 20)
    publisher = OutboxPublisher(settings)
    publisher.start()

    publisher.offer(rows)
    consumed = consume_all(settings, settings.topic_action_tracked, expect_at_least=20,
                           timeout=10)
    unpublished = _unpublished(db, rows)
    publisher.stop()

    assert len(consumed) == 20
    assert unpublished == 0
