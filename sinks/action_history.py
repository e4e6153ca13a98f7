"""The Bytewax sink of the favorites flow: batches -> one transaction each -> outbox -> Kafka.

Guarantees (SPEC §4-§5):
- ``write_batch`` returns only after the batch's transaction committed (and its poison, if any,
  was acknowledged by the DLQ topic). Bytewax snapshots input offsets only at the end of an epoch
  whose batches all returned, so offsets advance only after the commit.
- PostgreSQL unreachable, timeouts, admin shutdown, too many connections, serialization failure,
  deadlock: retried forever with back-off (1 s -> 60 s, jitter); the worker blocks, so no new
  input is consumed (back-pressure), nothing is skipped and nothing goes to the DLQ.
- A data error or an unexpected exception: the batch is bisected; a message failing alone three
  times is dead-lettered and its batch-mates are recorded normally.
- Idempotent: redelivered messages change nothing (see :mod:`sinks.favorites_store`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from bytewax.outputs import DynamicSink, StatelessSinkPartition
from typing_extensions import override

from dataflows.favorite_actions.decode import SKIP_OUTCOMES, FavoriteMessage, SkipReason
from runtime.backoff import Backoff, retry_forever
from runtime.health import HEALTH
from runtime.logs import log_event
from runtime.metrics import (
    FAVORITES_CONSUME_DURATION_MS,
    FAVORITES_DLQ,
    FAVORITES_LAG_SECONDS,
    FAVORITES_RECORDED,
    FAVORITES_RETRIES,
    FAVORITES_SKIPPED,
)
from runtime.poison import Poisoned, write_isolating_poison
from runtime.settings import Settings
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from sinks.db import Database
from sinks.dead_letters import DeadLetterPublisher
from sinks.errors import is_data_error, is_infrastructure_error
from sinks.favorites_store import BatchOutcome, FavoritesStore
from sinks.outbox import acquire_shared_publisher, release_shared_publisher

logger = logging.getLogger(__name__)

_RECORDED = {action: FAVORITES_RECORDED.labels(action_type=action.value) for action in ActionType}
_SKIPPED = {reason: FAVORITES_SKIPPED.labels(reason=reason.value) for reason in SkipReason}


def message_fields(message: FavoriteMessage) -> dict[str, Any]:
    """The SPEC §6 log fields of a message (ids only: no note, no PII)."""
    payload = message.envelope.payload
    return {  # UUIDs as objects: the JSON formatter (orjson) renders them natively, cheaply
        "MessageId": message.envelope.message_id,
        "FavoriteId": payload.favorite_id,
        "PropertyObjectId": payload.property_object_id,
        "ActionType": message.action_type,
        "source": message.record.where(),
    }


class ActionHistorySink(DynamicSink[tuple[str, FavoriteMessage]]):
    """Records ``(owner_key, FavoriteMessage)`` items; one partition (connection) per worker."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    @override
    def build(
        self, step_id: str, worker_index: int, worker_count: int
    ) -> _ActionHistoryPartition:
        return _ActionHistoryPartition(self._settings, worker_index)


