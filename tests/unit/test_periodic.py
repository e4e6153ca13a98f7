"""Periodic tasks survive a failed tick: logged with its traceback, counted."""

from __future__ import annotations

import time

from runtime.metrics import BACKGROUND_RESTARTS
from runtime.periodic import Periodic


def _restarts(name: str) -> float:
    return float(BACKGROUND_RESTARTS.labels(thread=name)._value.get())


class _Flaky(Periodic):
    def __init__(self) -> None:
        super().__init__(0.01, "test-flaky-periodic")
        self.ticks = 0

    def tick(self) -> bool:
        self.ticks += 1
        if self.ticks == 2:
            raise RuntimeError("one bad tick")
        return self.ticks < 5


def test_a_periodic_task_keeps_ticking_after_a_failed_tick() -> None:
    flaky = _Flaky().start()
    deadline = time.monotonic() + 5
    while flaky.ticks < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    flaky.stop()
    assert flaky.ticks == 5
    assert _restarts("test-flaky-periodic") == 1
