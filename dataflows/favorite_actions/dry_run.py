"""The favorites dry-run sink for replay: count what a run would do, write nothing.

``DryRunActionSink`` resolves sessions and looks up existing marks / rows in a READ ONLY
transaction and tallies would-be outcomes (:class:`sinks.dry_run.Tally`). Nothing is inserted
or published.
"""

from __future__ import annotations

from collections.abc import Sequence

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from typing_extensions import override

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.sql import query
from dataflows.favorite_actions.store import FavoritesStore, owner_of
from runtime.settings import Settings
from sinks.db import Connection, Database
from sinks.dry_run import Tally


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
