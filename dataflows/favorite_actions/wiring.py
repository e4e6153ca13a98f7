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
from collections.abc import Sequence
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.outputs import DynamicSink, Sink

from dataflows.common import (
    configured_start,
    deduplicated,
    kafka_records,
    warn_version_mismatch,
)
from dataflows.favorite_actions.decode import (
    SKIP_OUTCOMES,
    Decoded,
    FavoriteMessage,
    Skipped,
    SkipReason,
    decode_favorite,
)
from runtime.health import serve_http
from runtime.logs import log_event
from runtime.memory import start_trimmer
from runtime.metrics import (
    FAVORITES_DLQ,
    FAVORITES_RETRIES,
    FAVORITES_SKIPPED,
)
from runtime.settings import Settings
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.action_history import ActionHistorySink, message_fields
from sinks.dead_letters import DeadLetterSink
from sinks.dry_run import DryRunActionSink, DryRunDeadLetterSink, Tally
from sources.kafka_input import StartPosition

logger = logging.getLogger(__name__)


def _log_skip(reason: SkipReason, fields: dict[str, Any]) -> None:
    FAVORITES_SKIPPED.labels(reason=reason.value).inc()
    log_event(logger, SKIP_OUTCOMES[reason], outcome=SKIP_OUTCOMES[reason], **fields)


def _warn_version(message: FavoriteMessage) -> FavoriteMessage:
    return warn_version_mismatch(message, message_fields)  # type: ignore[no-any-return]


def _log_duplicate(message: FavoriteMessage) -> None:
    _log_skip(SkipReason.DUPLICATE, message_fields(message))


def _log_skipped(_step_id: str, skipped: Skipped) -> None:
    fields: dict[str, Any] = {"source": skipped.record.where()}
    if skipped.message is not None:
        fields["MessageId"] = str(skipped.message.message_id)
        fields["FavoriteId"] = str(skipped.message.payload.favorite_id)
        fields["PropertyObjectId"] = str(skipped.message.payload.property_object_id)
    if skipped.action_type is not None:
        fields["ActionType"] = skipped.action_type.value
    _log_skip(skipped.reason, fields)


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
    start_trimmer(settings.malloc_trim_interval_seconds)
    flow = Dataflow("favorite_actions")
    inputs = [
        (step_id, topic)
        for step_id, topic in (
            ("favorite_added_input", settings.topic_favorite_added),
            ("favorite_removed_input", settings.topic_favorite_removed),
        )
        if topics is None or topic in topics
    ]
    records = kafka_records(
        flow, settings, inputs, start or configured_start(settings), FAVORITES_RETRIES
    )

    action_types = {
        settings.topic_favorite_added: ActionType.ADD_TO_FAVORITES,
        settings.topic_favorite_removed: ActionType.REMOVE_FROM_FAVORITES,
    }

    def decode(record: SourceRecord) -> Decoded:
        return decode_favorite(record, action_types)

    decoded = op.map("decode_favorite", records, decode)
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
    fresh = deduplicated(
        "dedup_by_message_id", keyed, settings.dedup_ttl_seconds, _log_duplicate
    )
    history: Sink[tuple[str, FavoriteMessage]] = (
        ActionHistorySink(settings) if dry_run is None else DryRunActionSink(settings, dry_run)
    )
    op.output("record_action_history", fresh, history)
    return flow
