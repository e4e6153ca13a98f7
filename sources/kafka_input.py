"""Kafka input: one Bytewax partition per Kafka partition, offsets kept in Bytewax snapshots.

The partitions a worker reads share one consumer (:mod:`sources.shared_consumer`: one fetch
loop per worker, not per partition); each keeps its own position, snapshot and health.

Replaces Bytewax's ``KafkaSource`` (unmaintained upstream) to own these behaviours:
- consumer errors become :class:`ConsumerError` items (routed by the flow, never raised and never
  mistaken for an offset: an error event does not move the snapshot offset);
- starting position: earliest, latest, a timestamp (``offsets_for_times``) or explicit
  per-partition offsets, used only when there is no snapshot to resume from;
- bounded mode (``tail=False``): each partition stops at the end offset seen when it was built,
  so a backfill is a bounded run even while producers keep writing;
- transactions upstream: offsets never delivered (commit and abort markers, aborted records)
  are passed once the consumer's position is past them, so a partition ending on a marker is
  caught up (lag 0) and a bounded run ending on one ends;
- offsets that move on their own are said: records deleted by retention before they were read
  are counted and logged (``input-records-expired``), and a partition whose offsets went back
  (the topic created again, a resume offset past its end) is logged (``input-offset-reset``);
- no busy loop: an empty poll schedules the next one ``idle_poll`` later;
- the snapshot is the offset of the next record to read, taken by Bytewax at epoch end, i.e.
  only once the sinks have returned for the records before it;
- after each snapshot the snapshotted offset is also committed (asynchronously) to the flow's
  consumer group, for lag tools only (``kafka-consumer-groups --describe``, exporters, a KEDA
  scaler): positions always come from the recovery snapshots, never from these commits;
- progress per partition (next offset, high watermark, last read, CreateTime of the last
  record) is recorded for the scrape-time lag gauges (:mod:`runtime.input_progress`);
- a requested shutdown (:mod:`runtime.shutdown`: SIGTERM, Ctrl-C) ends every partition at its
  next poll, so Bytewax finishes the epoch and closes the sinks instead of dying mid-batch;
- no silent stall: librdkafka can stop fetching an assigned partition after a broker restart
  and never resume, with no error (confluentinc/librdkafka#5153; seen here once in a CI run of
  the broker-restart chaos test: one partition of twelve read nothing more). A partition that
  read nothing for ``stuck_after`` seconds asks the broker for its high watermark; if records
  wait past its next offset (moved past control records on empty polls) at two such checks in a
  row, the worker's consumer is replaced by a new one, each partition at its own next offset
  (nothing skipped, nothing read twice), logged (``kafka-consumer-restarted``) and counted as a
  retry. That high watermark is the last stable offset (``read_committed``), so records held
  back by a transaction open upstream are not taken for a stall: that is said instead
  (``input-behind-open-transaction``);
- no crash loop on one batch: a partition started three times at one offset without progress
  or a clean stop (a decompression bomb kills the process before any record of it reaches
  Python) is read through memory-capped child processes up to the high watermark, its bomb
  skipped and counted, before it joins the worker's consumer (:mod:`sources.guarded_read`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from typing_extensions import override

from runtime.backlog import BACKLOG
from runtime.backoff import Backoff, retry_forever
from runtime.health import HEALTH
from runtime.input_progress import INPUT_PROGRESS
from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.metrics import (
    INPUT_RECORDS_EXPIRED,
    INPUT_RECORDS_UNDECODABLE,
    INPUT_TOPIC_RECREATED,
)
from runtime.shutdown import SHUTDOWN
from schemas.kafka_record import ConsumerError, SourceRecord
from sources.alignment import EventTimeAlignment
from sources.guarded_read import GUARD_AFTER_STARTS, GuardedReader, count_start
from sources.partition_watch import NO_AUTO_CREATE, report_cleanup_policy, watch_partitions
from sources.shared_consumer import shared_consumer, size_limits
from sources.topic_id import cleanup_policy, topic_id
from sources.undecodable import UNDECODABLE_CODES, BatchProbe, ProbeFailedError, find_batch_end

logger = logging.getLogger(__name__)

InputItem = SourceRecord | ConsumerError


@dataclass(frozen=True)
class StartPosition:
    """Where a partition starts when Bytewax has no snapshot for it.

    Exactly one of: ``earliest`` (default), ``latest``, ``timestamp_ms`` or ``offsets`` (a map
    ``(topic, partition) -> offset``; partitions not in it start at earliest). ``group``: a
    consumer group whose committed offset is where a partition starts; a partition it has no
    offset for uses the other fields. In a bounded run
    (``tail=False``), ``until_ms`` also closes the window: each partition stops before its first
    record timestamped at or after it (else at the end offset seen when it was built).
    """

    latest: bool = False
    timestamp_ms: int | None = None
    offsets: Mapping[tuple[str, int], int] = field(default_factory=dict)
    until_ms: int | None = None
    group: str | None = None


def _part_name(topic: str, partition: int) -> str:
    return f"{topic}#{partition}"


def guard_cap_bytes(receive_max_bytes: int) -> int:
    """The memory cap of a guarded partition's child (:mod:`sources.guarded_read`).

    Twice the largest batch the input reads (librdkafka's buffer and the value's copy), plus
    128 MiB for the interpreter and the client.
    """
    return 2 * receive_max_bytes + 128 * 2**20


PartitionState = tuple[int | None, str] | int | None
"""A partition's snapshot: its next offset and the id of the topic it belongs to (an offset
alone, or None, from a version that kept no id, or when the broker did not tell the id)."""


class KafkaInput(FixedPartitionedSource[InputItem, PartitionState]):
    """Reads one topic; each Kafka partition is a Bytewax partition (the unit of parallelism)."""

    def __init__(
        self,
        client_config: Mapping[str, Any],
        topic: str,
        *,
        start: StartPosition | None = None,
        tail: bool = True,
        batch_size: int = 1000,
        idle_poll: timedelta = timedelta(milliseconds=20),
        stuck_after: float = 30.0,
        fetch_wait_ms: int = 10,
        receive_max_bytes: int = 100_000_000,
        partition_check: float = 0.0,
        backoff: Backoff | None = None,
        count_retry: Callable[[], None] = lambda: None,
        consumer_group: str = "",
        flow: str = "",
        alignment: EventTimeAlignment | None = None,
    ) -> None:
        """Read ``topic``.

        ``alignment``: the partitions pass records on in event-time order, to within its bound
        (:mod:`sources.alignment`);
        ``partition_check``: in a tailed run, seconds between checks whether the topic gained
        partitions, to restart and read them (:mod:`sources.partition_watch`; ``0``: never);
        ``consumer_group``: where snapshotted offsets are also committed (empty: nowhere);
        ``flow``: the flow whose lag gauge this input feeds (:mod:`runtime.input_progress`);
        ``stuck_after``: seconds without a record before the broker is asked whether the
        partition's consumer stopped fetching (module doc; ``0``: never); ``fetch_wait_ms``:
        how long the broker may hold a fetch of the worker's shared consumer to gather 64 KiB
        (:mod:`sources.shared_consumer`), the most the input adds to a record's latency;
        ``receive_max_bytes``: the largest record batch, decompressed, its consumers read
        (larger ones are skipped, counted and logged: :mod:`sources.undecodable`).
        """
        self._config = dict(client_config)
        self._consumer_group = consumer_group
        self._flow = flow
        self._topic = topic
        self._start = start or StartPosition()
        self._tail = tail
        self._batch_size = batch_size
        self._idle_poll = idle_poll
        self._stuck_after = stuck_after
        self._fetch_wait_ms = fetch_wait_ms
        self._receive_max_bytes = receive_max_bytes
        self._partition_check = partition_check
        self._backoff = backoff or Backoff()
        self._count_retry = count_retry
        self._topic_id: str | None = None
        self._alignment = alignment

    @override
    def list_parts(self) -> list[str]:
        """The topic's partitions; waits (back-off, forever) while Kafka is unreachable."""
        config: dict[str, Any] = {**self._config, "logger": LIBRDKAFKA_LOGGER,
                                  **NO_AUTO_CREATE}
        admin = AdminClient(config)

        def partitions() -> list[str]:
            # Up to 10 s (less once a stop's grace runs out), asked in calls of at most a second:
            # this runs on the main thread, which runs a SIGTERM's handler only between calls.
            # One blocking 10 s call held the handler back 10 s, and then the grace ran: a stop
            # while Kafka was down exited after 30 s, when Kubernetes kills the pod.
            deadline = time.monotonic() + SHUTDOWN.time_left(10.0)
            while True:
                left = deadline - time.monotonic()
                wait = min(max(left, 0.1), 1.0)
                asked = time.monotonic()
                try:
                    metadata = admin.list_topics(self._topic, timeout=wait)
                    break
                except KafkaException:
                    if left <= 1.0:
                        raise
                    # failed before its time: the next call a second after this one at most
                    SHUTDOWN.wait(max(0.0, wait - (time.monotonic() - asked)))
            topic = metadata.topics[self._topic]
            if topic.error is not None:
                raise KafkaException(topic.error)
            return [_part_name(self._topic, p) for p in sorted(topic.partitions)]

        parts = _retrying(partitions, self._topic, self._backoff, self._count_retry)
        self._topic_id = topic_id(admin, self._topic)
        # a compacted input topic loses events (sources.topic_id.cleanup_policy): said at start,
        # and followed by the partition watch while the job runs
        compacted = report_cleanup_policy(self._topic, cleanup_policy(admin, self._topic),
                                          said=False, log=logger)
        if self._tail:
            watch_partitions(config, self._topic, len(parts), self._partition_check,
                             self._topic_id, compacted=compacted)
        return parts

    @override
    def build_part(
        self, step_id: str, for_part: str, resume_state: PartitionState
    ) -> _KafkaPartition:
        topic, _, index = for_part.rpartition("#")
        return _KafkaPartition(
            {**self._config, **size_limits(self._receive_max_bytes)},
            topic,
            int(index),
            self._start,
            resume_state,
            tail=self._tail,
            batch_size=self._batch_size,
            idle_poll=self._idle_poll,
            stuck_after=self._stuck_after,
            fetch_wait_ms=self._fetch_wait_ms,
            backoff=self._backoff,
            count_retry=self._count_retry,
            consumer_group=self._consumer_group,
            flow=self._flow,
            topic_id=self._topic_id,
            guard_cap_bytes=guard_cap_bytes(self._receive_max_bytes),
            alignment=self._alignment,
        )


