"""The start counter and the careful reader (:mod:`sources.careful`), on a real broker.

The bomb itself is in ``e2e/test_decompression_bomb.py``; here the deaths it causes are
played by the committed offsets and counts a dying start leaves behind.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import REGISTRY

from runtime.process import Process
from schemas.kafka_record import SourceRecord
from sources.careful import CarefulReader, count_start, parse
from sources.kafka_input import KafkaInput, StartPosition, _KafkaPartition
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def _group_consumer(settings: Any, group: str) -> Consumer:
    return Consumer({**settings.kafka_client_config(), "group.id": group,
                     "enable.auto.commit": False})


def _committed(consumer: Consumer, topic: str, partition: int = 0) -> tuple[int, int, int]:
    """(offset, starts, careful fetches) the group holds for ``topic[partition]``."""
    [tp] = consumer.committed([TopicPartition(topic, partition)], timeout=10)
    return (tp.offset, *parse(tp.metadata))


def test_the_start_count_grows_at_one_offset_follows_a_careful_fetch_and_ends_with_progress(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings()
    topic = settings.topic_favorite_added
    consumer = _group_consumer(settings, f"{topic}.group")
    try:
        assert [count_start(consumer, topic, 0, 5) for _ in range(3)] == [
            (1, 5, 0), (2, 5, 0), (3, 5, 0)]
        assert count_start(consumer, topic, 1, 5) == (1, 5, 0)  # counted per partition
        # a careful start died fetching offset 9: its mark is kept by the starts after it
        consumer.commit(offsets=[TopicPartition(topic, 0, 9, metadata="ua-starts=2;fetching=1")],
                        asynchronous=False)
        assert count_start(consumer, topic, 0, 5) == (3, 9, 1)
        assert count_start(consumer, topic, 0, 5) == (4, 9, 1)
        # a snapshot's informational commit (no metadata) ends the count
        consumer.commit(offsets=[TopicPartition(topic, 0, 12)], asynchronous=False)
        assert count_start(consumer, topic, 0, 12) == (1, 12, 0)
    finally:
        consumer.close()
    assert [parse(m) for m in (None, "", "ua-starts=4", "ua-starts=2;fetching=1", "x", "fetching=3")
            ] == [(0, 0), (0, 0), (4, 0), (2, 1), (0, 0), (0, 0)]


def test_a_careful_reader_reads_one_batch_a_fetch_each_once_its_offset_is_on_record(
    make_settings: SettingsFactory,
) -> None:
    """300 batches of one record (a .NET producer at a low rate): each read once, in order.

    Before each fetch the next offset is committed with the count: what a death leaves.
    Without ``fetch.queue.backoff.ms`` 0, librdkafka waited a second per batch; a poll gathers
    batches (here ``limit`` 1: one batch a take).
    """
    settings = make_settings()
    topic = settings.topic_favorite_added
    group = f"{topic}.careful"
    single = Producer({**settings.kafka_client_config(), "linger.ms": 0})
    for n in range(300):
        single.produce(topic, b'{"n": %d}' % n, b"k", partition=0)
        assert single.flush(30) == 0  # one record, one batch
    config = {**settings.kafka_client_config(), "group.id": group, "enable.auto.commit": False}
    reader = CarefulReader(config, topic, 0, starts=2, at=0, fetching=0, until=300)
    watcher = _group_consumer(settings, group)
    offsets: list[int] = []
    deadline = time.monotonic() + 60
    try:
        while len(offsets) < 300:
            assert time.monotonic() < deadline, f"read {len(offsets)}"
            batch = reader.take(offsets[-1] + 1 if offsets else 0, limit=1)
            if batch:
                assert len(batch) == 1, "one batch per fetch"
                # on record before it was fetched (its mark cleared once read, asynchronously)
                assert _committed(watcher, topic)[:2] == (batch[0].offset(), 2)
            offsets += [m.offset() or 0 for m in batch]
    finally:
        reader.close()
        watcher.close()
    assert offsets == list(range(300))


def _undecodable(topic: str) -> float:
    return REGISTRY.get_sample_value("user_activity_input_records_undecodable_total",
                                     {"topic": topic, "partition": "0"}) or 0.0


def test_after_two_careful_starts_died_fetching_one_offset_the_next_skips_its_record(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """Offsets 0-9; the 2nd and 3rd starts died fetching offset 4 (the group's mark).

    The 4th start reads 0-3, skips 4 (counted, logged), reads 5-9, then joins the worker's
    consumer; its clean commit ends the count.
    """
    caplog.set_level(logging.INFO, logger="sources.kafka_input")
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    group = f"{topic}.{uuid.uuid4().hex[:6]}"
    for _ in range(10):  # a batch each: where a careful start dies is a batch's start
        produce(settings, [Produced(topic, b"k", b"{}", partition=0)])
    watcher = _group_consumer(settings, group)
    watcher.commit(offsets=[TopicPartition(topic, 0, 4, metadata="ua-starts=3;fetching=2")],
                   asynchronous=False)
    before = _undecodable(topic)
    part = KafkaInput(settings.kafka_client_config(), topic, process=Process(), tail=True,
                      consumer_group=group).build_part("input", f"{topic}#0", 0)
    offsets: list[int] = []
    try:
        assert isinstance(part, _KafkaPartition) and part._careful is not None
        deadline = time.monotonic() + 30
        while part._careful is not None:
            assert time.monotonic() < deadline, f"read {offsets}"
            offsets += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]
        produce(settings, [Produced(topic, b"k", b"{}", partition=0)])  # the shared consumer's
        while len(offsets) < 10:
            assert time.monotonic() < deadline, f"read {offsets}"
            offsets += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]
        deadline = time.monotonic() + 10
        while _committed(watcher, topic) != (10, 0, 0):
            assert time.monotonic() < deadline, _committed(watcher, topic)
            part.next_batch()  # serves the commit's callback
            time.sleep(0.1)
    finally:
        part.close()
        watcher.close()
    assert offsets == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert _undecodable(topic) - before == 1
    events = {r.getMessage(): r for r in caplog.records}
    careful = events["input-partition-careful"]
    assert (careful.starts, careful.died_at, careful.deaths) == (4, 4, 2)
    skipped = events["input-records-undecodable"]
    assert (skipped.from_offset, skipped.to_offset) == (4, 5)
    assert events["input-partition-careful-done"].next_offset == 10


def test_careful_partitions_of_a_process_take_turns_so_only_one_leaves_a_mark(
    make_settings: SettingsFactory,
) -> None:
    """Two partitions whose last start ended unclean: one reads carefully, the other waits.

    A death now leaves a fetch mark on the partition being read only; the waiting one holds
    its start count alone, so no later start takes its offset for a death spot.
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    group = f"{topic}.{uuid.uuid4().hex[:6]}"
    for p in (0, 1):
        for _ in range(5):
            produce(settings, [Produced(topic, b"k", b"{}", partition=p)])
    watcher = _group_consumer(settings, group)
    watcher.commit(offsets=[TopicPartition(topic, p, 0, metadata="ua-starts=1") for p in (0, 1)],
                   asynchronous=False)
    source = KafkaInput(settings.kafka_client_config(), topic, process=Process(), tail=True,
                        consumer_group=group, batch_size=1)  # a record a poll: turns show
    parts = [source.build_part("input", f"{topic}#{p}", 0) for p in (0, 1)]
    read: dict[int, list[int]] = {0: [], 1: []}
    try:
        assert all(isinstance(part, _KafkaPartition) and part._careful is not None
                   for part in parts)
        deadline = time.monotonic() + 30
        while len(read[0]) + len(read[1]) < 2:
            assert time.monotonic() < deadline, read
            for p, part in enumerate(parts):
                read[p] += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]
        reading = 0 if read[0] else 1
        assert read[1 - reading] == [], "both read carefully at once"
        assert _committed(watcher, topic, 1 - reading) == (0, 2, 0)  # waits: no mark
        while len(read[0]) + len(read[1]) < 10:
            assert time.monotonic() < deadline, read
            for p, part in enumerate(parts):
                read[p] += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]
    finally:
        for part in parts:
            part.close()
        watcher.close()
    assert read == {0: list(range(5)), 1: list(range(5))}


