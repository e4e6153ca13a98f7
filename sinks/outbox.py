"""The outbox publisher: committed outbox rows -> Kafka, at least once, with no per-row write.

How a row's publication is known (migration 0006, PgQ-style):
- Each ``user_activity.outbox`` row keeps ``txid``, the id of the transaction that wrote it. The
  publisher persists, in the one-row ``outbox_watermark``, ``delivered``: a
  ``pg_current_snapshot()`` such that every committed row whose txid is visible in it was
  acknowledged by the broker (or parked). A row is unpublished while its txid is not visible in
  ``delivered``. Sink partitions commit concurrently and in any order; a snapshot says exactly
  which transactions had committed, so no row is skipped.
- A publish cycle takes the current snapshot ``target`` and sends the window: rows visible in
  ``target`` and not in ``delivered`` (txid in ``delivered``'s in-progress list, or at or past its
  ``xmax``), in ``(txid, id)`` order, a page of ``outbox_batch_size`` at a time; then it moves
  the watermark with ONE update (``delivered = target``). A window of several pages records its
  progress (``target``, the last row sent) after each page. That update is the publisher's only
  write in the normal case: no UPDATE or DELETE per row (old rows go with their daily
  partition, :mod:`sinks.retention`).
- A crash anywhere (between the sink's commit and the produce, between the broker's
  acknowledgement and the watermark update) leaves the watermark behind the rows: the next
  cycle, in this process or another, sends them again. A row can be sent twice then, never lost,
  always with its stable MessageId. Watermark updates are made with ``synchronous_commit = off``:
  a database crash can only move the watermark back, which re-sends.
- One publisher at a time (the lease): the one holding the session advisory lock
  :data:`LEASE_KEY` on its own connection publishes; the others (the other processes of a
  cluster) stand by and take the lease within ``outbox_idle_poll_seconds`` when its holder's
  session ends (a crash, a stop, a lost connection). So two processes publish each row once in
  the normal case. The watermark update is also conditional on the generation it read. The
  lease is taken on a primary only (a standby's snapshots list no transaction in progress).
  A watermark ahead of the server's transaction ids (the database copied logically from
  another cluster: every new row would look published) is reset when the lease is taken, so
  every row in the table is sent again (``outbox-watermark-reset``, ERROR).
- Latency (the fast path): a sink's commit in the lease holder's process hands its rows over
  (``offer``); they are produced from memory at once, and the next window moves the watermark
  past the acknowledged ones without sending them again. So a committed row is on the topic in
  milliseconds. A deferred commit is handed over about one batch after it committed, and a
  window that ran first would read its rows back from the table (counted in
  ``user_activity_outbox_read_back_total``). So a sink announces the rows of a deferred
  statement when it sends it (``expect``), and the background loop's window stops before the
  first announced row that the fast path has not sent and that committed less than
  ``outbox_fast_path_grace_seconds`` (0.5 s) ago (not visible in a snapshot taken that long
  ago); it records its progress up to there and resumes later, when the row has been offered or
  is old enough to be read back. Rows not announced here (another process's, a crash's) are
  read back at once. The watermark so follows the fast path row by row, and a crash of the
  lease holder re-sends as little as possible.
- Kafka or PostgreSQL down: retried forever with back-off; nothing is dropped. A row is behind the
  watermark only after the broker acknowledged it (idempotent producer, ``acks=all``).
- A row the broker refuses for good (a per-record error, :func:`sinks.errors.is_record_error`:
  too large, invalid; confirmed by sending it alone) is parked: copied to
  ``outbox_parked`` with ``attempts`` and ``last_error`` in the transaction that moves the
  watermark past it, counted (``user_activity_outbox_parked_total``) and logged with its id; the
  rows behind it are published. An operator requeues it (``python -m cli outbox requeue``); the
  lease holder then sends it and sets its ``published_at`` (a per-row write, for parked rows
  only). A failure of the service (broker down, timeouts, authorization) is retried, never
  parked; for requeued rows it backs off on its own (``outbox-requeue-failed``), and the
  windows go on.
- Supervised: the publish loop runs under :class:`runtime.supervisor.SupervisedThread`, and a
  separate watchdog thread (:mod:`sinks.outbox_watchdog`) measures the age of the oldest
  committed, unpublished row in PostgreSQL every few seconds
  (``user_activity_outbox_oldest_unpublished_seconds``): older than
  ``outbox_stall_seconds`` -> ``/readyz`` 503 with the reason, whatever state the publish loop
  is in, and whichever process holds the lease (or none).
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
from psycopg.types.json import Jsonb

from runtime.backoff import Backoff, retry_forever
from runtime.health import HEALTH
from runtime.logs import log_event
from runtime.metrics import (
    OUTBOX_PARKED,
    OUTBOX_PUBLISH_FAILURES,
    OUTBOX_PUBLISHED,
    OUTBOX_READ_BACK,
)
from runtime.settings import Settings
from runtime.shutdown import SHUTDOWN
from runtime.supervisor import SupervisedThread
from runtime.tracing import start_publish
from schemas.action_tracked import (
    action_tracked_key,
    action_tracked_value,
    rendered_created_at,
    with_offset,
)
from schemas.outbox import OutboxRow
from sinks.db import Connection, Database
from sinks.errors import DeliveryFailedError, is_infrastructure_error, is_record_error
from sinks.kafka_producer import KafkaProducer, OutgoingRecord
from sinks.outbox_progress import DrainProgress
from sinks.outbox_watchdog import OutboxWatchdog
from sinks.retention import PeriodicMaintenance

logger = logging.getLogger(__name__)

LEASE_KEY = 0x75615F6F7574626F
"""The session advisory lock held by the one publishing process ('ua_outbo')."""

_NO_ROW = ("0", UUID(int=0))
_WATERMARK = """
SELECT delivered::text, target::text, after_txid::text, after_id, generation,
       pg_current_snapshot()::text
  FROM user_activity.outbox_watermark WHERE id = 1
