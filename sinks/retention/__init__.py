"""Bounded storage: the maintenance of the daily partitions of the marks and the outbox.

One :func:`maintain` run creates the partitions of today and the next 3 days, drops every
partition past ``retention_days`` (an outbox partition only once all its rows are published; else
a later run does), and deletes in chunks the expired rows of the DEFAULT partitions, late-conflict
records and published parked rows. Idempotent; one run at a time across processes (an advisory
lock: a concurrent run returns ``ran=False``); tables are locked with a 2 s ``lock_timeout`` (one
not locked in time is left to the next run). :func:`run_maintenance`: a run, then the census.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from functools import partial

import psycopg
from psycopg import sql

from runtime.logs import log_event
from runtime.metrics import STORAGE_EXPIRED_PARTITIONS, STORAGE_PARTITION_DAYS_READY
from runtime.settings import Settings
from sinks.db import Connection, Database, named_query

logger = logging.getLogger(__name__)

MAINTENANCE_KEY = 0x75615F6D61696E74  # the session advisory lock of a run ('ua_maint')
PARTITIONS_AHEAD_DAYS = 3
DELETE_CHUNK_ROWS = 5_000
PARENTS = ("consumer_idempotency_marks", "outbox")  # daily-partitioned, in ``user_activity``

_DAY = re.compile(r"_p(\d{8})$")
_query = partial(named_query, __name__)


@dataclass(frozen=True)
class PartitionCensus:
    """What storage looks like for one partitioned table, as of a UTC ``today``."""

    expired: int  # day partitions past the retention still there
    days_ready: int  # consecutive days from today with their partition (0: today's in DEFAULT)


@dataclass
class MaintenanceReport:
    """What one run did."""

    ran: bool = True  # False: another run held the lock
    created: int = 0
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # expired, with unpublished rows (or locked)
    deleted_rows: int = 0
    census: dict[str, PartitionCensus] = field(default_factory=dict)  # run_maintenance's


def run_maintenance(settings: Settings, conn: Connection | None = None, *,
                    today: date | None = None) -> MaintenanceReport:
    """One :func:`maintain` (on ``conn`` or its own), then the census gauges, even if not run.

    Raises psycopg errors (PostgreSQL down): the caller runs it again at its next interval.
    """
    own = Database(settings, "user-activity-maintenance")  # connects only if used
    try:
        target = conn if conn is not None else own.connection()
        report = maintain(target, settings.retention_days, today)
        report.census = storage_census(target, settings.retention_days, today)
    finally:
        own.close()
    for parent, counted in report.census.items():
        STORAGE_EXPIRED_PARTITIONS.labels(parent).set(counted.expired)
        STORAGE_PARTITION_DAYS_READY.labels(parent).set(counted.days_ready)
    return report


def maintenance_task(settings: Settings) -> Callable[[], None]:
    """:func:`run_maintenance` at the first call, then every ``maintenance_interval_seconds``."""
    last = [float("-inf")]

    def run_when_due() -> None:
        now = time.monotonic()
        if now - last[0] >= settings.maintenance_interval_seconds:
            last[0] = now
            run_maintenance(settings)

    return run_when_due


def maintain(conn: Connection, retention_days: int, today: date | None = None) -> MaintenanceReport:
    """One maintenance run on the autocommit ``conn`` (module doc); ``today`` in UTC."""
    today = today or datetime.now(UTC).date()
    report = MaintenanceReport()
    locked = conn.execute("SELECT pg_try_advisory_lock(%s)", (MAINTENANCE_KEY,)).fetchone()
    if not (locked and locked[0]):
        report.ran = False
        return report
    try:
        report.created = _create_ahead(conn, today)
        newest_expired = today - timedelta(days=retention_days + 1)
        for parent in PARENTS:
            for name in _partitions(conn, parent):
                day = _day_of(name)
                if day is None or day > newest_expired:
                    continue
                dropped = _drop(conn, parent, name, check_published=parent == "outbox")
                (report.dropped if dropped else report.kept).append(name)
        report.deleted_rows = _delete_expired_rows(conn, today - timedelta(days=retention_days))
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (MAINTENANCE_KEY,))
    log_event(logger, "maintenance-done", logging.INFO, partitions_created=report.created,
              dropped=report.dropped, kept=report.kept, deleted_rows=report.deleted_rows)
    return report


def census(names: Iterable[str], today: date, retention_days: int) -> PartitionCensus:
    """The census of one table's partition ``names`` (``..._pYYYYMMDD``; others ignored)."""
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
    return {parent: census(_partitions(conn, parent), today, retention_days)
            for parent in PARENTS}


def _partitions(conn: Connection, parent: str) -> list[str]:
    return [name for (name,) in conn.execute(_query("partitions"),
                                             (f"user_activity.{parent}",)).fetchall()]


def _create_ahead(conn: Connection, today: date) -> int:
    """Create the missing partitions of today and the days ahead; how many (0: lock timeout)."""
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            created = conn.execute(_query("ensure_partitions"), (
                today, today + timedelta(days=PARTITIONS_AHEAD_DAYS))).fetchone()
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


def _drop(conn: Connection, parent: str, name: str, *, check_published: bool) -> bool:
    """Drop partition ``name`` (its rows published, if checked); False if kept.

    The parent is locked first, in the writers' order (no deadlock with an insert).
    """
    table = sql.Identifier("user_activity", name)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '2s'")
            conn.execute(sql.SQL("LOCK TABLE ONLY {} IN ACCESS EXCLUSIVE MODE").format(
                sql.Identifier("user_activity", parent)))
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(table))
            if check_published:
                unpublished = sql.SQL(_query("unpublished_in"))
                row = conn.execute(unpublished.format(partition=sql.Identifier(name))).fetchone()
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
    for name, bound in (("delete_expired_marks", cutoff_day), ("delete_expired_outbox", cutoff),
                        ("delete_expired_conflicts", cutoff)):
        while True:
            count = conn.execute(_query(name), (bound, DELETE_CHUNK_ROWS)).rowcount
            deleted += count
            if count < DELETE_CHUNK_ROWS:
                break
    return deleted + conn.execute(_query("delete_published_parked"), (cutoff,)).rowcount
