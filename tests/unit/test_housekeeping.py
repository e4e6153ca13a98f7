"""The housekeeping thread's schedule, and the wall clock's check it runs (no services)."""

from __future__ import annotations

import logging

import pytest

from runtime.bytewax_0_21.clock import ClockCheck
from runtime.housekeeping import Housekeeping


def test_each_task_runs_at_its_own_interval_and_a_failing_one_runs_again() -> None:
    calls: list[str] = []
    housekeeping = Housekeeping()
    housekeeping.every(1.0, "fast", lambda: calls.append("fast"))
    housekeeping.every(3.0, "slow", lambda: calls.append("slow"))
    housekeeping.every(2.0, "failing", lambda: 1 / 0)
    housekeeping.every(0.0, "off", lambda: calls.append("off"))

    start = min(task.due for task in housekeeping._tasks)
    for second in range(7):
        housekeeping.run_due(start + second)

    assert calls.count("fast") == 7 and calls.count("slow") == 2 and "off" not in calls


def test_a_step_back_of_the_wall_clock_past_the_bound_asks_for_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    offsets = iter([1000.0, 1000.0, 990.0, 960.0])
    reasons: list[str] = []
    check = ClockCheck(reasons.append, clock=lambda: next(offsets))

    with caplog.at_level(logging.WARNING):
        check.check()  # unchanged
        check.check()  # 10 s back: said, waited out
        assert reasons == []
        check.check()  # 40 s back in all: restart

    assert len(reasons) == 1 and "40 s" in reasons[0]
    assert [r.getMessage() for r in caplog.records] == ["wall-clock-stepped"] * 2


def test_a_step_forward_is_said_and_never_restarts() -> None:
    offsets = iter([1000.0, 4600.0])
    reasons: list[str] = []
    check = ClockCheck(reasons.append, clock=lambda: next(offsets))

    check.check()

    assert reasons == []
