"""One Kafka consumer per worker thread, shared by every input partition that worker reads.

A partition's records reach only its own buffer, in offset order; the consumer is told an offset
only when a partition joins or moves, so dropping buffered records loses nothing. Memory is
bounded: librdkafka's prefetch per consumer, and a poll fills the buffers only when its own is
empty and fewer than four polls' worth wait. Every broker down: every member paused on ``kafka``
(health), one metadata call per back-off step checks the way back, one line per step. No group
membership: the group only receives informational commits (a failure logged once a minute).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from runtime.backoff import Backoff
from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.process import Process

logger = logging.getLogger(__name__)

Key = tuple[str, int]
PREFETCH_KBYTES = 8_192
"""librdkafka's local queue for all of a worker's partitions."""
_FILL_CAP_POLLS = 4


def consumer_config(config: Mapping[str, Any], group: str, receive_max_bytes: int
                    ) -> dict[str, Any]:
    """Every input consumer's: offsets are ours; zstd batches of up to ``receive_max_bytes``."""
    return {**config, "logger": LIBRDKAFKA_LOGGER, "group.id": group or "user-activity-unused",
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "enable.partition.eof": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": 1_000,  # bounds close and a commit while Kafka is down
            "receive.message.max.bytes": receive_max_bytes,  # zstd's only, once decompressed
            "fetch.max.bytes": min(PREFETCH_KBYTES * 1024, receive_max_bytes - 512)}


def waiter(key: Key) -> str:
    """An input partition's name in health and logs."""
    return f"{key[0]}[{key[1]}]"


def error_name(exc: KafkaException) -> str:
    """The librdkafka error name of ``exc``."""
    error = exc.args[0] if exc.args else None
    return error.name() if isinstance(error, KafkaError) else type(exc).__name__


_LEFT_OPEN: list[Consumer] = []
"""Consumers left open by :meth:`SharedConsumer.leave` while Kafka was down."""


