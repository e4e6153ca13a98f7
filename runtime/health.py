"""Process health: running, paused waiting for a dependency, stalled or dead; served over HTTP.

``/livez``: 200 while the process makes progress or is paused on an outage (no reason to
restart), 503 after ``stall_seconds`` without progress while not paused. ``/readyz``: 200 only
while running; 503 while any waiter (a sink partition, a worker's input, the outbox publisher)
is paused or any component reports itself stalled, the reason in the JSON body. ``/metrics``
serves the Prometheus registry.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runtime.metrics import PAUSED_SECONDS


@dataclass(frozen=True)
class HealthSnapshot:
    """What ``/livez`` and ``/readyz`` report."""

    state: str  # "running" | "paused" | "stalled" | "dead"
    dependency: str | None
    paused_since: float | None
    attempt: int
    last_error: str | None
    seconds_since_progress: float
    stalled: tuple[tuple[str, str], ...] = ()
    waiting: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> bytes:
        """The JSON body of ``/livez`` and ``/readyz``."""
        since = self.paused_since
        return orjson.dumps({
            "state": self.state, "dependency": self.dependency,
            "paused_since": None if since is None else time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)),
            "attempt": self.attempt, "last_error": self.last_error,
            "seconds_since_progress": round(self.seconds_since_progress, 3),
            "stalled": dict(self.stalled), "waiting": dict(self.waiting),
        })


class Health:
    """Thread-safe health state shared by every step of one process."""

    def __init__(self, stall_seconds: float = 300.0) -> None:
        self._lock, self._stall_seconds = threading.Lock(), stall_seconds
        # waiter -> (dependency, wall time it began, attempt, error, monotonic time it began)
        self._paused: dict[str, tuple[str, float, int, str, float]] = {}
        self._stalled: dict[str, str] = {}
        self._last_progress = time.monotonic()

    def beat(self) -> None:
        """Record progress (a poll, a batch, an idle loop): the process is alive."""
        self._last_progress = time.monotonic()

    def paused(self, dependency: str, attempt: int, error: str, *, waiter: str) -> None:
        """Record that ``waiter`` waits for ``dependency``; the pause keeps the time it began."""
        with self._lock:
            began = self._paused.get(waiter)
            since, since_monotonic = ((time.time(), time.monotonic()) if began is None
                                      else (began[1], began[4]))
            self._paused[waiter] = (dependency, since, attempt, error, since_monotonic)
        self.beat()
        self.refresh_gauge()

    def resumed(self, *, waiter: str) -> None:
        """Record that ``waiter``'s dependency answers again (harmless if it never paused)."""
        with self._lock:
            self._paused.pop(waiter, None)
        self.beat()
        self.refresh_gauge()

    def stalled(self, component: str, reason: str) -> None:
        """Record that ``component`` cannot make progress (``/readyz`` 503 with ``reason``)."""
        with self._lock:
            self._stalled[component] = reason

    def unstalled(self, component: str) -> None:
        """Record that ``component`` makes progress again."""
        with self._lock:
            self._stalled.pop(component, None)

    def snapshot(self) -> HealthSnapshot:
        """The current state."""
        with self._lock:
            paused = dict(self._paused)
            stalled = tuple(sorted(self._stalled.items()))
        idle = time.monotonic() - self._last_progress
        if paused:
            dependency, since, attempt, error, _ = min(paused.values(), key=lambda v: v[4])
            waiting = tuple(sorted((waiter, v[0]) for waiter, v in paused.items()))
            return HealthSnapshot("paused", dependency, since, attempt, error, idle, stalled,
                                  waiting)
        if idle > self._stall_seconds:
            return HealthSnapshot("dead", None, None, 0, None, idle, stalled)
        state = "stalled" if stalled else "running"
        return HealthSnapshot(state, None, None, 0, None, idle, stalled)

    def refresh_gauge(self) -> None:
        """Bring the paused-seconds gauge up to date (monotonic: a wall-clock step is no pause)."""
        with self._lock:
            since = min((v[4] for v in self._paused.values()), default=None)
        PAUSED_SECONDS.set(0 if since is None else time.monotonic() - since)


class _Handler(BaseHTTPRequestHandler):
    health: ClassVar[Health]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self.health.refresh_gauge()
            self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
            return
        snap = self.health.snapshot()
        if path == "/livez":
            self._send(503 if snap.state == "dead" else 200, snap.as_json(), "application/json")
        elif path == "/readyz":
            self._send(200 if snap.state == "running" else 503, snap.as_json(), "application/json")
        else:
            self._send(404, b'{"error":"not found"}', "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Silence the per-request access log."""


def serve_http(host: str, port: int, health: Health) -> int | None:
    """Serve ``health`` and the metrics on a thread named ``http``; the port (None: port 0)."""
    if port == 0:
        return None
    handler = type("HealthHandler", (_Handler,), {"health": health})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return int(server.server_address[1])
