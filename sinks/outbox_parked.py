"""The operator's side of parked outbox rows: list them, give them back to the publisher.

A row the broker refused for good is parked by :mod:`sinks.outbox` (``outbox_parked``, with
its ``attempts`` and ``last_error``); ``user-activity outbox parked`` / ``requeue`` call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from sinks.db import Connection


def requeue_parked(conn: Connection, ids: Sequence[UUID] | None) -> int:
    """Give parked rows back to the publisher (all of them when ``ids`` is None); how many.

    The rows keep their ``attempts`` and ``last_error``; the lease holder sends them within its
    poll interval. Idempotent: a row not parked (already requeued or published) is left alone.
    """
    where = "requeued_at IS NULL AND published_at IS NULL"
    if ids is None:
        cursor = conn.execute(
            f"UPDATE user_activity.outbox_parked SET requeued_at = now() WHERE {where}"
        )
    else:
        cursor = conn.execute(
            f"UPDATE user_activity.outbox_parked SET requeued_at = now() WHERE {where}"
            " AND id = ANY(%s)", (list(ids),),
        )
    return cursor.rowcount


def parked_rows(conn: Connection, limit: int = 100) -> list[tuple[Any, ...]]:
    """``(id, topic, attempts, last_error, parked_at, value size)`` of parked rows, oldest first."""
    return conn.execute(
        "SELECT id, topic, attempts, last_error, parked_at, octet_length(value)"
        "  FROM user_activity.outbox_parked"
        " WHERE requeued_at IS NULL AND published_at IS NULL"
        " ORDER BY parked_at LIMIT %s", (limit,),
    ).fetchall()
