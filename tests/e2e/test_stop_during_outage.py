"""SIGTERM while PostgreSQL or Kafka is down: the job stops within the pod's grace, loses nothing.

A stop cannot commit or publish through an outage. Kubernetes kills a pod 30 s after SIGTERM
(``terminationGracePeriodSeconds``), so the job must not wait for the outage to end: its retry
loops give up at the grace, and a call that never returns is cut by the stop's deadline (the
grace plus 5 s, its own ``stopped-during-outage`` line), both before the kill. Which of the two
ended a stop is read from the job's log; the harness's own waits are liveness bounds.
``python -m bench --phases timing`` measures how long the stops take.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from devenv.harness.jobs import JobProcess, JobSupervisor
from devenv.harness.stream import PacedProducer, Stream, good_stream
from runtime.settings import Settings
from tests.chaos import (
    Counts,
    assert_exact_outcome,
    count_rows,
    report,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory
from tests.support import frozen

pytestmark = pytest.mark.e2e


def _ended_by_the_deadline(job: JobProcess) -> bool:
    """The first run's stop was cut by its deadline (a call that did not return)."""
    return any(e.get("event") == "stopped-during-outage"
               and str(e.get("why", "")).startswith("the stop did not end within")
               for e in job.log_events(1))


def _paused_on(job: Any, dependency: str) -> bool:
    answer = job.get("/readyz")
    return answer is not None and answer.status == 503 and \
        answer.json().get("dependency") == dependency


def _not_answering(job: Any) -> bool:
    answer = job.get("/readyz")
    if answer is None or answer.status != 503:
        return False
    body = answer.json()
    return body.get("dependency") == "postgres" and \
        str(body.get("last_error")).startswith("no answer for")


def _events(job: Any) -> list[str]:
    return [str(e.get("event")) for e in job.log_events(1)]


def _streaming(settings: Settings, jobs: JobSupervisor, seed: int, rate: float = 1_000
               ) -> tuple[JobProcess, Stream, PacedProducer]:
    """A job running on 3,000 good records paced at ``rate``/s, 500 of them recorded."""
    database_url = settings.database_dsn()
    stream = good_stream(settings, database_url, 3_000, seed=seed)
    job = jobs.job(settings)
    job.start()
    producer = PacedProducer(settings, stream.records, rate=rate)
    producer.start()
    wait_for_rows(job, database_url, stream, 500, timeout=60)
    return job, stream, producer


def _restarted_exactly_once(settings: Settings, job: JobProcess, stream: Stream,
                            producer: PacedProducer) -> Counts:
    """Start ``job`` again after its stop: every record of ``stream`` is in, once, and said once."""
    database_url = settings.database_dsn()
    job.start()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    assert job.terminate() == 0
    return assert_exact_outcome(settings, database_url, stream, deliveries)


@pytest.mark.parametrize("down", ["postgres", "kafka"])
def test_sigterm_during_an_outage_stops_within_the_grace_and_the_next_start_loses_nothing(
    make_settings: SettingsFactory, jobs: JobSupervisor, record_property: Any, down: str,
    request: pytest.FixtureRequest,
) -> None:
    server = request.getfixturevalue("postgres_server" if down == "postgres" else "kafka_broker")
    if server is None:
        pytest.skip("needs the suite's own services (external ones configured)")
    settings = make_settings(retry_initial_seconds=0.5, retry_max_seconds=4.0)
    database_url = settings.database_dsn()
    # PostgreSQL down: the SIGTERM comes once a batch waits in the sink's retry loop, not when
    # /readyz first says paused (the outbox lease says it first: stopped then, the job rightly
    # exits 0, nothing unwritten); paced over 15 s, records still arrive during the outage
    rate = 200 if down == "postgres" else 1_000
    job, stream, producer = _streaming(settings, jobs, seed=21, rate=rate)
    server.stop()
    try:
        job.wait_until(lambda: _paused_on(job, down) and (
            down != "postgres" or "postgres-retry" in _events(job)), 60,
            f"/readyz paused on {down}, a batch held")
        code = job.terminate(sig=signal.SIGTERM)
    finally:
        server.start()
    events = [e.get("event") for e in job.log_events(1)]
    stop_s = job.stop_seconds(1)
    report(record_property, f"sigterm-during-{down}-outage", {"stop_s": stop_s,
                                                              "exit_code": code})
    # ended by the retry loops' grace, not by the deadline (the pod is killed after both)
    assert stop_s is not None and not _ended_by_the_deadline(job), (stop_s, job.log_tail())
    # Kafka down: the consumer cannot leave (librdkafka's close waits for the broker), so the
    # stop is unfinished whatever the outbox holds; PostgreSQL down: a batch is in flight.
    assert code == 75, (code, job.log_tail())
    assert "stopped-during-outage" in events
    rows_before = count_rows(database_url, stream.good_ids)
    counts = _restarted_exactly_once(settings, job, stream, producer)
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids) >= rows_before


