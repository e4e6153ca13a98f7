"""A decompression bomb no longer crash-loops its partition (real broker, real job).

One gzip record of 900 MB of zeros fits the topic's 1 MiB limit compressed (about 875 KB).
librdkafka inflates it whole before any record of it reaches Python, so the job dies on it at
every start, and each start resumes before it. Here the job runs with a data-segment limit
(``prlimit --data``, 640 MiB: it needs about 160 MiB), so the bomb kills it as a pod's memory
limit would, by the allocation librdkafka cannot make.

Without :mod:`sources.careful` every start died and nothing behind the bomb was ever recorded.
Now the second and third starts read the partition one batch per fetch, each fetch's offset
committed first, and both die fetching the bomb; the fourth skips it (counted, logged): the
valid events are recorded once and the job reads on as usual.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka import Producer

from devenv.harness.jobs import JobProcess, JobSupervisor
from devenv.harness.messages import favorite_envelope
from devenv.harness.metrics import metric_sum
from devenv.harness.sessions import insert_session
from tests.conftest import SettingsFactory
from tests.support import Produced, consume_all, produce

pytestmark = pytest.mark.e2e

JOB_DATA_LIMIT = 640 * 2**20
BOMB_BYTES = 900_000_000


class CappedJob(JobProcess):
    """The job under a data-segment limit, as a pod under its memory limit."""

    def command(self) -> list[str]:
        return ["prlimit", f"--data={JOB_DATA_LIMIT}", "--", *super().command()]


def _produce_bomb(config: dict[str, Any], topic: str) -> None:
    producer = Producer({**config, "acks": "all", "compression.type": "gzip", "linger.ms": 0,
                         "message.max.bytes": 1_000_000_000, "message.timeout.ms": 120_000})
    errors: list[Any] = []
    producer.produce(topic, key=b"bomb", value=bytes(BOMB_BYTES), partition=0,
                     on_delivery=lambda err, _msg: errors.append(err) if err else None)
    assert producer.flush(120) == 0
    assert not errors, errors


def test_a_gzip_bomb_is_skipped_at_the_fourth_start_and_every_valid_event_is_recorded_once(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
    tmp_path: Path,
) -> None:
    settings = make_settings(source_receive_max_bytes=2_000_000)
    topic = settings.topic_favorite_added
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    ids = [uuid.uuid4() for _ in range(8)]

    def favorites(chosen: list[uuid.UUID]) -> list[Produced]:
        return [Produced(topic, b"k", orjson.dumps(favorite_envelope(
            message_id=m, anonymous_id=device)), partition=0) for m in chosen]

    def recorded() -> int:
        row = db.execute("SELECT count(*) FROM user_activity.action_events"
                         " WHERE source_message_id = ANY(%s)", (ids,)).fetchone()
        return int(row[0]) if row else 0

    produce(settings, favorites(ids[:3]))  # offsets 0-2
    _produce_bomb(settings.kafka_client_config(), topic)  # offset 3
    produce(settings, favorites(ids[3:6]))  # offsets 4-6

    job = CappedJob(settings, tmp_path / "job", tail=True)
    jobs.jobs.append(job)
    for start in (1, 2, 3):  # the crash loop: each start dies on the bomb
        job.start(wait_http=0)
        assert job.wait(90) is not None, f"start {start} survived the bomb"
        assert job.exit_codes[-1] != 0
        if start == 1:  # fetched with the events before it: none recorded
            assert recorded() == 0
    careful = [(e["partition"], e["starts"], e.get("died_at")) for n in (2, 3)
               for e in job.log_events(n) if e["event"] == "input-partition-careful"]
    assert careful == [(0, 2, None), (0, 3, 3)]  # the 2nd died fetching offset 3

    job.start()
    job.wait_until(lambda: recorded() == 6, 120, "the six valid events to be recorded")
    undecodable = "user_activity_input_records_undecodable_total"
    job.wait_until(lambda: metric_sum(job.metrics(), undecodable, topic=topic, partition="0") == 1,
                   30, "the bomb to be counted")
    def done() -> list[int]:
        return [e["next_offset"] for e in job.log_events(4)
                if e["event"] == "input-partition-careful-done"]

    job.wait_until(lambda: done() == [7], 30, "the partition to join the worker's consumer")
    events = job.log_events(4)
    [fourth] = [e for e in events if e["event"] == "input-partition-careful"]
    assert (fourth["starts"], fourth["died_at"], fourth["deaths"]) == (4, 3, 2)
    [skipped] = [e for e in events if e["event"] == "input-records-undecodable"]
    assert (skipped["from_offset"], skipped["to_offset"]) == (3, 4)
    assert "decompression bomb" in skipped["reason"]
    assert not any(e["event"] == "input-records-undecodable" for n in (2, 3)
                   for e in job.log_events(n))

    produce(settings, favorites(ids[6:]))  # read by the worker's shared consumer again
    job.wait_until(lambda: recorded() == 8, 60, "the events after the careful read")
    assert job.terminate() == 0
    tracked = consume_all(settings, settings.topic_action_tracked, expect_at_least=8,
                          timeout=30, settle=1)
    assert len(tracked) == 8

    job.start()  # progress and a clean stop ended the count: read as usual, nothing again
    time.sleep(3)
    assert not [e for e in job.log_events(5) if e["event"] == "input-partition-careful"]
    assert job.terminate() == 0
    assert recorded() == 8
