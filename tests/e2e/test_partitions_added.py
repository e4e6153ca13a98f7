"""An input topic gains partitions while the job runs: the job restarts itself and reads them.

Bytewax lists a source's partitions once, at start; without the watch the records on the new
partitions wait, unread and missing from every lag gauge, until someone restarts the job.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewPartitions

from devenv.harness.jobs import JobSupervisor, wait_until
from devenv.harness.stream import PacedProducer, good_stream
from tests.chaos import (
    assert_exact_outcome,
    report,
    wait_for_rows,
    wait_until_drained,
)
from tests.conftest import SettingsFactory

pytestmark = pytest.mark.e2e

PARTITIONS_BEFORE, PARTITIONS_AFTER = 6, 12  # make_settings creates topics with 6


def test_partitions_added_to_an_input_topic_are_read_after_the_job_restarts_itself(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
    record_property: Any,
) -> None:
    settings = make_settings(source_partition_check_seconds=1.0)
    stream = good_stream(settings, database_url, 1_200, seed=41)
    first, second = stream.records[:600], stream.records[600:]
    job = jobs.job(settings, tail=True)
    job.start()
    before = PacedProducer(settings, first, rate=1_000)
    before.start()
    wait_for_rows(job, database_url, stream, len([r for r in first if r.message_id]), 60)

    admin = AdminClient(settings.kafka_client_config())
    topics = [settings.topic_favorite_added, settings.topic_favorite_removed]
    for future in admin.create_partitions(
            [NewPartitions(topic, PARTITIONS_AFTER) for topic in topics]).values():
        future.result(30)
    added = time.monotonic()
    # the broker applies the new partitions to its metadata after the call returns (up to half a
    # second measured on a busy machine): a producer made before that writes to 6 partitions only
    wait_until(lambda: all(len(admin.list_topics(topic, timeout=10).topics[topic].partitions)
                           == PARTITIONS_AFTER for topic in topics), 30, "12 partitions listed")
    after = PacedProducer(settings, second, rate=1_000)  # a new producer sees 12 partitions
    after.start()
    code = job.wait(60)
    stopped_s = time.monotonic() - added
    deliveries = [*before.result(), *after.result()]
    on_new = sum(1 for d in deliveries[len(first):] if d.partition >= PARTITIONS_BEFORE)
    events = job.log_events(1)
    added_events = [e for e in events if e.get("event") == "kafka-partitions-added"]

    assert code == 75, (code, job.log_tail())
    assert added_events and added_events[0]["partitions"] == PARTITIONS_AFTER
    assert added_events[0]["reading"] == PARTITIONS_BEFORE
    assert "stopped-for-restart" in {e.get("event") for e in events}
    assert on_new > 0, "no record landed on a new partition: the test would prove nothing"

    job.start()  # what the supervisor does on exit code 75
    wait_until_drained(job, database_url, stream)
    assert job.terminate() == 0
    counts = assert_exact_outcome(settings, database_url, stream, deliveries)
    assert counts.rows == counts.tracked_distinct == len(stream.good_ids)
    report(record_property, "partitions-added", {
        "stopped_after_s": round(stopped_s, 1), "records_on_new_partitions": on_new,
        "rows": counts.rows,
    })
