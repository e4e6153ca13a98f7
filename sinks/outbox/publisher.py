"""The outbox publisher: committed outbox rows -> Kafka, exactly once for read_committed readers.

One process publishes at a time (:mod:`.lease`). It opens the stream (:mod:`.stream`: fences any
earlier producer, reads the progress Kafka committed) and sends every row in Kafka transactions
whose last record is the stream's progress (:mod:`.progress`), so Kafka holds exactly which rows
are out and a new holder resumes exactly after them. Two pieces feed it: the fast path sends the
transactions this process's sinks committed from memory (:mod:`.fast_path`); the window sends the
rest from the table (:mod:`.window`). A row refused for good is parked, a refused topic's rows are
held (:mod:`.parking`). Outages are retried forever with back-off; an unexpected exception in
:meth:`OutboxPublisher.run` is logged once, then a clean stop and exit 75.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import KafkaError

from runtime.backoff import Backoff, retry_forever
from runtime.logs import log_event
from runtime.metrics import (
    OUTBOX_HELD,
    OUTBOX_PARKED,
    OUTBOX_PUBLISH_FAILURES,
    OUTBOX_PUBLISHED,
    OUTBOX_READ_BACK,
)
from runtime.process import Process
from runtime.settings import Settings
from runtime.tracing import start_publish
from schemas.outbox import OutboxRow
from sinks.errors import (
    DeliveryFailedError,
    is_infrastructure_error,
    is_record_error,
    is_topic_error,
)
from sinks.kafka_producer import Producible
from sinks.outbox.fast_path import Offer, Offers
from sinks.outbox.lease import Lease
from sinks.outbox.parking import (
    AsideRow,
    HeldRow,
    HeldTopics,
    forget_held,
    held_rows,
    held_topics,
    set_aside,
)
from sinks.outbox.progress import Progress, snapshot
from sinks.outbox.sql import query
from sinks.outbox.stream import Attempt, OutcomeUnknownError, StreamFencedError, TransactionalStream
from sinks.outbox.window import (
    Cache,
    Key,
    LeaseLostError,
    StoredRow,
    current_snapshot,
    read_cache,
    read_page,
    whole_rows,
    write_cache,
)

logger = logging.getLogger(__name__)

_WINDOW_SLICE_SECONDS = 0.25  # a window yields this often: the fast path and a stop go between
_FAST_PATH_ROWS = 5_000  # rows of offers in one transaction at most (the rest: the next one)
_STOP_DRAIN_SECONDS = 10.0
_HELD_REFRESH_SECONDS = 1.0  # how often the table is asked for held topics (a requeue)
_DRAIN_LOG_SECONDS = 10.0
_NOTHING_DELIVERED = "1:1:"  # the snapshot that sees no transaction


class ProgressMissingError(Exception):
    """Kafka has no progress of the stream while rows wait: an operator adopts the cache."""


@dataclass
class _Drain:
    """A window longer than one slice (a backlog) under way: logged as it drains."""

    target: str
    began: float
    logged: float
    sent: int = 0


class OutboxPublisher:
    """Publishes committed ``user_activity.outbox`` rows (:meth:`run`), or on demand."""

    def __init__(self, settings: Settings, *, process: Process, name: str = "outbox") -> None:
        self._settings = settings
        self._process = process
        self._health = process.health
        self._name = name  # the waiter an outage pauses (health)
        self._lease = Lease(settings, name)
        self._stream = TransactionalStream(settings, stopping=process.stopping)
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._offers = Offers()
        self._held = HeldTopics(self._backoff)
        self._held_refresh = 0.0
        self._progress: Progress | None = None  # what Kafka committed; None: to be read
        self._generation = 0  # the watermark cache's, as this holder last wrote it
        self._snapshots: collections.deque[tuple[float, str]] = collections.deque()
        self._under_way: dict[str, float] = {}  # the target of a window under way: taken at
        self._suspended_at: float | None = None  # the fast path waits for a window past this
        self._missing_said = False
        self._lost = False  # the lease was held and its session ended: taken again, or stop
        self._drain: _Drain | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ran = self._running = False

    def offer(self, txid: int, rows: Sequence[OutboxRow], *, ordered: bool = True) -> None:
        """A sink committed transaction ``txid``, whose outbox rows are ``rows``: hand them over.

        ``ordered`` False: each row's key is its own (no later row shares it), so the rows may
        overtake earlier ones. Never blocks; ignored by a standby (the holder's window sends them).
        """
        if rows and self.holds_lease:
            self._offers.put(Offer(txid, rows, ordered))
            self._wake.set()

    @property
    def holds_lease(self) -> bool:
        """True while this publisher holds the lease (as far as it knows)."""
        return self._lease.held

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set (in the composition root's thread; module doc)."""
        self._stop, self._ran, self._running = stop, True, True
        try:
            while not stop.is_set():
                self._wake.clear()
                count = retry_forever(
                    self._cycle, backoff=self._backoff, on_retry=self._on_retry,
                    is_transient=_is_transient,
                    on_recovered=lambda _n: self._health.resumed(waiter=self._name),
                    sleep=self._sleep)
                if not count:
                    self._idle(stop)
        except StreamFencedError:
            pass  # said by the stream, which asked for the restart
        except Exception as exc:
            logger.error("outbox-publisher-failed", exc_info=exc,
                         extra={"error": type(exc).__name__})
            self._process.stopping.restart(f"the outbox publisher failed: {type(exc).__name__}")
        finally:
            self._running = False

    def drain(self, wait_seconds: float = 0.0, publish_seconds: float | None = None) -> int:
        """Publish every row committed before the call; return how many rows this one sent.

        As the lease holder (taken if free): windows until one is empty, for at most
        ``publish_seconds`` (then :class:`TimeoutError`, the progress committed). As a standby:
        waits up to ``wait_seconds`` until the holder published them. Raises on an outage.
        """
        committed = current_snapshot(self._lease.connection())
        deadline = time.monotonic() + wait_seconds
        while not self._ready(force=True):
            pending = self._lease.connection().execute(query("pending_in"), (committed,))
            row = pending.fetchone()
            if not (row and row[0]) or time.monotonic() >= deadline:
                return 0
            time.sleep(0.05)
        total = self._publish_offered()  # a stop's last rows first, not behind a backlog
        until = None if publish_seconds is None else time.monotonic() + publish_seconds
        while (count := self._publish_window(current_snapshot(self._conn()), time.monotonic(),
                                             _WINDOW_SLICE_SECONDS)) > 0:
            total += count
            if until is not None and time.monotonic() >= until:
                raise TimeoutError(f"a backlog outlasted the drain's {publish_seconds:.0f} s"
                                   f" ({total} rows sent)")
        return total + self._publish_held(force=True)

    def close(self) -> None:
        """After :meth:`run` returned: publish what was committed, give the lease up, close.

        During a stop the drain is bounded by the grace (10 s at most; what is left: exit 75).
        """
        stopping = self._process.stopping
        if self._running:
            log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                      error="the publish loop did not stop")
            stopping.unfinished("committed outbox rows not published (the next start does)")
        elif (self._ran and self._progress is not None) or self._lease.held:
            try:
                left = stopping.time_left(_STOP_DRAIN_SECONDS)
                self.drain(wait_seconds=left,
                           publish_seconds=left if stopping.requested() else None)
            except StreamFencedError:
                pass
            except Exception as exc:  # noqa: BLE001 - the next publisher sends what is left
                log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                          error=type(exc).__name__)
                if stopping.requested():
                    stopping.unfinished("committed outbox rows not published (the next start"
                                        " publishes them)")
        self._stream.close()
        self._lease.close()
        self._health.resumed(waiter=self._name)  # a closed publisher waits for nothing

    # -- one cycle -------------------------------------------------------------------------

    def _cycle(self) -> int:
        if self._stop.is_set():
            return 0
        try:
            if not self._ready():
                return 0
            count = self._publish_offered()
            target = self._window_target()
            if target is not None:
                count += self._publish_window(*target, _WINDOW_SLICE_SECONDS)
            return count + self._publish_held()
        except (psycopg.Error, LeaseLostError) as exc:
            if isinstance(exc, LeaseLostError) or is_infrastructure_error(exc):
                self._lose_lease()  # taken again, the stream opened anew, the cache rewritten
            raise

    def _ready(self, *, force: bool = False) -> bool:
        """Hold the lease and know what Kafka committed (opening the stream if need be).

        A holder whose lease another process took meanwhile (it was frozen, or cut off from
        PostgreSQL past ``outbox_lease_seconds``) stops: a restart, exit 75.
        """
        if not self._lease.take(force=force or self._lost):
            if self._lost:
                self._superseded()
            return False
        self._lost = False
        if self._progress is None or not self._stream.is_open:
            self._progress = None
            self._lease.confirm()
            self._progress = self._resume(self._stream.open())
        return True

    def _resume(self, found: Progress | None) -> Progress:
        """The progress to resume from: Kafka's; the cache's only if nothing was ever published.

        Raises :class:`ProgressMissingError` when Kafka has none and a publisher moved the
        cache (a release without transactions, or the progress topic lost).
        """
        conn = self._conn()
        cache = read_cache(conn)
        self._generation = cache.generation
        current = current_snapshot(conn)
        progress = found if found is not None else self._adopt(cache)
        if snapshot(progress.delivered).xmax > snapshot(current).xmax:
            log_event(logger, "outbox-watermark-reset", logging.ERROR,
                      delivered=progress.delivered, current=current,
                      consequence="a progress ahead of this server's transactions (a logical copy"
                                  " of the database): every kept row is sent again")
            progress = self._commit_progress(Progress(_NOTHING_DELIVERED))
        self._generation = write_cache(conn, progress, self._generation)
        forget_held(conn, progress.held)
        self._held.clear()
        self._held.known(held_topics(conn))
        self._held_refresh = time.monotonic() + _HELD_REFRESH_SECONDS
        self._snapshots.clear()
        self._suspended_at = time.monotonic()  # offered while a standby: the window sends them
        self._offers.take()
        self._health.unstalled("outbox-progress")
        self._missing_said = False
        return progress

    def _adopt(self, cache: Cache) -> Progress:
        """No progress in Kafka: the cache's if no publisher ever moved it, else refuse."""
        if cache.generation > 0:
            if not self._missing_said:
                self._missing_said = True
                log_event(logger, "outbox-progress-missing", logging.ERROR,
                          topic=self._settings.topic_outbox_progress,
                          transactional_id=self._settings.outbox_transactional_id,
                          action="publishing nothing: `user-activity outbox adopt-watermark`"
                                 " starts from the PostgreSQL watermark (at least once for the"
                                 " rows after it)")
            self._health.stalled("outbox-progress", "Kafka has no outbox progress; run"
                                                    " `user-activity outbox adopt-watermark`")
            raise ProgressMissingError("no outbox progress in Kafka, and a publisher moved the"
                                       " watermark")
        started = self._commit_progress(cache.progress)
        log_event(logger, "outbox-progress-started", logging.INFO, delivered=started.delivered)
        return started

    def _commit_progress(self, progress: Progress) -> Progress:
        """A transaction of ``progress`` alone."""
        attempt = self._stream.publish([], progress)
        if not attempt.committed:
            raise DeliveryFailedError(attempt.error or "the progress record was refused")
        return progress

    # -- the fast path ---------------------------------------------------------------------

    def _publish_offered(self) -> int:
        """Send the offered transactions from memory; how many rows went out.

        An ordered offer waits for the windows (left to them) while one is under way, and after
        an offer was dropped, a transaction failed or the lease was taken, until a window has
        read everything committed by then: it never overtakes an earlier transaction's rows.
        """
        offers, dropped = self._offers.take(_FAST_PATH_ROWS)
        if dropped is not None:
            self._suspend(dropped)
        progress = self._progress
        assert progress is not None
        behind = self._suspended_at is not None or progress.target is not None
        offers = [o for o in offers if not progress.covers(o.txid)]
        sendable = [o for o in offers if not (o.ordered and behind)
                    and not any(row.topic in self._held for row in o.rows)]
        if len(sendable) < len(offers):
            self._suspend(time.monotonic())  # the rest is the windows'
        if not sendable:
            return 0
        rows = [row for offer in sendable for row in offer.rows]
        attempt = self._commit(rows, progress.with_sent(o.txid for o in sendable))
        if not attempt.committed:
            self._suspend(time.monotonic())  # the window parks or holds what was refused
            return 0
        return len(rows)

    def _suspend(self, since: float) -> None:
        self._suspended_at = max(since, self._suspended_at or since)

    # -- the window ------------------------------------------------------------------------

    def _window_target(self) -> tuple[str, float] | None:
        """The snapshot the next window reads up to and when it was taken; None: too soon.

        The newest snapshot taken at least ``outbox_fast_path_grace_seconds`` ago, so rows the
        sinks here are about to offer are left to the fast path; the current one while the
        fast path is suspended.
        """
        taken_at = time.monotonic()  # (before the query: a drop after it is not seen as read)
        current = current_snapshot(self._conn())
        grace = self._settings.outbox_fast_path_grace_seconds
        if self._suspended_at is not None or grace <= 0:
            return current, taken_at
        snapshots = self._snapshots
        snapshots.append((taken_at, current))
        while len(snapshots) > 1 and taken_at - snapshots[1][0] >= grace:
            snapshots.popleft()
        oldest_at, oldest = snapshots[0]
        return (oldest, oldest_at) if taken_at - oldest_at >= grace else None

    def _publish_window(self, target: str, taken_at: float, slice_seconds: float) -> int:
        """Send the window up to ``target`` (or the one under way) page by page; rows sent.

        Returns once it is sent, or a page ends ``slice_seconds`` after the call (the
        progress committed, the window under way).
        """
        began, delivered = time.monotonic(), 0
        progress = self._progress
        assert progress is not None
        if progress.target is not None:  # the window under way first
            target, taken_at = progress.target, self._under_way.get(progress.target, -1e18)
        if not snapshot(target).sees_all_of(snapshot(progress.delivered)):
            self._snapshots.clear()  # taken before a window that read further: done already
            return 0
        limit, conn = self._settings.outbox_batch_size, self._conn()
        while True:
            keys = read_page(conn, progress, target, limit)
            done = len(keys) < limit
            after = progress.window_done(target) if done else \
                progress.window_until(target, (keys[-1].txid, keys[-1].id))
            if keys or after.sent != progress.sent or progress.target is not None:
                delivered += self._send_window_page(keys, progress, after)
            else:
                self._progress = after  # nothing in the window: nothing to record
            progress = self._progress
            assert progress is not None
            if done:
                self._window_done(target, taken_at, delivered)
                return delivered
            if time.monotonic() - began >= slice_seconds:
                self._under_way = {target: taken_at}
                self._report_drain(target, delivered, done=False)
                return delivered

    def _send_window_page(self, keys: Sequence[Key], progress: Progress, after: Progress) -> int:
        """Read back the page's rows the fast path did not send, and send them up to ``after``."""
        todo = [key for key in keys if key.txid not in progress.sent]
        rows = whole_rows(self._conn(), todo)
        OUTBOX_READ_BACK.inc(len(rows))
        return self._send_rows([row for row in rows if not row.set_aside], after)

    def _window_done(self, target: str, taken_at: float, delivered: int) -> None:
        self._under_way = {}
        self._report_drain(target, delivered, done=True)
        if self._suspended_at is not None and self._suspended_at <= taken_at:
            self._suspended_at = None  # every transaction of a dropped offer is out
            self._snapshots.clear()  # older than the current target this window read up to

    def _send_rows(self, rows: list[StoredRow], progress: Progress) -> int:
        """``rows`` (of held topics: held) and ``progress`` in one transaction; rows sent.

        A row the broker refuses alone is parked, a refused topic held; then again without
        them. Anything else raises :class:`DeliveryFailedError` (retried with back-off).
        """
        while True:
            held = [(row, self._held.error(row.topic)) for row in rows if row.topic in self._held]
            if held:
                set_aside(self._conn(), "hold", [(_aside(r), e) for r, e in held])
                _count(OUTBOX_HELD, (row.topic for row, _ in held))
                rows = [row for row in rows if row.topic not in self._held]
            attempt = self._commit(rows, progress)
            if attempt.committed:
                return len(rows)
            refused = self._refused(rows, attempt)
            set_aside(self._conn(), "park", [(_aside(r), e) for r, e in refused])
            _parked(refused)
            parked = {row.id for row, _ in refused}
            rows = [row for row in rows if row.id not in parked]

    def _refused(self, rows: Sequence[StoredRow | HeldRow], attempt: Attempt
                 ) -> list[tuple[Any, str]]:
        """The rows of an aborted ``attempt`` refused alone (to park); refused topics held.

        A topic refused when it was added to the transaction names no record: then the broker
        is asked which topic it refuses. Raises :class:`DeliveryFailedError` when the broker
        refused neither a row nor a topic.
        """
        errors = list(attempt.errors)
        if attempt.error is not None and is_topic_error(attempt.error) and not any(
                e is not None and is_topic_error(e) for e in errors):
            errors = self._topic_errors(rows, errors)
        refused: list[tuple[Any, str]] = []
        topics: set[str] = set()
        for row, err in zip(rows, errors, strict=True):
            if err is not None and is_topic_error(err) and row.topic not in self._held:
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

    # -- held topics -----------------------------------------------------------------------

    def _publish_held(self, *, force: bool = False) -> int:
        """Send a page of each held topic whose retry is due, in order; how many went out.

        A topic still refused backs off on its own (the windows go on); one with no row left
        is released.
        """
        conn = self._conn()
        if force or time.monotonic() >= self._held_refresh:
            self._held.known(held_topics(conn))
            self._held_refresh = time.monotonic() + _HELD_REFRESH_SECONDS
        total = 0
        for topic in self._held.due(force=force):
            progress = self._progress
            assert progress is not None
            rows = held_rows(conn, topic, progress.held.get(topic, 0),
                             self._settings.outbox_batch_size)
            if not rows:
                self._held.release(topic)
                self._progress = progress.without_held([topic])
                log_event(logger, "outbox-topic-released", logging.INFO, topic=topic)
                continue
            total += self._send_held(topic, rows, progress)
        return total

    def _send_held(self, topic: str, rows: list[HeldRow], progress: Progress) -> int:
        """One page of ``topic``'s held rows; a refused topic backs off, refused rows parked."""
        attempt = self._commit(rows, progress.with_held(topic, rows[-1].seq))
        if attempt.committed:
            forget_held(self._conn(), {topic: rows[-1].seq})
            self._held.sent(topic)
            return len(rows)
        errors = [e for e in attempt.errors if e is not None]
        if any(is_record_error(e) for e in errors):
            refused = self._refused(rows, attempt)
            set_aside(self._conn(), "park", [(_aside(r), e) for r, e in refused])
            _parked(refused)
            return 0
        failed = next(iter(errors), attempt.error)
        name = failed.name() if failed is not None else "aborted"
        OUTBOX_PUBLISH_FAILURES.inc()
        delay = self._held.failed(topic, name)
        log_event(logger, "outbox-topic-retry-failed", logging.WARNING, topic=topic, error=name,
                  retry_in_s=round(delay, 1))
        return 0

    # -- the transaction -------------------------------------------------------------------

    def _commit(self, rows: Sequence[Producible], progress: Progress) -> Attempt:
        """``rows`` and ``progress`` in one Kafka transaction; the cache follows a commit."""
        records, publishing = start_publish(rows)  # sampled rows get a `publish` span
        try:
            attempt = self._stream.publish(records, progress)
        except OutcomeUnknownError:
            self._progress = None  # read again from Kafka by the next cycle
            raise
        if publishing is not None:
            publishing.end(list(attempt.errors) if not attempt.committed else [None] * len(rows))
        if attempt.committed:
            self._progress = progress
            _count(OUTBOX_PUBLISHED, (row.topic for row in rows))
            self._generation = write_cache(self._conn(), progress, self._generation)
        return attempt

    # -- the loop's plumbing ---------------------------------------------------------------

    def _conn(self) -> Any:
        return self._lease.connection()

    def _lose_lease(self) -> None:
        """Forget what only the lease holder knows; the stream is opened anew with the lease."""
        self._lost = self._lost or self._lease.held or self._progress is not None
        self._lease.lost()
        self._stream.close()
        self._progress = None
        self._held.clear()
        self._drain = None

    def _superseded(self) -> None:
        log_event(logger, "outbox-lease-superseded", logging.ERROR,
                  action="stopping cleanly (exit 75): another process publishes; whatever this"
                         " one had open is fenced")
        self._process.stopping.restart("another process took the outbox lease")
        raise StreamFencedError("the lease was taken by another process")

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _idle(self, stop: threading.Event) -> None:
        """Caught up: wait for an offer, the poll interval, or the stop (seen within 0.5 s)."""
        deadline = time.monotonic() + self._settings.outbox_idle_poll_seconds
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self._wake.wait(min(left, 0.5)):
                return

    def _hold_topic(self, topic: str, error: str) -> None:
        """The broker refused ``topic``: its rows are held back from now on (said once)."""
        if self._held.hold(topic, error):
            log_event(logger, "outbox-topic-held", logging.WARNING, topic=topic, error=error)

    def _report_drain(self, target: str, sent: int, *, done: bool) -> None:
        """A window longer than one slice (a backlog) logs how it drains (every 10 s, its end)."""
        now, drain = time.monotonic(), self._drain
        if drain is None or drain.target != target:
            if done:
                return  # a window of one slice says nothing
            drain = self._drain = _Drain(target, now, now)
        drain.sent += sent
        rate = round(drain.sent / (now - drain.began)) if now > drain.began else None
        if done:
            self._drain = None
            log_event(logger, "outbox-drained", logging.INFO, sent=drain.sent,
                      seconds=round(now - drain.began, 1), rows_per_s=rate)
        elif now - drain.logged >= _DRAIN_LOG_SECONDS:
            drain.logged = now
            log_event(logger, "outbox-draining", logging.WARNING, sent=drain.sent, rows_per_s=rate)

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        OUTBOX_PUBLISH_FAILURES.inc()
        if isinstance(exc, ProgressMissingError):
            self._lose_lease()  # nothing to publish: a standby's turn, checked again later
            return
        dependency = "postgres" if isinstance(exc, (psycopg.Error, LeaseLostError)) else "kafka"
        self._health.paused(dependency, attempt, type(exc).__name__, waiter=self._name)
        log_event(logger, "outbox-publish-retry", logging.WARNING, error=type(exc).__name__,
                  reason=str(exc)[:200], attempt=attempt, delay_s=round(delay, 2))


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (LeaseLostError, OutcomeUnknownError, ProgressMissingError,
                            DeliveryFailedError)) or is_infrastructure_error(exc)


def _aside(row: StoredRow | HeldRow) -> AsideRow:
    return AsideRow(row.id, row.topic, row.key, row.value, row.headers, row.created_at)


def _parked(refused: Sequence[tuple[Any, str]]) -> None:
    """Count and log each parked row."""
    for row, error in refused:
        OUTBOX_PARKED.labels(topic=row.topic).inc()
        log_event(logger, "outbox-row-parked", logging.ERROR, id=str(row.id), topic=row.topic,
                  error=error)


def _count(counter: Any, topics: Iterable[str]) -> None:
    """Count rows per topic (one ``inc`` per topic)."""
    for topic, count in collections.Counter(topics).items():
        counter.labels(topic=topic).inc(count)
