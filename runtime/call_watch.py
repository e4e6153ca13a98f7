"""Calls to a dependency in flight: one that never returns is said, not silent.

A server that accepts and acknowledges but never answers holds a call where no timeout of ours
can fire. Its processes may be stopped (a paused VM, SIGSTOP), or its storage may hang (a commit
waiting for a WAL flush that never ends). The server's statement timeout needs the server, and
its kernel answers our TCP keepalives. Before this watch, such a call showed nothing: ``/readyz``
said running until the liveness probe's ``stall_seconds`` (300 s) ran out.

Each connection's waits are wrapped in a :class:`Watched` (``with watched: ...``). A call in
flight longer than its ``slow_after`` seconds is said by the watch thread:

- the waiter (``<name>: call``) is paused on the dependency, so ``/readyz`` is 503 naming it, the
  paused-seconds gauge counts (``UserActivityStreamPausedTooLong``), and ``/livez`` stays 200
  (restarting the pod does not make a frozen server answer), until the call has lasted the
  liveness limit (``Health.stall_seconds``, 300 s): then the pause is withdrawn and liveness
  judges as it did before this watch (no progress: ``/livez`` 503, the pod restarted), since a
  connection the OS cannot see dead (keepalives off) ends only that way;
- a ``dependency-not-answering`` WARNING is logged, and again every ``REPEAT_SECONDS`` while the
  call lasts.

When the call returns (or fails), the pause ends and ``dependency-answered`` says how long it
took. A call that returns within ``slow_after`` costs two attribute writes and one uncontended
lock, about 0.3 µs.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from types import TracebackType

from runtime.health import HEALTH
from runtime.logs import log_event
from runtime.periodic import Periodic

logger = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
"""How often the watch thread looks at the calls in flight."""

REPEAT_SECONDS = 60.0
"""How often a call that still has no answer is said again."""


class Watched:
    """The calls of one connection (one at a time: a connection belongs to one thread).

    ``with watched:`` around each blocking call. Not re-entrant.
    """

    __slots__ = ("__weakref__", "_lock", "_said_at", "_started", "dependency", "name",
                 "slow_after")

    def __init__(self, name: str, dependency: str, slow_after: float) -> None:
        if slow_after <= 0:
            raise ValueError(f"slow_after must be > 0, got {slow_after}")
        self.name = name
        self.dependency = dependency
        self.slow_after = slow_after
        self._lock = threading.Lock()
        self._started: float | None = None
        self._said_at: float | None = None  # when it was last said not answering
        _watch().add(self)

    def __enter__(self) -> None:
        self._started = time.monotonic()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            started, self._started = self._started, None
            said, self._said_at = self._said_at, None
        if said is not None and started is not None:
            HEALTH.resumed(waiter=self.waiter)
            log_event(logger, "dependency-answered", logging.INFO, waiter=self.name,
                      dependency=self.dependency,
                      seconds=round(time.monotonic() - started, 1),
                      error=None if exc_type is None else exc_type.__name__)

    @property
    def waiter(self) -> str:
        """Its name as a health waiter."""
        return f"{self.name}: call"

    def check(self, now: float) -> None:
        """Say the call in flight if it has lasted past ``slow_after`` (the watch thread)."""
        with self._lock:
            started = self._started
            if started is None or now - started <= self.slow_after:
                return
            seconds = now - started
            if seconds > HEALTH.stall_seconds:  # liveness decides from here (module doc)
                HEALTH.resumed(waiter=self.waiter, progress=False)
            else:
                HEALTH.paused(self.dependency, 0, f"no answer for {seconds:.0f}s",
                              waiter=self.waiter, progress=False)
            said = self._said_at
            if said is not None and now - said < REPEAT_SECONDS:
                return
            self._said_at = now
        log_event(logger, "dependency-not-answering", logging.WARNING, waiter=self.name,
                  dependency=self.dependency, seconds=round(seconds, 1),
                  slow_after_s=self.slow_after)


class _CallWatch(Periodic):
    """The thread that checks every :class:`Watched` of the process."""

    def __init__(self) -> None:
        super().__init__(CHECK_SECONDS, "call-watch")
        self._watched: weakref.WeakSet[Watched] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, watched: Watched) -> None:
        with self._lock:
            self._watched.add(watched)

    def tick(self) -> bool:
        now = time.monotonic()
        with self._lock:
            watched = list(self._watched)
        for one in watched:
            one.check(now)
        return True


_WATCH: _CallWatch | None = None
_WATCH_LOCK = threading.Lock()


def _watch() -> _CallWatch:
    """The process's watch, its thread started on first use."""
    global _WATCH  # noqa: PLW0603
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = _CallWatch().start()
        return _WATCH
