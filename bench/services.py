"""The services of a benchmark run, the job as a measured process, and what ``/proc`` says.

:class:`Services`: by default a fresh Kafka broker (Kafka's production JVM options) and
PostgreSQL (``fsync=on``, checked) in a temporary directory, removed at the end; ``external``:
the servers named by ``USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS`` / ``USER_ACTIVITY_DATABASE_URL``
(the role must create databases; the run's ``bench_<run>_*`` databases are dropped at the end;
processes listening on their ports on this machine are found, for their CPU). :class:`Job`: the
favorites job (or one process of a cluster) with its CPU and RSS. :class:`CpuSampler`: CPU
seconds of the job's processes, PostgreSQL (postmaster and backends), Kafka and the machine over
a phase. :class:`OutputCounter`: a topic's records as they arrive.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from psycopg import sql

from cli.topics import PROGRESS_CONFIG, ensure_topics
from devenv.harness.jobs import ROOT, JobProcess
from runtime.settings import Settings

# the dev server's default fsync is off: commits must be durable; WAL compressed as the runbook says
POSTGRES_SETTINGS = {"fsync": "on", "wal_compression": "zstd"}
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_LIVE: set[Job] = set()


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float | None:
    """Utime + stime of ``pid`` (all threads; with its reaped children's), None when gone."""
    fields = _stat(pid)
    return None if fields is None else sum(
        int(v) for v in fields[11:15 if reaped_children else 13]) / _CLK_TCK


def _tree_cpu_seconds(parent: int) -> float:
    """CPU seconds of ``parent`` and of its reaped and live children (the postmaster's backends)."""
    total = cpu_seconds(parent, reaped_children=True) or 0.0
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == parent:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def rss_mb(pid: int, key: str = "VmRSS") -> float | None:
    """A ``/proc/<pid>/status`` value (VmRSS, VmHWM) in MiB, or None."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def _machine() -> tuple[float, float, float]:
    """Busy and total CPU seconds of the machine since boot; PSI "some" µs (0 without PSI)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    pressure = 0.0
    with contextlib.suppress(OSError, IndexError):
        pressure = float(Path("/proc/pressure/cpu").read_text().split("\n")[0].rsplit("=", 1)[1])
    total = sum(values[:8])
    return (total - values[3] - values[4]) / _CLK_TCK, total / _CLK_TCK, pressure


def _listening_pid(port: int) -> int | None:
    """The process of this machine listening on TCP ``port`` (None if none or not visible)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for fields in (line.split() for line in Path(table).read_text().splitlines()[1:]):
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    for entry in sorted((p for p in Path("/proc").iterdir() if p.name.isdigit() and sockets),
                        key=lambda p: int(p.name)):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in sockets for fd in (entry / "fd").iterdir()):
                return int(entry.name)
    return None


def server_durability(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """The server's ``fsync`` and ``synchronous_commit``."""
    found = {}
    for name in ("fsync", "synchronous_commit"):
        row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
        found[name] = str(row[0]) if row else ""
    return found


class Services:
    """Kafka + PostgreSQL for one run; ``close()`` leaves nothing running."""

    def __init__(self, external: bool, run_id: str) -> None:
        self.external, self.run_id = external, run_id
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{run_id}-"))
        self._owned: list[Any] = []
        self._databases: set[str] = set()
        self._streams: dict[str, str] = {}  # database URL -> its outbox stream (bench.<run>.<id>)
        self.bootstrap = self.server_url = ""
        self.kafka_pid: int | None = None
        self.postmaster_pid: int | None = None
        self.postgres: Any = None  # the run's own servers (None with external ones)
        self.broker: Any = None

    def start(self) -> dict[str, float]:
        """Start (or find) the services; how long each took to start."""
        if self.external:
            self.bootstrap = os.environ["USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS"]
            self.server_url = os.environ["USER_ACTIVITY_DATABASE_URL"]
            self.kafka_pid = _listening_pid(int(self.bootstrap.split(",")[0].rsplit(":", 1)[1]))
            self.postmaster_pid = _listening_pid(urlsplit(self.server_url).port or 5432)
            return {}
        from devenv.kafka_broker import PRODUCTION_JVM, KafkaBroker
        from devenv.postgres_server import PostgresServer

        t0 = time.monotonic()
        postgres = self.postgres = PostgresServer(self.run_dir / "postgres",
                                                  settings=POSTGRES_SETTINGS)
        self._owned.append(postgres)
        postgres.start()
        self.server_url, self.postmaster_pid = postgres.dsn("postgres"), postgres.pid
        timings = {"postgres_start_s": time.monotonic() - t0}
        if self.durability()["fsync"] != "on":
            raise RuntimeError("the benchmark's PostgreSQL must run with fsync=on")
        t0 = time.monotonic()
        broker = self.broker = KafkaBroker(self.run_dir / "kafka", jvm_options=PRODUCTION_JVM)
        self._owned.append(broker)
        self.bootstrap, self.kafka_pid = broker.start(), broker.pid
        return {**timings, "kafka_start_s": time.monotonic() - t0}

    def durability(self) -> dict[str, str]:
        """``fsync`` and ``synchronous_commit`` as the server says (``meta.postgres``)."""
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            return server_durability(conn)

    def _admin(self, statement: sql.Composed) -> None:
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(statement)

    def create_database(self, suffix: str, template: str | None = None) -> str:
        """Create the run's database ``suffix``, new or a file copy of ``template``; its URL."""
        name = f"bench_{self.run_id}_{suffix}"
        self.drop_database(suffix)
        create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        source = f"bench_{self.run_id}_{template}"
        if template is not None:
            create += sql.SQL(" TEMPLATE {} STRATEGY FILE_COPY").format(sql.Identifier(source))
        try:
            self._admin(create)
        except psycopg.errors.ObjectInUse:  # a connection to the template not yet closed (yoyo's)
            self._admin(sql.SQL("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                " WHERE datname = {}").format(sql.Literal(source)))
            self._admin(create)
        self._databases.add(suffix)
        return urlunsplit(urlsplit(self.server_url)._replace(path="/" + name))

    def drop_database(self, suffix: str) -> None:
        """Drop this run's database ``suffix`` (disconnecting its sessions)."""
        with contextlib.suppress(psycopg.Error):
            self._admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(f"bench_{self.run_id}_{suffix}")))
        self._databases.discard(suffix)

    def settings(self, prefix: str, db_url: str, **overrides: Any) -> Settings:
        """Settings whose topics are ``bench.<run>.<prefix>.*`` (the favorites ones created).

        The outbox's stream (transactional id, progress topic) is the database's: one stream
        per database, whichever phase's job publishes from it.
        """
        names = {f"topic_{n.replace('-', '_')}": f"bench.{self.run_id}.{prefix}.{n}" for n in (
            "favorite-added", "favorite-removed", "action-tracked", "favorites-dlq",
            "user-signed-in", "session-linked", "session-started", "session-ended",
            "session-linking-dlq")}
        stream = self._streams.setdefault(db_url, f"bench.{self.run_id}.{uuid.uuid4().hex[:8]}")
        settings = Settings(**{"kafka_bootstrap_servers": self.bootstrap, "database_url": db_url,
                               "http_port": 0, **names,
                               "topic_outbox_progress": f"{stream}.outbox-progress",
                               "outbox_transactional_id": f"{stream}.outbox", **overrides})
        ensure_topics(settings.kafka_client_config(), [
            settings.topic_favorite_added, settings.topic_favorite_removed,
            settings.topic_action_tracked, settings.topic_favorites_dlq], 6)
        ensure_topics(settings.kafka_client_config(), [settings.topic_outbox_progress], 1,
                      config=PROGRESS_CONFIG)
        return settings

    def close(self) -> None:
        """Drop this run's databases, stop its own services, remove the run directory."""
        for suffix in list(self._databases):
            self.drop_database(suffix)
        for service in reversed(self._owned):
            with contextlib.suppress(Exception):
                service.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def counts(db_url: str) -> dict[str, int]:
    """Rows of action_events and unpublished outbox rows."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM user_activity.action_events),"
                           " (SELECT count(*) FROM user_activity.outbox_unpublished)").fetchone()
    assert row is not None
    return {"action_events": int(row[0]), "outbox_unpublished": int(row[1])}


def wal_position(db_url: str) -> tuple[int, str]:
    """The server's WAL insert position, in bytes and as an LSN."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn,"
                           " pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def wal_by_kind(db_url: str, start: str, end: str, events: int) -> dict[str, float] | None:
    """WAL bytes per event between two LSNs: record data vs full-page images (pg_walinspect).

    None where ``pg_walinspect`` cannot be created (it needs a superuser) or the WAL is gone.
    """
    if events <= 0:
        return None
    try:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            row = conn.execute(  # it reads flushed WAL only
                "SELECT coalesce(sum(combined_size), 0), coalesce(sum(fpi_size), 0)"
                "  FROM pg_get_wal_stats(%s::pg_lsn,"
                "       least(%s::pg_lsn, pg_current_wal_flush_lsn()), per_record => false)",
                (start, end)).fetchone()
    except psycopg.Error:
        return None
    total, images = (int(v) for v in row or (0, 0))
    return {"records": round((total - images) / events, 1),
            "page_images": round(images / events, 1), "total": round(total / events, 1)}


class Job(JobProcess):
    """The favorites job, started at once with its own log; recovery only with ``recovery_dir``.

    ``source_dir`` runs it from another checkout (an A/B against another commit); ``cluster``
    ``(process id, addresses)`` runs one process of a Bytewax cluster (``-i``/``-a``).
    """

    def __init__(self, settings: Settings, log_path: Path, *, workers: int = 1, tail: bool,
                 recovery_dir: Path | None = None, extra_env: dict[str, str] | None = None,
                 source_dir: Path | None = None, cluster: tuple[int, str] | None = None) -> None:
        super().__init__(settings, log_path.parent, workers=workers, tail=tail, cluster=cluster,
                         recovery=recovery_dir is not None, recovery_dir=recovery_dir,
                         snapshot_interval=5, backup_interval=0, log_path=log_path,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, extra_env=extra_env,
                         cwd=source_dir or ROOT)
        self._hwm = 0.0
        self.start(wait_http=0)
        self.started = self.started_at or time.monotonic()
        _LIVE.add(self)

    def cpu_seconds(self) -> float | None:
        """The job's CPU seconds so far (exact once it has exited)."""
        if self.rusage is not None:
            return float(self.rusage.ru_utime + self.rusage.ru_stime)
        return cpu_seconds(self.pid or 0)

    def rss_mb(self) -> float | None:
        """The job's VmRSS in MiB."""
        return rss_mb(self.pid or 0)

    def hwm_mb(self) -> float | None:
        """The highest VmHWM read so far, MiB (not ``ru_maxrss``: it counts the fork's pages)."""
        if self.rusage is None:
            self._hwm = max(self._hwm, rss_mb(self.pid or 0, "VmHWM") or 0.0)
        return self._hwm or None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code."""
        _LIVE.discard(self)
        return self.terminate(timeout)


def kill_all_jobs() -> None:
    """SIGKILL every job still running (teardown)."""
    for job in list(_LIVE):
        job.kill()
        _LIVE.discard(job)


class CpuSampler:
    """CPU seconds of a process, PostgreSQL, Kafka, this process and the machine until ``stop``.

    ``cpu``/``rss`` read the measured process (None once it is gone: the last value is kept).
    """

    def __init__(self, services: Services, cpu: Callable[[], float | None] | None = None,
                 rss: Callable[[], float | None] | None = None) -> None:
        self._pg, self._kafka, self._cpu, self._rss = (
            services.postmaster_pid, services.kafka_pid, cpu, rss)
        self.peak_rss_mb, self._last_cpu = 0.0, 0.0
        self._stop, self._start = threading.Event(), self._read()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, services: Services, *jobs: Job) -> CpuSampler:
        """A sampler of ``jobs`` (the processes of one cluster): their summed CPU and RSS."""

        def total(read: Callable[[Job], float | None]) -> Callable[[], float | None]:
            def summed() -> float | None:  # None while any process is unreadable
                values = [read(job) for job in jobs]
                return None if None in values else sum(v or 0.0 for v in values)
            return summed

        return cls(services, total(Job.cpu_seconds), total(Job.rss_mb))

    def _read(self) -> dict[str, float]:
        busy, total, pressure = _machine()
        self._last_cpu = (self._cpu() if self._cpu else None) or self._last_cpu
        return {"t": time.monotonic(), "busy": busy, "total": total, "pressure": pressure,
                "job": self._last_cpu, "postgres": _tree_cpu_seconds(self._pg) if self._pg else 0.0,
                "kafka": (cpu_seconds(self._kafka) or 0.0) if self._kafka else 0.0,
                "bench": cpu_seconds(os.getpid()) or 0.0}

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._last_cpu = (self._cpu() if self._cpu else None) or self._last_cpu
            self.peak_rss_mb = max(self.peak_rss_mb, (self._rss() if self._rss else None) or 0.0)

    def stop(self) -> dict[str, Any]:
        """CPU seconds and cores of each part over the phase, the machine's busy share, PSI."""
        self._stop.set()
        self._thread.join(5)
        end, start = self._read(), self._start
        wall = max(end["t"] - start["t"], 1e-9)
        result: dict[str, Any] = {"wall_s": round(wall, 2)}
        ours = 0.0
        for part, known in (("job", True), ("postgres", self._pg), ("kafka", self._kafka),
                            ("bench", True)):
            used = end[part] - start[part] if known else None
            ours += used or 0.0
            result[f"{part}_cpu_s"] = None if used is None else round(used, 2)
            if used is not None:
                result[f"{part}_cores"] = round(used / wall, 2)
        busy = end["busy"] - start["busy"]
        result |= {"machine_busy_cores": round(busy / wall, 2),
                   "machine_busy_pct": round(100 * busy / max(end["total"] - start["total"], 1e-9),
                                             1),
                   "other_cores": round(max(0.0, busy - ours) / wall, 2),  # outside the bench
                   "cpu_pressure_some_pct": round((end["pressure"] - start["pressure"]) / 1e4
                                                  / wall, 1)}
        if self._rss is not None:
            result["job_peak_rss_mb"] = round(self.peak_rss_mb, 1)
        return result


def cpu_us_per_event(resources: dict[str, Any], events: int) -> dict[str, float | None]:
    """µs of CPU per event of the job (or peer), PostgreSQL and Kafka, and their total."""
    found = {p: None if not events or resources.get(f"{p}_cpu_s") is None
             else round(1e6 * resources[f"{p}_cpu_s"] / events, 1)
             for p in ("job", "postgres", "kafka")}
    return {**found, "total": round(sum(v or 0.0 for v in found.values()), 1) if events else None}


def _consumer(bootstrap: str, topic: str, **extra: Any) -> Consumer:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}",
                         "enable.auto.commit": False, **extra})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(6)])
    return consumer


