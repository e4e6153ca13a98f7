"""Whether this process's Kafka inputs are reading a backlog: some partition's last poll was full.

The Kafka source reports every poll (:meth:`BacklogSignal.polled`); a poll that returned as many
records as it asked for means more are waiting. The favorites sink defers a commit only while
that is so (:mod:`sinks.action_history`): under a backlog the next batch follows at once and
collects the commit, while the last batch of a burst, written after the polls came back short,
commits before ``write_batch`` returns and is logged and published at once, instead of waiting
for the epoch's end. One signal per process, shared by its worker threads.
"""

from __future__ import annotations


class BacklogSignal:
    """The partitions whose last poll came back full (set operations are atomic under the GIL)."""

    def __init__(self) -> None:
        self._full: set[tuple[str, int]] = set()

    def polled(self, topic: str, partition: int, *, full: bool) -> None:
        """Record the outcome of a poll of ``topic[partition]``."""
        key = (topic, partition)
        if full:
            self._full.add(key)
        else:
            self._full.discard(key)

    def closed(self, topic: str, partition: int) -> None:
        """``topic[partition]`` is no longer read here."""
        self._full.discard((topic, partition))

    def reading(self) -> bool:
        """True while some partition's last poll came back full."""
        return bool(self._full)


BACKLOG = BacklogSignal()
"""This process's signal."""
