"""Apply the forward-only SQL migrations in ``migrations/`` with yoyo-migrations.

Idempotent: applied migrations are recorded by yoyo and skipped; a lock keeps two concurrent
runs (two pods, a migration Job) from applying the same file twice.
"""

from __future__ import annotations

from pathlib import Path

from yoyo import get_backend, read_migrations

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def yoyo_url(dsn: str) -> str:
    """Yoyo's URL for a ``postgresql://`` DSN, using the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix) :]
    return dsn


def apply_migrations(dsn: str, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply every pending migration; return the ids of those applied now."""
    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(directory))
    with backend.lock():
        pending = backend.to_apply(migrations)
        backend.apply_migrations(pending)
    return [m.id for m in pending]
