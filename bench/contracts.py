"""The timing contracts the benchmark measures: each a scenario on real services, alone.

Each measure takes a :class:`Context` and returns one round's :class:`Measured` seconds, or
raises :class:`RoundFailed` when the scenario's outcome is wrong (an exit code, a count): a time
of a wrong outcome is no figure. A stop's seconds are the job's own (its log timestamps:
``shutdown-requested`` to the line that ended it); the others are this process's clock. Every
round has its own database (and topics); an outage or freeze of the run's broker or PostgreSQL
is always healed before the round returns.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
from confluent_kafka import TopicPartition

from bench.services import OutputCounter, Services, counts
from bench.workload import EnvelopeFactory, make_backlog, make_sessions, produce_all, producer
from cli.migrate import MIGRATIONS_DIR, MigrationBusy, apply_migrations
from devenv.harness.broker_faults import cluster_job_settings, run_under_fire
from devenv.harness.env import base_env
from devenv.harness.jobs import ROOT, JobProcess
from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import seed_sessions
from devenv.harness.stream import PacedProducer, good_stream
from devenv.kafka_cluster import ADMIN, KafkaCluster
from devenv.prometheus_server import PrometheusServer, ScrapeTarget, one_rule
from runtime.process import Process
from runtime.settings import Settings
from runtime.shutdown import Shutdown
from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput

Log = Callable[[str], None]
LAG_ALERT = "UserActivityFavoritesLagHigh"
LAG_THRESHOLD, LAG_HOLD = 10.0, 30.0
"""The lag rule's threshold here (240 s deployed), and its own hold (``for: 30s``)."""
STUCK_SECONDS = 5.0
"""``source_stuck_seconds`` of the stuck-consumer and frozen-broker rounds (30 s deployed)."""
OUTAGE = {"retry_initial_seconds": 0.5, "retry_max_seconds": 4.0}


class RoundFailed(Exception):
    """A round whose outcome was wrong: its time is no figure."""


@dataclass(frozen=True)
class Measured:
    """One round: the contract's seconds, and what else it saw."""

    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    """The run's services and a place for each round's databases, topics, jobs and files."""

    services: Services
    log: Log
    restart_backlog: int
    cluster_users: dict[str, str] = field(default_factory=lambda: {"job": "job-secret"})
    _rounds: int = 0
    _cluster: KafkaCluster | None = None

    def fresh(self, what: str) -> str:
        """A new name for one round of ``what`` (its database, topics and work directory)."""
        self._rounds += 1
        return f"t{self._rounds}_{what}".replace("-", "_")

    def database(self, name: str, sessions: int = 0) -> str:
        """A migrated database of the run named ``name``, with ``sessions`` Active sessions."""
        url = self.services.create_database(name)
        apply_migrations(url)
        if sessions:
            with psycopg.connect(url, autocommit=True) as conn:
                seed_sessions(conn, make_sessions(sessions, random.Random(name)))
        return url

    def job(self, settings: Settings, name: str, **kwargs: Any) -> JobProcess:
        """The favorites job of ``settings`` (not started) in its own directory."""
        return JobProcess(settings, self.services.run_dir / name, **kwargs)

    def cluster(self) -> KafkaCluster:
        """The 3-node cluster of the stand-still rounds, started on first use."""
        if self._cluster is None:
            self._cluster = KafkaCluster(self.services.run_dir / "cluster",
                                         users=self.cluster_users)
            self._cluster.start()
        return self._cluster

    def close(self) -> None:
        """SIGKILL the cluster's nodes (their data goes with the run directory)."""
        if self._cluster is not None:
            for node in self._cluster.nodes:
                self._cluster.kill(node)


@contextlib.contextmanager
def _running(job: JobProcess) -> Iterator[JobProcess]:
    """``job`` started; SIGKILLed at the end if it still runs."""
    job.start()
    try:
        yield job
    finally:
        job.kill()


def _streaming(job: JobProcess, count: int, rate: float) -> PacedProducer:
    """A paced stream of ``count`` favorites to ``job`` (started), a sixth of them recorded."""
    settings = job.settings
    stream = good_stream(settings, settings.database_dsn(), count, seed=46)
    paced = PacedProducer(settings, stream.records, rate=rate)
    paced.start()
    job.wait_until(lambda: counts(settings.database_dsn())["action_events"] >= count // 6, 60,
                   "a sixth of the rows")
    return paced


