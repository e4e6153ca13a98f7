"""The job as a subprocess (``python -m bytewax.run``), what it emits, and what it costs.

- :class:`JobProcess`: the real job as the harness (:mod:`devenv.harness.jobs`) runs it, with
  its CPU time and RSS from ``/proc``.
- :class:`OutputCounter`: a consumer thread on the action-tracked topic that counts messages and
  timestamps their arrival (receive time in this process); optionally maps FavoriteId -> arrival.
- :class:`CpuSampler`: CPU seconds of the job, PostgreSQL, Kafka and the whole machine over a
  phase, and the job's peak RSS.
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
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from devenv.harness.jobs import ROOT
from devenv.harness.jobs import JobProcess as HarnessJob
from runtime.settings import Settings

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_LIVE: set[JobProcess] = set()


def proc_cpu_seconds(pid: int) -> float | None:
    """The utime + stime of ``pid`` (all its threads), or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def proc_status_kb(pid: int, key: str) -> int | None:
    """A ``/proc/<pid>/status`` value in kB (VmRSS, VmHWM), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def children_cpu_seconds(parent: int) -> float:
    """CPU seconds of ``parent``, its reaped children (cutime + cstime) and its live children.

    For the postmaster: every backend, including those that exited during the phase.
    """
    try:
        fields = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    total = sum(int(v) for v in fields[11:15]) / _CLK_TCK
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def cpu_pressure_us() -> int | None:
    """Total microseconds some runnable task waited for a CPU (PSI), or None without PSI."""
    try:
        line = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
    except OSError:
        return None
    return int(line.rsplit("total=", 1)[1])


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return (total - idle) / _CLK_TCK, total / _CLK_TCK


class JobProcess(HarnessJob):
    """The favorites job as :class:`devenv.harness.jobs.JobProcess` runs it, started at once.

    Its own log file, no recovery unless ``recovery_dir`` (``-s snapshot_interval -b 0``); CPU
    time (exact once reaped) and RSS from ``/proc``; registered for :func:`kill_all_jobs`.
    """

    def __init__(
        self, settings: Settings, log_path: Path, *, workers: int = 1, tail: bool,
        recovery_dir: Path | None = None, snapshot_interval: float = 5.0,
        extra_env: dict[str, str] | None = None, source_dir: Path | None = None,
    ) -> None:
        """``source_dir``: run the job from another checkout (an A/B against another commit)."""
        super().__init__(
            settings, log_path.parent, workers=workers, tail=tail,
            recovery=recovery_dir is not None, recovery_dir=recovery_dir,
            snapshot_interval=round(snapshot_interval), backup_interval=0, log_path=log_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, extra_env=extra_env,
            cwd=source_dir or ROOT,
        )
        self._hwm_kb = 0
        self.start(wait_http=0)
        self.started = self.started_at or time.monotonic()
        _LIVE.add(self)

    def init_recovery(self) -> None:
        """The phases make the recovery store themselves."""

    @property
    def job_pid(self) -> int:
        """The job's pid (setpriv execs, so it is the Python process)."""
        assert self.pid is not None
        return self.pid

    def cpu_seconds(self) -> float | None:
        """The job's CPU seconds so far (exact once it has exited)."""
        if self.rusage is not None:
            return float(self.rusage.ru_utime + self.rusage.ru_stime)
        return proc_cpu_seconds(self.job_pid)

    def rss_mb(self) -> float | None:
        """The job's current VmRSS in MiB."""
        kb = proc_status_kb(self.job_pid, "VmRSS")
        return None if kb is None else kb / 1024

    def hwm_mb(self) -> float | None:
        """The job's peak RSS in MiB: the highest VmHWM read so far (call it while it runs).

        Not ``ru_maxrss``: that counts the forked benchmark process's pages before the exec.
        """
        kb = proc_status_kb(self.job_pid, "VmHWM") if self.rusage is None else None
        if kb is not None:
            self._hwm_kb = max(self._hwm_kb, kb)
        return self._hwm_kb / 1024 if self._hwm_kb else None

    def kill(self) -> int | None:
        """SIGKILL the job and reap it."""
        code = super().kill()
        _LIVE.discard(self)
        return code

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the return code."""
        code = self.terminate(timeout)
        _LIVE.discard(self)
        return code

    def log_tail(self, lines: int = 20, *, info: bool = True) -> str:
        """The end of the job's log."""
        return super().log_tail(lines, info=info)


def kill_all_jobs() -> None:
    """SIGKILL every job subprocess still running (teardown)."""
    for job in list(_LIVE):
        job.kill()


