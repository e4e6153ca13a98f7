"""The outbox publisher: committed outbox rows -> Kafka, at least once, with no write per row.

One process publishes at a time (the lease: a session advisory lock); the others stand by and
take it within ``outbox_idle_poll_seconds`` once its holder's session ends. Rows this process's
sinks committed are produced from memory at once (the fast path); the window
(:mod:`sinks.outbox.window`) sends from the table what the fast path did not. A row is behind the
watermark only once acknowledged, parked or held (:mod:`sinks.outbox.parking`): a crash re-sends,
never loses; a row keeps its MessageId. Outages are retried forever with back-off; an unexpected
exception in :meth:`OutboxPublisher.run` is logged once, then a clean stop and exit 75.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

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
from sinks.db import Connection, Database
from sinks.errors import (
    DeliveryFailedError,
    is_infrastructure_error,
    is_record_error,
    is_topic_error,
)
from sinks.kafka_producer import KafkaProducer, OutgoingRecord
from sinks.outbox.parking import HeldTopics, held_rows, held_topics, settle_held
from sinks.outbox.sql import query
from sinks.outbox.window import (
    LeaseLostError,
    Row,
    advance,
    read_page,
    read_window,
    visible_in,
    whole_rows,
)

logger = logging.getLogger(__name__)

LEASE_KEY = 0x75615F6F7574626F
"""The session advisory lock held by the one publishing process ('ua_outbo')."""

_OFFER_QUEUE_BATCHES = 64
_EARLY_MAX = 200_000  # ids acknowledged by the fast path, not yet behind the watermark
_RECENT_IDS = 50_000  # ids remembered as sent by a window, or as expected
_WINDOW_SLICE_SECONDS = 0.25  # a window yields this often: the fast path and a stop go between
_STOP_DRAIN_SECONDS = 10.0
_HELD_WAIT_SECONDS = 10.0  # a held topic's try: outlasts librdkafka's metadata propagation
_HELD_REFRESH_SECONDS = 1.0  # how often the table is asked for held topics (a requeue)
_DRAIN_LOG_SECONDS = 10.0


def outgoing_record(topic: str, key: bytes | None, value: bytes,
                    headers: dict[str, Any] | None) -> OutgoingRecord:
    """The Kafka record of a stored outbox row (header values sent UTF-8)."""
    return OutgoingRecord(topic, bytes(key) if key is not None else None, bytes(value),
                          [(name, str(v).encode()) for name, v in (headers or {}).items()])


class _RecentIds(collections.OrderedDict[UUID, None]):
    """The last ``size`` ids added, for membership tests (oldest forgotten first)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size

    def extend(self, ids: Iterable[UUID]) -> None:
        for row_id in ids:
            self.setdefault(row_id)
        while len(self) > self._size:
            self.popitem(last=False)


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
        self._db = Database(settings, f"user-activity-{name}")
        # a missing topic is known missing (UNKNOWN_TOPIC_OR_PART, held back) after 5 s, not
        # after the 30 s message time-out (a service error that holds every topic)
        missing_after: dict[str, Any] = {"topic.metadata.propagation.max.ms": 5000}
        self._producer = KafkaProducer(settings, name, stopping=process.stopping, **missing_after)
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ran = self._running = False
        self._offered: queue.Queue[Sequence[OutboxRow]] = queue.Queue(_OFFER_QUEUE_BATCHES)
        self._sent_early: set[UUID] = set()
        self._sent_by_window = _RecentIds(_RECENT_IDS)
        self._expected = _RecentIds(_RECENT_IDS)
        self._snapshots: collections.deque[tuple[float, str]] = collections.deque()
        self._drain: _Drain | None = None
        self._held = HeldTopics(self._backoff)
        self._held_refresh = 0.0
        self._lease: Connection | None = None
        self._last_lease_try = -1e9

    def offer(self, rows: Sequence[OutboxRow]) -> None:
        """A sink committed ``rows``: hand them over (never blocks; dropped: the window sends)."""
        if rows and self.holds_lease:
            with contextlib.suppress(queue.Full):
                self._offered.put_nowait(rows)
            self._wake.set()

    def expect(self, ids: Iterable[UUID]) -> None:
        """A sink sent a statement writing these rows: a window leaves them to the fast path.

        For up to ``outbox_fast_path_grace_seconds`` after they committed; ignored by a standby.
        """
        if self.holds_lease:
            self._expected.extend(ids)

    @property
    def holds_lease(self) -> bool:
        """True while this publisher's session holds the lease (as far as it knows)."""
        lease = self._lease
        return lease is not None and not lease.closed and not lease.broken

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set (in the composition root's thread; module doc)."""
        self._stop, self._ran, self._running = stop, True, True
        self._producer.producer  # noqa: B018 - built now: it connects while the flow starts
        try:
            while not stop.is_set():
                self._wake.clear()
                count = retry_forever(
                    self._cycle, backoff=self._backoff, on_retry=self._on_retry,
                    is_transient=lambda e: isinstance(e, LeaseLostError)
                    or is_infrastructure_error(e),
                    on_recovered=lambda _n: self._health.resumed(waiter=self._name),
                    sleep=self._sleep)
                if not count:
                    self._idle(stop)
        except Exception as exc:
            logger.error("outbox-publisher-failed", exc_info=exc,
                         extra={"error": type(exc).__name__})
            self._process.stopping.restart(f"the outbox publisher failed: {type(exc).__name__}")
        finally:
            self._running = False

    def drain(self, wait_seconds: float = 0.0, publish_seconds: float | None = None) -> int:
        """Publish every row committed before the call; return how many rows this one sent.

        As the lease holder (taken if free): windows until one is empty, for at most
        ``publish_seconds`` (then :class:`TimeoutError`, the progress recorded). As a standby:
        waits up to ``wait_seconds`` until the holder published them. Raises on an outage.
        """
        conn = self._db.connection()
        committed = conn.execute("SELECT pg_current_snapshot()::text").fetchall()[0][0]
        deadline = time.monotonic() + wait_seconds
        while not self._take_lease(force=True):
            pending = self._db.connection().execute(query("pending_in"), (committed,)).fetchone()
            if not (pending and pending[0]) or time.monotonic() >= deadline:
                return 0
            time.sleep(0.05)
        total = self.publish_offered()  # a stop's last rows first, not behind a backlog
        until = None if publish_seconds is None else time.monotonic() + publish_seconds
        while (count := self.publish_committed(slice_seconds=_WINDOW_SLICE_SECONDS)) > 0:
            total += count
            if until is not None and time.monotonic() >= until:
                raise TimeoutError(f"a backlog outlasted the drain's {publish_seconds:.0f} s"
                                   f" ({total} rows sent)")
        return total + self.publish_held(force=True)

    def close(self) -> None:
        """After :meth:`run` returned: publish what was committed, give the lease up, close.

        During a stop the drain is bounded by the grace (10 s at most; what is left: exit 75).
        """
        stopping = self._process.stopping
        if self._running:
            log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                      error="the publish loop did not stop")
            stopping.unfinished("committed outbox rows not published (the next start does)")
        elif self._ran:
            try:
                left = stopping.time_left(_STOP_DRAIN_SECONDS)
                self.drain(wait_seconds=left,
                           publish_seconds=left if stopping.requested() else None)
            except Exception as exc:  # noqa: BLE001 - the next publisher sends what is left
                log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                          error=type(exc).__name__)
                if stopping.requested():
                    stopping.unfinished("committed outbox rows not published (the next start"
                                        " publishes them)")
        if self._lease is not None:
            log_event(logger, "outbox-lease-released", logging.INFO)
        self._lease = None
        self._db.close()
        self._producer.close(5)
        self._health.resumed(waiter=self._name)  # a closed publisher waits for nothing

    def publish_offered(self) -> int:
        """The fast path: produce the offered rows from memory; how many were acknowledged.

        A row not acknowledged here, or of a held topic, is left to the window. A failure of
        Kafka itself (not of a record or a topic) ends the fast path with
        :class:`DeliveryFailedError` after its chunk: the run loop's back-off is a pause on
        ``kafka``, not one message time-out after another unsaid.
        """
        rows = self._take_offered()  # all of it: a row offered must not wait for the next window
        if not rows or not self.holds_lease or len(self._sent_early) >= _EARLY_MAX:
            return 0
        rows = [row for row in rows  # a window was quicker, or the topic is held back
                if row.id not in self._sent_by_window and row.topic not in self._held]
        acknowledged: list[OutboxRow] = []
        failed: KafkaError | None = None
        size = self._settings.outbox_batch_size
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            records, publishing = start_publish(chunk)  # an OutboxRow is producible as it is
            errors = self._producer.produce_and_wait(records)
            if publishing is not None:  # the sampled rows' `publish` spans (runtime.tracing)
                publishing.end(errors)
            for row, err in zip(chunk, errors, strict=True):
                if err is None:
                    acknowledged.append(row)
                elif is_topic_error(err):
                    self._hold_topic(row.topic, err.name())
                elif not is_record_error(err):
                    failed = failed or err
            if failed is not None:
                break
        self._sent_early.update(row.id for row in acknowledged)
        _count_published(row.topic for row in acknowledged)
        if failed is not None:
            raise DeliveryFailedError(failed)
        return len(acknowledged)

    def publish_committed(self, grace: float = 0.0, *, slice_seconds: float | None = None) -> int:
        """One window as the lease holder: send it, move the watermark; return rows delivered.

        ``slice_seconds``: return once a page ends that long after the call (progress recorded).
        ``grace`` > 0: stop before the first expected row committed less than ``grace`` ago. A
        row refused for good is parked, one of a refused topic held; the rows behind go on.
        Raises :class:`DeliveryFailedError` (the watermark stays before the row),
        :class:`LeaseLostError`, psycopg errors.
        """
        if not self.holds_lease:
            return 0
        conn = self._db.connection()
        window = read_window(conn)
        if grace > 0:
            self._snapshots.append((time.monotonic(), window.current))
        settled = self._aged(grace)
        limit = self._settings.outbox_batch_size
        after, generation, delivered = window.after, window.generation, 0
        early, began = self._sent_early, time.monotonic()
        while True:
            keys = read_page(conn, window, after, limit)
            cut = self._awaited(keys, settled) if grace > 0 else None
            if cut is not None:
                del keys[cut:]
                if not keys:
                    return delivered
            if not keys and not window.resumed and delivered == 0:
                return 0  # nothing committed since: the watermark stays where it is
            # rows the fast path had acknowledged are neither read whole nor sent again
            todo = [i for i, k in enumerate(keys) if k[1] not in early]
            whole = whole_rows(conn, [keys[i] for i in todo])
            OUTBOX_READ_BACK.inc(len(whole))
            rows: list[Row] = list(keys)
            for index, row in zip(todo, whole, strict=True):
                rows[index] = row
            behind = {i: self._held.error(rows[i][2]) for i in todo if rows[i][2] in self._held}
            send = [i for i in todo if i not in behind]
            errors: list[KafkaError | None] = [None] * len(keys)
            produced = self._produce([outgoing_record(*rows[i][2:6]) for i in send])
            for index, err in zip(send, produced, strict=True):
                errors[index] = err
            sent, parked, held = _settle(rows, errors, behind, hold=True)
            for row, error in held:
                self._hold_topic(row[2], error)
            last = cut is None and sent == len(keys) and len(keys) < limit
            if sent or last:
                cursor = None if last else (keys[sent - 1] if sent else after)
                generation = advance(conn, window, cursor, generation, parked=parked, held=held)
                _set_aside(parked, held)
            delivered += sent - len(parked) - len(held)
            _count_published(rows[i][2] for i in send if i < sent and errors[i] is None)
            early.difference_update(k[1] for k in keys[:sent])
            self._sent_by_window.extend(keys[i][1] for i in todo if i < sent)
            if sent < len(keys):
                failed = errors[sent]
                assert failed is not None
                raise DeliveryFailedError(failed)
            if last:
                self._progress(window.target, delivered, done=True)
                return delivered
            if cut is not None:
                return delivered
            after = (str(keys[-1][0]), keys[-1][1])
            if slice_seconds is not None and time.monotonic() - began >= slice_seconds:
                self._progress(window.target, delivered, done=False)
                return delivered

    def publish_held(self, *, force: bool = False) -> int:
        """Send a page of each held topic whose retry is due, in order; how many went out.

        A topic still refused backs off on its own (the windows go on); one with no row left is
        released.
        """
        if not self.holds_lease:
            return 0
        conn = self._db.connection()
        if force or time.monotonic() >= self._held_refresh:
            self._held.known(held_topics(conn))
            self._held_refresh = time.monotonic() + _HELD_REFRESH_SECONDS
        total = 0
        for topic in self._held.due(force=force):
            rows = held_rows(conn, topic, self._settings.outbox_batch_size)
            if not rows:
                self._held.release(topic)
                log_event(logger, "outbox-topic-released", logging.INFO, topic=topic)
                continue
            errors = self._produce([outgoing_record(*r[2:6]) for r in rows], _HELD_WAIT_SECONDS)
            sent, parked, _ = _settle(rows, errors, {}, hold=False)
            acknowledged = [rows[i][1] for i in range(sent) if errors[i] is None]
            settle_held(conn, acknowledged, parked)
            _set_aside(parked, [])
            _count_published(topic for _ in acknowledged)
            total += len(acknowledged)
            if sent == len(rows):
                self._held.sent(topic)
                continue
            failed = errors[sent]
            assert failed is not None
            OUTBOX_PUBLISH_FAILURES.inc()
            delay = self._held.failed(topic, failed.name())
            log_event(logger, "outbox-topic-retry-failed", logging.WARNING, topic=topic,
                      error=failed.name(), detail=failed.str(), retry_in_s=round(delay, 1))
        return total

    def _cycle(self) -> int:
        if self._stop.is_set():
            return 0
        try:
            if not self._take_lease():
                return 0
            count = self.publish_offered()
            count += self.publish_committed(self._settings.outbox_fast_path_grace_seconds,
                                            slice_seconds=_WINDOW_SLICE_SECONDS)
            return count + self.publish_held()
        except (psycopg.Error, LeaseLostError) as exc:
            if isinstance(exc, LeaseLostError) or is_infrastructure_error(exc):
                self._lost_lease()  # a new session takes the lease again if it is free
            raise

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _idle(self, stop: threading.Event) -> None:
        """Caught up: wait for an offer, the poll interval, or the stop (seen within 0.5 s)."""
        wait = self._settings.outbox_idle_poll_seconds
        if self._sent_early:  # sent from memory: a window moves past them after the grace
            wait = min(wait, max(self._settings.outbox_fast_path_grace_seconds, 0.05))
        deadline = time.monotonic() + wait
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self._wake.wait(min(left, 0.5)):
                return

    def _take_lease(self, *, force: bool = False) -> bool:
        """Hold the lease, taking it if it is free (tried at most every poll interval)."""
        if self.holds_lease:
            return True
        if self._lease is not None:  # its session ended: the lease is gone with it
            self._lost_lease()
        now = time.monotonic()
        if not force and now - self._last_lease_try < self._settings.outbox_idle_poll_seconds:
            return False
        self._last_lease_try = now
        conn = self._db.connection()
        row = conn.execute(query("take_lease"), (LEASE_KEY,)).fetchone()
        if row is None or not row[0]:
            return False  # another process holds it, or this server is a standby (no lease)
        conn.execute("SET synchronous_commit = off")  # a lost update only re-sends (window doc)
        reset = conn.execute(query("reset_foreign_watermark")).fetchone()
        if reset is not None:
            log_event(logger, "outbox-watermark-reset", logging.ERROR, delivered=reset[0],
                      target=reset[1], current=reset[2])
        self._lease = conn
        self._held.known(held_topics(conn))  # a previous holder's: their new rows go behind
        self._held_refresh = time.monotonic() + _HELD_REFRESH_SECONDS
        self._take_offered()  # offered while a standby (a race with offer()): the old holder's
        log_event(logger, "outbox-lease-taken", logging.INFO)
        return True

    def _take_offered(self) -> list[OutboxRow]:
        rows: list[OutboxRow] = []
        with contextlib.suppress(queue.Empty):
            while True:
                rows.extend(self._offered.get_nowait())
        return rows

    def _lost_lease(self) -> None:
        """Forget what only the lease holder knows; the connection is opened anew."""
        self._lease = None
        self._sent_early.clear()  # (a bound only: skipping an acknowledged row is safe)
        self._snapshots.clear()  # another publisher may have moved past them
        self._drain = None
        self._held.clear()
        self._db.reset()

    def _produce(self, records: Sequence[OutgoingRecord], timeout: float = 35.0,
                 ) -> list[KafkaError | None]:
        """Produce ``records``; a record error stands only when the record alone is refused."""
        if not records:
            return []
        records, publishing = start_publish(records)  # sampled rows get a `publish` span
        errors = self._producer.produce_and_wait(records, timeout)
        refused = [i for i, err in enumerate(errors) if err is not None and is_record_error(err)]
        if len(refused) > 1 or (refused and len(records) > 1):
            for index in refused:
                errors[index] = self._producer.produce_and_wait([records[index]], timeout)[0]
        if publishing is not None:
            publishing.end(errors)
        return errors

    def _hold_topic(self, topic: str, error: str) -> None:
        """The broker refused ``topic``: its rows are held back from now on (said once)."""
        if self._held.hold(topic, error):
            log_event(logger, "outbox-topic-held", logging.WARNING, topic=topic, error=error)

    def _aged(self, grace: float) -> Callable[[Any], bool] | None:
        """Visibility in the newest snapshot taken at least ``grace`` s ago (None: none yet)."""
        if grace <= 0:
            return None
        now, snapshots = time.monotonic(), self._snapshots
        while len(snapshots) > 1 and now - snapshots[1][0] >= grace:
            snapshots.popleft()
        if not snapshots or now - snapshots[0][0] < grace:
            return None
        return visible_in(snapshots[0][1])

    def _awaited(self, keys: Sequence[tuple[Any, Any]],
                 settled: Callable[[Any], bool] | None) -> int | None:
        """The first row a sink here will offer, not sent yet and recent (None: no such row)."""
        early, expected = self._sent_early, self._expected
        for index, (txid, row_id) in enumerate(keys):
            if (row_id not in early and row_id in expected
                    and (settled is None or not settled(txid))):
                return index
        return None

    def _progress(self, target: str, sent: int, *, done: bool) -> None:
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
        dependency = "postgres" if isinstance(exc, (psycopg.Error, LeaseLostError)) else "kafka"
        self._health.paused(dependency, attempt, type(exc).__name__, waiter=self._name)
        log_event(logger, "outbox-publish-retry", logging.WARNING, error=type(exc).__name__,
                  reason=str(exc)[:200], attempt=attempt, delay_s=round(delay, 2))