def test_a_partition_without_a_snapshot_starts_at_the_named_groups_committed_offset(
    make_settings: SettingsFactory,
) -> None:
    """Cutover: partition 0 at the old consumer's offset 7.

    Partition 1, where it committed nothing, at the fallback (here earliest).
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    produce(settings, [Produced(topic, b"k", b"{}", partition=p)
                       for p in (0, 1) for _ in range(10)])
    legacy = f"legacy-{uuid.uuid4().hex[:6]}"
    old = _group_consumer(settings, legacy)
    old.commit(offsets=[TopicPartition(topic, 0, 7)], asynchronous=False)
    old.close()
    source = KafkaInput(settings.kafka_client_config(), topic, process=Process(), tail=True,
                        start=StartPosition(group=legacy))
    assert len(source.list_parts()) == 6
    parts = [source.build_part("input", f"{topic}#{p}", None) for p in (0, 1)]
    read: dict[int, list[int]] = {0: [], 1: []}
    deadline = time.monotonic() + 30
    try:
        while len(read[0]) < 3 or len(read[1]) < 10:
            assert time.monotonic() < deadline, read
            for p, part in enumerate(parts):
                read[p] += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]
    finally:
        for part in parts:
            part.close()
    assert read == {0: [7, 8, 9], 1: list(range(10))}
