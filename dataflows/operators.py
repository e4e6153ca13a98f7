"""Bytewax operators shared by the flows: Kafka inputs (consumer errors routed), the dedup step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.operators import StatefulBatchLogic
from prometheus_client import Counter

from dataflows.dedup import DedupState, DedupWindow
from runtime import tracing
from runtime.backoff import Backoff
from runtime.bytewax_0_21 import recovery
from runtime.logs import log_event
from runtime.metrics import CONSUMER_ERRORS, DEDUP_FORGOTTEN_EARLY, DEDUP_IDS
from runtime.process import Process
from runtime.settings import Settings, StartingOffset
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import ConsumerError, SourceRecord
from sources.alignment import EventTimeAlignment
from sources.kafka_input import InputItem, KafkaInput, StartPosition

logger = logging.getLogger(__name__)


def configured_start(settings: Settings) -> StartPosition:
    """The configured starting position (used only for partitions without a snapshot)."""
    return StartPosition(latest=settings.starting_offset is StartingOffset.LATEST,
                         group=settings.start_from_group or None)


def log_consumer_error(error: ConsumerError) -> None:
    """Count and log a consumer error (never raised: librdkafka recovers by itself)."""
    CONSUMER_ERRORS.labels(topic=error.topic, code=error.code).inc()
    log_event(logger, "kafka-consumer-error", logging.ERROR if error.fatal else logging.WARNING,
              topic=error.topic, partition=error.partition, code=error.code, reason=error.reason)


def kafka_inputs(flow: Dataflow, settings: Settings, inputs: list[tuple[str, str]],
                 start: StartPosition, retries: Counter, *, flow_name: str, consumer_group: str,
                 process: Process,
                 alignment: EventTimeAlignment | None = None) -> Stream[InputItem]:
    """One input step per ``(step_id, topic)``, merged: records and consumer errors.

    The stream's consumer must pass every :class:`ConsumerError` to :func:`log_consumer_error`.
    ``retries`` counts retries of an unreachable Kafka; ``flow_name`` names the lag gauge;
    snapshotted offsets are also committed to ``consumer_group`` (empty: not at all).
    """
    backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
    streams = [
        op.input(step_id, flow, KafkaInput(
            settings.kafka_client_config(), topic, process=process, start=start,
            tail=settings.tail, batch_size=settings.source_batch_size,
            stuck_after=settings.source_stuck_seconds,
            fetch_wait_ms=settings.source_fetch_wait_ms,
            receive_max_bytes=settings.source_receive_max_bytes,
            partition_check=settings.source_partition_check_seconds, backoff=backoff,
            count_retry=retries.inc, consumer_group=consumer_group, flow=flow_name,
            alignment=alignment, stored_keys=partial(
                recovery.stored_keys, process.recovery_dir, f"{flow.flow_id}.{step_id}")))
        for step_id, topic in inputs
    ]
    return streams[0] if len(streams) == 1 else op.merge("merge_inputs", *streams)


def without_consumer_errors(consumed: Stream[InputItem]) -> Stream[SourceRecord]:
    """The records of ``consumed``; its consumer errors go to :func:`log_consumer_error`."""
    by_kind = op.branch("split_consumer_errors", consumed,
                        lambda item: isinstance(item, SourceRecord))
    op.inspect("log_consumer_errors", by_kind.falses,
               lambda _step_id, error: log_consumer_error(error))  # type: ignore[arg-type]
    return by_kind.trues  # type: ignore[return-value]


class Deduplicable(Protocol):
    """A message the dedup window can remember by ``dedup_id``."""

    @property
    def dedup_id(self) -> bytes:
        """A compact id of the message's idempotency key."""


M = TypeVar("M", bound=Deduplicable)


