"""The outbox publisher: committed outbox rows -> Kafka, exactly once for read_committed readers.

One process publishes at a time (:mod:`.lease`). It opens the stream (:mod:`.stream`: fences any
earlier producer, reads the progress Kafka committed) and sends every row in Kafka transactions
whose last record is the stream's progress (:mod:`.progress`, :mod:`.sending`), so Kafka holds
exactly which rows are out and a new holder resumes exactly after them. Each cycle, the fast path
sends the transactions this process's sinks committed from memory (:mod:`.fast_path`), the window
sends the rest from the table (:mod:`.window`), then held topics are retried (:mod:`.parking`).
Outages are retried forever with back-off; an unexpected exception in :meth:`OutboxPublisher.run`
is logged once, then a clean stop and exit 75.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import psycopg

from runtime.backoff import Backoff, retry_forever
from runtime.logs import log_event
from runtime.metrics import OUTBOX_PUBLISH_FAILURES
from runtime.process import Process
from runtime.settings import Settings
from schemas.outbox import OutboxRow
from sinks.db import Connection
from sinks.errors import DeliveryFailedError, is_infrastructure_error
from sinks.outbox.fast_path import FastPath, Offer
from sinks.outbox.lease import Lease
from sinks.outbox.progress import Progress, snapshot
from sinks.outbox.sending import Sender
from sinks.outbox.sql import query
from sinks.outbox.stream import OutcomeUnknownError, StreamFencedError, TransactionalStream
from sinks.outbox.table import Cache, LeaseLostError, current_snapshot, read_cache
from sinks.outbox.window import Target, Window

logger = logging.getLogger(__name__)

_WINDOW_SLICE_SECONDS = 0.25  # a window yields this often: the fast path and a stop go between
_STOP_DRAIN_SECONDS = 10.0
_NOTHING_DELIVERED = "1:1:"  # the snapshot that sees no transaction


class ProgressMissingError(Exception):
    """Kafka has no progress of the stream while rows wait: an operator adopts the cache."""


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
        self._sender = Sender(self._stream, self._backoff, settings.outbox_batch_size, self._conn)
        self._fast = FastPath(self._sender)
        self._window = Window(settings, self._sender, self._conn)
        self._missing_said = False
        self._lost = False  # the lease was held and its session ended: taken again, or stop
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ran = self._running = False

    def offer(self, txid: int, rows: Sequence[OutboxRow], *, ordered: bool = True) -> None:
        """A sink committed transaction ``txid``, whose outbox rows are ``rows``: hand them over.

        ``ordered`` False: each row's key is its own (no later row shares it), so the rows may
        overtake earlier ones. Never blocks; ignored by a standby (the holder's window sends them).
        """
        if rows and self.holds_lease:
            self._fast.put(Offer(txid, rows, ordered))
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
        total = self._fast.send()  # a stop's last rows first, not behind a backlog
        until = None if publish_seconds is None else time.monotonic() + publish_seconds
        while (count := self._send_window(Target(current_snapshot(self._conn()),
                                                 time.monotonic()))) > 0:
            total += count
            if until is not None and time.monotonic() >= until:
                raise TimeoutError(f"a backlog outlasted the drain's {publish_seconds:.0f} s"
                                   f" ({total} rows sent)")
        return total + self._sender.send_held(force=True)

    def close(self) -> None:
        """After :meth:`run` returned: publish what was committed, give the lease up, close.

        During a stop the drain is bounded by the grace (10 s at most; what is left: exit 75).
        """
        stopping = self._process.stopping
        if self._running:
            log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                      error="the publish loop did not stop")
            stopping.unfinished("committed outbox rows not published (the next start does)")
        elif (self._ran and self._sender.progress is not None) or self._lease.held:
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
            count = self._fast.send()
            target = self._window.target(behind=self._fast.behind)
            if target is not None:
                count += self._send_window(target)
            return count + self._sender.send_held()
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
        if self._sender.progress is None or not self._stream.is_open:
            self._sender.progress = None
            self._lease.confirm()
            self._resume(self._stream.open())
        return True

    def _resume(self, found: Progress | None) -> None:
        """Go on from Kafka's progress; from the cache's only if nothing was ever published.

        Raises :class:`ProgressMissingError` when Kafka has none and a publisher moved the
        cache (a release without transactions, or the progress topic lost).
        """
        conn = self._conn()
        cache = read_cache(conn)
        self._sender.start(cache.generation)
        progress = found if found is not None else self._adopt(cache)
        current = current_snapshot(conn)
        if snapshot(progress.delivered).xmax > snapshot(current).xmax:
            log_event(logger, "outbox-watermark-reset", logging.ERROR,
                      delivered=progress.delivered, current=current,
                      consequence="a progress ahead of this server's transactions (a logical copy"
                                  " of the database): every kept row is sent again")
            progress = self._sender.commit_progress(Progress(_NOTHING_DELIVERED))
        self._sender.resume(progress)
        self._fast.restart()  # offered while a standby: the window sends them
        self._window.restart()
        self._health.unstalled("outbox-progress")
        self._missing_said = False

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
        started = self._sender.commit_progress(cache.progress)
        log_event(logger, "outbox-progress-started", logging.INFO, delivered=started.delivered)
        return started

    def _send_window(self, target: Target) -> int:
        """A slice of the window to ``target``: the fast path catches up when it is read."""
        sent, read = self._window.send(target, _WINDOW_SLICE_SECONDS)
        if read is not None:
            self._fast.caught_up(read.taken_at)
        return sent

    # -- the loop's plumbing ---------------------------------------------------------------

    def _conn(self) -> Connection:
        return self._lease.connection()

    def _lose_lease(self, *, given_up: bool = False) -> None:
        """Forget what only the lease holder knows; the stream is opened anew with the lease.

        ``given_up``: nothing was published under it, so another holder next is no sign that
        this process was superseded (it waits as a standby).
        """
        self._lost = not given_up and (
            self._lost or self._lease.held or self._sender.progress is not None)
        self._lease.lost()
        self._stream.close()
        self._sender.forget()

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

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        OUTBOX_PUBLISH_FAILURES.inc()
        if isinstance(exc, ProgressMissingError):
            self._lose_lease(given_up=True)  # a standby's turn (an operator's adopt-watermark)
            return
        dependency = "postgres" if isinstance(exc, (psycopg.Error, LeaseLostError)) else "kafka"
        self._health.paused(dependency, attempt, type(exc).__name__, waiter=self._name)
        log_event(logger, "outbox-publish-retry", logging.WARNING, error=type(exc).__name__,
                  reason=str(exc)[:200], attempt=attempt, delay_s=round(delay, 2))


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, (LeaseLostError, OutcomeUnknownError, ProgressMissingError,
                            DeliveryFailedError)) or is_infrastructure_error(exc)


