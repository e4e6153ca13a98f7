"""``migrate`` one run at a time, also after a run was killed: the lock dies with its session."""

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



@contextmanager
def _analyst(dsn: str, seconds: float, statement: str) -> Iterator[int]:
    """An open transaction on action_events (``statement``), ended after ``seconds``; its pid."""
    conn = psycopg.connect(dsn, application_name="analyst")
    conn.execute(statement)
    pid = conn.info.backend_pid
    timer = threading.Timer(seconds, conn.rollback)
    timer.start()
    try:
        yield pid
    finally:
        timer.join()
        conn.close()


def _with_migration(tmp_path: Path, sql: str) -> Path:
    directory = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, directory)
    (directory / "0999_under_test.sql").write_text(sql)
    return directory


def test_a_migration_behind_a_long_transaction_holds_the_job_at_most_its_lock_timeout(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """An ALTER TABLE queued behind an analyst's 8 s transaction, while the job reads and writes.

    Measured before: ``migrate`` waited the whole transaction without a word, and every
    statement of the job on the table queued behind its lock request (8 s here; with a longer
    transaction, the job's 30 s statement timeout, a retry, and the same again). Now each attempt
    gives up after the 5 s lock timeout, says who blocks it, and is tried again after a back-off.
    """
    directory = _with_migration(
        tmp_path, "ALTER TABLE user_activity.action_events ADD COLUMN under_test text;\n")
    with scratch_database(database_url, "blocked_migration") as dsn:
        apply_migrations(dsn)
        latencies: list[float] = []
        done = threading.Event()

        def job() -> None:  # any statement on the table queues behind the ALTER's request
            with psycopg.connect(dsn, autocommit=True, options="-c statement_timeout=30000") as c:
                while not done.is_set():
                    started = time.monotonic()
                    c.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.05)

        runner = threading.Thread(target=job, daemon=True)
        runner.start()
        with caplog.at_level("WARNING", logger="cli.migrate"), \
                _analyst(dsn, 8.0, "SELECT count(*) FROM user_activity.action_events") as pid:
            started = time.monotonic()
            assert apply_migrations(dsn, directory) == ["0999_under_test"]
            took = time.monotonic() - started
        done.set()
        runner.join(35)
        assert 8.0 <= took < 20, took
        assert max(latencies) < 6.5, f"the job was held {max(latencies):.1f} s"
        said = [r for r in caplog.records if r.getMessage() == "migrate-lock-timeout"]
        assert said, "the lock timeout was not said"
        assert getattr(said[0], "migration", None) == "0999_under_test"
        assert f"server pid {pid}, analyst from" in getattr(said[0], "blocked_by", "")


def test_a_migration_blocked_for_longer_than_its_wait_is_rolled_back_with_one_line(
    database_url: str, tmp_path: Path,
) -> None:
    directory = _with_migration(
        tmp_path, "ALTER TABLE user_activity.outbox ADD COLUMN under_test text;\n")
    with scratch_database(database_url, "blocked_for_good") as dsn:
        apply_migrations(dsn)
        with _analyst(dsn, 2.0, "SELECT count(*) FROM user_activity.outbox") as pid, \
                pytest.raises(MigrationBusy, match=rf"0999_under_test could not take its locks"
                              rf" within 0.5 s in 1 attempt.*server pid {pid}, analyst from"):
            apply_migrations(dsn, directory, lock_timeout_seconds=0.5, blocked_wait_seconds=0.1)
        with psycopg.connect(dsn, autocommit=True) as conn:
            column = conn.execute("SELECT EXISTS (SELECT FROM information_schema.columns"
                                  " WHERE column_name = 'under_test')").fetchone()
        assert column == (False,)
        assert apply_migrations(dsn, directory) == ["0999_under_test"]  # nothing half done


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
        with _analyst(dsn, 2.0, "LOCK TABLE user_activity.action_events IN ROW EXCLUSIVE MODE"):
            started = time.monotonic()
            assert apply_migrations(dsn, directory, lock_timeout_seconds=0.5) == [
                "0999_under_test"]
            assert time.monotonic() - started >= 1.5  # it did wait for the writer
        with psycopg.connect(dsn, autocommit=True) as conn:
            valid = conn.execute("SELECT indisvalid FROM pg_index WHERE indexrelid ="
                                 " 'user_activity.ix_under_test'::regclass").fetchone()
        assert valid == (True,)
