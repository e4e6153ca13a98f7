"""Ratios, targets (issue 16) and the one table of a benchmark run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

TARGETS = {
    "job_events_per_s": (">=", 20_000.0),
    "job_vs_naive": (">=", 25.0),
    "job_vs_ceiling": (">=", 0.7),
    "job_vs_peer": (">=", 1.5),
    "total_cpu_us_per_event": ("<=", 90.0),
    "wal_bytes_per_recorded_event": ("<=", 1536.0),
    "steady_p99_ms": ("<", 150.0),
    "dedup_rss_mb": ("<=", 200.0),
    "restart_caught_up_s": ("<", 10.0),
    "scale_largest_vs_2m": (">=", 0.9),
}
_OPS = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__}


def get(results: dict[str, Any], path: str) -> Any:
    """The value at the dotted ``path`` (None where a key is missing)."""
    node: Any = results
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    return round(a / b, digits) if a and b else None


def paired_ratios(head: Sequence[float], ref: Sequence[float]) -> dict[str, Any]:
    """Each interleaved round's ``head / ref`` and their geometric mean.

    The two runs of a round ran minutes apart, so a pair's ratio is little moved by the
    machine's slow drift (its speed changes by 10-30 % within an hour here); the ratio of the
    two sides' medians pairs a fast round's run with a slow one's whenever the rounds fall so.
    """
    ratios = [h / r for h, r in zip(head, ref, strict=True)]
    found: dict[str, Any] = {"pairs": [round(x, 3) for x in ratios], "geomean": None,
                             "head_lower": None}
    if ratios and all(x > 0 for x in ratios):
        found["geomean"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
        found["head_lower"] = sum(1 for x in ratios if x < 1)
    return found


def best_job(results: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The job run with the highest events/s (1 or 2 workers)."""
    rated = [(k, v) for k, v in (results.get("job") or {}).items() if v.get("events_per_s")]
    return max(rated, key=lambda kv: kv[1]["events_per_s"]) if rated else (None, {})


def scale_point(results: dict[str, Any]) -> dict[str, Any] | None:
    """The run's point of the throughput-against-prefilled-rows curve."""
    name, job = best_job(results)
    if not job:
        return None
    return {"rows": get(results, "prefill.action_events_rows"), "job_run": name,
            "events_per_second": job["events_per_s"], "run_id": results["meta"]["run_id"],
            "commit": get(results, "meta.code.commit")}


def merge_scale(results: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """``scale``: the previous results' curve with this run's point replacing its row count."""
    curve = [p for p in (previous or {}).get("scale") or [] if isinstance(p, dict)]
    point = scale_point(results)
    if point is not None:
        curve = [p for p in curve if p.get("rows") != point["rows"]] + [point]
    results["scale"] = sorted(curve, key=lambda p: p.get("rows") or 0)


def evaluate(results: dict[str, Any]) -> None:
    """Add ``ratios`` and ``targets`` (value, target, met) to ``results``."""
    name, job = best_job(results)
    rate = job.get("events_per_s")
    scale = {p["rows"]: p["events_per_second"] for p in results.get("scale") or []}
    largest = max(scale, default=None)
    results["ratios"] = {
        "job_run": name,
        "job_vs_naive": _ratio(rate, get(results, "naive.events_per_s")),
        "job_vs_ceiling": _ratio(rate, get(results, "ceiling.events_per_s"), 3),
        "job_vs_peer": _ratio(rate, get(results, "peer.events_per_s")),
        "total_cpu_us_per_event": get(job, "cpu_us_per_event.total"),
        "peer_total_cpu_us_per_event": get(results, "peer.cpu_us_per_event.total"),
        "scale_largest_vs_2m": (_ratio(scale[largest], scale.get(2_000_000), 3)
                                if largest and largest > 2_000_000 else None),
    }
    values = {**results["ratios"], "job_events_per_s": rate,
              "wal_bytes_per_recorded_event": job.get("wal_bytes_per_recorded_event"),
              "steady_p99_ms": get(results, "steady.p99_ms"),
              "dedup_rss_mb": get(results, "dedup.rss_mb"),
              "restart_caught_up_s": get(results, "restart.caught_up_s")}
    results["targets"] = {}
    for key, (op, bound) in TARGETS.items():
        value = values[key]
        met = "not measured" if value is None else (
            "met" if _OPS[op](float(value), bound) else "not met")
        results["targets"][key] = {"value": value, "target": f"{op} {bound:g}", "met": met}


_OUTBOX = "outbox_publish_db_cost"
_ROWS = (
    ("prefill: action_events rows", "prefill.action_events_rows"),
    ("naive consumer: events/s", "naive.events_per_s"),
    ("write-path ceiling (record_batch x1000): events/s", "ceiling.events_per_s"),
    ("ceiling: WAL bytes per recorded event", "ceiling.wal_bytes_per_recorded_event"),
    ("outbox publisher: PG CPU us/row, WAL B/row",
     (f"{_OUTBOX}.pg_cpu_us_per_row", f"{_OUTBOX}.wal_bytes_per_row")),
    ("Quix Streams peer: events/s", "peer.events_per_s"),
    ("peer: CPU us/event peer / postgres / kafka", "peer.cpu_us_per_event"),
    ("steady: p50 / p95 ms", ("steady.p50_ms", "steady.p95_ms")),
    ("dedup window: ids", "dedup.ids"),
)


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return " / ".join(_fmt(v) for k, v in value.items() if k != "total")
    if isinstance(value, float):
        return f"{value:,.1f}"
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def print_table(results: dict[str, Any]) -> None:
    """One table: every headline figure, then each target with its value and whether it is met."""
    rows: list[tuple[str, str, str, str]] = []
    if warmup := results.get("warmup"):
        rows.append(("warm-up run (not measured): events/s, CPU us/event job / pg / kafka",
                     f"{_fmt(warmup.get('events_per_s'))}, {_fmt(warmup.get('cpu_us_per_event'))}",
                     "", ""))
    for name, run in (results.get("job") or {}).items():
        label = f"job {name.replace('_', ' ')}"
        rows += [(f"{label}: events/s (wall s)", f"{_fmt(run.get('events_per_s'))} "
                  f"({_fmt(run.get('wall_s'))})", "", ""),
                 (f"{label}: CPU us/event job / postgres / kafka",
                  _fmt(run.get("cpu_us_per_event")), "", ""),
                 (f"{label}: WAL B/event, records / page images",
                  " / ".join(_fmt(get(run, f"wal_by_kind.{kind}"))
                             for kind in ("records", "page_images")),
                  "", "")]
    for label, path in _ROWS:
        paths = (path,) if isinstance(path, str) else path
        rows.append((label, " / ".join(_fmt(get(results, p)) for p in paths), "", ""))
    for key, target in (results.get("targets") or {}).items():
        rows.append((f"target {key}", _fmt(target["value"]), target["target"], target["met"]))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'value':>22}  {'target':>10}  met\n{'-' * (width + 46)}")
    for label, value, bound, met in rows:
        print(f"{label:<{width}}  {value:>22}  {bound:>10}  {met}")
    if results.get("error"):
        print(f"\nERROR: {results['error']}")
