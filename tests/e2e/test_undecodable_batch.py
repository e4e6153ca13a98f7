"""The real job meets a record batch it cannot decompress: it skips it, says so and reads on.

A favorites producer sends one record of 20 MB of zeros (zstd: a few KB on the wire, so the
broker accepts it) between valid favorites, on one partition. The job reads batches of at most
``source_receive_max_bytes`` = 5 MB decompressed; librdkafka refuses that batch and would fetch
it again forever. Every valid favorite before and after it must be recorded and published
once, the skipped record counted and logged at ERROR, and the job keep running.
"""

from __future__ import annotations

import time
import uuid

import orjson
import psycopg
import pytest

from devenv.harness.jobs import JobSupervisor
from devenv.harness.messages import favorite_envelope, new_id
from devenv.harness.sessions import insert_session
from tests.conftest import SettingsFactory
from tests.support import Produced, consume_all, produce

pytestmark = pytest.mark.e2e

UNDECODABLE = "user_activity_input_records_undecodable_total"


def test_the_job_skips_an_undecodable_batch_and_records_every_favorite_around_it(
    make_settings: SettingsFactory, database_url: str, db: psycopg.Connection[object],
    jobs: JobSupervisor,
) -> None:
    settings = make_settings(source_receive_max_bytes=5_000_000)
    topic = settings.topic_favorite_added
    device = new_id()
    insert_session(db, anonymous_id=device)
    ids = [new_id() for _ in range(6)]

    def favorites(chosen: list[uuid.UUID]) -> list[Produced]:
        return [Produced(topic, b"k", orjson.dumps(favorite_envelope(
            message_id=m, anonymous_id=device)), partition=0) for m in chosen]

    job = jobs.job(settings)
    job.start()
    produce(settings, favorites(ids[:3]))  # offsets 0-2
    produce(settings, [Produced(topic, b"k", bytes(20_000_000), partition=0)],  # offset 3
            compression_type="zstd", message_max_bytes=100_000_000)
    produce(settings, favorites(ids[3:]))  # offsets 4-6

    def recorded() -> int:
        with psycopg.connect(database_url) as conn:
            row = conn.execute("SELECT count(*) FROM user_activity.action_events"
                               " WHERE source_message_id = ANY(%s)", (ids,)).fetchone()
        return int(row[0]) if row else 0

    job.wait_until(lambda: recorded() == 6, 60, "every favorite around the batch recorded")
    tracked = consume_all(settings, settings.topic_action_tracked, expect_at_least=6,
                          timeout=30, settle=2.0)
    assert len(tracked) == 6
    assert len({m.json()["AggregateId"] for m in tracked}) == 6
    skipped = [v for k, v in job.metrics().items()
               if k.startswith(UNDECODABLE) and f'topic="{topic}"' in k]
    assert skipped == [1.0]
    [line] = [e for e in job.log_events() if e.get("event") == "input-records-undecodable"]
    assert (line["level"], line["from_offset"], line["to_offset"]) == ("ERROR", 3, 4)
    time.sleep(1)
    assert job.running