def _stop(job: JobProcess, code: int | set[int]) -> float:
    """SIGTERM ``job``; the stop's seconds by its own clock. RoundFailed on another exit code."""
    exited = job.terminate()
    seconds = job.stop_seconds()
    if exited not in ({code} if isinstance(code, int) else code) or seconds is None:
        raise RoundFailed(f"exit {exited}, stop {seconds} s:\n{job.log_tail(10)}")
    return seconds


def stand_still(fault: str) -> Callable[[Context], Measured]:
    """The longest stand-still of recorded rows past the failover, 50k favorites on 3 brokers."""

    def measure(ctx: Context) -> Measured:
        cluster, name = ctx.cluster(), ctx.fresh(f"fire-{fault}")
        try:
            prefix, database = name.replace("_", "-"), ctx.database(name)
            job = ctx.job(cluster_job_settings(cluster, database, prefix, "job"), name)
            admin = cluster_job_settings(cluster, database, prefix, ADMIN)
            try:
                run = run_under_fire(cluster, job, admin, database, prefix=prefix,
                                     fault_name=fault)
            except AssertionError as exc:
                raise RoundFailed(str(exc)[:2000]) from exc
            finally:
                job.kill()
        finally:
            cluster.heal()
        ctx.log(f"    {run.summary}")
        if run.exit_code != 0 or run.rows != len(run.stream.good_ids):
            raise RoundFailed(f"exit {run.exit_code}, {run.rows} rows: {run.summary}")
        return Measured(run.pause_s, {"with_failover_s": run.pause_with_failover_s,
                                      "outbox_s": run.outbox_pause_s})

    return measure


def clean_stop(ctx: Context) -> Measured:
    """SIGTERM mid-stream (800 favorites/s): exit 0."""
    name = ctx.fresh("clean-stop")
    settings = ctx.services.settings(name, ctx.database(name), **OUTAGE)
    with _running(ctx.job(settings, name)) as job:
        paced = _streaming(job, 3_000, 800)
        seconds = _stop(job, 0)
    paced.result()
    return Measured(seconds)


def outage_stop(down: str) -> Callable[[Context], Measured]:
    """SIGTERM while ``down`` (postgres, kafka) is stopped: exit 75 at the grace."""

    def measure(ctx: Context) -> Measured:
        server = ctx.services.postgres if down == "postgres" else ctx.services.broker
        name = ctx.fresh(f"{down}-down-stop")
        settings = ctx.services.settings(name, ctx.database(name), **OUTAGE)
        with _running(ctx.job(settings, name)) as job:
            paced = _streaming(job, 3_000, 1_000)
            server.stop()
            try:
                job.wait_until(lambda: _paused_on(job, down), 60, f"/readyz paused on {down}")
                seconds = _stop(job, 75)
            finally:
                server.start()
                _note_pids(ctx.services)
        paced.result()
        return Measured(seconds)

    return measure


def frozen_postgres_stop(ctx: Context) -> Measured:
    """SIGTERM while PostgreSQL accepts and never answers: the stop's deadline ends it (75)."""
    name = ctx.fresh("frozen-postgres-stop")
    settings = ctx.services.settings(name, ctx.database(name), db_statement_timeout_ms=1_000,
                                     **OUTAGE)
    with _running(ctx.job(settings, name)) as job:
        paced = _streaming(job, 3_000, 1_000)
        with ctx.services.postgres.frozen():
            time.sleep(2)  # the worker is in a call the frozen server never answers
            seconds = _stop(job, 75)
    paced.result()
    return Measured(seconds)


def restart_caught_up(ctx: Context) -> Measured:
    """SIGKILL, a backlog produced meanwhile, a restart: seconds until its last action-tracked."""
    name, rng = ctx.fresh("restart"), random.Random(47)
    settings = ctx.services.settings(name, ctx.database(name))
    sessions = make_sessions(1_000, rng)
    with psycopg.connect(settings.database_dsn(), autocommit=True) as conn:
        seed_sessions(conn, sessions)
    factory = EnvelopeFactory(sessions, rng, settings.topic_favorite_added,
                              settings.topic_favorite_removed)
    first, second = (make_backlog(factory, n, rng) for n in (1_000, ctx.restart_backlog))
    counter = OutputCounter(ctx.services.bootstrap, settings.topic_action_tracked)
    job = ctx.job(settings, name, snapshot_interval=5, backup_interval=0)
    try:
        with _running(job):
            produce_all(ctx.services.bootstrap, first.records)
            job.wait_until(lambda: counter.count >= first.expected_recorded, 120, "the first")
            time.sleep(6.5)  # one more snapshot (every 5 s) past the last record
        produce_all(ctx.services.bootstrap, second.records)
        expected = first.expected_recorded + second.expected_recorded
        with _running(job):
            started = job.started_at or time.monotonic()
            job.wait_until(lambda: counter.count >= expected, 300, "caught up")
            caught = (counter.last_at or time.monotonic()) - started
    finally:
        counter.close()
    return Measured(round(caught, 2), {"backlog": len(second.records)})


