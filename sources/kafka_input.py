"""Kafka input: one Bytewax partition per Kafka partition, offsets kept in Bytewax snapshots.

A snapshot is a partition's next offset and its topic's id (a topic made again is read from its
start, said once); the offset is also committed asynchronously, for lag tools only, to the flow's
consumer group. Without a snapshot a partition starts at a :class:`StartPosition`. A worker's
partitions share one consumer (:mod:`sources.consumer`). Consumer errors are items, never raised.
Records deleted unread (``input-records-expired``) and offsets gone back (``input-offset-reset``)
are said. A stop request ends every partition at its next poll. A consumer that stopped fetching
(librdkafka#5153) is one line and exit 75. A topic missing at start is read as placeholders that
read nothing (:mod:`sources.topic` names it and asks for a restart once it exists). Undecodable
batches: :mod:`sources.undecodable`, :mod:`sources.careful`.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as Tp
from confluent_kafka.admin import AdminClient
from typing_extensions import override

from runtime.backoff import Backoff, retry_forever
from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.metrics import INPUT_RECORDS_EXPIRED, INPUT_RECORDS_UNDECODABLE, INPUT_TOPIC_RECREATED
from runtime.process import Process
from schemas.kafka_record import ConsumerError, SourceRecord
from sources.alignment import EventTimeAlignment
from sources.careful import CAREFUL_FROM_START, CarefulReader, count_start
from sources.consumer import consumer_config, error_name, shared_consumer, waiter
from sources.progress import INPUT_PROGRESS
from sources.topic import NO_AUTO_CREATE, TopicWatch, cleanup_policy, group_offsets, topic_id
from sources.undecodable import UNDECODABLE_CODES, BatchProbe, ProbeFailedError, find_batch_end

logger = logging.getLogger(__name__)

InputItem = SourceRecord | ConsumerError
T = TypeVar("T")
PartitionState = tuple[int | None, str] | int | None
"""A snapshot: the next offset and the topic's id (an offset alone when the id is unknown)."""
_MISSING = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_AUTHORIZATION_FAILED)
_MISSING_POLL = timedelta(seconds=0.5)


@dataclass(frozen=True)
class StartPosition:
    """Where a partition starts without a snapshot: the first of these that applies.

    ``offsets[(topic, partition)]``, the offset ``group`` committed, the first record at or after
    ``timestamp_ms``, the end if ``latest``, else the start. A bounded run stops each partition
    before its first record at or after ``until_ms`` (else at its end offset when built).
    """

    latest: bool = False
    timestamp_ms: int | None = None
    offsets: Mapping[tuple[str, int], int] = field(default_factory=dict)
    until_ms: int | None = None
    group: str | None = None


