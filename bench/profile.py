"""Summarise a ``py-spy record --format raw --threads`` file: where the job's samples go.

Each line of the raw (collapsed) format is ``thread;frame;frame;... count`` with frames written
``function (file:line)``. Reported: the share of samples per thread, the top functions by self
samples and by inclusive samples, and the inclusive share of named buckets (decode, logging,
metrics, database, Kafka, ...).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

BUCKETS: dict[str, tuple[str, ...]] = {
    "decode (pydantic model_validate_json)": ("decode.py:decode_favorite",),
    "dedup window (DedupLogic.on_batch)": ("flow.py:on_batch",),
    "logging (log_event + JSON formatter)": ("logs.py:log_event",),
    "metrics (prometheus)": ("prometheus_client/",),
    "sink _report (metrics + logs per message)": ("action_history.py:_report",),
    "store.record_batch (Python + SQL round trips)": ("favorites_store.py:record_batch",),
    "  build_recorded_action (orjson, uuid7)": ("records.py:build_recorded_action",),
    "  _resolve_sessions": ("favorites_store.py:_resolve_sessions",),
    "  _insert": ("favorites_store.py:_insert",),
    "outbox publish_pending": ("outbox.py:publish_pending",),
    "  produce_and_wait": ("kafka_producer.py:produce_and_wait",),
    "kafka source next_batch": ("kafka_input.py:next_batch",),
    "snapshot (dedup state)": ("flow.py:snapshot", "dedup.py:snapshot"),
    "message_fields (log field strings)": ("action_history.py:message_fields",),
    "owner_key / dedup_id / idempotency_key": (
        "decode.py:owner_key", "decode.py:dedup_id", "decode.py:idempotency_key"),
}


def _short(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match.group("file")
    parts = path.split("/")
    if "site-packages" in parts:
        path = "/".join(parts[parts.index("site-packages") + 1 :])
    else:
        path = "/".join(parts[-2:])
    return f"{path}:{match.group('func')}"


def summarize(raw: Path, top: int = 15) -> dict[str, Any]:
    """The summary of one raw profile."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        total += count
        threads[re.sub(r"\s*\(?0x[0-9a-f]+\)?", "", thread).strip() or thread] += count
        names = [_short(f) for f in frames]
        if names:
            self_counts[names[-1]] += count
        for name in set(names):
            incl_counts[name] += count
        joined = ";".join(names)
        for bucket, needles in BUCKETS.items():
            if any(n in joined for n in needles):
                buckets[bucket] += count

    def pct(n: int) -> float:
        return round(100 * n / total, 1) if total else 0.0

    return {
        "samples": total,
        "threads_pct": {k: pct(v) for k, v in threads.most_common(8)},
        "top_self_pct": {k: pct(v) for k, v in self_counts.most_common(top)},
        "top_inclusive_pct": {k: pct(v) for k, v in incl_counts.most_common(top * 2)},
        "buckets_inclusive_pct": {k: pct(buckets[k]) for k in BUCKETS if buckets[k]},
    }


if __name__ == "__main__":
    import json

    print(json.dumps(summarize(Path(sys.argv[1])), indent=2))
