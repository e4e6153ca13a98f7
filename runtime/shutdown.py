"""A clean stop on SIGTERM and the first Ctrl-C; exit 75 when the stop cannot finish.

SIGTERM and SIGINT set the :class:`Shutdown` instead of raising inside Bytewax's run loop: the
inputs end, the epoch completes, the sinks commit, exit 0; a second Ctrl-C interrupts at once.
Retry loops blocked by an outage keep trying for ``grace`` seconds, then exit 75; so does a stop
still running ``grace`` + :data:`DEADLINE_MARGIN` later. A stop the job asks for itself
(:meth:`Shutdown.restart`), or one that left work undone, exits 75 at its end.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

from runtime.logs import log_event

logger = logging.getLogger(__name__)

DEADLINE_MARGIN = 5.0
"""Seconds past the grace after which a stop still running ends the process (20 + 5 < 30 s)."""

EXIT_RESTART = 75
"""``EX_TEMPFAIL``: start the process again, nothing is lost."""


class Shutdown:
    """The process's stop request."""

    def __init__(self, grace: float = 20.0) -> None:
        self._event = threading.Event()
        self.signal: str | None = None
        self.grace = grace
        self._requested_at: float | None = None
        self._restart: str | None = None
        self._unfinished: list[str] = []

    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self._event.is_set()

    def request(self, reason: str) -> None:
        """Ask every input to end (idempotent)."""
        if not self._event.is_set():
            self.signal, self._requested_at = reason, time.monotonic()
            self._event.set()
            log_event(logger, "shutdown-requested", logging.WARNING, reason=reason)

    def restart(self, reason: str) -> None:
        """A clean stop after which the process must be started again (:meth:`finish`: 75)."""
        if self._restart is None:
            self._restart = reason
        self.request(reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested (or ``timeout``); True if it was."""
        return self._event.wait(timeout)

    def retry_sleep(self, seconds: float) -> None:
        """A retry loop's back-off: cut short by a stop, ending the process past its grace."""
        requested_at = self._requested_at
        if requested_at is None:
            self._event.wait(seconds)
            return
        left = requested_at + self.grace - time.monotonic()
        if left <= 0:
            abandon(f"an outage outlasted the stop's {self.grace:g} s grace")
        time.sleep(min(seconds, left))

    def time_left(self, timeout: float) -> float:
        """``timeout``, or less: what is left of the stop's grace once a stop was requested."""
        requested_at = self._requested_at
        if requested_at is None:
            return timeout
        return max(0.0, min(timeout, requested_at + self.grace - time.monotonic()))

    def unfinished(self, what: str) -> None:
        """Record that the stop leaves ``what`` to the next start (:meth:`finish`: 75)."""
        self._unfinished.append(what)

    def finish(self) -> None:
        """The end of a run: exit 75 now if a restart was asked for or work was left undone.

        Every stop ends with one line: ``stopped`` (a clean stop), ``stopped-for-restart`` or
        ``stopped-during-outage``.
        """
        if self._unfinished:
            abandon("; ".join(self._unfinished))
        if self._restart is not None:
            log_event(logger, "stopped-for-restart", logging.WARNING, reason=self._restart,
                      exit_code=EXIT_RESTART)
            _exit_now()
        if self.requested():
            log_event(logger, "stopped", logging.WARNING, reason=self.signal)


def abandon(why: str) -> None:
    """End the process now with exit code 75 (one ``stopped-during-outage`` line, no cleanup)."""
    log_event(logger, "stopped-during-outage", logging.ERROR, why=why, exit_code=EXIT_RESTART,
              unfinished="the batch in flight is read again at the next start; committed"
                         " outbox rows are published then")
    _exit_now()


def _exit_now() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_RESTART)


def install_signal_handlers(stopping: Shutdown) -> bool:
    """SIGTERM and SIGINT -> ``stopping``, and the deadline after its grace; False off main."""
    if threading.current_thread() is not threading.main_thread():
        return False

    def handle(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if stopping.requested():  # the second Ctrl-C: stop at once
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            print("stopping: finishing the batch in flight (Ctrl-C again to abort)",
                  file=sys.stderr, flush=True)
        stopping.request(signal.Signals(signum).name)

    def deadline() -> None:
        stopping.wait()
        limit = stopping.grace + DEADLINE_MARGIN
        time.sleep(limit)
        abandon(f"the stop did not end within {limit:g} s: a call that does not return (a"
                " database or broker that accepts connections and does not answer)")

    # Started here, not in the handler: a thread started from a signal handler can deadlock.
    threading.Thread(target=deadline, name="stop-deadline", daemon=True).start()
    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return True
