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

A migration never holds the running job for more than :data:`LOCK_TIMEOUT_SECONDS` (5 s) at a
time. Its DDL's ACCESS EXCLUSIVE lock request (``ALTER TABLE``, ``CREATE INDEX`` without
CONCURRENTLY, ``ADD CONSTRAINT``) queues behind any open transaction on the table (an analyst's
``BEGIN; SELECT ...``), and every later statement on the table, the job's too, queues behind it.
Measured before (1,000 events/s, a reader open for 45 s): ``migrate`` waited the 45 s without a
word, the job's batch statement hit its 30 s statement timeout (``postgres-retry``,
``QueryCanceled``, ``/readyz`` 503) and waited again, its stream stopped for the whole 45 s. Now
each transactional migration runs with that ``lock_timeout``: a timeout rolls it back, is said
(``migrate-lock-timeout``: the migration, the attempt, the sessions that blocked it, from
``pg_blocking_pids``), and it is tried again after a back-off (the lock timeout doubled per
attempt, at most 60 s: the job runs at least half the time), for at most
``blocked_wait_seconds`` (240 s: within the Job's deadline after a 600 s wait for the lock), then
:class:`MigrationBusy` (exit 75) names the blockers. A migration marked ``-- transactional:
false`` (``CREATE INDEX CONCURRENTLY``, which also waits for older transactions and would leave
an invalid index if cancelled) runs without it: it must take no lock that blocks writers.

A role that lacks a right the migrations need is refused with one line naming the right
(:class:`MigrationRefused`). Without the check, yoyo failed to create its own tables without a
word and then reported ``relation "yoyo_lock" does not exist`` in a 40-line traceback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from yoyo import get_backend, read_migrations

from runtime.logs import log_event

LOCK = (1970496882, 1835624306)
"""The migrations' session advisory lock (``pg_locks``: ``classid``, ``objid``): "user", "migr"."""

_LOG = logging.getLogger(__name__)

LOCK_TIMEOUT_SECONDS = 5.0
"""A transactional migration's ``lock_timeout``: how long it may hold the job's statements."""

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
    """Another run held the migrations' lock, or other sessions a table, too long (one line)."""


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
def migration_lock(dsn: str, wait_seconds: float = 600.0,
                   connect_options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Hold :data:`LOCK` on a connection of its own; wait for it at most ``wait_seconds``.

    ``connect_options``: the settings' TCP options (``Settings.database_tcp_options``), so the
    server ends the session, and the lock with it, soon after a migrate pod's node is lost
    (with the OS's defaults it held it about two hours: every later run waited its 600 s and
    stopped). The session must stay while the run lasts: a server or pooler that ends idle
    sessions (``idle_session_timeout``, transaction pooling) would let a second run in.
    """
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                         application_name="user-activity-migrate",
                         **dict(connect_options or {})) as conn:
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
                log_event(_LOG, "migrate-waiting-for-lock", logging.WARNING,
                          holder=_holder(conn), waited_s=round(waited))
                next_line += 10.0
            time.sleep(0.5)
        yield  # the lock goes with the connection's session


def _remove_stale_yoyo_lock(backend: Any) -> None:
    """Delete a ``yoyo_lock`` row a killed run left (only ever called under :data:`LOCK`)."""
    rows = backend.execute(f"SELECT pid, ctime FROM {backend.lock_table_quoted}").fetchall()
    if rows:
        backend.break_lock()
        log_event(_LOG, "migrate-stale-lock-removed", logging.WARNING,
                  left_by_client_pid=rows[0][0], since=str(rows[0][1]))


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
                     connect_options: Mapping[str, Any] | None = None,
                     lock_wait_seconds: float = 600.0,
                     lock_timeout_seconds: float = LOCK_TIMEOUT_SECONDS,
                     blocked_wait_seconds: float = 240.0) -> list[str]:
    """Apply every pending migration; return the ids of those applied now.

    Raises :class:`MigrationRefused` when the role lacks a right (before anything is applied,
    or, for the right to alter a table another role owns, at the migration that needs it:
    a migration in a transaction is then rolled back), :class:`MigrationBusy` when another run
    held the lock for ``lock_wait_seconds``, or when a migration's locks stayed taken by other
    sessions (each attempt waits ``lock_timeout_seconds``) for ``blocked_wait_seconds``.
    """
    check_rights(dsn)
    with migration_lock(dsn, lock_wait_seconds, connect_options):
        return _apply(dsn, directory, lock_timeout_seconds, blocked_wait_seconds)


def _apply(dsn: str, directory: Path, lock_timeout: float, blocked_wait: float) -> list[str]:
    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(directory))
    _remove_stale_yoyo_lock(backend)
    try:
        with backend.lock(), _BlockerWatch(dsn) as watch:
            timed = _timed_backend(backend, lock_timeout, watch)
            pending = backend.to_apply(migrations)
            for migration in pending:
                migration.load()
                if migration.use_transactions:
                    _apply_bounded(timed, migration, lock_timeout, blocked_wait, watch)
                else:
                    backend.apply_one(migration)
            backend.run_post_apply(pending)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationRefused(str(exc).splitlines()[0]) from None
    return [m.id for m in pending]


def _apply_bounded(backend: Any, migration: Any, lock_timeout: float, blocked_wait: float,
                   watch: _BlockerWatch) -> None:
    """Apply one transactional migration, again after a back-off while its locks time out."""
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        watch.blockers = []
        try:
            backend.apply_one(migration)
            return
        except psycopg.errors.LockNotAvailable:
            waited = time.monotonic() - started
            blocked_by = "; ".join(watch.blockers) or "sessions that ended before they were seen"
            if waited >= blocked_wait:
                raise MigrationBusy(
                    f"migration {migration.id} could not take its locks within {lock_timeout:g} s"
                    f" in {attempt} attempt(s) over {waited:.0f} s (blocked by {blocked_by}):"
                    f" it was rolled back; end those sessions (or wait for them) and run migrate"
                    f" again") from None
            delay = min(lock_timeout * 2 ** (attempt - 1), 60.0)
            log_event(_LOG, "migrate-lock-timeout", logging.WARNING, migration=migration.id,
                      attempt=attempt, lock_timeout_s=lock_timeout, retry_in_s=delay,
                      blocked_by=blocked_by)
            time.sleep(delay)


def _timed_backend(backend: Any, lock_timeout: float, watch: _BlockerWatch) -> Any:
    """A yoyo backend like ``backend`` whose connections wait at most ``lock_timeout`` for a lock.

    Each migration gets a connection of its own (``apply_one``); its pid goes to ``watch``.
    """

    class Timed(type(backend)):  # type: ignore[misc]
        def init_connection(self, connection: Any) -> None:  # called again after a rollback
            super().init_connection(connection)
            connection.execute(f"SET lock_timeout = {max(1, round(lock_timeout * 1000))}")
            watch.pid = connection.info.backend_pid

    return Timed(backend.uri, backend.migration_table)


_BLOCKERS = """
SELECT b.pid, coalesce(nullif(b.application_name, ''), '-'), coalesce(host(b.client_addr), 'local'),
       b.state, round(extract(epoch FROM now() - b.xact_start))::bigint,
       left(regexp_replace(b.query, '\\s+', ' ', 'g'), 100)
FROM unnest(pg_blocking_pids(%s)) AS blocker(pid) JOIN pg_stat_activity b ON b.pid = blocker.pid
"""


class _BlockerWatch:
    """Who the migrating connection waits for, looked at every 0.2 s from a connection of its own.

    After a lock timeout the wait is over and ``pg_blocking_pids`` says nothing: the sessions are
    those seen during the attempt.
    """

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="migrate-blockers", daemon=True)
        self.pid: int | None = None
        self.blockers: list[str] = []

    def __enter__(self) -> _BlockerWatch:
        self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10,
                                     application_name="user-activity-migrate")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)
        self._conn.close()

    def _run(self) -> None:
        with contextlib.suppress(psycopg.Error):
            while not self._done.wait(0.2):
                if self.pid is None:
                    continue
                seen = [f"server pid {pid}, {app} from {client}, {state}, in a transaction"
                        f" for {age} s: {query}"
                        for pid, app, client, state, age, query
                        in self._conn.execute(_BLOCKERS, (self.pid,)).fetchall()]
                if seen:
                    self.blockers = seen
