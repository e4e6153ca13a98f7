"""Bounded storage: the maintenance step over the daily partitions of the marks and the outbox.

Migration 0006 partitions ``user_activity.consumer_idempotency_marks`` (by ``processed_on``)
and ``user_activity.outbox`` (by ``created_at``) by UTC day: ``..._pYYYYMMDD`` holds day
YYYYMMDD (the marks partition of the migration day also holds every earlier mark). One run of
:func:`maintain`:

- creates the partitions of today and the next :data:`PARTITIONS_AHEAD_DAYS` days (those
  missing; ``user_activity.ensure_daily_partitions``);
- drops every partition whose day D is expired: D + 1 day <= today - ``retention_days`` (its
  newest row is older than the retention). An outbox partition is dropped only when none of
  its rows is still after the publication watermark (every row published or parked; parked
  rows live in ``outbox_parked``); otherwise it is kept and reported, and dropped by a later run.
  A drop is O(1): no DELETE, no vacuum;
- deletes, in bounded chunks, the expired rows that landed in a DEFAULT partition (a day that
  had no partition: normally none; published ones only for the outbox), the late-conflict
  records (``sign_in_conflicts``) detected and the parked rows published longer ago than the
  retention.

Guarantees: idempotent (a second run finds nothing to do); one run at a time across processes
(the session advisory lock :data:`MAINTENANCE_KEY`; a concurrent run returns at once with
``ran=False``); a partition and its parent are locked (``lock_timeout`` 2 s: writes wait that
long at most) before it is checked and dropped, so writers of it have finished, and one that
cannot be locked in time is left for the next run.
The permanent dedup authority, the unique ``action_events.source_message_id``, is never touched:
a redelivery older than the retention writes a new mark and records nothing.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

import psycopg
from psycopg import sql

from runtime.logs import log_event
from runtime.metrics import STORAGE_EXPIRED_PARTITIONS, STORAGE_PARTITION_DAYS_READY
from runtime.periodic import Periodic
from runtime.settings import Settings
from sinks.db import Connection, Database

logger = logging.getLogger(__name__)

MAINTENANCE_KEY = 0x75615F6D61696E74
"""The session advisory lock of the one running maintenance step ('ua_maint')."""
PARTITIONS_AHEAD_DAYS = 3
"""Days after today whose partitions exist after a run."""
DELETE_CHUNK_ROWS = 5_000
"""Rows one DELETE statement of a DEFAULT partition removes at most."""

_DAY = re.compile(r"_p(\d{8})$")
_PARTITIONS = """
SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = %s::regclass ORDER BY c.relname
"""
_UNPUBLISHED_IN = """
SELECT EXISTS (
    SELECT 1 FROM user_activity.{partition} o, user_activity.outbox_watermark w
     WHERE (o.txid >= pg_snapshot_xmax(w.delivered)
            OR o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(w.delivered))))
       AND NOT pg_visible_in_snapshot(o.txid, w.delivered))
    OR EXISTS (
    SELECT 1 FROM user_activity.{partition} o, user_activity.outbox_watermark w
     WHERE pg_snapshot_xmax(w.delivered) > pg_snapshot_xmax(pg_current_snapshot()))
"""
"""Whether a partition holds a row the publisher has not passed. A watermark ahead of the
server's transaction ids (copied from another cluster: :mod:`sinks.outbox` resets it when it
takes the lease) passes nothing, so no partition is dropped before its rows are sent again."""
_DELETE_EXPIRED_MARKS = """
DELETE FROM user_activity.consumer_idempotency_marks_default
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM user_activity.consumer_idempotency_marks_default
                          WHERE processed_on < %s LIMIT %s))
"""
_DELETE_EXPIRED_OUTBOX = """
DELETE FROM user_activity.outbox_default
 WHERE ctid = ANY (ARRAY(
        SELECT o.ctid FROM user_activity.outbox_default o, user_activity.outbox_watermark w
         WHERE o.created_at < %s AND pg_visible_in_snapshot(o.txid, w.delivered) LIMIT %s))
