"""Dry runs of replay: thread-safe outcome counts, and a dead-letter sink that only counts.

Generic (every flow's dry run uses them); each flow has its own read-only sink for its writes.
"""

from __future__ import annotations

import threading
from collections import Counter

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from typing_extensions import override

from schemas.dlq_letter import DeadLetter


class Tally:
    """Thread-safe outcome counts of one run (``recorded``, ``duplicate``, ``no-session``, …)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, outcome: str, count: int = 1) -> None:
        """Count ``count`` messages with ``outcome``."""
        with self._lock:
            self._counts[outcome] += count

    def snapshot(self) -> dict[str, int]:
        """The counts so far."""
        with self._lock:
            return dict(self._counts)


class DryRunDeadLetterSink(DynamicSink[DeadLetter], StatelessSinkPartition[DeadLetter]):
    """Tallies would-be dead letters by reason; its one partition (itself) is shared."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> DryRunDeadLetterSink:
        return self

    @override
    def write_batch(self, items: list[DeadLetter]) -> None:
        for letter in items:
            self._tally.add("dead-lettered")
            self._tally.add(f"dead-lettered:{letter.reason.value}")
