"""The outbox's Kafka side: one transactional producer for the stream, its progress read back.

The ``transactional.id`` belongs to the stream, not the process. :meth:`~TransactionalStream.open`
makes a producer, ``init_transactions`` (fencing any earlier producer of the stream, ending its
open transaction), then reads the last committed progress record (read_committed).
:meth:`~TransactionalStream.publish` sends records, then the progress, in one Kafka transaction:
committed, or aborted with each record's refusal. An unknown outcome (a time-out), and once per
commit a producer's own fatal state (:func:`renewable`), drop the producer and raise
:class:`OutcomeUnknownError`: the stream is opened again, never continued (no KIP-890 part 2 in
librdkafka, confluentinc/librdkafka#5423). A fenced or refused producer asks for a restart
(exit 75), raising :class:`StreamFencedError`; an unanswered call raises ``KafkaException``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.kafka_producer import Producible, build_producer, failure_reporter, hand_over
from sinks.outbox.progress import Progress

logger = logging.getLogger(__name__)

_READ_BACK = 64  # offsets read back from the end at first: a progress record and its marker each
_OPEN_SECONDS = 10.0
COMMIT_SECONDS = 10.0
"""A transaction not committed in this long is given up: a new producer reads what committed.

A request stuck on a frozen leader can keep the old producer from committing for the whole
message time-out; a new one sends to the live leaders at once (docs/decisions.md)."""


class StreamFencedError(Exception):
    """Another producer of the stream took over, or the producer died: a restart was asked for."""


class OutcomeUnknownError(Exception):
    """A transaction's outcome is unknown: the stream is closed, to be opened again."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one :meth:`TransactionalStream.publish` did."""

    committed: bool
    errors: Sequence[KafkaError | None]
    """Per record: the client's or the broker's refusal (None: none seen)."""
    error: KafkaError | None = None
    """Why the transaction was aborted (None when committed or refused locally)."""


