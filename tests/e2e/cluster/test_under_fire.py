"""The favorites job on the 3-node cluster under fire: brokers killed, restarted, frozen (issue 43).

The real job runs as a subprocess (SASL user ``job``) on topics with RF 3 and min ISR 2 while an
idempotent ``acks=all`` producer writes 50k favorites of seeded sessions at a steady rate, and
one fault runs: the leaders of an action-tracked and of a favorites partition SIGKILLed and
restarted; a rolling restart of the three brokers; one broker frozen (SIGSTOP) for 30 s. Each
ends exact: one action row per message, one action-tracked MessageId per row and none twice, an
empty DLQ. A broker holds back only the partitions it leads, and only until their leadership
moves: the recorded rows, counted every 0.2 s, never stand still for more than 3 s while
acknowledged favorites wait, the cluster's failover aside. Until a crashed or frozen broker is
fenced (3 s of missed heartbeats here), every ``acks=all`` write waits (it is in every ISR) and
the only favorites waiting are those on the partitions it led. ``-s`` prints each fault's
longest pause, after the failover and with it, and the outbox's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
import pytest
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    ResourcePatternType,
    ResourceType,
)

from devenv.harness.jobs import JobProcess, JobSupervisor
from devenv.kafka_cluster import ADMIN, KafkaCluster
from runtime.settings import Settings
from tests.chaos import PacedProducer, assert_exact_outcome, good_stream, stop_job

pytestmark = [pytest.mark.e2e, pytest.mark.timing, pytest.mark.xdist_group("kafka-cluster"),
              pytest.mark.timeout(300)]

FAVORITES = 50_000
LONGEST_PAUSE = 3.0
"""Seconds the recorded rows may stand still while acknowledged favorites wait (issue 43)."""
FREEZE_SECONDS = 30.0
PARTITIONS = 6
UPSTREAM = {"topic.metadata.refresh.interval.ms": 1_000}
"""The producer looks for new leaders every second: favorites keep arriving on every partition."""


@dataclass(frozen=True)
class Sample:
    at: float
    rows: int
    acked: int
    published_at: object  # when the outbox publisher last recorded progress


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
                row = db.execute(
                    "SELECT (SELECT count(*) FROM user_activity.action_events),"
                    " (SELECT updated_at FROM user_activity.outbox_watermark)").fetchone()
                assert row is not None
                self.samples.append(Sample(time.monotonic(), int(row[0]), acked, row[1]))

    @property
    def rows(self) -> int:
        return self.samples[-1].rows if self.samples else 0

    def stop(self) -> list[Sample]:
        self._done.set()
        self.join(10)
        return self.samples


def longest_pause(points: Sequence[tuple[float, object, bool]],
                  failovers: Sequence[tuple[float, float]] = ()) -> tuple[float, float]:
    """The longest time ``progress`` did not change while ``waiting``: (seconds, when it began).

    ``points`` are ``(at, progress, waiting)`` in time order. Time within ``failovers`` (a
    broker's partitions have no leader yet: the upstream waits for the ISR to shrink, the work
    waiting is only on those partitions) does not count.
    """
    longest, began = 0.0, 0.0
    since: float | None = None
    last: object = None
    for at, progress, waiting in points:
        if progress != last or not waiting:
            since = at if waiting else None
            last = progress
        elif since is None:
            since = at
        if since is None:
            continue
        stood = at - since - sum(max(0.0, min(at, end) - max(since, start))
                                 for start, end in failovers)
        if stood > longest:
            longest, began = stood, since
    return longest, began


def failover(samples: Sequence[Sample], crash: float, still: float = 1.0) -> Failover:
    """From ``crash`` until acknowledgements resume after ``still`` s or more without any.

    The upstream's ``acks=all`` writes wait until the crashed broker is fenced and dropped from
    the ISRs, the moment its leaderships move: the cluster's failover, not the job's.
    """
    last_acked, last_moved = -1, crash
    for sample in samples:
        if sample.at < crash:
            last_acked = sample.acked
            continue
        if sample.at > crash + 15:
            break
        if sample.acked != last_acked:
            if sample.at - last_moved >= still:
                return crash, sample.at
            last_acked, last_moved = sample.acked, sample.at
    return crash, crash


def recording(samples: Sequence[Sample]) -> list[tuple[float, object, bool]]:
    """The row count, waiting while acknowledged favorites are not recorded."""
    return [(s.at, s.rows, s.acked > s.rows) for s in samples]


def publishing(samples: Sequence[Sample]) -> list[tuple[float, object, bool]]:
    """The outbox's progress, waiting while rows were recorded after it last moved."""
    points, moved_at_rows, last = [], 0, None
    for s in samples:
        if s.published_at != last:
            last, moved_at_rows = s.published_at, s.rows
        points.append((s.at, s.published_at, s.rows > moved_at_rows))
    return points


