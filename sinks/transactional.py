"""The Bytewax sink partition shared by the flows: each batch in one transaction, or the DLQ.

``write_batch`` returns only after the batch committed (and its poison was acknowledged by the
DLQ topic): Bytewax snapshots input offsets after the sinks returned, so a crash loses nothing.
Items go by key to one of ``sink_partitions`` partitions (one connection each, one key's messages
in order). Infrastructure failures are retried forever with back-off (the worker blocks, health
paused); a data error or an unexpected exception bisects the batch, and a message failing alone
``poison_attempts`` times is dead-lettered. A committed batch's outbox rows are offered at once.
"""

from __future__ import annotations

import logging
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

import psycopg
from bytewax.outputs import FixedPartitionedSink, StatefulSinkPartition
from prometheus_client import Counter
from typing_extensions import override

from runtime import tracing
from runtime.backoff import Backoff, retry_forever
from runtime.logs import log_event
from runtime.process import Process
from runtime.settings import Settings
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import SourceRecord
from schemas.outbox import OutboxRow
from sinks.db import Connection, Database
from sinks.dead_letters import DeadLetterPublisher
from sinks.errors import is_data_error, is_infrastructure_error
from sinks.outbox.publisher import OutboxPublisher
from sinks.poison import Poisoned, write_isolating_poison


class _Created(Protocol):
    @property
    def created_at(self) -> datetime: ...


class FromRecord(Protocol):
    """A message that knows its Kafka record (what a dead letter re-sends) and its envelope."""

    @property
    def record(self) -> SourceRecord: ...  # noqa: D102

    @property
    def envelope(self) -> _Created: ...  # noqa: D102


class FlowLag(Protocol):
    """Where a flow's lag gauge learns what its sinks hold (``sources.progress``)."""

    def holding(self, flow: str, part: str, oldest: datetime) -> None: ...  # noqa: D102

    def finished(self, flow: str, part: str, newest: datetime | None) -> None: ...  # noqa: D102


Publishing = OutboxPublisher  # what a sink offers its committed outbox rows to
M = TypeVar("M", bound=FromRecord)
R = TypeVar("R")
T = TypeVar("T")


class PartitionedSink(FixedPartitionedSink[M, None], Generic[M]):
    """``sink_partitions`` fixed partitions; ``publisher`` None: another process's publishes.

    Shard ``i`` goes to partition ``i % n``; a key that is no shard (from a recovery store keyed
    by device) is hashed. Subclasses name their ``partition`` class.
    """

    partition: Callable[[Settings, Process, Publishing | None, str], TransactionalPartition[M, Any]]

    def __init__(self, settings: Settings, process: Process,
                 publisher: Publishing | None = None) -> None:
        self._settings = settings
        self._process = process
        self._publisher = publisher

    @override
    def list_parts(self) -> list[str]:
        return [str(i) for i in range(self._settings.sink_partitions)]

    @override
    def part_fn(self, item_key: str) -> int:
        return int(item_key) if item_key.isdigit() else zlib.adler32(item_key.encode())

    @override
    def build_part(self, step_id: str, for_part: str, resume_state: None
                   ) -> TransactionalPartition[M, Any]:
        return self.partition(self._settings, self._process, self._publisher, for_part)


