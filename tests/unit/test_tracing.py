"""Traces with the SDK's in-memory exporter: sampling, parentage, attributes, status, traceparent.

The real OpenTelemetry SDK (a ``SimpleSpanProcessor`` into an ``InMemorySpanExporter``); no
collector, no Kafka, no PostgreSQL. The favorites flow runs on Bytewax's TestingSource for the
outcomes decided before the database (invalid-owner, duplicate, dead-lettered).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import orjson
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from dataflows.favorite_actions import traces as favorite_traces
from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.flow import FavoritesSinks, build_flow
from dataflows.favorite_actions.records import ActionRowBuilder
from dataflows.favorite_actions.store import BatchOutcome
from dataflows.session_linking import traces as sign_in_traces
from dataflows.session_linking.decode import SignInMessage, decode_sign_in
from dataflows.session_linking.linking import ConflictReason, LinkOutcome, LinkResult
from devenv.harness.messages import favorite_envelope
from runtime import tracing
from runtime.settings import Settings
from runtime.tracing import Sampling
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from schemas.outbox import OutboxRow
from tests.rows import SessionSnapshot, build_with

SETTINGS = Settings(http_port=0, outbox_enabled=False)
ADDED = SETTINGS.topic_favorite_added
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
SAMPLED = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01".encode()
UNSAMPLED = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-00".encode()
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), Sampling(parent_based=True, bound=0),
                    consumer_group="ua-favorites")
    yield exporter
    tracing.shutdown()


def _record(traceparent: bytes | None = SAMPLED, offset: int = 7, value: bytes | None = None,
            ) -> SourceRecord:
    headers = (("traceparent", traceparent),) if traceparent is not None else ()
    if value is None:
        value = orjson.dumps(favorite_envelope(anonymous_id=uuid.uuid4()))
    return SourceRecord(ADDED, 3, offset, b"key", value, headers)


def _message(traceparent: bytes | None = SAMPLED, offset: int = 7) -> FavoriteMessage:
    decoded = decode_favorite(_record(traceparent, offset), ACTION_TYPES)
    assert isinstance(decoded, FavoriteMessage)
    return decoded


def _by_name(finished: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name.startswith(prefix)]


def test_sampling_follows_the_standard_variables() -> None:
    assert Sampling.from_env({}) == Sampling(True, 1 << 64)
    assert Sampling.from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                              "OTEL_TRACES_SAMPLER_ARG": "0.01"}) == Sampling.ratio(0.01)
    assert Sampling.from_env({"OTEL_TRACES_SAMPLER": "traceidratio",
                              "OTEL_TRACES_SAMPLER_ARG": "0"}) == Sampling(False, 0)
    assert Sampling.from_env({"OTEL_TRACES_SAMPLER": "always_off"}) == Sampling(False, 0)
    assert Sampling.from_env({"OTEL_TRACES_SAMPLER": "nonsense"}) == Sampling(True, 1 << 64)
    assert not tracing.tracing_wanted({})
    assert tracing.tracing_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.tracing_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                       "OTEL_SDK_DISABLED": "true"})


def test_with_tracing_off_nothing_is_sampled_and_records_are_produced_as_they_are() -> None:
    assert not tracing.configure_from_env(env={})
    assert _message().trace is None
    records = [OutboxRow(uuid.uuid4(), "t", b"k", b"v", {"traceparent": SAMPLED.decode()})]
    assert tracing.start_publish(records) == (records, None)


def test_the_incoming_sampled_flag_decides_and_a_sampled_message_keeps_its_trace(
    spans: InMemorySpanExporter,
) -> None:
    sampled = _message(SAMPLED).trace
    assert sampled is not None
    assert (sampled.trace_id, sampled.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert _message(UNSAMPLED).trace is None
    assert _message(None).trace is None  # no traceparent: the root ratio, 0 here
    assert _message(b"00-garbage").trace is None
    assert spans.get_finished_spans() == ()  # deciding makes no span


def test_the_root_ratio_samples_messages_without_a_traceparent() -> None:
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), Sampling.ratio(1.0))
    try:
        root = _message(None).trace
        assert root is not None and root.parent_span_id == 0
        non_parent_based = tracing.install(SimpleSpanProcessor(exporter),
                                           Sampling.ratio(0.0, parent_based=False))
        assert non_parent_based.sample(_record(SAMPLED)) is None  # the ratio, not the flag
    finally:
        tracing.shutdown()


@pytest.mark.parametrize(
    ("sampling", "traceparent", "expected"),
    [
        (Sampling.ratio(1.0), SAMPLED, "continued"),
        (Sampling.ratio(1.0), UNSAMPLED, None),  # the producer said no
        (Sampling.ratio(1.0), b"00-garbage-01", "root"),  # invalid: a root, by the ratio
        (Sampling.ratio(1.0), None, "root"),
        (Sampling.ratio(0.0), SAMPLED, "continued"),  # parent-based: the ratio is for roots
        (Sampling.ratio(0.0), b"00-garbage-01", None),
        (Sampling.ratio(1.0, parent_based=False), UNSAMPLED, "continued"),  # the ratio decides
        (Sampling.ratio(0.0, parent_based=False), SAMPLED, None),
        (Sampling(False, 0), None, None),
    ],
)
def test_each_sampler_decides_each_kind_of_incoming_context(
    sampling: Sampling, traceparent: bytes | None, expected: str | None,
) -> None:
    state = tracing.install(SimpleSpanProcessor(InMemorySpanExporter()), sampling)
    try:
        trace = state.sample(_record(traceparent))
    finally:
        tracing.shutdown()
    if expected is None:
        assert trace is None
    elif expected == "continued":
        assert trace is not None and (trace.trace_id, trace.parent_span_id) == (TRACE_ID,
                                                                                 PARENT_ID)
    else:
        assert trace is not None and trace.parent_span_id == 0 and trace.trace_id != TRACE_ID


def test_the_outbox_row_carries_the_handle_span_context_only_for_a_sampled_message(
    spans: InMemorySpanExporter,
) -> None:
    builder = ActionRowBuilder("action-tracked", datetime.now(UTC))
    session = SessionSnapshot(uuid.uuid4(), uuid.uuid4(), None, None)
    sampled, unsampled = _message(SAMPLED), _message(UNSAMPLED)
    assert sampled.trace is not None

    row = build_with(builder, sampled, session, uuid.uuid4(), uuid.uuid4()).outbox
    plain = build_with(builder, unsampled, session, uuid.uuid4(), uuid.uuid4()).outbox

    assert row.headers == {
        "traceparent": f"00-{TRACE_ID:032x}-{sampled.trace.handle_span_id:016x}-01"}
    assert plain.headers == {"traceparent": UNSAMPLED.decode()}  # passed through, as before


def test_a_committed_batch_makes_consume_handle_and_one_linked_insert_span(
    spans: InMemorySpanExporter,
) -> None:
    first, second, unsampled = _message(offset=1), _message(offset=2), _message(UNSAMPLED, 3)
    builder = ActionRowBuilder("action-tracked", datetime.now(UTC))
    session = SessionSnapshot(uuid.uuid4(), uuid.uuid4(), None, None)
    recorded = [build_with(builder, m, session, uuid.uuid4(), uuid.uuid4())
                for m in (first, unsampled)]
    outcome = BatchOutcome(recorded=recorded, no_session=[second],
                           written_ns=(1_000_000_000, 1_050_000_000))

    favorite_traces.trace_batch(outcome)

    finished = spans.get_finished_spans()
    consumes, handles = _by_name(finished, "consume"), _by_name(finished, "handle")
    (insert,) = _by_name(finished, "INSERT")
    assert len(consumes) == len(handles) == 2  # the unsampled message: no span at all
    assert first.trace is not None and second.trace is not None
    by_id = {span.context.span_id: span for span in handles}
    handle_1, handle_2 = by_id[first.trace.handle_span_id], by_id[second.trace.handle_span_id]
    for consume, handle in ((consumes[0], handle_1), (consumes[1], handle_2)):
        assert consume.kind is SpanKind.CONSUMER
        assert consume.parent is not None and consume.parent.span_id == PARENT_ID
        assert consume.context.trace_id == TRACE_ID
        assert handle.parent is not None and handle.parent.span_id == consume.context.span_id
    assert consumes[0].attributes == {
        "messaging.system": "kafka", "messaging.operation.type": "process",
        "messaging.operation.name": "consume", "messaging.destination.name": ADDED,
        "messaging.destination.partition.id": "3", "messaging.kafka.offset": 1,
        "messaging.consumer.group.name": "ua-favorites",
        "messaging.message.id": str(first.message_id),
    }
    assert handle_1.attributes is not None and handle_2.attributes is not None
    assert handle_1.attributes["user_activity.outcome"] == "recorded"
    assert handle_2.attributes["user_activity.outcome"] == "no-session"
    assert handle_1.status.status_code is StatusCode.OK
    assert handle_2.status.status_code is StatusCode.OK
    # the batch's one statement: a child of the first sampled handle, linked from the other
    assert insert.kind is SpanKind.CLIENT
    assert insert.parent is not None and insert.parent.span_id == first.trace.handle_span_id
    assert (insert.start_time, insert.end_time) == (1_000_000_000, 1_050_000_000)
    assert insert.attributes is not None and insert.attributes["db.operation.batch.size"] == 3
    assert [link.context.span_id for link in handle_2.links] == [insert.context.span_id]
    assert (handle_1.start_time, handle_1.end_time) == (1_000_000_000, 1_050_000_000)


def test_the_flow_traces_invalid_owner_duplicate_and_poison_at_once(
    spans: InMemorySpanExporter,
) -> None:
    envelope = favorite_envelope(anonymous_id=uuid.uuid4())
    records = [
        _record(SAMPLED, 1, orjson.dumps(envelope)),
        _record(SAMPLED, 2, orjson.dumps(envelope)),  # the same MessageId: a duplicate
        _record(SAMPLED, 3, orjson.dumps(favorite_envelope())),  # no owner: invalid-owner
        _record(SAMPLED, 4, b"not json"),  # poison
        _record(UNSAMPLED, 5, b"not json either"),  # poison, not sampled
    ]
    history: list[tuple[str, FavoriteMessage]] = []
    letters: list[DeadLetter] = []
    flow = build_flow(SETTINGS, source=TestingSource(records),
                      sinks=FavoritesSinks(TestingSink(history), TestingSink(letters)))

    run_main(flow)

    assert [m.trace is not None for _, m in history] == [True]
    handles = _by_name(spans.get_finished_spans(), "handle")
    outcomes = {}
    for span in handles:
        assert span.attributes is not None
        outcomes[span.attributes["user_activity.outcome"]] = span.status
    assert set(outcomes) == {"duplicate", "invalid-owner", "dead-lettered"}
    assert outcomes["duplicate"].status_code is StatusCode.OK
    assert outcomes["invalid-owner"].status_code is StatusCode.ERROR
    assert outcomes["dead-lettered"].status_code is StatusCode.ERROR
    assert outcomes["dead-lettered"].description == "dead-lettered: invalid-json"
    assert len(_by_name(spans.get_finished_spans(), "consume")) == 3


def test_publish_continues_the_stored_context_and_replaces_the_outgoing_traceparent(
    spans: InMemorySpanExporter,
) -> None:
    handle_context = f"00-{TRACE_ID:032x}-{0x1122334455667788:016x}-01"
    traced = OutboxRow(uuid.uuid4(), "action-tracked", b"k1", b"v", {"traceparent": handle_context})
    passed = OutboxRow(uuid.uuid4(), "action-tracked", b"k2", b"v",
                       {"traceparent": UNSAMPLED.decode()})
    swept = ("action-tracked", b"k3", b"v", [("traceparent", handle_context.encode())])

    records, publishing = tracing.start_publish([traced, passed, _Outgoing(*swept)])
    assert publishing is not None
    publishing.end([None, None, "MSG_SIZE_TOO_LARGE"])

    first, second = _by_name(spans.get_finished_spans(), "publish")
    assert first.kind is SpanKind.PRODUCER
    assert first.parent is not None and first.parent.span_id == 0x1122334455667788
    assert first.context.trace_id == TRACE_ID
    assert records[0].headers == {
        "traceparent": f"00-{TRACE_ID:032x}-{first.context.span_id:016x}-01"}
    assert records[1] is passed  # an unsampled stored context goes out as it is
    assert records[2].headers == [
        ("traceparent", f"00-{TRACE_ID:032x}-{second.context.span_id:016x}-01".encode())]
    assert first.attributes is not None
    assert first.attributes["messaging.message.id"] == str(traced.id)
    assert first.attributes["messaging.destination.name"] == "action-tracked"
    assert first.status.status_code is StatusCode.OK
    assert second.status.status_code is StatusCode.ERROR


def test_publish_applies_a_non_parent_based_ratio_as_the_decode_did() -> None:
    exporter = InMemorySpanExporter()
    state = tracing.install(SimpleSpanProcessor(exporter), Sampling.ratio(0.0, parent_based=False))
    try:
        message = _message(SAMPLED)  # the producer sampled it, our ratio (0) did not
        row = OutboxRow(uuid.uuid4(), "action-tracked", b"k", b"v",
                        {"traceparent": SAMPLED.decode()})
        records, publishing = state.start_publish([row])
    finally:
        tracing.shutdown()
    assert message.trace is None
    assert (records, publishing) == ([row], None)
    assert exporter.get_finished_spans() == ()


class _Outgoing:
    """A swept record (``sinks.kafka_producer.OutgoingRecord``'s shape: header pairs)."""

    def __init__(self, topic: str, key: bytes, value: bytes,
                 headers: list[tuple[str, bytes]]) -> None:
        self.topic, self.key, self.value, self.headers = topic, key, value, headers


def _sign_in(traceparent: bytes) -> SignInMessage:
    user, device = uuid.uuid4(), uuid.uuid4()
    value = orjson.dumps({
        "MessageId": str(uuid.uuid4()), "CreatedAt": "2026-11-29T08:00:00+00:00", "Version": 1,
        "AggregateId": str(user), "AggregateType": "User",
        "Payload": {"UserId": str(user), "AnonymousId": str(device),
                    "SignedInAt": "2026-11-29T08:00:00+00:00"},
    })
    decoded = decode_sign_in(SourceRecord("signed-in", 0, 9, None, value,
                                          (("traceparent", traceparent),)))
    assert isinstance(decoded, SignInMessage)
    return decoded


def test_session_linking_traces_each_sign_in_with_its_outcome(
    spans: InMemorySpanExporter,
) -> None:
    linked, late, unsampled = _sign_in(SAMPLED), _sign_in(SAMPLED), _sign_in(UNSAMPLED)
    session = uuid.uuid4()
    results = [
        LinkResult(linked, LinkOutcome.LINKED, session),
        LinkResult(late, LinkOutcome.LATE_CONFLICT, session,
                   conflict=ConflictReason.WOULD_RELINK),
        LinkResult(unsampled, LinkOutcome.STARTED, session),
    ]

    sign_in_traces.trace_batch(results, 2_000_000_000, 2_010_000_000)

    finished = spans.get_finished_spans()
    handles = {s.attributes["user_activity.outcome"]: s for s in _by_name(finished, "handle")
               if s.attributes is not None}
    (update,) = _by_name(finished, "UPDATE user_activity.sessions")
    assert set(handles) == {"linked", "late-conflict"}
    assert handles["linked"].status.status_code is StatusCode.OK
    assert handles["late-conflict"].status.status_code is StatusCode.ERROR
    assert handles["late-conflict"].status.description == "late-conflict: would-relink"
    assert update.parent is not None
    assert update.parent.span_id == handles["linked"].context.span_id
    assert [link.context.span_id for link in handles["late-conflict"].links] == [
        update.context.span_id]
    assert linked.trace is not None
    assert handles["linked"].context.span_id == linked.trace.handle_span_id
