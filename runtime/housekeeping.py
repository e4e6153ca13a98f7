"""The process's one housekeeping thread: periodic tasks, each at its own interval.

The composition root registers every periodic task and starts the thread once. A task is a
short call with its own time-outs; an exception it raises is logged (``housekeeping-task-failed``,
at most once a minute per task) and counted, and the task runs again at its next time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from runtime.logs import log_event
from runtime.metrics import BACKGROUND_ERRORS

logger = logging.getLogger(__name__)


@dataclass
class _Task:
    name: str
    interval: float
    call: Callable[[], object]
    due: float = 0.0
    logged_at: float = float("-inf")


class Housekeeping:
    """Runs registered tasks on one daemon thread named ``housekeeping``."""

    def __init__(self) -> None:
        self._tasks: list[_Task] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def every(self, seconds: float, name: str, call: Callable[[], object]) -> None:
        """Run ``call`` every ``seconds`` (the first run ``seconds`` after :meth:`start`)."""
        if seconds > 0:
            BACKGROUND_ERRORS.labels(task=name)  # the series exists (at 0) before any failure
            self._tasks.append(_Task(name, seconds, call, time.monotonic() + seconds))

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="housekeeping", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, waiting for the task under way at most ``timeout`` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run_due(self, now: float) -> float:
        """Run the tasks due at ``now`` (monotonic); the next due time."""
        for task in self._tasks:
            if task.due <= now:
                task.due = now + task.interval
                try:
                    task.call()
                except Exception as exc:  # noqa: BLE001 - logged and counted; runs again later
                    BACKGROUND_ERRORS.labels(task=task.name).inc()
                    if now - task.logged_at >= 60.0:
                        task.logged_at = now
                        log_event(logger, "housekeeping-task-failed", logging.ERROR,
                                  task=task.name, error=type(exc).__name__, detail=str(exc)[:300])
        return min((task.due for task in self._tasks), default=now + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            due = self.run_due(time.monotonic())
            self._stop.wait(max(0.0, due - time.monotonic()))
