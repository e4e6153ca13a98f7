"""The Bytewax recovery volume fills up (ENOSPC): a real small filesystem (tmpfs), real services.

Before runtime/recovery_volume.py the job died of a Rust panic in SQLite, exit code 1, with no
line naming the volume: ``database or disk is full`` when a snapshot did not fit, ``disk I/O
error`` at every start on the full volume. Now both are one ``recovery-volume-full`` line and
exit code 74; once space is freed the job resumes from its last snapshot, every message exactly
once, and the SQLite store is intact. Mounting needs root: skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devenv.harness.env import settings_env
from devenv.harness.jobs import ROOT, JobProcess, JobSupervisor, wait_until
from devenv.harness.stream import PacedProducer, good_stream
from runtime.bytewax_0_21.recovery import RECOVERY_VOLUME_FULL
from tests.chaos import (
    assert_exact_outcome,
    count_rows,
    stop_job,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory

MIN_FREE = 1024 * 1024
FREE_BYTES = "user_activity_recovery_volume_free_bytes"
MIN_FREE_BYTES = "user_activity_recovery_volume_min_free_bytes"


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB, unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (and mount(8))")
    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(volume)], check=True)
    try:
        yield volume
    finally:
        subprocess.run(["umount", "--lazy", str(volume)], check=False)


def _fill(volume: Path, leave: int = 0) -> Path:
    """Fill ``volume`` up to ``leave`` free bytes with one file; that file."""
    filler = volume / "filler"
    space = os.statvfs(volume)
    with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):  # ENOSPC: full
        out.write(b"\0" * max(0, space.f_bavail * space.f_frsize - leave))
    return filler


def _full_lines(job: JobProcess, run: int) -> list[dict[str, Any]]:
    return [e for e in job.log_events(run) if e.get("event") == "recovery-volume-full"]


def _wait_for_full_line(job: JobProcess, run: int) -> dict[str, Any]:
    wait_until(lambda: len(_full_lines(job, run)) > 0, 10, "a recovery-volume-full line",
               context=lambda: job.log_tail(20))
    [line] = _full_lines(job, run)
    return line


def _integrity(recovery: Path) -> dict[str, str]:
    checks = {}
    for part in sorted(recovery.glob("part-*.sqlite3")):
        with contextlib.closing(sqlite3.connect(part)) as conn:
            checks[part.name] = conn.execute("PRAGMA integrity_check").fetchone()[0]
    return checks


def test_a_recovery_volume_filling_up_while_running_stops_the_job_with_one_line_and_exit_74(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, small_volume: Path,
) -> None:
    settings = make_settings(tail=True, recovery_min_free_bytes=MIN_FREE)
    stream = good_stream(settings, database_url, 1_500, seed=11)
    recovery = small_volume / "recovery"
    job = jobs.job(settings, recovery_dir=recovery, snapshot_interval=1, backup_interval=10)
    job.start()
    producer = PacedProducer(settings, stream.records, rate=150)
    producer.start()
    wait_for_rows(job, database_url, stream, 300, timeout=60)
    watched = job.metrics()
    assert watched[FREE_BYTES] > MIN_FREE and watched[MIN_FREE_BYTES] == MIN_FREE

    # (a) The volume fills while the job runs: its next snapshot cannot be written.
    filler = _fill(small_volume)
    assert job.wait(60) == RECOVERY_VOLUME_FULL
    line = _wait_for_full_line(job, 1)
    assert line["level"] == "ERROR" and line["recovery_dir"] == str(recovery)
    assert line["free_bytes"] < MIN_FREE and line["exit_code"] == RECOVERY_VOLUME_FULL

    # (b) A start on the full volume ends before Bytewax opens the store, without a panic.
    job.start(wait_http=0)
    assert job.wait(60) == RECOVERY_VOLUME_FULL
    assert _wait_for_full_line(job, 2)["recovery_dir"] == str(recovery)
    assert "panicked" not in job.log_paths[-1].read_text()

    # Space freed: it resumes from its last snapshot; nothing lost, nothing twice.
    filler.unlink()
    job.start()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    assert stop_job(job)["stop_exit_code"] == 0
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    assert job.exit_codes == [RECOVERY_VOLUME_FULL, RECOVERY_VOLUME_FULL, 0]
    assert _integrity(recovery) == {"part-0.sqlite3": "ok"}


def test_a_start_on_a_recovery_volume_short_of_the_minimum_ends_with_one_line_and_exit_74(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, small_volume: Path,
) -> None:
    settings = make_settings(tail=True, recovery_min_free_bytes=MIN_FREE)
    stream = good_stream(settings, database_url, 50, seed=12)
    recovery = small_volume / "recovery"
    job = jobs.job(settings, recovery_dir=recovery)
    job.init_recovery()
    filler = _fill(small_volume, leave=MIN_FREE // 2)  # some room, less than a snapshot needs

    job.start(wait_http=0)

    assert job.wait(60) == RECOVERY_VOLUME_FULL
    line = _wait_for_full_line(job, 1)
    assert 0 < line["free_bytes"] < MIN_FREE and line["recovery_dir"] == str(recovery)
    filler.unlink()
    job.start()
    producer = PacedProducer(settings, stream.records, rate=100)
    producer.start()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    assert stop_job(job)["stop_exit_code"] == 0
    assert count_rows(database_url, stream.good_ids) == len(stream.good_ids)
    assert_exact_outcome(settings, database_url, stream, deliveries)


def test_the_operator_commands_that_make_a_store_on_a_full_volume_end_with_one_line_and_74(
    make_settings: SettingsFactory, small_volume: Path,
) -> None:
    """``init-recovery`` and ``replay`` open SQLite stores too: on a full volume Bytewax panicked.

    Before: ``init-recovery`` died in a Rust panic (exit 1), ``replay`` likewise. Now each prints
    the ``recovery-volume-full`` line and exits 74, having written nothing.
    """
    settings = make_settings(recovery_min_free_bytes=MIN_FREE)
    env = settings_env(settings)
    _fill(small_volume)
    for command, store in (
        (["init-recovery", str(small_volume / "store"), "--partitions", "2"], "store"),
        (["replay", "--from-beginning", "--recovery-dir", str(small_volume / "replay")],
         "replay"),
    ):
        done = subprocess.run([sys.executable, "-m", "cli", *command], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == RECOVERY_VOLUME_FULL, (command, done.stderr[-3000:])
        assert "panicked" not in done.stderr and "Traceback" not in done.stderr
        full = [json.loads(line) for line in (done.stdout + done.stderr).splitlines()
                if '"recovery-volume-full"' in line]
        assert len(full) == 1 and full[0]["recovery_dir"] == str(small_volume / store)
        assert not list((small_volume / store).glob("part-*.sqlite3"))