"""
_CURRENT_SNAPSHOT = "SELECT pg_current_snapshot()::text"
_TAKE_LEASE = "SELECT CASE WHEN NOT pg_is_in_recovery() THEN pg_try_advisory_lock(%s) END"
"""The lease, on a primary only. A snapshot taken on a hot standby lists no transaction in
progress (PostgreSQL keeps them as subtransactions there), so a window taken there and
recorded after a promotion would pass the rows of transactions still running at the time."""
_RESET_FOREIGN_WATERMARK = """
WITH old AS (
    SELECT delivered::text AS delivered, target::text AS target
      FROM user_activity.outbox_watermark
     WHERE id = 1
       AND greatest(pg_snapshot_xmax(delivered), pg_snapshot_xmax(coalesce(target, delivered)))
           > pg_snapshot_xmax(pg_current_snapshot())
       FOR UPDATE
)
UPDATE user_activity.outbox_watermark w
   SET delivered = '1:1:'::pg_snapshot, target = NULL, after_txid = NULL, after_id = NULL,
       generation = generation + 1, updated_at = now()
  FROM old
 WHERE w.id = 1
RETURNING old.delivered, old.target, pg_current_snapshot()::text
"""
"""A watermark ahead of this server's transaction ids belongs to another cluster: the database
was copied logically (pg_dump and restore, a logical-replication cut-over), the ids started
again, and every new row would look published. Reset to the snapshot that sees no
transaction, so every row in the table is sent again (at least once: duplicates, no loss). A
row in one cluster never has a txid past that cluster's current xmax, so this never fires for
the cluster's own watermark."""
# The next page of the window (delivered, target], after the cursor, in (txid, id) order: the
# transactions in progress at `delivered` that `target` sees, then those started after it.
_PAGE = """
SELECT * FROM (
    (SELECT o.txid, o.id
       FROM user_activity.outbox o
      WHERE o.txid = ANY (ARRAY(SELECT x FROM pg_snapshot_xip(%(delivered)s::pg_snapshot) x
                                 WHERE pg_visible_in_snapshot(x, %(target)s::pg_snapshot)))
        AND (o.txid, o.id) > (%(after_txid)s::xid8, %(after_id)s::uuid)
      ORDER BY o.txid, o.id LIMIT %(limit)s)
    UNION ALL
    (SELECT o.txid, o.id
       FROM user_activity.outbox o
      WHERE (o.txid, o.id) > (%(start_txid)s::xid8, %(start_id)s::uuid)
        AND o.txid < pg_snapshot_xmax(%(target)s::pg_snapshot)
        AND pg_visible_in_snapshot(o.txid, %(target)s::pg_snapshot)
      ORDER BY o.txid, o.id LIMIT %(limit)s)
) page ORDER BY txid, id LIMIT %(limit)s
"""
"""A page of the window: ``(txid, id)`` only. Most rows were sent by the fast path already;
only the others are read whole (:data:`_ROWS`).

The transactions started after ``delivered`` are read from ``(start_txid, start_id)``
(:func:`page_start`: the cursor, or just before ``delivered``'s xmax), ONE lower bound: with
two (``txid >= xmax AND (txid, id) > cursor``) the btree scan started at the cursor, and a
window's first page (cursor 0) read every index entry of the table, published rows included:
66 ms and 13,872 buffers with 1M rows, every window (several a second), growing with the
7 days of retention until the statement timeout."""
_MAX_UUID = UUID(int=(1 << 128) - 1)


def page_start(delivered: str, after: tuple[str, UUID]) -> tuple[str, UUID]:
    """The lower bound, in ``(txid, id)`` order, of a window's rows past ``delivered``'s xmax.

    The cursor ``after`` when it is past that xmax, else the last possible row before it (so
    ``(txid, id) > start`` is ``txid >= xmax``): the scan starts there, not at the cursor.
    """
    xmax = int(delivered.split(":")[1])
    if int(after[0]) >= xmax:
        return after
    return (str(xmax - 1), _MAX_UUID)


def _page_params(window: _Window, after: tuple[str, UUID]) -> dict[str, Any]:
    """The parameters of :data:`_PAGE` (but ``limit``) for ``window`` past the cursor ``after``."""
    start = page_start(window.delivered, after)
    return {"delivered": window.delivered, "target": window.target, "after_txid": after[0],
            "after_id": after[1], "start_txid": start[0], "start_id": start[1]}


