"""Exactly once to CRM: a read_committed reader sees every committed outbox row once, whatever dies.

The real job in a subprocess on real Kafka and PostgreSQL, killed where the outbox's Kafka
transaction is open, right after it committed (the PostgreSQL cache not yet updated), ten times
under a backlog, and frozen past its lease while another publisher takes over. An independent
read_committed consumer counts the MessageIds; a read_uncommitted one shows the aborted copies
that the check would see.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from devenv.harness.jobs import JobProcess, JobSupervisor, wait_until
from devenv.harness.stream import Delivery, PacedProducer, Stream, good_stream
from runtime.process import Process
from runtime.settings import Settings
from sinks.outbox import OutboxPublisher
from tests.chaos import (
    assert_exact_outcome,
    count_log_events,
    count_rows,
    report,
    stop_job,
    wait_until_drained,
)
from tests.conftest import SettingsFactory
from tests.support import consume_all, start_publisher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]


def _settings(make_settings: SettingsFactory, **overrides: Any) -> Settings:
    return make_settings(retry_initial_seconds=0.3, retry_max_seconds=2.0, **overrides)


def _backlog(settings: Settings, database_url: str, count: int, seed: int
             ) -> tuple[Stream, list[Delivery]]:
    """``count`` favorites on the input topics before the job starts (a backlog)."""
    stream = good_stream(settings, database_url, count, seed=seed)
    producer = PacedProducer(settings, stream.records, rate=1_000_000)
    producer.start()
    return stream, producer.result()


def _open_transaction(settings: Settings) -> bool:
    """A partition of action-tracked holds records of a transaction still open (LSO < end)."""
    admin = AdminClient(settings.kafka_client_config())
    topic = settings.topic_action_tracked
    partitions = [TopicPartition(topic, p)
                  for p in admin.list_topics(topic, timeout=10).topics[topic].partitions]
    latest = OffsetSpec.latest()

    def offsets(isolation: IsolationLevel) -> list[int]:
        asked = admin.list_offsets({tp: latest for tp in partitions},
                                   isolation_level=isolation, request_timeout=10)
        return [asked[tp].result(15).offset for tp in partitions]

    return offsets(IsolationLevel.READ_COMMITTED) != offsets(IsolationLevel.READ_UNCOMMITTED)


def _progress(job: JobProcess, database_url: str, stream: Stream, rng: random.Random) -> None:
    """Let the job record favorites for a few seconds: past a snapshot of its offsets.

    A job killed again and again at one offset reads carefully and, after repeated deaths
    there, skips the record as one that kills every start (sources/careful.py): not this test.
    """
    began, before = time.monotonic(), count_rows(database_url, stream.good_ids)
    job.wait_until(lambda: count_rows(database_url, stream.good_ids) > before, 120,
                   "favorites recorded")
    time.sleep(max(0.0, began + rng.uniform(2.5, 3.5) - time.monotonic()))


def _kill_inside_a_transaction(job: JobProcess, settings: Settings, tries: int = 200) -> bool:
    """SIGSTOP the job; SIGKILL it if a transaction of its is open, else go on and try again."""
    for _ in range(tries):
        job.send_signal(signal.SIGSTOP)
        if _open_transaction(settings):
            time.sleep(0.5)  # a commit sent just before is done by now: this one cannot be
            if _open_transaction(settings):
                job.kill()
                return True
        job.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    return False


def _exactly_once(settings: Settings, database_url: str, stream: Stream,
                  deliveries: list[Delivery]) -> tuple[int, int]:
    """The rows and action-tracked exact for read_committed; the read_uncommitted records."""
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.rows == counts.tracked_records == counts.tracked_distinct == len(stream.good_ids)
    uncommitted = consume_all(settings, settings.topic_action_tracked, expect_at_least=counts.rows,
                              timeout=60, settle=2.0, isolation="read_uncommitted")
    return counts.tracked_records, len(uncommitted)


def test_a_job_killed_inside_the_outboxs_transaction_sends_each_row_once_to_read_committed(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
    record_property: Any,
) -> None:
    settings = _settings(make_settings)
    stream = good_stream(settings, database_url, 20_000, seed=11)
    # transactions all along: the stream lasts past the kills (66 s), the rest is then a backlog
    producer = PacedProducer(settings, stream.records, rate=300)
    producer.start()
    job, rng = jobs.job(settings), random.Random(11)
    killed_inside = 0
    for _ in range(3):
        job.start()
        _progress(job, database_url, stream, rng)
        job.wait_until(lambda: _open_transaction(settings), 60, "a transaction of the outbox")
        killed_inside += _kill_inside_a_transaction(job, settings)
        job.kill()  # (already, unless no transaction was seen open in time)
    assert producer.produced < len(stream.records), "the stream ended before the kills"
    producer.hurry()
    job.start()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    shutdown = stop_job(job)

    committed, uncommitted = _exactly_once(settings, database_url, stream, deliveries)
    assert killed_inside == 3
    assert uncommitted > committed  # the aborted copies exist; read_committed never saw them
    report(record_property, "outbox-killed-in-transaction", {
        "read_committed": committed, "read_uncommitted": uncommitted, **shutdown})


def test_ten_sigkills_while_20k_favorites_stream_in_send_every_row_once_to_read_committed(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
    record_property: Any,
) -> None:
    """Each restart catches up on the favorites that came while the job was down."""
    settings = _settings(make_settings)
    stream = good_stream(settings, database_url, 20_000, seed=12)
    producer = PacedProducer(settings, stream.records, rate=200)  # lasts past the kills (100 s)
    producer.start()
    rng = random.Random(12)
    job = jobs.job(settings)
    for _ in range(10):
        job.start()
        _progress(job, database_url, stream, rng)
        time.sleep(rng.uniform(0.0, 1.0))
        job.kill()
        time.sleep(rng.uniform(0.0, 2.0))  # a backlog builds up while it is down
    assert producer.produced < len(stream.records), "the stream ended before the kills"
    producer.hurry()  # the rest as a backlog for the last start
    job.start()
    deliveries = producer.result()
    wait_until_drained(job, database_url, stream)
    shutdown = stop_job(job)

    committed, uncommitted = _exactly_once(settings, database_url, stream, deliveries)
    assert job.exit_codes[:10] == [-9] * 10
    report(record_property, "outbox-sigkill-x10", {
        "read_committed": committed, "read_uncommitted": uncommitted, **shutdown})


@pytest.fixture
def watermark_locked(database_url: str) -> Iterator[threading.Event]:
    """The watermark cache's row locked (its UPDATE waits) until the event is set."""
    release, locked = threading.Event(), threading.Event()

    def hold() -> None:
        with psycopg.connect(database_url) as conn, conn.transaction():
            conn.execute("SELECT * FROM user_activity.outbox_watermark FOR UPDATE")
            locked.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert locked.wait(30)
    try:
        yield release
    finally:
        release.set()
        holder.join(30)


