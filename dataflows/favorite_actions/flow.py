"""Wiring of the favorites flow: Kafka -> decode and key by owner -> dedup -> Postgres sink.

::

    favorite_added_input ─┐                                   ┌─ dead_letter_poison (DLQ topic)
                          ├─ decode_favorites ─ route_poison ─┤
    favorite_removed_input┘                                   └─ dedup_by_message_id
                                                      ─ record_action_history (Postgres + outbox)

One input step per topic (either can be replayed alone); keyed by owner shard, so one owner's
messages stay in order. Exactly-once effect = offsets in snapshots + idempotent writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.inputs import Source
from bytewax.outputs import Sink

from dataflows.favorite_actions.decode import (
    SKIP_OUTCOMES,
    FavoriteMessage,
    Skipped,
    SkipReason,
    decode_favorite,
)
from dataflows.favorite_actions.dry_run import DryRunActionSink
from dataflows.favorite_actions.sink import ActionHistorySink, message_fields
from dataflows.favorite_actions.traces import trace_duplicate, trace_skipped
from dataflows.operators import (
    DedupBound,
    configured_start,
    deduplicated,
    kafka_inputs,
    log_consumer_error,
    trace_poison,
    warn_version_mismatch,
)
from runtime.bytewax_0_21.steps import sink_step_id
from runtime.logs import log_event
from runtime.metrics import FAVORITES_DLQ, FAVORITES_RETRIES, FAVORITES_SKIPPED
from runtime.process import Process
from runtime.settings import Settings
from runtime.ticks import TickSource
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.dead_letters import DeadLetterSink
from sinks.dry_run import DryRunDeadLetterSink, Tally
from sinks.transactional import Publishing
from sources.kafka_input import InputItem, StartPosition

logger = logging.getLogger(__name__)


def _log_skip(reason: SkipReason, fields: dict[str, Any]) -> None:
    FAVORITES_SKIPPED.labels(reason=reason.value).inc()
    # invalid-owner breaks the producer's contract (INV-FAV-001): an error, though acknowledged
    level = logging.ERROR if reason is SkipReason.INVALID_OWNER else logging.INFO
    log_event(logger, SKIP_OUTCOMES[reason], level, outcome=SKIP_OUTCOMES[reason], **fields)


def _log_duplicate(message: FavoriteMessage) -> None:
    _log_skip(SkipReason.DUPLICATE, message_fields(message))
    trace_duplicate(message)


def _log_skipped(skipped: Skipped) -> None:
    payload = skipped.message.payload
    _log_skip(skipped.reason, {
        "source": skipped.record.where(), "MessageId": str(skipped.message.message_id),
        "FavoriteId": str(payload.favorite_id), "PropertyObjectId": str(payload.property_object_id),
        "ActionType": skipped.action_type.value})
    trace_skipped(skipped)


Routed = DeadLetter | tuple[str, FavoriteMessage]
"""What ``decode_favorites`` emits: poison for the DLQ, or a message keyed by its owner's shard."""


OWNER_SHARDS_PER_SINK_PARTITION = 8  # spreads the dedup over workers; few keys stay cheap


def owner_shards(sink_partitions: int) -> list[str]:
    """The shard keys of the favorites stream; each sink partition gets the same number."""
    return [str(i) for i in range(OWNER_SHARDS_PER_SINK_PARTITION * sink_partitions)]


def owner_shard(message: FavoriteMessage, shards: Sequence[str]) -> str:
    """The shard of ``message``'s owner (AnonymousId, else UserId), the same in every process."""
    payload = message.envelope.payload
    owner = payload.anonymous_id if payload.anonymous_id is not None else payload.user_id
    return shards[owner.int % len(shards)] if owner is not None else shards[0]