_ROWS = """
SELECT o.txid, o.id, o.topic, o.key, o.value, o.headers, o.created_at,
       o.action_event_id, o.correlation_id, o.occurred_offset, e.id, e.action_type,
       e.session_id, e.anonymous_id, e.user_id,
       e.occurred_at AT TIME ZONE make_interval(secs => o.occurred_offset),
       e.property_object_id, e.favorite_id
  FROM unnest(%(txids)s::xid8[], %(ids)s::uuid[]) AS w (txid, id)
  JOIN user_activity.outbox o ON o.txid = w.txid AND o.id = w.id
  LEFT JOIN user_activity.action_events e ON e.id = o.action_event_id
 ORDER BY o.txid, o.id
"""
"""The rows of a window that are sent from the table; a thin row (migration 0008: no value) with
the action it announces, OccurredAt read as the local time at its stored offset."""
_ADVANCE = """
UPDATE user_activity.outbox_watermark
   SET delivered = %(delivered)s::pg_snapshot, target = %(target)s::pg_snapshot,
       after_txid = %(after_txid)s::xid8, after_id = %(after_id)s,
       generation = generation + 1, updated_at = now()
 WHERE id = 1 AND generation = %(generation)s
"""
_PARK = """
INSERT INTO user_activity.outbox_parked
       (id, topic, key, value, headers, created_at, attempts, last_error)
VALUES (%s, %s, %s, %s, %s, %s, 1, %s)
ON CONFLICT (id) DO UPDATE
   SET attempts = outbox_parked.attempts + 1, last_error = EXCLUDED.last_error,
       parked_at = now(), requeued_at = NULL, published_at = NULL
"""
_REQUEUED = """
SELECT id, topic, key, value, headers FROM user_activity.outbox_parked
 WHERE requeued_at IS NOT NULL ORDER BY requeued_at LIMIT %s
"""
_REQUEUED_PUBLISHED = """
UPDATE user_activity.outbox_parked SET published_at = now(), requeued_at = NULL
 WHERE id = ANY(%s) AND requeued_at IS NOT NULL
"""
_REPARK = """
UPDATE user_activity.outbox_parked
   SET attempts = attempts + 1, last_error = %s, parked_at = now(), requeued_at = NULL
 WHERE id = %s AND requeued_at IS NOT NULL
"""
# Rows visible in a snapshot of the caller's that the watermark has not passed yet.
_PENDING_IN = """
SELECT EXISTS (
    SELECT 1 FROM user_activity.outbox o, user_activity.outbox_watermark w
     WHERE (o.txid >= pg_snapshot_xmax(w.delivered)
            OR o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(w.delivered))))
       AND pg_visible_in_snapshot(o.txid, %s::pg_snapshot)
       AND NOT pg_visible_in_snapshot(o.txid, w.delivered))
"""
_FAILURE_LOG_EVERY_SECONDS = 10.0
_REQUEUE_WAIT_SECONDS = 10.0
"""How long a send of requeued rows waits for the broker before it counts as failed (a deleted
topic's records wait out librdkafka's metadata propagation, 30 s): the publish loop is held up
that long at most per attempt, and the attempts back off."""
_OFFER_QUEUE_BATCHES = 64
_EARLY_MAX = 200_000
"""Ids acknowledged by the fast path and not yet behind the watermark, at most (memory bound)."""
_RECENT_WINDOW_IDS = 50_000
"""Ids last sent by a window, remembered so that their late offer is not sent again.

A window can read a row between its sink's commit and the sink's offer; the offer then comes
(milliseconds later) for a row already sent. The rows in that gap are those of the sink
commits in flight at the window's snapshot: far fewer than this.
"""


class _RecentIds:
    """The last ``size`` ids added, for membership tests (oldest forgotten first)."""

    def __init__(self, size: int) -> None:
        self._order: collections.deque[UUID] = collections.deque()
        self._ids: set[UUID] = set()
        self._size = size

    def extend(self, ids: Iterable[UUID]) -> None:
        """Remember ``ids`` (the oldest are forgotten beyond the size)."""
        for row_id in ids:
            if row_id not in self._ids:
                self._ids.add(row_id)
                self._order.append(row_id)
        while len(self._order) > self._size:
            self._ids.discard(self._order.popleft())

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._ids


_STOP_DRAIN_SECONDS = 10.0
_WINDOW_SLICE_SECONDS = 0.25
"""How long the background loop sends one window before it yields (its progress recorded).

A backlog (rows committed while the broker could not take them: 1M rows) is one window; sent
whole, it held the fast path and a stop for its whole length: new events waited for the
backlog (54 s behind 1M rows at 700 events/s), and a SIGTERM in the middle waited out the
stop's grace (exit 75 at 20 s). Sent a slice at a time, the loop offers the fast path its rows
and checks for a stop between slices; the next slice resumes at the recorded cursor.
"""


def outgoing_record(topic: str, key: bytes | None, value: bytes,
                    headers: dict[str, Any] | None) -> OutgoingRecord:
    """The Kafka record of a stored outbox row: the stored headers become the record's headers.

    Header values are sent as their ``str`` UTF-8 encoded (what the sinks stored is str).
    """
    return OutgoingRecord(
        topic, bytes(key) if key is not None else None, bytes(value),
        [(name, str(v).encode()) for name, v in (headers or {}).items()],
    )


