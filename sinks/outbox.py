"""The outbox publisher: committed outbox rows -> Kafka, at least once, with stable MessageIds.

Guarantees:
- A row is marked published (or deleted, with retention 0) only after the broker acknowledged
  it (idempotent producer, ``acks=all``, delivery reports checked), in the same transaction that
  claimed it; a crash before that commit leaves the row unpublished, and it is sent after restart.
- Rows are claimed with ``FOR UPDATE SKIP LOCKED``: two publishers (two processes, two flows)
  never send the same row concurrently.
- Kafka or PostgreSQL down: retried forever with back-off; nothing is dropped.
- Latency: the writing transaction ``NOTIFY``s; the publisher ``LISTEN``s, so a committed row is
  normally on the topic within milliseconds (and within ``outbox_idle_poll_seconds`` at worst).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from runtime.backoff import Backoff, retry_forever
from runtime.health import HEALTH
from runtime.logs import log_event
from runtime.metrics import OUTBOX_PUBLISH_FAILURES, OUTBOX_PUBLISHED
from runtime.settings import Settings
from sinks.db import Connection, Database
from sinks.errors import DeliveryFailedError, is_infrastructure_error
from sinks.kafka_producer import OutgoingRecord, build_producer, produce_and_wait

logger = logging.getLogger(__name__)

OUTBOX_CHANNEL = "user_activity_outbox"
"""The LISTEN/NOTIFY channel that wakes the publishers."""


def notify_publishers(conn: Connection) -> None:
    """NOTIFY the publishers, inside the transaction that wrote outbox rows.

    PostgreSQL delivers it at commit (and not at all on rollback).
    """
    conn.execute("SELECT pg_notify(%s, '')", (OUTBOX_CHANNEL,))


_CLAIM = """
SELECT id, topic, key, value, headers
  FROM user_activity.outbox
 WHERE published_at IS NULL
 ORDER BY created_at, id
 LIMIT %s
   FOR UPDATE SKIP LOCKED
"""
_MARK_PUBLISHED = "UPDATE user_activity.outbox SET published_at = now() WHERE id = ANY(%s)"
_DELETE_PUBLISHED = "DELETE FROM user_activity.outbox WHERE id = ANY(%s)"
_PURGE = (
    "DELETE FROM user_activity.outbox"
    " WHERE published_at < now() - make_interval(secs => %s)"
)
_PURGE_EVERY_SECONDS = 60.0


class OutboxPublisher:
    """Publishes ``user_activity.outbox`` rows in a background thread (or on demand)."""

    def __init__(self, settings: Settings, name: str = "outbox") -> None:
        self._settings = settings
        self._db = Database(settings, f"user-activity-{name}")
        self._producer = build_producer(settings, name)
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listening = False
        self._last_purge = 0.0

    def start(self) -> None:
        """Start the background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="outbox-publisher", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current cycle, publish what is left (one try), close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
            try:  # a bounded run ends with its rows on the topic when the services are up
                self.drain()
            except Exception as exc:  # noqa: BLE001 - left rows are sent by the next publisher
                log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                          error=type(exc).__name__)
        self._producer.flush(5)
        self._db.close()
        HEALTH.resumed("outbox")  # a stopped publisher waits for nothing

    def publish_pending(self) -> int:
        """One cycle: claim up to a batch of rows, publish them, mark them; return how many.

        Raises on an infrastructure failure (the caller retries); rows of a failed cycle stay
        unpublished (rows the broker did acknowledge in it are still marked).
        """
        conn = self._db.connection()
        with conn.transaction():
            rows: list[tuple[Any, ...]] = conn.execute(
                _CLAIM, (self._settings.outbox_batch_size,)
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
            errors = produce_and_wait(self._producer, records)
            delivered = [row[0] for row, err in zip(rows, errors, strict=True) if err is None]
            if delivered:
                statement = (
                    _DELETE_PUBLISHED
                    if self._settings.outbox_retention_seconds == 0
                    else _MARK_PUBLISHED
                )
                conn.execute(statement, (delivered,))
                for _id, topic, *_ in (r for r, e in zip(rows, errors, strict=True) if e is None):
                    OUTBOX_PUBLISHED.labels(topic=topic).inc()
        failed = next((err for err in errors if err is not None), None)
        if failed is not None:
            raise DeliveryFailedError(failed.name())
        return len(rows)

    def drain(self) -> int:
        """Publish until nothing is pending; return the number of rows published."""
        total = 0
        while (count := self.publish_pending()) > 0:
            total += count
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            published = retry_forever(
                self._cycle,
                is_transient=is_infrastructure_error,
                backoff=self._backoff,
                on_retry=self._on_retry,
                on_recovered=lambda _n: HEALTH.resumed("outbox"),
                sleep=self._sleep,
            )
            if published < self._settings.outbox_batch_size:
                self._wait_for_notify()

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _cycle(self) -> int:
        if self._stop.is_set():
            return 0
        try:
            count = self.publish_pending()
            self._purge_if_due()
            return count
        except psycopg.Error as exc:
            if is_infrastructure_error(exc):
                self._db.reset()
                self._listening = False
            raise

    def _purge_if_due(self) -> None:
        retention = self._settings.outbox_retention_seconds
        now = time.monotonic()
        if retention > 0 and now - self._last_purge >= _PURGE_EVERY_SECONDS:
            self._db.connection().execute(_PURGE, (retention,))
            self._last_purge = now

    def _wait_for_notify(self) -> None:
        timeout = self._settings.outbox_idle_poll_seconds
        try:
            conn = self._db.connection()
            if not self._listening:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(OUTBOX_CHANNEL)))
                self._listening = True
            for _ in conn.notifies(timeout=timeout, stop_after=1):
                pass
        except psycopg.Error:
            self._db.reset()
            self._listening = False
            self._stop.wait(timeout)

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
