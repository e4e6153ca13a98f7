"""The dead-letter publisher: original key, value and headers plus the ``x-dlq-*`` headers.

``publish`` returns once the broker acknowledged every letter; Kafka down is retried forever with
back-off (the stream paused). A letter can always be written: the producer uses zstd and the DLQ
topic's ``max.message.bytes`` (read at first use; 1,000,000 with a warning if unreadable); a letter
refused with a record error is sent again alone, then in ever smaller forms
(:class:`~schemas.dlq_letter.LetterForm`: value cut, ``x-dlq-truncated``; no original headers; no
key), each reduction logged. A delivered letter is never sent again, nor one handed over whose
report has not come (no message timeout: librdkafka retries it with its sequence number). A letter
in flight when the process ends is sent again by the next start. librdkafka checks
``message.max.bytes`` against the uncompressed record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]
from prometheus_client import Counter
from typing_extensions import override

from runtime.backoff import Backoff, retry_forever
from runtime.logs import LIBRDKAFKA_LOGGER, log_event
from runtime.process import Process
from runtime.settings import Settings
from schemas.dlq_letter import DeadLetter, LetterForm, next_form
from sinks.errors import (
    DeliveryFailedError,
    is_infrastructure_error,
    is_record_error,
    kafka_error_of,
)
from sinks.kafka_producer import KafkaProducer, OutgoingRecord, Sending

logger = logging.getLogger(__name__)
T = TypeVar("T")

SEND_TIMEOUT_SECONDS = 35.0
"""How long one attempt waits for its letters' reports before a back-off (then it waits again)."""

DEFAULT_TOPIC_LIMIT = 1_000_000
"""The DLQ size limit assumed when the topic's ``max.message.bytes`` cannot be read."""

_MIN_PRODUCER_LIMIT = 1_000  # librdkafka's range for message.max.bytes ...
_MAX_PRODUCER_LIMIT = 100_000_000  # ... capped at receive.message.max.bytes' default

_UNREACHABLE_CODES = frozenset({
    KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
    KafkaError._MSG_TIMED_OUT, KafkaError._RESOLVE, KafkaError._WAIT_COORD,
    KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION})
"""Codes meaning the cluster could not be reached: the limit lookup retries, nothing else."""


