"""Ratios, targets and the one table of a benchmark run."""

from __future__ import annotations

from typing import Any

TARGETS = {
    "job_events_per_s": (">=", 20_000.0),
    "job_vs_naive": (">=", 15.0),
    "job_vs_ceiling": (">=", 0.5),
    "steady_p99_ms": ("<", 500.0),
    "dedup_rss_mb": ("<=", 200.0),
    "restart_caught_up_s": ("<", 30.0),
}


def _get(results: dict[str, Any], *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def best_job(results: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The job run with the highest events/s (1 or 2 workers)."""
    runs = results.get("job") or {}
    rated = [(k, v) for k, v in runs.items() if v.get("events_per_s")]
    if not rated:
        return None, None
    return max(rated, key=lambda kv: kv[1]["events_per_s"])


def evaluate(results: dict[str, Any]) -> None:
    """Add ``ratios`` and ``targets`` (value, target, met) to ``results``."""
    name, job = best_job(results)
    job_rate = job["events_per_s"] if job else None
    naive = _get(results, "naive", "events_per_s")
    ceiling = _get(results, "ceiling", "events_per_s")
    results["ratios"] = {
        "job_run": name,
        "job_vs_naive": round(job_rate / naive, 2) if job_rate and naive else None,
        "job_vs_ceiling": round(job_rate / ceiling, 3) if job_rate and ceiling else None,
    }
    values = {
        "job_events_per_s": job_rate,
        "job_vs_naive": results["ratios"]["job_vs_naive"],
        "job_vs_ceiling": results["ratios"]["job_vs_ceiling"],
        "steady_p99_ms": _get(results, "steady", "p99_ms"),
        "dedup_rss_mb": _get(results, "dedup", "rss_mb"),
        "restart_caught_up_s": _get(results, "restart", "caught_up_s"),
    }
    targets: dict[str, Any] = {}
    for key, (op, bound) in TARGETS.items():
        value = values[key]
        met = None
        if value is not None:
            met = {">=": value >= bound, "<": value < bound, "<=": value <= bound}[op]
        targets[key] = {"value": value, "target": f"{op} {bound:g}",
                        "met": "met" if met else ("not met" if met is False else "not measured")}
    results["targets"] = targets


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(results: dict[str, Any]) -> None:
    """One table: every measured number, its target and whether it is met."""
    targets = results.get("targets", {})

    def target(key: str) -> tuple[str, str]:
        t = targets.get(key)
        return (t["target"], t["met"]) if t else ("", "")

    rows: list[tuple[str, str, str, str]] = []
    prefill = results.get("prefill") or {}
    rows.append(("prefill: action_events rows / seconds",
                 f"{_fmt(prefill.get('action_events_rows'))} / {_fmt(prefill.get('total_s'), 1)}",
                 "", ""))
    for name, run in (results.get("job") or {}).items():
        key = "job_events_per_s" if name == results.get("ratios", {}).get("job_run") else ""
        t, met = target(key) if key else ("", "")
        rows.append((f"job {name.replace('_', ' ')}: events/s (wall {_fmt(run.get('wall_s'), 1)}"
                     f" s incl. {_fmt(run.get('startup_s'), 1)} s start)",
                     _fmt(run.get("events_per_s")), t, met))
        rows.append((f"job {name.replace('_', ' ')}: events/s after first output",
                     _fmt(run.get("events_per_s_after_first_output")), "", ""))
        res = run.get("resources") or {}
        rows.append((f"job {name.replace('_', ' ')}: cores job / postgres / kafka",
                     f"{_fmt(res.get('job_cores'), 2)} / {_fmt(res.get('postgres_cores'), 2)}"
                     f" / {_fmt(res.get('kafka_cores'), 2)}", "", ""))
        rows.append((f"job {name.replace('_', ' ')}: WAL bytes per recorded event",
                     _fmt(run.get("wal_bytes_per_recorded_event")), "", ""))
        gc_time = run.get("gc") or {}
        rows.append((f"job {name.replace('_', ' ')}: GC seconds / CPU seconds, peak RSS MB",
                     f"{_fmt(gc_time.get('total_s'), 1)} / {_fmt(gc_time.get('cpu_s'), 1)}, "
                     f"{_fmt(run.get('job_peak_rss_mb'))}", "", ""))
    naive = results.get("naive") or {}
    rows.append(("naive consumer: events/s"
                 + (" (time-bounded, extrapolated)" if naive.get("extrapolated") else ""),
                 _fmt(naive.get("events_per_s")), "", ""))
    ceiling = results.get("ceiling") or {}
    rows.append(("write-path ceiling (record_batch x1000): events/s",
                 _fmt(ceiling.get("events_per_s")), "", ""))
    rows.append(("ceiling: WAL bytes per recorded event",
                 _fmt(ceiling.get("wal_bytes_per_recorded_event")), "", ""))
    cost = results.get("outbox_publish_db_cost") or {}
    for label in ("old", "new"):
        if label in cost:
            rows.append((f"outbox publisher DB cost ({label}): PG CPU us/row, WAL B/row",
                         f"{_fmt(cost[label].get('pg_cpu_us_per_row'), 1)}, "
                         f"{_fmt(cost[label].get('wal_bytes_per_row'))}", "", ""))
    ratios = results.get("ratios") or {}
    rows.append(("ratio job / naive", _fmt(ratios.get("job_vs_naive"), 1),
                 *target("job_vs_naive")))
    rows.append(("ratio job / ceiling", _fmt(ratios.get("job_vs_ceiling"), 2),
                 *target("job_vs_ceiling")))
    steady = results.get("steady") or {}
    rows.append((f"steady {_fmt(steady.get('target_rate'))}/s: p50 / p95 ms",
                 f"{_fmt(steady.get('p50_ms'), 1)} / {_fmt(steady.get('p95_ms'), 1)}", "", ""))
    rows.append(("steady: p99 ms", _fmt(steady.get("p99_ms"), 1), *target("steady_p99_ms")))
    dedup = results.get("dedup") or {}
    rows.append((f"RSS with {_fmt(dedup.get('ids'))} ids in dedup window, MB",
                 _fmt(dedup.get("rss_mb"), 1), *target("dedup_rss_mb")))
    restart = results.get("restart") or {}
    rows.append(("restart after SIGKILL -> caught up, s", _fmt(restart.get("caught_up_s"), 1),
                 *target("restart_caught_up_s")))
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'measure':<{width}}  {'value':>16}  {'target':>10}  met")
    print("-" * (width + 40))
    for label, value, t, met in rows:
        print(f"{label:<{width}}  {value:>16}  {t:>10}  {met}")
    if results.get("error"):
        print(f"\nERROR: {results['error']}")