def test_sigterm_while_the_job_starts_and_kafka_is_down_exits_within_the_grace(
    make_settings: SettingsFactory, jobs: JobSupervisor,
) -> None:
    # The start-up waits for the input topics' partitions. Each attempt was a blocking 10 s
    # metadata call, also after the stop: the job exited 30 s after SIGTERM, when Kubernetes
    # kills it (terminationGracePeriodSeconds), instead of within the 20 s grace.
    settings = make_settings(tail=True).model_copy(update={
        "kafka_bootstrap_servers": "127.0.0.1:1",  # nobody listens: Kafka down
        "retry_initial_seconds": 1.0, "retry_max_seconds": 60.0,  # as deployed
        "stop_grace_seconds": 5.0,  # (20 s deployed) a shorter test, the same bound
    })
    job = jobs.job(settings)
    job.start()  # /livez answers while the partitions are waited for
    time.sleep(3)

    code = job.terminate(sig=signal.SIGTERM)

    stop_s = job.stop_seconds()
    assert code == 75, job.log_tail()
    assert stop_s is not None and not _ended_by_the_deadline(job), (
        f"exit {stop_s} s after SIGTERM\n{job.log_tail(40)}")


def test_sigterm_while_postgresql_accepts_and_never_answers_exits_75_before_the_kill(
    make_settings: SettingsFactory, jobs: JobSupervisor, postgres_server: Any,
) -> None:
    """A frozen server holds the worker in its query, where no retry loop sees the stop.

    The server's processes are stopped with SIGSTOP: its kernel still accepts and acknowledges.
    Before the deadline, the job was still in its query when the harness killed it (-9 after
    40 s). Now it ends itself at the grace plus 5 s with 75, and the next start loses nothing
    and records nothing twice. (Without a stop, the hung call is bounded by the liveness probe.)
    """
    if postgres_server is None:
        pytest.skip("needs the suite's own PostgreSQL (external one configured)")
    settings = make_settings(stop_grace_seconds=5.0, db_statement_timeout_ms=1_000)
    job, stream, producer = _streaming(settings, jobs, seed=23)
    with postgres_server.frozen():
        time.sleep(2)  # the worker is in a call the frozen server never answers
        code = job.terminate(sig=signal.SIGTERM)
    stop_s = job.stop_seconds(1)
    assert code == 75, job.log_tail()  # the harness kills only past its liveness bound
    assert stop_s is not None and _ended_by_the_deadline(job), (stop_s, job.log_tail())
    counts = _restarted_exactly_once(settings, job, stream, producer)
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)


def test_a_broker_that_accepts_and_never_answers_pauses_the_job_within_the_stuck_check(
    make_settings: SettingsFactory, jobs: JobSupervisor, kafka_broker: Any, record_property: Any,
) -> None:
    """A frozen broker pauses the job on kafka at its partitions' next check, not a minute later.

    The broker's JVM is stopped with SIGSTOP: its kernel still accepts and acknowledges, so no
    connection fails and no request is answered. librdkafka says every broker is down only
    after a request's time-out and then a reconnection's: ``/readyz`` said running for 60.6 s
    of such a freeze (the frozen-broker probe), 31 s and over 45 s with the 30 s request
    time-out (librdkafka: 60 s) this job now sets, and 31.1 s in this test without the check. Now a
    partition that read nothing for ``source_stuck_seconds`` asks for its watermarks, and a
    query with no answer within a second pauses the worker on kafka (3 s here, 30 s deployed,
    as PostgreSQL's statement timeout plus 5 s): ``/readyz`` 503, ``/livez`` 200; a stop ends
    within the grace, and the next start loses nothing and records nothing twice. The wait for
    the pause is a liveness bound, ten times the check's 4 s and more; the bench measures it.
    """
    if kafka_broker is None or kafka_broker.pid is None:
        pytest.skip("an external broker cannot be frozen by the suite")
    settings = make_settings(source_stuck_seconds=3.0, stop_grace_seconds=5.0,
                             retry_initial_seconds=0.5, retry_max_seconds=2.0)
    job, stream, producer = _streaming(settings, jobs, seed=25)
    with frozen(kafka_broker.pid):
        said_after = job.wait_until(lambda: _paused_on(job, "kafka"), 45,
                                    "/readyz paused on kafka")
        livez = job.get("/livez")
        assert livez is not None and livez.status == 200, "a frozen broker is no reason to restart"
        code = job.terminate(sig=signal.SIGTERM)
    stop_s = job.stop_seconds(1)
    report(record_property, "frozen-broker", {"said_after_s": round(said_after, 1),
                                              "stop_s": stop_s, "exit_code": code})
    assert stop_s is not None, job.log_tail()  # ended itself, before the harness's kill
    assert code in {0, 75}, job.log_tail()
    counts = _restarted_exactly_once(settings, job, stream, producer)
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
