"""Run the real favorites job as a subprocess, the way Kubernetes runs it, for chaos tests.

``FavoritesJob`` starts ``python -m bytewax.run dataflows.favorite_actions:flow -r DIR -s 1 -b 10``
with the ``USER_ACTIVITY_*`` environment of a :class:`~runtime.settings.Settings` object (tailing,
with the health/metrics server on a free port), against a recovery directory made once with
``python -m cli init-recovery DIR --partitions 1``. It can SIGKILL the job and start it again
on the same recovery directory, scrape ``/metrics``, ``/livez`` and ``/readyz``, and read the
job's log (one file per start).

Nothing outlives a test: each job runs in its own process group and under
``setpriv --pdeathsig KILL`` (it dies with the thread that started it, even if pytest itself is
killed), and :class:`JobSupervisor` kills, by process group id, every job still running when the
test ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import orjson
from pydantic import SecretStr

from runtime.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parent.parent
FLOW = "dataflows.favorite_actions:flow"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as the ``USER_ACTIVITY_*`` variables that reproduce it (secrets in clear)."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, SecretStr):
            text = value.get_secret_value()
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, Enum):
            text = str(value.value)
        else:
            text = str(value)
        env[f"{ENV_PREFIX}{name.upper()}"] = text
    return env


def base_env() -> dict[str, str]:
    """The current environment minus service or Bytewax settings that could leak in."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith((ENV_PREFIX, "BYTEWAX_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_base_env = base_env  # the name tests/e2e/test_multi_process.py imports


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next((line for line in status.splitlines() if line.startswith("State:")), "")
    return "zombie" not in state.lower()


@dataclass(frozen=True)
class HttpAnswer:
    """One answer of the job's HTTP server."""

    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return orjson.loads(self.body)


