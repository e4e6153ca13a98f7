"""A PostgreSQL connection owned by one step, reopened after a failure.

One autocommit connection per sink partition and publisher (a single-threaded step gains nothing
from a pool); after an infrastructure failure the retry loop calls :meth:`Database.reset`. A
server that never answers is bounded by the liveness probe (a restart).
"""

from __future__ import annotations

import contextlib
from functools import cache
from importlib import resources
from typing import Any

import psycopg

from runtime.settings import Settings

Connection = psycopg.Connection[tuple[Any, ...]]
"""A psycopg connection returning tuple rows."""

SESSION_OPTIONS = "-c jit=off"  # the batch statements pass jit_above_cost; compiling costs more


@cache
def named_query(package: str, name: str) -> str:
    """The text of ``{name}.sql`` in ``package``, a line ``--@other`` replaced by ``other.sql``."""
    text = resources.files(package).joinpath(f"{name}.sql").read_text(encoding="utf-8")
    return "".join(named_query(package, line.strip()[3:]) if line.startswith("--@") else line
                   for line in text.splitlines(keepends=True))


class Database:
    """A lazily opened autocommit connection; transactions are explicit (``conn.transaction()``)."""

    def __init__(self, settings: Settings, application_name: str, *,
                 statement_timeout_ms: int | None = None) -> None:
        """A connection with the settings' statement timeout, or ``statement_timeout_ms``."""
        self._dsn = settings.database_dsn()
        self._application_name = application_name
        self._tcp_options = settings.database_tcp_options()
        if statement_timeout_ms is None:
            statement_timeout_ms = settings.db_statement_timeout_ms
        self._options = " ".join(filter(None, (
            f"-c statement_timeout={statement_timeout_ms}", SESSION_OPTIONS,
            self._tcp_options.pop("options", ""))))
        self._conn: Connection | None = None

    def connection(self) -> Connection:
        """The open connection, connecting first if needed (raises OperationalError if down)."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self.reset()
            conn = self._conn = psycopg.Connection.connect(
                self._dsn, application_name=self._application_name, autocommit=True,
                connect_timeout=5, **self._tcp_options, options=self._options)
        return conn

    def reset(self) -> None:
        """Drop the current connection (after an infrastructure error); the next call reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    close = reset  # nothing reconnects unless connection() is called again
