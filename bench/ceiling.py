"""The bare write-path ceiling: the job's own sink code, no Kafka, no Bytewax.

The backlog's records are decoded up front (``decode_favorite``, outside the timing); the valid
:class:`FavoriteMessage` values are fed to :meth:`FavoritesStore.record_batch` in batches of
``batch_size`` on one connection, one transaction per batch, exactly as the sink calls it (the
in-memory dedup is not applied: the batch's duplicates are sorted out by the store and the SQL).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.measure import proc_cpu_seconds
from bench.wal import lsn_text, wal_by_relation, wal_composition, wal_lsn
from bench.workload import Backlog
from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.db import SESSION_OPTIONS  # the job's session settings (jit off)


def decode_backlog(backlog: Backlog, added_topic: str, removed_topic: str
                   ) -> tuple[list[FavoriteMessage], dict[str, Any]]:
    """The backlog's valid messages, decoded as the job decodes them; and the decode rate."""
    action_types = {
        added_topic: ActionType.ADD_TO_FAVORITES,
        removed_topic: ActionType.REMOVE_FROM_FAVORITES,
    }
    t0 = time.monotonic()
    c0 = time.process_time()
    messages = []
    for offset, r in enumerate(backlog.records):
        decoded = decode_favorite(
            SourceRecord(r.topic, 0, offset, r.key, r.value, r.headers, time.monotonic()),
            action_types,
        )
        if isinstance(decoded, FavoriteMessage):
            messages.append(decoded)
    wall = time.monotonic() - t0
    cpu = time.process_time() - c0
    n = len(backlog.records)
    return messages, {
        "decode_favorite_per_s_wall": round(n / wall, 1) if wall else None,
        "decode_favorite_per_cpu_s": round(n / cpu, 1) if cpu else None,
    }


