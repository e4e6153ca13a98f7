"""A record batch that kills the process at every start is skipped at the fourth start.

librdkafka inflates a gzip, lz4 or snappy batch whole before Python sees it: a decompression bomb
kills the job at every start. Each start of a tailed partition counts itself in the committed
offset's metadata of the flow's group (``ua-starts=N``); a snapshot that moves the offset, and a
clean stop, commit without it. From the 2nd start in a row, partitions with a backlog are read by
:class:`CarefulReader`: one partition of the process at a time, one batch per fetch, up to the
start's high watermark, each fetch's offset committed first (``;fetching=K``), so a death leaves
the batch that killed it. After two careful starts died fetching one offset, the next skips it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

CAREFUL_FROM_START = 2
SKIP_AFTER_DEATHS = 2
ONE_BATCH_PER_FETCH = {
    "max.partition.fetch.bytes": 1, "fetch.max.bytes": 1000, "message.max.bytes": 1000,
    # no wait between two fetches (librdkafka's default is a second per batch)
    "queued.min.messages": 1, "fetch.queue.backoff.ms": 0,
}
_turn: list[tuple[str, int]] = []  # the partition of this process reading carefully now
_turn_lock = threading.Lock()


def parse(metadata: str | None) -> tuple[int, int]:
    """(starts, careful fetches) recorded in a committed offset's metadata ((0, 0): none)."""
    fields = dict(f.split("=", 1) for f in (metadata or "").split(";") if "=" in f)
    starts, fetching = fields.get("ua-starts", ""), fields.get("fetching", "")
    return (int(starts) if starts.isdigit() else 0,
            int(fetching) if starts.isdigit() and fetching.isdigit() else 0)


def _metadata(starts: int, fetching: int) -> str:
    return f"ua-starts={starts}" + (f";fetching={fetching}" if fetching else "")


def count_start(consumer: Consumer, topic: str, partition: int, offset: int
                ) -> tuple[int, int, int]:
    """Count a start of ``topic[partition]`` resuming at ``offset``: (starts, at, fetching).

    ``at``: the offset the last count was left at (if at or after ``offset``); ``fetching``:
    careful starts that died fetching it. Raises ``KafkaException`` (group unread in 2 s).
    """
    committed = consumer.committed([TopicPartition(topic, partition)], timeout=2)[0]
    before, fetching = parse(committed.metadata)
    resumed = before and committed.offset >= offset
    starts, at, fetching = (before + 1, committed.offset, fetching) if resumed else (1, offset, 0)
    consumer.commit(offsets=[TopicPartition(topic, partition, at, metadata=_metadata(
        starts, fetching))], asynchronous=True)
    return starts, at, fetching


class CarefulReader:
    """Reads one partition one batch per fetch, each fetch on record first (module doc)."""

    def __init__(self, config: Mapping[str, Any], topic: str, partition: int, *,
                 starts: int, at: int, fetching: int, until: int) -> None:
        self.until = until
        self.death = at if fetching >= SKIP_AFTER_DEATHS else None
        """The offset a careful start died fetching: its record is skipped, not fetched."""
        self._starts, self._at, self._fetching = starts, at, fetching
        self._key = (topic, partition)
        self._marked: int | None = None  # the offset on record as being fetched
        self.consumer, self._assigned = Consumer({**config, **ONE_BATCH_PER_FETCH}), False

    def move(self) -> None:
        """Fetch nothing more until the next :meth:`take` (which reads at its offset)."""
        self.consumer.unassign()
        self._assigned = False

    def skipped(self) -> None:
        """The record at :attr:`death` was skipped."""
        self.death = None
        self.move()

    def take(self, next_offset: int, limit: int, seconds: float = 0.1) -> list[Message]:
        """Up to ``limit`` records, batch after batch for up to ``seconds``, each fetch on record.

        Nothing when not this partition's turn or Kafka is unreachable; stops at an error and
        before :attr:`death`.
        """
        with _turn_lock:
            if not _turn:
                _turn.append(self._key)
            if _turn[0] != self._key:
                return []
        taken: list[Message] = []
        deadline = time.monotonic() + seconds
        while len(taken) < limit and next_offset != self.death:
            if not self._assigned:
                if next_offset >= self._at:  # before it: batches a careful start read already
                    fetching = self._fetching + 1 if next_offset == self._at else 1
                    if not self._commit(next_offset, fetching, wait=True):
                        break  # Kafka unreachable: fetch nothing until it is on record
                    self._marked = next_offset
                self.consumer.assign([TopicPartition(*self._key, next_offset)])
                self._assigned = True
            first = self.consumer.poll(max(0.0, deadline - time.monotonic()))
            if first is None:
                break
            room = limit - len(taken) - 1
            messages = [first, *(self.consumer.consume(room, 0) if room else [])]  # its batch
            self.move()  # unassigned, not paused: a resumed partition's next fetch lags a second
            if self._marked is not None:  # fetched alive: no longer a death spot
                self._commit(self._marked, 0, wait=False)
                self._marked = None
            taken += messages
            last = messages[-1]
            if last.error() is not None or last.offset() is None:
                break
            next_offset = last.offset() + 1  # type: ignore[operator]
        return taken

    def _commit(self, offset: int, fetching: int, *, wait: bool) -> bool:
        offsets = [TopicPartition(*self._key, offset, metadata=_metadata(self._starts, fetching))]
        try:
            if wait:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            else:
                self.consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException:
            return False
        return True

    def drained_position(self) -> int | None:
        """The consumer's position (past markers and aborted records), None before one."""
        offset = self.consumer.position([TopicPartition(*self._key)])[0].offset
        return offset if offset >= 0 else None

    def close(self) -> None:
        """Close the reader's consumer; the next careful partition of the process may read."""
        with _turn_lock:
            if self._key in _turn:
                _turn.remove(self._key)
        self.consumer.close()
