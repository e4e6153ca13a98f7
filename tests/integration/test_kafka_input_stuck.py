"""The Kafka source heals a consumer that stopped fetching (librdkafka#5153), on a real broker.

After a broker restart librdkafka can leave an assigned partition that fetches nothing more,
with no error. The fault is put in place here by pausing the partition's real consumer: records
then wait on the broker, none arrive, no error comes, the state the bug leaves. ``stuck_after``
is 2 s here, longer than a first fetch takes (the default is 30 s).
"""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Producer, TopicPartition

from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def _read(part: object, until: int, seconds: float) -> list[int]:
    offsets: list[int] = []
    deadline = time.monotonic() + seconds
    while len(offsets) < until and time.monotonic() < deadline:
        offsets += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]  # type: ignore[attr-defined]
        time.sleep(0.02)
    return offsets


def test_a_partition_whose_consumer_stopped_fetching_gets_a_new_one_and_reads_on_exactly(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    retries: list[int] = []
    part = KafkaInput(settings.kafka_client_config(), topic, tail=True, batch_size=50,
                      stuck_after=2.0, count_retry=lambda: retries.append(1)).build_part(
        "input", f"{topic}#0", None)
    try:
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(30)])
        assert _read(part, 30, 30) == list(range(30))
        stuck = part._consumer
        stuck.pause([TopicPartition(topic, 0)])  # the fault: fetches nothing more, no error
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(40)])
        with caplog.at_level(logging.WARNING, logger="sources.kafka_input"):
            offsets = _read(part, 40, 30)
        assert offsets == list(range(30, 70)), "skipped or read twice"
        assert part._consumer is not stuck
        restarts = [r for r in caplog.records if r.getMessage() == "kafka-consumer-restarted"]
        assert len(restarts) == 1 and retries == [1]
        assert restarts[0].next_offset == 30 and restarts[0].high_watermark == 70  # type: ignore[attr-defined]
    finally:
        part.close()


def test_an_idle_caught_up_partition_keeps_its_consumer(make_settings: SettingsFactory) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    retries: list[int] = []
    part = KafkaInput(settings.kafka_client_config(), topic, tail=True, stuck_after=2.0,
                      count_retry=lambda: retries.append(1)).build_part(
        "input", f"{topic}#0", None)
    try:
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(5)])
        assert _read(part, 5, 30) == list(range(5))
        consumer = part._consumer
        _read(part, 1, 7.0)  # three stuck checks' worth of idle polls: caught up each time
        assert part._consumer is consumer and retries == []
    finally:
        part.close()


def test_records_behind_a_transaction_open_upstream_keep_the_consumer_and_are_said_once(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """A transaction that neither commits nor aborts holds ``read_committed`` consumers back.

    That is no stall of ours: the consumer is kept (before, the docstring expected it replaced
    every ``stuck_after``), the partition is not said behind (the backlog signal), one WARNING
    names the last stable offset and the high watermark, and once the transaction aborts
    the records after it are read, each once, and the end is said.
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    retries: list[int] = []
    part = KafkaInput(settings.kafka_client_config(), topic, tail=True, batch_size=50,
                      stuck_after=1.0, count_retry=lambda: retries.append(1)).build_part(
        "input", f"{topic}#0", None)
    upstream = Producer({**settings.kafka_client_config(), "transactional.id": f"{topic}-tx",
                         "transaction.timeout.ms": 600_000})
    try:
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(5)])
        assert _read(part, 5, 30) == list(range(5))
        # A first fetch slower than stuck_after (a loaded machine) replaces the consumer then,
        # rightly: what counts is what happens from here on.
        consumer, retries_before = part._consumer, len(retries)
        upstream.init_transactions(30)
        upstream.begin_transaction()
        upstream.produce(topic, b"{}", key=b"k", partition=0)  # offset 5, left open
        upstream.flush(30)
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(4)])  # 6-9
        with caplog.at_level(logging.INFO, logger="sources.kafka_input"):
            assert _read(part, 1, 5.0) == []  # four stuck checks' worth: held back, not stuck
            assert part._consumer is consumer and len(retries) == retries_before
            said = [r for r in caplog.records if r.getMessage() == "input-behind-open-transaction"]
            assert len(said) == 1
            assert (said[0].next_offset, said[0].last_stable_offset,  # type: ignore[attr-defined]
                    said[0].high_watermark) == (5, 5, 10)  # type: ignore[attr-defined]
            assert not part._behind(0), "said behind while nothing can be read"
            upstream.abort_transaction(30)
            assert _read(part, 4, 30) == [6, 7, 8, 9]
            ended = [r for r in caplog.records if r.getMessage() == "input-open-transaction-ended"]
            assert len(ended) == 1 and part._consumer is consumer
            assert len(retries) == retries_before
    finally:
        part.close()
