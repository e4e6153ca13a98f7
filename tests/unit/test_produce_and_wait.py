"""hand_over's and failure_reporter's bookkeeping with a stand-in producer; header conversion.

The real-broker behaviour (a failed delivery is reported for exactly its record) is in
tests/integration/test_kafka_producer.py.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from runtime.settings import Settings
from runtime.shutdown import Shutdown
from schemas.outbox import OutboxRow
from sinks import kafka_producer
from sinks.errors import is_record_error
from sinks.kafka_producer import (
    KafkaProducer,
    OutgoingRecord,
    build_producer,
    failure_reporter,
    hand_over,
)
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


_WAIT = 0.3
"""The wait given to calls whose fake producer never settles everything: the time-out path
without the production default's 35 s (the fakes' flush returns at once, so that is a spin)."""


def produce_and_wait(producer: Any, records: list[Any]) -> list[KafkaError | None]:
    """What the outbox's stream does with one transaction's records: hand over, then flush."""
    errors: list[KafkaError | None] = [None] * len(records)
    report = failure_reporter(records, errors)
    hand_over(producer, records, lambda _index: report, errors.__setitem__)
    producer.flush(0)
    return errors


def _records(n: int) -> list[OutgoingRecord]:
    return [
        OutgoingRecord("t", f"k{i}".encode(), f'{{"MessageId":"{uuid.uuid4()}"}}'.encode())
        for i in range(n)
    ]


def test_all_acknowledged_gives_none_for_each_record() -> None:
    producer = FakeProducer()
    assert produce_and_wait(producer, _records(5)) == [None] * 5
    assert [c["key"] for c in producer.calls] == [f"k{i}".encode() for i in range(5)]


def test_one_shared_callback_serves_every_record_of_a_call() -> None:
    producer = FakeProducer()
    produce_and_wait(producer, _records(4))
    assert len({id(c["on_delivery"]) for c in producer.calls}) == 1


def test_a_failure_is_reported_for_exactly_its_record() -> None:
    err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    producer = FakeProducer(lambda i, _c: err if i in (1, 3) else None)
    errors = produce_and_wait(producer, _records(5))
    assert [e is not None for e in errors] == [False, True, False, True, False]
    assert errors[1] is err


def test_equal_records_fail_together_the_safe_direction() -> None:
    same = OutgoingRecord("t", b"k", b"same value")
    records = [same, OutgoingRecord("t", b"k", b"other"), OutgoingRecord("t", b"k", b"same value")]
    err = KafkaError(KafkaError._MSG_TIMED_OUT)
    producer = FakeProducer(lambda i, _c: err if i == 0 else None)
    errors = produce_and_wait(producer, records)
    assert errors == [err, None, err]


def test_a_report_matching_no_record_fails_every_record() -> None:
    err = KafkaError(KafkaError._MSG_TIMED_OUT)

    def fail(i: int, call: dict[str, Any]) -> KafkaError | None:
        if i == 1:
            call["value"] = b"not what was produced"
            return err
        return None

    errors = produce_and_wait(FakeProducer(fail), _records(3))
    assert errors == [err, err, err]


def test_empty_key_and_value_reported_back_as_none_still_match() -> None:
    records = [OutgoingRecord("t", b"", b""), OutgoingRecord("t", b"k", b"v")]
    err = KafkaError(KafkaError._MSG_TIMED_OUT)

    def fail(i: int, call: dict[str, Any]) -> KafkaError | None:
        if i == 0:
            call["key"] = call["value"] = None
            return err
        return None

    assert produce_and_wait(FakeProducer(fail), records) == [err, None]


def test_a_full_local_queue_is_served_and_the_record_retried() -> None:
    producer = FakeProducer(full_every=3)
    errors = produce_and_wait(producer, _records(7))
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
    produce_and_wait(producer, [OutgoingRecord("t", b"k", b"v", headers)])
    assert producer.calls[0].get("headers") == sent


def test_outbox_rows_are_produced_as_they_are() -> None:
    row = OutboxRow(uuid.uuid4(), "t", b"k", b"v", {"traceparent": "00-x"})
    producer = FakeProducer()
    assert produce_and_wait(producer, [row]) == [None]
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


# ---- a record refused by produce() itself; exact reports; the healing KafkaProducer -----------


class RefusingProducer(FakeProducer):
    """produce() raises KafkaException for the records whose key is in ``refuse``."""

    def __init__(self, refuse: dict[bytes, KafkaError], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._refuse = refuse

    def produce(self, topic: str, value: Any = None, key: Any = None, **kwargs: Any) -> None:
        if key in self._refuse:
            raise KafkaException(self._refuse[key])
        super().produce(topic, value, key, **kwargs)


class ReportingProducer(FakeProducer):
    """Reports every record (``delivery.report.only.error=False``) but the ``stuck`` ones.

    ``stuck`` records get no report before ``flush`` returns (they are left in flight).
    """

    def __init__(self, stuck: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stuck = stuck
        self.fatal_error: KafkaError | None = None

    def flush(self, _timeout: float) -> int:
        pending, self._pending = self._pending, []
        for call in pending:
            index = self.calls.index(call)
            if index not in self._stuck:
                err = self._fail(index, call)
                call["on_delivery"](err, FakeMessage(call["topic"], call["key"], call["value"]))
        return len(self._stuck)


def test_a_record_refused_by_produce_gets_its_error_and_the_others_are_still_sent() -> None:
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    producer = RefusingProducer({b"k1": too_large, b"k3": too_large})

    errors = produce_and_wait(producer, _records(5))

    assert errors == [None, too_large, None, too_large, None]
    assert [c["key"] for c in producer.calls] == [b"k0", b"k2", b"k4"]


def test_a_refused_record_and_a_broker_failure_are_each_reported_on_their_own_record() -> None:
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    down = KafkaError(KafkaError._MSG_TIMED_OUT)
    producer = RefusingProducer(
        {b"k0": too_large}, fail=lambda _i, c: down if c["key"] == b"k2" else None
    )

    assert produce_and_wait(producer, _records(3)) == [too_large, None, down]


def test_a_kafka_exception_without_an_error_becomes_a_service_failure_of_that_record() -> None:
    class Bare(FakeProducer):
        def produce(self, topic: str, value: Any = None, key: Any = None, **kw: Any) -> None:
            if key == b"k0":
                raise KafkaException("no error object")
            super().produce(topic, value, key, **kw)

    errors = produce_and_wait(Bare(), _records(2))

    assert errors[0] is not None and errors[0].code() == KafkaError._FAIL
    assert not is_record_error(errors[0])
    assert errors[1] is None


def _settings() -> Settings:
    return Settings(kafka_bootstrap_servers="127.0.0.1:1")


class Factory:
    """Stands in for build_producer: builds fake producers and remembers them."""

    def __init__(self, make: Callable[[int], FakeProducer]) -> None:
        self.built: list[FakeProducer] = []
        self.overrides: list[dict[str, Any]] = []
        self._make = make

    def __call__(self, _settings: Settings, _suffix: str, **overrides: Any) -> Any:
        producer = self._make(len(self.built))
        self.built.append(producer)
        self.overrides.append(overrides)
        return producer


_EXACT_REPORTS: dict[str, Any] = {"delivery.report.only.error": False}


def _producer(monkeypatch: pytest.MonkeyPatch, make: Callable[[int], FakeProducer], **kw: Any
              ) -> tuple[KafkaProducer, Factory, Shutdown]:
    factory, stopping = Factory(make), Shutdown()
    monkeypatch.setattr(kafka_producer, "build_producer", factory)
    return KafkaProducer(_settings(), "test", stopping=stopping, **kw), factory, stopping


def test_the_producer_is_built_once_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    producer, factory, stopping = _producer(
        monkeypatch, lambda _n: ReportingProducer(stuck=set()), **_EXACT_REPORTS)

    assert producer.wait(producer.send(_records(2)), _WAIT) == [None, None]
    assert producer.wait(producer.send(_records(2)), _WAIT) == [None, None]

    assert len(factory.built) == 1
    assert not stopping.requested()


def test_with_exact_reports_records_acknowledged_before_a_fatal_error_count_as_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fatal = KafkaError(KafkaError._FATAL, "fenced", fatal=True)
    producer, factory, stopping = _producer(
        monkeypatch, lambda _n: ReportingProducer(stuck={2}), **_EXACT_REPORTS)

    sending = producer.send(_records(3))
    factory.overrides[0]["error_cb"](fatal)
    errors = producer.wait(sending, _WAIT)

    assert errors[:2] == [None, None]
    assert errors[2] is not None and errors[2].code() == KafkaError._FATAL
    assert sending.done and stopping.requested()
    assert factory.overrides[0]["delivery.report.only.error"] is False


def test_a_record_with_no_report_yet_stays_unsettled_to_be_waited_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    producer, factory, _ = _producer(
        monkeypatch, lambda _n: ReportingProducer(stuck={2}), **_EXACT_REPORTS)

    sending = producer.send(_records(4))
    errors = producer.wait(sending, _WAIT)

    assert errors[:2] == [None, None] and errors[3] is None
    assert errors[2] is not None and errors[2].code() == KafkaError._TIMED_OUT
    assert sending.settled == [True, True, False, True]
    assert len({id(c["on_delivery"]) for c in factory.built[0].calls}) == 4


def test_a_fatal_error_raised_by_produce_requests_a_restart_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fatal = KafkaError(KafkaError._FATAL, "dead", fatal=True)
    producer, _, stopping = _producer(
        monkeypatch, lambda _n: RefusingProducer({b"k0": fatal, b"k1": fatal}))

    errors = producer.wait(producer.send(_records(2)), _WAIT)

    assert all(e is not None and e.code() == KafkaError._FATAL for e in errors)
    assert stopping.requested()


def test_build_producer_logs_client_errors_and_calls_the_given_error_callback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    configs: list[dict[str, Any]] = []
    monkeypatch.setattr(kafka_producer, "Producer", configs.append)  # no librdkafka handle
    seen: list[KafkaError] = []
    build_producer(_settings(), "test", error_cb=seen.append)
    caplog.set_level(logging.WARNING, "sinks.kafka_producer")

    configs[0]["error_cb"](KafkaError(KafkaError._TRANSPORT))
    configs[0]["error_cb"](KafkaError(KafkaError._FATAL, "boom", fatal=True))

    assert [e.code() for e in seen] == [KafkaError._TRANSPORT, KafkaError._FATAL]
    assert [r.getMessage() for r in caplog.records] == ["kafka-client-error",
                                                        "kafka-producer-fatal"]
    assert configs[0]["allow.auto.create.topics"] is False


def test_close_flushes_and_drops_the_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    producer, factory, _ = _producer(
        monkeypatch, lambda _n: ReportingProducer(stuck=set()), **_EXACT_REPORTS)
    producer.close(1)  # nothing built yet
    producer.wait(producer.send(_records(1)), _WAIT)
    producer.close(1)
    producer.wait(producer.send(_records(1)), _WAIT)
    assert len(factory.built) == 2
