"""The benchmark (``python -m bench``) runs end to end at a tiny size on the suite's services.

It is a subprocess (``--small --external``, with a one-round ``--compare HEAD``) against the
session's Kafka broker and PostgreSQL server (the benchmark creates and drops its own ``bench_*``
databases there). Only that it works is checked here: every section is present with positive
numbers; the targets are for the full run on an otherwise idle machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench.report import evaluate, merge_scale, print_table
from bench.services import POSTGRES_SETTINGS, server_durability
from devenv.postgres_server import PostgresServer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _positive(results: dict[str, Any], *path: str) -> float:
    node: Any = results
    for key in path:
        assert isinstance(node, dict) and key in node, f"missing {'.'.join(path)}"
        node = node[key]
    assert isinstance(node, (int, float)) and node > 0, f"{'.'.join(path)} = {node!r}"
    return float(node)


@pytest.mark.timeout(300)
def test_bench_small_writes_every_section_with_positive_numbers(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "results.json"
    env = {
        **os.environ,
        "USER_ACTIVITY_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "USER_ACTIVITY_DATABASE_URL": database_url,
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--small", "--external", "--compare", "HEAD",
         "--compare-rounds", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    results = json.loads(out.read_text())
    assert "error" not in results
    assert set(results["meta"]["postgres"]) == {"fsync", "synchronous_commit"}

    _positive(results, "prefill", "action_events_rows")
    assert results["warmup"]["ok"], results["warmup"]  # the job once, before the measured runs
    _positive(results, "warmup", "events_per_s")
    for workers in ("workers_1", "workers_2", "processes_2"):
        run = results["job"][workers]
        assert run["ok"], run
        assert run["rows_committed"] == run["expected_recorded"]
        assert run["action_tracked_distinct"] == run["expected_recorded"]
        _positive(results, "job", workers, "events_per_s")
        _positive(results, "job", workers, "wall_s")
        _positive(results, "job", workers, "wal_bytes_per_recorded_event")
        for part in ("job", "postgres", "kafka", "total"):
            _positive(results, "job", workers, "cpu_us_per_event", part)
    _positive(results, "naive", "events_per_s")
    _positive(results, "naive", "recorded")
    _positive(results, "ceiling", "events_per_s")
    peer = results["peer"]
    assert peer["ok"], peer
    assert peer["rows_committed"] == peer["expected_recorded"] == run["expected_recorded"]
    _positive(results, "peer", "events_per_s")
    _positive(results, "peer", "cpu_us_per_event", "total")
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        _positive(results, "steady", key)
    assert results["steady"]["ok"], results["steady"]
    _positive(results, "dedup", "rss_mb")
    _positive(results, "restart", "caught_up_s")
    _positive(results, "ratios", "job_vs_naive")
    _positive(results, "ratios", "job_vs_ceiling")
    _positive(results, "ratios", "job_vs_peer")
    _positive(results, "ratios", "total_cpu_us_per_event")
    compare = results["compare"]
    assert "failure" not in compare, compare
    assert len(compare["events_per_s"]["head"]) == len(compare["events_per_s"]["ref"]) == 1
    _positive(results, "compare", "paired_head_to_ref", "geomean")
    _positive(results, "compare", "cpu_paired_head_to_ref", "geomean")
    assert results["scale_job"]["ok"], results["scale_job"]
    assert [p["rows"] for p in results["scale"]] == [
        results["prefill"]["action_events_rows"], results["prefill_scale"]["action_events_rows"]]
    assert results["ratios"]["scale_points_from_this_run"] == [5_000, 20_000]
    assert set(results["targets"]) == {
        "job_events_per_s", "job_vs_naive", "job_vs_ceiling", "job_vs_peer",
        "total_cpu_us_per_event", "wal_bytes_per_recorded_event", "steady_p99_ms",
        "dedup_rss_mb", "restart_caught_up_s", "scale_largest_vs_2m",
        "workers_2_job_cpu_vs_1_worker", "processes_2_job_cpu_vs_1_worker",
    }
    for key, target in results["targets"].items():
        # the scale target needs a point above 2M rows (the full run's 10M)
        expected = ("not measured",) if key == "scale_largest_vs_2m" else ("met", "not met")
        assert target["met"] in expected, target
    assert "measure" in proc.stdout  # the table
    print(f"bench --small took {elapsed:.1f}s")


@pytest.mark.timeout(120)
def test_the_benchmarks_own_postgresql_flushes_every_commit(tmp_path: Path) -> None:
    """The benchmark's PostgreSQL runs with fsync on (the dev server's default is off).

    Its naive consumer commits once per message, and WAL per event is a durable-commit figure.
    """
    with PostgresServer(tmp_path / "postgres", settings=POSTGRES_SETTINGS) as server, \
            psycopg.connect(server.dsn(), autocommit=True) as conn:
        assert server_durability(conn) == {"fsync": "on", "synchronous_commit": "on"}


def test_the_scale_curve_keeps_other_row_counts_and_replaces_this_one() -> None:
    def run(rows: int, rate: float) -> dict[str, Any]:
        return {"meta": {"run_id": f"r{rows}", "code": {"commit": "c"}},
                "prefill": {"action_events_rows": rows},
                "job": {"workers_1": {"events_per_s": rate}}}

    ten_million = run(10_000_000, 9_000.0)
    merge_scale(ten_million, {"scale": [{"rows": 2_000_000, "events_per_second": 10_000.0},
                                        {"rows": 10_000_000, "events_per_second": 1.0}]})
    assert [(p["rows"], p["events_per_second"]) for p in ten_million["scale"]] == [
        (2_000_000, 10_000.0), (10_000_000, 9_000.0)]
    evaluate(ten_million)
    assert ten_million["targets"]["scale_largest_vs_2m"] == {
        "value": 0.9, "target": ">= 0.9", "met": "met"}
    assert ten_million["ratios"]["scale_points_from_this_run"] == [10_000_000]


def test_a_run_with_its_scale_phase_measures_the_scale_ratio_by_itself() -> None:
    results: dict[str, Any] = {
        "meta": {"run_id": "r", "code": {"commit": "c"}},
        "prefill": {"action_events_rows": 2_000_000},
        "job": {"workers_1": {"events_per_s": 20_000.0}, "workers_2": {"events_per_s": 15_000.0}},
        "prefill_scale": {"action_events_rows": 10_000_000},
        "scale_job": {"events_per_s": 19_000.0}}

    merge_scale(results, {"scale": [{"rows": 10_000_000, "events_per_second": 1.0}]})
    evaluate(results)

    assert results["ratios"]["scale_points_from_this_run"] == [2_000_000, 10_000_000]
    assert results["targets"]["scale_largest_vs_2m"]["value"] == 0.95


def test_the_committed_results_are_evaluated_and_printed(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    evaluate(results)
    print_table(results)
    # each target has its run's figure and verdict; whether an hour met it is the benchmark's
    # to say (docs/performance.md), not a test's
    assert {t["met"] for t in results["targets"].values()} <= {"met", "not met"}, \
        results["targets"]
    assert all(isinstance(t["value"], (int, float)) for t in results["targets"].values())
    printed = capsys.readouterr().out
    assert all(f"target {key}" in printed for key in results["targets"])
