"""Garbage-collector time of a benchmarked job (bench only, never in production).

Loaded by putting ``bench/gcprobe`` on the job's ``PYTHONPATH`` with ``GCPROBE_DIR`` set: it
times every collection through ``gc.callbacks`` and, at exit, writes ``$GCPROBE_DIR/<pid>.json``
with the count and seconds per generation, the total, the process CPU time and the thresholds
in force at the end (after :func:`runtime.gc_tuning.tune_gc`, if the job tuned them).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time
from typing import Any


def _install(directory: str) -> None:
    state: dict[str, Any] = {"started": 0.0, "count": [0, 0, 0], "seconds": [0.0, 0.0, 0.0]}

    def on_collect(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            state["started"] = time.perf_counter()
            return
        generation = info["generation"]
        state["count"][generation] += 1
        state["seconds"][generation] += time.perf_counter() - state["started"]

    def dump() -> None:
        result = {
            "collections": state["count"],
            "seconds": [round(s, 3) for s in state["seconds"]],
            "total_s": round(sum(state["seconds"]), 3),
            "cpu_s": round(time.process_time(), 3),
            "thresholds": list(gc.get_threshold()),
            "frozen": gc.get_freeze_count(),
        }
        with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as out:
            json.dump(result, out)

    gc.callbacks.append(on_collect)
    atexit.register(dump)


if os.environ.get("GCPROBE_DIR"):
    _install(os.environ["GCPROBE_DIR"])
