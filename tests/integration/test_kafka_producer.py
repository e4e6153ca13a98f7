"""hand_over and KafkaProducer on a real broker: failures land on exactly their records."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from runtime.settings import Settings
from runtime.shutdown import Shutdown
from schemas.outbox import OutboxRow
from sinks.errors import DeliveryFailedError, is_infrastructure_error
from sinks.kafka_producer import (
    KafkaProducer,
    OutgoingRecord,
    build_producer,
    failure_reporter,
    hand_over,
)

pytestmark = pytest.mark.integration


def produce_and_wait(producer: Any, records: list[Any], timeout: float = 30.0
                     ) -> list[KafkaError | None]:
    """Hand ``records`` over and flush: each record's error (None: acknowledged)."""
    errors: list[KafkaError | None] = [None] * len(records)
    report = failure_reporter(records, errors)
    hand_over(producer, records, lambda _index: report, errors.__setitem__)
    assert producer.flush(timeout) == 0, "records still in flight"
    return errors


def _create(bootstrap: str, topic: str, partitions: int, **config: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1, config=config)]).values():
        future.result(30)


def _consume(bootstrap: str, topic: str, expected: int, timeout: float = 30.0) -> list[Any]:
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex[:10]}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })
    consumer.subscribe([topic])
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg)
        # anything beyond the expected count would be a duplicate: give it a moment to show up
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                got.append(msg)
    finally:
        consumer.close()
    return got


def test_a_failed_delivery_is_reported_for_exactly_that_record(kafka_bootstrap: str) -> None:
    tag = uuid.uuid4().hex[:8]
    good, small, missing = f"pw-good-{tag}", f"pw-small-{tag}", f"pw-missing-{tag}"
    _create(kafka_bootstrap, good, 6)
    _create(kafka_bootstrap, small, 1, **{"max.message.bytes": "1000"})
    producer = build_producer(
        Settings(kafka_bootstrap_servers=kafka_bootstrap), "test",
        **{"message.timeout.ms": 3000, "allow.auto.create.topics": False},
    )
    records = [
        OutgoingRecord(good, f"k{i}".encode(), f'{{"MessageId":"{uuid.uuid4()}"}}'.encode(),
                       [("traceparent", f"tp-{i}".encode())])
        for i in range(10)
    ]
    # Rejected by the broker: over the topic's max.message.bytes (random bytes: lz4 can't
    # shrink them under the limit), well under the producer's own message.max.bytes.
    records[3] = OutgoingRecord(small, b"big", os.urandom(3000))
    records[7] = OutgoingRecord(missing, b"k7", b"nowhere")  # unknown topic: times out

    errors = produce_and_wait(producer, records, timeout=20.0)

    assert [i for i, err in enumerate(errors) if err is not None] == [3, 7]
    assert errors[3] is not None and errors[3].code() == KafkaError.MSG_SIZE_TOO_LARGE
    assert errors[7] is not None and errors[7].code() in (
        KafkaError._MSG_TIMED_OUT, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC,
    )
    consumed = _consume(kafka_bootstrap, good, 8)
    expected = {r.value or b"": r.headers for i, r in enumerate(records) if i not in (3, 7)}
    assert sorted(m.value() or b"" for m in consumed) == sorted(expected)
    assert all(m.headers() == expected[m.value() or b""] for m in consumed)


def test_outbox_rows_are_produced_with_their_headers_utf8_encoded(kafka_bootstrap: str) -> None:
    topic = f"pw-outbox-{uuid.uuid4().hex[:8]}"
    _create(kafka_bootstrap, topic, 3)
    producer = build_producer(Settings(kafka_bootstrap_servers=kafka_bootstrap), "test")
    rows = [
        OutboxRow(uuid.uuid4(), topic, b"key-1", b'{"n":1}',
                  {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                   "x-note": "caf\u00e9"}),
        OutboxRow(uuid.uuid4(), topic, b"key-2", b'{"n":2}', {}),
    ]

    assert produce_and_wait(producer, rows, timeout=20.0) == [None, None]

    consumed = {m.key(): m for m in _consume(kafka_bootstrap, topic, 2)}
    assert set(consumed) == {b"key-1", b"key-2"}
    assert consumed[b"key-1"].value() == b'{"n":1}'
    assert consumed[b"key-1"].headers() == [
        (name, value.encode()) for name, value in rows[0].headers.items()
    ]
    assert consumed[b"key-2"].headers() is None


def test_a_record_refused_by_the_producer_does_not_stop_the_rest_of_the_call(
    kafka_bootstrap: str,
) -> None:
    topic = f"pw-refused-{uuid.uuid4().hex[:8]}"
    _create(kafka_bootstrap, topic, 3)
    overrides: dict[str, Any] = {"message.max.bytes": 10_000, "delivery.report.only.error": False}
    producer = KafkaProducer(Settings(kafka_bootstrap_servers=kafka_bootstrap), "test",
                             stopping=Shutdown(), **overrides)
    records = [OutgoingRecord(topic, f"k{i}".encode(), f"v{i}".encode()) for i in range(5)]
    records[2] = OutgoingRecord(topic, b"k2", os.urandom(20_000))  # refused by produce()

    errors = producer.wait(producer.send(records), 20.0)

    assert [e is None for e in errors] == [True, True, False, True, True]
    assert errors[2] is not None and errors[2].code() == KafkaError.MSG_SIZE_TOO_LARGE
    assert sorted(m.key() for m in _consume(kafka_bootstrap, topic, 4)) == [
        b"k0", b"k1", b"k3", b"k4",
    ]
    producer.close()


def test_a_missing_topic_is_a_service_error_and_is_never_created_by_the_producer(
    kafka_bootstrap: str,
) -> None:
    """The suite's broker auto-creates topics (Kafka's default): the producer must not ask it to.

    An output topic deleted by mistake is then a pause (retried, alerted as a stalled outbox),
    not a topic made again with the broker's default partitions and limits.
    """
    missing = f"pw-deleted-{uuid.uuid4().hex[:8]}"
    producer = build_producer(Settings(kafka_bootstrap_servers=kafka_bootstrap), "test",
                              **{"message.timeout.ms": 3000})
    [error] = produce_and_wait(producer, [OutgoingRecord(missing, b"k", b"v")], timeout=20.0)
    assert error is not None
    assert is_infrastructure_error(DeliveryFailedError(error))  # retried, never dead-lettered
    topics = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).topics
    assert missing not in topics
