"""Retention cleanup while the job runs: expired partitions go, nothing is lost or doubled.

Old days are simulated: partitions of a day past the retention are created and filled with
marks and outbox rows dated that day (no sleeping for days). The job runs its own maintenance
every second; the operator command runs too; redeliveries and a replay within the retention
window arrive meanwhile.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from cli.replay import replay
from cli.topics import ensure_topics
from devenv.harness.env import base_env, settings_env
from devenv.harness.jobs import ROOT, JobSupervisor
from devenv.harness.stream import PacedProducer, good_stream
from sources.kafka_input import StartPosition
from tests.chaos import (
    assert_exact_outcome,
    unpublished,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory
from tests.support import Produced, consume_all, partitions, produce

pytestmark = pytest.mark.e2e

OLD_ROWS = 200


def test_cleanup_while_the_job_runs_with_redeliveries_and_a_replay_loses_and_doubles_nothing(
    make_settings: SettingsFactory, database_url: str, db: psycopg.Connection[Any],
    jobs: JobSupervisor,
) -> None:
    settings = make_settings(maintenance_interval_seconds=1, retention_days=7)
    old_topic = f"{settings.topic_action_tracked}.old"
    ensure_topics(settings.kafka_client_config(), [old_topic], 1)
    old_day = datetime.now(UTC).date() - timedelta(days=10)
    old_at = datetime(old_day.year, old_day.month, old_day.day, 12, tzinfo=UTC)
    suffix = old_day.strftime("%Y%m%d")
    db.execute("SELECT user_activity.ensure_daily_partitions(%s, %s)", (old_day, old_day))
    old_keys = [f"user-activity-favorites:AddToFavorites:{uuid.uuid4()}" for _ in range(500)]
    db.execute("INSERT INTO user_activity.consumer_idempotency_marks (key, processed_at,"
               " processed_on) SELECT k, %s, %s FROM unnest(%s::text[]) k",
               (old_at, old_day, old_keys))
    db.execute("INSERT INTO user_activity.outbox (id, topic, key, value, created_at)"
               " SELECT gen_random_uuid(), %s, convert_to(i::text, 'UTF8'), '\\x7b7d', %s"
               "   FROM generate_series(1, %s) i", (old_topic, old_at, OLD_ROWS))
    assert f"outbox_p{suffix}" in partitions(db, "outbox")

    stream = good_stream(settings, database_url, 3_000, seed=16)
    job = jobs.job(settings, tail=True)
    job.start()
    producer = PacedProducer(settings, stream.records, rate=600)
    producer.start()
    wait_for_rows(job, database_url, stream, 600, timeout=60)

    env = {**base_env(), **settings_env(settings)}
    maintained = subprocess.run([sys.executable, "-m", "cli", "maintain"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60, check=False)
    assert maintained.returncode == 0, maintained.stderr
    # Redeliveries of the first 1,000 records (already recorded, or racing the job) ...
    produce(settings, [Produced(r.topic, r.key, r.value, r.headers)
                       for r in stream.records[:1_000]])
    # ... and, once the whole stream is on the topic (the replay's range ends at the offsets it
    # finds when it starts), a replay from the beginning, inside the retention window, while the
    # job runs.
    deliveries = producer.result()
    replayed = replay(settings, StartPosition(timestamp_ms=0), out=io.StringIO())
    wait_until_drained(job, database_url, stream)
    job.wait_until(lambda: unpublished(database_url, old_topic) == 0, 30, "the old rows sent")
    job.wait_until(lambda: f"outbox_p{suffix}" not in partitions(db, "outbox"), 30,
                   "the job's maintenance to drop the expired outbox partition")
    # ... and its census says storage is bounded again (the alerts' gauges)
    job.wait_until(lambda: job.metric('user_activity_storage_expired_partitions{table="outbox"}',
                                      -1) == 0, 30, "the census to count no expired partition")
    assert job.metric('user_activity_storage_partition_days_ready{table="outbox"}') == 4
    code = job.terminate()

    assert code == 0, job.log_tail()
    assert "partitions created" in maintained.stdout or "holds the lock" in maintained.stdout
    assert re.search(r"(?m)^storage: consumer_idempotency_marks: \d+ expired partition\(s\) left,"
                     r" 4 day\(s\) ready; outbox: \d+ expired", maintained.stdout)  # racing the job
    assert f"consumer_idempotency_marks_p{suffix}" not in partitions(
        db, "consumer_idempotency_marks")
    left = db.execute("SELECT count(*) FROM user_activity.consumer_idempotency_marks"
                      " WHERE key = ANY(%s)", (old_keys,)).fetchone()
    assert left == (0,)
    assert replayed["recorded"] + replayed["duplicate"] >= 3_000
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    good = len(stream.good_ids)
    assert counts.rows == counts.tracked_distinct == good
    assert counts.tracked_records == good  # nothing twice: one publisher, no crash
    old = consume_all(settings, old_topic, expect_at_least=OLD_ROWS, timeout=30)
    assert len(old) == OLD_ROWS
