"""Kafka record errors vs service errors, as a real broker and librdkafka produce them.

One test per class of failure: the error arrives with the code ``sinks.errors`` expects, and
is classified as a record error (dead-letter, never retried forever) or a service error (pause,
retry with back-off). Authorization failures are covered by a unit test only (no ACLs here).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from runtime.settings import Settings
from runtime.shutdown import Shutdown
from sinks.errors import (
    DeliveryFailedError,
    is_infrastructure_error,
    is_record_error,
)
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


def _topic(bootstrap: str, prefix: str, **config: str) -> str:
    name = f"ec-{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, 1, 1, config=config)]).values():
        future.result(30)
    return name


def _producer(bootstrap: str, **overrides: Any) -> Producer:
    return build_producer(
        Settings(kafka_bootstrap_servers=bootstrap), "test",
        **{"message.timeout.ms": 10_000, **overrides},
    )


def _assert_record_error(err: KafkaError | None, code: int) -> None:
    assert err is not None
    assert err.code() == code, err.name()
    assert is_record_error(err)
    assert not is_infrastructure_error(DeliveryFailedError(err))


def test_a_record_over_the_producers_message_max_bytes_is_a_record_error_raised_locally(
    kafka_bootstrap: str,
) -> None:
    topic = _topic(kafka_bootstrap, "local")
    producer = _producer(kafka_bootstrap, **{"message.max.bytes": 100_000})
    records = [
        OutgoingRecord(topic, b"a", b"fine"),
        OutgoingRecord(topic, b"b", os.urandom(200_000)),
        OutgoingRecord(topic, b"c", b"fine too"),
    ]

    errors = produce_and_wait(producer, records, timeout=20.0)

    assert errors[0] is None and errors[2] is None  # the loop went on after the refusal
    _assert_record_error(errors[1], KafkaError.MSG_SIZE_TOO_LARGE)


@pytest.mark.parametrize(
    "value",
    [os.urandom(5_000), os.urandom(2_500) * 2],
    ids=["incompressible", "compressible-but-not-enough"],
)
def test_a_record_over_the_topics_max_message_bytes_is_a_record_error_from_the_broker(
    kafka_bootstrap: str, value: bytes
) -> None:
    topic = _topic(kafka_bootstrap, "broker", **{"max.message.bytes": "2000"})
    producer = _producer(kafka_bootstrap)  # message.max.bytes 1 MB: the broker decides

    errors = produce_and_wait(producer, [OutgoingRecord(topic, b"k", value)], timeout=20.0)

    _assert_record_error(errors[0], KafkaError.MSG_SIZE_TOO_LARGE)


def test_a_null_key_on_a_compacted_topic_is_a_record_error(kafka_bootstrap: str) -> None:
    topic = _topic(kafka_bootstrap, "compact", **{"cleanup.policy": "compact"})
    producer = _producer(kafka_bootstrap)

    errors = produce_and_wait(producer, [OutgoingRecord(topic, None, b"no key")], timeout=20.0)

    _assert_record_error(errors[0], KafkaError.INVALID_RECORD)


def test_the_broker_refuses_a_whole_batch_for_one_bad_record_so_batch_mates_get_its_error(
    kafka_bootstrap: str,
) -> None:
    """Measured: a record error from the broker fails every record of its batch.

    Same partition, same request: an innocent batch-mate gets the error too, and is delivered
    when sent again alone.
    """
    topic = _topic(kafka_bootstrap, "batch", **{"cleanup.policy": "compact"})
    producer = _producer(kafka_bootstrap, **{"linger.ms": 200})  # one batch for sure
    bad, innocent = OutgoingRecord(topic, None, b"no key"), OutgoingRecord(topic, b"k", b"keyed")

    errors = produce_and_wait(producer, [bad, innocent], timeout=20.0)

    _assert_record_error(errors[0], KafkaError.INVALID_RECORD)
    _assert_record_error(errors[1], KafkaError.INVALID_RECORD)
    assert produce_and_wait(producer, [innocent], timeout=20.0) == [None]


def test_a_timestamp_older_than_the_topic_accepts_is_a_record_error(kafka_bootstrap: str) -> None:
    topic = _topic(kafka_bootstrap, "ts", **{"message.timestamp.before.max.ms": "60000"})
    producer = _producer(kafka_bootstrap)
    reports: list[KafkaError | None] = []
    a_day_ago_ms = int((time.time() - 86_400) * 1000)

    producer.produce(topic, b"old", b"k", timestamp=a_day_ago_ms,
                     on_delivery=lambda err, _m: reports.append(err))
    assert producer.flush(20) == 0

    assert len(reports) == 1
    _assert_record_error(reports[0], KafkaError.INVALID_TIMESTAMP)


def test_a_stopped_broker_gives_service_errors_and_the_record_goes_through_after_restart(
    kafka_broker: Any, kafka_bootstrap: str
) -> None:
    if kafka_broker is None:
        pytest.skip("an external broker cannot be stopped by the suite")
    topic = _topic(kafka_bootstrap, "down")
    overrides: dict[str, Any] = {"message.timeout.ms": 3_000, "delivery.report.only.error": False}
    producer = KafkaProducer(Settings(kafka_bootstrap_servers=kafka_bootstrap), "test",
                             stopping=Shutdown(), **overrides)
    assert producer.wait(producer.send([OutgoingRecord(topic, b"k", b"before")]), 35.0) == [None]
    kafka_broker.stop()
    try:
        errors = producer.wait(producer.send([OutgoingRecord(topic, b"k", b"during")]), 10.0)
        err = errors[0]
        assert err is not None
        assert not is_record_error(err), err.name()
        assert is_infrastructure_error(DeliveryFailedError(err))
    finally:
        kafka_broker.start()
    assert producer.wait(producer.send([OutgoingRecord(topic, b"k", b"after")]), 30.0) == [None]
    producer.close()


def test_librdkafka_checks_message_max_bytes_on_the_uncompressed_record(
    kafka_bootstrap: str,
) -> None:
    """Measured: the producer's limit applies before compression, the broker's after."""
    topic = _topic(kafka_bootstrap, "zstd", **{"max.message.bytes": "1000000"})
    compressible = b"a" * 1_200_000
    record = [OutgoingRecord(topic, b"k", compressible)]

    at_topic_limit = _producer(
        kafka_bootstrap, **{"compression.type": "zstd", "message.max.bytes": 1_000_000}
    )
    above_topic_limit = _producer(
        kafka_bootstrap, **{"compression.type": "zstd", "message.max.bytes": 2_000_000}
    )

    refused = produce_and_wait(at_topic_limit, record, timeout=20.0)
    _assert_record_error(refused[0], KafkaError.MSG_SIZE_TOO_LARGE)  # local, uncompressed
    assert produce_and_wait(above_topic_limit, record, timeout=20.0) == [None]  # fits zstd'ed