def _rendered(row: tuple[Any, ...], created: dict[Any, str]) -> tuple[Any, ...]:
    """A thin action-tracked row of :data:`_ROWS` as a whole row, its key and value rendered.

    The bytes are those the sink rendered for the fast path (:mod:`schemas.action_tracked`, from
    the same immutable facts), so a row sent by both is the same record twice. ``created``
    caches CreatedAt's text by ``created_at``.
    """
    (txid, row_id, topic, _, _, headers, created_at, action_event_id, correlation_id, offset,
     found, action_type, session_id, anonymous_id, user_id, occurred_local, property_object_id,
     favorite_id) = row
    if found is None:  # never: an action and its outbox row commit together, neither is deleted
        raise RuntimeError(f"outbox row {row_id} names action {action_event_id}, which is missing")
    created_text = created.get(created_at)
    if created_text is None:
        created_text = created[created_at] = rendered_created_at(created_at)
    value = action_tracked_value(
        row_id, created_text, action_event_id,
        None if correlation_id is None else bytes(correlation_id).decode(), action_type,
        session_id, anonymous_id, user_id, with_offset(occurred_local, offset),
        property_object_id, favorite_id,
    )
    return (txid, row_id, topic, action_tracked_key(action_event_id), value, headers, created_at)


def visible_in(snapshot: str) -> Callable[[Any], bool]:
    """``pg_visible_in_snapshot(txid, snapshot)`` as a predicate, for a ``pg_snapshot`` text.

    ``xmin:xmax:xip,...``: a txid is visible when it is below ``xmin``, or below ``xmax`` and
    not in progress (``xip``). (Only committed txids are asked about: outbox rows.)
    """
    xmin, xmax, xip = snapshot.split(":")
    low, high = int(xmin), int(xmax)
    running = frozenset(int(x) for x in xip.split(",") if x)

    def visible(txid: Any) -> bool:
        value = int(txid)
        return value < low or (value < high and value not in running)

    return visible


@dataclass(frozen=True, slots=True)
class _Window:
    """The watermark as read: the window (delivered, target] and the last row sent of it."""

    delivered: str
    target: str
    after: tuple[str, UUID]
    generation: int
    resumed: bool


class LeaseLostError(Exception):
    """The watermark was moved by someone else: this publisher no longer holds the lease."""


