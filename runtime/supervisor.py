"""Supervised background loops: an unexpected exception never kills a thread of ours silently.

:class:`SupervisedThread` runs a loop body in a daemon thread. When the body raises, the
exception is logged with its traceback (``background-loop-crashed``), counted in
``user_activity_background_restarts_total{thread}``, and the body is started again after an
exponential back-off (1 s -> 60 s with jitter by default; the attempt count resets once a run
lasted a minute). The body gets the stop event and must return soon after it is set; ``stop()``
sets it and joins the thread. Nothing is retried inside the body by the supervisor: the body
keeps its own guarantees (e.g. the outbox publisher's rows stay in the table until published).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Self

from runtime.backoff import Backoff
from runtime.metrics import BACKGROUND_RESTARTS

logger = logging.getLogger(__name__)

_HEALTHY_RUN_SECONDS = 60.0
"""A run that lasted this long resets the back-off: the next crash restarts after 1 s again."""


def report_crash(thread: str, exc: BaseException, attempt: int, delay: float) -> None:
    """Log ``exc`` with its traceback and count the restart of ``thread``."""
    BACKGROUND_RESTARTS.labels(thread=thread).inc()
    with contextlib.suppress(Exception):  # reporting must never kill the supervisor
        logger.error("background-loop-crashed", exc_info=(type(exc), exc, exc.__traceback__),
                     extra={"loop": thread, "error": type(exc).__name__, "attempt": attempt,
                            "restart_in_s": round(delay, 2)})


class SupervisedThread:
    """Runs ``body(stop)`` in a daemon thread named ``name``, restarting it after a crash."""

    def __init__(self, name: str, body: Callable[[threading.Event], None],
                 backoff: Backoff | None = None) -> None:
        self.name = name
        self._body = body
        self._backoff = backoff or Backoff()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.crashes = 0
        BACKGROUND_RESTARTS.labels(thread=name)  # the series exists (at 0) before any crash

    def start(self) -> Self:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    @property
    def stopping(self) -> threading.Event:
        """The event the body watches."""
        return self._stop

    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the body to return and join the thread (at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._body(self._stop)
            except Exception as exc:  # noqa: BLE001 - the point: log, count, restart
                if time.monotonic() - started >= _HEALTHY_RUN_SECONDS:
                    attempt = 0
                delay = self._backoff.delay(attempt)
                attempt += 1
                self.crashes += 1
                report_crash(self.name, exc, attempt, delay)
                self._stop.wait(delay)
            else:
                return
