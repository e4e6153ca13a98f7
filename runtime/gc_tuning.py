"""When Python's cyclic garbage collector runs in the job.

Why: with CPython 3.11's default thresholds (700, 10, 10) the job spent 40 % of its CPU in the
collector: 8.3 of 21 CPU seconds for a 200k-message backlog, 7 of them in 49 full collections
of about 140 ms each (measured with ``gc.callbacks`` in the benchmark). Every message in flight
(its record, envelope, UUIDs, rows) survives a few young collections, so it is promoted, and
the old generation grows by a quarter again and again: each time a full collection walks the
whole heap, including every module, class and function imported at start.

So, once the flow is built (:func:`tune_gc`):

* ``gc.freeze()`` moves every object alive at start-up (imports, the flow, clients) out of the
  collector's reach for good: they are never garbage and never scanned again;
* the thresholds become ``(young_threshold, 50, 1000)`` (default young threshold 1,000,000): a
  young collection after 1M net allocations, and in practice no automatic full collection;
* instead a daemon thread runs ``gc.collect()`` every ``full_interval`` seconds, so garbage in
  reference cycles (rare here: exceptions with tracebacks, some library internals) is still
  freed. It holds the GIL for its duration (about 0.1-0.2 s under a backlog).

Objects without cycles are freed by reference counting the moment they are dropped, whatever
the thresholds: this changes when cycles are found, not when ordinary garbage is freed.
Measured in the same benchmark process (``--compare-env``): 7,250 -> 9,150-9,280 events/s,
collector time 8.3 -> 0.8 s.

The young threshold went from 100,000 to 1,000,000 in issue 16. In a 200k-event run at 100k,
the process made 6-7 more young collections than at 1M (121-122 against 115, start-up
included), and they took 0.7-0.9 s of the job's 12-14 CPU seconds: about 100 ms each (they
walk every container still in flight), 3.5-4.6 µs per event. At 1M the run's young
collections took 0.008 s in all, and the periodic full collection below still frees
cycles. Peak RSS of that run: 321 MB against 290-296 MB at 100k (one run against two); with 1M
MessageIds held, 172.5 MB (docs/performance.md, "Job CPU per event").
"""

from __future__ import annotations

import gc
import logging
import threading
import time

from runtime.logs import log_event
from runtime.periodic import Periodic

logger = logging.getLogger(__name__)

OLDER_THRESHOLDS = (50, 1000)
"""Collections of the younger generation before the middle and the old one are collected."""


class FullCollector(Periodic):
    """Runs ``gc.collect()`` every ``interval`` seconds in a daemon thread; ``stop()`` ends it."""

    def __init__(self, interval: float) -> None:
        super().__init__(interval, "gc-collect")
        self.collections = 0
        self.collected = 0
        self.last_ms = 0.0

    def tick(self) -> bool:
        """One full collection."""
        started = time.perf_counter()
        self.collected += gc.collect()
        self.last_ms = (time.perf_counter() - started) * 1000
        self.collections += 1
        return True


_COLLECTOR: FullCollector | None = None
_LOCK = threading.Lock()


def tune_gc(young_threshold: int = 1_000_000, full_interval: float = 60.0) -> FullCollector | None:
    """Freeze the start-up heap, raise the thresholds, collect fully every ``full_interval`` s.

    Once per process (later calls only return the collector). ``young_threshold == 0`` leaves
    the collector as Python configures it (returns None); ``full_interval <= 0`` starts no
    periodic collection.
    """
    global _COLLECTOR  # noqa: PLW0603 - one collector per process
    if young_threshold <= 0:
        return None
    thresholds = (young_threshold, *OLDER_THRESHOLDS)
    with _LOCK:
        if _COLLECTOR is None and gc.get_threshold() != thresholds:
            gc.collect()  # start-up garbage first: what is frozen is never collected
            gc.freeze()
            gc.set_threshold(*thresholds)
            if full_interval > 0:
                _COLLECTOR = FullCollector(full_interval).start()
            log_event(logger, "gc-tuned", thresholds=list(thresholds),
                      frozen=gc.get_freeze_count(), full_interval_s=full_interval)
        return _COLLECTOR


__all__ = ["OLDER_THRESHOLDS", "FullCollector", "tune_gc"]
