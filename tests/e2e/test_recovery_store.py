"""Operator mistakes with the recovery store, on real Kafka + PostgreSQL: refused at start.

Before (``runtime/recovery_store.py``): another flow's store or a replay's ran silently from no
snapshot of its own (the whole retention again) or from the replay's offsets; two jobs on one
store both ran, each reading everything; an empty directory was a Rust backtrace (exit 1). Now
one ``recovery-refused`` line, exit 78; a tailing job with no ``-r`` says so in one WARNING.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devenv.harness.env import base_env, settings_env
from devenv.harness.jobs import ROOT, SESSION_LINKING_FLOW, JobProcess, JobSupervisor
from devenv.harness.stream import PacedProducer, good_stream
from runtime.bytewax_0_21.recovery import RECOVERY_REFUSED, read_store
from tests.chaos import (
    assert_exact_outcome,
    wait_until_drained,
)
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e


def _refused(job: JobProcess) -> dict[str, Any]:
    """Start ``job``, expect exit 78 and exactly one ``recovery-refused`` line; that line."""
    job.start(wait_http=0)
    assert job.reap(60) == RECOVERY_REFUSED, job.log_tail()
    lines = [e for e in job.log_events() if e.get("event") == "recovery-refused"]
    assert len(lines) == 1, job.log_tail()
    assert "Traceback" not in job.log_paths[-1].read_text()
    return lines[0]


def test_the_favorites_job_refuses_the_session_linking_store_and_leaves_it_untouched(
    make_settings: SettingsFactory, jobs: JobSupervisor, tmp_path: Path
) -> None:
    settings = make_settings()
    store = tmp_path / "session-linking-store"
    linking = jobs.job(settings, "linking", flow=SESSION_LINKING_FLOW, recovery_dir=store)
    linking.start()
    linking.wait_until(lambda: any(p.steps for p in read_store(store).partitions), 30,
                       "a session-linking snapshot")
    assert linking.terminate() == 0

    line = _refused(jobs.job(settings, "favorites", recovery_dir=store))

    assert "session_linking" in line["problem"] and line["flow"] == "favorite_actions"
    steps = {s for p in read_store(store).partitions for s in p.steps}
    assert steps and all(s.startswith("session_linking.") for s in steps)


def test_the_job_refuses_a_store_a_replay_made(
    make_settings: SettingsFactory, jobs: JobSupervisor, tmp_path: Path
) -> None:
    settings = make_settings()
    store = tmp_path / "replay-store"
    subprocess.run([sys.executable, "-m", "cli", "replay", "--from-beginning", "--recovery-dir",
                    str(store)], cwd=ROOT, env={**base_env(), **settings_env(settings)},
                   check=True, capture_output=True, timeout=120)

    line = _refused(jobs.job(settings, recovery_dir=store))

    assert "replay" in line["problem"]


def test_an_empty_directory_is_one_line_not_a_backtrace_and_no_recovery_at_all_is_said(
    make_settings: SettingsFactory, jobs: JobSupervisor, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings()
    empty = tmp_path / "empty"
    empty.mkdir()
    job = jobs.job(settings, "empty", recovery_dir=empty)
    monkeypatch.setattr(job, "init_recovery", lambda: None)  # the operator skipped it

    assert "init-recovery" in _refused(job)["problem"]

    unrecovered = jobs.job(settings, "no-r", recovery=False)
    unrecovered.start()
    unrecovered.wait_until(lambda: any(e.get("event") == "recovery-disabled"
                                       for e in unrecovered.log_events()), 10, "the warning")
    assert unrecovered.terminate() == 0


def test_a_second_job_on_the_same_store_is_refused_and_the_first_records_every_message_once(
    make_settings: SettingsFactory, jobs: JobSupervisor, database_url: str,
    db: psycopg.Connection[Any], tmp_path: Path,
) -> None:
    settings = make_settings()
    store = tmp_path / "store"
    first = jobs.job(settings, "first", recovery_dir=store)
    first.start()
    stream = good_stream(settings, database_url, 1500, seed=7)
    producer = PacedProducer(settings, stream.records, rate=1000)
    producer.start()

    line = _refused(jobs.job(settings, "second", recovery_dir=store))

    assert "another job process" in line["problem"]
    deliveries = producer.result()
    wait_until_drained(first, database_url, stream)
    assert first.running
    assert first.terminate() == 0
    assert_exact_outcome(settings, database_url, stream, deliveries)