class _KafkaPartition(StatefulSourcePartition[InputItem, PartitionState]):
    def __init__(
        self,
        client_config: Mapping[str, Any],
        topic: str,
        partition: int,
        start: StartPosition,
        resume_state: PartitionState,
        *,
        topic_id: str | None = None,
        tail: bool,
        batch_size: int,
        idle_poll: timedelta,
        stuck_after: float,
        fetch_wait_ms: int,
        backoff: Backoff,
        count_retry: Callable[[], None],
        consumer_group: str,
        flow: str,
        guard_cap_bytes: int = 0,
        alignment: EventTimeAlignment | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self._key = (topic, partition)
        self._waiter = f"{topic}[{partition}]"  # what a broker outage pauses (health)
        self._commits = bool(consumer_group)
        self._committed: int | None = None
        self._progress = INPUT_PROGRESS.track(flow, topic, partition)
        self._batch_size = batch_size
        self._idle_poll = idle_poll
        self._backoff = backoff
        self._count_retry = count_retry
        self._awake: datetime | None = None
        self._last_commit_warning = -60.0
        self._stuck_after = stuck_after
        self._read_at = time.monotonic()  # when a record was last read (or the consumer made)
        self._stuck_check_at = 0.0  # time.monotonic() of the next stuck check, at the earliest
        self._behind_transaction = False  # said held back by a transaction open upstream
        self._held_at: int | None = None  # the last stable offset a check found holding it back
        self._waiting_at: int | None = None  # the next offset a check found records waiting at
        self._undecodable_retry_at = 0.0  # time.monotonic() of the next undecodable-batch probe
        self._undecodable_attempts = 0  # failed probes in a row (their back-off)
        self._consumer_config = client_config  # also the undecodable-batch probe's
        self._shared = shared_consumer(client_config, consumer_group, fetch_wait_ms, backoff,
                                       count_retry)
        self._topic_id = topic_id
        self._alignment = alignment
        if alignment is not None:
            alignment.join(self._key)
        resumed = self._resumed_offset(resume_state)
        self._next_offset = (
            resumed  # None: the topic's start
            if resume_state is not None
            else _retrying(lambda: self._initial_offset(start), topic, backoff, count_retry)
        )
        self._progress.next_offset = self._next_offset
        self._end_offset: int | None = None
        if not tail:
            self._end_offset = _retrying(
                lambda: self._final_offset(start.until_ms), topic, backoff, count_retry
            )
        self._partition_handle = TopicPartition(topic, partition)
        self._guard = self._guarded(guard_cap_bytes) if tail and self._commits else None
        if self._guard is None:
            self._shared.join(self)

    def _guarded(self, cap_bytes: int) -> GuardedReader | None:
        """A reader through capped children when this start is one of a crash loop (module doc).

        The start is counted in the consumer group (:func:`sources.guarded_read.count_start`);
        from the :data:`~sources.guarded_read.GUARD_AFTER_STARTS`-th start at one offset with
        records behind it, the partition is read guarded up to the high watermark. Best effort:
        a group that cannot be read or written (Kafka down) counts nothing.
        """
        try:
            low, high = self._consumer.get_watermark_offsets(self._partition_handle, timeout=2)
            offset = low if self._next_offset is None else self._next_offset
            starts = count_start(self._consumer, self.topic, self.partition, offset)
        except KafkaException:
            return None
        self._committed = offset  # the snapshot commits progress only (which ends the count)
        if starts < GUARD_AFTER_STARTS or high <= offset or cap_bytes <= 0:
            return None
        until = high if self._end_offset is None else min(high, self._end_offset)
        log_event(logger, "input-partition-guarded", logging.WARNING, topic=self.topic,
                  partition=self.partition, starts=starts, offset=offset, until=until,
                  reason=f"started {starts} times at this offset without progress or a clean"
                         " stop: reading it through memory-capped child processes up to the"
                         " high watermark")
        self._next_offset = offset
        return GuardedReader(
            self._consumer_config, self.topic, self.partition, start=offset, until=until,
            cap_bytes=cap_bytes, backoff=self._backoff,
            skipped=lambda first, end, reason: self._count_undecodable(first, end, first, reason),
            undecodable=lambda base, reason: self._skip_undecodable(base, base, reason))

    def _count_undecodable(self, first: int, end: int, base: int, reason: str) -> None:
        """Records ``first`` to ``end`` of the batch at ``base`` are skipped: counted, logged.

        A batch librdkafka refuses (:meth:`_skip_undecodable`), or one that killed a guarded
        reader's child (:mod:`sources.guarded_read`).
        """
        INPUT_RECORDS_UNDECODABLE.labels(self.topic, str(self.partition)).inc(end - first)
        log_event(
            logger, "input-records-undecodable", logging.ERROR, topic=self.topic,
            partition=self.partition, from_offset=first, to_offset=end, records=end - first,
            batch_offset=base, reason=reason,
        )

    def _guarded_batch(self, guard: GuardedReader) -> list[InputItem]:
        """The next records of a guarded partition; it joins the worker's consumer when done."""
        now = time.monotonic()
        batch: list[InputItem] = []
        records = guard.poll(self._batch_size)
        for offset, _, key, value, raw_headers in records:
            if raw_headers is None:
                headers: Any = _unreadable_headers(self.topic, self.partition, offset,
                                                   ValueError("not UTF-8"))
            else:
                headers = _headers(raw_headers) if raw_headers else ()
            batch.append(SourceRecord(self.topic, self.partition, offset, key, value, headers,
                                      now))
        if records and (last_timestamp := records[-1][1]) is not None:
            self._progress.read(records[-1][0] + 1, last_timestamp, time.time())
        self._next_offset = guard.next_offset
        self._progress.next_offset = guard.next_offset
        self._read_at = now
        if guard.done:
            guard.close()
            self._guard = None
            self._shared.join(self)
            log_event(logger, "input-partition-unguarded", topic=self.topic,
                      partition=self.partition, next_offset=self._next_offset)
        BACKLOG.polled(self.topic, self.partition, full=True)
        self._awake = None if batch else datetime.now(UTC) + self._idle_poll
        return batch

    def _resumed_offset(self, state: PartitionState) -> int | None:
        """The snapshot's next offset; None (the topic's start) if the topic is another now.

        A topic deleted and created again under the same name starts at offset 0 again: resumed
        at the old offset, the job skipped every new record below it, and said nothing.
        """
        offset, snapshot_id = state if isinstance(state, tuple) else (state, None)
        if offset is None or snapshot_id is None or self._topic_id in (None, snapshot_id):
            return offset
        INPUT_TOPIC_RECREATED.labels(self.topic).inc()
        log_event(logger, "input-topic-recreated", logging.ERROR, topic=self.topic,
                  partition=self.partition, snapshot_offset=offset,
                  snapshot_topic_id=snapshot_id, topic_id=self._topic_id,
                  action="reading the new topic from its first record")
        return None

    @property
    def _consumer(self) -> Consumer:
        """The librdkafka consumer this partition reads from (shared by its worker)."""
        return self._shared.consumer

    def _watermarks(self) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            TopicPartition(self.topic, self.partition), timeout=10
        )
        return int(low), int(high)

    def _initial_offset(self, start: StartPosition) -> int | None:
        explicit = start.offsets.get((self.topic, self.partition))
        if explicit is not None:
            return explicit
        if start.group is not None and (committed := self._committed_by(start.group)) is not None:
            return committed
        if start.timestamp_ms is not None:
            found = self._consumer.offsets_for_times(
                [TopicPartition(self.topic, self.partition, start.timestamp_ms)], timeout=10
            )[0]
            if found.offset >= 0:
                return int(found.offset)
            return self._watermarks()[1]  # nothing at or after the timestamp: the end
        if start.latest:
            return self._watermarks()[1]
        return None

    def _committed_by(self, group: str) -> int | None:
        """``group``'s committed offset of this partition (None: it has none)."""
        consumer = Consumer({**self._consumer_config, "group.id": group,
                             "enable.auto.commit": False, "logger": LIBRDKAFKA_LOGGER})
        try:
            [found] = consumer.committed([TopicPartition(self.topic, self.partition)], timeout=10)
        finally:
            consumer.close()
        if found.error is not None:
            raise KafkaException(found.error)
        return int(found.offset) if found.offset >= 0 else None

    def _final_offset(self, until_ms: int | None) -> int:
        """Where a bounded run stops: before the first record at/after ``until_ms``, or the end."""
        end = self._watermarks()[1]
        if until_ms is None:
            return end
        found = self._consumer.offsets_for_times(
            [TopicPartition(self.topic, self.partition, until_ms)], timeout=10
        )[0]
        return min(end, int(found.offset)) if found.offset >= 0 else end

    def assign_offset(self) -> int:
        """Where this partition reads on (:class:`sources.shared_consumer.Member`)."""
        return OFFSET_BEGINNING if self._next_offset is None else self._next_offset

    def _finished(self) -> bool:
        if self._end_offset is None:
            return False
        if self._next_offset is None:
            self._next_offset = _retrying(
                lambda: self._watermarks()[0], self.topic, self._backoff, self._count_retry
            )
        return self._next_offset >= self._end_offset

    @override
    def next_batch(self) -> list[InputItem]:
        HEALTH.beat()
        if SHUTDOWN.requested() or self._finished():
            raise StopIteration
        if self._guard is not None:
            return self._guarded_batch(self._guard)
        messages = self._shared.take(self._key, self._batch_size)
        if self._alignment is not None:
            messages = self._aligned(messages)
        batch: list[InputItem] = []
        append = batch.append
        now = time.monotonic()
        end = self._end_offset
        topic, partition = self.topic, self.partition
        next_offset = self._next_offset
        last = None  # the last record passed on (its CreateTime feeds the lag gauge)
        for msg in messages:  # hot: one pass per consumed record, locals only
            error = msg.error()
            if error is not None:
                code = error.code()
                if code in UNDECODABLE_CODES and msg.topic() == topic and (
                    msg.partition() == partition) and (  # not a departed partition's error
                    skipped_to := self._skip_undecodable(msg.offset(), next_offset, error.str())
                ) is not None:
                    next_offset = skipped_to
                    break  # the rest of this poll is that batch's errors again
                if code != KafkaError._PARTITION_EOF:
                    append(
                        ConsumerError(topic, partition, error.name(), error.str(), error.fatal())
                    )
                continue
            offset = msg.offset()
            if offset is None:
                continue
            if end is not None and offset >= end:
                # At or past the end: everything before it was read (a transaction marker or
                # a compacted record just before the end would otherwise never be "read").
                next_offset = max(next_offset or 0, end)
                continue
            if next_offset is not None and offset != next_offset:
                if offset > next_offset:
                    self._gap(next_offset, offset)  # a marker, compaction, or retention?
                else:
                    self._went_back(next_offset, offset)
            try:
                raw_headers = _HEADERS_OF(msg)
                headers = _headers(raw_headers) if raw_headers else ()
            except Exception as exc:  # noqa: BLE001 - the record is read without its headers
                headers = _unreadable_headers(topic, partition, offset, exc)
            append(SourceRecord(topic, partition, offset, msg.key(), msg.value(), headers, now))
            next_offset = offset + 1
            last = msg
        if not messages:
            next_offset = self._passed(self._expired_unseen(next_offset, end), end)
        self._next_offset = next_offset
        if last is not None:
            self._read_at = now
            self._held_at = self._waiting_at = None
            if self._behind_transaction:
                self._transaction_ended()
            last_timestamp = last.timestamp()[1]
            if last_timestamp is not None:
                self._progress.read(self._next_offset or 0, last_timestamp, time.time())
        elif (self._stuck_after and now >= self._stuck_check_at
              and not self._shared.down_attempts and now - self._read_at >= self._stuck_after):
            self._check_stuck(now)
        BACKLOG.polled(self.topic, self.partition, full=self._behind(len(messages)))
        if self._shared.down_attempts:  # one check for the worker's partitions, when due
            self._shared.check_reachable(fetched=last is not None)
        self._awake = None if messages else datetime.now(UTC) + self._idle_poll
        return batch

    def _aligned(self, messages: list[Message]) -> list[Message]:
        """The leading ``messages`` the input's event-time alignment admits; the rest wait."""
        assert self._alignment is not None
        _, high = self._consumer.get_watermark_offsets(self._partition_handle, cached=True)
        last = messages[-1].offset() if messages else None
        after = (last + 1) if last is not None else (self._next_offset or 0)
        # not fetched yet (no high watermark known): it may hold the earliest records
        behind = len(messages) >= self._batch_size or high < 0 or high > after
        admitted = self._alignment.admit(self._key, messages, behind=behind)
        if admitted < len(messages):
            self._shared.put_back(self._key, messages[admitted:])
            self._read_at = time.monotonic()  # records in hand, held back: not a stall
            return messages[:admitted]
        return messages

    def _gap(self, expected: int, got: int) -> None:
        """Records from ``expected`` to ``got`` were not delivered: say so if they expired.

        Gaps are normal after a transaction's marker and on compacted topics. When the
        partition's log start (librdkafka's cached low watermark: no broker call) is past
        ``expected``, the records before it were deleted (retention, DeleteRecords) before
        this job read them, e.g. after it was stopped or paused longer than the topic keeps
        records, and the consumer went on from the log start (``auto.offset.reset``). They
        are lost to the stream: counted and logged at ERROR, never silently skipped.
        """
        low = self._consumer.get_watermark_offsets(self._partition_handle, cached=True)[0]
        if low <= expected:
            return
        lost_to = min(got, low)
        INPUT_RECORDS_EXPIRED.labels(self.topic, str(self.partition)).inc(lost_to - expected)
        log_event(
            logger, "input-records-expired", logging.ERROR, topic=self.topic,
            partition=self.partition, from_offset=expected, to_offset=lost_to,
            records=lost_to - expected, log_start_offset=low,
        )

    def _expired_unseen(self, next_offset: int | None, end: int | None) -> int | None:
        """The next offset, moved to the log start when records up to it expired unread.

        :meth:`_gap` sees expired records when the next record arrives past them. When every
        record after the next offset was deleted (a job stopped longer than the retention, on
        a partition nothing was written to since), none arrives: the partition sat at its old
        offset, one lag of records behind, and the loss was counted only once a new record
        came, on a quiet partition never. An empty poll therefore asks librdkafka's cached
        log start (no broker call) and counts what lies before it the same way.

        Only when nothing is left after the log start (log start = high watermark): when
        records remain, the next one arrives and :meth:`_gap` counts exactly; counting here
        could also take records prefetched before the deletion, still queued behind other
        partitions' records, for lost ones.
        """
        if next_offset is None:
            return next_offset
        low, high = self._consumer.get_watermark_offsets(self._partition_handle, cached=True)
        if high > low:
            return next_offset
        if end is not None:
            low = min(low, end)
        if low <= next_offset:
            return next_offset
        self._gap(next_offset, low)
        self._progress.next_offset = low  # the lag gauge: caught up, not behind the loss
        return low

    def _went_back(self, expected: int, got: int) -> None:
        """A record before the next offset arrived: the partition's offsets were reset.

        The offset to resume from (a snapshot's, or a replay's start) was past the
        partition's end, so the broker answered "offset out of range" and the consumer went on
        from the log start (``auto.offset.reset``): the topic was deleted and created again, an
        unclean leader election lost records, or the recovery store belongs to another cluster.
        Reading from the log start loses nothing that is there, and what this job already
        recorded is de-duplicated by its MessageId; it is logged at ERROR all the same (once
        per reset: the next offset follows the record), because the snapshot no longer names
        this log. (A topic created again that had already passed the old offset is not seen
        here: the consumer resumes inside it, and the records before that offset are skipped
        with no signal; the runbook says so.)
        """
        log_event(
            logger, "input-offset-reset", logging.ERROR, topic=self.topic,
            partition=self.partition, expected_offset=expected, got_offset=got,
        )

    def _skip_undecodable(self, base: int | None, next_offset: int | None,
                          reason: str) -> int | None:
        """Skip the batch at ``base`` that cannot be decompressed; the offset read on from.

        librdkafka would fetch it again forever (:mod:`sources.undecodable`): its end is found
        by probing the broker, the records from the next offset to it are counted
        (``user_activity_input_records_undecodable_total``) and logged at ERROR
        (``input-records-undecodable``), and the partition reads on after it. They stay in the
        topic (until its retention): a replay of those offsets with a larger
        ``USER_ACTIVITY_SOURCE_RECEIVE_MAX_BYTES`` reads them. None when the broker could not
        be asked now (then the error goes on as a consumer error, and the next one, after a
        back-off, tries again).
        """
        now = time.monotonic()
        if now < self._undecodable_retry_at:
            return None
        if base is None or base < 0:  # no offset on the error: the batch at the next offset
            base = next_offset
        if base is None:
            return None
        probe: BatchProbe | None = None
        try:
            probe = BatchProbe(self._consumer_config, self.topic, self.partition, base)
            high = self._consumer.get_watermark_offsets(
                self._partition_handle, timeout=5.0, cached=False)[1]
            end = find_batch_end(base, max(int(high), base + 1), probe.inside)
        except (KafkaException, ProbeFailedError) as exc:
            self._undecodable_retry_at = now + self._backoff.delay(self._undecodable_attempts)
            self._undecodable_attempts += 1
            self._count_retry()
            log_event(logger, "input-batch-probe-failed", logging.WARNING, topic=self.topic,
                      partition=self.partition, offset=base, error=str(exc))
            return None
        finally:
            if probe is not None:
                probe.close()
        self._undecodable_attempts = 0
        if self._end_offset is not None:  # a bounded run: what is past its end is not its own
            end = min(end, self._end_offset)
        first = base if next_offset is None else max(base, next_offset)
        if end <= first:  # nothing of it left to skip (a bounded run's end, an old error)
            return None
        self._count_undecodable(first, end, base, reason)
        self._next_offset = end
        self._progress.next_offset = end
        self._read_at = now  # progress: the stuck check must not take the skip for a stall
        if self._guard is None:  # a guarded partition has not joined the consumer yet
            self._shared.move(self)
        return end

    def _passed(self, next_offset: int | None, end: int | None) -> int | None:
        """The next offset, moved past offsets no consumer is given, once nothing waits.

        A producer with transactions writes a marker after each transaction, and an aborted
        transaction's records are never delivered (``read_committed``): without this, the
        partition would look one record behind forever after a transaction (its lag gauge
        climbing while the topic is quiet, the lag alert firing, the backlog signal on) and a
        bounded run whose end sits behind a marker would never end. With this partition's
        buffer empty, the consumer's position (local, no broker call) is past every record it
        was given; what lies between is never delivered, so the snapshot may start there.
        Capped at a bounded run's end.
        """
        position = self._shared.drained_position(self._key)
        if position is None or (next_offset is not None and position <= next_offset):
            return next_offset
        if end is not None:
            position = min(position, end)
        self._progress.next_offset = position
        return position

    def _behind(self, polled: int) -> bool:
        """Whether more records are waiting (the backlog signal, :mod:`runtime.backlog`).

        True when the poll came back full, or the partition's high watermark as of the last
        fetch (cached by librdkafka: no broker call) is past the next offset to read.
        """
        _, high = self._consumer.get_watermark_offsets(self._partition_handle, cached=True)
        if high >= 0:
            self._progress.high_watermark = int(high)
        if polled >= self._batch_size:
            return True
        # Blocked by a transaction open upstream: nothing can be read before it ends.
        return (self._next_offset is not None and high > self._next_offset
                and not self._behind_transaction)

    def kafka_paused(self, attempt: int, error: str) -> None:
        """Every broker is unreachable (:class:`sources.shared_consumer.Member`): health."""
        HEALTH.paused("kafka", attempt, error, waiter=self._waiter)

    def kafka_resumed(self) -> None:
        """A broker answered again: reconnecting takes a moment, not a stuck consumer."""
        self._read_at = time.monotonic()
        HEALTH.resumed(waiter=self._waiter)

    def _check_stuck(self, now: float) -> None:
        """Nothing read for ``stuck_after`` s: replace the consumer if records wait (module doc).

        One watermark query (at most 1 s, on the worker thread) per ``stuck_after`` while the
        partition reads nothing. A query with no answer within the second pauses the worker's
        partitions on kafka (:meth:`SharedConsumer.not_answering`): a broker that accepts and
        never answers is so said within ``stuck_after`` plus a second, not librdkafka's minute.
        Records must be found waiting at the same next offset by two checks in a row: the idle
        time counts from the last record read, so one check could find records that arrived a
        moment ago (seen: the records after a transaction open for 5 s, checked just after its
        abort, got the consumer replaced). A consumer that stopped fetching is so replaced
        within two to three ``stuck_after``. Caught up (the high watermark at the next offset,
        which empty polls move past control records: :meth:`_passed`) is the normal idle case
        and changes nothing.

        The queried offset is the partition's *last stable offset*: librdkafka asks with the
        consumer's ``isolation.level`` (``read_committed``), so records behind a transaction
        left open upstream do not count as waiting (measured on this broker: high watermark 11,
        query 5, next offset 5), and such a consumer is not replaced. Its records do wait, though,
        and the lag gauge (from the high watermark, as Kafka's own lag tools count it) climbs
        and fires the lag alert; so when the last stable offset holds the partition back at two
        checks, that is said once (:meth:`_blocked_by_transaction`).
        """
        self._stuck_check_at = now + self._stuck_after
        try:
            low, high = self._consumer.get_watermark_offsets(
                self._partition_handle, timeout=1.0, cached=False)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() == KafkaError._TIMED_OUT:
                self._shared.not_answering(error.name())  # asked, no answer: paused on kafka
            return
        floor = low if self._next_offset is None else self._next_offset
        if high <= floor:
            self._waiting_at = None
            self._blocked_by_transaction(high, now)
            return
        if self._waiting_at != floor:
            # Seen waiting once: records that came a moment ago (a quiet partition's first
            # record, a transaction that just ended) are fetched before the next check.
            self._waiting_at = floor
            return
        self._waiting_at = None
        stuck = self._shared.replace()  # every partition of the worker reads on at its offset
        # Closed aside: a consumer in that state must not hold the worker up.
        threading.Thread(target=stuck.close, name="close-stuck-consumer", daemon=True).start()
        self._count_retry()
        log_event(
            logger, "kafka-consumer-restarted", logging.WARNING, topic=self.topic,
            partition=self.partition, next_offset=self._next_offset, high_watermark=high,
            idle_s=round(now - self._read_at, 1),
        )
        self._read_at = now

    def _blocked_by_transaction(self, last_stable: int, now: float) -> None:
        """Caught up to the last stable offset: say whether an open transaction holds it back.

        When the high watermark as of the last fetch (cached: no broker call) is past the last
        stable offset, records wait behind a transaction that neither committed nor aborted:
        they are read once it ends (the producer's ``transaction.timeout.ms`` at most, unless
        the transaction hangs, which needs ``kafka-transactions.sh``: the runbook). Said once
        per episode, at WARNING (``input-behind-open-transaction``), when two checks
        ``stuck_after`` apart find the same last stable offset holding it back (a transaction
        of a few milliseconds open at one check is no news); its end is said at the next record
        read, or at the next check once nothing waits any more (an abort with nothing after it).
        """
        _, high = self._consumer.get_watermark_offsets(self._partition_handle, cached=True)
        if high <= last_stable:
            self._held_at = None
            if self._behind_transaction:
                self._transaction_ended()
            return
        if self._behind_transaction:
            return
        if self._held_at != last_stable:
            self._held_at = last_stable  # seen once: said if the next check sees it still
            return
        self._behind_transaction = True
        log_event(
            logger, "input-behind-open-transaction", logging.WARNING, topic=self.topic,
            partition=self.partition, next_offset=self._next_offset,
            last_stable_offset=last_stable, high_watermark=high,
            idle_s=round(now - self._read_at, 1),
            consequence="the records after a transaction open upstream wait until it commits"
                        " or aborts; nothing is skipped",
        )

    def _transaction_ended(self) -> None:
        """The partition is no longer held back by a transaction: said once."""
        self._behind_transaction = False
        self._held_at = None
        log_event(logger, "input-open-transaction-ended", topic=self.topic,
                  partition=self.partition, next_offset=self._next_offset)

    @override
    def next_awake(self) -> datetime | None:
        return self._awake

    @override
    def snapshot(self) -> PartitionState:
        offset = self._next_offset
        if self._commits and offset is not None and offset != self._committed:
            self._committed = offset
            try:  # informational (lag tools): never blocks, never fails the snapshot
                self._consumer.commit(
                    offsets=[TopicPartition(self.topic, self.partition, offset)],
                    asynchronous=True,
                )
            except KafkaException as exc:
                self.commit_failed(exc.args[0] if exc.args else None)
        return offset if self._topic_id is None else (offset, self._topic_id)

    def commit_failed(self, error: object) -> None:
        now = time.monotonic()
        if now - self._last_commit_warning >= 60.0:  # at most once a minute per partition
            self._last_commit_warning = now
            name = error.name() if isinstance(error, KafkaError) else str(error)
            log_event(logger, "consumer-group-commit-failed", logging.WARNING,
                      topic=self.topic, partition=self.partition, error=name)

    @override
    def close(self) -> None:
        if self._alignment is not None:
            self._alignment.forget(self._key)
        BACKLOG.closed(self.topic, self.partition)
        INPUT_PROGRESS.forget(self._progress)
        if self._guard is not None:
            self._guard.close()
        offset = self._next_offset
        if self._commits and offset is not None:  # a clean stop: no start of a crash loop
            with contextlib.suppress(KafkaException):
                self._consumer.commit(
                    offsets=[TopicPartition(self.topic, self.partition, offset)],
                    asynchronous=True)
        # librdkafka's close waits for the group's informational commits: with the broker down,
        # for ever. Closed aside; waited for (within a stop's grace, :mod:`runtime.shutdown`)
        # unless every broker is known to be down.
        consumer = self._shared.leave(self)
        HEALTH.resumed(waiter=self._waiter)  # left: no outage reaches it any more
        if consumer is None:
            return  # other partitions of the worker still read from it
        closing = threading.Thread(target=consumer.close, name="close-consumer", daemon=True)
        closing.start()
        closing.join(0 if self._shared.down_attempts else SHUTDOWN.time_left(10.0))


