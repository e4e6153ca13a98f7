"""A record batch librdkafka refuses at every fetch: where it ends, so the partition moves on.

librdkafka reports a zstd batch that decompresses past ``receive.message.max.bytes`` (or corrupt
bytes) as ``_BAD_COMPRESSION`` at the batch's base offset, and fetches it again forever. A fetch
from inside the batch gets the same error, from past it what follows: :func:`find_batch_end`
finds that offset with :meth:`BatchProbe.inside`, asked of the broker by a consumer of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

UNDECODABLE_CODES = frozenset({KafkaError._BAD_COMPRESSION})
"""Consumer error codes of a batch that fails the same way at every fetch."""


def find_batch_end(base: int, high: int, inside: Callable[[int], bool]) -> int:
    """The first offset after the batch at ``base``: ``base < end <= high``.

    ``inside(offset)``: a fetch from ``offset`` still gets that batch (never asked of ``base``
    or ``high``). Steps double, then halve: about 2·log2(n) + 1 probes for n records.
    """
    lo, hi, step = base, high, 1  # inside(lo), not inside(hi)
    while lo + step < hi:
        if not inside(lo + step):
            hi = lo + step
            break
        lo += step
        step *= 2
    while hi - lo > 1:
        middle = (lo + hi) // 2
        if inside(middle):
            lo = middle
        else:
            hi = middle
    return hi


class ProbeFailedError(Exception):
    """The broker gave no answer about an offset in time (unreachable, slow): try later."""


class BatchProbe:
    """Asks the broker whether a fetch from an offset still gets the batch at ``base``."""

    def __init__(self, config: Mapping[str, Any], topic: str, partition: int, base: int, *,
                 stopping: Callable[[], bool], timeout: float = 10.0) -> None:
        self._tp, self._base, self._stopping = TopicPartition(topic, partition), base, stopping
        self._timeout, self._consumer = timeout, Consumer(dict(config))

    def inside(self, offset: int) -> bool:
        """True when a fetch from ``offset`` gets the batch at ``base`` (its error again).

        Raises :class:`ProbeFailedError` after the time-out, or at once on a stop request.
        """
        self._consumer.assign([TopicPartition(self._tp.topic, self._tp.partition, offset)])
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline and not self._stopping():
            for msg in self._consumer.consume(16, 0.2):
                error = msg.error()
                if error is None:
                    return False
                if error.code() in UNDECODABLE_CODES:
                    return msg.offset() == self._base
            if self._consumer.position([self._tp])[0].offset > offset:
                return False
        raise ProbeFailedError(f"no answer for {self._tp.topic}[{self._tp.partition}]@{offset}")

    def close(self) -> None:
        """Close the probe's consumer."""
        self._consumer.close()