class TransactionalStream:
    """The stream's producer and progress topic (module doc); used by one thread."""

    def __init__(self, settings: Settings, *, stopping: Shutdown) -> None:
        self._settings = settings
        self._stopping = stopping
        self._key = settings.outbox_transactional_id.encode()
        self._topic = settings.topic_outbox_progress
        self._producer: Producer | None = None
        self._fatal_since_commit = False

    @property
    def is_open(self) -> bool:
        """A producer of the stream is initialized (and not known fenced)."""
        return self._producer is not None

    def open(self) -> Progress | None:
        """A new producer (fencing the previous one), then the last committed progress.

        None: the progress topic holds no record of this stream. Raises ``KafkaException``
        when Kafka does not answer, :class:`StreamFencedError` on a fatal error.
        """
        self._renew()
        progress = read_progress(self._settings.kafka_client_config(), self._topic, self._key)
        log_event(logger, "outbox-stream-opened", logging.INFO,
                  transactional_id=self._key.decode(), progress_found=progress is not None,
                  delivered=None if progress is None else progress.delivered,
                  sent=None if progress is None else len(progress.sent),
                  target=None if progress is None else progress.target)
        return progress

    def publish(self, records: Sequence[Producible], progress: Progress,
                timeout: float = COMMIT_SECONDS, *, abort: bool = False) -> Attempt:
        """``records`` then ``progress`` in one transaction: committed, or aborted (module doc).

        ``abort``: no progress; the records are flushed, then the transaction is aborted.
        """
        producer = self._producer
        if producer is None:
            raise RuntimeError("the outbox stream is not open")
        errors: list[KafkaError | None] = [None] * len(records)
        try:
            producer.begin_transaction()
            report = failure_reporter(records, errors)
            hand_over(producer, records, lambda _index: report, errors.__setitem__)
            if any(errors):  # refused before sending: no progress may claim the record
                return self._aborted(errors, None)
            if abort:
                if producer.flush(self._stopping.time_left(timeout)) > 0:
                    return self._unknown(KafkaError(KafkaError._TIMED_OUT, "probe"))
                return self._aborted(errors, None)
            producer.produce(self._topic, progress.encode(), self._key, partition=0)
            producer.commit_transaction(self._stopping.time_left(timeout))
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            self._fail_if_fatal(error)
            if error.txn_requires_abort():
                return self._aborted(errors, error)
            return self._unknown(error)
        except SystemError as exc:  # a fatal error raised while a report was served
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, KafkaException):
                self._fail_if_fatal(cause.args[0])
            return self._unknown(KafkaError(KafkaError._FAIL, str(exc)))
        if not abort:
            self._fatal_since_commit = False
        return Attempt(True, errors)

    def probe(self, record: Producible, timeout: float = COMMIT_SECONDS) -> KafkaError | None:
        """Whether the broker refuses ``record`` alone, in a transaction that is always aborted.

        read_uncommitted consumers may see it; read_committed ones never do.
        """
        attempt = self.publish([record], Progress("1:1:"), timeout, abort=True)
        alone = attempt.errors[0]
        if alone is not None and alone.code() not in _PURGED:
            return alone
        return attempt.error or alone

    def refused_topics(self, topics: Iterable[str], timeout: float = 10.0) -> dict[str, KafkaError]:
        """Of ``topics``, those the broker refuses this principal to write (or does not have).

        The broker's own verdict (KIP-430 authorized operations); nothing is written. A topic
        refused as a transaction adds it names no record: this names the topic.
        """
        config: dict[str, Any] = {**self._settings.kafka_client_config(),
                                  "logger": LIBRDKAFKA_LOGGER}
        admin = AdminClient(config)
        asked = admin.describe_topics(TopicCollection(sorted(set(topics))),
                                      include_authorized_operations=True, request_timeout=timeout)
        refused: dict[str, KafkaError] = {}
        for topic, future in asked.items():
            try:
                found = future.result(timeout + 1)
            except KafkaException as exc:
                refused[topic] = exc.args[0]
                continue
            operations = found.authorized_operations
            if operations is not None and "WRITE" not in {op.name for op in operations}:
                refused[topic] = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
        return refused

    def close(self) -> None:
        """Drop the producer: whatever it had open is aborted by the next one (never waits)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                producer.purge(in_queue=True, in_flight=True, blocking=False)

    def _aborted(self, errors: list[KafkaError | None], error: KafkaError | None) -> Attempt:
        """Not committed: a new producer ends the transaction (its ``init_transactions``).

        Not ``abort_transaction``: it waits out records in flight to a frozen leader, fails
        with INVALID_TXN_STATE when no partition was added (librdkafka#4849), and leaves a
        refused batch's sequence gap to fail the next transaction (karafka/waterdrop#501).
        """
        try:
            self._renew()
        except KafkaException as exc:
            return self._unknown(exc.args[0])  # closed: opened again, the progress read
        return Attempt(False, errors, error)

    def _renew(self) -> None:
        """A new producer of the stream, initialized (fencing the previous one)."""
        self.close()
        producer = self._producer = build_producer(self._settings, "outbox",
                                                   **self._transactional_config())
        try:
            producer.init_transactions(_OPEN_SECONDS)
        except KafkaException as exc:
            self._fail_if_fatal(exc.args[0])
            self._producer = None  # not initialized: opened again by the next cycle
            raise

    def _unknown(self, error: KafkaError) -> Attempt:
        log_event(logger, "outbox-transaction-outcome-unknown", logging.WARNING,
                  error=error.name(), detail=error.str(),
                  action="a new producer reads the progress Kafka committed")
        self.close()
        raise OutcomeUnknownError(f"a transaction's outcome is unknown ({error.name()})")

    def _fail_if_fatal(self, error: KafkaError) -> None:
        """A fatal error: :class:`OutcomeUnknownError` (renewable, module doc), else a restart."""
        if not error.fatal():
            return
        # never destroyed before the process ends: librdkafka's destroy of a fenced transactional
        # producer corrupted the heap (glibc: "unaligned tcache chunk detected", SIGABRT)
        _FATAL_PRODUCERS.append(self._producer)
        self._producer = None
        if renewable(error, fatal_since_commit=self._fatal_since_commit):
            self._fatal_since_commit = True
            log_event(logger, "kafka-producer-fatal", logging.WARNING,
                      transactional_id=self._key.decode(), error=error.name(),
                      detail=error.str(), action="a new producer fences this one and reads the"
                                                 " progress Kafka committed")
            raise OutcomeUnknownError(f"the outbox's producer is in its fatal state"
                                      f" ({error.name()})")
        fenced = error.code() in _FENCED
        log_event(logger, "outbox-stream-fenced" if fenced else "kafka-producer-fatal",
                  logging.ERROR, transactional_id=self._key.decode(), error=error.name(),
                  detail=error.str(), action="stopping cleanly (exit 75)")
        self._stopping.restart("the outbox's producer was fenced by another" if fenced
                               else f"the outbox's producer is in its fatal state ({error.name()})")
        raise StreamFencedError(error.name())

    def _transactional_config(self) -> dict[str, Any]:
        settings = self._settings
        return {"transactional.id": self._key.decode(),
                "transaction.timeout.ms": settings.outbox_transaction_timeout_ms,
                "message.timeout.ms": settings.outbox_message_timeout_ms,
                # a request to a frozen broker times out and goes to the new leader: a window
                # waits for the failover and about this, not for the message time-out
                "socket.timeout.ms": 3000, "api.version.request.timeout.ms": 3000,
                # a missing topic is known after 5 s: its rows are held, not retried 30 s
                "topic.metadata.propagation.max.ms": 5000}


def renewable(error: KafkaError, *, fatal_since_commit: bool) -> bool:
    """Whether a fatal ``error`` is the producer's own state, which a new producer ends.

    Not a fence (another producer of the stream) nor the broker's refusal of the transactional
    id, and no other fatal error since the stream's last commit (a second one: a restart).
    """
    return (error.fatal() and not fatal_since_commit
            and error.code() not in _FENCED and error.code() not in _REFUSED)


_FATAL_PRODUCERS: list[Producer | None] = []
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
"""A record's report when its transaction failed for another reason."""
_FENCED = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                     KafkaError.INVALID_PRODUCER_EPOCH})
_REFUSED = frozenset({KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                      KafkaError.CLUSTER_AUTHORIZATION_FAILED})