T = TypeVar("T")
_METADATA_CALLS = itertools.count()


def _retrying(
    call: Callable[[], T], topic: str, backoff: Backoff, count_retry: Callable[[], None]
) -> T:
    """Run a metadata call until Kafka answers (a leader moving, a broker restarting).

    The one retry loop of the service (:func:`runtime.backoff.retry_forever`): every
    ``KafkaException`` is retried with back-off, counted, reported to health (each call its
    own waiter: workers may wait at once) and logged.
    """
    waiter = f"{topic}-metadata-{next(_METADATA_CALLS)}"

    def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
        count_retry()
        HEALTH.paused("kafka", attempt, type(exc).__name__, waiter=waiter)
        log_event(
            logger, "kafka-metadata-retry", logging.WARNING, topic=topic,
            error=str(exc), attempt=attempt, delay_s=round(delay, 2),
        )

    return retry_forever(
        call,
        is_transient=lambda exc: isinstance(exc, KafkaException),
        backoff=backoff,
        on_retry=on_retry,
        on_recovered=lambda _attempts: HEALTH.resumed(waiter=waiter),
        sleep=SHUTDOWN.retry_sleep,
    )


_HEADERS_OF = operator.methodcaller("headers")
"""``msg.headers()``, called so that a result with an exception set raises.

confluent-kafka (2.x) returns such a result for a header name that is not UTF-8: a list whose
pair holds a NULL. Written ``msg.headers()`` in a hot loop, CPython 3.11 specializes the call
into a direct C call that only asserts the result is clean: the list came through, and reading
it crashed the process (a segmentation fault, at every start). Through ``methodcaller`` the call
is checked and raises ``SystemError``, which :func:`_unreadable_headers` handles."""


