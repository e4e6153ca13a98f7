"""README's main-job command (``scripts/run-job.sh``): local services and a demo, or yours.

With ``USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS`` and ``USER_ACTIVITY_DATABASE_URL`` both set: migrate,
create our topics and run the favorites job in the foreground on them. Otherwise: a Kafka broker
(``--brokers N``: an N-node cluster, replication factor 3) and a throwaway PostgreSQL in ``.run/``,
demo sessions, a demo backlog (invalid owners and session-less devices included), the favorites
job with recovery until the backlog is recorded and on the topic, progress and a summary, then
everything stopped. ``--traces N``: an OTLP receiver on loopback, the first N events sampled,
their traces printed as trees once the job stopped.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import psycopg
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from cli.migrate import apply_migrations
from cli.topics import create_topics, ensure_topics
from devenv.harness.jobs import JobProcess
from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import seed_owners
from devenv.otlp_receiver import OtlpReceiver, render_tree
from runtime.configuration import load_settings
from runtime.settings import ENV_PREFIX, Settings

RUN_DIR = Path(__file__).resolve().parent.parent / ".run"


def _produce_demo(settings: Settings, devices: list[uuid.UUID], count: int,
                  traced: list[str]) -> None:
    """Produce ``count`` events, 80 % on favorite-added; the first ``len(traced)`` sampled."""
    producer = Producer({**settings.kafka_client_config(), "linger.ms": 20, "acks": "all",
                         "enable.idempotence": True})
    rng = random.Random(7)
    for i in range(count):
        parent = f"00-{traced[i]}-{rng.getrandbits(64) or 1:016x}-01" if i < len(traced) else ""
        headers: list[tuple[str, str | bytes | None]] = [("traceparent", parent)] if parent else []
        topic = (settings.topic_favorite_added if rng.random() < 0.8
                 else settings.topic_favorite_removed)
        owners = ((rng.choice(devices), uuid.uuid4()) if i % 200 == 0
                  else (uuid.uuid4(), None) if i % 250 == 0 else (rng.choice(devices), None))
        now = datetime.now(UTC)
        value = orjson.dumps(favorite_envelope(
            anonymous_id=owners[0], user_id=owners[1], occurred_at=now.isoformat(),
            created_at=now, correlation_id=f"demo-{uuid.uuid4().hex[:8]}",
            extra_payload={"Note": "a private note the service must never store or log"}))
        while True:
            try:
                producer.produce(topic, value=value, key=str(uuid.uuid4()).encode(),
                                 headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(60)


def _counts(dsn: str, watcher: Consumer, topic: str) -> tuple[int, int]:
    """action_events rows, and records on ``topic`` (what CRM can read: the outbox is purged)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
    deadline = time.monotonic() + 30
    while True:
        try:
            partitions = watcher.list_topics(topic, timeout=10).topics[topic].partitions
            return int(row[0]) if row else 0, sum(
                int(watcher.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])
                for p in partitions)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _job(settings: Settings, recovery: Path, log_path: Path | None = None,
         extra_env: dict[str, str] | None = None) -> JobProcess:
    """The favorites job with recovery, on the settings' own HTTP address and tail setting."""
    return JobProcess(settings, recovery.parent, tail=None, recovery_dir=recovery,
                      snapshot_interval=5, backup_interval=60, host=settings.http_host,
                      port=settings.http_port, log_path=log_path, env=os.environ,
                      extra_env=extra_env)


def run_configured(settings: Settings) -> int:
    """Migrate, create our topics, exec the job on the configured services (inputs: theirs)."""
    apply_migrations(settings.database_dsn())
    create_topics(settings)
    job = _job(settings, Path(os.environ.get("USER_ACTIVITY_RECOVERY_DIR", RUN_DIR / "recovery")))
    job.init_recovery()
    os.execvpe(sys.executable, job.command(), job.env)  # noqa: S606