class OutboxPublisher:
    """Publishes committed ``user_activity.outbox`` rows in a background thread (or on demand)."""

    def __init__(self, settings: Settings, name: str = "outbox") -> None:
        self._settings = settings
        self._name = name  # the waiter an outage pauses (health)
        self._db = Database(settings, f"user-activity-{name}")
        self._producer = KafkaProducer(settings, name)
        self._backoff = Backoff(settings.retry_initial_seconds, settings.retry_max_seconds)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._offered: queue.Queue[Sequence[OutboxRow]] = queue.Queue(_OFFER_QUEUE_BATCHES)
        self._sent_early: set[UUID] = set()
        self._sent_by_window = _RecentIds(_RECENT_WINDOW_IDS)
        self._expected = _RecentIds(_RECENT_WINDOW_IDS)
        self._snapshots: collections.deque[tuple[float, str]] = collections.deque()
        self._progress = DrainProgress()
        self._thread: SupervisedThread | None = None
        self._watchdog: OutboxWatchdog | None = None
        self._lease: Connection | None = None
        self._last_lease_try = -1e9
        self._requeue_due = -1e9  # time.monotonic() of the next requeued-rows check
        self._requeue_failures = 0  # failed sends of requeued rows in a row (their back-off)
        self._last_failure_log = -_FAILURE_LOG_EVERY_SECONDS

    def start(self) -> None:
        """Start the supervised publish loop and the stall watchdog (idempotent).

        The producer is built here, before the first row is offered: librdkafka connects and
        acquires the idempotent producer's id in the background while the flow starts, instead
        of on the first publish (which then waited for it: about half a second after a start).
        """
        if self._thread is None:
            self._producer.producer  # noqa: B018 - built now: it connects in the background
            self._stop.clear()
            self._thread = SupervisedThread("outbox-publisher", self._run, self._backoff).start()
            self._watchdog = OutboxWatchdog(self._settings).start()

    def offer(self, rows: Sequence[OutboxRow]) -> None:
        """A sink committed ``rows``: hand them over and wake the publisher (never blocks).

        Dropped when the queue is full: the rows are in the table, and the window sends them.
        A standby drops them at once: the holder, in another process, reads them from the table
        and sends them; kept until this process took the lease, they would be sent from memory
        a second time (the deployment test's SIGKILL of the lease holder: 1,757 rows twice).
        """
        if rows and self.holds_lease:
            with contextlib.suppress(queue.Full):
                self._offered.put_nowait(rows)
            self._wake.set()

    def expect(self, ids: Iterable[UUID]) -> None:
        """A sink of this process sent a statement writing these outbox rows (not committed yet).

        They will be offered once the sink knows the commit, so a window that finds them
        committed first leaves them to the fast path for up to the grace instead of reading
        them back. Rows not expected (another process's, a crash's) are read back at once, so
        the watermark does not wait for them. Ignored by a standby; the last
        50,000 ids are remembered (a statement that failed leaves its ids to be forgotten).
        """
        if self.holds_lease:
            self._expected.extend(ids)

    @property
    def holds_lease(self) -> bool:
        """True while this publisher's session holds the lease (as far as it knows)."""
        lease = self._lease
        return lease is not None and not lease.closed and not lease.broken

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop, publish what this process committed (see :meth:`drain`), close."""
        self._stop.set()
        self._wake.set()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._thread is not None:
            thread, self._thread = self._thread, None
            thread.stop(SHUTDOWN.time_left(timeout))
            try:  # a bounded run ends with its rows on the topic when the services are up
                if thread.alive():  # held up by an outage past the stop's grace
                    raise TimeoutError("the publish loop did not stop")
                # a stop's drain is bounded (a backlog is left to the next start); a bounded
                # run's end publishes everything
                left = SHUTDOWN.time_left(_STOP_DRAIN_SECONDS)
                self.drain(wait_seconds=left,
                           publish_seconds=left if SHUTDOWN.requested() else None)
            except Exception as exc:  # noqa: BLE001 - left rows are sent by the next publisher
                log_event(logger, "outbox-final-drain-failed", logging.WARNING,
                          error=type(exc).__name__)
                if SHUTDOWN.requested():
                    SHUTDOWN.unfinished("committed outbox rows not published (the next start"
                                        " publishes them)")
        self._release()
        self._producer.close(5)
        HEALTH.resumed(waiter=self._name)  # a stopped publisher waits for nothing

    def drain(self, wait_seconds: float = 0.0, publish_seconds: float | None = None) -> int:
        """Publish every row committed before the call; return how many rows this one sent.

        As the lease holder (taken if free): windows until one is empty, for at most
        ``publish_seconds`` when given (then :class:`TimeoutError`: a backlog longer than that
        is left, its progress recorded, to the next publisher). As a standby: waits up to
        ``wait_seconds`` until the holder has published them, or the lease is free to take.
        Raises on an infrastructure failure (the rows stay behind the watermark).
        """
        conn = self._db.connection()
        row = conn.execute(_CURRENT_SNAPSHOT).fetchone()
        assert row is not None
        committed = str(row[0])
        deadline = time.monotonic() + wait_seconds
        while True:
            if self._take_lease(force=True):
                total = self.publish_offered()  # a stop's last rows first, not behind a backlog
                until = None if publish_seconds is None else time.monotonic() + publish_seconds
                while (count := self.publish_committed(slice_seconds=_WINDOW_SLICE_SECONDS)) > 0:
                    total += count
                    if until is not None and time.monotonic() >= until:
                        raise TimeoutError(f"a backlog outlasted the drain's {publish_seconds:.0f}"
                                           f" s ({total} rows sent)")
                return total + self._publish_requeued_when_due(force=True)
            pending = self._db.connection().execute(_PENDING_IN, (committed,)).fetchone()
            if not (pending and pending[0]) or time.monotonic() >= deadline:
                return 0
            time.sleep(0.05)

    def publish_committed(self, grace: float = 0.0, *, slice_seconds: float | None = None) -> int:
        """One window as the lease holder: send it, move the watermark; return rows delivered.

        ``slice_seconds``: return after the first page that ends that long after the call, the
        progress recorded (the next call resumes the window there); None: the whole window.

        ``grace`` > 0 (the background loop): the window stops before the first row that this
        process's sinks will offer (:meth:`expect`), that the fast path has not sent, and that
        is not visible in a snapshot this publisher took at least ``grace`` seconds ago
        (committed less than ``grace`` ago, or no snapshot that old yet). The watermark records
        the progress up to that row (rows sent, none skipped) and a later call resumes there,
        when the fast path has sent the row or it is old enough to read back. ``grace`` 0 (a
        drain, a stop): the whole window. Returns 0 without a lease.
        Raises :class:`DeliveryFailedError` when the broker did not
        acknowledge a row (the watermark stays before it), :class:`LeaseLostError` when another
        publisher moved the watermark, psycopg errors when PostgreSQL fails.
        """
        if not self.holds_lease:
            return 0
        conn = self._db.connection()
        window = self._window(conn, grace)
        limit = self._settings.outbox_batch_size
        after, generation, delivered_rows = window.after, window.generation, 0
        early = self._sent_early
        aged = self._aged_snapshot(grace) if grace > 0 else None
        settled = visible_in(aged) if aged is not None else None
        began = time.monotonic()
        while True:
            rows: list[tuple[Any, ...]] = conn.execute(
                _PAGE, {**_page_params(window, after), "limit": limit}).fetchall()
            held = False
            if grace > 0:  # stop before a recent row of ours the fast path has not sent (yet)
                expected = self._expected
                for index, r in enumerate(rows):
                    if (r[1] not in early and r[1] in expected
                            and (settled is None or not settled(r[0]))):
                        del rows[index:]
                        held = True
                        break
                if held and not rows:
                    return delivered_rows
            if not rows and not window.resumed and delivered_rows == 0:
                return 0  # nothing committed since: the watermark stays where it is
            # rows the fast path already had acknowledged are not read whole nor sent again
            todo = [i for i, r in enumerate(rows) if r[1] not in early]
            whole = self._whole_rows(conn, [rows[i] for i in todo])
            if whole:
                OUTBOX_READ_BACK.inc(len(whole))
            for index, row in zip(todo, whole, strict=True):
                rows[index] = row
            errors: list[KafkaError | None] = [None] * len(rows)
            produced = self._produce([outgoing_record(*row[2:6]) for row in whole])
            for index, err in zip(todo, produced, strict=True):
                errors[index] = err
            sent = _settled_prefix(errors)
            refused = [(rows[i], errors[i]) for i in range(sent) if errors[i] is not None]
            last_page = not held and sent == len(rows) and len(rows) < limit
            state: tuple[str, str | None, str | None, UUID | None]
            if last_page:
                state = (window.target, None, None, None)
            else:
                cursor = (str(rows[sent - 1][0]), rows[sent - 1][1]) if sent else after
                state = (window.delivered, window.target, cursor[0], cursor[1])
            if sent or last_page:
                generation = self._advance(conn, state, generation, refused)
            delivered_rows += sent - len(refused)
            _count_published(rows[i][2] for i in todo if i < sent and errors[i] is None)
            early.difference_update(r[1] for r in rows[:sent])
            self._sent_by_window.extend(rows[i][1] for i in todo if i < sent)
            if sent < len(rows):
                failed = errors[sent]
                assert failed is not None
                self._delivery_failed(failed, len(rows) - sent)
                raise DeliveryFailedError(failed)
            if last_page:
                self._progress.ended(delivered_rows)
                return delivered_rows
            if held:
                return delivered_rows
            after = (str(rows[-1][0]), rows[-1][1])
            if slice_seconds is not None and time.monotonic() - began >= slice_seconds:
                self._progress.sliced(conn, _page_params(window, after), delivered_rows,
                                      next((r[6] for r in reversed(whole)), None))
                return delivered_rows

    @staticmethod
    def _whole_rows(conn: Connection, keys: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The whole rows of ``keys`` (``(txid, id)`` pairs, window order), in that order.

        A whole row is ``(txid, id, topic, key, value, headers, created_at)``; a thin row's key
        and value are rendered from the action it announces (:func:`_rendered`).
        A row of a window is unpublished, and only a published row's partition is ever dropped,
        so every one is there; a missing one is an error (the cycle is retried).
        """
        if not keys:
            return []
        stored: list[tuple[Any, ...]] = conn.execute(_ROWS, {
            "txids": [str(k[0]) for k in keys], "ids": [k[1] for k in keys],
        }).fetchall()
        if len(stored) != len(keys):
            raise RuntimeError(f"{len(keys) - len(stored)} outbox rows of the window are gone")
        created: dict[Any, str] = {}  # CreatedAt rendered once per batch of the writing sink
        return [row[:7] if row[4] is not None else _rendered(row, created) for row in stored]

    def publish_offered(self) -> int:
        """The fast path: produce the rows this process's sinks offered, from memory; how many.

        Only the lease holder does, before its next window reads them back (so a committed row
        is on the topic without waiting for a query); the ids the broker acknowledged are
        remembered and the window moves the watermark past them without sending them again. A
        row not acknowledged here is left to the window (retried, or parked). A standby drops
        what it is offered: the holder reads those rows from the table.
        """
        rows: list[OutboxRow] = []
        while True:  # all of it: a row offered before the next window must not wait for it
            try:
                rows.extend(self._offered.get_nowait())
            except queue.Empty:
                break
        if not rows or not self.holds_lease or len(self._sent_early) >= _EARLY_MAX:
            return 0
        sent_by_window = self._sent_by_window
        rows = [row for row in rows if row.id not in sent_by_window]  # a window was quicker
        acknowledged: list[OutboxRow] = []
        size = self._settings.outbox_batch_size
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            # an OutboxRow is producible as it is (bytes key and value, a dict of str headers)
            records, publishing = start_publish(chunk)
            errors = self._producer.produce_and_wait(records)
            if publishing is not None:  # the sampled rows' `publish` spans (runtime.tracing)
                publishing.end(errors)
            acknowledged += [row for row, err in zip(chunk, errors, strict=True) if err is None]
        self._sent_early.update(row.id for row in acknowledged)
        _count_published(row.topic for row in acknowledged)
        return len(acknowledged)

    def publish_requeued(self) -> int:
        """Send the parked rows an operator requeued (lease holder only); return how many.

        A delivered one gets ``published_at``; one refused again is parked again (attempts + 1).
        Raises :class:`DeliveryFailedError` when the broker did not acknowledge one.
        """
        if not self.holds_lease:
            return 0
        conn = self._db.connection()
        rows = conn.execute(_REQUEUED, (self._settings.outbox_batch_size,)).fetchall()
        if not rows:
            return 0
        errors = self._produce([outgoing_record(r[1], r[2], r[3], r[4]) for r in rows],
                               timeout=_REQUEUE_WAIT_SECONDS)
        delivered = [row[0] for row, err in zip(rows, errors, strict=True) if err is None]
        refused = [(row, err) for row, err in zip(rows, errors, strict=True)
                   if err is not None and is_record_error(err)]
        with conn.transaction():
            if delivered:
                conn.execute(_REQUEUED_PUBLISHED, (delivered,))
            for row, err in refused:
                conn.execute(_REPARK, (err.name(), row[0]))
        _count_published(r[1] for r, e in zip(rows, errors, strict=True) if e is None)
        for row, err in refused:
            _log_parked(row[0], row[1], err)
        failed = next((e for e in errors if e is not None and not is_record_error(e)), None)
        if failed is not None:
            self._delivery_failed(failed, len(rows) - len(delivered) - len(refused))
            raise DeliveryFailedError(failed)
        return len(delivered)

    def _window(self, conn: Connection, grace: float = 0.0) -> _Window:
        """The window to send: the one under way (its cursor), else up to the current snapshot.

        With ``grace`` > 0 the current snapshot is remembered for :meth:`_aged_snapshot`.
        """
        row = conn.execute(_WATERMARK).fetchone()
        if row is None:
            raise RuntimeError("user_activity.outbox_watermark has no row: run the migrations")
        delivered, target, after_txid, after_id, generation, current = row
        if grace > 0:
            self._snapshots.append((time.monotonic(), current))
        if target is not None:  # a window of several pages was under way: resume it
            return _Window(delivered, target, (after_txid, after_id), generation, resumed=True)
        return _Window(delivered, current, _NO_ROW, generation, resumed=False)

    def _aged_snapshot(self, grace: float) -> str | None:
        """The newest snapshot :meth:`_window` took at least ``grace`` seconds ago, if any.

        Called once per window. Drops the older ones: they are never needed again, so the
        deque holds one snapshot older than ``grace`` and those taken since.
        """
        now, snapshots = time.monotonic(), self._snapshots
        while len(snapshots) > 1 and now - snapshots[1][0] >= grace:
            snapshots.popleft()  # older ones are not needed again
        if not snapshots or now - snapshots[0][0] < grace:
            return None
        return snapshots[0][1]

    def _advance(
        self, conn: Connection, state: tuple[str, str | None, str | None, UUID | None],
        generation: int,
        refused: Sequence[tuple[tuple[Any, ...], KafkaError | None]],
    ) -> int:
        """Park the refused rows and move the watermark in one transaction; the new generation.

        Nothing refused (the normal case): the UPDATE alone, its own transaction on the
        autocommit connection (one round trip, no BEGIN and COMMIT).
        """
        delivered, target, after_txid, after_id = state
        params = {"delivered": delivered, "target": target, "after_txid": after_txid,
                  "after_id": after_id, "generation": generation}
        if refused:
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(_PARK, [
                    (r[1], r[2], r[3], r[4], Jsonb(r[5] or {}), r[6],
                     err.name() if err is not None else "")
                    for r, err in refused
                ])
                # raised inside: the parking is rolled back with it
                _require_moved(cur.execute(_ADVANCE, params).rowcount)
        else:
            _require_moved(conn.execute(_ADVANCE, params).rowcount)
        for row, err in refused:
            assert err is not None
            _log_parked(row[1], row[2], err)
        return generation + 1

    def _take_lease(self, *, force: bool = False) -> bool:
        """Hold the lease, taking it if it is free (tried at most every poll interval)."""
        if self.holds_lease:
            return True
        if self._lease is not None:  # its session ended: the lease is gone with it
            self._lease = None
            self._sent_early.clear()
        now = time.monotonic()
        if not force and now - self._last_lease_try < self._settings.outbox_idle_poll_seconds:
            return False
        self._last_lease_try = now
        conn = self._db.connection()
        row = conn.execute(_TAKE_LEASE, (LEASE_KEY,)).fetchone()
        if row is None or not row[0]:
            return False  # another process holds it, or this server is a standby (no lease)
        conn.execute("SET synchronous_commit = off")  # a lost update only re-sends (module doc)
        reset = conn.execute(_RESET_FOREIGN_WATERMARK).fetchone()
        if reset is not None:
            log_event(logger, "outbox-watermark-reset", logging.ERROR, delivered=reset[0],
                      target=reset[1], current=reset[2])
        self._lease = conn
        while True:  # offered while a standby (a race with offer()): the old holder sent them
            try:
                self._offered.get_nowait()
            except queue.Empty:
                break
        log_event(logger, "outbox-lease-taken", logging.INFO)
        return True

    def _release(self) -> None:
        """Give the lease up (by closing the session that holds it)."""
        if self._lease is not None:
            log_event(logger, "outbox-lease-released", logging.INFO)
        self._lease = None
        self._db.close()

    def _produce(self, records: Sequence[OutgoingRecord], timeout: float = 35.0,
                 ) -> list[KafkaError | None]:
        """Produce ``records``; a record error is confirmed by sending that record alone.

        The broker refuses a whole batch for one bad record, so its batch-mates come back with
        the same record error: each refused record is produced again on its own, and only a
        refusal of the record alone stands (it is then parked by the caller).
        """
        if not records:
            return []
        # Tracing: a row whose stored traceparent is sampled goes out under a `publish` span
        # (child of that context) and with the span's traceparent (runtime.tracing).
        records, publishing = start_publish(records)
        errors = self._producer.produce_and_wait(records, timeout)
        refused = [i for i, err in enumerate(errors) if err is not None and is_record_error(err)]
        if len(refused) > 1 or (refused and len(records) > 1):
            for index in refused:
                errors[index] = self._producer.produce_and_wait([records[index]], timeout)[0]
        if publishing is not None:
            publishing.end(errors)
        return errors

    def _delivery_failed(self, error: KafkaError, rows: int) -> None:
        """Count a failed delivery; log it at most every few seconds (throttled)."""
        OUTBOX_PUBLISH_FAILURES.inc()
        now = time.monotonic()
        if now - self._last_failure_log >= _FAILURE_LOG_EVERY_SECONDS:
            self._last_failure_log = now
            log_event(logger, "outbox-publish-failed", logging.WARNING, error=error.name(),
                      detail=error.str(), rows=rows)

    def _run(self, stop: threading.Event) -> None:
        while not self._stop.is_set() and not stop.is_set():
            self._wake.clear()
            count = retry_forever(
                self._cycle,
                is_transient=_is_transient,
                backoff=self._backoff,
                on_retry=self._on_retry,
                on_recovered=lambda _n: HEALTH.resumed(waiter=self._name),
                sleep=self._sleep,
            )
            if not count:  # caught up: wait for a local commit or the poll interval
                wait = self._settings.outbox_idle_poll_seconds
                if self._sent_early:  # sent from memory: a window moves past them after the grace
                    wait = min(wait, max(self._settings.outbox_fast_path_grace_seconds, 0.05))
                self._wake.wait(wait)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _cycle(self) -> int:
        if self._stop.is_set():
            return 0
        try:
            if not self._take_lease():
                return 0
            count = self.publish_offered()
            count += self.publish_committed(self._settings.outbox_fast_path_grace_seconds,
                                            slice_seconds=_WINDOW_SLICE_SECONDS)
            return count + self._publish_requeued_when_due()
        except (psycopg.Error, LeaseLostError) as exc:
            if isinstance(exc, LeaseLostError) or is_infrastructure_error(exc):
                self._lease = None
                self._sent_early.clear()  # (a bound only: skipping an acknowledged row is safe)
                self._snapshots.clear()  # another publisher may have moved past them
                self._progress.reset()
                self._db.reset()  # a new session takes the lease again if it is free
            raise

    def _publish_requeued_when_due(self, *, force: bool = False) -> int:
        """:meth:`publish_requeued` once per poll interval, after the window; how many it sent.

        Requeued rows are an operator's, on topics of their own: a service error for them (their
        topic deleted since, not authorized) backs off on its own (logged
        ``outbox-requeue-failed``) instead of being raised, which stopped every window behind
        it for as long as the requeued row kept failing. A database error is raised as before.
        """
        now = time.monotonic()
        if not force and now < self._requeue_due:
            return 0
        try:
            count = self.publish_requeued()
        except DeliveryFailedError as exc:
            self._requeue_failures += 1
            delay = self._backoff.delay(self._requeue_failures)
            self._requeue_due = now + delay
            log_event(logger, "outbox-requeue-failed", logging.WARNING, error=str(exc),
                      attempt=self._requeue_failures, retry_in_s=round(delay, 1))
            return 0
        self._requeue_failures = 0
        self._requeue_due = now + self._settings.outbox_idle_poll_seconds
        return count

    def _on_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        OUTBOX_PUBLISH_FAILURES.inc()
        HEALTH.paused(_dependency_of(exc), attempt, type(exc).__name__, waiter=self._name)
        log_event(
            logger,
            "outbox-publish-retry",
            logging.WARNING,
            error=type(exc).__name__,
            attempt=attempt,
            delay_s=round(delay, 2),
        )


