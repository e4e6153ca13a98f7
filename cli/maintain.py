"""One run of the maintenance step: daily partitions created ahead, expired ones dropped.

Safe at any time and from several places at once (the CronJob, the job's own periodic run): one
run at a time, idempotent; exit 0 also when another run held the lock. Its last line is the
partitions' census: expired partitions left, days ready ahead.
"""

from __future__ import annotations

import psycopg

from runtime.settings import Settings
from sinks.retention import maintain, storage_census


def run(settings: Settings) -> int:
    """Run the maintenance step once and print what it did; the exit code."""
    with psycopg.connect(settings.database_dsn(), application_name="user-activity-maintain",
                         autocommit=True, connect_timeout=10,
                         **settings.database_tcp_options()) as conn:
        report = maintain(conn, settings.retention_days)
        counted = storage_census(conn, settings.retention_days)
    if not report.ran:
        print("another maintenance run holds the lock: nothing done")
    else:
        print(f"partitions created: {report.created}; dropped: {len(report.dropped)}"
              f" ({', '.join(report.dropped) or '-'}); kept with unpublished rows:"
              f" {', '.join(report.kept) or '-'}; rows deleted: {report.deleted_rows}"
              f" (retention {settings.retention_days} days)")
    print("storage: " + "; ".join(
        f"{table}: {c.expired} expired partition(s) left, {c.days_ready} day(s) ready"
        for table, c in counted.items()))
    return 0
