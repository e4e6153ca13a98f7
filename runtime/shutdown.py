"""A clean stop on SIGTERM (Kubernetes) and on the first Ctrl-C: stop reading, finish, flush.

:func:`install_signal_handlers` (called once by a flow's entry point, on the main thread) makes
SIGTERM and SIGINT set :data:`SHUTDOWN` instead of killing the process or raising
``KeyboardInterrupt`` inside Bytewax's run loop (which ends in a Rust panic with a backtrace and
leaves the batch in flight to the next start). The Kafka input partitions check the flag before
each poll and end (``StopIteration``); Bytewax then completes the epoch, the sinks commit what
they hold and ``close()`` (the outbox publisher publishes what was offered, the producers flush),
and the process exits 0. A second SIGINT restores Python's default: an immediate interrupt.
What a stop cannot finish is not lost: offsets only advance in snapshots taken after commits.

A stop during an outage cannot commit or publish, and Kubernetes kills the pod
``terminationGracePeriodSeconds`` (30 s) after SIGTERM. So the retry loops sleep with
:meth:`Shutdown.retry_sleep`: a stop request wakes them (one more attempt at once), and once the
request is ``grace`` seconds old (``USER_ACTIVITY_STOP_GRACE_SECONDS``, 20 s) a retry that still
fails ends the process (:func:`abandon`): one ``stopped-during-outage`` line, exit code 75
(``EX_TEMPFAIL``). That is a SIGKILL with a reason: the batch in flight was not committed and its
records are read again at the next start; committed outbox rows are published then. The waits
of the stop itself (closing consumers, flushing producers, the outbox's final drain) are bounded
by the same deadline (:meth:`Shutdown.time_left`), and a stop that had to leave work behind
(:meth:`Shutdown.unfinished`) also exits 75 once Bytewax has returned.

A call that never returns cannot reach a retry loop: a database or broker that accepts
connections and does not answer (a frozen server, storage that hangs) keeps the worker in its
query. Measured with a PostgreSQL stopped by SIGSTOP: SIGTERM, then nothing until the kill at
40 s. So a process that installed the signal handlers ends itself :data:`DEADLINE_MARGIN`
seconds after the grace (:func:`abandon`, 75: a SIGKILL with a reason), before Kubernetes' kill.

The job may also stop itself to be started again (:meth:`Shutdown.restart`: an input topic
gained partitions, :mod:`sources.topic`): a clean stop like SIGTERM's, then exit
code 75, which every supervisor restarts.
"""

from __future__ import annotations

import atexit
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
"""Seconds past the grace after which a process with the signal handlers ends a stop that is
still running (module doc): 20 + 5 s, within Kubernetes' 30 s."""

STOPPED_DURING_OUTAGE = 75
"""The exit code of a stop that an outage kept from finishing (``EX_TEMPFAIL``), and of a clean
stop the job asked for to be started again: start it again, nothing is lost."""


class Shutdown:
    """The process-wide stop request."""

    def __init__(self, grace: float = 20.0) -> None:
        self._event = threading.Event()
        self.signal: str | None = None
        self.grace = grace
        """Seconds a stop waits for an outage to end (module doc)."""
        self._requested_at: float | None = None
        self._unfinished: list[str] = []

    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self._event.is_set()

    def request(self, reason: str) -> None:
        """Ask every input to end (idempotent)."""
        if not self._event.is_set():
            self.signal = reason
            self._requested_at = time.monotonic()
            self._event.set()
            log_event(logger, "shutdown-requested", logging.WARNING, reason=reason)

    def restart(self, reason: str) -> None:
        """Ask for a clean stop after which the process must be started again (exit code 75)."""
        if not self.requested():
            atexit.register(_exit_for_restart, reason)
        self.request(reason)

    def reset(self) -> None:
        """Forget a stop request (for tests that request one in their own process)."""
        self._event.clear()
        self.signal = self._requested_at = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested (or ``timeout``); True if it was."""
        return self._event.wait(timeout)

    def retry_sleep(self, seconds: float) -> None:
        """A retry loop's back-off: cut short by a stop request, and never past its grace.

        Called after a failed attempt: once the stop was requested ``grace`` seconds ago, the
        outage has outlasted the stop and the process ends (:func:`abandon`).
        """
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
        """Record that the stop leaves ``what`` to the next start: the exit code is 75, not 0."""
        if not self._unfinished:
            atexit.register(lambda: abandon("; ".join(self._unfinished)))
        self._unfinished.append(what)


SHUTDOWN = Shutdown()
"""This process's stop request."""


def abandon(why: str) -> None:
    """End the process now, with :data:`STOPPED_DURING_OUTAGE`: what is unfinished is not lost.

    Logs one ``stopped-during-outage`` line and flushes the log handlers first; no cleanup runs
    (like a SIGKILL, which the recovery design already survives).
    """
    log_event(logger, "stopped-during-outage", logging.ERROR, why=why,
              exit_code=STOPPED_DURING_OUTAGE,
              unfinished="the batch in flight is read again at the next start; committed"
                         " outbox rows are published then")
    _exit_now()


def _exit_for_restart(reason: str) -> None:
    """The end of a clean stop :meth:`Shutdown.restart` asked for (an ``atexit`` hook)."""
    log_event(logger, "stopped-for-restart", logging.WARNING, reason=reason,
              exit_code=STOPPED_DURING_OUTAGE)
    _exit_now()


def _exit_now() -> None:
    """Flush the log handlers, then end the process with :data:`STOPPED_DURING_OUTAGE`."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(STOPPED_DURING_OUTAGE)


def _deadline() -> None:
    """End the process :data:`DEADLINE_MARGIN` s after a stop's grace if it still runs."""
    SHUTDOWN.wait()
    limit = SHUTDOWN.grace + DEADLINE_MARGIN
    time.sleep(limit)
    abandon(f"the stop did not end within {limit:g} s: a call that does not return (a database"
            " or broker that accepts connections and does not answer)")


def _handle(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        if SHUTDOWN.requested():  # the second Ctrl-C: stop at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        print("stopping: finishing the batch in flight (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)
    SHUTDOWN.request(name)


def install_signal_handlers(grace: float = 20.0) -> bool:
    """SIGTERM and SIGINT -> :data:`SHUTDOWN` (with ``grace`` and the deadline after it).

    False off the main thread (nothing installed).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    SHUTDOWN.grace = grace
    # Started here, not in the handler: a thread started from a signal handler can deadlock on
    # threading's own lock when the signal lands while the main thread starts a thread.
    threading.Thread(target=_deadline, name="stop-deadline", daemon=True).start()
    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    return True