def _require_moved(rowcount: int) -> None:
    """Raise :class:`LeaseLostError` unless the conditional watermark update moved its row."""
    if rowcount != 1:
        raise LeaseLostError("the outbox watermark was moved by another publisher")


def _dependency_of(exc: BaseException) -> str:
    """The service a transient failure of the publish cycle waits for."""
    return "postgres" if isinstance(exc, (psycopg.Error, LeaseLostError)) else "kafka"


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, LeaseLostError) or is_infrastructure_error(exc)


def _settled_prefix(errors: Sequence[KafkaError | None]) -> int:
    """How many leading records are settled: acknowledged, or refused for good (to park)."""
    for index, err in enumerate(errors):
        if err is not None and not is_record_error(err):
            return index
    return len(errors)


def _count_published(topics: Iterable[str]) -> None:
    """Count acknowledged rows per topic (one ``inc`` per topic)."""
    per_topic: dict[str, int] = {}
    for topic in topics:
        per_topic[topic] = per_topic.get(topic, 0) + 1
    for topic, count in per_topic.items():
        OUTBOX_PUBLISHED.labels(topic=topic).inc(count)


def _log_parked(row_id: UUID, topic: str, err: KafkaError) -> None:
    OUTBOX_PARKED.labels(topic=topic).inc()
    log_event(logger, "outbox-row-parked", logging.ERROR, id=str(row_id), topic=topic,
              error=err.name(), detail=err.str())


