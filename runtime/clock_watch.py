"""A step of the wall clock is said; a step back of more than 30 s restarts the process.

A step: an NTP step, a VM resumed after a pause, while the job runs.
Bytewax 0.21 keeps its timers in wall time (``datetime`` compared with its own ``Utc::now()``):
an input partition's ``next_awake``, the end of a snapshot interval (``-s``), a stateful step's
``notify_at``. Our code returns them as wall times, and Bytewax turns ``due - now`` into a
monotonic delay. So when the clock steps back by S seconds, every idle input partition (its next
poll 20 ms ahead when the step landed) is polled again only S seconds later, even if the clock
is put right meanwhile; no epoch ends, so nothing is snapshotted; and held sign-ins and dedup
expiries wait S longer. Measured (a favorites job on real Kafka and PostgreSQL, its clock stepped
back 1 h while idle): 200 events produced after the step, none recorded in 60 s, ``/readyz`` 200
and ``/livez`` 200 (silent until the liveness probe's 300 s, and for ever if another partition
still beats), ``input_records_behind`` 0.

None of those timers can be moved from outside Bytewax, but a fresh start arms them all from the
new clock. So this watch compares ``time.time() - time.monotonic()`` every
:data:`CHECK_SECONDS`: a change of at least :data:`STEP_SECONDS` is a step (a slew by NTP moves it
by 0.5 ms a second at most). Each step is logged (``wall-clock-stepped``, WARNING). A fall of
more than :data:`RESTART_AFTER_STEP_BACK_SECONDS` below the highest offset of the last
:data:`WINDOW_SECONDS` (one step back, or several that add up) ends the process at once with
exit code 75
(:func:`runtime.shutdown.abandon`: a SIGKILL with a reason, which the recovery design survives:
the input since the last snapshot is read again and the idempotent writes make that harmless).
A clean stop would wait for the stalled partitions' next poll. A shorter step back is waited out
(a stall of at most that long). A step forward only fires the timers early: dedup ids are
forgotten early and held sign-ins released early, both decided by the database as any late
redelivery or sign-in is.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from runtime.logs import log_event
from runtime.periodic import Periodic
from runtime.shutdown import abandon

logger = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
"""How often the clocks are compared."""

STEP_SECONDS = 1.0
"""A change of the wall clock against the monotonic one of at least this much is a step."""

RESTART_AFTER_STEP_BACK_SECONDS = 30.0
"""A step back longer than this ends the process (exit 75) to be started again (module doc)."""


WINDOW_SECONDS = 600.0
"""A step back is measured from the highest offset of this long: several steps back in a row
add up (NTP's slew moves the offset by at most 0.3 s in this time)."""

_READ_SPREAD = 0.05
"""Readings whose two monotonic reads are further apart are taken again (module doc)."""


def wall_offset() -> float:
    """The wall clock minus the monotonic clock, in seconds (constant while no step happens).

    Read between two monotonic reads, and again when they are more than 50 ms apart: a thread
    preempted between the reads (a busy machine, the GIL) would otherwise see a step of the
    delay, back and then forward.
    """
    for _ in range(5):
        before = time.monotonic()
        wall = time.time()
        after = time.monotonic()
        if after - before <= _READ_SPREAD:
            break
    return wall - (before + after) / 2


class ClockWatch(Periodic):
    """Says each step of the wall clock; ends the process on a long step back (module doc)."""

    def __init__(self, *, offset: Callable[[], float] = wall_offset,
                 on_step_back: Callable[[str], None] = abandon,
                 interval: float = CHECK_SECONDS) -> None:
        super().__init__(interval, "clock-watch")
        self._offset = offset
        self._on_step_back = on_step_back
        self._last = offset()
        # (tick number, offset) with decreasing offsets: the front is the window's highest
        self._highest: collections.deque[tuple[int, float]] = collections.deque([(0, self._last)])
        self._ticks = 0
        self._window_ticks = max(1, round(WINDOW_SECONDS / interval))

    def tick(self) -> bool:
        """Compare the clocks once; True: keep watching."""
        now = self._offset()
        step, self._last = now - self._last, now
        back = self._back_from_highest(now)
        restart = back > RESTART_AFTER_STEP_BACK_SECONDS
        if abs(step) < STEP_SECONDS and not restart:
            return True
        step = -back if restart else step
        log_event(
            logger, "wall-clock-stepped", logging.WARNING, step_s=round(step, 3),
            consequence="the process ends (exit 75) to be started again: Bytewax's input"
                        " wake-ups, snapshot interval and timers would wait for the clock"
                        if restart else
                        "idle inputs and timers wait that long" if step < 0 else
                        "timers fire early (dedup, held sign-ins): the database decides")
        if restart:
            self._on_step_back(f"the wall clock stepped back {-step:.0f} s")
        return True

    def _back_from_highest(self, offset: float) -> float:
        """How far ``offset`` is below the highest offset of the window (a sliding maximum)."""
        self._ticks += 1
        highest = self._highest
        while highest and highest[-1][1] <= offset:
            highest.pop()
        highest.append((self._ticks, offset))
        while highest[0][0] <= self._ticks - self._window_ticks:
            highest.popleft()
        return highest[0][1] - offset
