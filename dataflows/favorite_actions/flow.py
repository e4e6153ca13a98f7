"""Wiring of the favorites flow: Kafka -> decode -> key by owner -> dedup -> Postgres sink.

::

    favorite_added_input ─┐                      ┌─ dead_letter_poison (DLQ topic)
                          ├─ decode_favorite ────┼─ log_invalid_owner
    favorite_removed_input┘   (+ consumer errors)└─ key_by_owner ─ dedup_by_message_id
                                                      ─ record_action_history (Postgres + outbox)

One input step per topic, so either can be replayed on its own. Exactly-once effect =
at-least-once input (offsets in Bytewax snapshots) + idempotent transactional writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.operators import StatefulBatchLogic
from bytewax.outputs import DynamicSink

from dataflows.favorite_actions.decode import (
    SKIP_OUTCOMES,
    Decoded,
    FavoriteMessage,
    Skipped,
    SkipReason,
    decode_favorite,
)
from dataflows.favorite_actions.dedup import DedupWindow
from runtime.backoff import Backoff
from runtime.health import serve_http
from runtime.logs import log_event
from runtime.metrics import (
    CONSUMER_ERRORS,
    FAVORITES_DLQ,
    FAVORITES_RETRIES,
    FAVORITES_SKIPPED,
)
from runtime.settings import Settings, StartingOffset
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import ConsumerError, SourceRecord
from sinks.action_history import ActionHistorySink, DeadLetterSink, message_fields
from sinks.dry_run import DryRunActionSink, DryRunDeadLetterSink, Tally
from sources.kafka_input import KafkaInput, StartPosition

logger = logging.getLogger(__name__)


class DedupLogic(StatefulBatchLogic[FavoriteMessage, FavoriteMessage, dict[bytes, float]]):
    """Per-owner dedup: passes a message on once per idempotency key within the TTL.

    Duplicates are dropped (logged ``skipped-duplicate``), not passed on as ``None``. Expired ids
    are evicted by a timer; an owner whose window empties is discarded. The snapshot is the
    owner's small dict, so snapshot cost follows the owners touched in an epoch, not the total.
    """

    def __init__(self, ttl: float, state: dict[bytes, float] | None) -> None:
        self._window = DedupWindow(ttl, state)

    def on_batch(self, values: list[FavoriteMessage]) -> tuple[list[FavoriteMessage], bool]:
        """Admit fresh messages, drop and log duplicates."""
        now = time.time()
        fresh: list[FavoriteMessage] = []
        for message in values:
            if self._window.admit(message.dedup_id, now):
                fresh.append(message)
            else:
                _log_skip(SkipReason.DUPLICATE, message_fields(message))
        return fresh, StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[FavoriteMessage], bool]:
        """Evict expired ids; discard the owner's state once it is empty."""
        self._window.evict(time.time())
        return [], len(self._window) == 0

    def notify_at(self) -> datetime | None:
        """When the owner's oldest id expires."""
        expiry = self._window.next_expiry()
        return None if expiry is None else datetime.fromtimestamp(expiry, UTC)

    def snapshot(self) -> dict[bytes, float]:
        """A copy of the owner's window."""
        return self._window.snapshot()


def _log_skip(reason: SkipReason, fields: dict[str, Any]) -> None:
    FAVORITES_SKIPPED.labels(reason=reason.value).inc()
    log_event(logger, SKIP_OUTCOMES[reason], outcome=SKIP_OUTCOMES[reason], **fields)


def _log_skipped(_step_id: str, skipped: Skipped) -> None:
    fields: dict[str, Any] = {"source": skipped.record.where()}
    if skipped.message is not None:
        fields["MessageId"] = str(skipped.message.message_id)
        fields["FavoriteId"] = str(skipped.message.payload.favorite_id)
        fields["PropertyObjectId"] = str(skipped.message.payload.property_object_id)
    if skipped.action_type is not None:
        fields["ActionType"] = skipped.action_type.value
    _log_skip(skipped.reason, fields)