_shared_lock = threading.Lock()
_shared: OutboxPublisher | None = None
_shared_users = 0


def acquire_shared_publisher(settings: Settings) -> OutboxPublisher | None:
    """The process's one running publisher (started on first use); None if disabled.

    The process's maintenance step (:mod:`sinks.retention`) starts and stops with it.
    """
    global _shared, _shared_users  # noqa: PLW0603
    if not settings.outbox_enabled:
        return None
    with _shared_lock:
        if _shared is None:
            _shared = OutboxPublisher(settings)
            _shared.start()
            _start_maintenance(settings)
        _shared_users += 1
        return _shared


def release_shared_publisher() -> None:
    """Stop the process's publisher when its last user lets go of it."""
    global _shared, _shared_users  # noqa: PLW0603
    with _shared_lock:
        _shared_users = max(0, _shared_users - 1)
        if _shared_users == 0 and _shared is not None:
            _stop_maintenance()
            _shared.stop()
            _shared = None


_maintenance: PeriodicMaintenance | None = None


def _start_maintenance(settings: Settings) -> None:
    global _maintenance  # noqa: PLW0603
    if settings.maintenance_interval_seconds > 0 and _maintenance is None:
        _maintenance = PeriodicMaintenance(settings).start()


def _stop_maintenance() -> None:
    global _maintenance  # noqa: PLW0603
    if _maintenance is not None:
        _maintenance.stop()
        _maintenance = None