def decoder(action_types: Mapping[str, ActionType], shards: Sequence[str]
            ) -> Callable[[list[InputItem]], list[Routed]]:
    """The ``decode_favorites`` batch step: dead letters and ``(owner_shard, message)`` pairs.

    Consumer errors, invalid-owner skips and version mismatches are logged; order is kept.
    """
    def decode_batch(items: list[InputItem]) -> list[Routed]:
        routed: list[Routed] = []
        append = routed.append
        consumed = 0
        for item in items:
            if not isinstance(item, SourceRecord):
                log_consumer_error(item)
                continue
            consumed += 1
            decoded = decode_favorite(item, action_types)
            if isinstance(decoded, FavoriteMessage):
                if decoded.version_mismatch:
                    warn_version_mismatch(decoded, message_fields)
                append((owner_shard(decoded, shards), decoded))
            elif isinstance(decoded, Skipped):
                _log_skipped(decoded)
            else:
                trace_poison(decoded)
                append(decoded)
        if consumed:  # the seed's `consumed` outcome, once per batch
            log_event(logger, "consumed", outcome="consumed", records=consumed)
        return routed

    return decode_batch


def is_keyed(item: Routed) -> bool:
    """True for an ``(owner_shard, message)`` pair, False for a dead letter."""
    return type(item) is tuple


@dataclass(frozen=True)
class FavoritesSinks:
    """Where the flow's two outputs go: the action history (with its outbox) and the DLQ."""

    history: Sink[tuple[str, FavoriteMessage]]
    dead_letters: Sink[DeadLetter]

    @classmethod
    def of(cls, settings: Settings, process: Process,
           publisher: Publishing | None = None) -> FavoritesSinks:
        """PostgreSQL (one transaction per batch, outbox) and the favorites DLQ topic."""
        return cls(ActionHistorySink(settings, process, publisher), DeadLetterSink(
            settings, settings.topic_favorites_dlq, FAVORITES_DLQ, FAVORITES_RETRIES, process))

    @classmethod
    def dry_run(cls, settings: Settings, tally: Tally) -> FavoritesSinks:
        """Read-only sinks that tally would-be outcomes into ``tally`` (replay ``--dry-run``)."""
        return cls(DryRunActionSink(settings, tally), DryRunDeadLetterSink(tally))


def build_flow(settings: Settings, *, source: Source[InputItem] | None = None,
               sinks: FavoritesSinks | None = None, start: StartPosition | None = None,
               topics: Sequence[str] | None = None, process: Process | None = None,
               publisher: Publishing | None = None) -> Dataflow:
    """The favorites dataflow for ``settings``; building it has no side effects.

    ``source`` replaces the Kafka inputs, ``sinks`` the PostgreSQL and DLQ sinks. ``start``
    overrides the starting position, ``topics`` limits the inputs (a replay of one topic).
    """
    process = process or Process()
    flow = Dataflow("favorite_actions")
    if source is not None:
        consumed: Stream[InputItem] = op.input("favorites_input", flow, source)
    else:
        inputs = [(step_id, topic) for step_id, topic in (
            ("favorite_added_input", settings.topic_favorite_added),
            ("favorite_removed_input", settings.topic_favorite_removed),
        ) if topics is None or topic in topics]
        consumed = kafka_inputs(flow, settings, inputs, start or configured_start(settings),
                                FAVORITES_RETRIES, flow_name="favorites",
                                consumer_group=settings.consumer_group_favorites, process=process)
    outputs = sinks or FavoritesSinks.of(settings, process, publisher)
    action_types = {settings.topic_favorite_added: ActionType.ADD_TO_FAVORITES,
                    settings.topic_favorite_removed: ActionType.REMOVE_FROM_FAVORITES}
    shards = owner_shards(settings.sink_partitions)
    routed = op.flat_map_batch("decode_favorites", consumed, decoder(action_types, shards))
    by_kind = op.branch("route_poison", routed, is_keyed)
    op.output("dead_letter_poison", by_kind.falses, outputs.dead_letters)  # type: ignore[misc]
    keyed: Stream[tuple[str, FavoriteMessage]] = by_kind.trues  # type: ignore[assignment]
    fresh = deduplicated("dedup_by_message_id", keyed, settings.dedup_ttl_seconds, _log_duplicate,
                         DedupBound("favorites", settings.dedup_max_ids, len(shards)))
    if source is None and settings.tail:  # each sink partition ticks (runtime.ticks)
        ticks = op.input("sink_ticks", flow, TickSource(
            [str(i) for i in range(settings.sink_partitions)], timedelta(seconds=0.1),
            process.stopping))
        fresh = op.merge("merge_sink_ticks", fresh, ticks)
    op.output(sink_step_id("record_action_history", settings.sink_partitions), fresh,
              outputs.history)
    return flow
