"""Reduced dead letters (pure logic) and the publisher's bookkeeping with a stand-in producer.

The real-broker behaviour is in tests/integration/test_dead_letters.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import pytest
from confluent_kafka import KafkaError, KafkaException
from prometheus_client import CollectorRegistry, Counter

from runtime.process import Process
from runtime.settings import Settings
from schemas.dlq import (
    DLQ_HEADERS,
    HEADER_ORIGINAL_SIZE,
    HEADER_SOURCE_OFFSET,
    HEADER_TRUNCATED,
    DlqReason,
)
from schemas.dlq_letter import (
    DeadLetter,
    LetterForm,
    estimated_size,
    next_form,
    protocol_margin,
    value_room,
)
from schemas.kafka_record import SourceRecord
from sinks.dead_letters import DeadLetterPublisher, is_kafka_unreachable
from sinks.kafka_producer import OutgoingRecord, Sending

LIMIT = 1_000_000
FAILED_AT = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def letter(
    value: bytes | None = b"v",
    key: bytes | None = b"key",
    headers: tuple[tuple[str, bytes], ...] = (("traceparent", b"00-abc"),),
    offset: int = 7,
) -> DeadLetter:
    record = SourceRecord("pin.favorites.favorite-added.v1", 3, offset, key, value, headers)
    return DeadLetter(record, DlqReason.INVALID_JSON, "JSONDecodeError", 1, FAILED_AT)


def names(headers: Sequence[tuple[str, bytes]]) -> list[str]:
    return [name for name, _ in headers]


def header(headers: Sequence[tuple[str, bytes]], name: str) -> bytes | None:
    return next((v for k, v in headers if k == name), None)


def test_the_whole_form_is_the_original_record_with_the_dlq_headers() -> None:
    ltr = letter(b"x" * 10)

    rendered = ltr.render(LetterForm.WHOLE, LIMIT)

    assert (rendered.key, rendered.value) == (b"key", b"x" * 10)
    assert rendered.headers == ltr.headers()
    assert names(rendered.headers) == ["traceparent", *DLQ_HEADERS]
    assert header(rendered.headers, HEADER_TRUNCATED) is None


def test_a_truncated_letter_keeps_key_and_headers_and_cuts_the_value_to_fit() -> None:
    ltr = letter(b"x" * 1_200_000)

    rendered = ltr.render(LetterForm.TRUNCATED, LIMIT)

    assert rendered.key == b"key"
    assert names(rendered.headers) == [
        "traceparent", *DLQ_HEADERS, HEADER_TRUNCATED, HEADER_ORIGINAL_SIZE,
    ]
    assert header(rendered.headers, HEADER_TRUNCATED) == b"true"
    assert header(rendered.headers, HEADER_ORIGINAL_SIZE) == b"1200000"
    assert header(rendered.headers, HEADER_SOURCE_OFFSET) == b"7"
    assert rendered.value is not None
    assert rendered.value == b"x" * len(rendered.value)  # a prefix of the original
    assert estimated_size(rendered) == LIMIT - protocol_margin(LIMIT)  # as much as fits
    assert 990_000 < len(rendered.value) < LIMIT


def test_a_value_that_already_fits_is_kept_whole_in_a_reduced_form() -> None:
    rendered = letter(b"small").render(LetterForm.TRUNCATED, LIMIT)
    assert rendered.value == b"small"
    assert header(rendered.headers, HEADER_ORIGINAL_SIZE) == b"5"


def test_when_the_key_and_headers_take_all_the_room_the_value_is_empty() -> None:
    ltr = letter(b"v" * 100, headers=(("big", b"h" * LIMIT),))
    assert ltr.render(LetterForm.TRUNCATED, LIMIT).value == b""


def test_further_forms_drop_the_original_headers_then_the_key() -> None:
    ltr = letter(b"x" * 2_000_000)

    no_headers = ltr.render(LetterForm.NO_ORIGINAL_HEADERS, LIMIT)
    no_key = ltr.render(LetterForm.NO_KEY, LIMIT)
    bare = ltr.render(LetterForm.BARE, LIMIT)

    assert no_headers.key == b"key" and "traceparent" not in names(no_headers.headers)
    assert no_key.key is None
    assert names(no_key.headers) == [*DLQ_HEADERS, HEADER_TRUNCATED, HEADER_ORIGINAL_SIZE]
    assert (bare.key, bare.value) == (None, b"")
    assert names(bare.headers) == [*DLQ_HEADERS, HEADER_TRUNCATED, HEADER_ORIGINAL_SIZE]
    assert header(bare.headers, HEADER_ORIGINAL_SIZE) == b"2000000"


def test_a_tombstone_stays_a_tombstone_in_every_form() -> None:
    ltr = letter(None)
    for form in LetterForm:
        assert ltr.render(form, LIMIT).value is None
    assert header(ltr.render(LetterForm.BARE, LIMIT).headers, HEADER_ORIGINAL_SIZE) == b"0"


def test_after_the_whole_letter_is_refused_the_next_form_is_truncated() -> None:
    assert next_form(letter(b"x" * 1_200_000), LetterForm.WHOLE, LIMIT) is LetterForm.TRUNCATED


def test_forms_that_cannot_fit_are_skipped() -> None:
    huge_headers = letter(b"x" * 10, headers=(("big", b"h" * 1_100_000),))
    huge_key = letter(b"x" * 10, key=b"k" * 1_100_000, headers=(("big", b"h" * 1_100_000),))

    assert next_form(huge_headers, LetterForm.WHOLE, LIMIT) is LetterForm.NO_ORIGINAL_HEADERS
    assert next_form(huge_key, LetterForm.WHOLE, LIMIT) is LetterForm.NO_KEY


def test_the_bare_letter_is_the_last_form() -> None:
    ltr = letter()
    assert next_form(ltr, LetterForm.NO_KEY, LIMIT) is LetterForm.BARE
    assert next_form(ltr, LetterForm.BARE, LIMIT) is None


def test_the_room_for_the_value_leaves_a_margin_and_is_never_negative() -> None:
    assert value_room(LIMIT, b"k", []) == LIMIT - protocol_margin(LIMIT) - 1
    assert value_room(1000, b"k" * 5000, []) == 0
    assert protocol_margin(LIMIT) > 100  # measured: 50 bytes of margin are not enough


@pytest.mark.parametrize(
    ("code", "unreachable"),
    [
        (KafkaError._TIMED_OUT, True),
        (KafkaError._TRANSPORT, True),
        (KafkaError._ALL_BROKERS_DOWN, True),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, False),
        (KafkaError.CLUSTER_AUTHORIZATION_FAILED, False),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, False),
    ],
)
def test_only_an_unreachable_cluster_makes_the_limit_lookup_retry(
    code: int, unreachable: bool
) -> None:
    assert is_kafka_unreachable(KafkaException(KafkaError(code))) is unreachable


# ---- the publisher, with a stand-in for KafkaProducer -------------------------------------------


Answer = Callable[[int, OutgoingRecord], KafkaError | None]


class FakeDlqProducer:
    """Answers each call with ``answers[call_number](index, record)``; records every send."""

    def __init__(self, answers: list[Answer]) -> None:
        self.calls: list[list[OutgoingRecord]] = []
        self._answers = answers

    def produce_and_wait(
        self, records: Sequence[OutgoingRecord], timeout: float = 35.0
    ) -> list[KafkaError | None]:
        answer = self._answers[min(len(self.calls), len(self._answers) - 1)]
        self.calls.append(list(records))
        return [answer(i, r) for i, r in enumerate(records)]

    def send(self, records: Sequence[OutgoingRecord]) -> Sending:
        """Every record settled at once with its answer (this stand-in has nothing in flight)."""
        return Sending(None, self.produce_and_wait(records), [True] * len(records))

    def wait(self, sending: Sending, timeout: float = 35.0) -> list[KafkaError | None]:
        return list(sending.results)

    def close(self, timeout: float = 10.0) -> None:
        pass


def ok(_i: int, _r: OutgoingRecord) -> KafkaError | None:
    return None


def too_large_if_over(size: int) -> Answer:
    def answer(_i: int, r: OutgoingRecord) -> KafkaError | None:
        big = len(r.value or b"") > size
        return KafkaError(KafkaError.MSG_SIZE_TOO_LARGE) if big else None

    return answer


def publisher(fake: FakeDlqProducer) -> tuple[DeadLetterPublisher, CollectorRegistry]:
    registry = CollectorRegistry()
    settings = Settings(
        kafka_bootstrap_servers="127.0.0.1:1", retry_initial_seconds=0.001,
        retry_max_seconds=0.002,
    )
    pub = DeadLetterPublisher(
        settings, "dlq", Counter("dlq", "d", registry=registry),
        Counter("retries", "r", registry=registry), name="test-dlq", process=Process(),
    )
    pub._producer = fake  # type: ignore[assignment]
    pub._limit = LIMIT
    return pub, registry


def offsets(records: Sequence[OutgoingRecord]) -> list[bytes | None]:
    return [header(r.headers, HEADER_SOURCE_OFFSET) for r in records]


def test_an_oversized_letter_is_resent_truncated_at_once_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeDlqProducer([too_large_if_over(LIMIT)])
    pub, registry = publisher(fake)
    caplog.set_level(logging.WARNING, "sinks.dead_letters")

    pub.publish([letter(b"ok", offset=1), letter(b"x" * 1_200_000, offset=2)])

    # the good one once; the big one alone (whole), then alone truncated
    assert [offsets(c) for c in fake.calls] == [[b"1", b"2"], [b"2"], [b"2"]]
    assert header(fake.calls[1][0].headers, HEADER_TRUNCATED) is None
    assert header(fake.calls[2][0].headers, HEADER_TRUNCATED) == b"true"
    assert registry.get_sample_value("dlq_total") == 2
    assert registry.get_sample_value("retries_total") == 0  # no back-off for a record error
    reduced = [r for r in caplog.records if r.getMessage() == "dead-letter-reduced"]
    assert [r.source for r in reduced] == [  # type: ignore[attr-defined]
        "pin.favorites.favorite-added.v1[3]@2"
    ]


class BatchRefusingProducer(FakeDlqProducer):
    """Like the broker: one record over ``size`` fails every record of the call."""

    def __init__(self, size: int) -> None:
        super().__init__([ok])
        self._size = size

    def produce_and_wait(
        self, records: Sequence[OutgoingRecord], timeout: float = 35.0
    ) -> list[KafkaError | None]:
        self.calls.append(list(records))
        if any(len(r.value or b"") > self._size for r in records):
            return [KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)] * len(records)
        return [None] * len(records)


def test_an_innocent_batch_mate_of_a_refused_letter_is_delivered_whole() -> None:
    fake = BatchRefusingProducer(LIMIT)
    pub, registry = publisher(fake)

    pub.publish([letter(b"ok", offset=1), letter(b"x" * 1_200_000, offset=2)])

    sent = {header(c[0].headers, HEADER_SOURCE_OFFSET): c[0] for c in fake.calls[1:]}
    assert sent[b"1"].value == b"ok"
    assert header(sent[b"1"].headers, HEADER_TRUNCATED) is None  # not reduced
    delivered_truncated = fake.calls[-1][0]
    assert header(delivered_truncated.headers, HEADER_SOURCE_OFFSET) == b"2"
    assert header(delivered_truncated.headers, HEADER_TRUNCATED) == b"true"
    assert registry.get_sample_value("dlq_total") == 2


def test_a_service_error_retries_only_the_letters_not_yet_delivered() -> None:
    down = KafkaError(KafkaError._MSG_TIMED_OUT)
    fake = FakeDlqProducer([lambda i, _r: down if i == 1 else None, ok])
    pub, registry = publisher(fake)

    pub.publish([letter(offset=1), letter(offset=2), letter(offset=3)])

    assert [offsets(c) for c in fake.calls] == [[b"1", b"2", b"3"], [b"2"]]
    assert header(fake.calls[1][0].headers, HEADER_TRUNCATED) is None  # not reduced
    assert registry.get_sample_value("dlq_total") == 3
    assert registry.get_sample_value("retries_total") == 1


def test_seven_poison_letters_some_oversized_are_each_delivered_once() -> None:
    fake = FakeDlqProducer([too_large_if_over(LIMIT)])
    pub, registry = publisher(fake)
    values = [b"x" * (1_200_000 if i % 3 == 0 else 10) for i in range(7)]

    pub.publish([letter(v, offset=i) for i, v in enumerate(values)])

    delivered = [r for c in fake.calls for r in c if len(r.value or b"") <= LIMIT]
    assert sorted(o or b"" for o in offsets(delivered)) == sorted(
        str(i).encode() for i in range(7)
    )
    assert registry.get_sample_value("dlq_total") == 7


def test_a_letter_refused_in_every_form_is_logged_loudly_not_stalled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    invalid = KafkaError(KafkaError.INVALID_RECORD)
    fake = FakeDlqProducer([lambda _i, _r: invalid])
    pub, registry = publisher(fake)
    caplog.set_level(logging.WARNING, "sinks.dead_letters")

    pub.publish([letter(offset=9)])

    assert len(fake.calls) == len(LetterForm)  # alone from the start: each form once
    unwritable = [r for r in caplog.records if r.getMessage() == "dead-letter-unwritable"]
    assert len(unwritable) == 1 and unwritable[0].levelno == logging.ERROR
    assert registry.get_sample_value("dlq_total") == 1


def test_publishing_nothing_builds_nothing() -> None:
    registry = CollectorRegistry()
    pub = DeadLetterPublisher(
        Settings(kafka_bootstrap_servers="127.0.0.1:1"), "dlq",
        Counter("dlq", "d", registry=registry), Counter("retries", "r", registry=registry),
        name="test-dlq", process=Process(),
    )
    pub.publish([])
    assert pub.limit is None


class InFlightProducer(FakeDlqProducer):
    """The first call's letters get no report for ``silent_waits`` waits (a frozen broker)."""

    def __init__(self, silent_waits: int) -> None:
        super().__init__([ok])
        self._silent = silent_waits
        self.waits = 0

    def send(self, records: Sequence[OutgoingRecord]) -> Sending:
        self.calls.append(list(records))
        return Sending(None, [None] * len(records), [False] * len(records))

    def wait(self, sending: Sending, timeout: float = 35.0) -> list[KafkaError | None]:
        self.waits += 1
        if self.waits > self._silent:
            sending.settled[:] = [True] * len(sending.settled)
        timed_out = KafkaError(KafkaError._TIMED_OUT)
        return [None if done else timed_out for done in sending.settled]


def test_a_letter_still_in_flight_is_waited_for_and_never_sent_twice() -> None:
    fake = InFlightProducer(silent_waits=2)
    pub, registry = publisher(fake)

    pub.publish([letter(b"a", offset=1), letter(b"b", offset=2)])

    assert [offsets(c) for c in fake.calls] == [[b"1", b"2"]]  # handed over once
    assert fake.waits == 3
    assert registry.get_sample_value("retries_total") == 2  # each silent wait: a back-off
    assert registry.get_sample_value("dlq_total") == 2
