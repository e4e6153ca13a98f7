"""The A/B's paired ratios (``bench.report.paired_ratios``): each round's head/ref, their mean."""

from __future__ import annotations

import pytest

from bench.report import paired_ratios


def test_the_pairs_of_the_combined_ab_give_its_geometric_mean() -> None:
    """Five paired rounds of an A/B (events/s, this / before), as measured once on this machine."""
    head = [11608.9, 14388.5, 13709.6, 12321.3, 11998.6]
    ref = [12231.7, 13287.3, 13850.9, 13300.1, 11824.3]

    found = paired_ratios(head, ref)

    assert found["pairs"] == [0.949, 1.083, 0.99, 0.926, 1.015]
    assert found["geomean"] == 0.991
    assert found["head_lower"] == 3


def test_a_constant_factor_is_found_whatever_the_drift_between_rounds() -> None:
    ref = [10_000.0, 16_000.0, 12_000.0]  # the machine's hour changes between rounds
    head = [0.95 * r for r in ref]

    assert paired_ratios(head, ref) == {"pairs": [0.95] * 3, "geomean": 0.95, "head_lower": 3}


def test_no_rounds_or_a_zero_give_no_mean_and_unequal_sides_raise() -> None:
    assert paired_ratios([], [])["geomean"] is None
    assert paired_ratios([0.0], [1.0])["geomean"] is None
    with pytest.raises(ValueError):
        paired_ratios([1.0, 2.0], [1.0])