class TransactionalPartition(StatefulSinkPartition[M, None], ABC, Generic[M, R]):
    """One partition's connection, DLQ producer and share of the outbox publisher."""

    ordered_outbox = True
    """False when each outbox row's key is its own: its rows may overtake earlier ones."""

    def __init__(self, settings: Settings, process: Process, publisher: Publishing | None, *,
                 name: str, dlq_topic: str, dlq_counter: Counter, retries_counter: Counter,
                 logger: logging.Logger, flow: str, lag: FlowLag | None = None) -> None:
        self._settings = settings
        self._process = process
        self._health = process.health
        self._flow = flow
        self._lag = lag
        self._name = name
        self._db = Database(settings, name)
        self._dlq = DeadLetterPublisher(settings, dlq_topic, dlq_counter, retries_counter,
                                        name=f"{name}-dlq", process=process)
        self._retries = retries_counter
        self._logger = logger
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._publisher = publisher

    @abstractmethod
    def write(self, conn: Connection, batch: Sequence[M]) -> R:
        """Write ``batch`` in one transaction (all or nothing)."""

    @abstractmethod
    def report(self, result: R) -> None:
        """Count and log what a committed batch did."""

    @abstractmethod
    def fields(self, message: M) -> dict[str, Any]:
        """The log fields that name ``message`` (ids only)."""

    @abstractmethod
    def committed_outbox(self, result: R) -> tuple[int, list[OutboxRow]]:
        """A committed batch's transaction and every outbox row it wrote (offered at once)."""

    @override
    def write_batch(self, values: list[M]) -> None:
        """Commit ``values`` (module doc): transactions, DLQ, outbox offer, report; in order."""
        self.track_held(values)
        size = self._settings.sink_batch_max
        for start in range(0, len(values), size):
            results, poisoned = write_isolating_poison(values[start : start + size], lambda b: (
                self._write_retrying(lambda: self.write(self._db.connection(), b))),
                self._settings.poison_attempts)
            for result in results:
                if self._publisher is not None:
                    self._publisher.offer(*self.committed_outbox(result),
                                          ordered=self.ordered_outbox)
                self.report(result)
            if poisoned:
                self._dead_letter(poisoned)
        self.track_finished(values)
        self._health.beat()

    @override
    def snapshot(self) -> None:
        """The epoch barrier: every batch written so far is committed already."""

    def track_held(self, messages: Sequence[M]) -> None:
        """``messages`` are in this partition's hands until :meth:`track_finished` (lag)."""
        if messages and self._lag is not None:
            self._lag.holding(self._flow, self._name, min(m.envelope.created_at for m in messages))

    def track_finished(self, messages: Sequence[M]) -> None:
        """Everything this partition held is finished, ``messages`` the last of it."""
        if self._lag is not None:
            self._lag.finished(self._flow, self._name, max(
                (m.envelope.created_at for m in messages), default=None))

    @override
    def close(self) -> None:
        self._health.resumed(waiter=self._name)  # a closed partition waits for nothing
        self._dlq.close()
        self._db.close()

    def _write_retrying(self, call: Callable[[], T]) -> T:
        """``call`` (a write on this partition's connection), infrastructure failures retried."""
        def once() -> T:
            try:
                return call()
            except psycopg.Error as exc:
                if is_infrastructure_error(exc):
                    self._db.reset()
                raise

        return retry_forever(once, is_transient=is_infrastructure_error, backoff=self._backoff,
                             on_retry=self._on_retry, on_recovered=self._on_recovered,
                             sleep=self._process.stopping.retry_sleep)

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        self._retries.inc()
        self._health.paused("postgres", attempt, type(exc).__name__, waiter=self._name)
        log_event(self._logger, "postgres-retry", logging.WARNING, error=type(exc).__name__,
                  sqlstate=getattr(exc, "sqlstate", None), attempt=attempt, delay_s=round(delay, 2))

    def _on_recovered(self, attempts: int) -> None:
        self._health.resumed(waiter=self._name)
        log_event(self._logger, "postgres-recovered", attempts=attempts)

    def _dead_letter(self, poisoned: list[Poisoned[M]]) -> None:
        letters = []
        for p in poisoned:
            reason = DlqReason.DATA_ERROR if is_data_error(p.error) else DlqReason.PROCESSING_ERROR
            error = type(p.error).__name__
            letters.append(DeadLetter.now(p.item.record, reason, error, p.attempts))
            log_event(self._logger, "record-failed", logging.ERROR, outcome="failed",
                      reason=reason.value, error=error,
                      sqlstate=getattr(p.error, "sqlstate", None), **self.fields(p.item))
        self._dlq.publish(letters)
        tracing.finish_messages([
            tracing.Handled(trace, p.item.record, "dead-lettered", error=letter.reason.value)
            for p, letter in zip(poisoned, letters, strict=True)
            if (trace := getattr(p.item, "trace", None)) is not None
        ])