"""
_DELETE_EXPIRED_CONFLICTS = """
DELETE FROM user_activity.sign_in_conflicts
 WHERE message_id = ANY (ARRAY(SELECT message_id FROM user_activity.sign_in_conflicts
                                WHERE detected_at < %s LIMIT %s))
"""
"""Late-conflict records older than the retention (one per late sign-in: a replay of late
sign-ins with fresh MessageIds added rows without end)."""
_DELETE_PUBLISHED_PARKED = """
DELETE FROM user_activity.outbox_parked WHERE published_at < %s
"""


@dataclass
class MaintenanceReport:
    """What one run did."""

    ran: bool = True
    """False when another run held the lock (this one did nothing)."""
    created: int = 0
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Expired outbox partitions kept: rows in them are not published yet (or not lockable)."""
    deleted_rows: int = 0


def maintain(conn: Connection, retention_days: int, today: date | None = None
             ) -> MaintenanceReport:
    """One maintenance run on the autocommit ``conn`` (see the module doc); ``today`` in UTC."""
    today = today or datetime.now(UTC).date()
    report = MaintenanceReport()
    locked = conn.execute("SELECT pg_try_advisory_lock(%s)", (MAINTENANCE_KEY,)).fetchone()
    if not (locked and locked[0]):
        report.ran = False
        return report
    try:
        report.created = _create_ahead(conn, today)
        newest_expired = today - timedelta(days=retention_days + 1)
        for parent, check in (("consumer_idempotency_marks", False), ("outbox", True)):
            for name in _expired(conn, parent, newest_expired):
                if _drop(conn, parent, name, check_published=check):
                    report.dropped.append(name)
                else:
                    report.kept.append(name)
        report.deleted_rows = _delete_expired_rows(conn, today - timedelta(days=retention_days))
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (MAINTENANCE_KEY,))
    log_event(logger, "maintenance-done", logging.INFO, partitions_created=report.created,
              dropped=report.dropped, kept=report.kept, deleted_rows=report.deleted_rows)
    return report


PARENTS = ("consumer_idempotency_marks", "outbox")
"""The daily-partitioned tables, by their name in ``user_activity``."""


@dataclass(frozen=True)
class PartitionCensus:
    """What storage looks like for one partitioned table, as of a UTC ``today``."""

    expired: int
    """Day partitions past the retention that are still there (0 right after a good run)."""
    days_ready: int
    """Consecutive days from today on that have their partition (1 + PARTITIONS_AHEAD_DAYS
    after a run; 0: today's rows land in the DEFAULT partition)."""


def census(names: Iterable[str], today: date, retention_days: int) -> PartitionCensus:
    """The census of one table's partition ``names`` (``..._pYYYYMMDD``; others are ignored).

    A partition of day D is expired when D + 1 day <= today - ``retention_days``, as
    :func:`maintain` drops them.
    """
    days = {day for day in map(_day_of, names) if day is not None}
    newest_expired = today - timedelta(days=retention_days + 1)
    ready = 0
    while today + timedelta(days=ready) in days:
        ready += 1
    return PartitionCensus(expired=sum(d <= newest_expired for d in days), days_ready=ready)


def storage_census(conn: Connection, retention_days: int, today: date | None = None
                   ) -> dict[str, PartitionCensus]:
    """:func:`census` of each partitioned table, read from the catalog (no lock, no row read)."""
    today = today or datetime.now(UTC).date()
    return {parent: census((name for (name,) in conn.execute(
                _PARTITIONS, (f"user_activity.{parent}",)).fetchall()), today, retention_days)
            for parent in PARENTS}


def _create_ahead(conn: Connection, today: date) -> int:
    """Create the missing partitions of today and the days ahead; how many (0: lock timeout)."""
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            created = conn.execute(
                "SELECT user_activity.ensure_daily_partitions(%s, %s)",
                (today, today + timedelta(days=PARTITIONS_AHEAD_DAYS)),
            ).fetchone()
    except psycopg.errors.LockNotAvailable:
        log_event(logger, "maintenance-create-postponed", logging.WARNING, reason="lock timeout")
        return 0
    return int(created[0]) if created else 0


