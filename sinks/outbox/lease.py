"""The outbox lease: one publishing process per database, a session advisory lock.

The holder's PostgreSQL session holds the lock (on a primary only: a snapshot taken on a hot
standby lists no transaction in progress). The session ends with the process, with a dead
connection (``db_dead_connection_seconds``) or after ``outbox_lease_seconds`` idle (a frozen
holder, or one waiting out an outage): a standby then takes the lease within
``outbox_idle_poll_seconds``. A holder that gives its connection up ends that session if it
still holds the lock, so it takes the lease again rather than wait for itself; a closing holder
unlocks first, so a standby takes over at once. The lease only keeps publishers from taking
turns; Kafka's fencing of the stream's ``transactional.id`` keeps a former holder from publishing.
"""

from __future__ import annotations

import contextlib
import logging
import time

import psycopg

from runtime.logs import log_event
from runtime.settings import Settings
from sinks.db import Connection, Database
from sinks.outbox.sql import query

logger = logging.getLogger(__name__)

LEASE_KEY = 0x75615F6F7574626F
"""The session advisory lock held by the one publishing process ('ua_outbo')."""


class Lease:
    """The process's claim on the lease, and the holder's connection."""

    def __init__(self, settings: Settings, name: str) -> None:
        self._settings = settings
        self._db = Database(settings, f"user-activity-{name}")
        self._conn: Connection | None = None
        self._session: tuple[int, object] | None = None  # the holder's (pid, backend_start)
        self._former: tuple[int, object] | None = None  # the session given up
        self._tried_at = -1e9

    @property
    def held(self) -> bool:
        """True while this process's session holds the lease (as far as it knows)."""
        conn = self._conn
        return conn is not None and not conn.closed and not conn.broken

    def connection(self) -> Connection:
        """The connection: the holder's session while held, else a fresh one."""
        return self._conn if self.held and self._conn is not None else self._db.connection()

    def take(self, *, force: bool = False) -> bool:
        """Hold the lease, taking it if it is free (tried at most every poll interval).

        Raises psycopg errors when PostgreSQL does not answer.
        """
        if self.held:
            return True
        if self._conn is not None:  # its session ended: the lease went with it
            self.lost()
        now = time.monotonic()
        if not force and now - self._tried_at < self._settings.outbox_idle_poll_seconds:
            return False
        self._tried_at = now
        conn = self._db.connection()
        if not self._try_lock(conn):
            return False  # another process holds it, or this server is a standby
        seconds = int(self._settings.outbox_lease_seconds * 1000)
        conn.execute(f"SET idle_session_timeout = {seconds}")
        conn.execute("SET synchronous_commit = off")  # a lost cache update only lags (table doc)
        session = conn.execute("SELECT pid, backend_start FROM pg_stat_activity"
                               " WHERE pid = pg_backend_pid()").fetchone()
        self._session = None if session is None else (int(session[0]), session[1])
        self._conn = conn
        log_event(logger, "outbox-lease-taken", logging.INFO)
        return True

    def _try_lock(self, conn: Connection) -> bool:
        row = conn.execute(query("take_lease"), (LEASE_KEY,)).fetchone()
        if row is not None and row[0]:
            return True
        former, self._former = self._former, None
        if former is None:
            return False
        ended = conn.execute(query("end_former_session"), {
            "pid": former[0], "started": former[1], "key": LEASE_KEY})
        if not any(r[0] for r in ended.fetchall()):
            return False
        log_event(logger, "outbox-former-session-ended", logging.WARNING, pid=former[0])
        row = conn.execute(query("take_lease"), (LEASE_KEY,)).fetchone()
        return bool(row is not None and row[0])

    def confirm(self) -> None:
        """One round trip on the holder's session: raises a psycopg error if it has ended.

        Before the stream is opened: a holder frozen past the lease must not fence the new one.
        """
        self.connection().execute("SELECT 1")

    def lost(self) -> None:
        """The session (and the lease) is gone, or must be given up: a new one is opened."""
        if self._conn is not None:
            log_event(logger, "outbox-lease-lost", logging.WARNING)
            self._former = self._session
        self._conn = None
        self._db.reset()

    def close(self) -> None:
        """Give the lease up (the session ends)."""
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):  # a standby need not wait for the session
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (LEASE_KEY,))
            log_event(logger, "outbox-lease-released", logging.INFO)
        self._conn = None
        self._db.close()
