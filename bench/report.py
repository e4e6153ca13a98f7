"""The targets of a benchmark run, its ratios, the ``scale`` curve and its one table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

TARGETS = {
    "job_events_per_s": (">=", 20_000.0), "job_vs_naive": (">=", 25.0),
    "job_vs_ceiling": (">=", 0.7), "job_vs_peer": (">=", 1.5),
    "total_cpu_us_per_event": ("<=", 90.0), "wal_bytes_per_recorded_event": ("<=", 1536.0),
    "steady_p99_ms": ("<", 150.0), "dedup_rss_mb": ("<=", 200.0),
    "restart_caught_up_s": ("<", 10.0), "scale_largest_vs_2m": (">=", 0.9),
    "workers_2_job_cpu_vs_1_worker": ("<=", 1.3), "processes_2_job_cpu_vs_1_worker": ("<=", 1.5)}
_OPS = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__}


def get(results: dict[str, Any], path: str) -> Any:
    """The value at the dotted ``path`` (None where a key is missing)."""
    node: Any = results
    for key in path.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    return round(a / b, digits) if a and b else None


def paired_ratios(head: Sequence[float], ref: Sequence[float]) -> dict[str, Any]:
    """Each interleaved round's ``head / ref``, their geometric mean, how many are below 1.

    A round's two runs are minutes apart, so its ratio is little moved by the machine's drift
    (10-30 % within an hour here), unlike the ratio of the two sides' medians.
    """
    ratios = [h / r for h, r in zip(head, ref, strict=True)]
    valid = bool(ratios) and all(x > 0 for x in ratios)
    return {"pairs": [round(x, 3) for x in ratios],
            "geomean": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
            if valid else None,
            "head_lower": sum(1 for x in ratios if x < 1) if valid else None}


def best_job(results: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The job run with the highest events/s."""
    rated = [(k, v) for k, v in (results.get("job") or {}).items() if v.get("events_per_s")]
    return max(rated, key=lambda kv: kv[1]["events_per_s"]) if rated else (None, {})


