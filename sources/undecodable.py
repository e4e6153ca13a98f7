"""A record batch librdkafka cannot decompress: find where it ends, so the partition moves on.

librdkafka reports a batch it cannot decompress (``_BAD_COMPRESSION``: its records decompress
to more than ``receive.message.max.bytes``, e.g. one highly compressible record of 150 MB that
the broker accepted because its *compressed* batch fits the topic's limit; or corrupt bytes)
with the batch's base offset only, and then fetches the same batch again, forever: without
help the partition never moves and everything behind the batch waits. The batch's last offset
is in its header, which librdkafka does not hand over; but a fetch from an offset inside the
batch gets the same batch (the same error), and a fetch from past it gets what follows. So the
end is the smallest offset whose fetch is not that error (:func:`find_batch_end`, pure), asked
of the broker by :class:`BatchProbe` (a consumer of its own: the worker's shared consumer and
its other partitions are not touched).

Only zstd batches are held to ``receive.message.max.bytes`` once decompressed: librdkafka
decompresses gzip, lz4 and snappy batches whatever their size (measured, librdkafka 2.16: a
5 MB record of zeros in each codec against a 2 MB limit; only the zstd one was refused). A
decompression bomb in those codecs is read whole, in memory (docs/architecture.md, "Input").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from runtime.logs import LIBRDKAFKA_LOGGER
from runtime.shutdown import SHUTDOWN

UNDECODABLE_CODES = frozenset({KafkaError._BAD_COMPRESSION})
"""Consumer error codes of a batch that fails the same way at every fetch."""


def find_batch_end(base: int, high: int, inside: Callable[[int], bool]) -> int:
    """The first offset after the batch that starts at ``base``: ``base < end <= high``.

    ``inside(offset)`` says whether a fetch from ``offset`` still gets that batch (true for
    ``base`` itself, which is never asked). ``high``, the partition's high watermark, is past
    every batch and is never asked either. Steps double from ``base`` until a probe is past the
    batch, then halve: at most about 2·log2(n) + 1 probes for a batch of n records, one for a
    batch of one record (the usual case: a record larger than the producer's ``batch.size`` is
    sent in a batch of its own).
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
    """The broker gave no answer about an offset in time (unreachable, slow): try again later."""


class BatchProbe:
    """Asks the broker whether a fetch from an offset still gets the undecodable batch.

    One consumer (the input's configuration, so the same ``receive.message.max.bytes``),
    assigned anew at each probed offset; closed by :meth:`close`.
    """

    def __init__(self, config: Mapping[str, Any], topic: str, partition: int, base: int,
                 *, timeout: float = 10.0) -> None:
        self._topic = topic
        self._partition = partition
        self._base = base
        self._timeout = timeout
        self._consumer = Consumer({
            **config, "logger": LIBRDKAFKA_LOGGER, "group.id": "user-activity-stream-probe",
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "enable.partition.eof": False, "auto.offset.reset": "earliest"})

    def inside(self, offset: int) -> bool:
        """True when a fetch from ``offset`` gets the batch at ``base`` (its error again).

        False when a record at or after ``offset`` arrives, another undecodable batch does (the
        next one: its error names its own base offset, so the probe is past this batch), or the
        consumer's position passes ``offset`` with nothing to deliver (control records, aborted
        ones). Raises :class:`ProbeFailedError` when none of these happens within the time-out
        (or a stop is requested meanwhile).
        """
        consumer = self._consumer
        consumer.assign([TopicPartition(self._topic, self._partition, offset)])
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline and not SHUTDOWN.requested():
            for msg in consumer.consume(16, 0.2):
                error = msg.error()
                if error is None:
                    return False
                if error.code() in UNDECODABLE_CODES:
                    return msg.offset() == self._base
            position = consumer.position([TopicPartition(self._topic, self._partition)])
            if position[0].offset > offset:
                return False
        raise ProbeFailedError(f"no answer for {self._topic}[{self._partition}]@{offset}")

    def close(self) -> None:
        """Close the probe's consumer."""
        self._consumer.close()


__all__ = ["UNDECODABLE_CODES", "BatchProbe", "ProbeFailedError", "find_batch_end"]