def lag_alert(ctx: Context) -> Measured:
    """PostgreSQL stopped under 5 favorites/s: seconds until Prometheus fires the lag alert.

    The lag rule of k8s/ at a 10 s threshold (240 s deployed) and its own 30 s hold, in
    Prometheus scraping and evaluating every second: due 40 s after the oldest favorite held
    was created (it may be a little older than the outage).
    """
    name = ctx.fresh("lag-alert")
    settings = ctx.services.settings(name, ctx.database(name, sessions=200),
                                     retry_initial_seconds=0.5, retry_max_seconds=1.0)
    workdir = ctx.services.run_dir / name
    job = ctx.job(settings, name)
    labels = {"namespace": "user-activity", "pod": "favorites-0", "endpoint": "http"}
    workdir.mkdir(parents=True, exist_ok=True)
    prometheus = PrometheusServer(
        workdir / "prometheus", [ScrapeTarget(f"127.0.0.1:{job.port}", labels)],
        [one_rule(workdir, LAG_ALERT, threshold=LAG_THRESHOLD, hold=f"{LAG_HOLD:g}s")])
    trickle = _Trickle(ctx, settings, 5.0)
    try:
        with _running(job), prometheus:
            trickle.start()
            job.wait_until(lambda: counts(settings.database_dsn())["action_events"] >= 10, 60,
                           "ten rows")
            ctx.services.postgres.stop()
            stopped = time.monotonic()
            try:
                prometheus.wait_until(lambda: bool(prometheus.firing(LAG_ALERT)),
                                      LAG_THRESHOLD + LAG_HOLD + 120, "the lag alert")
                fired = time.monotonic()
            finally:
                ctx.services.postgres.start()
                _note_pids(ctx.services)
    finally:
        trickle.stop()
    return Measured(round(fired - stopped, 2),
                    {"past_threshold_and_hold_s": round(fired - stopped - LAG_THRESHOLD - LAG_HOLD,
                                                        2)})


def stuck_consumer(ctx: Context) -> Measured:
    """A consumer stops fetching (paused) while records wait: seconds to the restart request.

    ``source_stuck_seconds`` is 5 s here (30 s deployed): two checks apart.
    """
    name = ctx.fresh("stuck")
    settings = ctx.services.settings(name, ctx.services.server_url, tail=True)
    topic, asked = settings.topic_favorite_added, _RestartRecorded()
    part: Any = KafkaInput(settings.kafka_client_config(), topic, process=Process(stopping=asked),
                           tail=True, batch_size=50, stuck_after=STUCK_SECONDS).build_part(
        "input", f"{topic}#0", None)
    try:
        _produce_to(settings, topic, 30)
        _read(part, 30)
        part._consumer.pause([TopicPartition(topic, 0)])  # the fault: nothing more, no error
        paused = time.monotonic()
        _produce_to(settings, topic, 40)
        with contextlib.suppress(StopIteration):  # the stop the restart asks for
            while asked.at is None and time.monotonic() < paused + 10 * STUCK_SECONDS:
                if any(isinstance(i, SourceRecord) for i in part.next_batch()):
                    raise RoundFailed("a paused consumer delivered a record")
                time.sleep(0.02)
    finally:
        part.close()
    if asked.at is None:
        raise RoundFailed("the stuck consumer was not seen")
    return Measured(round(asked.at - paused, 2))


def frozen_broker_paused(ctx: Context) -> Measured:
    """The broker frozen (SIGSTOP) mid-stream: seconds until ``/readyz`` says paused on kafka."""
    name = ctx.fresh("frozen-broker")
    settings = ctx.services.settings(name, ctx.database(name), source_stuck_seconds=STUCK_SECONDS,
                                     **OUTAGE)
    broker = ctx.services.broker.pid
    with _running(ctx.job(settings, name)) as job:
        paced = _streaming(job, 3_000, 1_000)
        os.kill(broker, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            job.wait_until(lambda: _paused_on(job, "kafka"), 10 * STUCK_SECONDS,
                           "/readyz paused on kafka", interval=0.05)
            said = time.monotonic() - frozen
        finally:
            os.kill(broker, signal.SIGCONT)
        _stop(job, {0, 75})
    paced.result()
    return Measured(round(said, 2))


def silent_server_command(command: str) -> Callable[[Context], Measured]:
    """``user-activity <command>`` against a server that accepts and never answers: exit 75."""

    def measure(_ctx: Context) -> Measured:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            port = listener.getsockname()[1]
            env = {**base_env(), "USER_ACTIVITY_DATABASE_URL": f"postgresql://u@127.0.0.1:{port}/d",
                   "USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"}
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "cli", *command.split()], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=120,
                                  check=False)
            seconds = time.monotonic() - started
        if done.returncode != 75:
            raise RoundFailed(f"exit {done.returncode}: {done.stderr[-500:]}")
        return Measured(round(seconds, 2))

    return measure


