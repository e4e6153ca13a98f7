"""A clock input: every sink partition gets a tick every ``interval`` seconds while the job runs.

Bytewax calls a sink only when items reach it; a tick gives each partition a periodic call
(a deferred commit, waiting rows) without a thread. Ticks end at a stop request.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final

from bytewax.inputs import DynamicSource, StatelessSourcePartition
from typing_extensions import override

from runtime.shutdown import Shutdown


class Tick:
    """The tick item (one instance, :data:`TICK`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TICK"

    def __reduce__(self) -> str:
        return "TICK"  # unpickled in another process of the cluster as that process's TICK


TICK: Final = Tick()


class TickSource(DynamicSource[tuple[str, Tick]]):
    """``(key, TICK)`` for each of ``keys`` every ``interval``, on every worker, until a stop."""

    def __init__(self, keys: list[str], interval: timedelta, stopping: Shutdown) -> None:
        self._items, self._interval = [(key, TICK) for key in keys], interval
        self._stopping = stopping

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _Ticks:
        return _Ticks(self._items, self._interval, self._stopping)


class _Ticks(StatelessSourcePartition[tuple[str, Tick]]):
    def __init__(self, items: list[tuple[str, Tick]], interval: timedelta,
                 stopping: Shutdown) -> None:
        self._items, self._interval, self._stopping = items, interval, stopping
        self._awake = datetime.now(UTC) + interval

    @override
    def next_batch(self) -> list[tuple[str, Tick]]:
        if self._stopping.requested():
            raise StopIteration
        self._awake = datetime.now(UTC) + self._interval
        return self._items

    @override
    def next_awake(self) -> datetime:
        return self._awake
