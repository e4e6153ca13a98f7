"""Whether this worker's Kafka inputs are reading a backlog: some partition's last poll was full.

The Kafka source reports every poll (:meth:`BacklogSignal.polled`); a poll that returned as many
records as it asked for means more are waiting. The favorites sink defers a commit only while
that is so (:mod:`dataflows.favorite_actions.sink`): under a backlog the next batch follows at
once and collects the commit, while the last batch of a burst, written after the polls came back
short, commits before ``write_batch`` returns and is logged and published at once, instead of
waiting for the epoch's end. A batch still in flight when the thread's inputs catch up (it may sit
in a sink partition that gets no more items) is finished then: the sink registers
:meth:`BacklogSignal.when_caught_up`, which the source's poll runs on the worker thread.

Kept per thread: a Bytewax worker is one thread that both polls its source partitions and
writes its sink partitions, so a worker whose own inputs are drained never defers, whatever
the other workers of the process are still reading.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class BacklogSignal:
    """Per calling thread, the partitions whose last poll came back full."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _full(self) -> set[tuple[str, int]]:
        full: set[tuple[str, int]] | None = getattr(self._local, "full", None)
        if full is None:
            full = self._local.full = set()
        return full

    def _callbacks(self) -> set[Callable[[], None]]:
        callbacks: set[Callable[[], None]] | None = getattr(self._local, "callbacks", None)
        if callbacks is None:
            callbacks = self._local.callbacks = set()
        return callbacks

    def polled(self, topic: str, partition: int, *, full: bool) -> None:
        """Record the outcome of this thread's poll of ``topic[partition]``."""
        key = (topic, partition)
        if full:
            self._full().add(key)
        else:
            self._forget(key)

    def closed(self, topic: str, partition: int) -> None:
        """``topic[partition]`` is no longer read by this thread."""
        self._forget((topic, partition))

    def reading(self) -> bool:
        """True while some partition this thread polls last came back full."""
        return bool(self._full())

    def when_caught_up(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, on this thread, when its inputs stop reading a backlog.

        Registering the same callback again before then adds nothing.
        """
        self._callbacks().add(callback)

    def _forget(self, key: tuple[str, int]) -> None:
        full = self._full()
        full.discard(key)
        if not full and getattr(self._local, "callbacks", None):
            callbacks, self._local.callbacks = self._local.callbacks, set()
            for callback in callbacks:
                callback()


BACKLOG = BacklogSignal()
"""This process's signal."""
