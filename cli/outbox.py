"""List parked outbox rows (parked), or give them back to the publisher (requeue)."""

from __future__ import annotations

import argparse

import psycopg

from runtime.settings import Settings
from sinks.outbox_parked import parked_rows, requeue_parked


def run(args: argparse.Namespace, settings: Settings) -> int:
    """List parked rows (``parked``) or requeue them (``requeue --id ID | --all``); exit code."""
    with psycopg.connect(settings.database_dsn(), application_name="user-activity-outbox",
                         autocommit=True, connect_timeout=10,
                         **settings.database_tcp_options()) as conn:
        if args.outbox_command == "parked":
            rows = parked_rows(conn, limit=1000)
            print(f"{'id':<38}{'topic':<45}{'attempts':>9}  {'error':<24}{'parked at':<34}bytes")
            for row_id, topic, attempts, error, parked_at, size in rows:
                print(f"{row_id!s:<38}{topic:<45}{attempts:>9}  {error:<24}"
                      f"{parked_at.isoformat():<34}{size}")
            print(f"{len(rows)} parked row(s)")
            return 0
        count = requeue_parked(conn, None if args.all else args.ids)
    print(f"requeued {count} parked outbox row(s): the publisher sends them within seconds")
    return 0
