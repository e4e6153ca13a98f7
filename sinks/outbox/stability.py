"""The last stable offsets of the outbox's topics: a transaction left open is seen.

A read_committed reader (CRM) reads a partition only up to its last stable offset (LSO): the
first record of the oldest transaction still open on it. A transaction left open (a hanging
one: a coordinator that lost it, a producer gone with no successor past
``transaction.timeout.ms``) holds every later record back. :meth:`StableOffsets.measure` asks
the broker, per partition of the outbox's topics, for its LSO and its end, without waiting:
``user_activity_outbox_unstable_seconds{topic}`` is how long the LSO of the topic's worst
partition has stayed below its end without moving (0: none). Nothing is written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from runtime.logs import LIBRDKAFKA_LOGGER
from runtime.metrics import OUTBOX_UNSTABLE_SECONDS

STABLE_OFFSETS_INTERVAL = 15.0
"""Seconds between two measurements: two list-offsets requests per broker."""


class StableOffsets:
    """Measures how long each outbox topic's LSO has stood still below its end."""

    def __init__(self, client_config: dict[str, Any], topics: Sequence[str]) -> None:
        config: dict[str, Any] = {**client_config, "logger": LIBRDKAFKA_LOGGER}
        self._admin = AdminClient(config)
        self._topics = list(topics)
        self._held: dict[tuple[str, int], tuple[int, float]] = {}  # (lso, since) held back
        for topic in self._topics:
            OUTBOX_UNSTABLE_SECONDS.labels(topic=topic).set(0)

    def measure(self, timeout: float = 5.0) -> None:
        """Measure every partition once (a topic Kafka does not answer for keeps its value)."""
        now = time.monotonic()
        try:
            metadata = self._admin.list_topics(timeout=timeout)
        except KafkaException:
            return
        for topic in self._topics:
            found = metadata.topics.get(topic)
            if found is None or found.error is not None:
                continue
            partitions = [TopicPartition(topic, p) for p in found.partitions]
            try:
                stable = self._offsets(partitions, IsolationLevel.READ_COMMITTED, timeout)
                end = self._offsets(partitions, IsolationLevel.READ_UNCOMMITTED, timeout)
            except KafkaException:
                continue
            worst = 0.0
            for key, lso in stable.items():
                if lso >= end.get(key, lso):
                    self._held.pop(key, None)
                    continue
                last, since = self._held.get(key, (lso, now))
                since = since if last == lso else now
                self._held[key] = (lso, since)
                worst = max(worst, now - since)
            OUTBOX_UNSTABLE_SECONDS.labels(topic=topic).set(round(worst, 1))

    def _offsets(self, partitions: list[TopicPartition], isolation: IsolationLevel,
                 timeout: float) -> dict[tuple[str, int], int]:
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        futures = self._admin.list_offsets({tp: latest for tp in partitions},
                                           isolation_level=isolation, request_timeout=timeout)
        return {(tp.topic, tp.partition): int(future.result(timeout + 1).offset)
                for tp, future in futures.items()}
