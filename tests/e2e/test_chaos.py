"""Chaos on real services (SPEC §5, AC7): the real job in a subprocess, real Kafka and PostgreSQL.

(a) PostgreSQL stopped >= 20 s in the middle of a 20k-message stream, then started;
(b) the Kafka broker stopped and restarted in the middle of the stream;
(c) the job SIGKILLed three times at different points and restarted on the same recovery dir;
(d) 5 % poison of every kind mixed into good messages.

Each ends with exact counts: every good message has exactly one row; action-tracked holds its
event exactly once for a read_committed reader (no copy, none missing); the DLQ holds
exactly the poison (original key/value, reason code, source coordinates), nothing good; no job
process is left running. Measurements are printed (``pytest -s``) and recorded as properties.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from devenv.harness.jobs import JobSupervisor
from devenv.harness.sessions import seed_owners
from devenv.harness.stream import PacedProducer, Stream, good_record, good_stream
from runtime.settings import Settings
from schemas.dlq import HEADER_EXCEPTION_TYPE, HEADER_REASON, DlqReason
from tests.chaos import (
    DLQ_TOTAL,
    GOOD_TRACEPARENT,
    RETRIES,
    HealthMonitor,
    assert_exact_outcome,
    count_log_events,
    count_rows,
    poison_records,
    refuse_in_the_database,
    report,
    stop_job,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

POSTGRES_DOWN_SECONDS = 22.0
KAFKA_DOWN_SECONDS = 35.0
"""Longer than the producers' ``message.timeout.ms`` (30 s): deliveries fail and are retried."""


def _chaos_settings(make_settings: SettingsFactory) -> Settings:
    return make_settings(retry_initial_seconds=0.5, retry_max_seconds=4.0)


# ---- (a) PostgreSQL down ---------------------------------------------------------------------


