"""A consumer that stopped fetching (librdkafka#5153) is one line and a restart (real broker).

After a broker restart librdkafka can leave an assigned partition that fetches nothing more,
with no error. The fault is put in place here by pausing the partition's real consumer: records
then wait on the broker, none arrive, no error comes, the state the bug leaves. The restart
(exit 75) makes a new consumer at the snapshot. ``stuck_after`` is 2 s here (30 s deployed).
"""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Producer, TopicPartition

from runtime.process import Process
from schemas.kafka_record import SourceRecord
from sources.kafka_input import KafkaInput, _KafkaPartition
from tests.conftest import SettingsFactory
from tests.support import Produced, produce

pytestmark = pytest.mark.integration


def _process(restarts: list[str], *, stop: bool = False) -> Process:
    """A process whose restart requests are recorded (and stop it, if ``stop``), no exit 75."""
    process = Process()

    def restart(reason: str) -> None:
        restarts.append(reason)
        if stop:
            process.stopping.request(reason)

    process.stopping.restart = restart  # type: ignore[method-assign]
    return process


def _read(part: object, until: int, seconds: float) -> list[int]:
    offsets: list[int] = []
    deadline = time.monotonic() + seconds
    while len(offsets) < until and time.monotonic() < deadline:
        offsets += [i.offset for i in part.next_batch() if isinstance(i, SourceRecord)]  # type: ignore[attr-defined]
        time.sleep(0.02)
    return offsets


def test_a_partition_whose_consumer_stopped_fetching_asks_for_a_restart_once(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    retries: list[int] = []
    restarts: list[str] = []
    part = KafkaInput(settings.kafka_client_config(), topic,
                      process=_process(restarts, stop=True), tail=True, batch_size=50,
                      stuck_after=2.0,
                      count_retry=lambda: retries.append(1)).build_part("input", f"{topic}#0", None)
    assert isinstance(part, _KafkaPartition)
    try:
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(30)])
        assert _read(part, 30, 30) == list(range(30))
        part._consumer.pause([TopicPartition(topic, 0)])  # the fault: nothing more, no error
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(40)])
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.WARNING, logger="sources.kafka_input"), \
                pytest.raises(StopIteration):  # the stop the restart asks for
            while True:
                assert time.monotonic() < deadline, "the stuck consumer was not seen"
                assert _read(part, 1, 0.1) == []
        assert restarts == [f"the consumer of {topic}[0] stopped fetching (librdkafka#5153)"]
        [line] = [r for r in caplog.records if r.getMessage() == "kafka-consumer-stuck"]
        assert (line.next_offset, line.high_watermark) == (30, 70)  # type: ignore[attr-defined]
        assert line.levelno == logging.ERROR and retries == [1]
        assert part.snapshot() == 30  # the restart reads on from here: nothing skipped
    finally:
        part.close()


def test_an_idle_caught_up_partition_keeps_its_consumer(make_settings: SettingsFactory) -> None:
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    retries: list[int] = []
    restarts: list[str] = []
    part = KafkaInput(settings.kafka_client_config(), topic, process=_process(restarts),
                      tail=True, stuck_after=2.0,
                      count_retry=lambda: retries.append(1)).build_part(
        "input", f"{topic}#0", None)
    try:
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(5)])
        assert _read(part, 5, 30) == list(range(5))
        _read(part, 1, 7.0)  # three stuck checks' worth of idle polls: caught up each time
        assert retries == [] and restarts == []
    finally:
        part.close()


def test_records_behind_a_transaction_open_upstream_keep_the_consumer_and_are_said_once(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    """A transaction that neither commits nor aborts holds ``read_committed`` consumers back.

    That is no stall of ours (a restart would not cure it): no restart, one WARNING names the
    last stable offset and the high watermark, and once the transaction aborts the records
    after it are read, each once, and the end is said.
    """
    settings = make_settings(tail=True)
    topic = settings.topic_favorite_added
    retries: list[int] = []
    restarts: list[str] = []
    part = KafkaInput(settings.kafka_client_config(), topic, process=_process(restarts),
                      tail=True, batch_size=50,
                      stuck_after=1.0, count_retry=lambda: retries.append(1)).build_part(
        "input", f"{topic}#0", None)
    upstream = Producer({**settings.kafka_client_config(), "transactional.id": f"{topic}-tx",
                         "transaction.timeout.ms": 600_000})
    try:
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(5)])
        assert _read(part, 5, 30) == list(range(5))
        # a first fetch slower than stuck_after (a loaded machine) asks for a restart then,
        # rightly: what counts is what happens from here on
        retries_before, restarts_before = len(retries), len(restarts)
        upstream.init_transactions(30)
        upstream.begin_transaction()
        upstream.produce(topic, b"{}", key=b"k", partition=0)  # offset 5, left open
        upstream.flush(30)
        produce(settings, [Produced(topic, b"k", b"{}", partition=0) for _ in range(4)])  # 6-9
        with caplog.at_level(logging.INFO, logger="sources.kafka_input"):
            assert _read(part, 1, 5.0) == []  # four stuck checks' worth: held back, not stuck
            assert (len(retries), len(restarts)) == (retries_before, restarts_before)
            said = [r for r in caplog.records if r.getMessage() == "input-behind-open-transaction"]
            assert len(said) == 1
            assert (said[0].next_offset, said[0].last_stable_offset,  # type: ignore[attr-defined]
                    said[0].high_watermark) == (5, 5, 10)  # type: ignore[attr-defined]
            upstream.abort_transaction(30)
            assert _read(part, 4, 30) == [6, 7, 8, 9]
            ended = [r for r in caplog.records if r.getMessage() == "input-open-transaction-ended"]
            assert len(ended) == 1
            assert (len(retries), len(restarts)) == (retries_before, restarts_before)
    finally:
        part.close()
