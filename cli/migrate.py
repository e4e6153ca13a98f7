"""Apply the forward-only SQL migrations of this image (migrations/, with yoyo).

Idempotent. One run at a time (a session advisory lock, gone with a killed run's session);
waiting for it over 60 s exits 75. A transactional migration waits at most 5 s for its table
locks, so it never holds the running job longer (then rolled back, exit 75). A missing right is
one line naming it, exit 2.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
from yoyo import read_migrations
from yoyo.backends import get_backend_class
from yoyo.connections import parse_uri

LOCK = (1970496882, 1835624306)
"""The migrations' session advisory lock (``pg_locks`` ``classid``, ``objid``)."""

LOCK_TIMEOUT_SECONDS = 5.0

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


class MigrationRefused(Exception):
    """The database role cannot apply the migrations: a right is missing (one line)."""


class MigrationBusy(Exception):
    """Another run held the migrations' lock, or other sessions a table, too long (one line)."""


def apply_migrations(dsn: str, directory: Path = MIGRATIONS_DIR, *,
                     connect_options: Mapping[str, Any] | None = None,
                     lock_wait_seconds: float = 60.0,
                     lock_timeout_seconds: float = LOCK_TIMEOUT_SECONDS) -> list[str]:
    """Apply every pending migration; the ids applied now (:class:`MigrationBusy`, ``Refused``)."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                         application_name="user-activity-migrate",
                         **dict(connect_options or {})) as conn:
        deadline = time.monotonic() + lock_wait_seconds
        # polled: a statement waiting for it is a transaction CREATE INDEX CONCURRENTLY waits for
        while not _one(conn, "SELECT pg_try_advisory_lock(%s::int4, %s::int4)", LOCK):
            if time.monotonic() > deadline:
                raise MigrationBusy(
                    f"another migrate has held the migrations' lock for {lock_wait_seconds:g} s"
                    f" ({_holder(conn)}): nothing was applied; run it again")
            time.sleep(0.5)
        try:
            return _apply(dsn, directory, lock_timeout_seconds)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise MigrationRefused(str(exc).splitlines()[0]) from None


def _apply(dsn: str, directory: Path, lock_timeout: float) -> list[str]:
    plain, timed = _backend(dsn, 0.0), _backend(dsn, lock_timeout)
    pending = plain.to_apply(read_migrations(str(directory)))
    for migration in pending:
        migration.load()
        try:
            (timed if migration.use_transactions else plain).apply_one(migration)
        except psycopg.errors.LockNotAvailable:
            raise MigrationBusy(
                f"migration {migration.id} could not take its locks within {lock_timeout:g} s"
                " (other sessions hold its tables: pg_stat_activity): it was rolled back; run"
                " it again") from None
    plain.run_post_apply(pending)
    return [m.id for m in pending]


def _backend(dsn: str, lock_timeout: float) -> Any:
    """A yoyo backend without yoyo's lock (:data:`LOCK` is held) and with ``lock_timeout``."""
    scheme, _, rest = dsn.partition("://")  # yoyo's URL of the psycopg 3 driver
    uri = parse_uri(f"postgresql+psycopg://{rest}" if scheme in ("postgresql", "postgres") else dsn)

    class Backend(get_backend_class(uri.scheme)):  # type: ignore[misc]
        def lock(self, timeout: int = 10) -> contextlib.nullcontext[None]:
            return contextlib.nullcontext()

        def init_connection(self, connection: Any) -> None:  # also a copy's, per migration
            super().init_connection(connection)
            if lock_timeout:
                connection.execute(f"SET lock_timeout = {max(1, round(lock_timeout * 1000))}")

    backend = Backend(uri, "_yoyo_migration")
    backend.init_database()
    return backend


def _one(conn: psycopg.Connection[Any], query: str, params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    return row and row[0]


def _holder(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(
        "SELECT a.pid, a.application_name, coalesce(host(a.client_addr), 'local')"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype ="
        " 'advisory' AND l.classid = %s AND l.objid = %s AND l.objsubid = 2 AND l.granted",
        LOCK).fetchone()
    return "a session that just ended" if row is None else (
        f"server pid {row[0]}, {row[1] or '-'} from {row[2]}")
