"""Apply the forward-only SQL migrations in ``migrations/`` with yoyo-migrations.

Idempotent: applied migrations are recorded by yoyo and skipped; a lock keeps two concurrent
runs (two pods, a migration Job) from applying the same file twice.

A role that lacks a right the migrations need is refused with one line naming the right
(:class:`MigrationRefused`). Without the check, yoyo failed to create its own tables without a
word and then reported ``relation "yoyo_lock" does not exist`` in a 40-line traceback.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
from yoyo import get_backend, read_migrations

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def yoyo_url(dsn: str) -> str:
    """Yoyo's URL for a ``postgresql://`` DSN, using the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix) :]
    return dsn


class MigrationRefused(Exception):
    """The database role cannot apply the migrations: a right is missing (one line)."""


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


def apply_migrations(dsn: str, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply every pending migration; return the ids of those applied now.

    Raises :class:`MigrationRefused` when the role lacks a right (before anything is applied,
    or, for the right to alter a table another role owns, at the migration that needs it:
    a migration in a transaction is then rolled back).
    """
    check_rights(dsn)
    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(directory))
    try:
        with backend.lock():
            pending = backend.to_apply(migrations)
            backend.apply_migrations(pending)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationRefused(str(exc).splitlines()[0]) from None
    return [m.id for m in pending]