def _grant_the_job(cluster: KafkaCluster, prefix: str) -> None:
    for operation in (AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE,
                      AclOperation.DESCRIBE_CONFIGS):
        cluster.grant("User:job", ResourceType.TOPIC, prefix, operation,
                      ResourcePatternType.PREFIXED)
    cluster.grant("User:job", ResourceType.GROUP, prefix, AclOperation.READ,
                  ResourcePatternType.PREFIXED)
    cluster.grant("User:job", ResourceType.TRANSACTIONAL_ID, prefix, AclOperation.WRITE,
                  ResourcePatternType.PREFIXED)


Failover = tuple[float, float]
"""From a broker's crash or freeze until the cluster takes writes again (monotonic times)."""
Fault = Callable[[KafkaCluster, Settings], tuple[str, list[float]]]
"""Runs a fault; what it did, and when each broker crashed or froze (monotonic times)."""


def _kill_leaders(cluster: KafkaCluster, settings: Settings) -> tuple[str, list[float]]:
    """SIGKILL the leader of action-tracked[0], restart it; then the leader of favorite-added[0].

    Each is restarted once its partitions are led elsewhere (until it is fenced, the metadata
    still shows it, so a restart would seem ready at once), and is back in sync before the next.
    """
    topics = settings.all_topics()

    def kill_and_restart(node: int) -> float:
        killed = time.monotonic()
        cluster.kill(node)
        cluster.wait_leaders_available(topics)
        cluster.restart(node)
        cluster.wait_isr_full(topics)
        return killed

    first = cluster.leader_of(settings.topic_action_tracked, 0)
    crashes = [kill_and_restart(first)]
    second = cluster.leader_of(settings.topic_favorite_added, 0)
    crashes.append(kill_and_restart(second))
    return (f"killed {first} (action-tracked[0]) then {second} (favorite-added[0])",
            crashes)


def _rolling_restart(cluster: KafkaCluster, settings: Settings) -> tuple[str, list[float]]:
    """A clean stop moves a broker's leaderships first: no crash."""
    for node in cluster.nodes:
        cluster.restart(node)
        cluster.wait_isr_full(settings.all_topics())
    return f"restarted {list(cluster.nodes)} one by one", []


def _freeze(cluster: KafkaCluster, settings: Settings) -> tuple[str, list[float]]:
    node = cluster.leader_of(settings.topic_favorite_added, 0)
    frozen = time.monotonic()
    cluster.freeze(node)
    time.sleep(max(0.0, frozen + FREEZE_SECONDS - time.monotonic()))  # rows counted meanwhile
    cluster.thaw(node)
    cluster.wait_isr_full(settings.all_topics())
    return f"froze {node} for {FREEZE_SECONDS:.0f}s", [frozen]


@pytest.mark.parametrize("fire", [  # the fault, and a favorites rate that outlasts it
    pytest.param((_kill_leaders, 1_500), id="leaders-sigkilled"),
    pytest.param((_rolling_restart, 1_200), id="rolling-restart"),
    pytest.param((_freeze, 1_500), id="broker-frozen"),
])
def test_a_broker_fault_holds_no_row_back_longer_than_3s_and_the_outcome_is_exact(
    kafka_cluster: KafkaCluster, own_database: str, cluster_settings: Callable[..., Settings],
    jobs: JobSupervisor, fire: tuple[Fault, float],
) -> None:
    fault, rate = fire
    name = fault.__name__.strip("_").replace("_", "-")
    prefix = f"fire-{name}-{time.monotonic_ns() % 10**8}"
    settings = cluster_settings(prefix, "job")
    admin = cluster_settings(prefix, ADMIN)
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
    what, crashes = fault(kafka_cluster, settings)
    fault_s = time.monotonic() - fault_began
    deliveries = producer.result()
    job.wait_until(lambda: watch.rows >= FAVORITES, 120, "every row")
    samples = watch.stop()
    drained_s = time.monotonic() - began
    shutdown = stop_job(job)

    failovers = [failover(samples, crash) for crash in crashes]
    pause, at = longest_pause(recording(samples), failovers)
    literal, literal_at = longest_pause(recording(samples))
    outbox_pause, outbox_at = longest_pause(publishing(samples))
    (job.workdir / "rows.csv").write_text("".join(  # the timeline, for a failure's diagnosis
        f"{s.at - fault_began:.2f},{s.rows},{s.acked},{s.published_at}\n" for s in samples))
    led = ", ".join(f"{end - start:.1f}s" for start, end in failovers) or "-"
    print(f"\nfault={name} ({what}, {fault_s:.1f}s; writes taken again "
          f"after {led}): longest pause {pause:.2f}s at +{at - fault_began:.1f}s after the "
          f"failover, {literal:.2f}s at +{literal_at - fault_began:.1f}s with it; outbox "
          f"{outbox_pause:.2f}s at +{outbox_at - fault_began:.1f}s; produced in "
          f"{producer.seconds}s, all rows after {drained_s:.1f}s; job exits {job.exit_codes}",
          flush=True)
    counts = assert_exact_outcome(admin, own_database, stream, deliveries)
    assert counts.rows == counts.tracked_distinct == counts.tracked_records == FAVORITES
    assert counts.dlq == 0
    assert shutdown["stop_exit_code"] == 0, job.log_tail()
    assert pause <= LONGEST_PAUSE, f"rows stood still {pause:.2f}s while favorites waited"
