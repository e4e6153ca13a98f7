"""What a phase measures: CPU and RSS from ``/proc``, and the messages arriving on a topic.

- :class:`Job`: the job as :class:`devenv.harness.jobs.JobProcess` runs it, started at once,
  with its CPU time and RSS; :func:`kill_all_jobs` leaves none running.
- :class:`CpuSampler`: CPU seconds of a process (the job or the peer), PostgreSQL (postmaster
  and every backend), Kafka and the whole machine over a phase; CPU pressure (PSI).
- :class:`OutputCounter`: a consumer thread counting a topic's messages and their arrival times.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from devenv.harness.jobs import ROOT, JobProcess
from runtime.settings import Settings

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_LIVE: set[Job] = set()


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_cpu_seconds(pid: int, *, reaped_children: bool = False) -> float | None:
    """Utime + stime of ``pid`` (all threads; with its reaped children's), None when gone."""
    fields = _stat(pid)
    if fields is None:
        return None
    return sum(int(v) for v in fields[11:15 if reaped_children else 13]) / _CLK_TCK


def tree_cpu_seconds(parent: int) -> float:
    """CPU seconds of ``parent``, its reaped and its live children (the postmaster's backends)."""
    total = proc_cpu_seconds(parent, reaped_children=True) or 0.0
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == parent:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def rss_kb(pid: int, key: str = "VmRSS") -> int | None:
    """A ``/proc/<pid>/status`` value in kB (VmRSS, VmHWM), or None."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _machine() -> tuple[float, float, float]:
    """(busy, total) CPU seconds of the machine since boot; PSI "some" µs (0 without PSI)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    pressure = 0.0
    with contextlib.suppress(OSError, IndexError):
        line = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        pressure = float(line.rsplit("total=", 1)[1])
    total = sum(values[:8])
    return (total - values[3] - values[4]) / _CLK_TCK, total / _CLK_TCK, pressure


class Job(JobProcess):
    """The favorites job, started at once; its own log; recovery only with ``recovery_dir``.

    The recovery store (one partition) is made on the first start, snapshots every 5 s.
    """

    def __init__(
        self, settings: Settings, log_path: Path, *, workers: int = 1, tail: bool,
        recovery_dir: Path | None = None, extra_env: dict[str, str] | None = None,
        source_dir: Path | None = None, cluster: tuple[int, str] | None = None,
    ) -> None:
        """``source_dir``: run the job from another checkout (an A/B against another commit).

        ``cluster``: ``(process id, addresses)`` of one process of a multi-process job.
        """
        super().__init__(settings, log_path.parent, workers=workers, tail=tail, cluster=cluster,
                         recovery=recovery_dir is not None, recovery_dir=recovery_dir,
                         snapshot_interval=5, backup_interval=0, log_path=log_path,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, extra_env=extra_env,
                         cwd=source_dir or ROOT)
        self._hwm_kb = 0
        self.start(wait_http=0)
        self.started = self.started_at or time.monotonic()
        _LIVE.add(self)

    def cpu_seconds(self) -> float | None:
        """The job's CPU seconds so far (exact once it has exited)."""
        if self.rusage is not None:
            return float(self.rusage.ru_utime + self.rusage.ru_stime)
        return proc_cpu_seconds(self.pid or 0)

    def rss_mb(self) -> float | None:
        """The job's current VmRSS in MiB."""
        kb = rss_kb(self.pid or 0)
        return None if kb is None else round(kb / 1024, 1)

    def hwm_mb(self) -> float | None:
        """The highest VmHWM read so far, MiB (not ``ru_maxrss``: it counts the fork's pages)."""
        kb = rss_kb(self.pid or 0, "VmHWM") if self.rusage is None else None
        self._hwm_kb = max(self._hwm_kb, kb or 0)
        return round(self._hwm_kb / 1024, 1) if self._hwm_kb else None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the return code."""
        _LIVE.discard(self)
        return self.terminate(timeout)


def kill_all_jobs() -> None:
    """SIGKILL every job subprocess still running (teardown)."""
    for job in list(_LIVE):
        job.kill()
        _LIVE.discard(job)


class CommitProbe:
    """Times a one-row commit (a WAL flush, fsync) every ``interval`` seconds, in a thread.

    The steady phase runs it beside the job, on the same server: a commit that takes long is the
    storage stalling, which every writer of the server waits for. ``stalls(ms)`` are the wall
    clock ``(start, end)`` of the probes that took at least ``ms``.
    """

    def __init__(self, db_url: str, interval: float = 0.05) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._conn = psycopg.connect(db_url, autocommit=True)
        self._conn.execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (at timestamptz)")
        self.interval = interval
        self._thread = threading.Thread(target=self._run, name="commit-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            began = time.time()
            self._conn.execute("INSERT INTO bench_commit_probe VALUES (now())")
            self.samples.append((began, time.time()))

    def stop(self) -> None:
        """Stop probing and close the connection."""
        self._stop.set()
        self._thread.join(10)
        self._conn.close()

    def stalls(self, ms: float) -> list[tuple[float, float]]:
        """The probes of at least ``ms`` milliseconds."""
        return [(a, b) for a, b in self.samples if 1000 * (b - a) >= ms]


class CpuSampler:
    """CPU seconds of a process / PostgreSQL / Kafka / the machine between start and ``stop``.

    ``process`` gives the measured process's CPU seconds (None once it is gone: the last value
    read, every 0.5 s, is kept) and its RSS in MiB.
    """

    def __init__(self, services: Any, process: Job | None = None,
                 cpu: Callable[[], float | None] | None = None,
                 rss: Callable[[], float | None] | None = None) -> None:
        self._pg, self._kafka = services.postmaster_pid, services.kafka_pid
        self._cpu = cpu or (process.cpu_seconds if process is not None else None)
        self._rss = rss or (process.rss_mb if process is not None else None)
        self.peak_rss_mb = 0.0
        self._last_cpu = 0.0
        self._stop = threading.Event()
        self._start = self._read()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, float]:
        busy, total, pressure = _machine()
        cpu = self._cpu() if self._cpu is not None else None
        self._last_cpu = cpu if cpu is not None else self._last_cpu
        return {"t": time.monotonic(), "busy": busy, "total": total, "pressure": pressure,
                "job": self._last_cpu,
                "postgres": tree_cpu_seconds(self._pg) if self._pg else 0.0,
                "kafka": (proc_cpu_seconds(self._kafka) or 0.0) if self._kafka else 0.0,
                "bench": proc_cpu_seconds(os.getpid()) or 0.0}

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            if self._cpu is not None:
                self._last_cpu = self._cpu() or self._last_cpu
            if self._rss is not None:
                self.peak_rss_mb = max(self.peak_rss_mb, self._rss() or 0.0)

    def stop(self) -> dict[str, Any]:
        """Stop; CPU seconds and cores of each part over the phase, machine busy, PSI."""
        self._stop.set()
        self._thread.join(5)
        end = self._read()
        wall = max(end["t"] - self._start["t"], 1e-9)
        result: dict[str, Any] = {"wall_s": round(wall, 2)}
        ours = 0.0
        for part, known in (("job", True), ("postgres", self._pg), ("kafka", self._kafka),
                            ("bench", True)):
            if not known:
                result[f"{part}_cpu_s"] = None
                continue
            used = end[part] - self._start[part]
            ours += used
            result[f"{part}_cpu_s"] = round(used, 2)
            result[f"{part}_cores"] = round(used / wall, 2)
        busy = end["busy"] - self._start["busy"]
        result["machine_busy_cores"] = round(busy / wall, 2)
        result["machine_busy_pct"] = round(100 * busy / max(end["total"] - self._start["total"],
                                                            1e-9), 1)
        result["other_cores"] = round(max(0.0, busy - ours) / wall, 2)  # outside the benchmark
        result["cpu_pressure_some_pct"] = round(
            (end["pressure"] - self._start["pressure"]) / 1e4 / wall, 1)
        if self._rss is not None:
            result["job_peak_rss_mb"] = round(self.peak_rss_mb, 1)
        return result


def cpu_us_per_event(resources: dict[str, Any], events: int) -> dict[str, float | None]:
    """µs of CPU per event of the job (or peer), PostgreSQL and Kafka, and their total."""
    parts = {p: resources.get(f"{p}_cpu_s") for p in ("job", "postgres", "kafka")}
    if not events:
        return {**dict.fromkeys(parts), "total": None}
    found = {p: None if v is None else round(1e6 * v / events, 1) for p, v in parts.items()}
    return {**found, "total": round(sum(v or 0.0 for v in found.values()), 1)}


def _consumer(bootstrap: str, topic: str, partitions: int, **extra: Any) -> Consumer:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}",
                         "enable.auto.commit": False, **extra})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    return consumer


class OutputCounter:
    """Counts a topic's messages (all partitions, from the beginning) in a thread.

    ``first_at``/``last_at``: monotonic receive times; with ``track_favorites``, ``arrivals``
    maps each FavoriteId (lower case) to its wall-clock receive time and ``published`` to the
    record's timestamp (its producer's clock at ``produce``: when the job's publisher sent it).
    """

    def __init__(self, bootstrap: str, topic: str, *, track_favorites: bool = False,
                 partitions: int = 6) -> None:
        self.count = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.arrivals: dict[str, float] = {}
        self.published: dict[str, float] = {}
        self._track = track_favorites
        self._stop = threading.Event()
        self._consumer = _consumer(bootstrap, topic, partitions, **{"fetch.wait.max.ms": 20})
        self._thread = threading.Thread(target=self._run, name=f"count-{topic}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # poll() returns as soon as a record is there; consume(n, timeout) would wait the
            # whole timeout for n records (up to 50 ms added to every arrival time, measured)
            first = self._consumer.poll(0.05)
            if first is None:
                continue
            good = [m for m in (first, *self._consumer.consume(2000, 0)) if m.error() is None]
            if not good:
                continue
            now_wall, now = time.time(), time.monotonic()
            for msg in good if self._track else ():
                with contextlib.suppress(Exception):
                    favorite = orjson.loads(msg.value() or b"")["Payload"]["FavoriteId"].lower()
                    if favorite not in self.arrivals:
                        self.arrivals[favorite] = now_wall
                        self.published[favorite] = msg.timestamp()[1] / 1000
            self.first_at = self.first_at or now
            self.last_at = now
            self.count += len(good)
        self._consumer.close()

    def close(self) -> None:
        """Stop the thread and close the consumer."""
        self._stop.set()
        self._thread.join(10)


def read_topic(bootstrap: str, topic: str, key: Callable[[Any], str], *,
               expect: int, timeout: float = 60.0, partitions: int = 6) -> tuple[int, int]:
    """(total, distinct ``key(message)``) of everything on ``topic``."""
    consumer = _consumer(bootstrap, topic, partitions, **{"enable.partition.eof": True})
    total, seen, eof = 0, set[str](), set[int]()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and (len(eof) < partitions or total < expect):
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
