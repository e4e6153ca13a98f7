"""Apply the forward-only SQL migrations in ``migrations/`` with yoyo-migrations.

Idempotent: applied migrations are recorded by yoyo and skipped. One run at a time: a session
advisory lock (:data:`LOCK`) keeps two concurrent runs (two pods, a migration Job) from applying
the same file twice; the second waits, saying every 10 s which session holds it, for at most
``lock_wait_seconds`` (600 s), then stops with one line (:class:`MigrationBusy`, exit 75). The
server releases that lock when its session ends, also when the run is killed. yoyo's own lock (a
row in ``yoyo_lock``) did not: a run killed while it held it (a pod evicted, OOM-killed, past
its Job's deadline) made every later run fail after 10 s with a traceback ("run yoyo break-lock")
until someone deleted the row by hand. Under the advisory lock a row found there can only be
such a leftover: it is removed and said (``migrate-stale-lock-removed``).

A role that lacks a right the migrations need is refused with one line naming the right
(:class:`MigrationRefused`). Without the check, yoyo failed to create its own tables without a
word and then reported ``relation "yoyo_lock" does not exist`` in a 40-line traceback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from yoyo import get_backend, read_migrations

LOCK = (1970496882, 1835624306)
"""The migrations' session advisory lock (``pg_locks``: ``classid``, ``objid``): "user", "migr"."""

_LOG = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def yoyo_url(dsn: str) -> str:
    """Yoyo's URL for a ``postgresql://`` DSN, using the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix) :]
    return dsn


class MigrationRefused(Exception):
    """The database role cannot apply the migrations: a right is missing (one line)."""


class MigrationBusy(Exception):
    """Another run held the migrations' lock longer than this one would wait (one line)."""


_HOLDER = """
SELECT a.pid, coalesce(nullif(a.application_name, ''), '-'), coalesce(host(a.client_addr), 'local'),
       round(extract(epoch FROM now() - a.backend_start))::bigint
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s AND l.objsubid = 2 AND l.granted
"""


def _holder(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(_HOLDER, LOCK).fetchone()
    if row is None:
        return "a session that just ended"
    pid, application, client, age = row
    return f"server pid {pid}, {application} from {client}, connected {age} s ago"


@contextmanager
def migration_lock(dsn: str, wait_seconds: float = 600.0) -> Iterator[None]:
    """Hold :data:`LOCK` on a connection of its own; wait for it at most ``wait_seconds``."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                         application_name="user-activity-migrate") as conn:
        started = time.monotonic()
        next_line = 0.0
        take = "SELECT pg_try_advisory_lock(%s::int4, %s::int4)"
        while not (conn.execute(take, LOCK).fetchone() or (False,))[0]:
            waited = time.monotonic() - started
            if waited >= wait_seconds:
                raise MigrationBusy(
                    f"another migrate has held the migrations' lock for {waited:.0f} s and still"
                    f" does ({_holder(conn)}): nothing was applied; run it again once that one"
                    f" ended (or end that session)")
            if waited >= next_line:
                _LOG.warning("migrate-waiting-for-lock",
                             extra={"holder": _holder(conn), "waited_s": round(waited)})
                next_line += 10.0
            time.sleep(0.5)
        yield  # the lock goes with the connection's session


def _remove_stale_yoyo_lock(backend: Any) -> None:
    """Delete a ``yoyo_lock`` row a killed run left (only ever called under :data:`LOCK`)."""
    rows = backend.execute(f"SELECT pid, ctime FROM {backend.lock_table_quoted}").fetchall()
    if rows:
        backend.break_lock()
        _LOG.warning("migrate-stale-lock-removed",
                     extra={"left_by_client_pid": rows[0][0], "since": str(rows[0][1])})


_RIGHTS = """
SELECT current_user, current_schema(),
       current_schema() IS NOT NULL AND (to_regclass('yoyo_lock') IS NOT NULL
                                         OR has_schema_privilege(current_schema(), 'CREATE')),
       to_regnamespace('user_activity') IS NOT NULL
       OR has_database_privilege(current_database(), 'CREATE')
"""


def check_rights(dsn: str) -> None:
    """Raise :class:`MigrationRefused` when the role cannot create what the migrations need.

    yoyo keeps its bookkeeping tables (``yoyo_lock``, ``_yoyo_migration``, …) in the first
    schema of the search path; the first migration creates the ``user_activity`` schema.
    """
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute(_RIGHTS).fetchone()
    assert row is not None
    role, schema, bookkeeping, user_activity = row
    if not bookkeeping:
        where = f"schema {schema}" if schema else "any schema of its search_path (none exists)"
        raise MigrationRefused(
            f"role {role} cannot create yoyo's bookkeeping tables in {where}: grant it CREATE on"
            f" that schema (or run migrate as its owner)")
    if not user_activity:
        raise MigrationRefused(
            f"role {role} cannot create schema user_activity: grant it CREATE on the database"
            f" (or create the schema for it), or run migrate as the database owner")


def apply_migrations(dsn: str, directory: Path = MIGRATIONS_DIR, *,
                     lock_wait_seconds: float = 600.0) -> list[str]:
    """Apply every pending migration; return the ids of those applied now.

    Raises :class:`MigrationRefused` when the role lacks a right (before anything is applied,
    or, for the right to alter a table another role owns, at the migration that needs it:
    a migration in a transaction is then rolled back), :class:`MigrationBusy` when another run
    held the lock for ``lock_wait_seconds``.
    """
    check_rights(dsn)
    with migration_lock(dsn, lock_wait_seconds):
        return _apply(dsn, directory)


def _apply(dsn: str, directory: Path) -> list[str]:
    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(directory))
    _remove_stale_yoyo_lock(backend)
    try:
        with backend.lock():
            pending = backend.to_apply(migrations)
            backend.apply_migrations(pending)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationRefused(str(exc).splitlines()[0]) from None
    return [m.id for m in pending]
