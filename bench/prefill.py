"""The template database: migrated, seeded sessions, >= N action_events rows already present.

Rows are generated server-side (``INSERT ... SELECT generate_series``), in chunks. Ids are
UUIDv7-shaped (48-bit millisecond timestamp, version 7, variant 10, md5 bits), spread over the 30
days before now, so the job's own UUIDv7 ids sort after them (as in production). Every row also
gets its consumer idempotency mark (the job writes one per row). The outbox stays empty, as after
the publisher purged published rows. VACUUM ANALYZE + CHECKPOINT at the end, so each copy starts
with clean pages and fresh statistics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import psycopg

from devenv.harness.sessions import Session, seed_sessions

_UUID7 = (
    "(lpad(to_hex({ms}), 12, '0') || '7' || substr({h}, 1, 3) || '8'"
    " || substr({h}, 4, 15))::uuid"
)

_PREFILL = f"""
WITH s AS (
    SELECT row_number() OVER (ORDER BY id) AS rn, id, anonymous_id, user_id
      FROM user_activity.sessions
),
g AS (
    SELECT i,
           %(base_ms)s::bigint + i * %(step_ms)s::bigint AS ms,
           md5(i::text || 'e') AS he,
           md5(i::text || 'm') AS hm,
           1 + (i * 7919) %% %(sessions)s AS rn
      FROM generate_series(%(start)s::bigint, %(stop)s::bigint) AS i
)
INSERT INTO user_activity.action_events
       (id, action_type, session_id, anonymous_id, user_id, occurred_at, property_object_id,
        favorite_id, source_message_id, recorded_at)
SELECT {_UUID7.format(ms="g.ms", h="g.he")},
       CASE WHEN g.i %% 5 = 0 THEN 'RemoveFromFavorites' ELSE 'AddToFavorites' END,
       s.id, s.anonymous_id, s.user_id,
       to_timestamp(g.ms / 1000.0),
       md5(g.i::text || 'p')::uuid,
       md5(g.i::text || 'f')::uuid,
       {_UUID7.format(ms="g.ms", h="g.hm")},
       to_timestamp(g.ms / 1000.0)
  FROM g JOIN s ON s.rn = g.rn
"""

_MARKS = """
INSERT INTO user_activity.consumer_idempotency_marks (key, processed_at)
SELECT 'user-activity-favorites:' || action_type || ':' || source_message_id, recorded_at
  FROM user_activity.action_events
"""

_DAY_MS = 86_400_000


def prefill(url: str, sessions: Sequence[Session], rows: int, chunk: int = 500_000,
            log: Any = print) -> dict[str, Any]:
    """Seed ``sessions`` and ``rows`` action_events (+ marks) into the migrated ``url``."""
    result: dict[str, Any] = {"sessions": len(sessions), "rows": rows}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET maintenance_work_mem = '256MB'")
        t0 = time.monotonic()
        seed_sessions(conn, sessions)
        result["seed_sessions_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        now_ms = int(time.time() * 1000)
        span = 30 * _DAY_MS
        step = max(1, span // max(rows, 1))
        base = now_ms - span - 60_000
        done = 0
        while done < rows:
            stop = min(rows, done + chunk)
            conn.execute(
                _PREFILL,
                {"base_ms": base, "step_ms": step, "sessions": len(sessions),
                 "start": done + 1, "stop": stop},
            )
            done = stop
            log(f"  prefill: {done:,}/{rows:,} action_events rows "
                f"({time.monotonic() - t0:.0f}s)")
        result["action_events_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        conn.execute(_MARKS)
        result["idempotency_marks_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        conn.execute("VACUUM (ANALYZE)")
        conn.execute("CHECKPOINT")
        result["vacuum_analyze_checkpoint_s"] = round(time.monotonic() - t0, 2)
        counted = conn.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
        result["action_events_rows"] = int(counted[0]) if counted else 0
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        result["database_mb"] = round(int(size[0]) / 2**20, 1) if size else None
    return result
