"""The outbox publisher: committed outbox rows -> Kafka, at least once, with stable MessageIds.

Two paths, one guarantee:
- Fast path: after a sink's transaction commits, it ``offer``s the rows it wrote; the publisher
  produces them from memory (no read-back) and then marks them published (or deletes them, with
  retention 0) by id. This is the normal case: a committed row is on the topic in milliseconds.
- Sweep: rows left unpublished longer than ``outbox_sweep_grace_seconds`` (a crash between commit
  and publish, a failed delivery, an offer dropped because the queue was full, another process's
  rows) are claimed with ``FOR UPDATE SKIP LOCKED`` (two publishers never send the same claimed
  row concurrently), produced, and marked in the claiming transaction.
- A row is marked only after the broker acknowledged it (idempotent producer, ``acks=all``,
  delivery reports checked); a crash before that leaves it unpublished, and the sweep sends it
  after restart. A row can be sent twice (a slow fast path overtaken by the sweep), never lost.
- Kafka or PostgreSQL down: retried forever with back-off; nothing is dropped.
- A row the broker refuses for good (a per-record error, :func:`sinks.errors.is_record_error`:
  too large, invalid) is parked: ``parked_at``, ``attempts`` and ``last_error`` are set, the
  sweep no longer reads it, it is counted (``user_activity_outbox_parked_total``) and logged with
  its id, and the rows behind it are published. An operator re-queues it once the cause is
  fixed (``python -m cli outbox requeue --id ID | --all``). A row is never parked for a
  failure of the service (broker down, timeouts, authorization): those are retried.
- Supervised: the publish loop runs under :class:`runtime.supervisor.SupervisedThread` (an
  unexpected exception is logged with its traceback, counted, and the loop restarts after
  back-off), and a separate watchdog thread measures the age of the oldest committed,
  unpublished, unparked row in PostgreSQL every few seconds
  (``user_activity_outbox_oldest_unpublished_seconds``): older than
  ``outbox_stall_seconds`` -> ``/readyz`` 503 with the reason, whatever state the publish loop
  is in (crashed, stuck, starved, or another process's publisher gone).
- Old published rows are purged in bounded chunks (never one unbounded DELETE).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
from confluent_kafka import KafkaError

from runtime.backoff import Backoff, retry_forever
from runtime.health import HEALTH
from runtime.logs import log_event
from runtime.metrics import (
    OUTBOX_OLDEST_UNPUBLISHED_SECONDS,
    OUTBOX_PARKED,
    OUTBOX_PUBLISH_FAILURES,
    OUTBOX_PUBLISHED,
    OUTBOX_STALL_THRESHOLD_SECONDS,
)
from runtime.periodic import Periodic
from runtime.settings import Settings
from runtime.supervisor import SupervisedThread
from runtime.tracing import start_publish
from schemas.outbox import OutboxRow
from sinks.db import Connection, Database
from sinks.errors import DeliveryFailedError, is_infrastructure_error, is_record_error
from sinks.kafka_producer import KafkaProducer, OutgoingRecord, Producible

logger = logging.getLogger(__name__)


_CLAIM = """
SELECT id, topic, key, value, headers
  FROM user_activity.outbox
 WHERE published_at IS NULL
   AND parked_at IS NULL
   AND created_at <= now() - make_interval(secs => %s)
 ORDER BY created_at, id
 LIMIT %s
   FOR UPDATE SKIP LOCKED
"""
_MARK_PUBLISHED = (
    "UPDATE user_activity.outbox SET published_at = now()"
    " WHERE id = ANY(%s) AND published_at IS NULL"
)
_DELETE_PUBLISHED = "DELETE FROM user_activity.outbox WHERE id = ANY(%s)"
_PARK = """
UPDATE user_activity.outbox
   SET parked_at = now(), attempts = attempts + 1, last_error = %s
 WHERE id = %s AND published_at IS NULL
"""
_OLDEST_UNPUBLISHED = """
SELECT extract(epoch FROM now() - min(created_at))::float8
  FROM user_activity.outbox
 WHERE published_at IS NULL AND parked_at IS NULL
"""
_OFFER_QUEUE_BATCHES = 64
_PURGE_CHUNK = """
DELETE FROM user_activity.outbox
 WHERE id IN (SELECT id FROM user_activity.outbox
               WHERE published_at < now() - make_interval(secs => %s)
               ORDER BY published_at
               LIMIT %s)
