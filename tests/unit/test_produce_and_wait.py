"""produce_and_wait's bookkeeping with a stand-in producer; sources' header conversion.

The real-broker behaviour (a failed delivery is reported for exactly its record) is in
tests/integration/test_kafka_producer.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError

from schemas.outbox import OutboxRow
from sinks.kafka_producer import OutgoingRecord, produce_and_wait
from sources.kafka_input import _headers


class FakeMessage:
    def __init__(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        self._topic, self._key, self._value = topic, key, value

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value


class FakeProducer:
    """Queues produce() calls; flush() reports the configured failures (only-error mode)."""

    def __init__(
        self,
        fail: Callable[[int, dict[str, Any]], KafkaError | None] = lambda _i, _c: None,
        *,
        full_every: int = 0,
        left_in_flight: int = 0,
    ) -> None:
        self.calls: list[dict[str, Any]] = []
        self._fail = fail
        self._full_every = full_every
        self._attempts = 0
        self._left = left_in_flight
        self._pending: list[dict[str, Any]] = []
        self.polls = 0

    def produce(self, topic: str, value: Any = None, key: Any = None, **kwargs: Any) -> None:
        self._attempts += 1
        if self._full_every and self._attempts % self._full_every == 0:
            raise BufferError("Local: Queue full")
        if "headers" in kwargs and not isinstance(kwargs["headers"], list | dict):
            raise TypeError("expected headers to be dict or list of (key, value) tuples")
        call = {"topic": topic, "value": value, "key": key, **kwargs}
        self.calls.append(call)
        self._pending.append(call)

    def _serve(self) -> None:
        pending, self._pending = self._pending, []
        for call in pending:
            err = self._fail(self.calls.index(call), call)
            if err is not None:
                call["on_delivery"](err, FakeMessage(call["topic"], call["key"], call["value"]))

    def poll(self, _timeout: float) -> int:
        self.polls += 1
        self._serve()
        return 0

    def flush(self, _timeout: float) -> int:
        self._serve()
        return self._left


def _records(n: int) -> list[OutgoingRecord]:
    return [
        OutgoingRecord("t", f"k{i}".encode(), f'{{"MessageId":"{uuid.uuid4()}"}}'.encode())
        for i in range(n)
    ]


def test_all_acknowledged_gives_none_for_each_record() -> None:
    producer = FakeProducer()
    assert produce_and_wait(producer, _records(5)) == [None] * 5  # type: ignore[arg-type]
    assert [c["key"] for c in producer.calls] == [f"k{i}".encode() for i in range(5)]


def test_one_shared_callback_serves_every_record_of_a_call() -> None:
    producer = FakeProducer()
    produce_and_wait(producer, _records(4))  # type: ignore[arg-type]
    assert len({id(c["on_delivery"]) for c in producer.calls}) == 1


def test_a_failure_is_reported_for_exactly_its_record() -> None:
    err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    producer = FakeProducer(lambda i, _c: err if i in (1, 3) else None)
    errors = produce_and_wait(producer, _records(5))  # type: ignore[arg-type]
    assert [e is not None for e in errors] == [False, True, False, True, False]
    assert errors[1] is err


def test_equal_records_fail_together_the_safe_direction() -> None:
    same = OutgoingRecord("t", b"k", b"same value")
    records = [same, OutgoingRecord("t", b"k", b"other"), OutgoingRecord("t", b"k", b"same value")]
    err = KafkaError(KafkaError._MSG_TIMED_OUT)
    producer = FakeProducer(lambda i, _c: err if i == 0 else None)
    errors = produce_and_wait(producer, records)  # type: ignore[arg-type]
    assert errors == [err, None, err]


def test_a_report_matching_no_record_fails_every_record() -> None:
    err = KafkaError(KafkaError._MSG_TIMED_OUT)

    def fail(i: int, call: dict[str, Any]) -> KafkaError | None:
        if i == 1:
            call["value"] = b"not what was produced"
            return err
        return None

    errors = produce_and_wait(FakeProducer(fail), _records(3))  # type: ignore[arg-type]
    assert errors == [err, err, err]


def test_empty_key_and_value_reported_back_as_none_still_match() -> None:
    records = [OutgoingRecord("t", b"", b""), OutgoingRecord("t", b"k", b"v")]
    err = KafkaError(KafkaError._MSG_TIMED_OUT)

    def fail(i: int, call: dict[str, Any]) -> KafkaError | None:
        if i == 0:
            call["key"] = call["value"] = None
            return err
        return None

    assert produce_and_wait(FakeProducer(fail), records) == [err, None]  # type: ignore[arg-type]


def test_anything_left_in_flight_fails_every_record() -> None:
    errors = produce_and_wait(FakeProducer(left_in_flight=1), _records(3))  # type: ignore[arg-type]
    assert all(e is not None and e.code() == KafkaError._TIMED_OUT for e in errors)


def test_a_full_local_queue_is_served_and_the_record_retried() -> None:
    producer = FakeProducer(full_every=3)
    errors = produce_and_wait(producer, _records(7))  # type: ignore[arg-type]
    assert errors == [None] * 7
    assert [c["key"] for c in producer.calls] == [f"k{i}".encode() for i in range(7)]
    assert producer.polls > 0


@pytest.mark.parametrize(
    ("headers", "sent"),
    [
        ((), None),
        ([], None),
        ({}, None),
        ([("a", b"1")], [("a", b"1")]),
        ((("a", b"1"), ("b", b"2")), [("a", b"1"), ("b", b"2")]),
        ({"traceparent": "00-x"}, {"traceparent": "00-x"}),
    ],
)
def test_headers_go_to_confluent_as_a_list_or_a_dict(headers: Any, sent: Any) -> None:
    producer = FakeProducer()
    produce_and_wait(producer, [OutgoingRecord("t", b"k", b"v", headers)])  # type: ignore[arg-type]
    assert producer.calls[0].get("headers") == sent


def test_outbox_rows_are_produced_as_they_are() -> None:
    row = OutboxRow(uuid.uuid4(), "t", b"k", b"v", {"traceparent": "00-x"})
    producer = FakeProducer()
    assert produce_and_wait(producer, [row]) == [None]  # type: ignore[arg-type]
    call = producer.calls[0]
    assert (call["topic"], call["key"], call["value"]) == ("t", b"k", b"v")
    assert call["headers"] is row.headers


def test_consumed_headers_become_a_tuple_of_pairs() -> None:
    raw = [("traceparent", b"00-x"), ("a", b"1")]
    converted = _headers(raw)
    assert converted == (("traceparent", b"00-x"), ("a", b"1"))
    assert isinstance(converted, tuple)
    hash(converted)


def test_consumed_headers_none_or_empty_are_empty() -> None:
    assert _headers(None) == ()
    assert _headers([]) == ()


def test_a_null_header_value_becomes_empty_bytes() -> None:
    assert _headers([("a", None), ("b", b"2")]) == (("a", b""), ("b", b"2"))
