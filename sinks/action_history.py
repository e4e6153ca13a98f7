"""The Bytewax sink of the favorites flow: batches -> one transaction each -> outbox -> Kafka.

Offsets advance only after the commit, outages pause and poison is isolated as described in
:mod:`sinks.transactional`; writes are idempotent (:mod:`sinks.favorites_store`): redelivered
messages change nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from typing_extensions import override

from dataflows.favorite_actions.decode import SKIP_OUTCOMES, FavoriteMessage, SkipReason
from runtime.logs import log_events
from runtime.metrics import (
    FAVORITES_CONSUME_DURATION_MS,
    FAVORITES_DLQ,
    FAVORITES_LAG_SECONDS,
    FAVORITES_RECORDED,
    FAVORITES_RETRIES,
    FAVORITES_SKIPPED,
)
from runtime.settings import Settings
from schemas.favorites import ActionType
from schemas.outbox import OutboxRow
from sinks.db import Connection
from sinks.favorites_store import BatchOutcome, FavoritesStore
from sinks.transactional import PartitionedSink, TransactionalPartition

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


class ActionHistorySink(PartitionedSink[FavoriteMessage]):
    """Records ``(owner_key, FavoriteMessage)`` items: one owner's messages go to one partition."""

    @override
    def build_partition(self, part: str) -> _ActionHistoryPartition:
        return _ActionHistoryPartition(self._settings, part)


class _ActionHistoryPartition(TransactionalPartition[FavoriteMessage, BatchOutcome]):
    def __init__(self, settings: Settings, part: str) -> None:
        super().__init__(
            settings,
            name=f"user-activity-favorites-{part}",
            dlq_topic=settings.topic_favorites_dlq,
            dlq_counter=FAVORITES_DLQ,
            retries_counter=FAVORITES_RETRIES,
            logger=logger,
        )
        self._store = FavoritesStore(settings.topic_action_tracked)

    def write(self, conn: Connection, batch: Sequence[FavoriteMessage]) -> BatchOutcome:
        """One transaction: sessions, rows, marks, outbox (:mod:`sinks.favorites_store`)."""
        return self._store.record_batch(conn, batch)

    def fields(self, message: FavoriteMessage) -> dict[str, Any]:
        """SPEC §6 log fields."""
        return message_fields(message)

    def outbox_rows(self, result: BatchOutcome) -> list[OutboxRow]:
        """The action-tracked rows of the recorded actions."""
        return [action.outbox for action in result.recorded]

    def report(self, outcome: BatchOutcome) -> None:
        """Metrics and one log line per message of a committed batch.

        Counters move once per batch (``inc(n)``), the histogram observes each message, and each
        outcome's lines are written together (:func:`runtime.logs.log_events`).
        """
        now_mono = time.monotonic()
        now = datetime.now(UTC)
        observe = FAVORITES_CONSUME_DURATION_MS.observe
        recorded = outcome.recorded
        if recorded:
            messages = [action.message for action in recorded]
            for message in messages:
                observe((now_mono - message.record.received_at) * 1000)
            action_types = [message.action_type for message in messages]
            for action_type, counter in _RECORDED.items():
                if count := action_types.count(action_type):
                    counter.inc(count)
            rows = [
                {"outcome": "recorded", "SessionId": action.event.session_id,
                 **message_fields(action.message)}
                for action in recorded
            ]
            log_events(logger, "recorded", rows)
            oldest = min([message.envelope.created_at for message in messages])
            FAVORITES_LAG_SECONDS.set(max(0.0, (now - oldest).total_seconds()))
        for reason, skipped in (
            (SkipReason.DUPLICATE, outcome.duplicates),
            (SkipReason.NO_SESSION, outcome.no_session),
        ):
            if not skipped:
                continue
            for message in skipped:
                observe((now_mono - message.record.received_at) * 1000)
            _SKIPPED[reason].inc(len(skipped))
            event = SKIP_OUTCOMES[reason]
            log_events(logger, event, [{"outcome": event, **message_fields(m)} for m in skipped])
