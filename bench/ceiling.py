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


def outbox_publish_cost(db_url: str, batch: int = 1000) -> dict[str, Any]:
    """The outbox publisher's PostgreSQL cost per published row, without Kafka.

    On the rows the ceiling phase left in the outbox, in one process: the job's own
    :class:`sinks.outbox.OutboxPublisher` (lease, windows read back in pages of ``batch``, one
    watermark update per page), its broker replaced by one that acknowledges every record at
    once. Reports per row: the PostgreSQL backend's CPU (µs, from ``/proc/<pid>/stat``), the
    wall time (µs) and the WAL bytes. (The publisher before issue 16, which marked each row
    published, was measured beside it up to commit 87a3c51: docs/performance.md.)
    """
    from runtime.settings import Settings
    from sinks.outbox import OutboxPublisher

    class _AcknowledgingPublisher(OutboxPublisher):
        def _produce(self, records: Any, timeout: float = 35.0) -> list[Any]:
            return [None] * len(records)

    with psycopg.connect(db_url, autocommit=True, options=SESSION_OPTIONS) as conn:
        settings = Settings(database_url=db_url, outbox_batch_size=batch)
        publisher = _AcknowledgingPublisher(settings, "bench-outbox")
        try:
            assert publisher._take_lease(force=True), "another publisher holds the outbox lease"
            cost = _meter(conn, publisher._db.connection().info.backend_pid)
            rows = 0
            while (count := publisher.publish_committed()) > 0:
                rows += count
            return cost(rows)
        finally:
            publisher._release()


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
