"""The shared sink partition's commit guarantee against a real PostgreSQL.

``write_batch`` returns after the commit, so ``snapshot()`` (Bytewax's end-of-epoch call) finds
everything committed (the favorites sink's deferred commits: test_deferred_commit.py).
"""

from __future__ import annotations

import logging
import threading
import types
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, Counter

from runtime.process import Process
from runtime.settings import Settings
from schemas.kafka_record import SourceRecord
from schemas.outbox import OutboxRow
from sinks.db import Connection
from sinks.transactional import TransactionalPartition

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Item:
    n: int

    @property
    def record(self) -> SourceRecord:
        return SourceRecord("t", 0, self.n, None, b"{}")

    @property
    def envelope(self) -> Any:
        return types.SimpleNamespace(created_at=datetime.now(UTC))


class TablePartition(TransactionalPartition[Item, list[int]]):
    """Inserts each batch into a scratch table; ``hold`` keeps a write waiting before commit."""

    def __init__(self, settings: Settings, table: str) -> None:
        registry = CollectorRegistry()
        super().__init__(
            settings,
            Process(),
            None,
            name="barrier-test",
            dlq_topic="unused",
            dlq_counter=Counter("dlq", "d", registry=registry),
            retries_counter=Counter("retries", "r", registry=registry),
            logger=logging.getLogger("barrier-test"),
            flow="barrier-test",
        )
        self.table = table
        self.hold = threading.Event()
        self.hold.set()

    def write(self, conn: Connection, batch: Sequence[Item]) -> list[int]:
        with conn.transaction():
            conn.execute(
                f"INSERT INTO {self.table} (n) SELECT unnest(%s::int[])",
                ([i.n for i in batch],),
            )
            assert self.hold.wait(10)
        return [i.n for i in batch]

    def report(self, result: list[int]) -> None:
        pass

    def fields(self, message: Item) -> dict[str, Any]:
        return {"n": message.n}

    def committed_outbox(self, result: list[int]) -> tuple[int, list[OutboxRow]]:
        return 0, []


@pytest.fixture
def table(database_url: str) -> Iterator[str]:
    name = f"barrier_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (n int PRIMARY KEY)")
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {name}")


def _count(database_url: str, table: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(row[0]) if row else -1


def _settings(database_url: str) -> Settings:
    return Settings(
        database_url=database_url,
        kafka_bootstrap_servers="127.0.0.1:1",  # never used: no poison, no outbox
        outbox_enabled=False,
        http_port=0,
    )


def test_write_batch_returns_after_the_commit(
    database_url: str, table: str
) -> None:
    part = TablePartition(_settings(database_url), table)
    try:
        part.write_batch([Item(i) for i in range(7)])
        assert _count(database_url, table) == 7
        part.snapshot()
    finally:
        part.close()


def test_close_commits_what_was_handed_over(database_url: str, table: str) -> None:
    part = TablePartition(_settings(database_url), table)
    for start in range(0, 50, 10):
        part.write_batch([Item(i) for i in range(start, start + 10)])
    part.close()
    assert _count(database_url, table) == 50
