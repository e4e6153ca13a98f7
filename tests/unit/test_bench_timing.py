"""The timing phase's summary of a contract's rounds, and results kept across partial runs."""

from __future__ import annotations

from typing import Any

from bench.contracts import Measured
from bench.report import carry_over
from bench.timing import CONTRACTS, Contract, summarise

STAND_STILL = Contract("stand_still", "rows stand still", "<=", 3.0, lambda _ctx: Measured(0.0))


def test_every_round_within_the_target_is_met_with_the_median_and_the_max() -> None:
    entry = summarise(STAND_STILL, [Measured(1.0), Measured(3.0), Measured(0.5)], 3)

    assert (entry["median"], entry["max"], entry["met"]) == (1.0, 3.0, "met")
    assert entry["seconds"] == [1.0, 3.0, 0.5]
    assert entry["target"] == "<= 3"


def test_one_round_over_the_target_is_not_met() -> None:
    entry = summarise(STAND_STILL, [Measured(1.0), Measured(3.01), Measured(0.5)], 3)

    assert (entry["median"], entry["max"], entry["met"]) == (1.0, 3.01, "not met")


def test_a_failed_round_fails_the_contract_and_says_why() -> None:
    entry = summarise(STAND_STILL, [Measured(1.0, {"outbox_s": 2.0}), "exit -9"], 2)

    assert entry["met"] == "failed"
    assert entry["rounds"] == [{"seconds": 1.0, "outbox_s": 2.0}, {"failed": "exit -9"}]
    assert (entry["median"], entry["max"]) == (1.0, 1.0)


def test_a_contract_not_measured_says_why_and_has_no_figure() -> None:
    entry = summarise(STAND_STILL, [], 3, not_measured="external services")

    assert entry == {"what": "rows stand still", "target": "<= 3", "met": "not measured",
                     "why": "external services"}


def test_every_contract_has_its_own_name_and_a_positive_target() -> None:
    names = [c.name for c in CONTRACTS]

    assert len(set(names)) == len(names)
    assert all(c.target > 0 and c.op in {"<", "<="} for c in CONTRACTS)


def test_a_timing_run_keeps_the_full_runs_sections_and_the_meta_of_the_runs_they_come_from(
) -> None:
    full = {"run_id": "full", "args": {"rows": 2_000_000}}
    previous: dict[str, Any] = {
        "meta": {**full, "carried_over": {"peer": "old"},
                 "earlier_runs": {"old": {"run_id": "old"}, "older": {"run_id": "older"}}},
        "job": {"workers_1": {}}, "peer": {}, "targets": {}, "ratios": {}, "timing": {"old": 1}}
    results: dict[str, Any] = {"meta": {"run_id": "timing"}, "timing": {"new": 1}}

    carry_over(results, previous)

    assert results["timing"] == {"new": 1}
    assert results["job"] == {"workers_1": {}} and results["peer"] == {}
    assert "targets" not in results and "ratios" not in results
    assert results["meta"]["carried_over"] == {"job": "full", "peer": "old"}
    assert results["meta"]["earlier_runs"] == {"full": full, "old": {"run_id": "old"}}


def test_a_run_that_measures_everything_carries_nothing() -> None:
    results: dict[str, Any] = {"meta": {"run_id": "new"}, "job": {}}

    carry_over(results, {"meta": {"run_id": "old"}, "job": {"old": 1}})

    assert results == {"meta": {"run_id": "new"}, "job": {}}