class _ActionHistoryPartition(StatelessSinkPartition[tuple[str, FavoriteMessage]]):
    def __init__(self, settings: Settings, worker_index: int) -> None:
        self._settings = settings
        self._db = Database(settings, f"user-activity-favorites-{worker_index}")
        self._store = FavoritesStore(settings.topic_action_tracked)
        self._dlq = DeadLetterPublisher(
            settings, settings.topic_favorites_dlq, FAVORITES_DLQ, FAVORITES_RETRIES
        )
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._publisher = acquire_shared_publisher(settings)

    @override
    def write_batch(self, items: list[tuple[str, FavoriteMessage]]) -> None:
        messages = [message for _owner, message in items]
        size = self._settings.sink_batch_max
        for start in range(0, len(messages), size):
            chunk = messages[start : start + size]
            outcomes, poisoned = write_isolating_poison(
                chunk, self._write_retrying, self._settings.poison_attempts
            )
            for outcome in outcomes:
                self._report(outcome)
            if poisoned:
                self._dead_letter(poisoned)
        HEALTH.beat()

    @override
    def close(self) -> None:
        self._dlq.close()
        self._db.close()
        if self._publisher is not None:
            release_shared_publisher()

    def _write_retrying(self, batch: Sequence[FavoriteMessage]) -> BatchOutcome:
        return retry_forever(
            lambda: self._write_once(batch),
            is_transient=is_infrastructure_error,
            backoff=self._backoff,
            on_retry=self._on_retry,
            on_recovered=self._on_recovered,
            sleep=time.sleep,
        )

    def _write_once(self, batch: Sequence[FavoriteMessage]) -> BatchOutcome:
        try:
            return self._store.record_batch(self._db.connection(), batch)
        except psycopg.Error as exc:
            if is_infrastructure_error(exc):
                self._db.reset()
            raise

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        FAVORITES_RETRIES.inc()
        HEALTH.paused("postgres", attempt, type(exc).__name__)
        log_event(
            logger,
            "postgres-retry",
            logging.WARNING,
            error=type(exc).__name__,
            sqlstate=getattr(exc, "sqlstate", None),
            attempt=attempt,
            delay_s=round(delay, 2),
        )

    def _on_recovered(self, attempts: int) -> None:
        HEALTH.resumed("postgres")
        log_event(logger, "postgres-recovered", attempts=attempts)

    def _report(self, outcome: BatchOutcome) -> None:
        now_mono = time.monotonic()
        now = datetime.now(UTC)
        oldest = None
        for action in outcome.recorded:
            message = action.message
            _RECORDED[message.action_type].inc()
            FAVORITES_CONSUME_DURATION_MS.observe((now_mono - message.record.received_at) * 1000)
            created = message.envelope.created_at
            oldest = created if oldest is None or created < oldest else oldest
            log_event(
                logger,
                "recorded",
                outcome="recorded",
                SessionId=action.event.session_id,
                **message_fields(message),
            )
        for reason, messages in (
            (SkipReason.DUPLICATE, outcome.duplicates),
            (SkipReason.NO_SESSION, outcome.no_session),
        ):
            skipped = _SKIPPED[reason]
            for message in messages:
                skipped.inc()
                FAVORITES_CONSUME_DURATION_MS.observe(
                    (now_mono - message.record.received_at) * 1000
                )
                log_event(
                    logger, SKIP_OUTCOMES[reason], outcome=SKIP_OUTCOMES[reason],
                    **message_fields(message),
                )
        if oldest is not None:
            FAVORITES_LAG_SECONDS.set(max(0.0, (now - oldest).total_seconds()))

    def _dead_letter(self, poisoned: list[Poisoned[FavoriteMessage]]) -> None:
        letters = [
            DeadLetter.now(
                p.item.record,
                DlqReason.DATA_ERROR if is_data_error(p.error) else DlqReason.PROCESSING_ERROR,
                type(p.error).__name__,
                p.attempts,
            )
            for p in poisoned
        ]
        for p in poisoned:
            log_event(
                logger,
                "record-failed",
                logging.ERROR,
                outcome="failed",
                error=type(p.error).__name__,
                sqlstate=getattr(p.error, "sqlstate", None),
                **message_fields(p.item),
            )
        self._dlq.publish(letters)


class DeadLetterSink(DynamicSink[DeadLetter]):
    """Publishes dead letters from the decode step to a DLQ topic (blocks until acknowledged)."""

    def __init__(self, settings: Settings, topic: str, dlq_counter: Any, retries: Any) -> None:
        self._settings = settings
        self._topic = topic
        self._dlq_counter = dlq_counter
        self._retries = retries

    @override
    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DeadLetterPartition:
        return _DeadLetterPartition(
            DeadLetterPublisher(self._settings, self._topic, self._dlq_counter, self._retries)
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
