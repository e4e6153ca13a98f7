"""The Bytewax sink of the favorites flow: batches -> one transaction each -> outbox -> Kafka.

Commits, outages and poison as :mod:`sinks.transactional` says; writes are idempotent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, cast

import psycopg
from typing_extensions import override

from dataflows.favorite_actions.decode import SKIP_OUTCOMES, FavoriteMessage, SkipReason
from dataflows.favorite_actions.store import BatchOutcome, FavoritesStore, SentBatch, WaitingSwept
from dataflows.favorite_actions.traces import trace_batch
from runtime.logs import log_event, log_events
from runtime.metrics import (
    FAVORITES_CONSUME_DURATION_MS,
    FAVORITES_DLQ,
    FAVORITES_RECORDED,
    FAVORITES_RETRIES,
    FAVORITES_SESSION_WAITS,
    FAVORITES_SKIPPED,
    FAVORITES_WRITE_DURATION_MS,
    observe_durations_ms,
)
from runtime.process import Process
from runtime.settings import Settings
from runtime.ticks import TICK, Tick
from schemas.favorites import ActionType
from schemas.outbox import OutboxRow
from sinks.db import Connection
from sinks.errors import is_infrastructure_error
from sinks.transactional import PartitionedSink, Publishing, TransactionalPartition
from sources.progress import INPUT_PROGRESS

logger = logging.getLogger(__name__)

_RECORDED = {action: FAVORITES_RECORDED.labels(action_type=action.value) for action in ActionType}
_SKIPPED = {reason: FAVORITES_SKIPPED.labels(reason=reason.value) for reason in SkipReason}
_received_at = attrgetter("record.received_at")


def message_fields(message: FavoriteMessage) -> dict[str, Any]:
    """The SPEC §6 log fields of a message (ids only: no note, no PII)."""
    payload = message.envelope.payload
    # UUIDs as objects: the JSON formatter (orjson) renders them natively, cheaply
    return {"MessageId": message.envelope.message_id, "FavoriteId": payload.favorite_id,
            "PropertyObjectId": payload.property_object_id, "ActionType": message.action_type,
            "source": message.record.where()}


class _ActionHistoryPartition(TransactionalPartition[FavoriteMessage, BatchOutcome]):
    """The favorites sink partition; a large batch commits while the worker goes on.

    A batch of at least ``sink_defer_min_batch`` messages is sent without waiting; the next
    ``write_batch`` (or tick), ``snapshot()`` and ``close()`` wait for it first, then offer its
    outbox rows. At most one batch is in flight, so an epoch never closes with rows uncommitted.
    A failed deferred statement is written again synchronously (idempotent).
    """

    ordered_outbox = False  # an action-tracked row's key is its action's id

    def __init__(self, settings: Settings, process: Process, publisher: Publishing | None,
                 part: str) -> None:
        super().__init__(settings, process, publisher, name=f"user-activity-favorites-{part}",
                         dlq_topic=settings.topic_favorites_dlq, dlq_counter=FAVORITES_DLQ,
                         retries_counter=FAVORITES_RETRIES, logger=logger, flow="favorites",
                         lag=INPUT_PROGRESS)
        waits = settings.favorites_session_wait_seconds if settings.tail else 0
        self._store = FavoritesStore(settings.topic_action_tracked, wait_seconds=waits)
        self._sweeps = waits > 0
        self._swept_at = 0.0
        self._defer_min = settings.sink_defer_min_batch
        self._in_flight: tuple[list[FavoriteMessage], SentBatch] | None = None

    @override
    def write_batch(self, values: Sequence[FavoriteMessage | Tick]) -> None:
        """Commit the batch in flight, then send ``values`` (deferred) or write them now.

        A tick also sweeps the actions waiting for a session, once a second at most.
        """
        self._finish_in_flight()
        if TICK in values:
            values = [v for v in values if type(v) is not Tick]
            if self._sweeps and time.monotonic() - self._swept_at >= 1.0:
                self.sweep_waiting()
            if not values:
                self._health.beat()
                return
        messages = cast("list[FavoriteMessage]", list(values))
        if self._defer_min and len(messages) >= self._defer_min:
            started_ns = time.time_ns()
            self.track_held(messages)
            try:
                sent = self._store.send_batch(self._db.connection(), messages)
            except Exception as exc:  # noqa: BLE001 - the synchronous path retries or isolates
                self._deferred_failed(exc, messages)
            else:
                self._in_flight = (messages, sent)
                sent.outcome.written_ns = (started_ns, 0)
            self._health.beat()
            return
        super().write_batch(messages)

    @override
    def snapshot(self) -> None:
        """The epoch barrier: the batch in flight is committed before the epoch closes."""
        self._finish_in_flight()
        super().snapshot()

    @override
    def close(self) -> None:
        try:
            self._finish_in_flight()
        finally:
            super().close()

    def sweep_waiting(self) -> None:
        """Record the waiting actions whose owner now has a session; skip the expired ones.

        Sweeps until a page is not full. An outage ends the sweep (paused on ``postgres``; the
        next tick tries again): the worker goes on reading, and the batches it takes wait for
        PostgreSQL as held ones, which the lag gauge sees.
        """
        while True:
            self._swept_at = time.monotonic()
            try:
                swept = self._store.sweep_waiting(self._db.connection(), _SWEEP_PAGE)
            except psycopg.Error as exc:
                if not is_infrastructure_error(exc):
                    raise
                self._db.reset()
                self._health.paused("postgres", 1, type(exc).__name__, waiter=self._name)
                return
            self._health.resumed(waiter=self._name)
            _report_swept(swept)
            if len(swept) < _SWEEP_PAGE:
                return

    def _finish_in_flight(self) -> None:
        if self._in_flight is None:
            return
        values, sent = self._in_flight
        self._in_flight = None
        try:
            outcome = self._store.finish_batch(self._db.connection(), sent)
        except Exception as exc:  # noqa: BLE001 - the synchronous path retries or isolates
            self._deferred_failed(exc, values)
            return
        outcome.written_ns = ((sent.outcome.written_ns or (0, 0))[0], time.time_ns())
        if self._publisher is not None:
            self._publisher.offer(*self.committed_outbox(outcome), ordered=self.ordered_outbox)
        self.report(outcome)
        self.track_finished(values)

    def _deferred_failed(self, exc: Exception, values: list[FavoriteMessage]) -> None:
        if not isinstance(exc, psycopg.Error) or is_infrastructure_error(exc):
            self._db.reset()  # a statement may still be in flight on it
        log_event(logger, "deferred-write-failed", logging.WARNING, error=type(exc).__name__,
                  sqlstate=getattr(exc, "sqlstate", None), messages=len(values))
        super().write_batch(values)

    def write(self, conn: Connection, batch: Sequence[FavoriteMessage]) -> BatchOutcome:
        """One transaction: sessions, rows, marks, outbox (:class:`FavoritesStore`)."""
        started_ns = time.time_ns()
        outcome = self._store.record_batch(conn, batch)
        outcome.written_ns = (started_ns, time.time_ns())
        return outcome

    def fields(self, message: FavoriteMessage) -> dict[str, Any]:
        """SPEC §6 log fields."""
        return message_fields(message)

    def committed_outbox(self, result: BatchOutcome) -> tuple[int, list[OutboxRow]]:
        """The action-tracked rows of the recorded actions, and their transaction."""
        return result.txid, [action.outbox for action in result.recorded]

    def report(self, outcome: BatchOutcome) -> None:
        """Metrics, spans and one log line per message of a committed batch."""
        trace_batch(outcome)
        if outcome.written_ns is not None and outcome.written_ns[0] and outcome.written_ns[1]:
            started_ns, ended_ns = outcome.written_ns
            FAVORITES_WRITE_DURATION_MS.observe((ended_ns - started_ns) / 1e6)
        now_mono = time.monotonic()
        recorded = outcome.recorded
        if recorded:
            messages = [action.message for action in recorded]
            observe_durations_ms(FAVORITES_CONSUME_DURATION_MS, now_mono,
                                 map(_received_at, messages))
            action_types = [message.action_type for message in messages]
            for action_type, counter in _RECORDED.items():
                if count := action_types.count(action_type):
                    counter.inc(count)
            log_events(logger, "recorded", [
                {"outcome": "recorded", "SessionId": action.event.session_id,
                 **message_fields(action.message)} for action in recorded])
        if outcome.waiting:
            _WAITS_STARTED.inc(len(outcome.waiting))
            log_events(logger, "waiting-for-session", [
                {"outcome": "waiting-for-session", **message_fields(m)} for m in outcome.waiting])
        for reason, skipped in ((SkipReason.DUPLICATE, outcome.duplicates),
                                (SkipReason.NO_SESSION, outcome.no_session)):
            if not skipped:
                continue
            observe_durations_ms(FAVORITES_CONSUME_DURATION_MS, now_mono,
                                 map(_received_at, skipped))
            _SKIPPED[reason].inc(len(skipped))
            event = SKIP_OUTCOMES[reason]
            log_events(logger, event, [{"outcome": event, **message_fields(m)} for m in skipped])


class ActionHistorySink(PartitionedSink[FavoriteMessage]):
    """Records ``(owner_shard, FavoriteMessage)`` items (:class:`_ActionHistoryPartition`)."""

    partition = _ActionHistoryPartition


_SWEEP_PAGE = 500
_WAITS_STARTED = FAVORITES_SESSION_WAITS.labels(outcome="started")
_WAITS_RECORDED = FAVORITES_SESSION_WAITS.labels(outcome="recorded")
_WAITS_SKIPPED = FAVORITES_SESSION_WAITS.labels(outcome="skipped")


def _report_swept(swept: list[WaitingSwept]) -> None:
    for action in swept:
        fields: dict[str, Any] = {"MessageId": action.message_id, "FavoriteId": action.favorite_id,
                                  "PropertyObjectId": action.property_object_id,
                                  "ActionType": action.action_type, "waited": True}
        if action.session_id is not None and action.inserted:
            _RECORDED[ActionType(action.action_type)].inc()
            _WAITS_RECORDED.inc()
            log_event(logger, "recorded", outcome="recorded", SessionId=action.session_id, **fields)
        elif action.session_id is not None:
            _SKIPPED[SkipReason.DUPLICATE].inc()
            log_event(logger, "skipped-duplicate", outcome="skipped-duplicate", **fields)
        elif action.given_up:
            _SKIPPED[SkipReason.NO_SESSION].inc()
            _WAITS_SKIPPED.inc()
            log_event(logger, "skipped-no-session", outcome="skipped-no-session", **fields)
