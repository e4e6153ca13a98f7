"""The maintenance step on real PostgreSQL: expired daily partitions go, unpublished rows stay.

Each test gets its own freshly migrated database. Time is simulated: ``maintain`` runs as of a
later ``today`` (no sleeping for days), and rows are written with the dates of past days.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from runtime.settings import Settings
from sinks.retention import (
    MAINTENANCE_KEY,
    PARTITIONS_AHEAD_DAYS,
    PartitionCensus,
    maintain,
    run_maintenance,
    storage_census,
)
from tests.support import partitions, scratch_database

pytestmark = pytest.mark.integration

RETENTION_DAYS = 7


@dataclass(frozen=True)
class Days:
    """The days a test's dates are relative to."""

    migrated: date
    """The day the test database was migrated (its partitions: the day before to 3 days ahead)."""

    @property
    def expired(self) -> date:
        """A ``today`` on which the partitions of ``migrated`` and before are expired."""
        return self.migrated + timedelta(days=RETENTION_DAYS + 1)


def _day(day: date) -> str:
    return day.strftime("%Y%m%d")


def _deliver_everything(db: psycopg.Connection[Any]) -> None:
    """What a publisher does once every committed row was acknowledged."""
    db.execute("UPDATE user_activity.outbox_watermark SET delivered = pg_current_snapshot(),"
               " target = NULL, after_txid = NULL, after_id = NULL, generation = generation + 1")


def _at(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, 12, tzinfo=UTC)


@pytest.fixture
def fresh(database_url: str) -> Iterator[str]:
    """A migrated database of this test alone (dropped afterwards)."""
    with scratch_database(database_url, "retention", migrated=True) as dsn:
        yield dsn


