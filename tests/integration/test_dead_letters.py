"""The DLQ publisher on a real broker: every dead letter is written exactly once, whole or reduced.

The DLQ topics here are created by each test with the ``max.message.bytes`` it needs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]
from confluent_kafka.cimpl import NewTopic
from prometheus_client import CollectorRegistry, Counter

from devenv.harness.jobs import wait_until
from runtime.process import Process
from runtime.settings import Settings
from schemas.dlq import (
    DLQ_HEADERS,
    HEADER_ORIGINAL_SIZE,
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_TRUNCATED,
    DlqReason,
)
from schemas.dlq_letter import DeadLetter
from schemas.kafka_record import SourceRecord
from sinks.dead_letters import DEFAULT_TOPIC_LIMIT, DeadLetterPublisher
from tests.support import Consumed, consume_all, frozen

pytestmark = pytest.mark.integration

SOURCE = "pin.favorites.favorite-added.v1"
MB_1_2 = 1_200_000


def _dlq_topic(bootstrap: str, **config: str) -> str:
    name = f"dlq-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, 3, 1, config=config)]).values():
        future.result(30)
    # Created is not yet described: asked at once, the broker could still answer "unknown
    # topic", and the publisher then fell back to its default limit (seen after other tests).
    resource = ConfigResource("topic", name)

    def described() -> bool:
        try:
            admin.describe_configs([resource])[resource].result(10)
        except KafkaException:
            return False
        return True

    wait_until(described, 30, f"topic {name} described", interval=0.1)
    return name


class Dlq:
    """A publisher for one DLQ topic, its counters and a reader of what landed on it."""

    def __init__(self, bootstrap: str, **topic_config: str) -> None:
        self.settings = Settings(
            kafka_bootstrap_servers=bootstrap, retry_initial_seconds=0.2, retry_max_seconds=1.0
        )
        self.topic = _dlq_topic(bootstrap, **topic_config)
        self.registry = CollectorRegistry()
        self.publisher = DeadLetterPublisher(
            self.settings, self.topic,
            Counter("dlq", "dead letters", registry=self.registry),
            Counter("retries", "retries", registry=self.registry), name="test-dlq",
            process=Process(),
        )

    def records(self, expected: int) -> list[Consumed]:
        return consume_all(self.settings, self.topic, expect_at_least=expected, settle=2.0)

    @property
    def counted(self) -> float | None:
        return self.registry.get_sample_value("dlq_total")


def _letter(
    value: bytes | None, offset: int, key: bytes | None = b"fav-1",
    headers: tuple[tuple[str, bytes], ...] = (("traceparent", b"00-4bf92f-00f067aa-01"),),
) -> DeadLetter:
    record = SourceRecord(SOURCE, 4, offset, key, value, headers)
    return DeadLetter.now(record, DlqReason.INVALID_JSON, "JSONDecodeError", 1)


def _by_offset(records: list[Consumed]) -> dict[int, Consumed]:
    found = {int(r.header(HEADER_SOURCE_OFFSET) or b"-1"): r for r in records}
    assert len(found) == len(records), "a letter was written twice"
    return found


def _assert_reduced(got: Consumed, original: DeadLetter, limit: int) -> None:
    assert got.header(HEADER_TRUNCATED) == b"true"
    assert got.header(HEADER_ORIGINAL_SIZE) == str(len(original.record.value or b"")).encode()
    assert got.header(HEADER_SOURCE_TOPIC) == SOURCE.encode()
    assert got.header(HEADER_SOURCE_PARTITION) == b"4"
    assert got.header(HEADER_REASON) == b"invalid-json"
    assert {name for name, _ in got.headers} >= set(DLQ_HEADERS)
    assert got.value is not None and (original.record.value or b"").startswith(got.value)
    assert 0 < len(got.value) < limit


@pytest.fixture
def dlq_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, "sinks.dead_letters")
    return caplog


def _events(caplog: pytest.LogCaptureFixture, event: str) -> list[Any]:
    return [r for r in caplog.records if r.getMessage() == event]


@pytest.mark.parametrize(
    "value",
    [os.urandom(MB_1_2), b'{"MessageId": "%s", "Note": "' % uuid.uuid4().bytes.hex().encode()
     + b"a" * MB_1_2 + b'"'],
    ids=["incompressible", "compressible"],
)
def test_a_1_2_mb_value_is_dead_lettered_exactly_once_truncated_with_its_key_and_headers(
    kafka_bootstrap: str, value: bytes, dlq_logs: pytest.LogCaptureFixture
) -> None:
    dlq = Dlq(kafka_bootstrap)  # the broker's default max.message.bytes (1048588)
    letter = _letter(value, 41)

    dlq.publisher.publish([letter])

    [got] = dlq.records(1)
    assert dlq.publisher.limit == 1_048_588
    assert got.key == b"fav-1"
    assert got.header("traceparent") == b"00-4bf92f-00f067aa-01"
    _assert_reduced(got, letter, 1_048_588)
    assert dlq.counted == 1
    [reduced] = _events(dlq_logs, "dead-letter-reduced")
    assert reduced.source == f"{SOURCE}[4]@41"
    assert reduced.code == "MSG_SIZE_TOO_LARGE"


def test_seven_poison_letters_some_oversized_make_exactly_seven_dlq_records(
    kafka_bootstrap: str,
) -> None:
    dlq = Dlq(kafka_bootstrap, **{"max.message.bytes": "1000000"})
    values = {
        0: b'{"broken": ',
        1: os.urandom(MB_1_2),  # refused locally (over message.max.bytes)
        2: b"not json at all",
        3: b"a" * MB_1_2,  # compressible, still refused locally (uncompressed size)
        4: os.urandom(999_960),  # under the local check, over the topic once framed: the broker
        5: b"\xff\xfe not utf-8",
        6: b"{}",
    }
    letters = [_letter(v, offset) for offset, v in values.items()]  # one key: one partition

    dlq.publisher.publish(letters)

    got = _by_offset(dlq.records(7))
    assert sorted(got) == list(range(7))
    assert dlq.counted == 7
    for offset in (0, 2, 5, 6):  # innocent batch-mates are delivered whole
        assert got[offset].value == values[offset]
        assert got[offset].header(HEADER_TRUNCATED) is None
    for offset in (1, 3, 4):
        _assert_reduced(got[offset], letters[offset], 1_000_000)


def test_a_compressible_value_over_the_topic_limit_is_truncated_because_the_limit_is_checked_uncompressed(  # noqa: E501
    kafka_bootstrap: str,
) -> None:
    """The producer's message.max.bytes (= the topic's limit) is checked before compression.

    A value whose zstd batch would fit is still refused whole, so it is sent truncated.
    """
    dlq = Dlq(kafka_bootstrap, **{"max.message.bytes": "1000000"})
    letter = _letter(b"a" * MB_1_2, 7)

    dlq.publisher.publish([letter])

    [got] = dlq.records(1)
    _assert_reduced(got, letter, 1_000_000)


def test_the_size_limit_is_read_from_the_dlq_topic(kafka_bootstrap: str) -> None:
    dlq = Dlq(kafka_bootstrap, **{"max.message.bytes": "200000"})
    small, big = _letter(os.urandom(150_000), 1), _letter(os.urandom(300_000), 2)

    dlq.publisher.publish([small, big])

    got = _by_offset(dlq.records(2))
    assert dlq.publisher.limit == 200_000
    assert got[1].value == small.record.value  # under the limit: whole
    _assert_reduced(got[2], big, 200_000)


def test_headers_larger_than_the_topic_takes_are_dropped_and_the_key_kept(
    kafka_bootstrap: str,
) -> None:
    dlq = Dlq(kafka_bootstrap, **{"max.message.bytes": "1000000"})
    letter = _letter(b'{"x": 1}', 3, headers=(("huge", os.urandom(MB_1_2)),))

    dlq.publisher.publish([letter])

    [got] = dlq.records(1)
    assert got.key == b"fav-1"
    assert got.header("huge") is None
    assert got.header(HEADER_TRUNCATED) == b"true"
    assert got.value == b'{"x": 1}'


def test_a_key_larger_than_the_topic_takes_is_dropped_leaving_the_dlq_headers(
    kafka_bootstrap: str,
) -> None:
    dlq = Dlq(kafka_bootstrap, **{"max.message.bytes": "1000000"})
    letter = _letter(b'{"x": 1}', 5, key=os.urandom(MB_1_2))

    dlq.publisher.publish([letter])

    [got] = dlq.records(1)
    assert got.key is None
    assert got.header(HEADER_TRUNCATED) == b"true"
    assert got.header(HEADER_SOURCE_OFFSET) == b"5"
    assert {name for name, _ in got.headers} >= set(DLQ_HEADERS)


def test_an_unreadable_topic_limit_falls_back_to_one_million_with_a_warning(
    kafka_bootstrap: str, dlq_logs: pytest.LogCaptureFixture
) -> None:
    settings = Settings(kafka_bootstrap_servers=kafka_bootstrap)
    registry = CollectorRegistry()
    publisher = DeadLetterPublisher(
        settings, f"no-such-topic-{uuid.uuid4().hex[:8]}",
        Counter("dlq", "d", registry=registry), Counter("retries", "r", registry=registry),
        name="test-dlq", process=Process(),
    )

    assert publisher._read_topic_limit() == DEFAULT_TOPIC_LIMIT
    [warning] = _events(dlq_logs, "dlq-limit-unknown")
    assert warning.levelno == logging.WARNING
    assert warning.code == "UNKNOWN_TOPIC_OR_PART"


def _publishing(dlq: Dlq, letters: list[DeadLetter]
                ) -> tuple[threading.Thread, list[BaseException]]:
    """A thread (not started) publishing ``letters``, and the exceptions it raised."""
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            dlq.publisher.publish(letters)
        except BaseException as exc:  # reported by the test's assertion
            errors.append(exc)

    return threading.Thread(target=publish, daemon=True), errors


def test_letters_published_while_the_broker_is_down_wait_and_land_once_unreduced(
    kafka_broker: Any, kafka_bootstrap: str
) -> None:
    if kafka_broker is None:
        pytest.skip("an external broker cannot be stopped by the suite")
    dlq = Dlq(kafka_bootstrap)
    dlq.publisher.publish([_letter(b"first", 0)])  # reads the limit while the broker is up
    thread, errors = _publishing(dlq, [_letter(b"during-%d" % i, i) for i in range(1, 4)])

    kafka_broker.stop()
    try:
        thread.start()
        time.sleep(3)
        assert thread.is_alive()  # waiting, not dead-lettering into the void
    finally:
        kafka_broker.start()
    thread.join(90)

    assert not thread.is_alive() and errors == []
    got = _by_offset(dlq.records(4))
    assert sorted(got) == [0, 1, 2, 3]
    assert all(r.header(HEADER_TRUNCATED) is None for r in got.values())
    assert dlq.counted == 4


def test_letters_sent_to_a_frozen_broker_are_written_once_when_it_resumes(
    kafka_broker: Any, kafka_bootstrap: str
) -> None:
    """A broker that took the request and does not answer writes it when it resumes: once.

    The broker's JVM is stopped with SIGSTOP: its kernel still accepts and acknowledges, so the
    letters' request waits in its socket. Before, the letters timed out in flight after the
    producer's 30 s message timeout, were produced again, and the resumed broker wrote both
    copies (measured here: 6 records for 3 letters; in a job, 9 of 300 letters twice after a
    60 s freeze). Now a letter in flight is waited for, never produced again.
    """
    if kafka_broker is None or kafka_broker.pid is None:
        pytest.skip("an external broker cannot be frozen by the suite")
    dlq = Dlq(kafka_bootstrap)
    dlq.publisher.publish([_letter(b"first", 0)])  # connected, the limit read
    thread, errors = _publishing(dlq, [_letter(b"frozen-%d" % i, i) for i in range(1, 4)])
    with frozen(kafka_broker.pid):
        thread.start()
        time.sleep(33)  # past the 30 s message timeout the letters had
        assert thread.is_alive(), f"done while the broker was frozen: {errors}"  # waiting
    thread.join(90)

    assert not thread.is_alive() and errors == []
    got = _by_offset(dlq.records(4))  # fails on a letter written twice
    assert sorted(got) == [0, 1, 2, 3]
    assert dlq.counted == 4
