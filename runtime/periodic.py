"""A daemon thread that runs a task every ``interval`` seconds until stopped.

An exception from a tick is logged with its traceback (``background-loop-crashed``) and
counted (``user_activity_background_restarts_total{thread}``); the next tick runs as planned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from typing import Self

from runtime.metrics import BACKGROUND_RESTARTS

logger = logging.getLogger(__name__)


class Periodic(ABC):
    """Calls :meth:`tick` every ``interval`` seconds in a daemon thread named ``name``.

    ``tick`` returning False ends the thread; ``stop()`` ends it from outside (and joins it).
    """

    def __init__(self, interval: float, name: str) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        BACKGROUND_RESTARTS.labels(thread=name)  # the series exists (at 0) before any crash

    @abstractmethod
    def tick(self) -> bool:
        """One run of the task; False when it should never run again."""

    def start(self) -> Self:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (if it was started)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                if not self.tick():
                    return
            except Exception as exc:
                failures += 1
                BACKGROUND_RESTARTS.labels(thread=self._thread.name).inc()
                with contextlib.suppress(Exception):  # reporting must never end the thread
                    logger.error("background-loop-crashed", exc_info=exc, extra={
                        "loop": self._thread.name, "error": type(exc).__name__,
                        "attempt": failures})
