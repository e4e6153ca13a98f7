"""A record batch that kills the process at every start is skipped from the third start.

librdkafka inflates a gzip, lz4 or snappy batch whole before any record of it reaches Python:
a decompression bomb kills the job at every start, each resuming before it. Each start of a
tailed partition counts itself in the flow's consumer group, as the committed offset's metadata
(:func:`count_start`: ``ua-starts=N``); a snapshot that moves the offset, and a clean stop,
commit without it. From the 2nd start in a row, the partition is read by a
:class:`CarefulReader` up to the high watermark of its start: one batch per fetch, and before
each fetch its offset committed with the count, so a death leaves the offset of the batch that
killed it. The 3rd start skips the record there; each start that dies right after a skip skips
the next one (a batch of several records). A bomb's inflation outlasts a commit's round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

CAREFUL_FROM_START = 2
SKIP_AT_START = 3
_STARTS = "ua-starts="

ONE_BATCH_PER_FETCH = {
    "max.partition.fetch.bytes": 1, "fetch.max.bytes": 1000, "message.max.bytes": 1000,
    # no wait between two fetches (librdkafka's default is a second per batch)
    "queued.min.messages": 1, "fetch.queue.backoff.ms": 0,
}


def start_count(metadata: str | None) -> int:
    """The starts recorded in a committed offset's metadata (0: none)."""
    count = (metadata or "").removeprefix(_STARTS)
    return int(count) if metadata and metadata.startswith(_STARTS) and count.isdigit() else 0


def count_start(consumer: Consumer, topic: str, partition: int, offset: int) -> tuple[int, int]:
    """Record one more start of ``topic[partition]`` resuming at ``offset``: (starts, where).

    ``where`` is the committed offset when the last start left a count at or after ``offset``
    (a careful reader's), else ``offset``. Raises ``KafkaException`` when the group cannot be
    read within 2 s. The count is committed asynchronously.
    """
    committed = consumer.committed([TopicPartition(topic, partition)], timeout=2)[0]
    before = start_count(committed.metadata)
    starts, where = (before + 1, committed.offset) if before and committed.offset >= offset \
        else (1, offset)
    consumer.commit(offsets=[TopicPartition(topic, partition, where,
                                            metadata=f"{_STARTS}{starts}")], asynchronous=True)
    return starts, where


class CarefulReader:
    """Reads one partition one batch per fetch; a fetch only once its offset is committed.

    ``death``: the offset where the last start died, when this start must skip the record
    there instead of fetching it (see the module doc).
    """

    def __init__(self, config: Mapping[str, Any], topic: str, partition: int, *,
                 starts: int, where: int, until: int) -> None:
        self.until = until
        self.death = where if starts >= SKIP_AT_START else None
        self._starts = starts
        self._after_skip = False
        self._recorded = where  # committed with the count: fetching there is on record
        self._tp = TopicPartition(topic, partition)
        self.consumer = Consumer({**config, **ONE_BATCH_PER_FETCH})
        self._assigned = False

    def move(self) -> None:
        """Fetch nothing more until the next :meth:`take` (which reads at its offset)."""
        self.consumer.unassign()
        self._assigned = False

    def skipped(self) -> None:
        """The record at :attr:`death` was skipped."""
        self.death = None
        self._after_skip = True
        self.move()

    def take(self, next_offset: int) -> list[Message]:
        """The next batch (or nothing yet); never fetches at an offset not on record."""
        if not self._assigned:
            if next_offset > self._recorded:
                try:
                    self.consumer.commit(offsets=[TopicPartition(
                        self._tp.topic, self._tp.partition, next_offset,
                        metadata=f"{_STARTS}{self._starts}")], asynchronous=False)
                except KafkaException:
                    return []  # Kafka unreachable: fetch nothing until it is on record
                self._recorded = next_offset
            self.consumer.assign([TopicPartition(self._tp.topic, self._tp.partition,
                                                 next_offset)])
            self._assigned = True
        messages = self.consumer.consume(1000, 0)
        if messages:
            self.move()  # unassigned, not paused: a resumed partition's next fetch lags a second
            if self._after_skip:  # the skipped batch has ended: a next death counts anew
                self._starts, self._after_skip = 1, False
        return messages

    def drained_position(self) -> int | None:
        """The consumer's position (past markers and aborted records), None before one."""
        offset = self.consumer.position([self._tp])[0].offset
        return offset if offset >= 0 else None

    def close(self) -> None:
        """Close the reader's consumer."""
        self.consumer.close()
