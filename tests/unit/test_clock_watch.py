"""The wall clock's watch (runtime/clock_watch.py), its clocks driven by the test."""

from __future__ import annotations

import pytest

from runtime.clock_watch import RESTART_AFTER_STEP_BACK_SECONDS, ClockWatch


class Clock:
    def __init__(self) -> None:
        self.offset = 1_700_000_000.0

    def __call__(self) -> float:
        return self.offset


def _watch(clock: Clock, ended: list[str]) -> ClockWatch:
    return ClockWatch(offset=clock, on_step_back=ended.append)


def test_a_step_back_of_an_hour_ends_the_process_to_be_started_again(
        caplog: pytest.LogCaptureFixture) -> None:
    clock, ended = Clock(), list[str]()
    watch = _watch(clock, ended)
    assert watch.tick() and not ended
    clock.offset -= 3600
    assert watch.tick()
    assert ended == ["the wall clock stepped back 3600 s"]
    assert "wall-clock-stepped" in caplog.text


@pytest.mark.parametrize("step", [-(RESTART_AFTER_STEP_BACK_SECONDS - 1), -2.0, 3600.0, 0.0004])
def test_a_short_step_back_a_step_forward_or_a_slew_only_logs(step: float) -> None:
    clock, ended = Clock(), list[str]()
    watch = _watch(clock, ended)
    clock.offset += step
    watch.tick()
    clock.offset += 0.0004  # NTP's slew: never a step
    watch.tick()
    assert ended == []


def test_a_step_is_measured_against_the_last_check_not_the_start() -> None:
    clock, ended = Clock(), list[str]()
    watch = _watch(clock, ended)
    for _ in range(3):  # three steps back of 20 s, a check apart: each waited out
        clock.offset -= 20
        watch.tick()
    assert ended == []