@pytest.fixture
def fdb(fresh: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(fresh, autocommit=True) as conn:
        yield conn


@pytest.fixture
def days(fdb: psycopg.Connection[Any]) -> Days:
    """Read from the partitions the migration made, not from the clock.

    The migration names them after PostgreSQL's UTC date when it ran; a test that started just
    before midnight UTC would otherwise expect the previous day's.
    """
    named = [n.removeprefix("outbox_p") for n in partitions(fdb, "outbox")]
    first = min(datetime.strptime(d, "%Y%m%d").replace(tzinfo=UTC).date()
                for d in named if d.isdigit())
    return Days(migrated=first + timedelta(days=1))


def _mark(db: psycopg.Connection[Any], day: date) -> str:
    key = f"retention-test:{uuid.uuid4()}"
    db.execute("INSERT INTO user_activity.consumer_idempotency_marks"
               " (key, processed_at, processed_on) VALUES (%s, %s, %s)", (key, _at(day), day))
    return key


def _outbox(db: psycopg.Connection[Any], day: date) -> uuid.UUID:
    row = uuid.uuid4()
    db.execute("INSERT INTO user_activity.outbox (id, topic, value, created_at)"
               " VALUES (%s, 'retention-test', '\\x00', %s)", (row, _at(day)))
    return row


def test_expired_partitions_are_dropped_once_their_rows_are_published(
    fdb: psycopg.Connection[Any], days: Days,
) -> None:
    old_mark, recent_mark = _mark(fdb, days.migrated), _mark(fdb, days.migrated + timedelta(days=2))
    old_rows = [_outbox(fdb, days.migrated - timedelta(days=1)), _outbox(fdb, days.migrated)]
    recent_row = _outbox(fdb, days.migrated + timedelta(days=2))
    _deliver_everything(fdb)

    report = maintain(fdb, RETENTION_DAYS, today=days.expired)

    assert report.ran
    before = days.migrated - timedelta(days=1)  # the migration made the partitions of yesterday too
    assert set(report.dropped) == {
        f"consumer_idempotency_marks_p{_day(before)}",
        f"consumer_idempotency_marks_p{_day(days.migrated)}",
        f"outbox_p{_day(before)}", f"outbox_p{_day(days.migrated)}",
    }
    marks = fdb.execute("SELECT key FROM user_activity.consumer_idempotency_marks").fetchall()
    assert marks == [(recent_mark,)] and old_mark != recent_mark
    rows = fdb.execute("SELECT id FROM user_activity.outbox").fetchall()
    assert rows == [(recent_row,)] and recent_row not in old_rows
    for ahead in range(PARTITIONS_AHEAD_DAYS + 1):  # created ahead of the (simulated) today
        day = _day(days.expired + timedelta(days=ahead))
        assert f"outbox_p{day}" in partitions(fdb, "outbox")
        assert f"consumer_idempotency_marks_p{day}" in partitions(
            fdb, "consumer_idempotency_marks")


def test_an_expired_outbox_partition_with_an_unpublished_row_is_kept(
    fdb: psycopg.Connection[Any], days: Days,
) -> None:
    _mark(fdb, days.migrated)
    waiting = _outbox(fdb, days.migrated)  # committed, not yet behind the watermark

    report = maintain(fdb, RETENTION_DAYS, today=days.expired)

    assert f"outbox_p{_day(days.migrated)}" in report.kept
    assert f"consumer_idempotency_marks_p{_day(days.migrated)}" in report.dropped  # no check needed
    assert fdb.execute("SELECT id FROM user_activity.outbox_unpublished").fetchall() == [
        (waiting,)]

    _deliver_everything(fdb)
    again = maintain(fdb, RETENTION_DAYS, today=days.expired)
    assert f"outbox_p{_day(days.migrated)}" in again.dropped


def test_an_outbox_partition_is_kept_while_the_watermark_belongs_to_another_cluster(
    fdb: psycopg.Connection[Any], days: Days,
) -> None:
    """A watermark ahead of the transaction ids passes nothing.

    After a logical copy (pg_dump and restore) the watermark is ahead of the transaction ids:
    no partition goes before the publisher has sent its rows again.
    """
    _mark(fdb, days.migrated)
    _outbox(fdb, days.migrated)
    _deliver_everything(fdb)
    fdb.execute("UPDATE user_activity.outbox_watermark SET delivered = (x || ':' || x || ':')"
                "::pg_snapshot FROM (SELECT (pg_snapshot_xmax(pg_current_snapshot())::text"
                "::bigint + 1000000)::text AS x) ahead WHERE id = 1")

    report = maintain(fdb, RETENTION_DAYS, today=days.expired)

    assert f"outbox_p{_day(days.migrated)}" in report.kept


def test_a_second_run_changes_nothing(fdb: psycopg.Connection[Any], days: Days) -> None:
    _deliver_everything(fdb)
    maintain(fdb, RETENTION_DAYS, today=days.expired)

    again = maintain(fdb, RETENTION_DAYS, today=days.expired)

    assert (again.created, again.dropped, again.kept, again.deleted_rows) == (0, [], [], 0)


def test_nothing_inside_the_retention_is_dropped(fdb: psycopg.Connection[Any], days: Days) -> None:
    key = _mark(fdb, days.migrated)
    _outbox(fdb, days.migrated)
    _deliver_everything(fdb)

    report = maintain(fdb, RETENTION_DAYS, today=days.expired - timedelta(days=1))

    before = _day(days.migrated - timedelta(days=1))  # empty, a day older
    assert sorted(report.dropped) == [f"consumer_idempotency_marks_p{before}", f"outbox_p{before}"]
    assert fdb.execute("SELECT key FROM user_activity.consumer_idempotency_marks"
                       ).fetchall() == [(key,)]
    assert fdb.execute("SELECT count(*) FROM user_activity.outbox").fetchone() == (1,)


def test_only_one_maintenance_run_at_a_time(
    fdb: psycopg.Connection[Any], fresh: str, days: Days
) -> None:
    with psycopg.connect(fresh, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MAINTENANCE_KEY,))
        try:
            report = maintain(fdb, RETENTION_DAYS, today=days.expired)
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (MAINTENANCE_KEY,))

    assert not report.ran
    assert f"consumer_idempotency_marks_p{_day(days.migrated)}" in partitions(
        fdb, "consumer_idempotency_marks")


def test_expired_rows_in_a_default_partition_are_deleted(
    fdb: psycopg.Connection[Any], days: Days
) -> None:
    far = days.migrated + timedelta(days=30)  # a day that had no partition: the DEFAULT one
    key = _mark(fdb, far)
    _outbox(fdb, far)
    _deliver_everything(fdb)

    report = maintain(fdb, RETENTION_DAYS, today=far + timedelta(days=RETENTION_DAYS + 1))

    assert report.deleted_rows == 2
    assert fdb.execute("SELECT count(*) FROM user_activity.consumer_idempotency_marks"
                       " WHERE key = %s", (key,)).fetchone() == (0,)
    assert fdb.execute("SELECT count(*) FROM user_activity.outbox").fetchone() == (0,)


