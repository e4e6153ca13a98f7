"""``user-activity check`` on PostgreSQL: the role's privileges and the migration level."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from cli import check
from cli.migrate import MIGRATIONS_DIR, apply_migrations
from runtime.settings import Settings
from tests.support import scratch_database

pytestmark = pytest.mark.integration


def _failing(settings: Settings) -> list[tuple[str, str, str]]:
    return [(kind, name, found) for kind, name, ok, found in check.postgres_rows(settings)
            if not ok]


def test_a_missing_privilege_a_foreign_owner_and_a_pending_migration_are_each_named(
    database_url: str,
) -> None:
    role = f"job_{uuid.uuid4().hex[:8]}"
    last = sorted(path.stem for path in MIGRATIONS_DIR.glob("*.sql"))[-1]
    with scratch_database(database_url, "check") as dsn:
        apply_migrations(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN")
            conn.execute(f"GRANT USAGE, CREATE ON SCHEMA user_activity TO {role}")
            conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA"
                         f" user_activity TO {role}")
            conn.execute(f"REVOKE INSERT ON user_activity.action_events FROM {role}")
            conn.execute(f"GRANT SELECT ON _yoyo_migration TO {role}")
        as_role = urlunsplit(urlsplit(dsn)._replace(
            netloc=f"{role}@{urlsplit(dsn).hostname}:{urlsplit(dsn).port}"))
        try:
            without_maintenance = _failing(Settings(database_url=as_role,
                                                    maintenance_interval_seconds=0))
            with_maintenance = _failing(Settings(database_url=as_role))
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DELETE FROM _yoyo_migration WHERE migration_id = %s", (last,))
            owner = _failing(Settings(database_url=dsn))
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(f"DROP OWNED BY {role}")
                conn.execute(f"DROP ROLE {role}")

    lacking = ("table", "user_activity.action_events",
               "this role lacks INSERT (needs SELECT, INSERT)")
    assert without_maintenance == [lacking]
    assert with_maintenance[0] == lacking
    assert [(kind, name) for kind, name, _ in with_maintenance[1:]] == [
        ("partitions", "user_activity.outbox"),
        ("partitions", "user_activity.consumer_idempotency_marks")]
    assert owner == [("migrations", f"{len(list(MIGRATIONS_DIR.glob('*.sql')))} files",
                      f"not applied: {last} (user-activity migrate)")]
