"""The figures of a ``results.json`` as pictures (matplotlib, Agg): ``docs/img/*.png``.

- ``throughput.png``: events/s per phase (job runs, ceiling, Quix Streams peer, naive);
- ``latency.png``: the latency distribution at the steady rate, cumulative (from its histogram;
  a run that has none gives its percentiles only);
- ``scale.png``: job events/s against prefilled action_events rows (``scale``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.report import get, scale_point

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def _job_label(run: str) -> str:
    """``workers_2`` -> ``job -w 2``; ``processes_2`` -> ``job, 2 processes``."""
    if run.startswith("processes_"):
        return f"job, {run.removeprefix('processes_')} processes"
    return f"job {run.replace('workers_', '-w ')}"


def _throughput(results: dict[str, Any], ax: Any) -> None:
    bars = {_job_label(k): v.get("events_per_s") for k, v in (results.get("job") or {}).items()}
    bars |= {"write-path ceiling": get(results, "ceiling.events_per_s"),
             "Quix Streams peer": get(results, "peer.events_per_s"),
             "naive consumer": get(results, "naive.events_per_s")}
    shown = {k: v for k, v in bars.items() if v}
    ax.barh(list(shown), list(shown.values()), color="tab:blue")
    for y, value in enumerate(shown.values()):
        ax.text(value, y, f" {value:,.0f}", va="center")
    ax.invert_yaxis()
    ax.set_xlim(0, max(shown.values(), default=1) * 1.15)  # room for the value labels
    ax.set_xlabel("events/s (200k backlog, same machine, same services)")
    ax.set_title("Throughput per phase")


def _latency(results: dict[str, Any], ax: Any) -> None:
    steady = results.get("steady") or {}
    histogram = steady.get("latency_histogram")
    if histogram:  # the cumulative share of messages by latency
        counts, width = histogram["counts"], histogram["bin_ms"]
        total, running, xs, ys = sum(counts) or 1, 0, [], []
        for i, count in enumerate(counts):
            running += count
            xs.append((i + 1) * width)
            ys.append(100 * running / total)
        ax.plot(xs, ys, label="all messages")
    quantiles = {0: "min", 50: "p50", 95: "p95", 99: "p99", 100: "max"}
    points = [(steady.get(f"{q}_ms"), pct, q) for pct, q in quantiles.items()]
    points = [(v, pct, q) for v, pct, q in points if v is not None]
    ax.plot([v for v, _, _ in points], [pct for _, pct, _ in points], "o--", label="percentiles")
    for value, pct, q in points:
        ax.annotate(f"{q} {value:.0f} ms", (value, pct), textcoords="offset points",
                    xytext=(6, -10), fontsize=8)
    ax.set_xlabel("CreatedAt -> action-tracked arrival, ms")
    ax.set_ylabel("% of messages at or below")
    ax.legend(loc="lower right")
    ax.set_title(f"Latency at {steady.get('target_rate', 0):,.0f} events/s")


def _scale(results: dict[str, Any], ax: Any) -> None:
    points = results.get("scale") or [p for p in [scale_point(results)] if p]
    xs = [p["rows"] / 1e6 for p in points]
    ys = [p["events_per_second"] for p in points]
    ax.plot(xs, ys, marker="o")
    for x, y in zip(xs, ys, strict=True):
        ax.annotate(f"{y:,.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xlim(0, max([*xs, 10.0]) * 1.1)
    ax.set_ylim(0, max([*ys, 1.0]) * 1.25)
    ax.set_xlabel("prefilled action_events rows, millions")
    ax.set_ylabel("job events/s")
    ax.set_title("Throughput against prefilled rows")


def draw(results: dict[str, Any], directory: Path = IMG) -> list[Path]:
    """Write the three charts into ``directory``; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (("throughput", _throughput), ("latency", _latency), ("scale", _scale)):
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        plot(results, ax)
        fig.tight_layout()
        fig.savefig(directory / f"{name}.png")
        plt.close(fig)
        written.append(directory / f"{name}.png")
    return written
