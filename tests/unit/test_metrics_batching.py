"""Metrics moved per batch give exactly what moving them per message gives."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from runtime.metrics import _MS_BUCKETS, observe_durations_ms


def _histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("consume_ms", "test", buckets=_MS_BUCKETS, registry=registry)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }


def test_durations_observed_per_distinct_start_equal_one_observe_per_message() -> None:
    now = 1000.0
    # three polls (one shared received_at each), one on a bucket bound, one past the last bucket
    starts = [999.9995] * 7 + [999.95] * 3 + [1000.0 - 0.25] + [900.0] * 2 + [999.9995]
    per_message, batched = CollectorRegistry(), CollectorRegistry()
    one_by_one = _histogram(per_message)
    for start in starts:
        one_by_one.observe((now - start) * 1000)

    observe_durations_ms(_histogram(batched), now, iter(starts))

    expected, got = _samples(per_message), _samples(batched)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got[("consume_ms_count", "")] == len(starts)
    assert got[("consume_ms_bucket", "+Inf")] == len(starts)


def test_no_starts_observe_nothing() -> None:
    registry = CollectorRegistry()
    observe_durations_ms(_histogram(registry), 5.0, [])
    assert _samples(registry)[("consume_ms_count", "")] == 0