def test_postgres_down_20s_mid_stream_pauses_then_records_all_20k_exactly_once(
    make_settings: SettingsFactory, database_url: str, postgres_server: Any,
    jobs: JobSupervisor, record_property: Any,
) -> None:
    if postgres_server is None:
        pytest.skip("needs the suite's own PostgreSQL server (external one configured)")
    settings = _chaos_settings(make_settings)
    stream = good_stream(settings, database_url, 20_000, seed=1)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    monitor = HealthMonitor(job)
    monitor.start()
    producer = PacedProducer(settings, stream.records, rate=800)
    producer.start()

    wait_for_rows(job, database_url, stream, 5_000, timeout=90)
    retries_before = job.metric(RETRIES)
    produced_at_stop = producer.produced
    rows_at_stop = count_rows(database_url, stream.good_ids)
    postgres_server.stop()
    try:
        stopped = time.monotonic()
        time.sleep(POSTGRES_DOWN_SECONDS)
        down_seconds = time.monotonic() - stopped
        produced_at_start = producer.produced
    finally:  # never leave the session's server down for the tests that follow
        postgres_server.start()
    restarted = time.monotonic()
    retries_at_start = job.metric(RETRIES)
    resumed_after = job.wait_until(
        lambda: (s := job.get("/readyz")) is not None and s.status == 200, 60, "/readyz 200",
    )
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    drained_after = time.monotonic() - restarted
    retries_after = job.metric(RETRIES)
    dlq_total = job.metric(DLQ_TOTAL)
    samples = monitor.stop()
    shutdown = stop_job(job)

    outage = [s for s in samples if stopped <= s.at <= restarted]
    paused = [s for s in outage if s.ready is not None and s.ready.status == 503]
    assert paused, "readyz never reported the pause"
    assert all(s.ready_state == "paused" for s in paused)
    bodies = [s.ready.json() for s in paused if s.ready is not None]
    # The sinks and the outbox publisher all wait for PostgreSQL, and /readyz says so.
    assert {b["dependency"] for b in bodies} == {"postgres"}
    assert all(set(b["waiting"].values()) == {"postgres"} for b in bodies)
    first_paused = paused[0].at - stopped
    steady = [s for s in outage if s.at >= paused[0].at]
    assert all(s.ready_state == "paused" for s in steady), "readyz flapped while Postgres was down"
    assert down_seconds >= 20
    assert all(s.live is not None and s.live.status == 200 for s in samples), "livez failed"
    assert max(s.paused_seconds or 0.0 for s in outage) > 10
    assert retries_at_start - retries_before >= 5
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == 0 and dlq_total == 0
    assert counts.rows == counts.tracked_distinct == 20_000
    assert job.leftover_pids() == []
    report(record_property, "a-postgres-down", {
        "rows_at_stop": rows_at_stop,
        "postgres_down_s": round(down_seconds, 1),
        "readyz_paused_s": round(paused[-1].at - paused[0].at, 1),
        "readyz_paused_after_stop_s": round(first_paused, 1),
        "readyz_dependencies": sorted({str(b["dependency"]) for b in bodies}),
        "max_attempt_seen": max(int(b["attempt"]) for b in bodies),
        "max_paused_seconds_gauge": round(max(s.paused_seconds or 0.0 for s in outage), 1),
        "retries_during_outage": retries_at_start - retries_before,
        "retries_total": retries_after,
        "produced_during_outage": produced_at_start - produced_at_stop,
        "ready_again_after_start_s": round(resumed_after, 1),
        "drained_after_start_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })


# ---- (b) Kafka down --------------------------------------------------------------------------


def test_kafka_broker_restart_mid_stream_loses_and_duplicates_nothing(
    make_settings: SettingsFactory, database_url: str, kafka_broker: Any,
    jobs: JobSupervisor, record_property: Any,
) -> None:
    if kafka_broker is None:
        pytest.skip("needs the suite's own Kafka broker (external one configured)")
    settings = _chaos_settings(make_settings)
    stream = good_stream(settings, database_url, 8_000, seed=2)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    monitor = HealthMonitor(job)
    monitor.start()
    producer = PacedProducer(settings, stream.records, rate=800)
    producer.start()

    wait_for_rows(job, database_url, stream, 2_000, timeout=60)
    retries_before = job.metric(RETRIES)
    rows_at_stop = count_rows(database_url, stream.good_ids)
    stopping = time.monotonic()
    kafka_broker.stop()
    try:
        stopped = time.monotonic()
        time.sleep(KAFKA_DOWN_SECONDS)
        rows_while_down = count_rows(database_url, stream.good_ids)
        starting = time.monotonic()
    finally:  # never leave the session's broker down for the tests that follow
        kafka_broker.start()
    restarted = time.monotonic()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    drained_after = time.monotonic() - restarted
    job.wait_until(lambda: (s := job.get("/readyz")) is not None and s.status == 200, 60,
                   "/readyz 200")
    retries_after = job.metric(RETRIES)
    dlq_total = job.metric(DLQ_TOTAL)
    samples = monitor.stop()
    shutdown = stop_job(job)

    # Until the restarted broker acknowledges the job's records (the published count, read
    # after each /readyz, passes what it was when the broker was started again), the job waits
    # for Kafka: every 503 says paused, every waiter names Kafka (the input's consumers, and the
    # outbox publisher once a delivery failed), and the input partitions are among them. Kafka
    # back, a 503 is a wait for it or the outbox's backlog of the outage draining.
    outage = monitor.between(stopped, restarted)
    before = max(s.published for s in monitor.between(stopped, starting)
                 if s.published is not None)
    waiting = [s for s in outage if s.published is not None and s.published <= before]
    paused = [s for s in waiting if s.ready is not None and s.ready.status == 503]
    assert paused and all(s.ready_state == "paused" for s in paused), "no pause reported"
    bodies = [s.ready.json() for s in paused if s.ready is not None]
    assert {b["dependency"] for b in bodies} == {"kafka"}
    assert all(set(b["waiting"].values()) == {"kafka"} for b in bodies)
    assert any(waiter.startswith(f"{settings.topic_favorite_added}[") for b in bodies
               for waiter in b["waiting"])
    back = [s.ready.json() for s in outage if s.published is not None and s.published > before
            and s.ready is not None and s.ready.status == 503]
    assert all(set(b["waiting"].values()) == {"kafka"} if b["state"] == "paused"
               else b["state"] == "stalled" and set(b["stalled"]) == {"outbox"}
               for b in back), back
    steady = monitor.between(paused[0].at, starting)
    assert all(s.ready_state == "paused" for s in steady), "readyz flapped while Kafka was down"
    assert all(s.live is not None and s.live.status == 200 for s in samples), "livez failed"
    consumer_retries = count_log_events(job, "kafka-consumer-retry")
    assert consumer_retries > 0 and count_log_events(job, "kafka-consumer-recovered") > 0
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == 0 and dlq_total == 0
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    assert job.leftover_pids() == []
    report(record_property, "b-kafka-restart", {
        "broker_stop_s": round(stopped - stopping, 1),
        "broker_down_s": round(restarted - stopped, 1),
        "readyz_paused_s": round(paused[-1].at - paused[0].at, 1),
        "readyz_paused_after_stop_s": round(paused[0].at - stopped, 1),
        "readyz_pauses": sorted({f'{b["dependency"]}:{b["last_error"]}' for b in bodies}),
        "rows_at_stop": rows_at_stop,
        "rows_while_down": rows_while_down,
        "consumer_retry_lines": consumer_retries,
        "retries_total_delta": retries_after - retries_before,
        "outbox_retries_logged": count_log_events(job, "outbox-publish-retry"),
        "drained_after_start_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })


# ---- (c) SIGKILL x3 --------------------------------------------------------------------------


def test_job_sigkilled_three_times_resumes_from_its_recovery_dir_exactly_once(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor, record_property: Any,
) -> None:
    settings = _chaos_settings(make_settings)
    stream = good_stream(settings, database_url, 8_000, seed=3)
    good = len(stream.good_ids)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    producer = PacedProducer(settings, stream.records, rate=600)
    producer.start()
    kills: list[dict[str, Any]] = []

    def kill_and_restart(point: str) -> None:
        job.kill()
        kills.append({"point": point, "rows": count_rows(database_url, stream.good_ids),
                      "produced": producer.produced})
        job.start()

    # 1: in steady processing, a fifth of the way in.
    wait_for_rows(job, database_url, stream, good // 5, timeout=60)
    kill_and_restart("steady-20%")
    # 2: right after the restart, before its first snapshot (-s 1) has surely been taken.
    time.sleep(0.3)
    kill_and_restart("just-restarted")
    # 3: later, with the producer still writing.
    wait_for_rows(job, database_url, stream, good * 7 // 10, timeout=60)
    kill_and_restart("steady-70%")
    deliveries = producer.result()
    drained_after = wait_until_drained(job, database_url, stream)
    shutdown = stop_job(job)

    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == 0
    assert counts.rows == counts.tracked_distinct == good
    assert len(job.pids) == 4 and job.exit_codes[:3] == [-9, -9, -9]
    assert job.leftover_pids() == []
    duplicates = [count_log_events(job, "skipped-duplicate", run) for run in range(1, 5)]
    recorded = [count_log_events(job, "recorded", run) for run in range(1, 5)]
    # The database decides: at most one "recorded" per message, ever (fewer only if a kill hit
    # between a commit and its log lines).
    assert sum(recorded) <= good
    # Each restart resumed from its snapshot: a replay from the start would re-read (and skip as
    # duplicates) every message recorded before the kill.
    for run in (1, 2, 3):
        assert duplicates[run] < max(1, kills[run - 1]["rows"]), (run, duplicates, kills)
    report(record_property, "c-sigkill-x3", {
        "kills": kills,
        "recorded_per_run": recorded,
        "redelivered_skipped_per_run": duplicates,
        "drained_after_producer_done_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })


# ---- (d) poison ------------------------------------------------------------------------------


def test_five_percent_poison_of_every_kind_is_dead_lettered_and_good_messages_all_recorded(
    make_settings: SettingsFactory, database_url: str, db: psycopg.Connection[Any],
    jobs: JobSupervisor, record_property: Any,
) -> None:
    settings = _chaos_settings(make_settings)
    rng = random.Random(4)
    devices, users = seed_owners(database_url, 400, 100)
    per_kind = 40
    poison = poison_records(settings, rng, devices, users, per_kind)
    refuse_in_the_database(database_url, [p for p in poison if p.reason is DlqReason.DATA_ERROR])
    records = [
        good_record(settings, rng, devices, users,
                    headers=(("traceparent", GOOD_TRACEPARENT),) if i % 10 == 0 else ())
        for i in range(19 * len(poison))
    ]
    for record in poison:
        records.insert(rng.randrange(len(records) + 1), record)
    stream = Stream(records)
    job = jobs.job(settings)
    job.start()
    began = time.monotonic()
    producer = PacedProducer(settings, stream.records, rate=1500)
    producer.start()

    deliveries = producer.result()
    drained_after = wait_until_drained(job, database_url, stream)
    job.wait_until(lambda: job.metric(DLQ_TOTAL) >= len(poison), 60, "every dead letter")
    dlq_total = job.metric(DLQ_TOTAL)
    retries = job.metric(RETRIES)
    shutdown = stop_job(job)

    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.dlq == dlq_total == len(poison) == 5 * per_kind
    assert len(poison) * 20 == len(records)  # 5 %
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    failed = [e for e in job.log_events() if e.get("event") == "record-failed"]
    assert len(failed) == per_kind
    assert {(e["sqlstate"], e["error"]) for e in failed} == {("23514", "CheckViolation")}
    data_errors = [c for c in counts.letters if c.header(HEADER_REASON) == b"data-error"]
    assert len(data_errors) == per_kind
    assert {c.header(HEADER_EXCEPTION_TYPE) for c in data_errors} == {b"CheckViolation"}
    assert {c.header("traceparent") for c in data_errors} == {GOOD_TRACEPARENT}
    assert retries == 0
    assert job.leftover_pids() == []
    reasons = Counter(str(p.reason) for p in poison)
    report(record_property, "d-poison", {
        "messages": len(records), "good": counts.good, "poison": len(poison),
        "poison_by_reason": dict(sorted(reasons.items())),
        "data_error_sqlstate": "23514",
        "drained_s": round(drained_after, 1),
        "produce_s": producer.seconds,
        "rows": counts.rows, "action_tracked_records": counts.tracked_records,
        "action_tracked_distinct": counts.tracked_distinct, "dlq": counts.dlq,
        **shutdown,
        "took_s": round(time.monotonic() - began, 1),
    })
