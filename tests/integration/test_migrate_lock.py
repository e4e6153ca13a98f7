"""``migrate`` one run at a time, also after a run was killed: the lock dies with its session."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime

import psycopg
import pytest

from cli.migrate import LOCK, MIGRATIONS_DIR, MigrationBusy, apply_migrations
from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT
from tests.support import scratch_database

pytestmark = pytest.mark.integration

EVERY = len(sorted(MIGRATIONS_DIR.glob("*.sql")))


def _migrate(dsn: str) -> subprocess.Popen[str]:
    env = {**base_env(), "USER_ACTIVITY_DATABASE_URL": dsn}
    return subprocess.Popen([sys.executable, "-m", "cli", "migrate"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_lock_row_left_by_a_killed_migrate_does_not_block_the_next_one(
    database_url: str,
) -> None:
    """A killed run's row in ``yoyo_lock`` (yoyo's lock) no longer blocks every later run.

    Measured before: every later ``migrate`` failed after 10 s, exit 1, a 29-line traceback
    ending "Process N has locked this database (run yoyo break-lock ...)", for ever. Now the
    run holds a session advisory lock (gone with a killed session): the row can only be a
    leftover, is removed and said, and the migrations are applied.
    """
    with scratch_database(database_url, "stale_lock") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:  # what a killed run leaves
            conn.execute("CREATE TABLE yoyo_lock (locked INT DEFAULT 1, ctime TIMESTAMP,"
                         " pid INT NOT NULL, PRIMARY KEY (locked))")
            conn.execute("INSERT INTO yoyo_lock VALUES (1, %s, 4242)",
                         (datetime.now(UTC).replace(tzinfo=None),))
        started = time.monotonic()
        out, err = _migrate(dsn).communicate(timeout=60)
        assert f"applied {EVERY} migration(s)" in out, err[-2000:]
        assert time.monotonic() - started < 8
        assert err.count('"migrate-stale-lock-removed"') == 1
        assert '"left_by_client_pid":4242' in err
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM yoyo_lock").fetchone() == (0,)


def test_two_migrates_at_once_apply_each_migration_once_and_a_held_lock_is_said(
    database_url: str,
) -> None:
    """Two init Jobs at once: both end 0, the migrations applied once in all.

    A run that finds the lock held says which session holds it, and gives up after its wait.
    """
    with scratch_database(database_url, "two_migrates") as dsn:
        runs = [_migrate(dsn), _migrate(dsn)]
        outs = [run.communicate(timeout=60) for run in runs]
        assert [run.returncode for run in runs] == [0, 0], [err[-1000:] for _, err in outs]
        counts = sorted(int(out.split("applied ")[1].split()[0]) for out, _ in outs)
        assert counts == [0, EVERY]
        with psycopg.connect(dsn, autocommit=True, application_name="holder") as holder:
            holder.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", LOCK)
            with pytest.raises(MigrationBusy, match=r"still does \(server pid \d+, holder from"):
                apply_migrations(dsn, lock_wait_seconds=1.0)
        assert apply_migrations(dsn) == []  # the holder's session ended: free again