def test_late_conflict_records_older_than_the_retention_are_deleted(
    fdb: psycopg.Connection[Any], days: Days
) -> None:
    # One row per late sign-in, kept for ever: a replay of late sign-ins with fresh MessageIds
    # (or a hostile producer) grew the table without end.
    today = days.migrated + timedelta(days=30)
    ages = {"expired": RETENTION_DAYS + 1, "kept": RETENTION_DAYS - 1}
    ids = {name: uuid.uuid4() for name in ages}
    for name, age in ages.items():
        detected = _at(today - timedelta(days=age))
        fdb.execute(
            "INSERT INTO user_activity.sign_in_conflicts (message_id, anonymous_id, session_id,"
            " session_user_id, sign_in_user_id, signed_in_at, device_last_signed_in_at, reason,"
            " detected_at) VALUES (%s, %s, %s, %s, %s, %s, %s, 'would-relink', %s)",
            (ids[name], uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), detected,
             detected + timedelta(seconds=1), detected))

    report = maintain(fdb, RETENTION_DAYS, today=today)

    assert report.deleted_rows == 1
    assert fdb.execute("SELECT message_id FROM user_activity.sign_in_conflicts").fetchall() == [
        (ids["kept"],)]


def test_writes_go_on_while_partitions_are_dropped(
    fdb: psycopg.Connection[Any], fresh: str, days: Days
) -> None:
    _deliver_everything(fdb)
    stop = threading.Event()
    written: list[str] = []

    def write() -> None:
        with psycopg.connect(fresh, autocommit=True) as writer:
            while not stop.is_set():
                key = f"retention-live:{uuid.uuid4()}"
                writer.execute("INSERT INTO user_activity.consumer_idempotency_marks (key)"
                               " VALUES (%s)", (key,))
                written.append(key)

    thread = threading.Thread(target=write)
    thread.start()
    try:
        report = maintain(fdb, RETENTION_DAYS, today=days.expired)
    finally:
        stop.set()
        thread.join(10)

    assert f"consumer_idempotency_marks_p{_day(days.migrated)}" in report.dropped
    assert written


def test_the_census_counts_expired_partitions_kept_and_the_days_ready(
    fdb: psycopg.Connection[Any], days: Days,
) -> None:
    # Storage that stopped being bounded (a partition kept for unpublished rows, drops that
    # failed, a CronJob that never ran) was said only by warning lines: no gauge, no alert.
    _outbox(fdb, days.migrated)  # committed, not yet behind the watermark: its partition stays
    maintain(fdb, RETENTION_DAYS, today=days.expired)

    counted = storage_census(fdb, RETENTION_DAYS, today=days.expired)

    ready = PARTITIONS_AHEAD_DAYS + 1
    assert counted == {"consumer_idempotency_marks": PartitionCensus(expired=0, days_ready=ready),
                       "outbox": PartitionCensus(expired=1, days_ready=ready)}
    later = days.expired + timedelta(days=PARTITIONS_AHEAD_DAYS + 1)  # no run since: no partition
    assert storage_census(fdb, RETENTION_DAYS, today=later)["outbox"].days_ready == 0


def test_the_jobs_maintenance_exports_the_census_after_each_run(
    fdb: psycopg.Connection[Any], fresh: str,
) -> None:
    today = datetime.now(UTC).date()
    old = today - timedelta(days=RETENTION_DAYS + 5)
    fdb.execute("SELECT user_activity.ensure_daily_partitions(%s, %s)", (old, old))
    _outbox(fdb, old)  # unpublished: the job's run keeps its partition
    settings = Settings(database_url=fresh, kafka_bootstrap_servers="127.0.0.1:9",
                        retention_days=RETENTION_DAYS)

    report = run_maintenance(settings)  # as the job's housekeeping runs it, hourly

    def gauge(name: str, table: str) -> float | None:
        return REGISTRY.get_sample_value(f"user_activity_storage_{name}", {"table": table})

    assert report.ran and report.census["outbox"].expired == 1
    assert gauge("expired_partitions", "outbox") == 1
    assert gauge("expired_partitions", "consumer_idempotency_marks") == 0  # dropped
    assert gauge("partition_days_ready", "outbox") == PARTITIONS_AHEAD_DAYS + 1
    assert gauge("partition_days_ready", "consumer_idempotency_marks") == PARTITIONS_AHEAD_DAYS + 1