@dataclass(frozen=True)
class DedupBound:
    """How much one flow's dedup windows hold: ``max_ids`` in all, shared by ``keys`` windows."""

    flow: str
    max_ids: int
    keys: int

    @property
    def per_key(self) -> int:
        """``ceil(max_ids / keys)``."""
        return max(1, -(-self.max_ids // self.keys))


_FULL_LOG_EVERY_SECONDS = 600.0


class DedupMeter:
    """A flow's dedup gauge and early-forget counter; says ``dedup-window-full`` every 10 min."""

    def __init__(self, bound: DedupBound) -> None:
        self.bound = bound
        self.held = DEDUP_IDS.labels(flow=bound.flow)
        self._forgotten = DEDUP_FORGOTTEN_EARLY.labels(flow=bound.flow)
        self._since_log = 0
        self._logged_at = -_FULL_LOG_EVERY_SECONDS

    def forgot(self, count: int, oldest_expiry: float | None, ttl: float, now: float) -> None:
        """A full window forgot ``count`` ids early; ``remembered_s``: how far back it reaches."""
        self._forgotten.inc(count)
        self._since_log += count
        if now - self._logged_at >= _FULL_LOG_EVERY_SECONDS:
            log_event(logger, "dedup-window-full", logging.INFO, flow=self.bound.flow,
                      max_ids=self.bound.max_ids, forgotten=self._since_log, ttl_s=ttl,
                      remembered_s=None if oldest_expiry is None
                      else round(now - (oldest_expiry - ttl), 1))
            self._logged_at, self._since_log = now, 0


class DedupLogic(StatefulBatchLogic[M, M, DedupState], Generic[M]):
    """Per-key dedup: passes a message on once per ``dedup_id`` within the TTL.

    Duplicates are reported to ``on_duplicate`` and dropped. Expired ids are evicted by a timer;
    a key whose window empties is discarded; the snapshot is the packed window. With a
    ``meter``, the window holds at most ``bound.per_key`` ids (oldest forgotten first).
    """

    def __init__(self, ttl: float, state: DedupState | None, on_duplicate: Callable[[M], None],
                 meter: DedupMeter | None = None) -> None:
        self._ttl = ttl
        self._window = DedupWindow(
            ttl, state, max_ids=None if meter is None else meter.bound.per_key)
        self._on_duplicate = on_duplicate
        self._meter = meter
        self._held = 0
        self._count(time.time())

    def on_batch(self, values: list[M]) -> tuple[list[M], bool]:
        """Admit fresh messages, drop and report duplicates."""
        now = time.time()
        fresh: list[M] = []
        admit = self._window.admit
        for message in values:
            if admit(message.dedup_id, now):
                fresh.append(message)
            else:
                self._on_duplicate(message)
        self._count(now)
        return fresh, StatefulBatchLogic.RETAIN

    def on_notify(self) -> tuple[list[M], bool]:
        """Evict expired ids; discard the key's state once it is empty."""
        now = time.time()
        self._window.evict(now)
        self._count(now)
        return [], len(self._window) == 0

    def _count(self, now: float) -> None:
        meter = self._meter
        if meter is None:
            return
        window = self._window
        held = len(window)
        if held != self._held:
            meter.held.inc(held - self._held)
            self._held = held
        if window.forgotten_early:
            meter.forgot(window.forgotten_early, window.next_expiry(), self._ttl, now)
            window.forgotten_early = 0

    def notify_at(self) -> datetime | None:
        """When the key's oldest id expires."""
        expiry = self._window.next_expiry()
        return None if expiry is None else datetime.fromtimestamp(expiry, UTC)

    def snapshot(self) -> DedupState:
        """An immutable copy of the key's window."""
        return self._window.snapshot()


def deduplicated(step_id: str, keyed: Stream[tuple[str, M]], ttl: float,
                 on_duplicate: Callable[[M], None], bound: DedupBound | None = None,
                 ) -> Stream[tuple[str, M]]:
    """``keyed`` without the messages seen within ``ttl`` for the same key (:class:`DedupLogic`)."""
    meter = None if bound is None else DedupMeter(bound)
    return op.stateful_batch(step_id, keyed,
                             lambda state: DedupLogic(ttl, state, on_duplicate, meter))


def warn_version_mismatch(message: Any, fields: Callable[[Any], dict[str, Any]]) -> Any:
    """Log ``contract-version-mismatch`` for a message of another Version, and pass it on."""
    if message.version_mismatch:
        log_event(logger, "contract-version-mismatch", logging.WARNING,
                  version=message.envelope.version, **fields(message))
    return message


def trace_poison(letter: DeadLetter) -> None:
    """The span of a record dead-lettered at decode, when it is sampled."""
    tracing.finish_alone(letter.record, "dead-lettered", error=letter.reason.value)
