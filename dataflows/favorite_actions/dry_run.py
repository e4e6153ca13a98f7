"""The favorites dry-run sink for replay: the real write, rolled back, its outcomes tallied."""

from __future__ import annotations

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from typing_extensions import override

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.store import FavoritesStore
from runtime.settings import Settings
from sinks.db import Database
from sinks.dry_run import Tally


class DryRunActionSink(DynamicSink[tuple[str, FavoriteMessage]]):
    """Tallies would-be ``recorded`` / ``duplicate`` / ``no-session`` outcomes."""

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
        conn = self._db.connection()
        with conn.transaction(force_rollback=True):
            outcome = self._store.record_batch(conn, [m for _k, m in items])
        self._tally.add("recorded", len(outcome.recorded))
        self._tally.add("duplicate", len(outcome.duplicates))
        self._tally.add("no-session", len(outcome.no_session))

    @override
    def close(self) -> None:
        self._db.close()
