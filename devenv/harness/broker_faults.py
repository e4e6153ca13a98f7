"""The favorites job on the 3-node cluster under fire: one broker fault, and how long rows stood.

:func:`run_under_fire` runs the real job (SASL user ``job``) on RF 3 / min ISR 2 topics while a
:class:`~devenv.harness.stream.PacedProducer` writes favorites of seeded sessions, and one fault
of :data:`FAULTS`: the leaders of an action-tracked and of a favorites partition SIGKILLed and
restarted, a rolling restart, one broker frozen (SIGSTOP) 30 s. :class:`RowWatch` counts the
recorded rows every 0.2 s; :func:`longest_pause` is the longest time they stood still while
acknowledged favorites waited, the cluster's failover (until a crashed or frozen broker is
fenced every ``acks=all`` write waits) not counted. Used by tests/e2e/cluster/test_under_fire.py
(the outcome) and the benchmark's timing phase (the pauses).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclOperation,
    ResourcePatternType,
    ResourceType,
)

from devenv.harness.jobs import JobProcess
from devenv.harness.stream import Delivery, PacedProducer, Stream, good_stream
from devenv.kafka_cluster import KafkaCluster
from runtime.settings import Settings
from sinks.outbox.sql import query

FREEZE_SECONDS = 30.0
PARTITIONS = 6
UPSTREAM = {"topic.metadata.refresh.interval.ms": 1_000}
"""The producer looks for new leaders every second: favorites keep arriving on every partition."""

Failover = tuple[float, float]
"""From a broker's crash or freeze until the cluster takes writes again (monotonic times)."""
Fault = Callable[[KafkaCluster, Settings], tuple[str, list[float]]]
"""Runs a fault; what it did, and when each broker crashed or froze (monotonic times)."""


def cluster_job_settings(cluster: KafkaCluster, database_url: str, prefix: str, user: str,
                         **overrides: Any) -> Settings:
    """Settings of a job on ``cluster`` as ``user``: topics and groups ``<prefix>.<name>``."""
    topics: dict[str, Any] = {
        name: f"{prefix}.{name.removeprefix('topic_').replace('_', '-')}"
        for name, field in Settings.model_fields.items()
        if name.startswith("topic_") and isinstance(field.default, str)}
    values: dict[str, Any] = {
        "kafka_bootstrap_servers": cluster.bootstrap,
        "kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "PLAIN",
        "kafka_sasl_username": user,
        "kafka_sasl_password": cluster.client_config(user)["sasl.password"],
        "database_url": database_url, **topics,
        "consumer_group_favorites": f"{prefix}.favorites",
        "consumer_group_session_linking": f"{prefix}.session-linking",
        "outbox_transactional_id": f"{prefix}.outbox",
        "http_port": 0, "retry_initial_seconds": 0.2, "retry_max_seconds": 2.0,
        "outbox_idle_poll_seconds": 0.2, **overrides}
    return Settings(**values)


def grant_prefix(cluster: KafkaCluster, user: str, prefix: str) -> None:
    """Let ``user`` use what is named ``prefix*``: its topics, groups and transactional ids."""
    for operation in (AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE,
                      AclOperation.DESCRIBE_CONFIGS):
        cluster.grant(f"User:{user}", ResourceType.TOPIC, prefix, operation,
                      ResourcePatternType.PREFIXED)
    cluster.grant(f"User:{user}", ResourceType.GROUP, prefix, AclOperation.READ,
                  ResourcePatternType.PREFIXED)
    cluster.grant(f"User:{user}", ResourceType.TRANSACTIONAL_ID, prefix, AclOperation.WRITE,
                  ResourcePatternType.PREFIXED)


@dataclass(frozen=True)
class Sample:
    """One count: the recorded rows, the acknowledged favorites, the outbox's last progress."""

    at: float
    rows: int
    acked: int
    published_at: object
    pending: bool
    """A committed outbox row is not published yet."""


class RowWatch(threading.Thread):
    """Counts the recorded rows and the acknowledged favorites every ``interval`` seconds."""

    def __init__(self, dsn: str, producer: PacedProducer, interval: float = 0.2) -> None:
        super().__init__(name="row-watch", daemon=True)
        self._dsn, self._producer, self._interval = dsn, producer, interval
        self._done = threading.Event()
        self.samples: list[Sample] = []

    def run(self) -> None:
        """Sample until :meth:`stop`."""
        with psycopg.connect(self._dsn, autocommit=True) as db:
            while not self._done.wait(self._interval):
                acked = self._producer.acknowledged
                row = db.execute(
                    "SELECT (SELECT count(*) FROM user_activity.action_events),"
                    " (SELECT updated_at FROM user_activity.outbox_watermark),"
                    " pg_current_snapshot()::text").fetchone()
                assert row is not None
                pending = db.execute(query("pending_in"), (row[2],)).fetchone()
                self.samples.append(Sample(time.monotonic(), int(row[0]), acked, row[1],
                                           bool(pending and pending[0])))

    @property
    def rows(self) -> int:
        """The rows at the latest count."""
        return self.samples[-1].rows if self.samples else 0

    @property
    def published(self) -> bool:
        """Every row committed by the latest count is published."""
        return bool(self.samples) and not self.samples[-1].pending

    def stop(self) -> list[Sample]:
        """Stop sampling; every sample."""
        self._done.set()
        self.join(10)
        return self.samples