def _day_of(name: str) -> date | None:
    """The day of partition ``name`` (``..._pYYYYMMDD``); None for any other name."""
    found = _DAY.search(name)
    try:
        return datetime.strptime(found[1], "%Y%m%d").date() if found else None
    except ValueError:  # eight digits that are no date: not one of ours
        return None


def _expired(conn: Connection, parent: str, newest_expired: date) -> list[str]:
    """The day partitions of ``parent`` whose day is at or before ``newest_expired``."""
    names = []
    for (name,) in conn.execute(_PARTITIONS, (f"user_activity.{parent}",)).fetchall():
        day = _day_of(name)
        if day is not None and day <= newest_expired:
            names.append(name)
    return names


def _drop(conn: Connection, parent: str, name: str, *, check_published: bool) -> bool:
    """Drop partition ``name`` (after checking its rows are published); False if kept.

    The parent is locked before the partition, in the order writers lock them (a writer
    inserting through the parent then waits instead of deadlocking with the drop).
    """
    table = sql.Identifier("user_activity", name)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            conn.execute(sql.SQL("LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE").format(
                sql.Identifier("user_activity", parent)))
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(table))
            if check_published:
                row = conn.execute(
                    sql.SQL(_UNPUBLISHED_IN).format(partition=sql.Identifier(name))
                ).fetchone()
                if row is not None and row[0]:
                    log_event(logger, "maintenance-partition-kept", logging.WARNING,
                              partition=name, reason="unpublished rows")
                    return False
            conn.execute(sql.SQL("DROP TABLE {}").format(table))
    except psycopg.errors.LockNotAvailable:
        log_event(logger, "maintenance-partition-kept", logging.WARNING, partition=name,
                  reason="lock timeout")
        return False
    return True


def _delete_expired_rows(conn: Connection, cutoff_day: date) -> int:
    """Expired rows: DEFAULT partitions', late conflicts', published parked ones (chunked)."""
    cutoff = datetime(cutoff_day.year, cutoff_day.month, cutoff_day.day, tzinfo=UTC)
    deleted = 0
    for statement, bound in ((_DELETE_EXPIRED_MARKS, cutoff_day),
                             (_DELETE_EXPIRED_OUTBOX, cutoff),
                             (_DELETE_EXPIRED_CONFLICTS, cutoff)):
        while True:
            count = conn.execute(statement, (bound, DELETE_CHUNK_ROWS)).rowcount
            deleted += count
            if count < DELETE_CHUNK_ROWS:
                break
    deleted += conn.execute(_DELETE_PUBLISHED_PARKED, (cutoff,)).rowcount
    return deleted


class PeriodicMaintenance(Periodic):
    """The job's own maintenance: :func:`maintain` every ``maintenance_interval_seconds``.

    The first run is a minute after the start (so a job restarted more often than the interval
    still runs it). A failed run (the database down) is logged and counted by
    :class:`runtime.periodic.Periodic`; the next one runs as planned.
    """

    def __init__(self, settings: Settings) -> None:
        self._every = settings.maintenance_interval_seconds
        super().__init__(min(60.0, self._every), "maintenance")
        self._retention_days = settings.retention_days
        self._db = Database(settings, "user-activity-maintenance")
        self._last_run: float | None = None

    def tick(self) -> bool:
        """Run :func:`maintain` when due, then count the partitions (whoever held the lock).

        The census sets ``user_activity_storage_*`` (alerted: storage that is no longer bounded,
        partitions missing ahead). It is taken after every run, also one that found another
        process's run holding the lock, so every job process exports it.
        """
        now = time.monotonic()
        if self._last_run is not None and now - self._last_run < self._every:
            return True
        self._last_run = now
        try:
            conn = self._db.connection()
            maintain(conn, self._retention_days)
            for parent, counted in storage_census(conn, self._retention_days).items():
                STORAGE_EXPIRED_PARTITIONS.labels(parent).set(counted.expired)
                STORAGE_PARTITION_DAYS_READY.labels(parent).set(counted.days_ready)
        except psycopg.Error:
            self._db.reset()
            raise
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close its connection."""
        super().stop(timeout)
        self._db.close()
