"""README's main-job command: local services (or the configured ones), migrate, topics, the job.

With no ``USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS`` / ``USER_ACTIVITY_DATABASE_URL`` in the
environment it starts a real Kafka broker (``--brokers N``: an N-node cluster with replication
factor 3, :mod:`devenv.kafka_cluster`) and a throwaway PostgreSQL in ``.run/``, seeds demo
sessions, produces a demo backlog plus a live trickle, runs the favorites job with recovery
(``python -m bytewax.run dataflows.favorite_actions:flow -r .run/recovery``), prints progress and
a summary, then stops everything. With both variables set it migrates, creates topics and runs
the job in the foreground against those services (no demo data) until interrupted.

``--traces N`` shows traces without an external collector: the demo starts an OTLP/HTTP receiver
on loopback (:mod:`devenv.otlp_receiver`), points the job at it (``OTEL_*``, sampling parent-based
with roots off), gives the first N events a sampled ``traceparent``, and prints those N traces
as trees once the job stopped.
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

ROOT = Path(__file__).resolve().parent.parent
RUN_DIR = ROOT / ".run"


def _envelope(anonymous_id: uuid.UUID | None, user_id: uuid.UUID | None) -> bytes:
    now = datetime.now(UTC)
    return orjson.dumps(favorite_envelope(
        user_id=user_id, anonymous_id=anonymous_id, occurred_at=now.isoformat(), created_at=now,
        correlation_id=f"demo-{uuid.uuid4().hex[:8]}",
        extra_payload={"Note": "a private note the service must never store or log"},
    ))


def _produce_demo(settings: Settings, devices: list[uuid.UUID], count: int,
                  traced: list[str] | None = None) -> int:
    """Produce ``count`` demo events; the first ``len(traced)`` with those sampled trace ids."""
    producer = Producer({**settings.kafka_client_config(), "linger.ms": 20, "acks": "all"})
    rng = random.Random(7)
    traced = traced or []
    for i in range(count):
        headers: list[tuple[str, str | bytes | None]] | None = (
            [("traceparent", f"00-{traced[i]}-{rng.getrandbits(64) or 1:016x}-01".encode())]
            if i < len(traced) else None
        )
        roll = rng.random()
        topic = settings.topic_favorite_added if roll < 0.8 else settings.topic_favorite_removed
        if i % 200 == 0:
            value = _envelope(rng.choice(devices), uuid.uuid4())  # both owners: invalid-owner
        elif i % 250 == 0:
            value = _envelope(uuid.uuid4(), None)  # a device without a session: no-session
        else:
            value = _envelope(rng.choice(devices), None)
        while True:
            try:
                producer.produce(topic, value=value, key=str(uuid.uuid4()).encode(),
                                 headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(60)
    return count


def _rows(dsn: str) -> int:
    """Action-history rows in the database (the table is append-only)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
    assert row is not None
    return int(row[0])


def _on_topic(consumer: Consumer, topic: str) -> int:
    """Records on ``topic`` (the sum of its partitions' end offsets): what CRM can read.

    Counted on the topic itself, not from the outbox table, whose published rows the job purges.
    A just-created topic may answer NOT_LEADER for a moment: asked again for up to 30 s.
    """
    deadline = time.monotonic() + 30
    while True:
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            return sum(int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])
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


def _print_traces(receiver: OtlpReceiver, trace_ids: list[str]) -> None:
    """The spans of the traced demo events, one tree per trace, in production order."""
    wanted = set(trace_ids)
    spans = [span for span in receiver.spans() if span.trace_id in wanted]
    order = {trace_id: i for i, trace_id in enumerate(trace_ids)}
    spans.sort(key=lambda span: (order[span.trace_id], span.start_ns))
    print(f"traces of the first {len(trace_ids)} events ({len(spans)} spans received; span id, "
          "name, kind, duration, outcome, status, links):")
    print(render_tree(spans, len(trace_ids)) or "  (no spans received)")


def run_configured(settings: Settings) -> int:
    """Migrate, create our topics and run the job in the foreground on the configured services.

    The input topics are their owners': the job waits for them (``user-activity check`` says so).
    """
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
        tracked_topic = settings.topic_action_tracked
        before_rows, before_published = _rows(dsn), _on_topic(watcher, tracked_topic)
        devices, _users = seed_owners(dsn, sessions, started_ago=timedelta(0))
        produced = _produce_demo(settings, devices, events, trace_ids)
        print(f"seeded {sessions} sessions, produced {produced} favorites events")
        tracing_env = None if receiver is None else {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_always_off",  # only the traced events
            "OTEL_BSP_SCHEDULE_DELAY": "500",
        }
        job = _job(settings, RUN_DIR / "recovery", RUN_DIR / "job.log", tracing_env)
        print(f"running: {' '.join(job.command()[1:])}  (log: .run/job.log)")
        started = time.monotonic()
        job.start(wait_http=0)
        invalid = len(range(0, events, 200))  # what _produce_demo makes of every 200th event
        no_session = len(range(0, events, 250)) - len(range(0, events, 1000))
        expected = events - invalid - no_session
        done_at: float | None = None
        while job.running:
            time.sleep(2)
            rows = _rows(dsn) - before_rows
            published = _on_topic(watcher, tracked_topic) - before_published
            elapsed = time.monotonic() - started
            print(f"  t={elapsed:5.1f}s  rows recorded={rows:7d}  action-tracked on the topic="
                  f"{published:7d}  ({rows / elapsed:,.0f} rows/s)", flush=True)
            if done_at is None and elapsed > timeout:
                print(f"demo not done after {timeout:.0f}s: still waiting for "
                      f"{max(0, expected - rows)} of {expected} rows and "
                      f"{max(0, expected - published)} action-tracked records on "
                      f"{tracked_topic}; the job's log is .run/job.log", flush=True)
                return 1
            if done_at is None and rows >= expected and published >= rows:
                done_at = elapsed
                print(f"demo backlog done in {done_at:.1f}s: {rows} rows, {published} published "
                      f"({rows / done_at:,.0f} events/s incl. start-up); "
                      f"lingering {linger:.0f}s (Ctrl-C to stop)")
            if done_at is not None and elapsed - done_at > linger:
                break
        if done_at is None:
            print(f"the job exited ({job.returncode}) before the demo was done; "
                  "see .run/job.log", flush=True)
        if receiver is not None:
            job.terminate(30)  # SIGTERM: a clean stop, the job's last spans are flushed
            _print_traces(receiver, trace_ids)
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
