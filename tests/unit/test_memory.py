"""The job's collector tuning and heap trimming (runtime.memory)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from runtime.memory import OLDER_THRESHOLDS, collect_full, trim_heap, tune_gc


@pytest.fixture
def _restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("_restored_gc")
def test_tuning_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    tune_gc(50_000)

    assert gc.get_threshold() == (50_000, *OLDER_THRESHOLDS)
    assert gc.get_freeze_count() > 0


@pytest.mark.usefixtures("_restored_gc")
def test_a_young_threshold_of_zero_keeps_pythons_defaults() -> None:
    before = gc.get_threshold()

    tune_gc(0)

    assert gc.get_threshold() == before


def test_a_full_collection_frees_a_reference_cycle() -> None:
    class Node:
        other: object

    first, second = Node(), Node()
    first.other, second.other = second, first
    count = sum(isinstance(o, Node) for o in gc.get_objects())
    del first, second

    collect_full()

    assert sum(isinstance(o, Node) for o in gc.get_objects()) == count - 2


def test_trimming_the_heap_answers_whether_glibc_released_memory() -> None:
    assert trim_heap() in (True, False)  # glibc's malloc_trim exists on Debian