class OutputCounter:
    """Counts messages on a topic (all partitions, from the beginning) in a thread."""

    def __init__(self, bootstrap: str, topic: str, *, track_favorites: bool = False,
                 partitions: int = 6) -> None:
        self.count = 0
        self.first_at: float | None = None  # monotonic receive time of the first message
        self.last_at: float | None = None
        self.arrivals: dict[str, float] = {}  # FavoriteId -> wall-clock receive time
        self._track = track_favorites
        self._stop = threading.Event()
        self._consumer = Consumer({
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 20,
        })
        self._consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self._thread = threading.Thread(target=self._run, name=f"count-{topic}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        consumer = self._consumer
        while not self._stop.is_set():
            messages = consumer.consume(2000, 0.05)
            if not messages:
                continue
            now_wall = time.time()
            now = time.monotonic()
            good = 0
            for msg in messages:
                if msg.error() is not None:
                    continue
                good += 1
                if self._track:
                    with contextlib.suppress(Exception):
                        favorite = orjson.loads(msg.value() or b"")["Payload"]["FavoriteId"]
                        self.arrivals.setdefault(favorite.lower(), now_wall)
            if good:
                if self.first_at is None:
                    self.first_at = now
                self.last_at = now
                self.count += good
        consumer.close()

    def close(self) -> None:
        """Stop the thread and close the consumer."""
        self._stop.set()
        self._thread.join(10)


def read_topic(bootstrap: str, topic: str, key: Callable[[Any], str], *,
               expect: int, timeout: float = 60.0, partitions: int = 6) -> tuple[int, int]:
    """(total, distinct ``key(envelope)``) of everything on ``topic``."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}",
        "enable.auto.commit": False, "enable.partition.eof": True,
    })
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    total = 0
    seen: set[str] = set()
    eof: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and (len(eof) < partitions or total < expect):
            for msg in consumer.consume(5000, 0.2):
                err = msg.error()
                if err is not None:
                    if err.code() == -191:  # _PARTITION_EOF
                        eof.add(msg.partition() or 0)
                    continue
                total += 1
                seen.add(key(orjson.loads(msg.value() or b"null")))
    finally:
        consumer.close()
    return total, len(seen)


class CpuSampler:
    """CPU seconds of the job / PostgreSQL / Kafka / machine between ``start`` and ``stop``."""

    def __init__(self, job: JobProcess | None, postmaster_pid: int | None,
                 kafka_pid: int | None, interval: float = 0.5) -> None:
        self._job = job
        self._pg = postmaster_pid
        self._kafka = kafka_pid
        self._interval = interval
        self._stop = threading.Event()
        self.peak_rss_mb = 0.0
        self._start = self._read()
        self._last_job_cpu = self._start["job"]
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, float]:
        busy, total = machine_cpu()
        job_cpu = None if self._job is None else self._job.cpu_seconds()
        return {
            "t": time.monotonic(),
            "machine_busy": busy,
            "machine_total": total,
            "job": job_cpu or 0.0,
            "postgres": children_cpu_seconds(self._pg) if self._pg else 0.0,
            "kafka": (proc_cpu_seconds(self._kafka) or 0.0) if self._kafka else 0.0,
            "bench": proc_cpu_seconds(os.getpid()) or 0.0,
            "pressure_us": float(cpu_pressure_us() or 0),
        }

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if self._job is not None:
                rss = self._job.rss_mb()
                if rss is not None:
                    self.peak_rss_mb = max(self.peak_rss_mb, rss)
                cpu = self._job.cpu_seconds()
                if cpu is not None:
                    self._last_job_cpu = cpu

    def stop(self) -> dict[str, Any]:
        """Stop sampling; CPU seconds and utilisation (cores) of each part over the phase."""
        self._stop.set()
        self._thread.join(5)
        end = self._read()
        if self._job is not None and self._job.rusage is None and not self._job.running:
            end["job"] = self._last_job_cpu
        wall = end["t"] - self._start["t"]
        result: dict[str, Any] = {"wall_s": round(wall, 2)}
        for part in ("job", "postgres", "kafka", "bench"):
            if (part == "postgres" and not self._pg) or (part == "kafka" and not self._kafka):
                result[f"{part}_cpu_s"] = None
                continue
            used = end[part] - self._start[part]
            result[f"{part}_cpu_s"] = round(used, 2)
            result[f"{part}_cores"] = round(used / wall, 2) if wall > 0 else None
        busy = end["machine_busy"] - self._start["machine_busy"]
        total = end["machine_total"] - self._start["machine_total"]
        result["machine_busy_cores"] = round(busy / wall, 2) if wall > 0 else None
        result["machine_busy_pct"] = round(100 * busy / total, 1) if total > 0 else None
        ours = sum(result.get(f"{part}_cpu_s") or 0.0 for part in ("job", "postgres", "kafka",
                                                                   "bench"))
        # CPU used by processes outside this benchmark (other work sharing the machine).
        result["other_cores"] = round(max(0.0, busy - ours) / wall, 2) if wall > 0 else None
        # Share of the wall time in which some runnable task waited for a CPU (PSI "some").
        waited = end["pressure_us"] - self._start["pressure_us"]
        result["cpu_pressure_some_pct"] = round(100 * waited / 1e6 / wall, 1) if wall else None
        if self._job is not None:
            result["job_peak_rss_mb"] = round(self.peak_rss_mb, 1)
        return result