class SharedConsumer:
    """The consumer of one worker thread, one client configuration and one consumer group."""

    def __init__(self, config: Mapping[str, Any], *, fetch_wait_ms: int, process: Process,
                 backoff: Backoff, count_retry: Callable[[], None],
                 forget: Callable[[], None]) -> None:
        self._health, self._stopping = process.health, process.stopping
        self._backoff = backoff
        self._count_retry = count_retry
        self._forget = forget
        self.down_attempts = 0  # failed checks since every broker went down (0: not down)
        self.resumed_at = time.monotonic()  # made, or Kafka answered again after an outage
        self._last_error = ""
        self._probe_at = self._checked_at = 0.0
        self._commit_warned_at = -60.0
        self._buffers: dict[Key, list[Message]] = {}
        self._buffered = 0
        self._held: set[Key] = set()  # paused by the input's alignment
        self.users: set[Key] = set()  # joined or not: the last to leave closes the consumer
        self.consumer = Consumer({
            **config, "error_cb": self._on_error, "on_commit": self._on_commit,
            "fetch.min.bytes": 65_536, "fetch.wait.max.ms": fetch_wait_ms,
            "queued.max.messages.kbytes": PREFETCH_KBYTES})

    def join(self, key: Key, offset: int) -> None:
        """Start fetching partition ``key`` at ``offset``."""
        self._buffers[key] = []
        self.consumer.incremental_assign([TopicPartition(*key, offset)])
        if self.down_attempts:  # joins an outage: waits with the others
            self._health.paused("kafka", self.down_attempts, self._last_error, waiter=waiter(key))

    def take(self, key: Key, limit: int) -> list[Message]:
        """Up to ``limit`` records (and consumer errors) of partition ``key``; never waits."""
        buffers, held = self._buffers, self._held
        waiting = self._buffered
        if held:
            if key in held:
                held.discard(key)
                self.consumer.resume([TopicPartition(*key)])
            waiting -= sum(len(buffers[k]) for k in held)
        if not buffers[key] and waiting < _FILL_CAP_POLLS * limit:
            self._fill(key, limit)
        buf = buffers[key]
        if len(buf) <= limit:
            taken, buffers[key] = buf, []
        else:
            taken, buffers[key] = buf[:limit], buf[limit:]
        self._buffered -= len(taken)
        return taken

    def _fill(self, caller: Key, limit: int) -> None:
        buffers = self._buffers
        kept = 0
        for msg in self.consumer.consume(limit, 0):  # hot: one pass per consumed record
            target = buffers.get((msg.topic(), msg.partition()))  # type: ignore[arg-type]
            if target is None:
                if msg.error() is None:
                    continue  # its partition left or moved: fetched again if it comes back
                target = buffers[caller]  # an error of no partition of ours: the caller's
            target.append(msg)
            kept += 1
        self._buffered += kept

    def put_back(self, key: Key, messages: list[Message]) -> None:
        """``messages`` back at the front of ``key``'s buffer, paused (not counted) till taken."""
        self._buffers[key][:0] = messages
        self._buffered += len(messages)
        if key not in self._held:
            self._held.add(key)
            self.consumer.pause([TopicPartition(*key)])

    def move(self, key: Key, offset: int) -> None:
        """Fetch ``key`` again from ``offset``, dropping what waits for it."""
        self._buffered -= len(self._buffers.get(key, []))
        self._buffers[key] = []
        self.consumer.incremental_unassign([TopicPartition(*key)])
        self.consumer.incremental_assign([TopicPartition(*key, offset)])

    def drained_position(self, key: Key) -> int | None:
        """The position in ``key`` (past markers and aborted records) once none of it waits."""
        if self._buffers.get(key):
            return None
        offset = self.consumer.position([TopicPartition(*key)])[0].offset
        return offset if offset >= 0 else None

    def leave(self, key: Key) -> None:
        """Stop fetching ``key``; the last partition to leave closes the consumer."""
        self.users.discard(key)
        if key in self._buffers:
            self._buffered -= len(self._buffers.pop(key))
            self._held.discard(key)
            self._health.resumed(waiter=waiter(key))
            if self.users:
                with contextlib.suppress(KafkaException):  # else fetched, dropped until close
                    self.consumer.incremental_unassign([TopicPartition(*key)])
        if not self.users:
            self._forget()
            if self.down_attempts:  # librdkafka's close (and destroy) waits for Kafka: exit 75
                _LEFT_OPEN.append(self.consumer)  # never destroyed before the process ends
                self._stopping.unfinished("the Kafka consumer could not leave: Kafka is down")
            else:
                self.consumer.close()

    def check_reachable(self, *, fetched: bool) -> None:
        """While down, when due: one metadata call; answered, every member resumes.

        A fetch makes it due at once (at most once a second): the local queue may still give.
        """
        if not self.down_attempts or not self._buffers:
            return
        now = time.monotonic()
        if now < self._probe_at and not (fetched and now - self._checked_at >= 1.0):
            return
        self._checked_at = now
        try:
            self.consumer.list_topics(next(iter(self._buffers))[0], timeout=1.0)
        except KafkaException as exc:
            self._down(error_name(exc))
            return
        attempts, self.down_attempts, self.resumed_at = self.down_attempts, 0, now
        for key in self._buffers:
            self._health.resumed(waiter=waiter(key))
        log_event(logger, "kafka-consumer-recovered", partitions=self._waiters(),
                  attempts=attempts)

    def not_answering(self, error: str) -> None:
        """A member's query had no answer: a broker that accepts and never answers is down."""
        if not self.down_attempts:
            self._down(error)

    def _down(self, error: str) -> None:
        if not self._buffers:
            return  # nobody waits (a consumer closing after its last partition left)
        delay = self._backoff.delay(self.down_attempts)
        self.down_attempts += 1
        self._count_retry()
        self._probe_at = time.monotonic() + delay
        self._last_error = error
        for key in self._buffers:
            self._health.paused("kafka", self.down_attempts, error, waiter=waiter(key))
        log_event(logger, "kafka-consumer-retry", logging.WARNING, partitions=self._waiters(),
                  error=error, attempt=self.down_attempts, delay_s=round(delay, 2))

    def _waiters(self) -> list[str]:
        return [waiter(key) for key in sorted(self._buffers)]

    def _on_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._ALL_BROKERS_DOWN and not self.down_attempts:
            self._down(error.name())

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        now = time.monotonic()
        if error is not None and now - self._commit_warned_at >= 60.0:
            self._commit_warned_at = now
            log_event(logger, "consumer-group-commit-failed", logging.WARNING,
                      partitions=[waiter((tp.topic, tp.partition)) for tp in partitions],
                      error=error.name())


_REGISTRY: dict[tuple[Any, ...], SharedConsumer] = {}
_REGISTRY_LOCK = threading.Lock()


def shared_consumer(user: Key, config: Mapping[str, Any], *, fetch_wait_ms: int,
                    process: Process, backoff: Backoff, count_retry: Callable[[], None]
                    ) -> SharedConsumer:
    """The calling thread's consumer for ``config``, used by ``user`` until it leaves."""
    key = (threading.get_ident(), fetch_wait_ms, tuple(sorted(
        (k, repr(v)) for k, v in config.items())))

    def forget() -> None:
        with _REGISTRY_LOCK:
            _REGISTRY.pop(key, None)

    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            shared = _REGISTRY[key] = SharedConsumer(
                config, fetch_wait_ms=fetch_wait_ms, process=process, backoff=backoff,
                count_retry=count_retry, forget=forget)
        shared.users.add(user)
        return shared
