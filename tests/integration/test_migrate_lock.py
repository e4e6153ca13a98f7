"""``migrate`` one run at a time, also after a run was killed; never holding the job long."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

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
    """A row in ``yoyo_lock`` (what a run killed under yoyo's own lock leaves) blocks nothing.

    The run holds a session advisory lock instead, which dies with a killed run's session.
    """
    with scratch_database(database_url, "stale_lock") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:  # what a killed run leaves
            conn.execute("CREATE TABLE yoyo_lock (locked INT DEFAULT 1, ctime TIMESTAMP,"
                         " pid INT NOT NULL, PRIMARY KEY (locked))")
            conn.execute("INSERT INTO yoyo_lock VALUES (1, %s, 4242)",
                         (datetime.now(UTC).replace(tzinfo=None),))
        run = _migrate(dsn)
        out, err = run.communicate(timeout=60)  # a liveness bound; yoyo's lock gave up at 10 s
        assert run.returncode == 0, err[-2000:]
        assert f"applied {EVERY} migration(s)" in out, err[-2000:]


def test_two_migrates_at_once_apply_each_migration_once_and_a_held_lock_is_said(
    database_url: str,
) -> None:
    """Two init Jobs at once: both end 0, the migrations applied once in all.

    A run that finds the lock held gives up after its wait, naming the session that holds it.
    """
    with scratch_database(database_url, "two_migrates") as dsn:
        runs = [_migrate(dsn), _migrate(dsn)]
        outs = [run.communicate(timeout=60) for run in runs]
        assert [run.returncode for run in runs] == [0, 0], [err[-1000:] for _, err in outs]
        counts = sorted(int(out.split("applied ")[1].split()[0]) for out, _ in outs)
        assert counts == [0, EVERY]
        with psycopg.connect(dsn, autocommit=True, application_name="holder") as holder:
            holder.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", LOCK)
            with pytest.raises(MigrationBusy, match=r"\(server pid \d+, holder from [\d.]+\)"):
                apply_migrations(dsn, lock_wait_seconds=1.0)
        assert apply_migrations(dsn) == []  # the holder's session ended: free again



@contextmanager
def _analyst(dsn: str, statement: str, seconds: float | None = None) -> Iterator[int]:
    """An open transaction on a table (``statement``), ended after ``seconds`` or at the end."""
    conn = psycopg.connect(dsn, application_name="analyst")
    conn.execute(statement)
    timer = threading.Timer(seconds or 0, conn.rollback)
    if seconds is not None:
        timer.start()
    try:
        yield conn.info.backend_pid
    finally:
        if seconds is not None:
            timer.join()
        conn.close()


def _with_migration(tmp_path: Path, sql: str) -> Path:
    directory = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, directory)
    (directory / "0999_under_test.sql").write_text(sql)
    return directory


def test_a_migration_behind_a_long_transaction_holds_the_job_at_most_its_lock_timeout(
    database_url: str, tmp_path: Path,
) -> None:
    """An ALTER TABLE queued behind an analyst's open transaction while the job reads the table.

    Every statement on the table queues behind the ALTER's lock request: the migration gives up
    after its lock timeout (rolled back, one line naming it: the Job runs it again), so the job
    waits at most that long; once the transaction ended, the next run applies it.
    """
    directory = _with_migration(
        tmp_path, "ALTER TABLE user_activity.action_events ADD COLUMN under_test text;\n")
    with scratch_database(database_url, "blocked_migration") as dsn:
        apply_migrations(dsn)
        latencies: list[float] = []
        done = threading.Event()

        def job() -> None:
            with psycopg.connect(dsn, autocommit=True, options="-c statement_timeout=30000") as c:
                while not done.is_set():
                    started = time.monotonic()
                    c.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
                    latencies.append(time.monotonic() - started)
                    done.wait(0.05)

        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        with _analyst(dsn, "SELECT count(*) FROM user_activity.action_events"), \
                pytest.raises(MigrationBusy, match=r"^migration 0999_under_test could not take"
                              r" its locks within 1 s .*: it was rolled back; run it again$"):
            apply_migrations(dsn, directory, lock_timeout_seconds=1.0)
        done.set()
        runner.join(35)
        # a liveness bound, ten times the lock timeout: held until the analyst ended, the job
        # would have waited out its 30 s statement timeout
        assert max(latencies) < 10.0, f"the job was held {max(latencies):.1f} s"
        with psycopg.connect(dsn, autocommit=True) as conn:
            column = conn.execute("SELECT EXISTS (SELECT FROM information_schema.columns"
                                  " WHERE column_name = 'under_test')").fetchone()
        assert column == (False,)  # nothing half done
        assert apply_migrations(dsn, directory) == ["0999_under_test"]


def test_a_concurrent_index_build_waits_for_writers_without_the_lock_timeout(
    database_url: str, tmp_path: Path,
) -> None:
    """CREATE INDEX CONCURRENTLY (``transactional: false``) runs without the lock timeout.

    It waits for older writers' transactions: with the timeout it would fail, leaving an invalid
    index.
    """
    directory = _with_migration(
        tmp_path, "-- transactional: false\nCREATE INDEX CONCURRENTLY ix_under_test"
                  " ON user_activity.action_events (occurred_at);\n")
    with scratch_database(database_url, "concurrent_index") as dsn:
        apply_migrations(dsn)
        with _analyst(dsn, "LOCK TABLE user_activity.action_events IN ROW EXCLUSIVE MODE", 2.0):
            started = time.monotonic()
            assert apply_migrations(dsn, directory, lock_timeout_seconds=0.5) == [
                "0999_under_test"]
            assert time.monotonic() - started >= 1.5  # it did wait for the writer
        with psycopg.connect(dsn, autocommit=True) as conn:
            valid = conn.execute("SELECT indisvalid FROM pg_index WHERE indexrelid ="
                                 " 'user_activity.ix_under_test'::regclass").fetchone()
        assert valid == (True,)