def run_ceiling(messages: list[FavoriteMessage], action_tracked: str, db_url: str,  # noqa: PLR0917
                batch_size: int = 1000, max_seconds: float = 120.0,
                sampler: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Feed decoded ``messages`` to ``record_batch``; the rate over what was written."""
    store = FavoritesStore(action_tracked)
    recorded = duplicates = no_session = fed = 0
    with psycopg.connect(db_url, autocommit=True, options=SESSION_OPTIONS) as conn:
        wal0 = wal_lsn(conn)
        cpu = sampler() if sampler is not None else None
        start = time.monotonic()
        sample: tuple[str, str, int] | None = None  # the WAL range of the first 10k recorded
        first = lsn_text(conn)
        for i in range(0, len(messages), batch_size):
            batch = messages[i : i + batch_size]
            outcome = store.record_batch(conn, batch)
            fed += len(batch)
            recorded += len(outcome.recorded)
            duplicates += len(outcome.duplicates)
            no_session += len(outcome.no_session)
            if sample is None and recorded >= WAL_SAMPLE_EVENTS:
                sample = (first, lsn_text(conn), recorded)
            if time.monotonic() - start > max_seconds:
                break
        elapsed = time.monotonic() - start
        resources = cpu.stop() if cpu is not None else None
        wal = wal_lsn(conn) - wal0
        breakdown = wal_by_relation(conn, *sample) if sample is not None else None
        composition = wal_composition(conn, first, lsn_text(conn), recorded)
    return {
        "messages_fed": fed,
        "recorded": recorded,
        "duplicates": duplicates,
        "no_session": no_session,
        "batch_size": batch_size,
        "seconds": round(elapsed, 2),
        "events_per_s": round(fed / elapsed, 1) if elapsed else None,
        "recorded_per_s": round(recorded / elapsed, 1) if elapsed else None,
        "wal_bytes_per_recorded_event": round(wal / recorded) if recorded else None,
        "wal_bytes_per_recorded_event_by_relation": breakdown,
        "wal_by_kind": composition,
        "resources": resources,
    }


WAL_SAMPLE_EVENTS = 10_000
"""Recorded events whose WAL :func:`wal_by_relation` breaks down."""


_OLD_SCHEMA = """
CREATE SCHEMA bench_old_outbox;
CREATE TABLE bench_old_outbox.outbox (
    id uuid PRIMARY KEY, topic text NOT NULL, key bytea NULL, value bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb, created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz NULL, attempts integer NOT NULL DEFAULT 0, last_error text NULL,
    parked_at timestamptz NULL);
CREATE INDEX ON bench_old_outbox.outbox (created_at, id)
    WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX ON bench_old_outbox.outbox (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX ON bench_old_outbox.outbox (parked_at) WHERE parked_at IS NOT NULL;
"""
# The publisher of migrations 0001-0005 (before issue 16): claim, mark published, then purge.
_OLD_CLAIM = """
SELECT id, topic, key, value, headers FROM bench_old_outbox.outbox
 WHERE published_at IS NULL AND parked_at IS NULL ORDER BY created_at, id LIMIT %s
   FOR UPDATE SKIP LOCKED
"""
_OLD_MARK = ("UPDATE bench_old_outbox.outbox SET published_at = now()"
             " WHERE id = ANY(%s) AND published_at IS NULL")
_OLD_PURGE = """
DELETE FROM bench_old_outbox.outbox WHERE id IN (
    SELECT id FROM bench_old_outbox.outbox WHERE published_at IS NOT NULL
     ORDER BY published_at LIMIT 5000)
"""


def outbox_publish_cost(db_url: str, batch: int = 1000, limit: int = 100_000) -> dict[str, Any]:
    """The outbox publisher's PostgreSQL cost per published row, old vs new, without Kafka.

    On the rows the ceiling phase left in the outbox (up to ``limit``), in one process:
    - ``new``: the job's own :class:`sinks.outbox.OutboxPublisher` (lease, windows read back
      in pages of ``batch``, one watermark update per page), its broker replaced by one that
      acknowledges every record at once;
    - ``old``: the publisher before issue 16 on a copy of the rows in the old table layout
      (claim ``FOR UPDATE SKIP LOCKED``, ``UPDATE ... SET published_at``, then the purge
      ``DELETE``), its statements kept here for the comparison.
    Reports per row: the PostgreSQL backend's CPU (µs, from ``/proc/<pid>/stat``), the wall
    time (µs) and the WAL bytes.
    """
    from runtime.settings import Settings
    from sinks.outbox import OutboxPublisher

    class _AcknowledgingPublisher(OutboxPublisher):
        def _produce(self, records: Any) -> list[Any]:
            return [None] * len(records)

    result: dict[str, Any] = {}
    with psycopg.connect(db_url, autocommit=True, options=SESSION_OPTIONS) as conn:
        conn.execute(_OLD_SCHEMA)
        # the same rows, whole (a thin row rendered as the publisher renders it)
        keys = conn.execute("SELECT txid, id FROM user_activity.outbox LIMIT %s",
                            (limit,)).fetchall()
        whole = OutboxPublisher._whole_rows(conn, keys)
        with conn.cursor().copy("COPY bench_old_outbox.outbox"
                                " (id, topic, key, value, headers, created_at) FROM STDIN") as copy:
            for row in whole:
                copy.write_row((row[1], row[2], row[3], row[4], Jsonb(row[5]), row[6]))
        cost = _meter(conn, conn.info.backend_pid)
        rows = 0
        while True:
            with conn.transaction():
                claimed = conn.execute(_OLD_CLAIM, (batch,)).fetchall()
                if not claimed:
                    break
                conn.execute(_OLD_MARK, ([r[0] for r in claimed],))
            rows += len(claimed)
        while conn.execute(_OLD_PURGE).rowcount:
            pass
        result["old"] = cost(rows)
        conn.execute("DROP SCHEMA bench_old_outbox CASCADE")

        settings = Settings(database_url=db_url, outbox_batch_size=batch)
        publisher = _AcknowledgingPublisher(settings, "bench-outbox")
        try:
            assert publisher._take_lease(force=True), "another publisher holds the outbox lease"
            cost = _meter(conn, publisher._db.connection().info.backend_pid)
            rows = 0
            while (count := publisher.publish_committed()) > 0:
                rows += count
            result["new"] = cost(rows)
        finally:
            publisher._release()
    return result


def _meter(conn: psycopg.Connection[Any], pid: int) -> Callable[[int], dict[str, Any]]:
    """From now: per row, backend ``pid``'s CPU (µs), the wall time (µs) and the WAL bytes."""
    wal0, cpu0, t0 = wal_lsn(conn), proc_cpu_seconds(pid) or 0.0, time.monotonic()

    def cost(rows: int) -> dict[str, Any]:
        wal, wall = wal_lsn(conn) - wal0, time.monotonic() - t0
        cpu = (proc_cpu_seconds(pid) or 0.0) - cpu0
        return {"rows": rows, "pg_cpu_us_per_row": round(1e6 * cpu / rows, 1) if rows else None,
                "us_per_row": round(1e6 * wall / rows, 1) if rows else None,
                "wal_bytes_per_row": round(wal / rows) if rows else None}

    return cost
