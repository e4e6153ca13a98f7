"""Parked outbox rows (parked, requeue), and the stream's progress (adopt-watermark).

``adopt-watermark``: Kafka has no progress of the outbox stream (an upgrade from a release
without transactions, the progress topic lost) while a publisher moved the PostgreSQL
watermark, so the publisher publishes nothing. This commits the watermark as the stream's
progress: rows after it that an earlier publisher had sent are sent again, once (at least once
for that one window); every later row exactly once.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.outbox import parked_rows, requeue_parked
from sinks.outbox.lease import LEASE_KEY
from sinks.outbox.sql import query
from sinks.outbox.stream import TransactionalStream
from sinks.outbox.table import read_cache

LEASE_WAIT_SECONDS = 30.0
"""A publisher without progress gives the lease up after each attempt; one keeping it publishes."""


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``parked``, ``requeue --id ID | --all`` or ``adopt-watermark``; the exit code."""
    with psycopg.connect(settings.database_dsn(), application_name="user-activity-outbox",
                         autocommit=True, connect_timeout=10,
                         **settings.database_tcp_options()) as conn:
        if args.outbox_command == "adopt-watermark":
            return _adopt(conn, settings)
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


def _adopt(conn: psycopg.Connection[tuple[object, ...]], settings: Settings) -> int:
    """Under the outbox lease, so no publisher is between opening the stream and reading it."""
    if not _lease_taken(conn, LEASE_WAIT_SECONDS):
        print(f"user-activity outbox adopt-watermark: a publisher held the outbox lease for"
              f" {LEASE_WAIT_SECONDS:.0f} s, so it publishes (Kafka has its progress): nothing"
              " adopted")
        return 2
    stream = TransactionalStream(settings, stopping=Shutdown())
    try:
        found = stream.open()  # fences any producer of the stream
        if found is not None:
            print(f"the outbox stream {settings.outbox_transactional_id} has its progress in"
                  f" {settings.topic_outbox_progress} already: nothing adopted")
            return 0
        cache = read_cache(conn).progress
        attempt = stream.publish([], cache)
        if not attempt.committed:
            print(f"user-activity outbox adopt-watermark: Kafka refused the progress record"
                  f" ({attempt.error.name() if attempt.error else 'refused'})")
            return 2
    finally:
        stream.close()
    print(f"adopted the PostgreSQL watermark {cache.delivered} as the progress of"
          f" {settings.outbox_transactional_id}: rows after it that an earlier publisher sent"
          " are sent again (at least once for that one window); every later row exactly once")
    return 0


def _lease_taken(conn: psycopg.Connection[tuple[object, ...]], seconds: float) -> bool:
    """The outbox lease held by this session (released when it ends), tried for ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        row = conn.execute(query("take_lease"), (LEASE_KEY,)).fetchone()
        if row is not None and row[0]:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
