"""The dead-letter publisher: original key, value and headers plus the ``x-dlq-*`` headers.

``publish`` returns only when the broker acknowledged every letter; while Kafka is down it
retries forever with back-off (the stream stays paused), so a poison record is never lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from bytewax.outputs import DynamicSink, StatelessSinkPartition
from confluent_kafka import Producer
from prometheus_client import Counter
from typing_extensions import override

from runtime.backoff import Backoff, retry_forever
from runtime.health import HEALTH
from runtime.logs import log_event
from runtime.settings import Settings
from schemas.dlq_letter import DeadLetter
from sinks.errors import DeliveryFailedError, is_infrastructure_error
from sinks.kafka_producer import OutgoingRecord, build_producer, produce_and_wait

logger = logging.getLogger(__name__)


class DeadLetterPublisher:
    """Sends dead letters to one DLQ topic and counts them."""

    def __init__(
        self, settings: Settings, topic: str, dlq_counter: Counter, retries_counter: Counter
    ) -> None:
        self._topic = topic
        self._settings = settings
        self._producer: Producer | None = None  # built on the first letter: poison is rare
        self._dlq_counter = dlq_counter
        self._retries_counter = retries_counter
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)

    def publish(self, letters: Sequence[DeadLetter]) -> None:
        """Send ``letters``; return once all are acknowledged (retrying forever)."""
        pending = list(letters)
        if not pending:
            return

        def attempt() -> None:
            records = [
                OutgoingRecord(self._topic, ltr.record.key, ltr.record.value, ltr.headers())
                for ltr in pending
            ]
            if self._producer is None:
                self._producer = build_producer(self._settings, "dlq")
            errors = produce_and_wait(self._producer, records)
            failed = [ltr for ltr, err in zip(pending, errors, strict=True) if err is not None]
            first = next((err for err in errors if err is not None), None)
            pending[:] = failed
            if first is not None:
                raise DeliveryFailedError(first.name())

        retry_forever(
            attempt,
            is_transient=is_infrastructure_error,
            backoff=self._backoff,
            on_retry=self._on_retry,
            on_recovered=lambda _n: HEALTH.resumed("kafka"),
            sleep=time.sleep,
        )
        for letter in letters:
            self._dlq_counter.inc()
            log_event(
                logger,
                "dead-lettered",
                logging.WARNING,
                outcome="failed",
                reason=letter.reason.value,
                exception_type=letter.exception_type,
                attempts=letter.attempts,
                source=letter.record.where(),
            )

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        self._retries_counter.inc()
        HEALTH.paused("kafka", attempt, type(exc).__name__)
        log_event(
            logger,
            "dlq-publish-retry",
            logging.WARNING,
            error=type(exc).__name__,
            detail=str(exc),
            attempt=attempt,
            delay_s=round(delay, 2),
        )

    def close(self) -> None:
        """Flush what is queued (bounded) and drop the producer."""
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None


class DeadLetterSink(DynamicSink[DeadLetter]):
    """Publishes a flow's dead letters to its DLQ topic (``write_batch`` blocks until acked)."""

    def __init__(
        self, settings: Settings, topic: str, dlq_counter: Counter, retries_counter: Counter
    ) -> None:
        self._settings = settings
        self._topic = topic
        self._dlq_counter = dlq_counter
        self._retries_counter = retries_counter

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DeadLetterPartition:
        return _DeadLetterPartition(
            DeadLetterPublisher(
                self._settings, self._topic, self._dlq_counter, self._retries_counter
            )
        )


class _DeadLetterPartition(StatelessSinkPartition[DeadLetter]):
    def __init__(self, publisher: DeadLetterPublisher) -> None:
        self._publisher = publisher

    @override
    def write_batch(self, items: list[DeadLetter]) -> None:
        self._publisher.publish(items)

    @override
    def close(self) -> None:
        self._publisher.close()
