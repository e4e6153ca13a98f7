"""A dataflow job as a subprocess (``python -m bytewax.run``), the way Kubernetes runs it.

Start, SIGKILL, terminate and restart on one recovery directory; HTTP, metrics and log events.
Nothing outlives its owner: each job has its own process group and ``setpriv --pdeathsig
KILL``, and :class:`JobSupervisor` kills every job still running when it closes.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg

from devenv.harness.env import base_env, settings_env
from devenv.harness.metrics import parse_metrics
from devenv.harness.ports import free_port
from runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FAVORITES_FLOW = "dataflows.favorite_actions:flow"
SESSION_LINKING_FLOW = "dataflows.session_linking:flow"
_TAIL_BYTES = 200_000
STOP_LIVENESS_SECONDS = 60.0
"""How long :meth:`JobProcess.terminate` waits before SIGKILL: a stop ends itself by its grace
+ 5 s (runtime/shutdown.py), so only a job that never ends is killed."""
STOP_ENDS = ("stopped", "stopped-for-restart", "stopped-during-outage")
"""The line that ends every stop (runtime/shutdown.py): exit 0, a restart (75), unfinished (75)."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs and is no zombie (PID 1 may reap a detached process late, or never)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class HttpAnswer:
    """One answer of the job's HTTP server."""

    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return orjson.loads(self.body)


