"""Bytewax operators shared by the flows: Kafka inputs with routed consumer errors, the dedup step.

Only this module and each flow's ``flow`` module import ``bytewax.operators``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Generic, Protocol, TypeVar

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.operators import StatefulBatchLogic
from prometheus_client import Counter

from dataflows.dedup import DedupState, DedupWindow
from runtime.backoff import Backoff
from runtime.logs import log_event
from runtime.metrics import CONSUMER_ERRORS
from runtime.settings import Settings, StartingOffset
from schemas.kafka_record import ConsumerError, SourceRecord
from sources.kafka_input import InputItem, KafkaInput, StartPosition

logger = logging.getLogger(__name__)


def configured_start(settings: Settings) -> StartPosition:
    """The configured starting position (used only for partitions without a snapshot)."""
    return StartPosition(latest=settings.starting_offset is StartingOffset.LATEST)


def log_consumer_error(error: ConsumerError) -> None:
    """Count and log a consumer error (never raised: librdkafka recovers by itself)."""
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


def _log_consumer_error(_step_id: str, error: ConsumerError) -> None:
    log_consumer_error(error)


def kafka_inputs(
    flow: Dataflow,
    settings: Settings,
    inputs: list[tuple[str, str]],
    start: StartPosition,
    retries: Counter,
    *,
    flow_name: str,
    consumer_group: str,
) -> Stream[InputItem]:
    """One input step per ``(step_id, topic)``, merged: records and consumer errors.

    ``retries`` counts every retry of an unreachable Kafka. The consumer of this stream passes
    every :class:`ConsumerError` to :func:`log_consumer_error`: never raised, never dropped.
    ``flow_name`` names the flow's lag gauge; snapshotted offsets are also committed to
    ``consumer_group`` (informational; empty: not at all).
    """
    backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
    streams = [
        op.input(
            step_id,
            flow,
            KafkaInput(
                settings.kafka_client_config(),
                topic,
                start=start,
                tail=settings.tail,
                batch_size=settings.source_batch_size,
                stuck_after=settings.source_stuck_seconds,
                fetch_wait_ms=settings.source_fetch_wait_ms,
                receive_max_bytes=settings.source_receive_max_bytes,
                partition_check=settings.source_partition_check_seconds,
                backoff=backoff,
                count_retry=retries.inc,
                consumer_group=consumer_group,
                flow=flow_name,
            ),
        )
        for step_id, topic in inputs
    ]
    return streams[0] if len(streams) == 1 else op.merge("merge_inputs", *streams)


def kafka_records(
    flow: Dataflow,
    settings: Settings,
    inputs: list[tuple[str, str]],
    start: StartPosition,
    retries: Counter,
    *,
    flow_name: str,
    consumer_group: str,
) -> Stream[SourceRecord]:
    """:func:`kafka_inputs` with consumer errors routed to ``log_consumer_errors``."""
    consumed = kafka_inputs(
        flow, settings, inputs, start, retries, flow_name=flow_name,
        consumer_group=consumer_group,
    )
    by_kind = op.branch(
        "split_consumer_errors", consumed, lambda item: isinstance(item, SourceRecord)
    )
    op.inspect("log_consumer_errors", by_kind.falses, _log_consumer_error)  # type: ignore[arg-type]
    return by_kind.trues  # type: ignore[return-value]


class Deduplicable(Protocol):
    """A message the dedup window can remember."""

    @property
    def dedup_id(self) -> bytes:
        """A compact id of the message's idempotency key."""
        ...


M = TypeVar("M", bound=Deduplicable)


class DedupLogic(StatefulBatchLogic[M, M, DedupState], Generic[M]):
    """Per-key dedup: passes a message on once per ``dedup_id`` within the TTL.

    An optimisation only (the database's idempotency marks decide). Duplicates are dropped and
    reported to ``on_duplicate``, not passed on as ``None``. Expired ids are evicted by a timer;
    a key whose window empties is discarded. The snapshot is the key's packed window (two
    ``bytes``, ``len(dedup_id) + 4`` bytes per id), so snapshot cost follows the keys touched in
    an epoch, not the total number of ids remembered.
    """

    def __init__(
        self,
        ttl: float,
        state: DedupState | None,
        on_duplicate: Callable[[M], None],
    ) -> None:
        self._window = DedupWindow(ttl, state)
        self._on_duplicate = on_duplicate

    def on_batch(self, values: list[M]) -> tuple[list[M], bool]:
        """Admit fresh messages, drop and report duplicates."""
        now = time.time()
        fresh: list[M] = []
        for message in values:
            if self._window.admit(message.dedup_id, now):
                fresh.append(message)
            else:
                self._on_duplicate(message)
        return fresh, StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[M], bool]:
        """Evict expired ids; discard the key's state once it is empty."""
        self._window.evict(time.time())
        return [], len(self._window) == 0

    def notify_at(self) -> datetime | None:
        """When the key's oldest id expires."""
        expiry = self._window.next_expiry()
        return None if expiry is None else datetime.fromtimestamp(expiry, UTC)

    def snapshot(self) -> DedupState:
        """An immutable copy of the key's window."""
        return self._window.snapshot()


def deduplicated(
    step_id: str,
    keyed: Stream[tuple[str, M]],
    ttl: float,
    on_duplicate: Callable[[M], None],
) -> Stream[tuple[str, M]]:
    """``keyed`` without the messages seen within ``ttl`` for the same key."""
    return op.stateful_batch(
        step_id, keyed, lambda state: DedupLogic(ttl, state, on_duplicate)
    )


def warn_version_mismatch(message: Any, fields: Callable[[Any], dict[str, Any]]) -> Any:
    """Log ``contract-version-mismatch`` for a message of another Version, and pass it on."""
    if message.version_mismatch:
        log_event(
            logger,
            "contract-version-mismatch",
            logging.WARNING,
            version=message.envelope.version,
            **fields(message),
        )
    return message
