"""Wiring of the session-linking flow: Kafka -> decode -> dedup -> key by device -> Postgres sink.

::

    user_signed_in_input ─ decode_sign_in ─┬─ dead_letter_poison (session-linking DLQ topic)
        (+ consumer errors → log)          ├─ log_invalid_sign_in
                                           └─ key_by_device_shard ─ dedup_by_message_id
                  ─ reorder_by_signed_in_at ─ link_sessions (Postgres + outbox)

Keyed by device shard: one device's sign-ins go to one worker, in SignedInAt order. Exactly
one effect per sign-in = offsets in snapshots + the idempotency mark in the transaction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.inputs import Source
from bytewax.outputs import Sink

from dataflows.operators import (
    DedupBound,
    configured_start,
    deduplicated,
    kafka_inputs,
    trace_poison,
    warn_version_mismatch,
    without_consumer_errors,
)
from dataflows.session_linking.decode import (
    DecodedSignIn,
    InvalidSignIn,
    SignInMessage,
    decode_sign_in,
    sign_in_fields,
    signed_in_time,
)
from dataflows.session_linking.dry_run import DryRunLinkSink
from dataflows.session_linking.linking import LOG_EVENTS, LinkOutcome
from dataflows.session_linking.reorder import ReorderLogic
from dataflows.session_linking.sink import SessionLinkSink
from dataflows.session_linking.traces import trace_duplicate, trace_invalid
from runtime.bytewax_0_21.steps import sink_step_id
from runtime.logs import log_event
from runtime.metrics import SESSION_LINKING_DLQ, SESSION_LINKING_OUTCOMES, SESSION_LINKING_RETRIES
from runtime.process import Process
from runtime.settings import Settings
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import SourceRecord
from sinks.dead_letters import DeadLetterSink
from sinks.dry_run import DryRunDeadLetterSink, Tally
from sinks.transactional import Publishing
from sources.alignment import EventTimeAlignment
from sources.kafka_input import StartPosition

logger = logging.getLogger(__name__)


def _log_outcome(outcome: LinkOutcome, message: SignInMessage | InvalidSignIn) -> None:
    SESSION_LINKING_OUTCOMES.labels(outcome=outcome.value).inc()
    event = LOG_EVENTS[outcome]
    level = logging.WARNING if outcome is LinkOutcome.INVALID else logging.INFO
    log_event(logger, event, level, outcome=event, **sign_in_fields(message))


def _log_invalid(_step_id: str, invalid: InvalidSignIn) -> None:
    _log_outcome(LinkOutcome.INVALID, invalid)
    trace_invalid(invalid)


def _decoder(max_skew: timedelta) -> Callable[[SourceRecord], DecodedSignIn]:
    def decode(record: SourceRecord) -> DecodedSignIn:
        decoded = decode_sign_in(record, datetime.now(UTC), max_skew)
        if isinstance(decoded, DeadLetter):
            trace_poison(decoded)
        elif isinstance(decoded, SignInMessage) and decoded.adjusted_at is not None:
            log_event(logger, "sign-in-from-the-future", logging.WARNING,
                      SignedInAt=decoded.envelope.payload.signed_in_at.isoformat(),
                      used=decoded.adjusted_at.isoformat(), **sign_in_fields(decoded))
        return decoded

    return decode


DEVICE_SHARDS = tuple(str(i) for i in range(16))
"""The keys of the dedup and reorder steps (bounded state, whatever the devices seen)."""


def device_shard(message: SignInMessage) -> str:
    """The shard of ``message``'s device, the same in every process."""
    return DEVICE_SHARDS[message.anonymous_id.int % len(DEVICE_SHARDS)]


def _warn_version(message: SignInMessage) -> SignInMessage:
    return warn_version_mismatch(message, sign_in_fields)  # type: ignore[no-any-return]


def _log_duplicate(message: SignInMessage) -> None:
    _log_outcome(LinkOutcome.DUPLICATE, message)
    trace_duplicate(message)


