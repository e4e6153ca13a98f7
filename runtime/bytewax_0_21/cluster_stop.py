"""A stop asked of one process reaches every process of its Bytewax cluster, through PostgreSQL.

Bytewax ends a cluster cleanly only when every input of every process has ended. A process
asked to stop records it in ``user_activity.stream_stops``; each process checks that row once a
second and stops too when the request is newer than its own start (database clock). PostgreSQL
unreachable: the stop stays local.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg

from runtime.logs import log_event
from runtime.shutdown import Shutdown

logger = logging.getLogger(__name__)

PEER_STOP = "peer-stop"

_REQUEST = """
INSERT INTO user_activity.stream_stops (flow, requested_at, requested_by)
VALUES (%s, now(), %s)
ON CONFLICT (flow) DO UPDATE SET requested_at = excluded.requested_at,
                                 requested_by = excluded.requested_by
"""
_LATEST = "SELECT requested_at, requested_by FROM user_activity.stream_stops WHERE flow = %s"


class ClusterStop:
    """Shares the stop requests of ``flow`` between the processes of its cluster."""

    def __init__(self, dsn: str, flow: str, stopping: Shutdown, *,
                 tcp_options: Mapping[str, Any] | None = None) -> None:
        self._dsn, self._tcp_options, self._flow = dsn, dict(tcp_options or {}), flow
        self._stopping = stopping
        self._started_at: datetime | None = None
        self._born, self._announced = time.monotonic(), False
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None

    def check(self) -> None:
        """Announce this process's stop, or take a newer peer's; never raises."""
        if self._announced:
            return
        try:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = psycopg.connect(
                    self._dsn, autocommit=True, connect_timeout=5,
                    application_name=f"user-activity-stop-{self._flow}", **self._tcp_options)
            self._check(conn)
        except psycopg.Error:
            self.close()

    def close(self) -> None:
        """Close the connection (the next check opens one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _check(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        if self._started_at is None:  # this process's start, on the database's clock
            row = conn.execute("SELECT now()").fetchone()
            assert row is not None
            self._started_at = row[0] - timedelta(seconds=time.monotonic() - self._born)
        if not self._stopping.requested():
            row = conn.execute(_LATEST, (self._flow,)).fetchone()
            if row is None or row[0] <= self._started_at:
                return
            log_event(logger, "cluster-stop-received", logging.WARNING, flow=self._flow,
                      requested_by=row[1])
            self._stopping.request(PEER_STOP)
        elif self._stopping.signal != PEER_STOP:
            conn.execute(_REQUEST, (self._flow, socket.gethostname()))
            log_event(logger, "cluster-stop-requested", logging.WARNING, flow=self._flow)
        self._announced = True
        self.close()
