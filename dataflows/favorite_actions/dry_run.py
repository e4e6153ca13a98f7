"""Dry-run sinks for replay: count what a run would do, write nothing.

``DryRunActionSink`` resolves sessions and looks up existing marks / rows in a READ ONLY
transaction and tallies would-be outcomes; ``DryRunDeadLetterSink`` tallies would-be dead
letters. Nothing is inserted, published or dead-lettered.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from typing_extensions import override

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.sql import query
from dataflows.favorite_actions.store import FavoritesStore, owner_of
from runtime.settings import Settings
from schemas.dlq_letter import DeadLetter
from sinks.db import Connection, Database


class Tally:
    """Thread-safe outcome counts of one run (``recorded``, ``duplicate``, ``no-session``, …)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, outcome: str, count: int = 1) -> None:
        """Count ``count`` messages with ``outcome``."""
        with self._lock:
            self._counts[outcome] += count

    def snapshot(self) -> dict[str, int]:
        """The counts so far."""
        with self._lock:
            return dict(self._counts)


class DryRunActionSink(DynamicSink[tuple[str, FavoriteMessage]]):
    """Tallies would-be ``recorded`` / ``duplicate`` / ``no-session`` outcomes, read-only."""

    def __init__(self, settings: Settings, tally: Tally) -> None:
        self._settings = settings
        self._tally = tally

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DryRunPartition:
        return _DryRunPartition(Database(self._settings, "user-activity-dry-run"), self._tally)


class _DryRunPartition(StatelessSinkPartition[tuple[str, FavoriteMessage]]):
    def __init__(self, db: Database, tally: Tally) -> None:
        self._db = db
        self._tally = tally
        self._store = FavoritesStore("dry-run")

    @override
    def write_batch(self, items: list[tuple[str, FavoriteMessage]]) -> None:
        messages = list(dict((m.idempotency_key, m) for _k, m in items).values())
        self._tally.add("duplicate", len(items) - len(messages))
        conn = self._db.connection()
        with conn.transaction():
            conn.execute("SET TRANSACTION READ ONLY")
            sessions = self._store.resolve_sessions(conn, messages)
            known = self._existing(conn, messages)
        for message in messages:
            if message.idempotency_key in known:
                self._tally.add("duplicate")
            elif owner_of(message) not in sessions:
                self._tally.add("no-session")
            else:
                self._tally.add("recorded")

    def _existing(
        self, conn: Connection, messages: Sequence[FavoriteMessage]
    ) -> set[str]:
        rows = conn.execute(
            query("preview_actions"),
            {
                "idempotency_keys": [m.idempotency_key for m in messages],
                "source_message_ids": [m.message_id for m in messages],
            },
        ).fetchall()
        return {str(row[0]) for row in rows}

    @override
    def close(self) -> None:
        self._db.close()


class DryRunDeadLetterSink(DynamicSink[DeadLetter]):
    """Tallies would-be dead letters by reason (``dead-letter:<reason>``)."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DryRunDlqPartition:
        return _DryRunDlqPartition(self._tally)


class _DryRunDlqPartition(StatelessSinkPartition[DeadLetter]):
    def __init__(self, tally: Tally) -> None:
        self._tally = tally

    @override
    def write_batch(self, items: list[DeadLetter]) -> None:
        for letter in items:
            self._tally.add("dead-lettered")
            self._tally.add(f"dead-lettered:{letter.reason.value}")
