"""Summarise a ``py-spy record --format raw --threads`` file: where the job's samples go.

Each line of the raw (collapsed) format is ``thread;frame;frame;... count`` with frames written
``function (file:line)``. Reported: the share of samples per thread, the top functions by self
samples and by inclusive samples, and the inclusive share of named buckets (decode, logging,
metrics, database, Kafka, ...).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

BUCKETS: dict[str, str] = {
    # name: a regex searched in the ';'-joined stack of "path:Class.function" frames
    "decode: decode_favorite (msgspec, pydantic fallback)": r":decode_favorite",
    "dedup: DedupLogic.on_batch": r":DedupLogic\.on_batch",
    "sink: FavoritesStore.send_batch (deferred: parameters, send)": (
        r"favorite_actions/store\.py:FavoritesStore\.send_batch"),
    "  send_batch: statement (binary array parameters)": (
        r"favorite_actions/store\.py:FavoritesStore\.send_batch.*FavoritesStore\.statement"),
    "sink: FavoritesStore.finish_batch (wait for the commit, then settle)": (
        r"favorite_actions/store\.py:FavoritesStore\.finish_batch"),
    "  settle: the recorded rows (outbox JSON, rows)": (
        r"favorite_actions/store\.py:FavoritesStore\.settle"),
    "sink: FavoritesStore.record_batch (all)": (
        r"favorite_actions/store\.py:FavoritesStore\.record_batch"),
    "  record_batch: psycopg parameter dump (binary arrays)": (
        r"favorite_actions/store\.py:FavoritesStore\.record_batch.*_queries\.py:PostgresQuery\.dump"),
    "  record_batch: waiting for PostgreSQL (Connection.wait)": (
        r"favorite_actions/store\.py:FavoritesStore\.record_batch.*connection\.py:Connection\.wait"),
    "  record_batch: build_recorded_action (orjson, str(uuid), uuid7)": (
        r":build_recorded_action|favorite_actions/store\.py:FavoritesStore\.record_batch"
        r".*compat/__init__\.py"),
    "sink: report (log lines + metrics per batch)": (
        r"favorite_actions/sink\.py:_ActionHistoryPartition\.report"),
    "  logging (log_event(s), JSON formatter, stream write)": r"logs\.py:log_event",
    "  metrics (prometheus_client)": r"prometheus_client/",
    "  message_fields (str(uuid) for logs)": r"favorite_actions/sink\.py:message_fields",
    "flow: other skip logs (_log_skip)": r":_log_skip",
    "outbox publisher thread (all)": r"outbox\.py:OutboxPublisher\._run",
    "  publisher: window read-back + watermark (PostgreSQL calls)": (
        r"outbox\.py:OutboxPublisher\.publish_committed;[^;]*(cursor|connection)\.py"),
    "  publisher: produce_and_wait (produce + delivery reports + flush)": (
        r"kafka_producer\.py:produce_and_wait"),
    "sink: write_batch on the worker (all)": (
        r"favorite_actions/sink\.py:_ActionHistoryPartition\.write_batch"),
    "sink: snapshot (finishing a deferred commit)": (
        r"favorite_actions/sink\.py:_ActionHistoryPartition\.snapshot"),
    "kafka source: next_batch": r"kafka_input\.py:_KafkaPartition\.next_batch",
    "snapshot (DedupLogic.snapshot)": (
        r":DedupLogic\.snapshot|:DedupWindow\.snapshot"),
    "http /metrics thread (benchmark scraping)": r"socketserver\.py|http/server\.py",
    "bytewax/Rust (samples with no Python frame below run.py)": r"run\.py:<module>$",
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
        for bucket, pattern in BUCKETS.items():
            if re.search(pattern, joined):
                buckets[bucket] += count

    def pct(n: int) -> float:
        return round(100 * n / total, 1) if total else 0.0

    return {
        "samples": total,
        "threads_pct": {k: pct(v) for k, v in threads.most_common(8)},
        "top_self_pct": {k: pct(v) for k, v in self_counts.most_common(top)},
        "top_inclusive_pct": {k: pct(v) for k, v in incl_counts.most_common(top * 2)},
        "buckets_inclusive_pct": {k: pct(buckets[k]) for k in BUCKETS if buckets[k]},
        "note": "percent of all py-spy samples (all Python threads, --nonblocking, 100 Hz)",
    }