class KafkaInput(FixedPartitionedSource[InputItem, PartitionState]):
    """Reads one topic; each Kafka partition is a Bytewax partition."""

    def __init__(self, client_config: Mapping[str, Any], topic: str, *, process: Process,
                 start: StartPosition | None = None, tail: bool = True, batch_size: int = 1000,
                 idle_poll: timedelta = timedelta(milliseconds=20), stuck_after: float = 30.0,
                 fetch_wait_ms: int = 10, receive_max_bytes: int = 100_000_000,
                 partition_check: float = 0.0, backoff: Backoff | None = None,
                 count_retry: Callable[[], None] = lambda: None, consumer_group: str = "",
                 flow: str = "", alignment: EventTimeAlignment | None = None,
                 stored_keys: Callable[[], Iterable[str]] = tuple) -> None:
        """``stuck_after``, ``partition_check``: seconds between checks (0: none).

        ``stored_keys``: the partition keys the recovery store holds of this input.
        """
        self.client_config: dict[str, Any] = dict(client_config)
        self.config = consumer_config(client_config, consumer_group, receive_max_bytes)
        self.topic, self.process, self.tail = topic, process, tail
        self.start = start or StartPosition()
        self.batch_size, self.idle_poll, self.stuck_after = batch_size, idle_poll, stuck_after
        self.fetch_wait_ms, self.partition_check = fetch_wait_ms, partition_check
        self.backoff, self.count_retry = backoff or Backoff(), count_retry
        self.commits, self.flow, self.alignment = bool(consumer_group), flow, alignment
        self.stored_keys = stored_keys
        self.topic_id: str | None = None
        self.group_offsets: dict[int, int] = {}
        self.watch: TopicWatch | None = None

    @override
    def list_parts(self) -> list[str]:
        """The topic's partitions; waits (back-off, forever) while Kafka is unreachable.

        A topic the broker says is missing or refused lists partition 0 and the keys the store
        holds of it, each read by a placeholder (Bytewax 0.21.1 panics on a stored key not
        listed, and on an input with no partition at all).
        """
        config: dict[str, Any] = {**self.client_config, "logger": LIBRDKAFKA_LOGGER,
                                  **NO_AUTO_CREATE}
        admin = AdminClient(config)
        partitions = self.retrying(lambda: self._partitions(admin))
        if isinstance(partitions, str):
            if self.watch is None or not self.watch.waits_for_topic:  # once for every worker
                self.watch = TopicWatch(admin, self.topic, partitions=0, known_id=None,
                                        interval=0, process=self.process, missing=partitions,
                                        backoff=self.backoff if self.tail else None)
            numbers = {int(key.rpartition("#")[2]) for key in self.stored_keys()
                       if key.rpartition("#")[0] == self.topic}
            return [f"{self.topic}#{p}" for p in sorted({0, *numbers})]
        self.topic_id = topic_id(admin, self.topic)
        group = self.start.group
        if group:
            self.group_offsets = self.retrying(
                lambda: group_offsets(admin, group, self.topic, partitions))
        self.watch = TopicWatch(admin, self.topic, partitions=len(partitions),
                                known_id=self.topic_id, process=self.process,
                                interval=self.partition_check if self.tail else 0)
        self.watch.cleanup(cleanup_policy(admin, self.topic))
        return [f"{self.topic}#{p}" for p in partitions]

    def _partitions(self, admin: AdminClient, *, again: bool = False) -> list[int] | str:
        """The partitions, or the error of a topic missing or refused at two asks 1 s apart.

        (A topic just made may not be known to every broker yet.)
        """
        # short: on the main thread a SIGTERM's handler runs only between calls
        topic = admin.list_topics(self.topic, timeout=2.0).topics[self.topic]
        error = topic.error
        if error is None:
            return sorted(topic.partitions)
        if error.code() not in _MISSING:
            raise KafkaException(error)
        if again:
            return str(error.name())
        self.process.stopping.wait(1.0)
        return self._partitions(admin, again=True)

    @override
    def build_part(self, step_id: str, for_part: str, resume_state: PartitionState
                   ) -> StatefulSourcePartition[InputItem, PartitionState]:
        partition = int(for_part.rpartition("#")[2])
        if self.watch is not None and self.watch.waits_for_topic:
            return _MissingPartition(self, partition, resume_state)
        return _KafkaPartition(self, partition, resume_state)

    def retrying(self, call: Callable[[], T]) -> T:
        """``call`` until Kafka answers: every ``KafkaException`` retried with back-off."""
        health, name = self.process.health, f"{self.topic}-metadata-{id(call)}"

        def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
            self.count_retry()
            health.paused("kafka", attempt, type(exc).__name__, waiter=name)
            log_event(logger, "kafka-metadata-retry", logging.WARNING, topic=self.topic,
                      error=str(exc), attempt=attempt, delay_s=round(delay, 2))

        return retry_forever(call, is_transient=lambda exc: isinstance(exc, KafkaException),
                             backoff=self.backoff, on_retry=on_retry,
                             on_recovered=lambda _: health.resumed(waiter=name),
                             sleep=self.process.stopping.retry_sleep)


class _MissingPartition(StatefulSourcePartition[InputItem, PartitionState]):
    """A partition of a topic missing at start: reads nothing, keeps its snapshot as it was.

    Partition 0's polls check for the topic; a bounded run ends it at once.
    """

    def __init__(self, src: KafkaInput, partition: int, resume_state: PartitionState) -> None:
        self._src, self._state = src, resume_state
        self._watch = src.watch if partition == 0 else None
        self._awake: datetime | None = None

    @override
    def next_batch(self) -> list[InputItem]:
        process = self._src.process
        process.health.beat()
        if process.stopping.requested() or not self._src.tail:
            raise StopIteration
        if self._watch is not None:
            self._watch.check()
        self._awake = datetime.now(UTC) + _MISSING_POLL
        return []

    @override
    def next_awake(self) -> datetime | None:
        return self._awake

    @override
    def snapshot(self) -> PartitionState:
        return self._state