"""
PURGE_CHUNK_ROWS = 5_000
"""Rows one purge statement deletes at most (well under any statement timeout)."""
_PURGE_BUDGET_SECONDS = 1.0
_PURGE_EVERY_SECONDS = 60.0
_FAILURE_LOG_EVERY_SECONDS = 10.0


class OutboxPublisher:
    """Publishes ``user_activity.outbox`` rows in a background thread (or on demand)."""

    def __init__(self, settings: Settings, name: str = "outbox") -> None:
        self._settings = settings
        self._db = Database(settings, f"user-activity-{name}")
        self._producer = KafkaProducer(settings, name)
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._stop = threading.Event()
        self._thread: SupervisedThread | None = None
        self._watchdog: OutboxWatchdog | None = None
        self._offered: queue.Queue[Sequence[OutboxRow]] = queue.Queue(_OFFER_QUEUE_BATCHES)
        self._last_purge = 0.0
        self._last_sweep = 0.0
        self._last_failure_log = -_FAILURE_LOG_EVERY_SECONDS
        self._carried: list[OutboxRow] = []

    def start(self) -> None:
        """Start the supervised publish loop and the stall watchdog (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = SupervisedThread("outbox-publisher", self._run, self._backoff).start()
            self._watchdog = OutboxWatchdog(self._settings).start()

    def offer(self, rows: Sequence[OutboxRow]) -> None:
        """Hand over committed rows for immediate publication (never blocks).

        Dropped when the publisher is not running or its queue is full: the rows are in the
        table, and the sweep publishes them after the grace period.
        """
        if rows and self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._offered.put_nowait(rows)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current cycle, publish what is left (one try), close."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._thread is not None:
            self._thread.stop(timeout)
            self._thread = None
            try:  # a bounded run ends with its rows on the topic when the services are up
                self.drain()
            except Exception as exc:  # noqa: BLE001 - left rows are sent by the next publisher
                log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                          error=type(exc).__name__)
        self._producer.close(5)
        self._db.close()
        HEALTH.resumed("outbox")  # a stopped publisher waits for nothing

    def publish_offered(self) -> int:
        """Publish the rows offered so far and mark them; return how many were published.

        Rows the broker did not acknowledge stay unpublished for the sweep; raises on an
        infrastructure failure while marking (the rows stay unmarked and are swept later).
        """
        rows, self._carried = self._carried, []
        while len(rows) < self._settings.outbox_batch_size:
            try:
                rows.extend(self._offered.get_nowait())
            except queue.Empty:
                break
        if not rows:
            return 0
        # Rows are produced as they are: no record object per row; the headers dict goes to
        # confluent-kafka unchanged (it sends str values UTF-8 encoded, like ``str.encode()``).
        errors = self._produce(rows)
        delivered: list[UUID] = []
        per_topic: dict[str, int] = {}
        refused: list[tuple[UUID, str, KafkaError]] = []
        failed: KafkaError | None = None
        for row, err in zip(rows, errors, strict=True):
            if err is None:
                delivered.append(row.id)
                per_topic[row.topic] = per_topic.get(row.topic, 0) + 1
            elif is_record_error(err):
                refused.append((row.id, row.topic, err))
            else:
                failed = failed or err
        conn = self._db.connection()
        if delivered:
            conn.execute(self._mark_statement(), (delivered,))
            for topic, count in per_topic.items():
                OUTBOX_PUBLISHED.labels(topic=topic).inc(count)
        if refused:
            _park(conn, refused)
        if failed is not None:  # left unpublished: the sweep sends them after the grace
            self._delivery_failed(failed, len(rows) - len(delivered) - len(refused), "offered")
        return len(delivered)

    def publish_pending(self, grace_seconds: float = 0.0) -> int:
        """One sweep: claim, publish and mark up to a batch of rows; return how many.

        Only rows unpublished for at least ``grace_seconds`` are claimed (the fast path has
        that long to mark its own).

        Raises on an infrastructure failure (the caller retries); rows of a failed cycle stay
        unpublished (rows the broker did acknowledge in it are still marked).
        """
        conn = self._db.connection()
        with conn.transaction():
            rows: list[tuple[Any, ...]] = conn.execute(
                _CLAIM, (grace_seconds, self._settings.outbox_batch_size)
            ).fetchall()
            if not rows:
                return 0
            records = [
                OutgoingRecord(
                    topic,
                    bytes(key) if key is not None else None,
                    bytes(value),
                    [(name, str(v).encode()) for name, v in (headers or {}).items()],
                )
                for _id, topic, key, value, headers in rows
            ]
            errors = self._produce(records)
            delivered = [row[0] for row, err in zip(rows, errors, strict=True) if err is None]
            if delivered:
                conn.execute(self._mark_statement(), (delivered,))
                for _id, topic, *_ in (r for r, e in zip(rows, errors, strict=True) if e is None):
                    OUTBOX_PUBLISHED.labels(topic=topic).inc()
            refused = [
                (row[0], row[1], err) for row, err in zip(rows, errors, strict=True)
                if err is not None and is_record_error(err)
            ]
            if refused:  # in the claiming transaction: parked rows leave the sweep's way
                _park(conn, refused)
        failed = next(
            (err for err in errors if err is not None and not is_record_error(err)), None
        )
        if failed is not None:
            self._delivery_failed(
                failed, sum(1 for e in errors if e is not None and not is_record_error(e)),
                "swept",
            )
            raise DeliveryFailedError(failed)
        return len(rows)

    def drain(self) -> int:
        """Publish everything offered or pending, with no grace; return how many rows."""
        total = 0
        while (count := self.publish_offered()) > 0:
            total += count
        while (count := self.publish_pending()) > 0:
            total += count
        return total

    def _mark_statement(self) -> str:
        if self._settings.outbox_retention_seconds == 0:
            return _DELETE_PUBLISHED
        return _MARK_PUBLISHED

    def _produce(self, records: Sequence[Producible]) -> list[KafkaError | None]:
        """Produce ``records``; a record error is confirmed by sending that record alone.

        The broker refuses a whole batch for one bad record, so its batch-mates come back with
        the same record error: each refused record is produced again on its own, and only a
        refusal of the record alone stands (it is then parked by the caller).
        """
        # Tracing: a row whose stored traceparent is sampled goes out under a `publish` span
        # (child of that context) and with the span's traceparent (runtime.tracing).
        records, publishing = start_publish(records)
        errors = self._producer.produce_and_wait(records)
        refused = [i for i, err in enumerate(errors) if err is not None and is_record_error(err)]
        if len(refused) > 1 or (refused and len(records) > 1):
            for index in refused:
                errors[index] = self._producer.produce_and_wait([records[index]])[0]
        if publishing is not None:
            publishing.end(errors)
        return errors

    def _delivery_failed(self, error: KafkaError, rows: int, path: str) -> None:
        """Count a failed delivery; log it at most every few seconds (throttled)."""
        OUTBOX_PUBLISH_FAILURES.inc()
        now = time.monotonic()
        if now - self._last_failure_log >= _FAILURE_LOG_EVERY_SECONDS:
            self._last_failure_log = now
            log_event(logger, "outbox-publish-failed", logging.WARNING, error=error.name(),
                      detail=error.str(), rows=rows, path=path)

    def _run(self, stop: threading.Event) -> None:
        while not self._stop.is_set() and not stop.is_set():
            retry_forever(
                self._cycle,
                is_transient=is_infrastructure_error,
                backoff=self._backoff,
                on_retry=self._on_retry,
                on_recovered=lambda _n: HEALTH.resumed("outbox"),
                sleep=self._sleep,
            )
            if self._offered.empty():
                self._wait_for_offer()

    def _wait_for_offer(self) -> None:
        with contextlib.suppress(queue.Empty):
            self._carried = list(
                self._offered.get(timeout=self._settings.outbox_idle_poll_seconds)
            )

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _cycle(self) -> int:
        if self._stop.is_set():
            return 0
        try:
            count = self.publish_offered()
            now = time.monotonic()
            if now - self._last_sweep >= self._settings.outbox_idle_poll_seconds:
                count += self.publish_pending(self._settings.outbox_sweep_grace_seconds)
                self._last_sweep = now
            self._purge_if_due()
            return count
        except psycopg.Error as exc:
            if is_infrastructure_error(exc):
                self._db.reset()
            raise

    def _purge_if_due(self) -> None:
        """Delete published rows older than the retention, a bounded chunk at a time.

        At most about a second of deleting per cycle; what is left goes in the next cycles.
        """
        retention = self._settings.outbox_retention_seconds
        now = time.monotonic()
        if retention <= 0 or now - self._last_purge < _PURGE_EVERY_SECONDS:
            return
        conn = self._db.connection()
        deadline = now + _PURGE_BUDGET_SECONDS
        while True:
            deleted = conn.execute(_PURGE_CHUNK, (retention, PURGE_CHUNK_ROWS)).rowcount
            if deleted < PURGE_CHUNK_ROWS:
                self._last_purge = now
                return
            if time.monotonic() >= deadline:  # more to delete: continue in the next cycle
                return

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        OUTBOX_PUBLISH_FAILURES.inc()
        HEALTH.paused("outbox", attempt, type(exc).__name__)
        log_event(
            logger,
            "outbox-publish-retry",
            logging.WARNING,
            error=type(exc).__name__,
            attempt=attempt,
            delay_s=round(delay, 2),
        )


