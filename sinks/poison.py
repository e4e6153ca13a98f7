"""Isolate the poison in a failed batch by bisection, so its batch-mates are written normally.

``write`` must retry infrastructure failures itself (forever) and raise only for a problem with
the data. A failed batch is split in halves until the failing messages stand alone; each lone
message gets ``attempts`` immediate attempts in all, then is handed back as poison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Poisoned(Generic[T]):
    """A message that failed alone ``attempts`` times, with the last exception."""

    item: T
    error: BaseException
    attempts: int


def write_isolating_poison(items: Sequence[T], write: Callable[[Sequence[T]], R], attempts: int,
                           ) -> tuple[list[R], list[Poisoned[T]]]:
    """Write ``items``; return the results of the successful writes and the poisoned items."""
    results: list[R] = []
    poisoned: list[Poisoned[T]] = []
    if items:  # not a recursive closure: its cycle would keep every batch until a full GC
        _write_halving(items, write, attempts, results, poisoned)
    return results, poisoned


def _write_halving(batch: Sequence[T], write: Callable[[Sequence[T]], R], attempts: int,
                   results: list[R], poisoned: list[Poisoned[T]]) -> None:
    for attempt in range(1, attempts + 1):
        try:
            results.append(write(batch))
            return
        except Exception as exc:  # noqa: BLE001 - any failure of a lone item is poison
            if len(batch) > 1:
                middle = len(batch) // 2
                _write_halving(batch[:middle], write, attempts, results, poisoned)
                _write_halving(batch[middle:], write, attempts, results, poisoned)
                return
            if attempt == attempts:
                poisoned.append(Poisoned(batch[0], exc, attempts))