def is_kafka_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says Kafka could not be reached (not: it answered with a refusal)."""
    err = kafka_error_of(exc) if isinstance(exc, KafkaException) else None
    return isinstance(exc, TimeoutError) or (err is not None and err.code() in _UNREACHABLE_CODES)


@dataclass(slots=True)
class _Pending:
    letter: DeadLetter
    form: LetterForm = LetterForm.WHOLE
    delivered: bool = False
    alone: bool = False  # refused in a batch with others: sent alone from now on
    sent: tuple[Sending, int] | None = None  # handed over, no report yet: waited for, not resent


class DeadLetterPublisher:
    """Sends dead letters to one DLQ topic and counts them."""

    def __init__(self, settings: Settings, topic: str, dlq_counter: Counter,
                 retries_counter: Counter, *, name: str, process: Process) -> None:
        self._topic = topic
        self._process = process
        self._name = name  # the waiter a Kafka outage pauses (health)
        self._settings = settings
        self._producer: KafkaProducer | None = None  # built on the first letter: poison is rare
        self._limit: int | None = None  # the topic's max.message.bytes, read on the first letter
        self._dlq_counter = dlq_counter
        self._retries_counter = retries_counter
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)

    @property
    def limit(self) -> int | None:
        """The DLQ topic's size limit the letters are fitted to (None before the first use)."""
        return self._limit

    def publish(self, letters: Sequence[DeadLetter]) -> None:
        """Send ``letters``; return once all are acknowledged or unwritable (module doc)."""
        if not letters:
            return
        producer = self._ensure_producer()
        limit = self._limit or DEFAULT_TOPIC_LIMIT
        pending = [_Pending(letter) for letter in letters]
        settled: list[_Pending] = []

        def attempt() -> None:
            while pending:
                together = [p for p in pending if not p.alone]
                groups = ([together] if together else []) + [[p] for p in pending if p.alone]
                still: list[_Pending] = []
                service: KafkaError | None = None
                for group in groups:
                    for p, (err, with_others) in zip(
                            group, self._deliver(producer, group, limit), strict=True):
                        if err is None:
                            p.delivered = True
                            settled.append(p)
                        elif not is_record_error(err):
                            service = service or err
                            still.append(p)
                        elif with_others:  # maybe an innocent batch-mate: alone first
                            p.alone = True
                            still.append(p)
                        elif self._reduce(p, err, limit):
                            still.append(p)
                        else:
                            settled.append(p)
                pending[:] = still
                if service is not None:
                    raise DeliveryFailedError(service)

        self._retry(attempt, is_infrastructure_error)
        for p in settled:
            self._dlq_counter.inc()
            if p.delivered:
                log_event(logger, "dead-lettered", logging.WARNING, outcome="failed",
                          reason=p.letter.reason.value, exception_type=p.letter.exception_type,
                          attempts=p.letter.attempts, source=p.letter.record.where(),
                          form=None if p.form is LetterForm.WHOLE else p.form.name.lower(),
                          **dict(p.letter.ids))

    def _deliver(self, producer: KafkaProducer, group: Sequence[_Pending], limit: int,
                 ) -> list[tuple[KafkaError | None, bool]]:
        """Each letter's result and whether it went with others (one in flight: waited for)."""
        fresh = [p for p in group if p.sent is None]
        if fresh:
            rendered = [p.letter.render(p.form, limit) for p in fresh]
            sending = producer.send([OutgoingRecord(self._topic, r.key, r.value, r.headers)
                                     for r in rendered])
            for index, p in enumerate(fresh):
                p.sent = (sending, index)
        deadline = time.monotonic() + SEND_TIMEOUT_SECONDS
        results: dict[int, list[KafkaError | None]] = {}
        out: list[tuple[KafkaError | None, bool]] = []
        for p in group:
            assert p.sent is not None
            sending, index = p.sent
            if id(sending) not in results:
                results[id(sending)] = producer.wait(sending, max(0.0, deadline - time.monotonic()))
            if sending.settled[index]:
                p.sent = None  # its report came: a retry sends it anew
            out.append((results[id(sending)][index], len(sending.settled) > 1))
        return out

    def _reduce(self, p: _Pending, err: KafkaError, limit: int) -> bool:
        """Move ``p`` to its next form after ``err``; False when there is none left."""
        refused = p.form
        form = next_form(p.letter, refused, limit)
        if form is None:  # even the bare letter: the topic refuses such records (compacted?)
            log_event(logger, "dead-letter-unwritable", logging.ERROR, outcome="failed",
                      reason=p.letter.reason.value, source=p.letter.record.where(),
                      code=err.name(), dlq_topic=self._topic)
            return False
        p.form = form
        log_event(logger, "dead-letter-reduced", logging.WARNING, source=p.letter.record.where(),
                  code=err.name(), refused_form=refused.name.lower(), form=form.name.lower(),
                  original_size=p.letter.original_size, limit=limit)
        return True

    def _ensure_producer(self) -> KafkaProducer:
        if self._producer is None:
            if self._limit is None:
                self._limit = self._read_topic_limit()
            # no message timeout: a letter in flight is never given up (see _deliver)
            overrides: dict[str, Any] = {"compression.type": "zstd", "message.timeout.ms": 0,
                                         "message.max.bytes": max(_MIN_PRODUCER_LIMIT, self._limit),
                                         "delivery.report.only.error": False}  # send() and wait()
            self._producer = KafkaProducer(self._settings, "dlq", stopping=self._process.stopping,
                                           **overrides)
        return self._producer

    def _read_topic_limit(self) -> int:
        """The DLQ topic's ``max.message.bytes`` (retried while Kafka is unreachable)."""
        config: dict[str, Any] = {**self._settings.kafka_client_config(),
                                  "client.id": f"{self._settings.kafka_client_id}-dlq-admin",
                                  "socket.connection.setup.timeout.ms": 5_000,
                                  "logger": LIBRDKAFKA_LOGGER}
        admin = AdminClient(config)

        def read() -> int:
            resource = ConfigResource("topic", self._topic)
            futures = admin.describe_configs([resource], request_timeout=10)
            entries = futures[resource].result(15)
            return int(entries["max.message.bytes"].value)

        try:
            limit = self._retry(read, is_kafka_unreachable)
        except Exception as exc:  # noqa: BLE001 - any answer but "unreachable": use the default
            err = kafka_error_of(exc)
            log_event(logger, "dlq-limit-unknown", logging.WARNING, dlq_topic=self._topic,
                      error=type(exc).__name__, code=None if err is None else err.name(),
                      limit=DEFAULT_TOPIC_LIMIT)
            return DEFAULT_TOPIC_LIMIT
        limit = min(max(limit, 1), _MAX_PRODUCER_LIMIT)
        log_event(logger, "dlq-limit", dlq_topic=self._topic, limit=limit)
        return limit

    def _retry(self, attempt: Callable[[], T], is_transient: Callable[[BaseException], bool]) -> T:
        """``attempt()``, retried forever with back-off while ``is_transient`` (Kafka paused)."""
        return retry_forever(attempt, is_transient=is_transient, backoff=self._backoff,
                             on_retry=self._on_retry,
                             on_recovered=lambda _n: self._process.health.resumed(
                                 waiter=self._name),
                             sleep=self._process.stopping.retry_sleep)

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        self._retries_counter.inc()
        self._process.health.paused("kafka", attempt, type(exc).__name__, waiter=self._name)
        log_event(logger, "dlq-publish-retry", logging.WARNING, error=type(exc).__name__,
                  detail=str(exc), attempt=attempt, delay_s=round(delay, 2))

    def close(self) -> None:
        """Flush what is queued (bounded) and drop the producer."""
        self._process.health.resumed(waiter=self._name)
        if self._producer is not None:
            self._producer.close(10)
            self._producer = None


class DeadLetterSink(DynamicSink[DeadLetter]):
    """Publishes a flow's dead letters to its DLQ topic (``write_batch`` blocks until acked)."""

    def __init__(self, settings: Settings, topic: str, dlq_counter: Counter,
                 retries_counter: Counter, process: Process) -> None:
        self._publisher_args = (settings, topic, dlq_counter, retries_counter)
        self._process = process

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DeadLetterPartition:
        return _DeadLetterPartition(DeadLetterPublisher(
            *self._publisher_args, name=f"{step_id}-{worker_index}", process=self._process))


class _DeadLetterPartition(StatelessSinkPartition[DeadLetter]):
    def __init__(self, publisher: DeadLetterPublisher) -> None:
        self._publisher = publisher

    @override
    def write_batch(self, items: list[DeadLetter]) -> None:
        self._publisher.publish(items)

    @override
    def close(self) -> None:
        self._publisher.close()
