"""A clean stop on SIGTERM (Kubernetes) and on the first Ctrl-C: stop reading, finish, flush.

:func:`install_signal_handlers` (called once by a flow's entry point, on the main thread) makes
SIGTERM and SIGINT set :data:`SHUTDOWN` instead of killing the process or raising
``KeyboardInterrupt`` inside Bytewax's run loop (which ends in a Rust panic with a backtrace and
leaves the batch in flight to the next start). The Kafka input partitions check the flag before
each poll and end (``StopIteration``); Bytewax then completes the epoch, the sinks commit what
they hold and ``close()`` (the outbox publisher publishes what was offered, the producers flush),
and the process exits 0. A second SIGINT restores Python's default: an immediate interrupt.
What a stop cannot finish is not lost: offsets only advance in snapshots taken after commits.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from runtime.logs import log_event

logger = logging.getLogger(__name__)


class Shutdown:
    """The process-wide stop request."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: str | None = None

    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self._event.is_set()

    def request(self, reason: str) -> None:
        """Ask every input to end (idempotent)."""
        if not self._event.is_set():
            self.signal = reason
            self._event.set()
            log_event(logger, "shutdown-requested", logging.WARNING, reason=reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested (or ``timeout``); True if it was."""
        return self._event.wait(timeout)


SHUTDOWN = Shutdown()
"""This process's stop request."""


def _handle(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        if SHUTDOWN.requested():  # the second Ctrl-C: stop at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        print("stopping: finishing the batch in flight (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)
    SHUTDOWN.request(name)


def install_signal_handlers() -> bool:
    """SIGTERM and SIGINT -> :data:`SHUTDOWN`; False (nothing done) off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _handle)
    signal.signal(signal.SIGINT, _handle)
    return True