def versus_one_worker(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each other job run over ``workers_1`` of the same run: events/s and CPU µs per event.

    CPU per event of the job's processes (summed over a cluster's), PostgreSQL, the broker and
    their total; None where either run lacks the figure.
    """
    runs = results.get("job") or {}
    base = runs.get("workers_1") or {}
    return {name: {"events_per_s": _ratio(run.get("events_per_s"), base.get("events_per_s")),
                   **{f"{part}_cpu_us_per_event": _ratio(get(run, f"cpu_us_per_event.{part}"),
                                                         get(base, f"cpu_us_per_event.{part}"))
                      for part in ("job", "postgres", "kafka", "total")}}
            for name, run in runs.items() if name != "workers_1"}


def merge_scale(results: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """``scale``: the previous results' curve, this run's points replacing their row counts'.

    This run's points: its best job run at ``--rows``, its ``scale`` run at ``--scale-rows``.
    """
    curve = [p for p in (previous or {}).get("scale") or [] if isinstance(p, dict)]
    for prefill, (name, job) in (("prefill", best_job(results)),
                                 ("prefill_scale", ("scale_job", results.get("scale_job") or {}))):
        if job.get("events_per_s"):
            rows = get(results, f"{prefill}.action_events_rows")
            curve = [p for p in curve if p.get("rows") != rows] + [{
                "rows": rows, "job_run": name, "events_per_second": job["events_per_s"],
                "run_id": results["meta"]["run_id"], "commit": get(results, "meta.code.commit")}]
    results["scale"] = sorted(curve, key=lambda p: p.get("rows") or 0)


_COMPUTED = frozenset({"meta", "ratios", "targets", "scale", "error"})


def carry_over(results: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """The sections of ``previous`` (the file replaced) that this run did not measure.

    ``meta.carried_over`` names each one's run, ``meta.earlier_runs`` keeps those runs' own
    ``meta``: a ``--phases timing`` run keeps the full run's figures and the other way round.
    """
    before = dict((previous or {}).get("meta") or {})
    runs = {**(before.pop("earlier_runs", None) or {}), before.get("run_id"): before}
    origins = before.pop("carried_over", None) or {}
    carried = {key: origins.get(key, before.get("run_id")) for key in previous or {}
               if key not in results and key not in _COMPUTED}
    for key in carried:
        results[key] = (previous or {})[key]
    if carried:
        results["meta"]["carried_over"] = carried
        results["meta"]["earlier_runs"] = {run: runs[run] for run in sorted(
            set(carried.values()), key=str) if run in runs}


def evaluate(results: dict[str, Any]) -> None:
    """Add ``ratios`` and ``targets`` (value, target, met) to ``results``."""
    name, job = best_job(results)
    rate = job.get("events_per_s")
    scaling = versus_one_worker(results)
    scale = {p["rows"]: p["events_per_second"] for p in results.get("scale") or []}
    largest = max(scale, default=0)
    results["ratios"] = {
        "job_run": name,
        "job_vs_naive": _ratio(rate, get(results, "naive.events_per_s")),
        "job_vs_ceiling": _ratio(rate, get(results, "ceiling.events_per_s"), 3),
        "job_vs_peer": _ratio(rate, get(results, "peer.events_per_s")),
        "total_cpu_us_per_event": get(job, "cpu_us_per_event.total"),
        "peer_total_cpu_us_per_event": get(results, "peer.cpu_us_per_event.total"),
        "scale_largest_vs_2m": (_ratio(scale[largest], scale.get(2_000_000), 3)
                                if largest > 2_000_000 else None),
        "scale_points_from_this_run": sorted(
            p["rows"] for p in results.get("scale") or []
            if p.get("run_id") == results["meta"]["run_id"]),
        "versus_1_worker": scaling,
    }
    values = {**results["ratios"], "job_events_per_s": rate,
              "wal_bytes_per_recorded_event": job.get("wal_bytes_per_recorded_event"),
              "steady_p99_ms": get(results, "steady.p99_ms"),
              "dedup_rss_mb": get(results, "dedup.rss_mb"),
              "restart_caught_up_s": get(results, "restart.caught_up_s"),
              **{f"{run}_job_cpu_vs_1_worker": get(scaling, f"{run}.job_cpu_us_per_event")
                 for run in ("workers_2", "processes_2")}}
    results["targets"] = {
        key: {"value": values[key], "target": f"{op} {bound:g}",
              "met": "not measured" if values[key] is None
              else "met" if _OPS[op](float(values[key]), bound) else "not met"}
        for key, (op, bound) in TARGETS.items()}


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return " / ".join(_fmt(v) for k, v in value.items() if k != "total")
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def print_table(results: dict[str, Any]) -> None:
    """Every headline figure, then each target with its value and whether it is met."""
    rows = [("warm-up (not measured): events/s; CPU us/event job / pg / kafka",
             f"{_fmt(get(results, 'warmup.events_per_s'))}; "
             f"{_fmt(get(results, 'warmup.cpu_us_per_event'))}", "", "")]
    for name, run in (results.get("job") or {}).items():
        label = f"job {name.replace('_', ' ')}"
        rows += [(f"{label}: events/s (wall s)",
                  f"{_fmt(run.get('events_per_s'))} ({_fmt(run.get('wall_s'))})", "", ""),
                 (f"{label}: CPU us/event job / postgres / kafka",
                  _fmt(run.get("cpu_us_per_event")), "", ""),
                 (f"{label}: WAL B/event records / page images",
                  f"{_fmt(get(run, 'wal_by_kind.records'))} / "
                  f"{_fmt(get(run, 'wal_by_kind.page_images'))}", "", "")]
    for name, ratio in (get(results, "ratios.versus_1_worker") or {}).items():
        cpu = " / ".join(_fmt(ratio[f"{part}_cpu_us_per_event"])
                         for part in ("job", "postgres", "kafka"))
        rows.append((f"job {name.replace('_', ' ')} / workers 1: events/s; CPU/event job / "
                     "postgres / kafka", f"{_fmt(ratio['events_per_s'])}; {cpu}", "", ""))
    for label, path in (("prefill: action_events rows", "prefill.action_events_rows"),
                        ("scale: rows, -w 1 events/s", ("prefill_scale.action_events_rows",
                                                        "scale_job.events_per_s")),
                        ("scale: CPU us/event job / postgres / kafka",
                         "scale_job.cpu_us_per_event"),
                        ("naive consumer: events/s", "naive.events_per_s"),
                        ("write-path ceiling: events/s", "ceiling.events_per_s"),
                        ("Quix Streams peer: events/s", "peer.events_per_s"),
                        ("peer: CPU us/event peer / postgres / kafka", "peer.cpu_us_per_event"),
                        ("steady: p50 ms", "steady.p50_ms"), ("steady: p95 ms", "steady.p95_ms"),
                        ("compare: paired head/ref events/s", "compare.paired_head_to_ref"),
                        ("compare: paired head/ref job CPU", "compare.cpu_paired_head_to_ref")):
        paths = (path,) if isinstance(path, str) else path
        rows.append((label, " / ".join(_fmt(get(results, p)) for p in paths), "", ""))
    rows += [(f"target {key}", _fmt(t["value"]), t["target"], t["met"])
             for key, t in (results.get("targets") or {}).items()]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'value':>22}  {'target':>10}  met\n{'-' * (width + 46)}")
    for label, value, bound, met in rows:
        print(f"{label:<{width}}  {value:>22}  {bound:>10}  {met}")
    if results.get("error"):
        print(f"\nERROR: {results['error']}")
