"""The wall clock's watch (runtime/clock_watch.py), its clocks driven by the test."""

from __future__ import annotations

import time

import pytest

from runtime import clock_watch
from runtime.clock_watch import RESTART_AFTER_STEP_BACK_SECONDS, WINDOW_SECONDS, ClockWatch


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


def test_steps_back_in_a_row_add_up() -> None:
    """Three steps back of 20 s, a check apart: 40 s below the highest after the second."""
    clock, ended = Clock(), list[str]()
    watch = _watch(clock, ended)
    clock.offset -= 20
    watch.tick()
    assert ended == []
    clock.offset -= 20
    watch.tick()
    assert ended == ["the wall clock stepped back 40 s"]


def test_a_step_forward_put_right_later_restarts() -> None:
    """An hour ahead for a while, then put right: the timers armed meanwhile are an hour out."""
    clock, ended = Clock(), list[str]()
    watch = _watch(clock, ended)
    clock.offset += 3600
    watch.tick()
    for _ in range(100):
        watch.tick()
    clock.offset -= 3600
    watch.tick()
    assert ended == ["the wall clock stepped back 3600 s"]


def test_a_step_back_older_than_the_window_is_forgotten() -> None:
    """Steps back of 20 s an hour apart (each waited out) never add up."""
    clock, ended = Clock(), list[str]()
    watch = _watch(clock, ended)
    for _ in range(3):
        clock.offset -= 20
        for _ in range(int(WINDOW_SECONDS) + 1):
            watch.tick()
    assert ended == []


def test_the_offset_is_read_again_when_the_thread_was_held_between_its_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader held 2 s between its two monotonic reads would see a step of 2 s."""
    monotonic = iter([100.0, 102.0, 103.0, 103.001])  # held once, then a quick reading
    monkeypatch.setattr(time, "monotonic", lambda: next(monotonic))
    monkeypatch.setattr(time, "time", lambda: 1_000.0)
    assert clock_watch.wall_offset() == pytest.approx(1_000.0 - 103.0005)
