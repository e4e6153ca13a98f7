"""The scaling ratios of a benchmark run (``bench.report``): each job run over ``workers_1``."""

from __future__ import annotations

from typing import Any

from bench.report import evaluate


def _run(rate: float, job: float, postgres: float, kafka: float) -> dict[str, Any]:
    return {"events_per_s": rate, "cpu_us_per_event": {
        "job": job, "postgres": postgres, "kafka": kafka, "total": job + postgres + kafka}}


def test_two_workers_and_two_processes_are_rated_against_one_worker_and_held_to_their_targets(
) -> None:
    results: dict[str, Any] = {"meta": {"run_id": "r"}, "job": {
        "workers_1": _run(10_000.0, 40.0, 30.0, 10.0),
        "workers_2": _run(12_000.0, 50.0, 30.0, 12.0),
        "processes_2": _run(8_000.0, 80.0, 33.0, 10.0)}}

    evaluate(results)

    assert results["ratios"]["versus_1_worker"] == {
        "workers_2": {"events_per_s": 1.2, "job_cpu_us_per_event": 1.25,
                      "postgres_cpu_us_per_event": 1.0, "kafka_cpu_us_per_event": 1.2,
                      "total_cpu_us_per_event": 1.15},
        "processes_2": {"events_per_s": 0.8, "job_cpu_us_per_event": 2.0,
                        "postgres_cpu_us_per_event": 1.1, "kafka_cpu_us_per_event": 1.0,
                        "total_cpu_us_per_event": 1.54}}
    assert results["targets"]["workers_2_job_cpu_vs_1_worker"] == {
        "value": 1.25, "target": "<= 1.3", "met": "met"}
    assert results["targets"]["processes_2_job_cpu_vs_1_worker"] == {
        "value": 2.0, "target": "<= 1.5", "met": "not met"}


def test_a_run_without_a_cluster_leaves_its_target_not_measured() -> None:
    results: dict[str, Any] = {"meta": {"run_id": "r"},
                               "job": {"workers_1": _run(10_000.0, 40.0, 30.0, 10.0)}}

    evaluate(results)

    assert results["ratios"]["versus_1_worker"] == {}
    assert results["targets"]["processes_2_job_cpu_vs_1_worker"]["met"] == "not measured"
