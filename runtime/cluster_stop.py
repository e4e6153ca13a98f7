"""A stop asked of one process reaches every process of its Bytewax cluster.

Bytewax ends a cluster cleanly only when every input of every process has ended. A SIGTERM to
one pod (a rolling restart, an eviction, a node drain) ends that process's inputs, but its peers
keep reading, so it waits until Kubernetes SIGKILLs it after the grace period, and its peers then
crash (``Send thread panic``) and replay from their last snapshot. Measured with 2 processes:
30 s with half the partitions unread, then both down (``tests/e2e/test_rolling_restart.py``).

:class:`ClusterStop` closes that gap through PostgreSQL, which every process already uses:

- when this process is asked to stop (:data:`runtime.shutdown.SHUTDOWN`, by SIGTERM or
  Ctrl-C), it records the request in ``user_activity.stream_stops`` (one row per flow);
- every second it reads that row, and a request newer than this process's own start (both on
  the database's clock) stops this process too.

So the whole cluster ends its inputs within about a second, finishes the epoch, commits and
exits 0; the restarted processes start after the request and are not stopped by it. If
PostgreSQL is unreachable the stop stays local (the behaviour without this module).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg

from runtime.logs import log_event
from runtime.shutdown import SHUTDOWN
from runtime.supervisor import SupervisedThread

logger = logging.getLogger(__name__)

_Connection = psycopg.Connection[tuple[Any, ...]]

_REQUEST = """
INSERT INTO user_activity.stream_stops (flow, requested_at, requested_by)
VALUES (%s, now(), %s)
ON CONFLICT (flow) DO UPDATE SET requested_at = excluded.requested_at,
                                 requested_by = excluded.requested_by
"""
_LATEST = "SELECT requested_at, requested_by FROM user_activity.stream_stops WHERE flow = %s"


class ClusterStop:
    """Shares stop requests of ``flow`` between the processes of its cluster (see module doc)."""

    def __init__(self, dsn: str, flow: str, *, interval: float = 1.0,
                 tcp_options: Mapping[str, Any] | None = None) -> None:
        """``tcp_options``: libpq's keepalive parameters (``Settings.database_tcp_options``)."""
        self._dsn = dsn
        self._tcp_options = dict(tcp_options or {})
        self._flow = flow
        self._interval = interval
        self._started_at: datetime | None = None
        self._born = time.monotonic()  # the process's start (the flow is being built)
        self._announced = False
        self._me = socket.gethostname()
        self._thread = SupervisedThread(f"cluster-stop-{flow}", self._run)

    def start(self) -> ClusterStop:
        """Start watching (a daemon thread)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching."""
        self._thread.stop(5)

    def _run(self, stop: threading.Event) -> None:
        conn: _Connection | None = None
        while not stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5,
                                           application_name=f"user-activity-stop-{self._flow}",
                                           **self._tcp_options)
                self._check(conn)
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
            if stop.wait(self._interval) or (self._announced and SHUTDOWN.requested()):
                break
        if conn is not None:
            conn.close()

    def _check(self, conn: _Connection) -> None:
        if self._started_at is None:
            # This process's start on the database's clock, however long connecting took: a
            # peer's request made while we were still connecting is newer than us.
            row = conn.execute("SELECT now()").fetchone()
            assert row is not None
            self._started_at = row[0] - timedelta(seconds=time.monotonic() - self._born)
        if SHUTDOWN.requested():
            if SHUTDOWN.signal != "peer-stop" and not self._announced:
                conn.execute(_REQUEST, (self._flow, self._me))
                log_event(logger, "cluster-stop-requested", logging.WARNING, flow=self._flow)
            self._announced = True
            return
        row = conn.execute(_LATEST, (self._flow,)).fetchone()
        if row is not None and self._started_at is not None and row[0] > self._started_at:
            log_event(logger, "cluster-stop-received", logging.WARNING, flow=self._flow,
                      requested_by=row[1])
            SHUTDOWN.request("peer-stop")
            self._announced = True
