"""The job's wall clock steps back an hour while it runs: it restarts, records everything once.

Only the job's clock moves: ``wallshift.c`` (built here, ``LD_PRELOAD``) shifts
``CLOCK_REALTIME`` by the seconds in a file, for Python's ``time.time()`` and Bytewax's Rust
``Utc::now()`` alike; the monotonic clock is left alone, as in a real NTP step.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from devenv.harness.jobs import JobSupervisor
from runtime.shutdown import STOPPED_DURING_OUTAGE
from tests.chaos import (
    PacedProducer,
    count_log_events,
    good_stream,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e


def _shift(offset_file: Path, seconds: float) -> None:
    temporary = offset_file.with_suffix(".tmp")
    temporary.write_text(f"{seconds}\n")
    temporary.replace(offset_file)  # never read half written


def test_an_hour_step_back_while_idle_restarts_the_job_and_every_event_is_recorded_once(
    make_settings: SettingsFactory, jobs: JobSupervisor, tmp_path: Path,
) -> None:
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler is not None, "gcc builds the clock shim (scripts/bootstrap.sh installs it)"
    shim = tmp_path / "libwallshift.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(shim),
                    str(Path(__file__).with_name("wallshift.c")), "-ldl"], check=True)
    offset = tmp_path / "wall-offset"
    _shift(offset, 0)
    settings = make_settings()
    url = settings.database_dsn()
    stream = good_stream(settings, url, 200, seed=31)
    job = jobs.job(settings, extra_env={"LD_PRELOAD": str(shim), "WALLSHIFT_FILE": str(offset)})
    job.start()
    PacedProducer(settings, stream.records[:100], rate=1_000).start()
    wait_for_rows(job, url, stream, 100, timeout=60)
    time.sleep(1.5)  # idle: every input partition waits for its next poll, 20 ms ahead

    # Before the watch, the idle partitions were polled again an hour later (Bytewax arms a
    # monotonic delay of due - now): 200 events produced after the step, none recorded in 60 s,
    # /readyz and /livez 200.
    _shift(offset, -3600)
    assert job.wait(10) == STOPPED_DURING_OUTAGE, "the job went on after its clock stepped back"
    assert count_log_events(job, "wall-clock-stepped", 1) == 1
    # Started again, as Kubernetes does. Without the shim: a process started after a real step
    # sees one clock, whereas the shim moves only what the code reads, not the kernel's timed
    # waits (librdkafka's, absolute in CLOCK_REALTIME, then timed out at once).
    del job.env["LD_PRELOAD"]
    job.start()
    PacedProducer(settings, stream.records[100:], rate=1_000).start()
    wait_until_drained(job, url, stream, timeout=60)  # each good message: one row, published
