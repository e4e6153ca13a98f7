"""The garbage collector tuning: thresholds, the frozen start-up heap, the periodic collection."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from runtime import gc_tuning
from runtime.gc_tuning import OLDER_THRESHOLDS, FullCollector, tune_gc


@pytest.fixture
def restore_gc() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    if gc_tuning._COLLECTOR is not None:
        gc_tuning._COLLECTOR.stop()
        gc_tuning._COLLECTOR = None
    gc.unfreeze()
    gc.set_threshold(*saved)


@pytest.mark.usefixtures("restore_gc")
def test_tune_gc_freezes_the_heap_and_sets_the_thresholds_once() -> None:
    collector = tune_gc(50_000, full_interval=3600)

    assert gc.get_threshold() == (50_000, *OLDER_THRESHOLDS)
    assert gc.get_freeze_count() > 1000  # every module, class and function imported so far
    assert collector is not None and collector.interval == 3600
    assert tune_gc(50_000, full_interval=1) is collector  # once per process


@pytest.mark.usefixtures("restore_gc")
def test_zero_threshold_keeps_pythons_collector() -> None:
    before = gc.get_threshold()

    assert tune_gc(0) is None
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_periodic_full_collection_frees_cycles() -> None:
    gc.disable()
    try:
        for _ in range(100):
            _Cycle()  # unreachable, kept alive only by its own cycle
        collector = FullCollector(0.05).start()
        deadline = time.monotonic() + 5
        while collector.collections == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        collector.stop()
    finally:
        gc.enable()
    assert collector.collections >= 1
    assert collector.collected >= 100


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        FullCollector(0)
