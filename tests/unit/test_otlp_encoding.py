"""The direct OTLP encoder writes what the SDK exporter's encoder builds; the exporter sends it.

Property-based: any span of the kinds, attribute types, links, events, statuses and parents the
SDK allows parses (``ExportTraceServiceRequest``) to the message of the exporter's own
``encode_spans``. Then :class:`~runtime.otlp_export.OtlpSpanExporter` exports spans over HTTP to
a real OTLP/HTTP receiver (``devenv.otlp_receiver``) that decodes them with
``opentelemetry-proto``.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from devenv.otlp_receiver import OtlpReceiver
from runtime.otlp_encoding import encode_request
from runtime.otlp_export import OtlpSpanExporter

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_SCALAR = st.one_of(st.text(max_size=20), st.booleans(), _INT64,
                    st.floats(allow_nan=False), st.binary(max_size=20))
_VALUE = st.one_of(_SCALAR, st.lists(st.one_of(st.text(max_size=8), _INT64), max_size=4))
_ATTRIBUTES = st.dictionaries(st.text(min_size=1, max_size=12), _VALUE, max_size=6)
_TRACE_ID = st.integers(min_value=1, max_value=2**128 - 1)
_SPAN_ID = st.integers(min_value=1, max_value=2**64 - 1)
_STATE = st.sampled_from([TraceState(), TraceState([("vendor", "v1"), ("other", "x")])])


@st.composite
def _contexts(draw: Any, *, remote: bool | None = None) -> SpanContext:
    return SpanContext(
        draw(_TRACE_ID), draw(_SPAN_ID), draw(st.booleans()) if remote is None else remote,
        TraceFlags(TraceFlags.SAMPLED), draw(_STATE),
    )


_RESOURCES = [Resource.create({"service.name": "a", "k8s.pod.name": "p-0", "n": 3}),
              Resource({"service.name": "b"}, "https://opentelemetry.io/schemas/1.21.0")]
_SCOPES = [InstrumentationScope("user_activity_stream", "1.2.3"),
           InstrumentationScope("other", None, "https://example.org/s", {"scope.attr": "x"}),
           None]


@st.composite
def _spans(draw: Any) -> ReadableSpan:
    code = draw(st.sampled_from(list(StatusCode)))
    description = draw(st.text(max_size=10)) if code is StatusCode.ERROR else None
    start = draw(st.integers(min_value=0, max_value=2**63))
    return ReadableSpan(
        draw(st.text(max_size=30)),
        draw(_contexts(remote=False)),
        draw(st.one_of(st.none(), _contexts())),
        draw(st.sampled_from(_RESOURCES)),
        draw(_ATTRIBUTES),
        [Event(draw(st.text(max_size=8)), draw(_ATTRIBUTES), draw(st.integers(0, 2**63)))
         for _ in range(draw(st.integers(0, 2)))],
        [Link(draw(_contexts()), draw(_ATTRIBUTES)) for _ in range(draw(st.integers(0, 3)))],
        draw(st.sampled_from(list(SpanKind))),
        None,
        Status(code, description),
        start,
        start + draw(st.integers(min_value=0, max_value=10**12)),
        draw(st.sampled_from(_SCOPES)),
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(_spans(), min_size=1, max_size=6))
def test_the_direct_encoding_parses_to_the_exporters_own_message(
    spans: list[ReadableSpan],
) -> None:
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(encode_request(spans))

    assert ours == encode_spans(spans)


def test_the_exporter_sends_the_encoded_spans_to_a_real_receiver() -> None:
    parent = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True,
                         TraceFlags(TraceFlags.SAMPLED))
    context = SpanContext(parent.trace_id, 0x1122334455667788, False,
                          TraceFlags(TraceFlags.SAMPLED))
    span = ReadableSpan(
        "consume favorites", context, parent, _RESOURCES[0],
        {"messaging.system": "kafka", "messaging.kafka.offset": 7}, (), (),
        SpanKind.CONSUMER, None, Status(StatusCode.OK), 1_000, 2_000, _SCOPES[0],
    )
    with OtlpReceiver() as receiver:
        exporter = OtlpSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")
        try:
            assert exporter.export([span]) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        (received,) = receiver.spans()
    assert exporter.export([span]) is SpanExportResult.FAILURE  # after shutdown: refused
    assert (received.trace_id, received.span_id, received.parent_span_id) == (
        "4bf92f3577b34da6a3ce929d0e0e4736", "1122334455667788", "00f067aa0ba902b7")
    assert (received.name, received.kind, received.status) == (
        "consume favorites", "CONSUMER", "OK")
    assert (received.start_ns, received.end_ns) == (1_000, 2_000)
    assert received.attributes == {"messaging.system": "kafka", "messaging.kafka.offset": 7}
    assert received.resource["k8s.pod.name"] == "p-0"
