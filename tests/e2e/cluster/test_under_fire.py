"""The favorites job on the 3-node cluster under fire: brokers killed, restarted, frozen (issue 43).

The real job runs as a subprocess (SASL user ``job``) on topics with RF 3 and min ISR 2 while an
idempotent ``acks=all`` producer writes 50k favorites of seeded sessions at a steady rate, and
one fault runs: the leaders of an action-tracked and of a favorites partition SIGKILLed and
restarted; a rolling restart of the three brokers; one broker frozen (SIGSTOP) for 30 s. Each
ends exact: one action row per message, one action-tracked MessageId per row and none twice, an
empty DLQ. A broker holds back only the partitions it leads, and only until their leadership
moves: the recorded rows, counted every 0.2 s, never stand still for more than 3 s while
acknowledged favorites wait. ``-s`` prints each fault's longest pause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    ResourcePatternType,
    ResourceType,
)

from cli.migrate import apply_migrations
from devenv.harness.jobs import JobProcess, JobSupervisor
from devenv.kafka_cluster import ADMIN, KafkaCluster
from runtime.settings import Settings
from tests.chaos import PacedProducer, assert_exact_outcome, good_stream, stop_job
from tests.support import scratch_database

pytestmark = [pytest.mark.e2e, pytest.mark.timing, pytest.mark.xdist_group("kafka-cluster"),
              pytest.mark.timeout(300)]

FAVORITES = 50_000
LONGEST_PAUSE = 3.0
"""Seconds the recorded rows may stand still while acknowledged favorites wait (issue 43)."""
FREEZE_SECONDS = 30.0
PARTITIONS = 6
UPSTREAM = {"topic.metadata.refresh.interval.ms": 1_000}
"""The producer looks for new leaders every second: favorites keep arriving on every partition."""


@pytest.fixture
def own_database(database_url: str) -> Iterator[str]:
    with scratch_database(database_url, "fire") as dsn:
        apply_migrations(dsn)
        yield dsn


@dataclass(frozen=True)
class Sample:
    at: float
    rows: int
    acked: int


class RowWatch(threading.Thread):
    """Counts the recorded rows and the acknowledged favorites every ``interval`` seconds."""

    def __init__(self, dsn: str, producer: PacedProducer, interval: float = 0.2) -> None:
        super().__init__(name="row-watch", daemon=True)
        self._dsn, self._producer, self._interval = dsn, producer, interval
        self._done = threading.Event()
        self.samples: list[Sample] = []

    def run(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True) as db:
            while not self._done.wait(self._interval):
                acked = sum(d is not None for d in self._producer.deliveries)
                row = db.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
                assert row is not None
                self.samples.append(Sample(time.monotonic(), int(row[0]), acked))

    @property
    def rows(self) -> int:
        return self.samples[-1].rows if self.samples else 0

    def stop(self) -> list[Sample]:
        self._done.set()
        self.join(10)
        return self.samples


def longest_pause(samples: list[Sample]) -> tuple[float, float]:
    """The longest time the row count did not change while acknowledged favorites waited.

    Returns (seconds, when it began).
    """
    longest, began = 0.0, 0.0
    since: float | None = None
    last_rows = -1
    for sample in samples:
        waiting = sample.acked > sample.rows
        if sample.rows != last_rows or not waiting:
            since = sample.at if waiting else None
            last_rows = sample.rows
        elif since is None:
            since = sample.at
        if since is not None and sample.at - since > longest:
            longest, began = sample.at - since, since
    return longest, began


def _settings(cluster: KafkaCluster, dsn: str, prefix: str, user: str) -> Settings:
    topics: dict[str, Any] = {name: f"{prefix}.{name.removeprefix('topic_').replace('_', '-')}"
                              for name, field in Settings.model_fields.items()
                              if name.startswith("topic_") and isinstance(field.default, str)}
    return Settings(
        kafka_bootstrap_servers=cluster.bootstrap, kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_mechanism="PLAIN", kafka_sasl_username=user,
        kafka_sasl_password=cluster.client_config(user)["sasl.password"], database_url=dsn,
        **topics, consumer_group_favorites=f"{prefix}.favorites",
        consumer_group_session_linking=f"{prefix}.session-linking",
        http_port=0, retry_initial_seconds=0.2, retry_max_seconds=2.0,
        outbox_idle_poll_seconds=0.2)


def _grant_the_job(cluster: KafkaCluster, prefix: str) -> None:
    for operation in (AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE,
                      AclOperation.DESCRIBE_CONFIGS):
        cluster.grant("User:job", ResourceType.TOPIC, prefix, operation,
                      ResourcePatternType.PREFIXED)
    cluster.grant("User:job", ResourceType.GROUP, prefix, AclOperation.READ,
                  ResourcePatternType.PREFIXED)


Fault = Callable[[KafkaCluster, Settings, RowWatch], str]


def _kill_leaders(cluster: KafkaCluster, settings: Settings, watch: RowWatch) -> str:
    """SIGKILL the leader of action-tracked[0], restart it; then the leader of favorite-added[0].

    Each is restarted once its partitions are led elsewhere (until it is fenced, the metadata
    still shows it, so a restart would seem ready at once), and is back in sync before the next.
    """
    topics = settings.all_topics()

    def kill_and_restart(node: int) -> None:
        cluster.kill(node)
        cluster.wait_leaders_available(topics)
        cluster.restart(node)
        cluster.wait_isr_full(topics)

    first = cluster.leader_of(settings.topic_action_tracked, 0)
    kill_and_restart(first)
    second = cluster.leader_of(settings.topic_favorite_added, 0)
    kill_and_restart(second)
    return f"killed {first} (action-tracked[0]) then {second} (favorite-added[0])"


def _rolling_restart(cluster: KafkaCluster, settings: Settings, watch: RowWatch) -> str:
    for node in cluster.nodes:
        cluster.restart(node)
        cluster.wait_isr_full(settings.all_topics())
    return f"restarted {list(cluster.nodes)} one by one"


def _freeze(cluster: KafkaCluster, settings: Settings, watch: RowWatch) -> str:
    node = cluster.leader_of(settings.topic_favorite_added, 0)
    cluster.freeze(node)
    time.sleep(FREEZE_SECONDS)  # the fault itself: the rows are counted meanwhile
    cluster.thaw(node)
    cluster.wait_isr_full(settings.all_topics())
    return f"froze {node} for {FREEZE_SECONDS:.0f}s"


@pytest.mark.parametrize(("fault", "rate"), [
    pytest.param(_kill_leaders, 1_500, id="leaders-sigkilled"),
    pytest.param(_rolling_restart, 1_200, id="rolling-restart"),
    pytest.param(_freeze, 1_500, id="broker-frozen"),
])
def test_a_broker_fault_holds_no_row_back_longer_than_3s_and_the_outcome_is_exact(
    kafka_cluster: KafkaCluster, own_database: str, jobs: JobSupervisor, fault: Fault,
    rate: float, request: pytest.FixtureRequest,
) -> None:
    prefix = f"fire-{request.node.callspec.id}-{time.monotonic_ns() % 10**8}"
    settings = _settings(kafka_cluster, own_database, prefix, "job")
    admin = _settings(kafka_cluster, own_database, prefix, ADMIN)
    kafka_cluster.create_topics(admin.all_topics(), partitions=PARTITIONS)
    _grant_the_job(kafka_cluster, prefix)
    stream = good_stream(admin, own_database, FAVORITES, seed=43)
    job: JobProcess = jobs.job(settings)
    job.start()
    job.wait_until(lambda: (r := job.get("/readyz")) is not None and r.status == 200, 60,
                   "/readyz 200")
    producer = PacedProducer(admin, stream.records, rate=rate, **UPSTREAM)
    watch = RowWatch(own_database, producer)
    began = time.monotonic()
    producer.start()
    watch.start()

    job.wait_until(lambda: watch.rows >= FAVORITES // 10, 60, "a tenth of the rows")
    fault_began = time.monotonic()
    what = fault(kafka_cluster, settings, watch)
    fault_s = time.monotonic() - fault_began
    deliveries = producer.result()
    job.wait_until(lambda: watch.rows >= FAVORITES, 120, "every row")
    samples = watch.stop()
    drained_s = time.monotonic() - began
    shutdown = stop_job(job)
    counts = assert_exact_outcome(admin, own_database, stream, deliveries)

    pause, at = longest_pause(samples)
    (job.workdir / "rows.csv").write_text("".join(
        f"{s.at - fault_began:.2f},{s.rows},{s.acked}\n" for s in samples))
    print(f"\nfault={request.node.callspec.id} ({what}, {fault_s:.1f}s) longest pause "
          f"{pause:.2f}s at +{at - fault_began:.1f}s; produced in {producer.seconds}s, all rows "
          f"after {drained_s:.1f}s; job exits {job.exit_codes}", flush=True)
    assert counts.rows == counts.tracked_distinct == counts.tracked_records == FAVORITES
    assert counts.dlq == 0
    assert shutdown["stop_exit_code"] == 0, job.log_tail()
    assert pause <= LONGEST_PAUSE, f"rows stood still {pause:.2f}s while favorites waited"