def test_a_kill_after_the_kafka_commit_before_the_cache_update_sends_nothing_again(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
    request: pytest.FixtureRequest,
) -> None:
    settings = _settings(make_settings)
    stream, deliveries = _backlog(settings, database_url, 2_000, seed=13)
    job = jobs.job(settings)
    job.start()
    job.wait_until(lambda: _cache_generation(database_url) > 0, 60, "the stream's start")
    release = request.getfixturevalue("watermark_locked")  # the next cache update waits
    committed = consume_all(settings, settings.topic_action_tracked, expect_at_least=1,
                            timeout=60, settle=1.0)
    job.kill()  # its Kafka transactions committed; the cache behind them
    release.set()
    job.start()
    wait_until_drained(job, database_url, stream)
    stop_job(job)

    assert committed
    _exactly_once(settings, database_url, stream, deliveries)


def _cache_generation(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT generation FROM user_activity.outbox_watermark").fetchone()
    return int(row[0]) if row else 0


def test_a_frozen_lease_holder_is_fenced_publishes_nothing_visible_and_exits_75(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
) -> None:
    settings = _settings(make_settings, outbox_lease_seconds=3.0)
    stream = good_stream(settings, database_url, 3_000, seed=14)
    job = jobs.job(settings)
    job.start()
    producer = PacedProducer(settings, stream.records, rate=300)
    producer.start()
    consume_all(settings, settings.topic_action_tracked, expect_at_least=200, timeout=60,
                settle=0)  # the job publishes
    job.send_signal(signal.SIGSTOP)  # frozen: its lease session idles out
    standby = OutboxPublisher(settings, process=Process(), name="outbox-standby")
    stop_standby = start_publisher(standby)
    try:
        wait_until(lambda: standby.holds_lease, 60, "the standby to take the lease")
        job.send_signal(signal.SIGCONT)
        exit_code = job.reap(90)
        job.start()  # as Kubernetes does after exit 75; the standby keeps the lease
        deliveries = producer.result()
        wait_until_drained(job, database_url, stream)
    finally:
        stop_standby()
    stop_job(job)

    assert exit_code == 75
    # its producer fenced (it used Kafka first), or its lease found taken (PostgreSQL first)
    assert count_log_events(job, "outbox-stream-fenced", 1) + count_log_events(
        job, "outbox-lease-superseded", 1) == 1
    _exactly_once(settings, database_url, stream, deliveries)