def _unreadable_headers(
    topic: str, partition: int, offset: int, exc: Exception,
) -> tuple[tuple[str, bytes], ...]:
    """No headers for a record whose headers confluent-kafka cannot give (logged).

    A header name that is not UTF-8 (any client outside Python can write one; Kafka's Java
    client reads it with replacement characters) makes ``msg.headers()`` raise (confluent-kafka
    2.x: a ``SystemError`` over the ``UnicodeDecodeError`` of the name). Raised from the input,
    it stopped the job on that record at every start: a crash loop. The record's key and value
    are intact, so it takes its normal way without headers: it only loses its ``traceparent``
    (and a dead letter of it, the original headers).
    """
    log_event(logger, "input-headers-unreadable", logging.WARNING,
              source=f"{topic}[{partition}]@{offset}", error=type(exc).__name__,
              detail=str(exc.__cause__ or exc)[:200])
    return ()


def _headers(raw: object) -> tuple[tuple[str, bytes], ...]:
    """``msg.headers()`` as ``SourceRecord.headers``: None -> (), a null value -> ``b""``.

    Hot (once per consumed record): confluent-kafka already gives a list of ``(str, bytes)``
    tuples (``None`` for a null value), so the usual case is one copy of that list into a tuple
    (immutable, hashable), without rebuilding a pair per header.
    """
    if not raw or not isinstance(raw, list):
        return ()
    for _name, value in raw:
        if value is None:
            return tuple([(name, value or b"") for name, value in raw])
    return tuple(raw)


__all__ = ["OFFSET_END", "InputItem", "KafkaInput", "StartPosition"]