def _park(conn: Connection, refused: Sequence[tuple[UUID, str, KafkaError]]) -> None:
    """Set rows the broker refused for good aside (see the module doc), count and log each."""
    with conn.cursor() as cur:
        cur.executemany(_PARK, [(err.name(), row_id) for row_id, _topic, err in refused])
    for row_id, topic, err in refused:
        OUTBOX_PARKED.labels(topic=topic).inc()
        log_event(logger, "outbox-row-parked", logging.ERROR, id=str(row_id), topic=topic,
                  error=err.name(), detail=err.str())


class OutboxWatchdog(Periodic):
    """Measures the oldest committed, unpublished, unparked row; reports a stall to health.

    Runs in its own thread on its own connection, so a crashed, stuck or starved publish loop
    (or a process whose publisher is gone) is seen all the same. A failed measurement (the
    database down) keeps the last value: the sinks report that outage themselves.
    """

    def __init__(self, settings: Settings) -> None:
        self._threshold = settings.outbox_stall_seconds
        super().__init__(min(5.0, max(0.2, self._threshold / 3)), "outbox-watchdog")
        self._db = Database(settings, "user-activity-outbox-watchdog")
        OUTBOX_STALL_THRESHOLD_SECONDS.set(self._threshold)

    def tick(self) -> bool:
        """One measurement."""
        try:
            row = self._db.connection().execute(_OLDEST_UNPUBLISHED).fetchone()
        except psycopg.Error:
            self._db.reset()
            return True
        age = float(row[0]) if row is not None and row[0] is not None else 0.0
        OUTBOX_OLDEST_UNPUBLISHED_SECONDS.set(max(0.0, age))
        if age > self._threshold:
            HEALTH.stalled(
                "outbox", f"oldest unpublished outbox row is {age:.0f}s old "
                          f"(> {self._threshold:g}s)")
        else:
            HEALTH.unstalled("outbox")
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop measuring; the stall it reported is withdrawn."""
        super().stop(timeout)
        self._db.close()
        HEALTH.unstalled("outbox")


def requeue_parked(conn: Connection, ids: Sequence[UUID] | None) -> int:
    """Give parked rows back to the publisher (all of them when ``ids`` is None); how many.

    The rows keep their ``attempts`` and ``last_error``; the sweep publishes them at once (they
    are older than its grace period). Idempotent: a row not parked is left alone.
    """
    if ids is None:
        cursor = conn.execute(
            "UPDATE user_activity.outbox SET parked_at = NULL WHERE parked_at IS NOT NULL"
        )
    else:
        cursor = conn.execute(
            "UPDATE user_activity.outbox SET parked_at = NULL"
            " WHERE parked_at IS NOT NULL AND id = ANY(%s)", (list(ids),),
        )
    return cursor.rowcount


def parked_rows(conn: Connection, limit: int = 100) -> list[tuple[Any, ...]]:
    """``(id, topic, attempts, last_error, parked_at, value size)`` of parked rows, oldest first."""
    return conn.execute(
        "SELECT id, topic, attempts, last_error, parked_at, octet_length(value)"
        "  FROM user_activity.outbox WHERE parked_at IS NOT NULL"
        " ORDER BY parked_at LIMIT %s", (limit,),
    ).fetchall()


_shared_lock = threading.Lock()
_shared: OutboxPublisher | None = None
_shared_users = 0


def acquire_shared_publisher(settings: Settings) -> OutboxPublisher | None:
    """The process's one running publisher (started on first use); None if disabled."""
    global _shared, _shared_users  # noqa: PLW0603
    if not settings.outbox_enabled:
        return None
    with _shared_lock:
        if _shared is None:
            _shared = OutboxPublisher(settings)
            _shared.start()
        _shared_users += 1
        return _shared


def release_shared_publisher() -> None:
    """Stop the process's publisher when its last user lets go of it."""
    global _shared, _shared_users  # noqa: PLW0603
    with _shared_lock:
        _shared_users = max(0, _shared_users - 1)
        if _shared_users == 0 and _shared is not None:
            _shared.stop()
            _shared = None
