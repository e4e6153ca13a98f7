"""Wiring of the session-linking flow: Kafka -> decode -> key by device -> dedup -> Postgres sink.

::

    user_signed_in_input ─ decode_sign_in ─┬─ dead_letter_poison (session-linking DLQ topic)
        (+ consumer errors → log)          ├─ log_invalid_sign_in
                                           └─ key_by_device ─ dedup_by_message_id
                                                  ─ link_sessions (Postgres + outbox)

Keying by AnonymousId sends every sign-in of one device to one worker, in input order, so one
device's sessions are changed by one transaction at a time in this job (the row locks of the
sink make it safe against any other writer too). Exactly one effect per sign-in = at-least-once
input (offsets in Bytewax snapshots) + the idempotency mark in the linking transaction.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.operators import StatefulBatchLogic

from dataflows.favorite_actions.dedup import DedupWindow
from dataflows.session_linking.decode import (
    InvalidSignIn,
    SignInMessage,
    decode_sign_in,
    sign_in_fields,
)
from dataflows.session_linking.linking import LOG_EVENTS, LinkOutcome
from runtime.backoff import Backoff
from runtime.health import serve_http
from runtime.logs import log_event
from runtime.metrics import (
    CONSUMER_ERRORS,
    SESSION_LINKING_DLQ,
    SESSION_LINKING_OUTCOMES,
    SESSION_LINKING_RETRIES,
)
from runtime.settings import Settings, StartingOffset
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import ConsumerError, SourceRecord
from sinks.action_history import DeadLetterSink
from sinks.session_links import SessionLinkSink
from sources.kafka_input import KafkaInput, StartPosition

logger = logging.getLogger(__name__)


class SignInDedupLogic(StatefulBatchLogic[SignInMessage, SignInMessage, dict[bytes, float]]):
    """Per-device dedup by MessageId within the TTL: spares the database obvious redeliveries.

    Only an optimisation: the idempotency mark in the linking transaction decides. Duplicates are
    dropped (logged ``skipped-duplicate``); a device whose window empties is discarded.
    """

    def __init__(self, ttl: float, state: dict[bytes, float] | None) -> None:
        self._window = DedupWindow(ttl, state)

    def on_batch(self, values: list[SignInMessage]) -> tuple[list[SignInMessage], bool]:
        """Admit fresh sign-ins, drop and log duplicates."""
        now = time.time()
        fresh: list[SignInMessage] = []
        for message in values:
            if self._window.admit(message.dedup_id, now):
                fresh.append(message)
            else:
                _log_outcome(LinkOutcome.DUPLICATE, message.record, message)
        return fresh, StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[SignInMessage], bool]:
        """Evict expired ids; discard the device's state once it is empty."""
        self._window.evict(time.time())
        return [], len(self._window) == 0

    def notify_at(self) -> datetime | None:
        """When the device's oldest id expires."""
        expiry = self._window.next_expiry()
        return None if expiry is None else datetime.fromtimestamp(expiry, UTC)

    def snapshot(self) -> dict[bytes, float]:
        """A copy of the device's window."""
        return self._window.snapshot()


def _log_outcome(
    outcome: LinkOutcome, record: SourceRecord, message: SignInMessage | InvalidSignIn
) -> None:
    SESSION_LINKING_OUTCOMES.labels(outcome=outcome.value).inc()
    event = LOG_EVENTS[outcome]
    level = logging.WARNING if outcome is LinkOutcome.INVALID else logging.INFO
    log_event(logger, event, level, outcome=event, **sign_in_fields(record, message.envelope))


def _log_invalid(_step_id: str, invalid: InvalidSignIn) -> None:
    _log_outcome(LinkOutcome.INVALID, invalid.record, invalid)


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


def _warn_version(message: SignInMessage) -> SignInMessage:
    if message.version_mismatch:
        log_event(
            logger,
            "contract-version-mismatch",
            logging.WARNING,
            version=message.envelope.version,
            **sign_in_fields(message.record, message.envelope),
        )
    return message


def build_flow(settings: Settings, start: StartPosition | None = None) -> Dataflow:
    """The session-linking dataflow for ``settings`` (``start`` overrides the start position)."""
    serve_http(settings.http_host, settings.http_port)
    flow = Dataflow("session_linking")
    position = start or StartPosition(latest=settings.starting_offset is StartingOffset.LATEST)
    source = KafkaInput(
        settings.kafka_client_config(),
        settings.topic_user_signed_in,
        start=position,
        tail=settings.tail,
        batch_size=settings.source_batch_size,
        backoff=Backoff(settings.retry_initial_seconds, settings.retry_max_seconds),
    )
    consumed = op.input("user_signed_in_input", flow, source)

    by_kind = op.branch(
        "split_consumer_errors", consumed, lambda item: isinstance(item, SourceRecord)
    )
    op.inspect("log_consumer_errors", by_kind.falses, _log_consumer_error)  # type: ignore[arg-type]

    decoded = op.map("decode_sign_in", by_kind.trues, decode_sign_in)  # type: ignore[arg-type]
    valid = op.branch("route_decoded", decoded, lambda d: isinstance(d, SignInMessage))
    rejected = op.branch(
        "route_rejected", valid.falses, lambda d: isinstance(d, DeadLetter)
    )
    op.output(
        "dead_letter_poison",
        rejected.trues,  # type: ignore[misc]
        DeadLetterSink(
            settings, settings.topic_session_linking_dlq, SESSION_LINKING_DLQ,
            SESSION_LINKING_RETRIES,
        ),
    )
    op.inspect("log_invalid_sign_in", rejected.falses, _log_invalid)  # type: ignore[arg-type]

    messages = op.map("warn_version_mismatch", valid.trues, _warn_version)  # type: ignore[arg-type]
    keyed = op.key_on("key_by_device", messages, lambda m: m.device_key)
    ttl = settings.dedup_ttl_seconds
    fresh = op.stateful_batch(
        "dedup_by_message_id", keyed, lambda state: SignInDedupLogic(ttl, state)
    )
    op.output("link_sessions", fresh, SessionLinkSink(settings))
    return flow

