"""Input progress and lag, recorded by the input partitions, computed at scrape time.

Each input partition records where it stands after every poll; the collector computes gauges at
scrape time, so a stopped input cannot freeze them: records behind, seconds since progress and
lag (now - CreateTime of the last record read) while records wait. The flow lag gauges (SPEC §6):
now - CreatedAt of the oldest message a sink of the flow holds; holding none while records wait,
of the newest it finished; else 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector

_FLOW_LAG = ("Now minus the envelope CreatedAt of the oldest {what} the sink holds; holding"
             " none while records wait, of the newest it finished; else 0.")
FLOW_LAG_METRICS = {
    "favorites": ("user_activity_favorites_lag_seconds", _FLOW_LAG.format(what="favorite")),
    "session-linking": ("user_activity_session_linking_lag_seconds",
                        _FLOW_LAG.format(what="sign-in")),
}


@dataclass
class PartitionProgress:
    """Where one input partition stands (written by its poll, read by the collector)."""

    flow: str
    topic: str
    partition: int
    next_offset: int | None = None
    high_watermark: int = -1
    last_read: float = field(default_factory=time.time)  # wall time (the start until then)
    last_read_monotonic: float = field(default_factory=time.monotonic)
    last_record_time: float | None = None  # CreateTime (s) of the last record read

    def read(self, next_offset: int, record_time_ms: int | None, now: float,
             monotonic: float | None = None) -> None:
        """A poll returned records up to ``next_offset - 1`` (at wall time ``now``)."""
        self.next_offset, self.last_read = next_offset, now
        self.last_read_monotonic = time.monotonic() if monotonic is None else monotonic
        if record_time_ms is not None and record_time_ms > 0:
            self.last_record_time = record_time_ms / 1000.0

    def behind(self) -> int:
        """Records between the next offset and the high watermark (0 when unknown)."""
        if self.high_watermark < 0:
            return 0
        return max(0, self.high_watermark - (self.next_offset or 0))

    def lag(self, now: float) -> float:
        """Source-side lag in seconds (0 while caught up)."""
        if not self.behind():
            return 0.0
        since = self.last_record_time if self.last_record_time is not None else self.last_read
        return max(0.0, now - since)

    def stalled_for(self, monotonic_now: float) -> float:
        """Seconds without a record read while records wait (0 while caught up)."""
        return max(0.0, monotonic_now - self.last_read_monotonic) if self.behind() else 0.0


class InputProgress(Collector):
    """The registry of this process's input partitions, and their Prometheus collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int], PartitionProgress] = {}
        self._held: dict[tuple[str, str], float] = {}
        """(flow, sink partition) -> the oldest CreatedAt (epoch s) of what it holds."""
        self._finished: dict[str, float] = {}
        """flow -> the newest CreatedAt (epoch s) its sinks finished."""

    def holding(self, flow: str, part: str, oldest: datetime) -> None:
        """A sink partition of ``flow`` took messages, the oldest created at ``oldest``."""
        with self._lock:
            self._held[(flow, part)] = min(oldest.timestamp(),
                                           self._held.get((flow, part), float("inf")))

    def finished(self, flow: str, part: str, newest: datetime | None) -> None:
        """The sink partition finished all it held; the newest was created at ``newest``."""
        with self._lock:
            self._held.pop((flow, part), None)
            if newest is not None:
                self._finished[flow] = max(newest.timestamp(), self._finished.get(flow, 0.0))

    def track(self, flow: str, topic: str, partition: int) -> PartitionProgress:
        """The (new) progress record of ``topic[partition]`` read by ``flow``."""
        progress = PartitionProgress(flow, topic, partition)
        with self._lock:
            self._parts[(topic, partition)] = progress
        return progress

    def forget(self, progress: PartitionProgress) -> None:
        """The partition is closed."""
        with self._lock:
            if self._parts.get((progress.topic, progress.partition)) is progress:
                del self._parts[(progress.topic, progress.partition)]

    def partitions(self) -> list[PartitionProgress]:
        """The tracked partitions."""
        with self._lock:
            return list(self._parts.values())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges, computed now."""
        now, monotonic_now = time.time(), time.monotonic()
        labels = ["topic", "partition"]
        behind = GaugeMetricFamily(
            "user_activity_input_records_behind",
            "Per input partition: records between the next offset and the high watermark.",
            labels=labels)
        stalled = GaugeMetricFamily(
            "user_activity_input_seconds_since_progress",
            "Per input partition: seconds since a record was last read while records wait"
            " behind the high watermark (0 while caught up).", labels=labels)
        lag = GaugeMetricFamily(
            "user_activity_input_lag_seconds",
            "Per input partition: now minus CreatedAt (Kafka CreateTime) of the last record"
            " read while records wait behind the high watermark (0 while caught up).",
            labels=labels)
        flow_lag: dict[str, float] = dict.fromkeys(FLOW_LAG_METRICS, 0.0)
        with self._lock:
            held, finished = dict(self._held), dict(self._finished)
        for part in self.partitions():
            values = [part.topic, str(part.partition)]
            part_lag = part.lag(now)
            behind.add_metric(values, part.behind())
            stalled.add_metric(values, part.stalled_for(monotonic_now))
            lag.add_metric(values, part_lag)
            if part.flow in flow_lag and part_lag:
                newest = finished.get(part.flow)
                flow_lag[part.flow] = max(flow_lag[part.flow],
                                          part_lag if newest is None else now - newest)
        for (flow, _part), oldest in held.items():
            if flow in flow_lag:
                flow_lag[flow] = max(flow_lag[flow], now - oldest)
        yield from (behind, stalled, lag)
        for flow, (name, documentation) in FLOW_LAG_METRICS.items():
            yield GaugeMetricFamily(name, documentation, value=flow_lag[flow])


INPUT_PROGRESS = InputProgress()
"""This process's input partitions (collected by the default Prometheus registry)."""
REGISTRY.register(INPUT_PROGRESS)
