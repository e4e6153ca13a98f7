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

from bench.workload import Backlog
from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord


def wal_lsn(conn: psycopg.Connection[Any]) -> int:
    """The current WAL insert position in bytes."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


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
    with psycopg.connect(db_url, autocommit=True) as conn:
        wal0 = wal_lsn(conn)
        cpu = sampler() if sampler is not None else None
        start = time.monotonic()
        for i in range(0, len(messages), batch_size):
            batch = messages[i : i + batch_size]
            outcome = store.record_batch(conn, batch)
            fed += len(batch)
            recorded += len(outcome.recorded)
            duplicates += len(outcome.duplicates)
            no_session += len(outcome.no_session)
            if time.monotonic() - start > max_seconds:
                break
        elapsed = time.monotonic() - start
        resources = cpu.stop() if cpu is not None else None
        wal = wal_lsn(conn) - wal0
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
        "resources": resources,
    }