class FavoritesJob:
    """The favorites job in a subprocess; start / kill -9 / terminate / restart on one recovery dir.

    ``settings`` are used as given except ``tail`` (forced true) and ``http_port`` (a free port,
    kept across restarts). Each start writes its own log file ``<workdir>/job-<n>.log``.
    """

    def __init__(
        self,
        settings: Settings,
        workdir: Path,
        *,
        snapshot_interval: float = 1,
        backup_interval: float = 10,
    ) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.recovery_dir = workdir / "recovery"
        self.port = free_port()
        self.settings = settings.model_copy(update={"tail": True, "http_port": self.port})
        self._snapshot_interval = snapshot_interval
        self._backup_interval = backup_interval
        self._proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.log_paths: list[Path] = []
        self.exit_codes: list[int] = []
        self._env = {**base_env(), **settings_env(self.settings)}

    # ---- lifecycle ------------------------------------------------------------------------

    def init_recovery(self) -> None:
        """Create the recovery store (one SQLite partition) unless it already exists."""
        if self.recovery_dir.exists() and any(self.recovery_dir.iterdir()):
            return
        subprocess.run(
            [sys.executable, "-m", "cli", "init-recovery", str(self.recovery_dir),
             "--partitions", "1"],
            cwd=ROOT, env=self._env, check=True, capture_output=True, timeout=60,
        )

    def command(self) -> list[str]:
        """The job's command line (after ``setpriv``)."""
        return [
            sys.executable, "-m", "bytewax.run", FLOW,
            "-r", str(self.recovery_dir),
            "-s", _seconds(self._snapshot_interval),
            "-b", _seconds(self._backup_interval),
        ]

    def start(self, *, wait_http: float = 60.0) -> None:
        """Start the job (recovery dir created on first start); wait until ``/livez`` answers."""
        if self.running:
            raise RuntimeError("the job is already running")
        self.init_recovery()
        log_path = self.workdir / f"job-{len(self.log_paths) + 1}.log"
        self.log_paths.append(log_path)
        with log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--", *self.command()],
                cwd=ROOT,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: kill() reaches every child
            )
        self.pids.append(self._proc.pid)
        if wait_http:
            self.wait_until(lambda: self.get("/livez") is not None, wait_http, "/livez to answer")

    @property
    def running(self) -> bool:
        """True while the current job process has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the job's process group (a crash: no cleanup, no final snapshot) and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:  # alive, so its pid (and group id) is still ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._reap(proc, 30.0)

    def terminate(
        self, timeout: float = 20.0, sig: signal.Signals = signal.SIGTERM
    ) -> int | None:
        """Stop the job as Kubernetes does: ``sig`` (SIGTERM), SIGKILL after ``timeout``.

        Returns the exit code (negative: the signal that ended it). SIGINT makes Bytewax stop
        at the next epoch boundary instead (exit code 1, "signal received").
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        return self._reap(proc, 30.0)

    def restart(self) -> None:
        """SIGKILL the job and start it again on the same recovery directory."""
        self.kill()
        self.start()

    def wait(self, timeout: float) -> int:
        """Wait for the job to exit by itself; its exit code."""
        if self._proc is None:
            raise RuntimeError("the job was never started")
        self._proc.wait(timeout)
        return self._reap(self._proc, 1.0)

    def _reap(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        # Signals go to the process group only while its leader is alive or not yet reaped, so
        # a group id is never reused by then; the job forks no children (checked by
        # ``leftover_pids``).
        code = proc.wait(timeout)
        self.exit_codes.append(code)
        self._proc = None
        return code

    def leftover_pids(self) -> list[int]:
        """Processes of this job still alive: started pids, and any process using its recovery."""
        left = [pid for pid in self.pids if _alive(pid)]
        marker = str(self.recovery_dir).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes() and _alive(int(entry.name)):
                    left.append(int(entry.name))
        return sorted(set(left))

    # ---- HTTP ------------------------------------------------------------------------------

    def get(self, path: str, timeout: float = 2.0) -> HttpAnswer | None:
        """GET ``path`` from the job's HTTP server; None if it does not answer."""
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return HttpAnswer(response.status, response.read())
        except urllib.error.HTTPError as exc:
            return HttpAnswer(exc.code, exc.read())
        except (OSError, ValueError):
            return None

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples, ``name{labels}`` -> value (empty if unreachable)."""
        answer = self.get("/metrics")
        if answer is None or answer.status != 200:
            return {}
        return parse_metrics(answer.body.decode())

    def metric(self, name: str, default: float = 0.0) -> float:
        """One sample by its full name (with labels, as exposed), or ``default``."""
        return self.metrics().get(name, default)

    # ---- logs ------------------------------------------------------------------------------

    def log_events(self, run: int | None = None) -> list[dict[str, Any]]:
        """The JSON log lines of every start (or of start number ``run``, 1-based)."""
        paths = self.log_paths if run is None else [self.log_paths[run - 1]]
        events: list[dict[str, Any]] = []
        for path in paths:
            for line in _read_lines(path):
                with contextlib.suppress(orjson.JSONDecodeError):
                    parsed = orjson.loads(line)
                    if isinstance(parsed, dict):
                        events.append(parsed)
        return events

    def log_tail(self, lines: int = 30) -> str:
        """The end of the latest log without its INFO lines, for failure messages."""
        if not self.log_paths:
            return ""
        kept = [line for line in _read_lines(self.log_paths[-1]) if b'"level":"INFO"' not in line]
        return "\n".join(line.decode(errors="replace") for line in kept[-lines:])

    # ---- helpers ---------------------------------------------------------------------------

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str,
                   interval: float = 0.2) -> float:
        """Poll ``condition`` until true; the seconds it took. Fails if the job exits first."""
        started = time.monotonic()
        while True:
            if condition():
                return time.monotonic() - started
            if self._proc is not None and self._proc.poll() is not None:
                raise AssertionError(
                    f"the job exited ({self._proc.returncode}) while waiting for {what}:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() - started > timeout:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n"
                                     f"{self.log_tail()}")
            time.sleep(interval)


class JobSupervisor:
    """Creates jobs for one test and guarantees none is left running when it closes."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self.jobs: list[FavoritesJob] = []

    def job(self, settings: Settings, name: str = "job", **kwargs: Any) -> FavoritesJob:
        """A new (not yet started) job with its own work directory."""
        job = FavoritesJob(settings, self._workdir / name, **kwargs)
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


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{"name{labels}": value}`` (comments skipped)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            samples[name] = float(value)
    return samples


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _read_lines(path: Path) -> list[bytes]:
    try:
        return path.read_bytes().splitlines()
    except OSError:
        return []