def sign_in_alignment(settings: Settings) -> EventTimeAlignment:
    """The input's partitions read in SignedInAt order to within half the lateness.

    A partition that passed nothing for the lateness (its broker down) holds nobody back.
    """
    lateness = settings.session_linking_lateness_seconds
    skew = settings.session_linking_max_clock_skew_seconds
    return EventTimeAlignment(lambda value: signed_in_time(value, time.time(), skew),
                              max_ahead=lateness / 2, idle_after=max(lateness, 1.0))


@dataclass(frozen=True)
class SessionLinkingSinks:
    """Where the flow's two outputs go: the session changes (with their outbox) and the DLQ."""

    links: Sink[tuple[str, SignInMessage]]
    dead_letters: Sink[DeadLetter]

    @classmethod
    def of(cls, settings: Settings, process: Process,
           publisher: Publishing | None = None) -> SessionLinkingSinks:
        """PostgreSQL (one transaction per batch, outbox) and the session-linking DLQ topic."""
        return cls(SessionLinkSink(settings, process, publisher), DeadLetterSink(
            settings, settings.topic_session_linking_dlq, SESSION_LINKING_DLQ,
            SESSION_LINKING_RETRIES, process))

    @classmethod
    def dry_run(cls, settings: Settings, tally: Tally) -> SessionLinkingSinks:
        """Read-only sinks that tally would-be outcomes into ``tally`` (replay ``--dry-run``)."""
        return cls(DryRunLinkSink(settings, tally), DryRunDeadLetterSink(tally))


def build_flow(settings: Settings, *, source: Source[SourceRecord] | None = None,
               sinks: SessionLinkingSinks | None = None, start: StartPosition | None = None,
               process: Process | None = None, publisher: Publishing | None = None) -> Dataflow:
    """The session-linking dataflow for ``settings``; building it has no side effects.

    ``source`` replaces the Kafka input, ``sinks`` the PostgreSQL and DLQ sinks; ``start``
    overrides the starting position.
    """
    process = process or Process()
    flow = Dataflow("session_linking")
    outputs = sinks or SessionLinkingSinks.of(settings, process, publisher)
    alignment = sign_in_alignment(settings)
    if source is not None:
        records: Stream[SourceRecord] = op.input("user_signed_in_input", flow, source)
    else:
        records = without_consumer_errors(kafka_inputs(
            flow, settings, [("user_signed_in_input", settings.topic_user_signed_in)],
            start or configured_start(settings), SESSION_LINKING_RETRIES,
            flow_name="session-linking", consumer_group=settings.consumer_group_session_linking,
            process=process, alignment=alignment))

    max_skew = timedelta(seconds=settings.session_linking_max_clock_skew_seconds)
    decoded = op.map("decode_sign_in", records, _decoder(max_skew))
    valid = op.branch("route_decoded", decoded, lambda d: isinstance(d, SignInMessage))
    rejected = op.branch("route_rejected", valid.falses, lambda d: isinstance(d, DeadLetter))
    op.output("dead_letter_poison", rejected.trues, outputs.dead_letters)  # type: ignore[misc]
    op.inspect("log_invalid_sign_in", rejected.falses, _log_invalid)  # type: ignore[arg-type]

    messages = op.map("warn_version_mismatch", valid.trues, _warn_version)  # type: ignore[arg-type]
    sharded = op.key_on("key_by_device_shard", messages, device_shard)
    fresh = deduplicated("dedup_by_message_id", sharded, settings.dedup_ttl_seconds, _log_duplicate,
                         DedupBound("session-linking", settings.dedup_max_ids, len(DEVICE_SHARDS)))
    lateness, bounded = settings.session_linking_lateness_seconds, not settings.tail
    per_shard = -(-settings.session_linking_max_pending // len(DEVICE_SHARDS))
    in_order = op.stateful_batch(  # keyed by the device's shard too: see reorder.py
        "reorder_by_signed_in_at", fresh,
        lambda state: ReorderLogic(lateness, state, flush_on_eof=bounded,
                                   max_pending=per_shard, reading=alignment.reading),
    )
    op.output(sink_step_id("link_sessions", settings.sink_partitions), in_order, outputs.links)
    return flow