def _settle(rows: Sequence[Row], errors: Sequence[KafkaError | None], behind: dict[int, str],
            *, hold: bool) -> tuple[int, list[tuple[Row, str]], list[tuple[Row, str]]]:
    """How many leading rows are settled, and which of them to park and to hold back.

    ``behind``: index -> error name of rows behind a held topic.
    """
    parked: list[tuple[Row, str]] = []
    held: list[tuple[Row, str]] = []
    for index, err in enumerate(errors):
        if index in behind:
            held.append((rows[index], behind[index]))
        elif err is None:
            continue
        elif is_record_error(err):
            parked.append((rows[index], err.name()))
        elif hold and is_topic_error(err):
            held.append((rows[index], err.name()))
        else:
            return index, parked, held
    return len(errors), parked, held


def _set_aside(parked: Sequence[tuple[Row, str]], held: Sequence[tuple[Row, str]]) -> None:
    """Count what was set aside; log each parked row."""
    for row, error in parked:
        OUTBOX_PARKED.labels(topic=row[2]).inc()
        log_event(logger, "outbox-row-parked", logging.ERROR, id=str(row[1]), topic=row[2],
                  error=error)
    for row, _ in held:
        OUTBOX_HELD.labels(topic=row[2]).inc()


def _count_published(topics: Iterable[str]) -> None:
    """Count acknowledged rows per topic (one ``inc`` per topic)."""
    for topic, count in collections.Counter(topics).items():
        OUTBOX_PUBLISHED.labels(topic=topic).inc(count)
