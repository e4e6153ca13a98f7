"""Sending outbox rows: each batch and the stream's progress in one Kafka transaction.

:class:`Sender` knows the progress Kafka last committed and moves it: a committed transaction
moves it, and the watermark cache follows (:func:`~sinks.outbox.table.write_cache`). A row the
broker refuses alone is parked; a topic the broker refuses is held, its rows set aside in order
and retried on their own with back-off while the other topics go on (:mod:`.parking`). Both are
set aside in PostgreSQL before the transaction whose progress passes them commits. Whatever
else aborts a transaction raises :class:`~sinks.errors.DeliveryFailedError` (the publisher
retries the cycle).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from confluent_kafka import KafkaError

from runtime.backoff import Backoff
from runtime.logs import log_event
from runtime.metrics import (
    OUTBOX_HELD,
    OUTBOX_PARKED,
    OUTBOX_PUBLISH_FAILURES,
    OUTBOX_PUBLISHED,
)
from runtime.tracing import start_publish
from sinks.db import Connection
from sinks.errors import DeliveryFailedError, is_record_error, is_topic_error
from sinks.kafka_producer import Producible
from sinks.outbox.parking import (
    AsideRow,
    HeldRow,
    HeldTopics,
    forget_held,
    held_rows,
    held_topics,
    set_aside,
)
from sinks.outbox.progress import Progress
from sinks.outbox.stream import Attempt, OutcomeUnknownError, TransactionalStream
from sinks.outbox.table import StoredRow, write_cache

logger = logging.getLogger(__name__)

_HELD_REFRESH_SECONDS = 1.0  # how often the table is asked for held topics (a requeue)

Refused = list[tuple[StoredRow | HeldRow, str]]


class Sender:
    """The lease holder's transactions: rows and progress together (module doc)."""

    def __init__(self, stream: TransactionalStream, backoff: Backoff, page_rows: int,
                 conn: Callable[[], Connection]) -> None:
        self._stream = stream
        self._conn = conn
        self._page_rows = page_rows
        self.progress: Progress | None = None
        """What Kafka last committed; None: to be read (the stream opened anew)."""
        self.held = HeldTopics(backoff)
        self._generation = 0  # the watermark cache's, as this holder last wrote it
        self._held_refresh = 0.0

    def start(self, generation: int) -> None:
        """Begin as the holder; the watermark cache is at ``generation`` (as read)."""
        self.progress, self._generation = None, generation

    def resume(self, progress: Progress) -> None:
        """Go on from ``progress``, which Kafka committed: the cache and the held rows follow."""
        conn = self._conn()
        self._generation = write_cache(conn, progress, self._generation)
        forget_held(conn, progress.held)
        self.held.clear()
        self._refresh_held(conn)
        self.progress = progress

    def forget(self) -> None:
        """The lease was lost: what only its holder knows is read again by the next one."""
        self.progress = None
        self.held.clear()

    def commit(self, rows: Sequence[Producible], progress: Progress) -> Attempt:
        """``rows`` and ``progress`` in one Kafka transaction; the cache follows a commit.

        Raises :class:`OutcomeUnknownError` (the progress is read again from Kafka).
        """
        records, publishing = start_publish(rows)  # sampled rows get a `publish` span
        try:
            attempt = self._stream.publish(records, progress)
        except OutcomeUnknownError:
            self.progress = None
            raise
        if publishing is not None:
            publishing.end(list(attempt.errors) if not attempt.committed else [None] * len(rows))
        if attempt.committed:
            self.progress = progress
            _count(OUTBOX_PUBLISHED, (row.topic for row in rows))
            self._generation = write_cache(self._conn(), progress, self._generation)
        return attempt

    def commit_progress(self, progress: Progress) -> Progress:
        """A transaction of ``progress`` alone (the cache follows in :meth:`resume`)."""
        attempt = self._stream.publish([], progress)
        if not attempt.committed:
            raise DeliveryFailedError(attempt.error or "the progress record was refused")
        return progress

    def send(self, rows: list[StoredRow], progress: Progress) -> int:
        """``rows`` (held topics' rows: held) and ``progress`` in one transaction; rows sent.

        A row refused alone is parked, a refused topic held; then again without them.
        """
        while True:
            held = [(row, self.held.error(row.topic)) for row in rows if row.topic in self.held]
            if held:
                set_aside(self._conn(), "hold", [(_aside(r), e) for r, e in held])
                _count(OUTBOX_HELD, (row.topic for row, _ in held))
                rows = [row for row in rows if row.topic not in self.held]
            attempt = self.commit(rows, progress)
            if attempt.committed:
                return len(rows)
            parked = {row.id for row, _ in self._park(self._refused(rows, attempt))}
            rows = [row for row in rows if row.id not in parked]

    def send_held(self, *, force: bool = False) -> int:
        """Send a page of each held topic whose retry is due, in order; how many went out.

        A topic still refused backs off on its own; one with no row left is released.
        """
        conn = self._conn()
        if force or time.monotonic() >= self._held_refresh:
            self._refresh_held(conn)
        total = 0
        for topic in self.held.due(force=force):
            progress = self.progress
            assert progress is not None
            rows = held_rows(conn, topic, progress.held.get(topic, 0), self._page_rows)
            if rows:
                total += self._send_held_page(topic, rows, progress)
            else:
                self.held.release(topic)
                self.progress = progress.without_held([topic])
                log_event(logger, "outbox-topic-released", logging.INFO, topic=topic)
        return total

    def _send_held_page(self, topic: str, rows: list[HeldRow], progress: Progress) -> int:
        attempt = self.commit(rows, progress.with_held(topic, rows[-1].seq))
        if attempt.committed:
            forget_held(self._conn(), {topic: rows[-1].seq})
            self.held.sent(topic)
            return len(rows)
        errors = [e for e in attempt.errors if e is not None]
        if any(is_record_error(e) for e in errors):
            self._park(self._refused(rows, attempt))
            return 0
        failed = next(iter(errors), attempt.error)
        name = failed.name() if failed is not None else "aborted"
        OUTBOX_PUBLISH_FAILURES.inc()
        delay = self.held.failed(topic, name)
        log_event(logger, "outbox-topic-retry-failed", logging.WARNING, topic=topic, error=name,
                  retry_in_s=round(delay, 1))
        return 0

    def _refused(self, rows: Sequence[StoredRow | HeldRow], attempt: Attempt) -> Refused:
        """The rows of an aborted ``attempt`` refused alone (to park); refused topics held.

        A topic refused when it was added to the transaction names no record: then the broker
        is asked which topic it refuses. Raises :class:`DeliveryFailedError` when the broker
        refused neither a row nor a topic.
        """
        errors = list(attempt.errors)
        if attempt.error is not None and is_topic_error(attempt.error) and not any(
                e is not None and is_topic_error(e) for e in errors):
            errors = self._topic_errors(rows, errors)
        refused: Refused = []
        topics: set[str] = set()
        for row, err in zip(rows, errors, strict=True):
            if err is not None and is_topic_error(err) and row.topic not in self.held:
                self._hold_topic(row.topic, err.name())
                topics.add(row.topic)
            elif err is not None and is_record_error(err) and row.topic not in topics:
                alone = self._stream.probe(row)
                if alone is not None and is_record_error(alone):
                    refused.append((row, alone.name()))
        if not refused and not topics:
            error = attempt.error or next((e for e in errors if e is not None), None)
            raise DeliveryFailedError(error or "the transaction was aborted")
        return refused

    def _topic_errors(self, rows: Sequence[StoredRow | HeldRow],
                      errors: list[KafkaError | None]) -> list[KafkaError | None]:
        """``errors`` with the broker's refusal of each row's topic, asked of it directly."""
        refused = self._stream.refused_topics(row.topic for row in rows)
        return [refused.get(row.topic) or err for row, err in zip(rows, errors, strict=True)]

    def _hold_topic(self, topic: str, error: str) -> None:
        """The broker refused ``topic``: its rows are held back from now on (said once)."""
        if self.held.hold(topic, error):
            log_event(logger, "outbox-topic-held", logging.WARNING, topic=topic, error=error)

    def _park(self, refused: Refused) -> Refused:
        """Park ``refused`` rows (each counted and logged)."""
        set_aside(self._conn(), "park", [(_aside(row), error) for row, error in refused])
        for row, error in refused:
            OUTBOX_PARKED.labels(topic=row.topic).inc()
            log_event(logger, "outbox-row-parked", logging.ERROR, id=str(row.id),
                      topic=row.topic, error=error)
        return refused

    def _refresh_held(self, conn: Connection) -> None:
        self.held.known(held_topics(conn))
        self._held_refresh = time.monotonic() + _HELD_REFRESH_SECONDS


def _aside(row: StoredRow | HeldRow) -> AsideRow:
    return AsideRow(row.id, row.topic, row.key, row.value, row.headers, row.created_at)


def _count(counter: Any, topics: Iterable[str]) -> None:
    """Count rows per topic (one ``inc`` per topic)."""
    for topic, count in collections.Counter(topics).items():
        counter.labels(topic=topic).inc(count)
