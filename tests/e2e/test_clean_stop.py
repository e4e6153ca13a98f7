"""SIGTERM (how Kubernetes stops a pod) is a clean stop, and the next start loses nothing.

The inputs end, the batch in flight commits, the outbox publishes what it was offered, the
producers flush, the process exits 0; the next start replays at most the last snapshot interval,
and nothing is lost or doubled. How long a stop takes is read from the job's own log timestamps
(``shutdown-requested`` to ``stopped``); ``python -m bench --phases timing`` measures it.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from devenv.harness.jobs import JobSupervisor
from devenv.harness.stream import PacedProducer, good_stream
from tests.chaos import (
    assert_exact_outcome,
    count_log_events,
    count_rows,
    report,
    unpublished,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e


def test_sigterm_mid_stream_exits_0_after_committing_and_publishing_then_resumes_exactly_once(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, record_property: Any,
) -> None:
    settings = make_settings(retry_initial_seconds=0.5, retry_max_seconds=4.0)
    stream = good_stream(settings, database_url, 6_000, seed=11)
    good = len(stream.good_ids)
    job = jobs.job(settings, snapshot_interval=5)
    job.start()
    producer = PacedProducer(settings, stream.records, rate=800)
    producer.start()
    wait_for_rows(job, database_url, stream, good // 3, timeout=60)

    code = job.terminate(sig=signal.SIGTERM)
    stop_s = job.stop_seconds(1)
    rows_at_stop = count_rows(database_url, stream.good_ids)
    left_unpublished = unpublished(database_url, settings.topic_action_tracked)

    assert code == 0, job.log_tail()
    assert any(e.get("event") == "shutdown-requested" for e in job.log_events(1))
    # Everything the stopped job committed was also published before it exited.
    assert left_unpublished == 0
    assert stop_s is not None and stop_s < settings.stop_grace_seconds, (stop_s, job.log_tail())

    job.start()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    code_2 = job.terminate()
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert code_2 == 0
    assert counts.rows == counts.tracked_distinct == good
    assert counts.dlq == 0
    replayed = count_log_events(job, "skipped-duplicate", 2)
    report(record_property, "sigterm", {
        "stop_s": stop_s, "exit_code": code, "rows_at_stop": rows_at_stop,
        "replayed_after_restart": replayed, "rows": counts.rows,
        "action_tracked_records": counts.tracked_records,
    })


def test_sigterm_while_idle_exits_0_within_seconds(
    make_settings: SettingsFactory, jobs: JobSupervisor
) -> None:
    job = jobs.job(make_settings())
    job.start()
    job.wait_until(lambda: job.get("/readyz") is not None, 30, "/readyz")
    code = job.terminate(sig=signal.SIGTERM)
    stop_s = job.stop_seconds()
    assert code == 0, job.log_tail()
    assert stop_s is not None and stop_s < 10, (stop_s, job.log_tail())
