"""Source-side lag and progress gauges are computed at scrape time, so they never freeze."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sources.progress import InputProgress, PartitionProgress


def _samples(progress: InputProgress) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(progress)
    text = generate_latest(registry).decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_a_caught_up_partition_reports_no_lag_however_old_its_last_record() -> None:
    part = PartitionProgress("favorites", "t", 0, next_offset=10, high_watermark=10)
    part.read(10, record_time_ms=1_000, now=2_000.0, monotonic=2_000.0)  # long ago, then nothing
    assert part.behind() == 0
    assert part.lag(now=5_000.0) == 0.0
    assert part.stalled_for(5_000.0) == 0.0


def test_a_stopped_partition_with_a_backlog_reports_growing_lag_and_no_progress_time() -> None:
    part = PartitionProgress("favorites", "t", 3)
    part.read(100, record_time_ms=1_000_000, now=1_001.0, monotonic=1_001.0)
    part.high_watermark = 500
    assert part.behind() == 400
    assert part.lag(now=1_060.0) == 60.0
    assert part.lag(now=1_600.0) == 600.0  # nothing is read, the gauge still rises
    assert part.stalled_for(1_600.0) == 599.0


def test_a_step_of_the_wall_clock_does_not_move_the_time_since_progress() -> None:
    """Read at wall 1,001 s (monotonic 50 s), then the wall clock jumps an hour ahead."""
    part = PartitionProgress("favorites", "t", 3, high_watermark=500)
    part.read(100, record_time_ms=1_000_000, now=1_001.0, monotonic=50.0)
    assert part.stalled_for(60.0) == 10.0  # not 3,610 (no false UserActivityInputStalled)


def test_a_partition_that_never_read_a_record_measures_from_its_start() -> None:
    part = PartitionProgress("favorites", "t", 1, high_watermark=5, last_read=100.0)
    assert part.lag(now=130.0) == 30.0


def test_the_collector_exports_per_partition_gauges_and_the_flows_largest_lag() -> None:
    progress = InputProgress()
    behind = progress.track("favorites", "added", 0)
    behind.read(10, record_time_ms=1, now=1.0)
    behind.high_watermark = 50
    caught_up = progress.track("favorites", "removed", 0)
    caught_up.read(7, record_time_ms=1, now=1.0)
    caught_up.high_watermark = 7
    signed_in = progress.track("session-linking", "signed-in", 2)

    samples = _samples(progress)

    assert samples["user_activity_input_records_behind{partition=0,topic=added}"] == 40
    assert samples["user_activity_input_records_behind{partition=0,topic=removed}"] == 0
    assert samples["user_activity_input_lag_seconds{partition=0,topic=removed}"] == 0
    assert samples["user_activity_input_lag_seconds{partition=0,topic=added}"] > 1e6
    assert samples["user_activity_favorites_lag_seconds"] == (
        samples["user_activity_input_lag_seconds{partition=0,topic=added}"]
    )
    assert samples["user_activity_session_linking_lag_seconds"] == 0
    progress.forget(signed_in)
    assert "user_activity_input_lag_seconds{partition=2,topic=signed-in}" not in _samples(progress)