class _KafkaPartition(StatefulSourcePartition[InputItem, PartitionState]):
    def __init__(self, src: KafkaInput, partition: int, resume_state: PartitionState) -> None:
        self._src, self.topic, self.partition = src, src.topic, partition
        self._key, self._tp = (src.topic, partition), Tp(src.topic, partition)
        self._progress = INPUT_PROGRESS.track(src.flow, src.topic, partition)
        self._watch = src.watch if partition == 0 else None
        self._shared = shared_consumer(self._key, src.config, fetch_wait_ms=src.fetch_wait_ms,
                                       process=src.process, backoff=src.backoff,
                                       count_retry=src.count_retry)
        self._awake: datetime | None = None
        self._read_at = self._stuck_check_at = time.monotonic()
        self._waiting_at: int | None = None  # the next offset a stuck check saw records wait at
        self._held_at: int | None = None  # the last stable offset a check saw holding it back
        self._open_transaction = False  # said held back by a transaction open upstream
        self._probe_at, self._probe_failures = 0.0, 0
        if src.alignment is not None:
            src.alignment.join(self._key)
        offset, snapshot_id = resume_state if isinstance(resume_state, tuple) \
            else (resume_state, None)
        if resume_state is None:
            offset = src.retrying(self._initial_offset)
        elif offset is not None and None not in (snapshot_id, src.topic_id) and \
                snapshot_id != src.topic_id:
            INPUT_TOPIC_RECREATED.labels(self.topic).inc()
            log_event(logger, "input-topic-recreated", logging.ERROR, topic=self.topic,
                      partition=partition, snapshot_offset=offset, snapshot_topic_id=snapshot_id,
                      topic_id=src.topic_id, action="reading the new topic from its start")
            offset = None
        self._next_offset: int | None = offset  # None: the topic's start
        self._progress.next_offset = offset
        self._end: int | None = None if src.tail else src.retrying(self._final_offset)
        self._committed: int | None = None
        self._careful = self._count_start() if src.tail and src.commits else None
        if self._careful is None:
            self._shared.join(self._key, OFFSET_BEGINNING if offset is None else offset)

    def _watermarks(self, timeout: float = 10.0) -> tuple[int, int]:
        low, high = self._shared.consumer.get_watermark_offsets(self._tp, timeout=timeout)
        return int(low), int(high)

    def _at_time(self, ms: int) -> int | None:
        found = self._shared.consumer.offsets_for_times([Tp(*self._key, ms)], timeout=10)[0]
        return int(found.offset) if found.offset >= 0 else None

    def _initial_offset(self) -> int | None:
        start = self._src.start
        offset = start.offsets.get(self._key, self._src.group_offsets.get(self.partition))
        if offset is not None:
            return offset
        if start.timestamp_ms is not None:
            at = self._at_time(start.timestamp_ms)
            return self._watermarks()[1] if at is None else at
        return self._watermarks()[1] if start.latest else None

    def _final_offset(self) -> int:
        end = self._watermarks()[1]
        until = self._src.start.until_ms
        at = None if until is None else self._at_time(until)
        return end if at is None else min(end, at)

    def _count_start(self) -> CarefulReader | None:
        """Count this start (:mod:`sources.careful`); a careful reader from the 2nd in a row."""
        try:
            low, high = self._watermarks(timeout=2)
            offset = low if self._next_offset is None else self._next_offset
            starts, at, fetching = count_start(self._shared.consumer, *self._key, offset)
        except KafkaException:
            return None  # best effort: the count is for a partition that keeps dying
        self._committed = at  # only a snapshot that moves the offset ends the count
        if starts < CAREFUL_FROM_START or high <= offset:
            return None
        log_event(logger, "input-partition-careful", logging.WARNING, topic=self.topic,
                  partition=self.partition, starts=starts, offset=offset,
                  died_at=at if fetching else None, deaths=fetching, until=high)
        self._next_offset = offset
        return CarefulReader(self._src.config, *self._key, starts=starts, at=at,
                             fetching=fetching, until=high)

    @property
    def _consumer(self) -> Consumer:
        return self._shared.consumer if self._careful is None else self._careful.consumer

    def _finished(self) -> bool:
        if self._end is None:
            return False
        if self._next_offset is None:
            self._next_offset = self._src.retrying(lambda: self._watermarks()[0])
        return self._next_offset >= self._end

    @override
    def next_batch(self) -> list[InputItem]:
        src = self._src
        src.process.health.beat()
        if src.process.stopping.requested() or self._finished():
            raise StopIteration
        if self._watch is not None:
            self._watch.check()
        careful = self._careful
        if careful is None:
            messages = self._shared.take(self._key, src.batch_size)
            if src.alignment is not None:
                messages = self._aligned(src.alignment, messages)
        elif careful.death is not None and self._next_offset == careful.death:
            self._skip(careful.death, careful.death + 1, careful.death,
                       "it killed the process at every start (a decompression bomb?)")
            careful.skipped()
            return []
        else:
            messages = careful.take(self._next_offset or 0, src.batch_size)
        batch: list[InputItem] = []
        append = batch.append
        now = time.monotonic()
        end = self._end
        topic, partition = self._key
        next_offset = self._next_offset
        last = None  # the last record passed on (its CreateTime feeds the lag gauge)
        for msg in messages:  # hot: one pass per consumed record, locals only
            error = msg.error()
            if error is not None:
                if error.code() in UNDECODABLE_CODES and msg.topic() == topic and \
                        msg.partition() == partition and \
                        (skipped_to := self._undecodable(msg.offset(), error.str())) is not None:
                    next_offset = skipped_to
                    break  # the rest of this poll is that batch's errors again
                append(ConsumerError(topic, partition, error.name(), error.str(), error.fatal()))
                continue
            offset = msg.offset()
            if offset is None:
                continue
            if end is not None and offset >= end:
                next_offset = max(next_offset or 0, end)  # what is before the end was read
                continue
            if next_offset is not None and offset != next_offset:
                if offset > next_offset:
                    self._gap(next_offset, offset)  # a marker, compaction, or retention?
                else:
                    log_event(logger, "input-offset-reset", logging.ERROR, topic=topic,
                              partition=partition, expected_offset=next_offset, got_offset=offset)
            try:
                raw_headers = _HEADERS_OF(msg)
                headers = _headers(raw_headers) if raw_headers else ()
            except Exception as exc:  # noqa: BLE001 - the record is read without its headers
                headers = ()
                log_event(logger, "input-headers-unreadable", logging.WARNING,
                          source=f"{topic}[{partition}]@{offset}", error=type(exc).__name__,
                          detail=str(exc.__cause__ or exc)[:200])
            append(SourceRecord(topic, partition, offset, msg.key(), msg.value(), headers, now))
            next_offset = offset + 1
            last = msg
        if not messages:
            next_offset = self._passed(self._expired_unseen(next_offset, end), end)
        self._next_offset = next_offset
        high = self._consumer.get_watermark_offsets(self._tp, cached=True)[1]
        if high >= 0:
            self._progress.high_watermark = high
        if last is not None:
            self._read_at, self._waiting_at = now, None
            if self._open_transaction:
                self._say_open_transaction(None)
            self._progress.read(next_offset or 0, last.timestamp()[1], time.time())
        elif careful is None and src.stuck_after and now >= self._stuck_check_at and \
                not self._shared.down_attempts and \
                now - max(self._read_at, self._shared.resumed_at) >= src.stuck_after:
            self._check_stuck(now)
        if careful is not None and (next_offset or 0) >= careful.until:
            self._careful_done(careful)
        if self._shared.down_attempts:  # one check for the worker's partitions, when due
            self._shared.check_reachable(fetched=last is not None)
        self._awake = None if messages else datetime.now(UTC) + src.idle_poll
        return batch

    def _careful_done(self, careful: CarefulReader) -> None:
        """Read carefully up to its start's end: the count ends, back to the shared consumer."""
        careful.close()
        self._careful = None
        self._commit(self._next_offset)
        self._shared.join(self._key, self._next_offset or 0)
        log_event(logger, "input-partition-careful-done", topic=self.topic,
                  partition=self.partition, next_offset=self._next_offset)

    def _aligned(self, alignment: EventTimeAlignment, messages: list[Message]) -> list[Message]:
        """The leading ``messages`` the event-time alignment admits; the rest wait."""
        high = self._shared.consumer.get_watermark_offsets(self._tp, cached=True)[1]
        after = messages[-1].offset() + 1 if messages else (self._next_offset or 0)  # type: ignore[operator]
        # not fetched yet (no high watermark known): it may hold the earliest records
        behind = len(messages) >= self._src.batch_size or high < 0 or high > after
        admitted = alignment.admit(self._key, messages, behind=behind)
        if admitted < len(messages):
            self._shared.put_back(self._key, messages[admitted:])
            self._read_at = time.monotonic()  # records in hand, held back: not a stall
            return messages[:admitted]
        return messages

    def _gap(self, expected: int, got: int) -> None:
        """Offsets ``expected`` to ``got`` not delivered: counted if before the log start."""
        low = self._consumer.get_watermark_offsets(self._tp, cached=True)[0]
        if low > expected:
            lost_to = min(got, low)
            INPUT_RECORDS_EXPIRED.labels(self.topic, str(self.partition)).inc(lost_to - expected)
            log_event(logger, "input-records-expired", logging.ERROR, topic=self.topic,
                      partition=self.partition, from_offset=expected, to_offset=lost_to,
                      records=lost_to - expected, log_start_offset=low)

    def _expired_unseen(self, next_offset: int | None, end: int | None) -> int | None:
        """The next offset, moved to the log start when all after it expired (no record came)."""
        low, high = self._consumer.get_watermark_offsets(self._tp, cached=True)
        if next_offset is None or high > low or min(low, end or low) <= next_offset:
            return next_offset
        low = min(low, end or low)
        self._gap(next_offset, low)
        self._progress.next_offset = low
        return low

    def _passed(self, next_offset: int | None, end: int | None) -> int | None:
        """The next offset moved past offsets never delivered (markers, aborted records)."""
        position = self._shared.drained_position(self._key) if self._careful is None \
            else self._careful.drained_position()
        if position is None or (next_offset is not None and position <= next_offset):
            return next_offset
        position = position if end is None else min(position, end)
        self._progress.next_offset = position
        return position

    def _undecodable(self, base: int | None, reason: str) -> int | None:
        """Skip the batch at ``base`` librdkafka refuses: the offset after it.

        None when the broker could not be probed (a consumer error; retried after a back-off).
        """
        now = time.monotonic()
        base = self._next_offset if base is None or base < 0 else base
        if now < self._probe_at or base is None:
            return None
        probe = None
        try:
            probe = BatchProbe(self._src.config, *self._key, base,
                               stopping=self._src.process.stopping.requested)
            high = self._watermarks(timeout=5)[1]
            end = find_batch_end(base, max(high, base + 1), probe.inside)
        except (KafkaException, ProbeFailedError) as exc:
            self._probe_at = now + self._src.backoff.delay(self._probe_failures)
            self._probe_failures += 1
            self._src.count_retry()
            log_event(logger, "input-batch-probe-failed", logging.WARNING, topic=self.topic,
                      partition=self.partition, offset=base, error=str(exc))
            return None
        finally:
            if probe is not None:
                probe.close()
        self._probe_failures = 0
        end = end if self._end is None else min(end, self._end)
        first = max(base, self._next_offset or base)
        if end <= first:
            return None
        self._skip(first, end, base, reason)
        self._read_at = now  # progress, not a stall
        if self._careful is None:
            self._shared.move(self._key, end)
        else:
            self._careful.move()
        return end

    def _skip(self, first: int, end: int, base: int, reason: str) -> None:
        """Records ``first`` to ``end`` of the batch at ``base`` are skipped: counted, logged."""
        INPUT_RECORDS_UNDECODABLE.labels(self.topic, str(self.partition)).inc(end - first)
        log_event(logger, "input-records-undecodable", logging.ERROR, topic=self.topic,
                  partition=self.partition, from_offset=first, to_offset=end,
                  records=end - first, batch_offset=base, reason=reason)
        self._next_offset = self._progress.next_offset = end

    def _check_stuck(self, now: float) -> None:
        """Restart if records wait at one offset at two checks; unanswered in 1 s: Kafka down.

        Records behind a transaction open upstream (the last stable offset) are said, no stall.
        """
        self._stuck_check_at = now + self._src.stuck_after
        try:
            low, high = self._consumer.get_watermark_offsets(self._tp, timeout=1.0, cached=False)
        except KafkaException as exc:
            if error_name(exc) == "_TIMED_OUT":
                self._shared.not_answering("_TIMED_OUT")
            return
        floor = low if self._next_offset is None else self._next_offset
        if high <= floor:
            self._waiting_at = None
            self._say_open_transaction(high)
        elif self._waiting_at != floor:
            self._waiting_at = floor  # seen once: records that came a moment ago are fetched
        else:
            self._src.count_retry()
            log_event(logger, "kafka-consumer-stuck", logging.ERROR, topic=self.topic,
                      partition=self.partition, next_offset=self._next_offset,
                      high_watermark=high, idle_s=round(now - self._read_at, 1),
                      action="stopping cleanly (exit 75): the restart makes a new consumer")
            self._src.process.stopping.restart(
                f"the consumer of {waiter(self._key)} stopped fetching (librdkafka#5153)")

    def _say_open_transaction(self, last_stable: int | None) -> None:
        """Said once when two checks see one transaction open upstream hold records back."""
        high = self._consumer.get_watermark_offsets(self._tp, cached=True)[1]
        held = last_stable is not None and high > last_stable
        if held and not self._open_transaction and self._held_at == last_stable:
            self._open_transaction = True
            log_event(logger, "input-behind-open-transaction", logging.WARNING,
                      topic=self.topic, partition=self.partition, next_offset=self._next_offset,
                      last_stable_offset=last_stable, high_watermark=high,
                      consequence="the records after it wait until it commits or aborts")
        elif not held and self._open_transaction:
            self._open_transaction = False
            log_event(logger, "input-open-transaction-ended", topic=self.topic,
                      partition=self.partition, next_offset=self._next_offset)
        self._held_at = last_stable if held else None

    @override
    def next_awake(self) -> datetime | None:
        return self._awake

    @override
    def snapshot(self) -> PartitionState:
        offset = self._next_offset
        if self._careful is None and offset != self._committed:
            self._commit(offset)  # a careful reader commits its own (the count)
        return offset if self._src.topic_id is None else (offset, self._src.topic_id)

    def _commit(self, offset: int | None) -> None:
        """Commit ``offset`` to the flow's group, without a start count (never waits)."""
        # none while Kafka is down: a commit waiting for its coordinator would hold the close
        if self._src.commits and offset is not None and not self._shared.down_attempts:
            self._committed = offset
            try:
                self._shared.consumer.commit(offsets=[Tp(*self._key, offset)], asynchronous=True)
            except KafkaException as exc:
                log_event(logger, "consumer-group-commit-failed", logging.WARNING,
                          partitions=[waiter(self._key)], error=error_name(exc))

    @override
    def close(self) -> None:
        if self._src.alignment is not None:
            self._src.alignment.forget(self._key)
        INPUT_PROGRESS.forget(self._progress)
        if self._careful is not None:
            self._careful.close()
        self._commit(self._next_offset)  # a clean stop: no start of a crash loop
        self._shared.leave(self._key)


# Not msg.headers(): specialized in a hot loop, CPython 3.11 ignores the exception set by a
# header name that is not UTF-8 (confluent-kafka 2.x) and crashed; this call raises it.
_HEADERS_OF = operator.methodcaller("headers")


def _headers(raw: object) -> tuple[tuple[str, bytes], ...]:
    """``msg.headers()`` as ``SourceRecord.headers``: None -> (), a null value -> ``b""``."""
    if not raw or not isinstance(raw, list):
        return ()
    for _name, value in raw:
        if value is None:
            return tuple([(name, value or b"") for name, value in raw])
    return tuple(raw)
