"""Event-time alignment of one input's partitions in this process (Flink's watermark alignment).

A partition passes on a record only while its event time is at most ``max_ahead`` seconds past
the frontier of every other active partition (its waiting record's event time, else the last it
passed on): a backlog over several partitions is read in event-time order to within
``max_ahead``. A caught-up partition, or one that passed nothing for ``idle_after`` seconds while
others waited, holds nobody back; a record without an event time passes at once. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

Key = tuple[str, int]
EventTime = Callable[[bytes | None], float | None]
"""A record value's event time (epoch seconds), or None when it has none."""


class Record(Protocol):
    """What alignment reads of a consumed record (a confluent-kafka ``Message``)."""

    def value(self) -> bytes | None: ...  # noqa: D102

    def error(self) -> object | None: ...  # noqa: D102


class EventTimeAlignment:
    """The shared frontiers of one input's partitions (see the module doc)."""

    def __init__(self, event_time: EventTime, max_ahead: float, idle_after: float) -> None:
        self._event_time, self._max_ahead, self._idle_after = event_time, max_ahead, idle_after
        self._lock = threading.Lock()
        self._frontier: dict[Key, float] = {}
        self._active: dict[Key, float] = {}
        """Partitions with records waiting, and when (monotonic) each last passed one on."""

    def admit(self, key: Key, records: Sequence[Record], *, behind: bool) -> int:
        """How many of ``records`` (the next ones of partition ``key``) may be passed on now.

        ``behind``: more records wait after these (not caught up). The rest are kept by the
        caller for a later poll.
        """
        now = time.monotonic()
        with self._lock:
            if not records and not behind:
                self._active.pop(key, None)  # caught up: holds nobody back
                return 0
            last_passed = self._active.get(key)
            self._active[key] = now if last_passed is None else last_passed
            limit = self._limit(key, now)
            admitted = 0
            for record in records:
                moment = None if record.error() is not None else self._event_time(record.value())
                if moment is not None:
                    if moment > limit:
                        self._frontier[key] = moment  # waits with this one in hand
                        break
                    self._frontier[key] = max(self._frontier.get(key, moment), moment)
                admitted += 1
            if admitted:
                self._active[key] = now
            if admitted == len(records) and not behind:
                self._active.pop(key, None)
            return admitted

    def reading(self) -> bool:
        """Whether some partition still has records waiting (a backlog), or was not polled yet."""
        now = time.monotonic()
        with self._lock:
            return any(now - at < self._idle_after for at in self._active.values())

    def join(self, key: Key) -> None:
        """Partition ``key`` is read here: it holds the others back until it has been polled."""
        with self._lock:
            self._active.setdefault(key, time.monotonic())

    def forget(self, key: Key) -> None:
        """Partition ``key`` is closed."""
        with self._lock:
            self._frontier.pop(key, None)
            self._active.pop(key, None)

    def _limit(self, key: Key, now: float) -> float:
        others = [self._frontier.get(other, float("-inf"))
                  for other, passed_at in self._active.items()
                  if other != key and now - passed_at < self._idle_after]
        return min(others) + self._max_ahead if others else float("inf")