def longest_pause(points: Sequence[tuple[float, object, bool]],
                  failovers: Sequence[Failover] = ()) -> tuple[float, float]:
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


def kill_leaders(cluster: KafkaCluster, settings: Settings) -> tuple[str, list[float]]:
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


def rolling_restart(cluster: KafkaCluster, settings: Settings) -> tuple[str, list[float]]:
    """A clean stop moves a broker's leaderships first: no crash."""
    for node in cluster.nodes:
        cluster.restart(node)
        cluster.wait_isr_full(settings.all_topics())
    return f"restarted {list(cluster.nodes)} one by one", []


def freeze(cluster: KafkaCluster, settings: Settings) -> tuple[str, list[float]]:
    """SIGSTOP the leader of favorite-added[0] for :data:`FREEZE_SECONDS`, then SIGCONT."""
    node = cluster.leader_of(settings.topic_favorite_added, 0)
    frozen = time.monotonic()
    cluster.freeze(node)
    time.sleep(max(0.0, frozen + FREEZE_SECONDS - time.monotonic()))  # rows counted meanwhile
    cluster.thaw(node)
    cluster.wait_isr_full(settings.all_topics())
    return f"froze {node} for {FREEZE_SECONDS:.0f}s", [frozen]


FAULTS: dict[str, tuple[Fault, float]] = {  # the fault, and a favorites rate that outlasts it
    "leaders-sigkilled": (kill_leaders, 1_500),
    "rolling-restart": (rolling_restart, 1_200),
    "broker-frozen": (freeze, 1_500),
}


@dataclass(frozen=True)
class FireRun:
    """What one run under fire did; the pauses in seconds."""

    stream: Stream
    deliveries: list[Delivery]
    exit_code: int | None
    rows: int
    pause_s: float
    pause_with_failover_s: float
    outbox_pause_s: float
    summary: str


def run_under_fire(cluster: KafkaCluster, job: JobProcess, admin: Settings, database_url: str, *,
                   prefix: str, fault_name: str, favorites: int = 50_000) -> FireRun:
    """Run ``job`` (not started) through the fault ``fault_name``; ``admin``: its settings as admin.

    The topics (:func:`cluster_job_settings` of ``prefix``) are created and granted to the job's
    user here; the job is stopped with SIGTERM once every row is recorded and published; the
    rows' timeline is written to ``job.workdir / "rows.csv"``. Raises AssertionError when the job
    does not get ready, record every favorite or publish every row (liveness bounds).
    """
    fault, rate = FAULTS[fault_name]
    settings = job.settings
    cluster.create_topics(admin.all_topics(), partitions=PARTITIONS)
    grant_prefix(cluster, settings.kafka_sasl_username or "", prefix)
    stream = good_stream(admin, database_url, favorites, seed=43)
    job.start()
    job.wait_until(lambda: (r := job.get("/readyz")) is not None and r.status == 200, 60,
                   "/readyz 200")
    producer = PacedProducer(admin, stream.records, rate=rate, **UPSTREAM)
    watch = RowWatch(database_url, producer)
    began = time.monotonic()
    producer.start()
    watch.start()
    job.wait_until(lambda: watch.rows >= favorites // 10, 60, "a tenth of the rows")
    fault_began = time.monotonic()
    what, crashes = fault(cluster, settings)
    fault_s = time.monotonic() - fault_began
    deliveries = producer.result()
    job.wait_until(lambda: watch.rows >= favorites, 120, "every row")
    job.wait_until(lambda: watch.published, 120, "every row published")
    samples = watch.stop()
    drained_s = time.monotonic() - began
    code = job.terminate()
    failovers = [failover(samples, crash) for crash in crashes]
    pause, at = longest_pause(recording(samples), failovers)
    literal, literal_at = longest_pause(recording(samples))
    outbox, outbox_at = longest_pause(publishing(samples))
    (job.workdir / "rows.csv").write_text("".join(  # the timeline, for a failure's diagnosis
        f"{s.at - fault_began:.2f},{s.rows},{s.acked},{s.published_at}\n" for s in samples))
    led = ", ".join(f"{end - start:.1f}s" for start, end in failovers) or "-"
    summary = (f"fault={fault_name} ({what}, {fault_s:.1f}s; writes taken again after {led}): "
               f"longest pause {pause:.2f}s at +{at - fault_began:.1f}s after the failover, "
               f"{literal:.2f}s at +{literal_at - fault_began:.1f}s with it; outbox "
               f"{outbox:.2f}s at +{outbox_at - fault_began:.1f}s; produced in "
               f"{producer.seconds}s, all rows after {drained_s:.1f}s; job exits {code}")
    return FireRun(stream, deliveries, code, samples[-1].rows, round(pause, 2), round(literal, 2),
                   round(outbox, 2), summary)