def run_demo(events: int, sessions: int, linger: float, timeout: float, traces: int = 0, *,
             brokers: int = 1) -> int:
    """Local services + demo data + the job; prints progress and a summary (and traces)."""
    from devenv.kafka_broker import KafkaBroker
    from devenv.kafka_cluster import KafkaCluster
    from devenv.postgres_server import PostgresServer

    RUN_DIR.mkdir(exist_ok=True)
    print(f"starting PostgreSQL and Kafka ({brokers} broker(s)) on 127.0.0.1 ...", flush=True)
    postgres = PostgresServer(RUN_DIR / "postgres")
    postgres.start()
    broker = (KafkaBroker(RUN_DIR / "kafka") if brokers == 1
              else KafkaCluster(RUN_DIR / f"kafka-cluster-{brokers}", nodes=brokers))
    job: JobProcess | None = None
    watcher: Consumer | None = None
    receiver = OtlpReceiver().start() if traces else None
    trace_ids = [f"{random.getrandbits(128) or 1:032x}" for _ in range(min(traces, events))]
    try:
        broker.start()
        dsn = postgres.create_database("user_activity")
        settings = Settings(kafka_bootstrap_servers=broker.bootstrap, database_url=dsn)
        applied = apply_migrations(dsn)
        ensure_topics(settings.kafka_client_config(), settings.all_topics(), 6,
                      replication_factor=min(3, brokers))
        print(f"kafka {broker.bootstrap}  postgres {dsn}  migrations applied now: {applied}")
        watcher = Consumer({**settings.kafka_client_config(), "group.id": "demo-watcher"})
        topic = settings.topic_action_tracked
        rows0, published0 = _counts(dsn, watcher, topic)
        devices, _users = seed_owners(dsn, sessions, started_ago=timedelta(0))
        _produce_demo(settings, devices, events, trace_ids)
        print(f"seeded {sessions} sessions, produced {events} favorites events")
        job = _job(settings, RUN_DIR / "recovery", RUN_DIR / "job.log", None if not receiver else {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_always_off",  # only the traced events
            "OTEL_BSP_SCHEDULE_DELAY": "500"})
        print(f"running: {' '.join(job.command()[1:])}  (log: .run/job.log)")
        started = time.monotonic()
        job.start(wait_http=0)
        expected = events - len(range(0, events, 200)) - (  # invalid owners, then no session
            len(range(0, events, 250)) - len(range(0, events, 1000)))
        done_at: float | None = None
        while job.running:
            time.sleep(2)
            rows, published = (a - b for a, b in zip(_counts(dsn, watcher, topic),
                                                     (rows0, published0), strict=True))
            elapsed = time.monotonic() - started
            print(f"  t={elapsed:5.1f}s  rows recorded={rows:7d}  action-tracked on the topic="
                  f"{published:7d}  ({rows / elapsed:,.0f} rows/s)", flush=True)
            if done_at is None and elapsed > timeout:
                print(f"demo not done after {timeout:.0f}s: still waiting for "
                      f"{max(0, expected - rows)} of {expected} rows and "
                      f"{max(0, expected - published)} action-tracked records on {topic}; the "
                      "job's log is .run/job.log", flush=True)
                return 1
            if done_at is None and rows >= expected and published >= rows:
                done_at = elapsed
                print(f"demo backlog done in {done_at:.1f}s: {rows} rows, {published} published "
                      f"({rows / done_at:,.0f} events/s incl. start-up); lingering "
                      f"{linger:.0f}s (Ctrl-C to stop)")
            if done_at is not None and elapsed - done_at > linger:
                break
        if done_at is None:
            print(f"the job exited ({job.returncode}) before the demo was done; see .run/job.log",
                  flush=True)
        if receiver is not None:
            job.terminate(30)  # SIGTERM: a clean stop, the job's last spans are flushed
            wanted = {trace_id: i for i, trace_id in enumerate(trace_ids)}
            spans = sorted((s for s in receiver.spans() if s.trace_id in wanted),
                           key=lambda s: (wanted[s.trace_id], s.start_ns))
            print(f"traces of the first {len(trace_ids)} events ({len(spans)} spans received; "
                  "span id, name, kind, duration, outcome, status, links):")
            print(render_tree(spans, len(trace_ids)) or "  (no spans received)")
        return 0 if done_at is not None else 1
    except KeyboardInterrupt:
        print("interrupted: stopping the job, Kafka and PostgreSQL", flush=True)
        return 130
    finally:
        if job is not None and job.running:
            job.terminate(30, signal.SIGINT)
        if watcher is not None:
            watcher.close()
        if receiver is not None:
            receiver.stop()
        broker.stop()
        postgres.stop()
        print("stopped the job, Kafka and PostgreSQL")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scripts/run-job.sh``."""
    parser = argparse.ArgumentParser(prog="scripts/run-job.sh", description=__doc__)
    parser.add_argument("--events", type=int, default=20_000, help="demo backlog size")
    parser.add_argument("--sessions", type=int, default=2_000, help="demo sessions to seed")
    parser.add_argument("--linger", type=float, default=10.0,
                        help="seconds to keep the job running after the backlog is done")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="give up (exit 1, saying what is missing) if the backlog is not "
                             "recorded and on the topic after this many seconds")
    parser.add_argument("--traces", type=int, default=0, metavar="N",
                        help="trace the first N demo events and print their spans as trees "
                             "(a local OTLP receiver, no collector needed)")
    parser.add_argument("--brokers", type=int, default=1, metavar="N",
                        help="local Kafka brokers: 1, or a cluster of N nodes (replication "
                             "factor 3, min ISR 2; in .run/kafka-cluster-N)")
    args = parser.parse_args(argv)
    if args.brokers < 1:
        parser.error("--brokers must be at least 1")
    if all(f"{ENV_PREFIX}{name}" in os.environ
           for name in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL")):
        return run_configured(load_settings())
    return run_demo(args.events, args.sessions, args.linger, args.timeout, args.traces,
                    brokers=args.brokers)


if __name__ == "__main__":
    sys.exit(main())
