"""The storage census of the daily partitions (sinks.retention.census): pure, no database."""

from __future__ import annotations

from datetime import date, timedelta

from hypothesis import given
from hypothesis import strategies as st

from sinks.retention import PartitionCensus, census

TODAY = date(2026, 12, 5)


def _names(*offsets: int, table: str = "outbox") -> list[str]:
    return [f"{table}_p{(TODAY + timedelta(days=d)):%Y%m%d}" for d in offsets]


def test_after_a_run_nothing_is_expired_and_today_and_three_days_ahead_are_ready() -> None:
    names = [*_names(-7, -6, -1, 0, 1, 2, 3), "outbox_default"]

    assert census(names, TODAY, 7) == PartitionCensus(expired=0, days_ready=4)


def test_a_partition_past_the_retention_counts_as_expired_as_maintain_drops_it() -> None:
    # maintain drops day D once D + 1 day <= today - retention: D = today - 8 with 7 days
    assert census(_names(-9, -8, 0), TODAY, 7) == PartitionCensus(expired=2, days_ready=1)
    assert census(_names(-7, 0), TODAY, 7).expired == 0


def test_days_ready_stop_at_the_first_missing_day() -> None:
    assert census(_names(0, 1, 3), TODAY, 7).days_ready == 2
    assert census(_names(1, 2, 3), TODAY, 7).days_ready == 0  # today's rows go to DEFAULT


def test_names_without_a_day_are_ignored() -> None:
    names = ["outbox_default", "consumer_idempotency_marks_default", "outbox_p2026", "x_p2026120",
             "outbox_p20261399"]

    assert census(names, TODAY, 7) == PartitionCensus(expired=0, days_ready=0)


@given(st.sets(st.integers(-60, 30)), st.integers(1, 30))
def test_expired_and_ready_partition_the_days_they_count(offsets: set[int], retention: int) -> None:
    counted = census(_names(*offsets), TODAY, retention)

    assert counted.expired == sum(d <= -(retention + 1) for d in offsets)
    assert all(d in offsets for d in range(counted.days_ready))
    assert counted.days_ready not in offsets