def read_progress(client_config: dict[str, Any], topic: str, key: bytes,
                  timeout: float = _OPEN_SECONDS) -> Progress | None:
    """The last committed progress record of stream ``key`` on ``topic``'s one partition.

    Reads read_committed from near the end, further back until a record of ``key`` is found or
    the log's start is reached. Raises ``KafkaException`` when Kafka does not answer in
    ``timeout``, ``ValueError`` for a record that is no progress.
    """
    consumer = Consumer({**client_config, "group.id": "user-activity-outbox-progress",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True, "logger": LIBRDKAFKA_LOGGER})
    try:
        low, end = _watermarks(consumer, TopicPartition(topic, 0), time.monotonic() + timeout)
        start, last = max(low, end - _READ_BACK), None
        while last is None and end > low:
            last = _last_of(consumer, TopicPartition(topic, 0, start), key, end, timeout)
            end, start = start, max(low, start - 16 * (end - start))
        return None if last is None else Progress.decode(last)
    finally:
        consumer.close()


def _watermarks(consumer: Consumer, partition: TopicPartition, deadline: float
                ) -> tuple[int, int]:
    """The partition's log start and end, asked until ``deadline`` (a leader moving)."""
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                partition, timeout=max(0.1, deadline - time.monotonic()), cached=False)
            return int(low), int(high)
        except KafkaException:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def _last_of(consumer: Consumer, start: TopicPartition, key: bytes, end: int,
             timeout: float) -> bytes | None:
    """The value of the last record of ``key`` from ``start`` up to the committed end."""
    consumer.assign([start])
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(min(1.0, max(0.0, deadline - time.monotonic())))
        if msg is None:
            continue
        error = msg.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return last
            if msg.topic() == start.topic:  # not the group's (it is never joined nor committed)
                raise KafkaException(error)
            continue
        offset = msg.offset()
        if offset is not None and offset >= end:
            return last
        if msg.key() == key:
            last = msg.value()
    raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "reading the outbox progress"))
