"""The job's memory: when the cyclic garbage collector runs, and heap given back to the OS.

:func:`tune_gc` freezes the start-up heap and raises the young threshold, so messages in
flight do not trigger collections that walk the whole heap; the composition root runs
:func:`collect_full` and :func:`trim_heap` periodically.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from functools import cache

OLDER_THRESHOLDS = (50, 1000)


def tune_gc(young_threshold: int) -> None:
    """Freeze the start-up heap; a young collection every ``young_threshold`` (0: defaults)."""
    if young_threshold > 0:
        gc.collect()
        gc.freeze()
        gc.set_threshold(young_threshold, *OLDER_THRESHOLDS)


def collect_full() -> None:
    """One full collection (frees reference cycles)."""
    gc.collect()


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def trim_heap() -> bool | None:
    """``malloc_trim(0)``: True if memory was released, False if none, None if unsupported."""
    trim = _malloc_trim()
    return None if trim is None else bool(trim(0))
