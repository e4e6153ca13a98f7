"""A PostgreSQL connection owned by one step, reopened after a failure.

Each sink partition and the outbox publisher own one connection: a single-threaded step gains
nothing from a pool, and a dead connection is replaced on the next attempt of the retry loop.
Every wait of the connection for the server is watched (:mod:`runtime.call_watch`): a call with
no answer for the statement timeout plus ``SLOW_MARGIN_SECONDS`` pauses its step on
``postgres`` (``/readyz`` 503) and is logged, where nothing else of ours would notice it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from runtime.call_watch import Watched
from runtime.settings import Settings

Connection = psycopg.Connection[tuple[Any, ...]]
"""A psycopg connection returning tuple rows."""

SLOW_MARGIN_SECONDS = 5.0
"""A call is said not answering this long after the statement timeout should have ended it."""

COMMAND_SLOW_SECONDS = 60.0
"""When an operator command's call is said not answering: their sessions have no statement
timeout (a partition's drop or a requeue may take long), so the job's bound does not apply."""


class WatchedConnection(psycopg.Connection[tuple[Any, ...]]):
    """A connection whose every wait for the server (a statement, a commit, a fetch) is watched.

    psycopg's blocking calls all go through :meth:`wait`; connecting does not (it has its own
    ``connect_timeout``).
    """

    watched: Watched | None = None

    def wait(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - psycopg's
        watched = self.watched
        if watched is None:
            return super().wait(*args, **kwargs)
        with watched:
            return super().wait(*args, **kwargs)

SESSION_OPTIONS = "-c jit=off"
"""Every job connection's session settings (besides its statement timeout). jit off: the batch
statements' row estimates (CTEs over 1,000-2,000 unnested rows) pass ``jit_above_cost``, and
compiling them took ~34 ms of a 108 ms statement of 2,000 rows (docs/performance.md)."""


def connect_watched(dsn: str, application_name: str, slow_after: float,
                    **kwargs: Any) -> WatchedConnection:
    """A connection whose waits are watched: one with no answer for ``slow_after`` s is said.

    What :class:`Database` uses, and the operator commands (``maintain``, ``outbox``): a server
    that froze after they connected made them wait for ever without a word.
    """
    conn = WatchedConnection.connect(dsn, application_name=application_name, **kwargs)
    conn.watched = Watched(application_name, "postgres", slow_after)
    return conn


class Database:
    """A lazily opened autocommit connection; transactions are explicit (``conn.transaction()``)."""

    def __init__(self, settings: Settings, application_name: str, *,
                 statement_timeout_ms: int | None = None) -> None:
        """A connection with the settings' statement timeout, or ``statement_timeout_ms``.

        A step that must not wait as long as the sinks may (the outbox watchdog) sets its own.
        """
        self._dsn = settings.database_dsn()
        self._application_name = application_name
        self._tcp_options = settings.database_tcp_options()
        if statement_timeout_ms is None:
            statement_timeout_ms = settings.db_statement_timeout_ms
        self._options = " ".join(filter(None, (
            f"-c statement_timeout={statement_timeout_ms}", SESSION_OPTIONS,
            self._tcp_options.pop("options", ""))))
        self._conn: Connection | None = None
        self._slow_after = statement_timeout_ms / 1000 + SLOW_MARGIN_SECONDS

    def connection(self) -> Connection:
        """The open connection, connecting first if needed (raises OperationalError if down)."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self.reset()
            conn = self._conn = connect_watched(
                self._dsn, self._application_name, self._slow_after, autocommit=True,
                connect_timeout=5, **self._tcp_options, options=self._options)
        return conn

    def reset(self) -> None:
        """Drop the current connection (after an infrastructure error); the next call reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        """Close the connection for good."""
        self.reset()
