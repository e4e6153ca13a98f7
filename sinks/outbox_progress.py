"""What a long publish window (a backlog) says while it drains: ``outbox-draining`` lines.

A window longer than one slice of the background loop (:mod:`sinks.outbox`) is a backlog: rows
committed while the publisher could not send (a long broker outage, a topic the broker
refused, a publisher down while another process recorded). It is sent a slice at a time, its
progress recorded after each page, and the fast path runs between slices. Without a word it
looked like a stall: ``/readyz`` said the oldest row was an hour old, and nothing said that
rows were going out.

:class:`DrainProgress` counts the window's rows once, when it first needs a second slice (an
index-only count: 166 ms for 2.2M rows), and then logs at most every
:data:`LOG_EVERY_SECONDS`: rows sent, rows left, rows/s, the age of the next row to send.
``outbox-drained`` ends it (rows, seconds, rows/s). Guarantees: at most one count query per
window, one line per interval; nothing is logged for a window that fits in one slice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from runtime.logs import log_event
from sinks.db import Connection

logger = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 10.0
"""At most one ``outbox-draining`` line per this many seconds."""

_WINDOW_LEFT = """
SELECT (SELECT count(*) FROM user_activity.outbox o
         WHERE o.txid = ANY (ARRAY(SELECT x FROM pg_snapshot_xip(%(delivered)s::pg_snapshot) x
                                    WHERE pg_visible_in_snapshot(x, %(target)s::pg_snapshot)))
           AND (o.txid, o.id) > (%(after_txid)s::xid8, %(after_id)s::uuid))
     + (SELECT count(*) FROM user_activity.outbox o
         WHERE (o.txid, o.id) > (%(start_txid)s::xid8, %(start_id)s::uuid)
           AND o.txid < pg_snapshot_xmax(%(target)s::pg_snapshot)
           AND pg_visible_in_snapshot(o.txid, %(target)s::pg_snapshot))
"""
"""The rows of the window (delivered, target] after the cursor (as ``sinks.outbox._PAGE``, with
its one lower bound ``start``)."""


@dataclass
class _Drain:
    target: str
    left_at_count: int
    started: float
    sent: int = 0
    last_log: float = 0.0


class DrainProgress:
    """Follows the window under way across slices; logs a backlog's drain (module doc)."""

    def __init__(self) -> None:
        self._drain: _Drain | None = None

    def sliced(self, conn: Connection, params: dict[str, Any], sent: int,
               next_created_at: datetime | None) -> None:
        """A slice of the window ``params`` (``_PAGE``'s, cursor after it) sent ``sent`` rows.

        The first slice of a window is not counted among its rows left (counted after it).
        """
        now = time.monotonic()
        drain = self._drain
        if drain is None or drain.target != params["target"]:
            row = conn.execute(_WINDOW_LEFT, params).fetchone()
            drain = self._drain = _Drain(params["target"], int(row[0]) if row else 0, now,
                                         last_log=now - LOG_EVERY_SECONDS)
        else:
            drain.sent += sent
        if now - drain.last_log < LOG_EVERY_SECONDS:
            return
        drain.last_log = now
        elapsed = now - drain.started
        age = None
        if next_created_at is not None:
            age = round(max(0.0, time.time() - next_created_at.timestamp()), 1)
        log_event(logger, "outbox-draining", logging.WARNING, sent=drain.sent,
                  left=max(0, drain.left_at_count - drain.sent),
                  rows_per_s=round(drain.sent / elapsed) if elapsed > 0 else None,
                  oldest_left_s=age)

    def ended(self, sent: int) -> None:
        """The window under way ended (its last page sent ``sent`` rows); log it if it drained."""
        drain, self._drain = self._drain, None
        if drain is None:
            return
        total = drain.sent + sent
        elapsed = time.monotonic() - drain.started
        log_event(logger, "outbox-drained", logging.INFO, sent=total,
                  seconds=round(elapsed, 1),
                  rows_per_s=round(total / elapsed) if elapsed > 0 else None)

    def reset(self) -> None:
        """Forget the window (the lease was lost: another publisher may finish it)."""
        self._drain = None
