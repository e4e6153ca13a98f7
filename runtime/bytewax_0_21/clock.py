"""A step back of the wall clock by more than 30 s ends the process with exit 75.

Bytewax 0.21 arms its timers in wall time: after a step back of S seconds nothing is polled or
snapshotted for S seconds; a fresh start arms them from the new clock. Each step of a second or
more is logged (``wall-clock-stepped``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from runtime.logs import log_event

logger = logging.getLogger(__name__)

RESTART_AFTER_STEP_BACK_SECONDS = 30.0
STEP_SECONDS = 1.0


class ClockCheck:
    """Compares ``time.time() - time.monotonic()`` at each :meth:`check` (once a second)."""

    def __init__(self, restart: Callable[[str], None],
                 clock: Callable[[], float] = lambda: time.time() - time.monotonic()) -> None:
        self._restart, self._clock = restart, clock
        self._last = self._highest = clock()

    def check(self) -> None:
        """Log a step of the wall clock; restart on a fall of the offset past the bound."""
        offset = self._clock()
        step = offset - self._last
        self._last = offset
        if abs(step) >= STEP_SECONDS:
            log_event(logger, "wall-clock-stepped", logging.WARNING, step_s=round(step, 3))
        self._highest = max(self._highest, offset)
        fall = self._highest - offset
        if fall > RESTART_AFTER_STEP_BACK_SECONDS:
            self._restart(f"the wall clock stepped back {fall:.0f} s: Bytewax's timers wait"
                          " that long; a new start arms them from the new clock")
