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
- one reachability check per consumer, not per partition: when every broker is down (the
  client's ``_ALL_BROKERS_DOWN``) the consumer asks a broker for metadata with back-off, at
  most one call of up to a second per step (after a fetch at once, but at most once a second),
  and tells every member to pause or resume (one that joins during the outage at once); one
  ``kafka-consumer-retry`` line per step names the waiting partitions, one
  ``kafka-consumer-recovered`` line ends the outage. Checked per partition, a worker with 12
  partitions spent up to 12 s of its thread per step in these calls and logged 12 lines;
- a failed informational commit reaches the partitions it was for.

Thread use: a worker's partitions are polled on its own thread, so a member only ever calls in
from one thread; the lock makes a shared consumer safe anyway if Bytewax ever builds a
partition on another thread than the one that polls it. librdkafka calls ``error_cb`` from the
thread that polls or closes a consumer: a replaced consumer, closed on a thread of its own, may
still report every broker down, and is ignored (each consumer's callback knows its generation).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from runtime.backoff import Backoff
from runtime.logs import LIBRDKAFKA_LOGGER, log_event

logger = logging.getLogger(__name__)

FETCH_MIN_BYTES = 65_536
"""The broker answers a fetch once this much waits (or after ``fetch_wait_ms``)."""

PREFETCH_KBYTES = 8_192
"""librdkafka's local queue for all of a worker's partitions (per consumer, not per partition)."""

_FILL_CAP_POLLS = 4
"""No fill while this many polls' worth of records already wait in the buffers."""


def size_limits(receive_max_bytes: int) -> dict[str, int]:
    """The size settings (librdkafka's) of an input consumer that reads batches up to this size.

    ``receive.message.max.bytes`` bounds a fetch response and a zstd batch once decompressed
    (librdkafka checks no other codec's); ``fetch.max.bytes`` must stay 512 below it. Left
    unset, librdkafka makes ``fetch.max.bytes`` the prefetch queue's size
    (:data:`PREFETCH_KBYTES`, 8 MiB) rather than its 50 MiB default; set (as it must be, for a
    limit below that), it is kept at that size too.
    """
    return {"receive.message.max.bytes": receive_max_bytes,
            "fetch.max.bytes": min(PREFETCH_KBYTES * 1024, receive_max_bytes - 512)}


class Member(Protocol):
    """What a shared consumer needs of one of its partitions."""

    topic: str
    partition: int

    def assign_offset(self) -> int:
        """Where the partition reads on: its next offset (or ``OFFSET_BEGINNING``)."""

    def kafka_paused(self, attempt: int, error: str) -> None:
        """Every broker is unreachable (check number ``attempt`` failed with ``error``)."""

    def kafka_resumed(self) -> None:
        """A broker answered again after :meth:`kafka_paused`."""

    def commit_failed(self, error: object) -> None:
        """The informational commit of this partition's offset failed."""


class SharedConsumer:
    """The consumer of one worker thread, one client configuration and one consumer group."""

    def __init__(self, config: Mapping[str, Any], group: str, fetch_wait_ms: int,  # noqa: PLR0917
                 forget: Callable[[SharedConsumer], None], backoff: Backoff,
                 count_retry: Callable[[], None]) -> None:
        self._config = config
        self._group = group
        self._fetch_wait_ms = fetch_wait_ms
        self._forget = forget
        self._backoff = backoff
        self._count_retry = count_retry
        self.down_attempts = 0
        """Failed reachability checks since every broker went down (0: not known to be down)."""
        self._last_error = ""  # of the last failed check (what a joining member is paused for)
        self._probe_at = 0.0  # time.monotonic() of the next check while down
        self._checked_at = 0.0  # time.monotonic() of the last check
        self._generation = 0  # of the consumer in use: a replaced one's errors are ignored
        self._lock = threading.RLock()
        self._members: dict[tuple[str, int], Member] = {}
        self._buffers: dict[tuple[str, int], list[Message]] = {}
        self._buffered = 0
        self._held: set[tuple[str, int]] = set()
        """Partitions held back by the input's alignment (paused)."""
        self.consumer = self._new_consumer()

    def _new_consumer(self) -> Consumer:
        self._generation += 1
        generation = self._generation
        return Consumer({
            **self._config,
            "logger": LIBRDKAFKA_LOGGER,
            "error_cb": lambda error: self._on_error(error, generation),
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
            if self.down_attempts:  # joins an outage: waits with the others
                member.kafka_paused(self.down_attempts, self._last_error)

    def take(self, key: tuple[str, int], limit: int) -> list[Message]:
        """Up to ``limit`` records (and consumer errors) of the partition ``key``; never waits."""
        with self._lock:
            buffers = self._buffers
            held = self._held
            if held:
                if key in held:
                    held.discard(key)
                    self.consumer.resume([TopicPartition(*key)])
                waiting = self._buffered - sum(len(buffers[k]) for k in held)
            else:
                waiting = self._buffered
            if not buffers[key] and waiting < _FILL_CAP_POLLS * limit:
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

    def put_back(self, key: tuple[str, int], messages: list[Message]) -> None:
        """Put ``messages`` (the last :meth:`take` gave for ``key``) back at its buffer's front.

        The partition is held back (its event time ran ahead, :mod:`sources.alignment`): its
        fetching is paused until its next :meth:`take`, and what it holds does not count against
        the fill cap, so the partitions it waits for still fill.
        """
        with self._lock:
            self._buffers[key][:0] = messages
            self._buffered += len(messages)
            if key not in self._held:
                self._held.add(key)
                self.consumer.pause([TopicPartition(*key)])

    def move(self, member: Member) -> None:
        """Fetch ``member``'s partition again from its next offset, dropping what waits for it.

        For a partition that must skip what the consumer would fetch next (an undecodable
        batch: :mod:`sources.undecodable`): what waits for it (that batch's errors again) is
        dropped; other partitions are not touched.
        """
        key = (member.topic, member.partition)
        with self._lock:
            self._buffered -= len(self._buffers.get(key, []))
            self._buffers[key] = []
            self.consumer.incremental_unassign([TopicPartition(*key)])
            self.consumer.incremental_assign(
                [TopicPartition(member.topic, member.partition, member.assign_offset())])

    def drained_position(self, key: tuple[str, int]) -> int | None:
        """The consumer's position in partition ``key`` once none of its records wait here.

        librdkafka's position is the offset after the last record it handed out, and it also
        passes what is never handed out (transaction markers, aborted transactions' records).
        With the partition's buffer empty, every record before it was taken. None while
        records of ``key`` wait in the buffer, or before the consumer has a position (a local
        call: no broker is asked).
        """
        with self._lock:
            if self._buffers.get(key):
                return None
            offset = self.consumer.position([TopicPartition(*key)])[0].offset
            return offset if offset >= 0 else None

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
            self._held.clear()
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
            self._held.discard(key)
            if self._members:
                # On failure it stays assigned: fetched and dropped until the consumer closes.
                with contextlib.suppress(KafkaException):
                    self.consumer.incremental_unassign([TopicPartition(*key)])
                return None
            self._forget(self)
            return self.consumer

    def check_reachable(self, *, fetched: bool) -> None:
        """While down: ask a broker for metadata when due (back-off), resume every member then.

        Called by a member's poll while :attr:`down_attempts` is set. Records may still come
        from the local prefetch queue while every broker is down, so a fetch makes the check
        due at once (at most once a second); it does not prove Kafka is back.
        """
        with self._lock:
            if not self.down_attempts or not self._members:
                return
            now = time.monotonic()
            if now < self._probe_at and not (fetched and now - self._checked_at >= 1.0):
                return
            self._checked_at = now
            topic = next(iter(self._members))[0]
            try:
                self.consumer.list_topics(topic, timeout=1.0)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                self._kafka_down(error.name() if isinstance(error, KafkaError)
                                 else type(exc).__name__)
                return
            attempts, self.down_attempts = self.down_attempts, 0
            for member in list(self._members.values()):
                member.kafka_resumed()
            log_event(logger, "kafka-consumer-recovered", partitions=self._waiters(),
                      attempts=attempts)

    def not_answering(self, error: str) -> None:
        """A member's query went unanswered: start the reachability checks now (if not yet).

        A broker that accepts connections and never answers (its process frozen, its disk
        hung) is seen by librdkafka as down only after a request's time-out and then a
        reconnection's, and only once every connection has failed: measured with a broker
        stopped by SIGSTOP, 13.5 s with a 6 s request time-out, 31 s and over 45 s in two runs
        with the 30 s one, 60.6 s with librdkafka's 60 s; ``/readyz`` said running meanwhile.
        A member's unanswered query (the stuck check of :mod:`sources.kafka_input`) pauses
        every member at once; the first check a broker answers resumes them
        (:meth:`check_reachable`).
        """
        with self._lock:
            if not self.down_attempts:
                self._kafka_down(error)

    def _kafka_down(self, error: str) -> None:
        if not self._members:
            return  # nobody waits (a consumer closing after its last partition left)
        delay = self._backoff.delay(self.down_attempts)
        self.down_attempts += 1
        self._count_retry()
        self._probe_at = time.monotonic() + delay
        self._last_error = error
        for member in list(self._members.values()):
            member.kafka_paused(self.down_attempts, error)
        log_event(logger, "kafka-consumer-retry", logging.WARNING, partitions=self._waiters(),
                  error=error, attempt=self.down_attempts, delay_s=round(delay, 2))

    def _waiters(self) -> list[str]:
        return [f"{topic}[{partition}]" for topic, partition in sorted(self._members)]

    def _on_error(self, error: KafkaError, generation: int) -> None:
        """Client errors of librdkafka: every broker down starts the reachability checks.

        Only the consumer in use counts: a replaced one, closing on another thread, may still
        report that every broker is down.
        """
        if error.code() == KafkaError._ALL_BROKERS_DOWN and not self.down_attempts:
            with self._lock:
                if not self.down_attempts and generation == self._generation:
                    self._kafka_down(error.name())

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if error is None:
            return
        for tp in partitions:
            member = self._members.get((tp.topic, tp.partition))
            if member is not None:
                member.commit_failed(error)


_REGISTRY: dict[tuple[Any, ...], SharedConsumer] = {}
_REGISTRY_LOCK = threading.Lock()


def shared_consumer(config: Mapping[str, Any], group: str, fetch_wait_ms: int,
                    backoff: Backoff, count_retry: Callable[[], None]) -> SharedConsumer:
    """The calling thread's consumer for ``config`` and ``group`` (made on first use).

    ``backoff`` and ``count_retry`` (the reachability checks') are the first caller's. It is
    forgotten when its last partition leaves, so a later run in the same process (tests,
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
            shared = _REGISTRY[key] = SharedConsumer(
                config, group, fetch_wait_ms, forget, backoff, count_retry)
        return shared


__all__ = ["FETCH_MIN_BYTES", "Member", "SharedConsumer", "shared_consumer", "size_limits"]
