"""Guarded reading of a partition (:mod:`sources.guarded_read`), on the real broker.

The start count kept in the consumer group, and a reader whose capped children meet a gzip
bomb: every other record is handed over once and in order, the bomb's batch is skipped.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from runtime.backoff import Backoff
from sources.guarded_read import GuardedReader, count_start, start_count
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def test_the_start_count_grows_at_one_offset_and_ends_with_progress(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    topic = settings.topic_favorite_added
    consumer = Consumer({**settings.kafka_client_config(), "group.id": f"{topic}.group"})
    try:
        assert [count_start(consumer, topic, 0, 5) for _ in range(3)] == [1, 2, 3]
        assert count_start(consumer, topic, 1, 5) == 1  # counted per partition
        # a snapshot's informational commit (no metadata) ends the count
        consumer.commit(offsets=[TopicPartition(topic, 0, 9)], asynchronous=False)
        assert count_start(consumer, topic, 0, 9) == 1
        assert count_start(consumer, topic, 0, 12) == 1  # another offset: counted anew
    finally:
        consumer.close()
    assert [start_count(m) for m in (None, "", "ua-starts=4", "ua-starts=x", "other")] == [
        0, 0, 4, 0, 0]


def _read_all(reader: GuardedReader, timeout: float = 90) -> list[int]:
    offsets: list[int] = []
    deadline = time.monotonic() + timeout
    while not reader.done:
        assert time.monotonic() < deadline, f"read {offsets}, next {reader.next_offset}"
        offsets += [record[0] for record in reader.poll(100)]
        time.sleep(0.05)
    return offsets


def test_a_reader_hands_over_every_record_in_order_and_skips_the_bomb_alone(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    topic = settings.topic_favorite_added
    config = settings.kafka_client_config()

    def records(first: int, count: int) -> list[Produced]:
        return [Produced(topic, b"k", b'{"n": %d}' % n, partition=0)
                for n in range(first, first + count)]

    produce(settings, records(0, 3))  # offsets 0-2
    bomb = Producer({**config, "compression.type": "gzip", "linger.ms": 0,
                     "message.max.bytes": 1_000_000_000})
    bomb.produce(topic, value=bytes(300_000_000), partition=0)  # offset 3
    assert bomb.flush(60) == 0
    produce(settings, records(4, 40))  # offsets 4-43, in batches of several records

    skipped: list[tuple[int, int, str]] = []
    undecodable: list[Any] = []
    reader = GuardedReader(config, topic, 0, start=0, until=44, cap_bytes=96 * 2**20,
                           backoff=Backoff(), skipped=lambda *a: skipped.append(a),
                           undecodable=lambda *a: undecodable.append(a))
    try:
        offsets = _read_all(reader)
    finally:
        reader.close()

    assert offsets == [0, 1, 2, *range(4, 44)]
    assert [(first, end) for first, end, _ in skipped] == [(3, 4)]
    assert "within 96 MiB" in skipped[0][2]
    assert not undecodable
    assert reader.next_offset == 44


def test_a_cap_no_child_can_live_under_skips_nothing(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """Children that die whatever they read are no bomb: the reader retries and skips nothing.

    Without the control child, every probe dying would have made the whole range "the bomb".
    """
    settings = make_settings()
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(3)])
    skipped: list[Any] = []
    reader = GuardedReader(settings.kafka_client_config(), topic, 0, start=0, until=3,
                           cap_bytes=8 * 2**20, backoff=Backoff(initial=0.2, maximum=0.5),
                           skipped=lambda *a: skipped.append(a), undecodable=lambda *a: None)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not [
                r for r in caplog.records if r.getMessage() == "input-guarded-read-retry"
                and "cannot run within 8 MiB" in r.reason]:  # type: ignore[attr-defined]
            assert reader.poll(100) == []
            time.sleep(0.1)
    finally:
        reader.close()
    assert not skipped
    assert reader.next_offset == 0
    assert [r for r in caplog.records if r.getMessage() == "input-guarded-read-retry"]


def test_a_child_waits_for_the_job_instead_of_piling_the_backlog_up_in_memory(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"k", b'{"n": %d}' % n + b" " * 200, partition=0)
                       for n in range(20_000)])
    reader = GuardedReader(settings.kafka_client_config(), topic, 0, start=0, until=20_000,
                           cap_bytes=256 * 2**20, backoff=Backoff(), skipped=lambda *a: None,
                           undecodable=lambda *a: None)
    try:
        first = reader.poll(10)  # starts the child
        time.sleep(3)  # the job takes nothing for a while
        child = reader._child  # the bound under test
        assert child is not None
        assert child.frames.qsize() <= 8
        assert child.proc.poll() is None  # blocked on its pipe, not done reading
        offsets = [record[0] for record in first] + _read_all(reader)
    finally:
        reader.close()
    assert offsets == list(range(20_000))


def test_small_batches_are_read_one_fetch_after_another_not_one_a_second(
    make_settings: SettingsFactory,
) -> None:
    """A guarded partition of small batches (a .NET producer's at a low rate) is read on.

    A fetch of one batch leaves librdkafka's fetch queue at its threshold
    (``queued.min.messages`` 1), and librdkafka then waits ``fetch.queue.backoff.ms``
    (1000 ms by default) before the next fetch: one batch a second. Measured before the fix:
    20 records in 20 s with one record a batch, so a backlog of a million small batches behind
    a crash loop would have taken eleven days; after it, 5,000 in 2.1 s. 300 batches here:
    about 300 s before, well under a second after; the bound leaves the noise of a busy CI
    machine room.
    """
    settings = make_settings()
    topic = settings.topic_favorite_added
    config = settings.kafka_client_config()
    single = Producer({**config, "linger.ms": 0, "acks": "all"})
    for n in range(300):
        single.produce(topic, b'{"n": %d}' % n, b"k", partition=0)
        assert single.flush(30) == 0  # one record, one batch
    reader = GuardedReader(config, topic, 0, start=0, until=300, cap_bytes=256 * 2**20,
                           backoff=Backoff(), skipped=lambda *a: None,
                           undecodable=lambda *a: None)
    try:
        offsets = _read_all(reader, timeout=60)  # asserts the bound
    finally:
        reader.close()
    assert offsets == list(range(300))
