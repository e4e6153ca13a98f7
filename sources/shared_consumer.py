"""One Kafka consumer per worker thread, shared by every input partition that worker reads.

A consumer per partition (the layout of Bytewax's own ``KafkaSource``) costs a fetch loop, a
connection and its threads per partition, and the broker answers every one of them each time a
producer appends to its partition. Measured on this machine's broker at 2,000 records/s over
24 partitions: the consumers cost the broker 0.3-0.4 cores and themselves 0.15; one consumer
that lets the broker gather up to 64 KiB for ``fetch_wait_ms`` costs 0.07 and 0.03. At
12,000/s tailed: 0.21 + 0.11 cores against 0.07 + 0.03.

Guarantees:

- a partition's records reach only that partition, in offset order: each has its own buffer,
  filled from the shared queue;
- positions stay the partitions' own. The consumer is told where a partition starts (its next
  offset) when it joins and when the consumer is replaced, never otherwise. Records buffered
  but not yet taken are after that offset, so dropping them (a replacement, a partition
  leaving) loses nothing: they are fetched again;
- bounded memory: librdkafka's prefetch is bounded per consumer (``queued.max.messages.kbytes``),
  and a partition fills the buffers only when its own is empty and fewer than four polls'
  worth of records wait in all of them;
- client errors (every broker down) reach every member; a failed informational commit reaches
  the partitions it was for.

Thread use: a worker's partitions are polled on its own thread, so a member only ever calls in
from one thread; the lock makes a shared consumer safe anyway if Bytewax ever builds a
partition on another thread than the one that polls it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from runtime.logs import LIBRDKAFKA_LOGGER

FETCH_MIN_BYTES = 65_536
"""The broker answers a fetch once this much waits (or after ``fetch_wait_ms``)."""

PREFETCH_KBYTES = 8_192
"""librdkafka's local queue for all of a worker's partitions (per consumer, not per partition)."""

_FILL_CAP_POLLS = 4
"""No fill while this many polls' worth of records already wait in the buffers."""


class Member(Protocol):
    """What a shared consumer needs of one of its partitions."""

    topic: str
    partition: int

    def assign_offset(self) -> int:
        """Where the partition reads on: its next offset (or ``OFFSET_BEGINNING``)."""

    def on_client_error(self, error: KafkaError) -> None:
        """A client-level error of the consumer (e.g. every broker down)."""

    def commit_failed(self, error: object) -> None:
        """The informational commit of this partition's offset failed."""


class SharedConsumer:
    """The consumer of one worker thread, one client configuration and one consumer group."""

    def __init__(self, config: Mapping[str, Any], group: str, fetch_wait_ms: int,
                 forget: Callable[[SharedConsumer], None]) -> None:
        self._config = config
        self._group = group
        self._fetch_wait_ms = fetch_wait_ms
        self._forget = forget
        self._lock = threading.RLock()
        self._members: dict[tuple[str, int], Member] = {}
        self._buffers: dict[tuple[str, int], list[Message]] = {}
        self._buffered = 0
        self.consumer = self._new_consumer()

    def _new_consumer(self) -> Consumer:
        return Consumer({
            **self._config,
            "logger": LIBRDKAFKA_LOGGER,
            "error_cb": self._on_error,
            # Offsets live in Bytewax snapshots; the group only receives informational
            # commits of snapshotted offsets (no subscription, no group membership).
            "group.id": self._group or "user-activity-stream-unused",
            "on_commit": self._on_commit,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            "auto.offset.reset": "earliest",
            "fetch.min.bytes": FETCH_MIN_BYTES,
            "fetch.wait.max.ms": self._fetch_wait_ms,
            "queued.max.messages.kbytes": PREFETCH_KBYTES,
        })

    def join(self, member: Member) -> None:
        """Start fetching ``member``'s partition at its next offset."""
        key = (member.topic, member.partition)
        with self._lock:
            self._members[key] = member
            self._buffers[key] = []
            self.consumer.incremental_assign(
                [TopicPartition(member.topic, member.partition, member.assign_offset())])

    def take(self, key: tuple[str, int], limit: int) -> list[Message]:
        """Up to ``limit`` records (and consumer errors) of the partition ``key``; never waits."""
        with self._lock:
            buffers = self._buffers
            if not buffers[key] and self._buffered < _FILL_CAP_POLLS * limit:
                self._fill(key, limit)
            buf = buffers[key]
            if not buf:
                return []
            if len(buf) <= limit:
                taken, buffers[key] = buf, []
            else:
                taken, buffers[key] = buf[:limit], buf[limit:]
            self._buffered -= len(taken)
            return taken

    def _fill(self, caller: tuple[str, int], limit: int) -> None:
        """One poll of the shared queue into the partitions' buffers."""
        buffers = self._buffers
        kept = 0
        for msg in self.consumer.consume(limit, 0):  # hot: one pass per consumed record
            target = buffers.get((msg.topic(), msg.partition()))  # type: ignore[arg-type]
            if target is None:
                if msg.error() is None:
                    continue  # its partition left: fetched again if it comes back
                target = buffers[caller]  # an error of no partition of ours: the caller's
            target.append(msg)
            kept += 1
        self._buffered += kept

    def replace(self) -> Consumer:
        """A new consumer for every member at its next offset; returns the old one (to close).

        Everything buffered is dropped: it lies after each partition's next offset.
        """
        with self._lock:
            old, self.consumer = self.consumer, self._new_consumer()
            for key in self._buffers:
                self._buffers[key] = []
            self._buffered = 0
            if self._members:
                self.consumer.incremental_assign([
                    TopicPartition(m.topic, m.partition, m.assign_offset())
                    for m in self._members.values()])
            return old

    def leave(self, member: Member) -> Consumer | None:
        """Stop fetching ``member``'s partition; the consumer to close once nobody is left."""
        key = (member.topic, member.partition)
        with self._lock:
            if self._members.pop(key, None) is None:
                return None
            self._buffered -= len(self._buffers.pop(key, []))
            if self._members:
                # On failure it stays assigned: fetched and dropped until the consumer closes.
                with contextlib.suppress(KafkaException):
                    self.consumer.incremental_unassign([TopicPartition(*key)])
                return None
            self._forget(self)
            return self.consumer

    def _on_error(self, error: KafkaError) -> None:
        for member in list(self._members.values()):
            member.on_client_error(error)

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if error is None:
            return
        for tp in partitions:
            member = self._members.get((tp.topic, tp.partition))
            if member is not None:
                member.commit_failed(error)


_REGISTRY: dict[tuple[Any, ...], SharedConsumer] = {}
_REGISTRY_LOCK = threading.Lock()


def shared_consumer(config: Mapping[str, Any], group: str, fetch_wait_ms: int) -> SharedConsumer:
    """The calling thread's consumer for ``config`` and ``group`` (made on first use).

    It is forgotten when its last partition leaves, so a later run in the same process (tests,
    ``run_main``) gets a fresh one.
    """
    key = (threading.get_ident(), group, fetch_wait_ms,
           tuple(sorted((k, repr(v)) for k, v in config.items())))

    def forget(shared: SharedConsumer) -> None:
        with _REGISTRY_LOCK:
            if _REGISTRY.get(key) is shared:
                del _REGISTRY[key]

    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            shared = _REGISTRY[key] = SharedConsumer(config, group, fetch_wait_ms, forget)
        return shared


__all__ = ["FETCH_MIN_BYTES", "Member", "SharedConsumer", "shared_consumer"]