class JobProcess:
    """A job in a subprocess; start / kill -9 / terminate / restart on one recovery directory."""

    def __init__(self, settings: Settings, workdir: Path, *, flow: str = FAVORITES_FLOW,
                 workers: int | None = None, tail: bool | None = True, recovery: bool = True,
                 recovery_dir: Path | None = None, snapshot_interval: float = 1,
                 backup_interval: float = 10, host: str = "127.0.0.1", port: int | None = None,
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 extra_env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 cluster: tuple[int, str] | None = None) -> None:
        self.workdir, self.cluster = workdir, cluster
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.flow, self.workers = flow, workers
        self.recovery_dir = (recovery_dir or workdir / "recovery") if recovery else None
        self.port = free_port() if port is None else port
        update: dict[str, Any] = {"http_port": self.port, "http_host": host}
        if tail is not None:
            update["tail"] = tail
        self.settings, self.cwd = settings.model_copy(update=update), cwd or ROOT
        self._snapshot_interval, self._backup_interval = snapshot_interval, backup_interval
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.pids: list[int] = []
        self.log_paths: list[Path] = []
        self.exit_codes: list[int] = []
        self.started_at: float | None = None
        self.exited_at: float | None = None
        self.rusage: Any = None  # the exact CPU time and max RSS of the last reaped start
        self.env = {**(base_env() if env is None else env), **settings_env(self.settings),
                     **(extra_env or {})}

    def init_recovery(self) -> None:
        """Create the recovery store (one SQLite partition) unless it already exists."""
        if self.recovery_dir is None or (
                self.recovery_dir.exists() and any(self.recovery_dir.iterdir())):
            return
        from bytewax.recovery import init_db_dir

        self.recovery_dir.mkdir(parents=True, exist_ok=True)
        init_db_dir(self.recovery_dir, 1)  # type: ignore[no-untyped-call]

    def command(self) -> list[str]:
        """The job's command line (after ``setpriv``)."""
        command = [sys.executable, "-m", "bytewax.run", self.flow]
        if self.workers is not None:
            command += ["-w", str(self.workers)]
        if self.cluster is not None:
            command += ["-i", str(self.cluster[0]), "-a", self.cluster[1]]
        if self.recovery_dir is not None:
            command += ["-r", str(self.recovery_dir),
                        "-s", _seconds(self._snapshot_interval),
                        "-b", _seconds(self._backup_interval)]
        return command

    def start(self, *, wait_http: float = 60.0) -> None:
        """Start the job (recovery dir created on first start); wait until ``/livez`` answers."""
        if self.running:
            raise RuntimeError("the job is already running")
        self.init_recovery()
        if self._log_path is None:
            log_path, mode = self.workdir / f"job-{len(self.log_paths) + 1}.log", "wb"
        else:
            log_path, mode = self._log_path, "ab"
        self.log_paths.append(log_path)
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        with log_path.open(mode) as log:
            self.started_at = time.monotonic()
            self.exited_at = self.rusage = None
            self._proc = subprocess.Popen(  # its own process group: kill() reaches every child
                [*prefix, *self.command()], cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids.append(self._proc.pid)
        if wait_http:
            self.wait_until(lambda: self.get("/livez") is not None, wait_http, "/livez to answer")

    @property
    def pid(self) -> int | None:
        """The pid of the latest start (``setpriv`` execs the job: the Python process)."""
        return self.pids[-1] if self.pids else None

    @property
    def returncode(self) -> int | None:
        """The exit code of the latest start once it has exited, else None."""
        if self._proc is not None:
            return self._poll()
        return self.exit_codes[-1] if self.exit_codes else None

    @property
    def running(self) -> bool:
        """True while the current job process has not exited."""
        return self._proc is not None and self._poll() is None

    def _poll(self) -> int | None:
        """The exit code once the process has exited (reaping it, with its rusage), else None."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            if proc.returncode is None:
                try:
                    pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
                except ChildProcessError:
                    return proc.returncode
                if pid == 0:
                    return None
                proc.returncode = os.waitstatus_to_exitcode(status)
                self.rusage, self.exited_at = rusage, time.monotonic()
            return proc.returncode

    def _wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the current process to exit; its exit code, or None."""
        deadline = time.monotonic() + timeout
        while (code := self._poll()) is None:
            if self._proc is None or time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
        return code

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the job's process group while it runs."""
        proc = self._proc
        if proc is not None and self._poll() is None:  # alive: its group id is still ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def kill(self) -> int | None:
        """SIGKILL the job's process group (a crash: no cleanup, no final snapshot) and reap it."""
        if self._proc is None:
            return None
        self.send_signal(signal.SIGKILL)
        return self.reap(30.0)

    def terminate(self, timeout: float = STOP_LIVENESS_SECONDS,
                  sig: signal.Signals = signal.SIGTERM) -> int | None:
        """Stop the job as Kubernetes does: ``sig``, SIGKILL after ``timeout``; the exit code."""
        if self._proc is None:
            return None
        self.send_signal(sig)
        if self._wait_exit(timeout) is None:
            self.send_signal(signal.SIGKILL)
        return self.reap(30.0)

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the job to exit by itself; its exit code, or None."""
        if self._proc is None:
            return self.exit_codes[-1] if self.exit_codes else None
        return None if self._wait_exit(timeout) is None else self.reap(1.0)

    def reap(self, timeout: float) -> int:
        """Wait for the current process to exit and record its exit code (``exit_codes``)."""
        if self._proc is None:
            raise RuntimeError("the job is not started")
        code = self._wait_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.command(), timeout)
        self.exit_codes.append(code)
        self._proc = None
        return code

    def leftover_pids(self) -> list[int]:
        """Processes of this job still alive: started pids, and any process using its recovery."""
        left = [pid for pid in self.pids if alive(pid)]
        if self.recovery_dir is None:
            return sorted(set(left))
        marker = str(self.recovery_dir).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    left.append(int(entry.name))
        return sorted(set(left))

    def get(self, path: str, timeout: float = 2.0) -> HttpAnswer | None:
        """GET ``path`` from the job's HTTP server; None if it does not answer."""
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return HttpAnswer(response.status, response.read())
        except urllib.error.HTTPError as exc:
            return HttpAnswer(exc.code, exc.read())
        except (OSError, ValueError, http.client.HTTPException):  # a job dying mid-answer
            return None

    def scrape(self, timeout: float = 2.0) -> dict[str, float] | None:
        """The Prometheus samples, ``name{labels}`` -> value; None if ``/metrics`` is not 200."""
        answer = self.get("/metrics", timeout)
        if answer is None or answer.status != 200:
            return None
        return parse_metrics(answer.body.decode())

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples, ``name{labels}`` -> value (empty if unreachable)."""
        return self.scrape() or {}

    def metric(self, name: str, default: float = 0.0) -> float:
        """One sample by its full name (with labels, as exposed), or ``default``."""
        return self.metrics().get(name, default)

    def log_events(self, run: int | None = None) -> list[dict[str, Any]]:
        """The JSON log lines of every start (or of start number ``run``, 1-based)."""
        paths = self.log_paths if run is None else [self.log_paths[run - 1]]
        events: list[dict[str, Any]] = []
        for path in dict.fromkeys(paths):
            for line in _read_lines(path):
                with contextlib.suppress(orjson.JSONDecodeError):
                    parsed = orjson.loads(line)
                    if isinstance(parsed, dict):
                        events.append(parsed)
        return events

    def logged_at(self, event: str, run: int | None = None, *, last: bool = False
                  ) -> float | None:
        """When the job logged its first (``last``: last) ``event`` line, by its own clock.

        Epoch seconds of the line's ``ts`` (milliseconds) in start ``run`` (default: the
        latest); None when there is no such line.
        """
        times = [datetime.fromisoformat(e["ts"]).timestamp()
                 for e in self.log_events(run or len(self.log_paths))
                 if e.get("event") == event and isinstance(e.get("ts"), str)]
        return (times[-1] if last else times[0]) if times else None

    def stop_ended_at(self, run: int | None = None) -> float | None:
        """When the line that ended a stop (:data:`STOP_ENDS`) was logged, as :meth:`logged_at`."""
        ends = [t for t in (self.logged_at(e, run, last=True) for e in STOP_ENDS) if t is not None]
        return max(ends, default=None)

    def stop_seconds(self, run: int | None = None) -> float | None:
        """Seconds from ``shutdown-requested`` to the line that ended the stop (:data:`STOP_ENDS`).

        Read from the job's log timestamps, which a busy harness cannot stretch; start ``run``
        (default: the latest). None without a request or an end (a SIGKILL).
        """
        requested, ended = self.logged_at("shutdown-requested", run), self.stop_ended_at(run)
        return None if requested is None or ended is None else round(ended - requested, 3)

    def log_tail(self, lines: int = 30, *, info: bool = False) -> str:
        """The end of the latest log (without its INFO lines unless ``info``), for messages."""
        if not self.log_paths:
            return ""
        if info:
            kept = _read_lines(self.log_paths[-1], _TAIL_BYTES)
        else:
            kept = [line for line in _read_lines(self.log_paths[-1])
                    if b'"level":"INFO"' not in line]
        return "\n".join(line.decode(errors="replace") for line in kept[-lines:])

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str,
                   interval: float = 0.2) -> float:
        """Poll ``condition`` until true; the seconds it took. Fails if the job exits first."""

        def exited() -> str | None:
            code = None if self._proc is None else self._poll()
            return None if code is None else f"the job exited ({code})"

        return wait_until(condition, timeout, what, interval=interval, exited=exited,
                          context=self.diagnosis)

    def diagnosis(self) -> str:
        """What a failed wait shows: the log tail, ``py-spy dump``, busy SQL sessions."""
        parts = [self.log_tail()]
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if self.running and self._proc is not None and Path(spy).exists():
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(self._proc.pid)],
                                      check=False, capture_output=True, text=True, timeout=30)
                parts.append(f"py-spy dump:\n{dump.stdout}{dump.stderr}")
            except (OSError, subprocess.SubprocessError) as exc:
                parts.append(f"py-spy dump failed: {exc}")
        try:
            with psycopg.connect(self.settings.database_dsn(), connect_timeout=5,
                                 autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT application_name, state, wait_event_type, wait_event,"
                    " now() - xact_start, left(query, 200) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND state <> 'idle'").fetchall()
            parts.append("busy sessions:\n" + "\n".join(map(str, rows)))
        except psycopg.Error as exc:
            parts.append(f"pg_stat_activity failed: {exc}")
        return "\n".join(parts)


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *, interval: float = 0.2,
               exited: Callable[[], str | None] = lambda: None,
               context: Callable[[], str] = lambda: "") -> float:
    """Poll ``condition`` until true; the seconds it took."""
    started = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - started
        if (ended := exited()) is not None:
            raise AssertionError(f"{ended} while waiting for {what}:\n{context()}")
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{context()}")
        time.sleep(interval)


class JobSupervisor:
    """Creates jobs and guarantees none is left running when it closes."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self.jobs: list[JobProcess] = []

    def job(self, settings: Settings, name: str = "job", **kwargs: Any) -> JobProcess:
        """A new (not yet started) job with its own work directory."""
        job = JobProcess(settings, self._workdir / name, **kwargs)
        self.jobs.append(job)
        return job

    def close(self) -> list[int]:
        """Kill every job still running; return the pids that were still alive afterwards."""
        for job in self.jobs:
            job.kill()
        return [pid for job in self.jobs for pid in job.leftover_pids()]


@contextlib.contextmanager
def supervised_jobs(workdir: Path) -> Iterator[JobSupervisor]:
    """A :class:`JobSupervisor` that is closed (jobs killed) however the block ends."""
    supervisor = JobSupervisor(workdir)
    try:
        yield supervisor
    finally:
        left = supervisor.close()
        if left:
            raise AssertionError(f"job processes left running: {left}")


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _read_lines(path: Path, tail_bytes: int | None = None) -> list[bytes]:
    try:
        with path.open("rb") as fh:
            if tail_bytes is not None:
                fh.seek(max(0, path.stat().st_size - tail_bytes))
            return fh.read().splitlines()
    except OSError:
        return []