class OutputCounter:
    """Counts a topic's records (6 partitions, from the beginning) in a thread.

    ``first_at``/``last_at``: monotonic receive times; with ``track_favorites``, ``arrivals``
    maps each FavoriteId (lower case) to its wall-clock receive time.
    """

    def __init__(self, bootstrap: str, topic: str, *, track_favorites: bool = False) -> None:
        self.count = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.arrivals: dict[str, float] = {}
        self._track, self._stop = track_favorites, threading.Event()
        self._consumer = _consumer(bootstrap, topic, **{"fetch.wait.max.ms": 20})
        self._thread = threading.Thread(target=self._run, name=f"count-{topic}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # poll() returns at the first record; consume(n, timeout) would wait out the timeout
            if (first := self._consumer.poll(0.05)) is None:
                continue
            good = [m for m in (first, *self._consumer.consume(2000, 0)) if m.error() is None]
            now_wall, now = time.time(), time.monotonic()
            for msg in good if self._track else ():
                with contextlib.suppress(Exception):
                    favorite = orjson.loads(msg.value() or b"")["Payload"]["FavoriteId"].lower()
                    self.arrivals.setdefault(favorite, now_wall)
            if good:
                self.first_at, self.last_at = self.first_at or now, now
                self.count += len(good)
        self._consumer.close()

    def close(self) -> None:
        """Stop the thread and close the consumer."""
        self._stop.set()
        self._thread.join(10)


def read_topic(bootstrap: str, topic: str, key: Callable[[Any], str], *, expect: int,
               timeout: float = 60.0) -> tuple[int, int]:
    """(total, distinct ``key(record)``) of everything on ``topic``."""
    consumer = _consumer(bootstrap, topic, **{"enable.partition.eof": True})
    total, seen, eof = 0, set[str](), set[int]()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and (len(eof) < 6 or total < expect):
            for msg in consumer.consume(5000, 0.2):
                if (err := msg.error()) is not None:
                    if err.code() == -191:  # _PARTITION_EOF
                        eof.add(msg.partition() or 0)
                    continue
                total += 1
                seen.add(key(orjson.loads(msg.value() or b"null")))
    finally:
        consumer.close()
    return total, len(seen)
