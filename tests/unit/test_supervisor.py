"""Supervised background loops restart after a crash; periodic tasks survive a failed tick."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.backoff import Backoff
from runtime.metrics import BACKGROUND_RESTARTS
from runtime.periodic import Periodic
from runtime.supervisor import SupervisedThread


def _restarts(name: str) -> float:
    return float(BACKGROUND_RESTARTS.labels(thread=name)._value.get())


def test_a_crashing_loop_is_counted_logged_with_its_traceback_and_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []
    done = threading.Event()

    def body(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) < 3:
            raise ValueError(f"crash {len(runs)}")
        done.set()
        stop.wait()

    supervised = SupervisedThread("test-crashing", body, Backoff(0.01, 0.02)).start()
    assert done.wait(5)
    supervised.stop(5)

    assert len(runs) == 3
    assert supervised.crashes == 2
    assert _restarts("test-crashing") == 2
    crashed = [r for r in caplog.records if r.getMessage() == "background-loop-crashed"]
    assert [str(r.exc_info[1]) for r in crashed if r.exc_info] == ["crash 1", "crash 2"]
    assert not supervised.alive()


def test_a_loop_that_returns_is_not_restarted() -> None:
    runs: list[int] = []
    supervised = SupervisedThread("test-returning", lambda _stop: runs.append(1)).start()
    time.sleep(0.2)
    assert runs == [1]
    assert not supervised.alive()
    assert _restarts("test-returning") == 0


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