def _log_consumer_error(_step_id: str, error: ConsumerError) -> None:
    CONSUMER_ERRORS.labels(topic=error.topic, code=error.code).inc()
    log_event(
        logger,
        "kafka-consumer-error",
        logging.ERROR if error.fatal else logging.WARNING,
        topic=error.topic,
        partition=error.partition,
        code=error.code,
        reason=error.reason,
    )


def _warn_version(message: FavoriteMessage) -> FavoriteMessage:
    if message.version_mismatch:
        log_event(
            logger,
            "contract-version-mismatch",
            logging.WARNING,
            version=message.envelope.version,
            **message_fields(message),
        )
    return message


def start_position(settings: Settings) -> StartPosition:
    """The configured starting position (used only for partitions without a snapshot)."""
    return StartPosition(latest=settings.starting_offset is StartingOffset.LATEST)


def build_flow(
    settings: Settings,
    start: StartPosition | None = None,
    *,
    topics: Sequence[str] | None = None,
    dry_run: Tally | None = None,
) -> Dataflow:
    """The favorites dataflow for ``settings``.

    ``start`` overrides the starting position; ``topics`` limits the input to some of the two
    favorites topics (a replay of one topic); ``dry_run`` swaps the sinks for read-only ones
    that tally would-be outcomes into the given :class:`~sinks.dry_run.Tally`.
    """
    serve_http(settings.http_host, settings.http_port)
    flow = Dataflow("favorite_actions")
    client = settings.kafka_client_config()
    position = start or start_position(settings)
    backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)

    def kafka_input(step_id: str, topic: str) -> Stream[SourceRecord | ConsumerError]:
        source = KafkaInput(
            client, topic, start=position, tail=settings.tail,
            batch_size=settings.source_batch_size, backoff=backoff,
        )
        return op.input(step_id, flow, source)

    inputs = [
        kafka_input(step_id, topic)
        for step_id, topic in (
            ("favorite_added_input", settings.topic_favorite_added),
            ("favorite_removed_input", settings.topic_favorite_removed),
        )
        if topics is None or topic in topics
    ]
    consumed = op.merge("merge_favorite_topics", *inputs)

    by_kind = op.branch(
        "split_consumer_errors", consumed, lambda item: isinstance(item, SourceRecord)
    )
    op.inspect("log_consumer_errors", by_kind.falses, _log_consumer_error)  # type: ignore[arg-type]

    action_types = {
        settings.topic_favorite_added: ActionType.ADD_TO_FAVORITES,
        settings.topic_favorite_removed: ActionType.REMOVE_FROM_FAVORITES,
    }

    def decode(record: SourceRecord) -> Decoded:
        return decode_favorite(record, action_types)

    decoded = op.map("decode_favorite", by_kind.trues, decode)  # type: ignore[arg-type]
    valid = op.branch("route_decoded", decoded, lambda d: isinstance(d, FavoriteMessage))
    rejected = op.branch(
        "route_rejected", valid.falses, lambda d: isinstance(d, DeadLetter)
    )
    dead_letters: DynamicSink[DeadLetter] = (
        DeadLetterSink(settings, settings.topic_favorites_dlq, FAVORITES_DLQ, FAVORITES_RETRIES)
        if dry_run is None
        else DryRunDeadLetterSink(dry_run)
    )
    op.output("dead_letter_poison", rejected.trues, dead_letters)  # type: ignore[misc]
    op.inspect("log_invalid_owner", rejected.falses, _log_skipped)  # type: ignore[arg-type]

    messages = op.map("warn_version_mismatch", valid.trues, _warn_version)  # type: ignore[arg-type]
    keyed = op.key_on("key_by_owner", messages, lambda m: m.owner_key)
    ttl = settings.dedup_ttl_seconds
    fresh = op.stateful_batch(
        "dedup_by_message_id", keyed, lambda state: DedupLogic(ttl, state)
    )
    history: DynamicSink[tuple[str, FavoriteMessage]] = (
        ActionHistorySink(settings) if dry_run is None else DryRunActionSink(settings, dry_run)
    )
    op.output("record_action_history", fresh, history)
    return flow