def migration_behind_a_transaction(ctx: Context) -> Measured:
    """An ALTER TABLE queued behind an open transaction: the longest a read of the table waits.

    The migration gives up at its 5 s lock timeout; the reads queued behind it go on.
    """
    name = ctx.fresh("migration-lock")
    url = ctx.database(name)
    directory = ctx.services.run_dir / name / "migrations"
    shutil.copytree(MIGRATIONS_DIR, directory)
    (directory / "0999_under_test.sql").write_text(
        "ALTER TABLE user_activity.action_events ADD COLUMN under_test text;\n")
    latencies: list[float] = []
    done = threading.Event()

    def reads() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while not done.is_set():
                began = time.monotonic()
                conn.execute("SELECT count(*) FROM user_activity.action_events").fetchone()
                latencies.append(time.monotonic() - began)
                done.wait(0.05)

    reader = threading.Thread(target=reads, daemon=True)
    with psycopg.connect(url) as analyst:
        analyst.execute("SELECT count(*) FROM user_activity.action_events")  # stays open
        reader.start()
        try:
            apply_migrations(url, directory)
        except MigrationBusy:
            pass
        else:
            raise RoundFailed("the migration did not wait for the open transaction")
        finally:
            done.set()
            reader.join(60)
    return Measured(round(max(latencies), 2))


class _RestartRecorded(Shutdown):
    """A stop request that records when a restart was asked for, then stops the input."""

    at: float | None = None

    def restart(self, reason: str) -> None:
        """Record the moment; request the stop."""
        self.at = self.at or time.monotonic()
        self.request(reason)


class _Trickle(threading.Thread):
    """Valid favorites of the database's sessions at ``rate``/s until :meth:`stop`."""

    def __init__(self, ctx: Context, settings: Settings, rate: float) -> None:
        super().__init__(name="trickle", daemon=True)
        with psycopg.connect(settings.database_dsn(), autocommit=True) as conn:
            anonymous = [row[0] for row in conn.execute(
                "SELECT anonymous_id FROM user_activity.sessions").fetchall()]
        self._owners, self._settings, self._rate = anonymous, settings, rate
        self._producer, self._done = producer(ctx.services.bootstrap, **{"linger.ms": 0}), \
            threading.Event()

    def run(self) -> None:
        """Produce one favorite per ``1 / rate`` s."""
        rng = random.Random(48)
        while not self._done.wait(1 / self._rate):
            envelope = favorite_envelope(anonymous_id=rng.choice(self._owners))
            self._producer.produce(self._settings.topic_favorite_added, orjson.dumps(envelope),
                                   b"k")
            self._producer.poll(0)

    def stop(self) -> None:
        """Stop producing; flush."""
        self._done.set()
        self.join(10)
        self._producer.flush(30)


def _produce_to(settings: Settings, topic: str, count: int) -> None:
    prod = producer(settings.kafka_bootstrap_servers)
    for _ in range(count):
        prod.produce(topic, b"{}", b"k", partition=0)
    if prod.flush(30):
        raise RoundFailed(f"{topic}: records not acknowledged")


def _read(part: Any, count: int) -> None:
    read, deadline = 0, time.monotonic() + 60
    while read < count:
        if time.monotonic() > deadline:
            raise RoundFailed(f"read {read} of {count}")
        read += sum(isinstance(i, SourceRecord) for i in part.next_batch())
        time.sleep(0.02)


def _paused_on(job: JobProcess, dependency: str) -> bool:
    answer = job.get("/readyz")
    return answer is not None and answer.status == 503 and \
        answer.json().get("dependency") == dependency


def _note_pids(services: Services) -> None:
    """The servers' pids after a restart (the CPU samplers of later phases read them)."""
    services.postmaster_pid = services.postgres.pid
    services.kafka_pid = services.broker.pid

