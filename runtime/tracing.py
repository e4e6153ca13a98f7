"""OpenTelemetry traces of sampled messages, set up by the standard ``OTEL_*`` variables only.

On when ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` is set and ``OTEL_SDK_DISABLED`` is not
``true``: the SDK's ``BatchSpanProcessor`` exports over OTLP/HTTP (a full queue drops spans,
never blocks the flow). Off, every hook is one ``None`` check. Sampling is decided once per
message at decode (:func:`sample`; ``OTEL_TRACES_SAMPLER``/``_ARG``, default
``parentbased_always_on``): an unsampled message costs no span, id or clock read. Spans are made
finished once the outcome is known: ``consume <topic>`` (CONSUMER) > ``handle`` (INTERNAL, its
``user_activity.outcome``) > one database span (CLIENT) per batch, a child of the first sampled
``handle`` and linked from the others. :func:`start_publish` adds a ``publish <topic>`` span
(PRODUCER) whose ``traceparent`` the outgoing event carries.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue

from runtime.logs import log_event
from schemas.kafka_record import SourceRecord
from schemas.outbox import TRACEPARENT, MessageTrace, valid_traceparent

logger = logging.getLogger(__name__)

SERVICE_NAME = "user-activity-stream"
"""``service.name`` unless ``OTEL_SERVICE_NAME`` says otherwise."""

_LOW_64 = (1 << 64) - 1
_ALL = 1 << 64
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.OK)
_UNSET = Status(StatusCode.UNSET)
_BATCH_LINK: Mapping[str, AttributeValue] = {"user_activity.link": "batch-database-work"}
_DAY_NS = 86_400 * 10**9


@dataclass(frozen=True, slots=True)
class Sampling:
    """The per-message sampling rule (``OTEL_TRACES_SAMPLER`` / ``_ARG``).

    ``parent_based``: a valid incoming ``traceparent``'s flag decides; otherwise a trace id is
    sampled when its low 64 bits are below ``bound`` (``TraceIdRatioBased``'s rule).
    """

    parent_based: bool
    bound: int

    @classmethod
    def ratio(cls, ratio: float, *, parent_based: bool = True) -> Sampling:
        """Sample ``ratio`` (0..1) of the root traces."""
        return cls(parent_based, round(min(1.0, max(0.0, ratio)) * _ALL))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Sampling:
        """The rule the standard variables name; an unknown sampler warns and uses the default."""
        name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = float(arg) if arg else 1.0
        except ValueError:
            logger.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number: 1.0", arg)
            ratio = 1.0
        rules = {
            "always_on": cls(False, _ALL), "always_off": cls(False, 0),
            "traceidratio": cls.ratio(ratio, parent_based=False),
            "parentbased_always_on": cls(True, _ALL), "parentbased_always_off": cls(True, 0),
            "parentbased_traceidratio": cls.ratio(ratio)}
        if name not in rules:
            logger.warning("OTEL_TRACES_SAMPLER=%r is not supported: parentbased_always_on", name)
        return rules.get(name, rules["parentbased_always_on"])


def tracing_wanted(env: Mapping[str, str]) -> bool:
    """True when the variables ask for traces: an OTLP endpoint set, the SDK not disabled."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())


@dataclass(frozen=True, slots=True)
class Handled:
    """What became of one sampled message: the ``handle`` span's outcome and attributes."""

    trace: MessageTrace
    record: SourceRecord
    outcome: str
    message_id: str | None = None
    error: str | None = None
    """Set for an outcome that is a fault (span status ERROR with this description)."""
    attributes: Mapping[str, AttributeValue] | None = None


@dataclass(frozen=True, slots=True)
class DatabaseWork:
    """The one statement (or transaction) of a batch, for its database span."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class TracedRecord:
    """A record to produce with the ``traceparent`` of its ``publish`` span."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Any


class Tracing:
    """The process's span processor, sampling rule and resource.

    Spans are handed finished (``ReadableSpan``) to the processor's ``on_end``: no tracer.
    """

    def __init__(self, processor: SpanProcessor, sampling: Sampling, resource: Resource,
                 consumer_group: str) -> None:
        self.processor, self.sampling, self._resource = processor, sampling, resource
        self._scope = InstrumentationScope("user_activity_stream", _version())
        self._group = consumer_group

    def emit(  # noqa: PLR0917
        self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
        attributes: Mapping[str, AttributeValue], links: Sequence[Link], status: Status,
        start_ns: int, end_ns: int,
    ) -> None:
        """Hand one finished span to the processor (sampled: ``context`` carries the flag)."""
        self.processor.on_end(ReadableSpan(
            name, context, parent, self._resource, attributes, (), links, kind, None, status,
            start_ns, end_ns, self._scope))

    def sample(self, record: SourceRecord) -> MessageTrace | None:
        """The message's trace if sampled, else None (no valid ``traceparent``: a root)."""
        if not self.sampling.bound and not self.sampling.parent_based:
            return None
        parent = self._parent(record.header(TRACEPARENT))
        if parent is not None:
            trace_id, span_id, sampled = parent
            return MessageTrace(trace_id, span_id, _new_span_id()) if sampled else None
        trace_id = random.getrandbits(128) or 1
        if (trace_id & _LOW_64) >= self.sampling.bound:
            return None
        return MessageTrace(trace_id, 0, _new_span_id())

    def _parent(self, header: bytes | None) -> tuple[int, int, bool] | None:
        """A valid ``traceparent``'s trace id and span id, and whether this rule samples it."""
        parent = None if header is None else valid_traceparent(header)
        if parent is None:
            return None
        trace_id = int(parent[3:35], 16)
        sampled = (int(parent[53:55], 16) & 1 == 1 if self.sampling.parent_based
                   else (trace_id & _LOW_64) < self.sampling.bound)
        return trace_id, int(parent[36:52], 16), sampled

    def finish_messages(self, handled: Sequence[Handled], started_ns: int | None, ended_ns: int,
                        database: DatabaseWork | None = None) -> None:
        """The ``consume``, ``handle`` and database spans of a batch's sampled messages."""
        database_context: SpanContext | None = None
        emit = self.emit
        for item in handled:
            trace, record = item.trace, item.record
            trace_id = trace.trace_id
            handle_start = started_ns if started_ns is not None else ended_ns
            consume_start = _wall_ns(record.received_at, ended_ns) or handle_start
            if not handle_start - _DAY_NS <= consume_start <= handle_start:
                # another process's clock (a sign-in held in a snapshot across a restart)
                consume_start = handle_start
            parent = (SpanContext(trace_id, trace.parent_span_id, True, _SAMPLED)
                      if trace.parent_span_id else None)
            consume = SpanContext(trace_id, _new_span_id(), False, _SAMPLED)
            handle = SpanContext(trace_id, trace.handle_span_id, False, _SAMPLED)
            attributes: dict[str, AttributeValue] = {
                "messaging.system": "kafka", "messaging.operation.type": "process",
                "messaging.operation.name": "consume", "messaging.destination.name": record.topic,
                "messaging.destination.partition.id": str(record.partition),
                "messaging.kafka.offset": record.offset,
                "messaging.consumer.group.name": self._group}
            if item.message_id is not None:
                attributes["messaging.message.id"] = item.message_id
            handle_attributes: dict[str, AttributeValue] = {"user_activity.outcome": item.outcome,
                                                            **(item.attributes or {})}
            links = () if database_context is None else (Link(database_context, _BATCH_LINK),)
            if database_context is None and database is not None:
                database_context = SpanContext(trace_id, _new_span_id(), False, _SAMPLED)
                emit(database.name, database_context, handle, SpanKind.CLIENT,
                     database.attributes, (), _UNSET, database.start_ns, database.end_ns)
            status = _OK if item.error is None else Status(
                StatusCode.ERROR, f"{item.outcome}: {item.error}")
            emit("handle", handle, consume, SpanKind.INTERNAL, handle_attributes, links, status,
                 handle_start, ended_ns)
            emit(f"consume {record.topic}", consume, parent, SpanKind.CONSUMER, attributes, (),
                 _UNSET, consume_start, ended_ns)

    def start_publish(self, records: Sequence[Any]) -> tuple[list[Any], _Publishing | None]:
        """``records`` with a ``publish`` span for each sampled one (:func:`start_publish`).

        Under a non-parent-based rule the stored trace id must also pass the ratio: the
        decision its message got at decode.
        """
        out: list[Any] = []
        spans: list[_Pending | None] = []
        for record in records:
            headers = record.headers
            parent = self._parent(_stored_traceparent(headers))
            if parent is None or not parent[2]:
                out.append(record)
                spans.append(None)
                continue
            trace_id, parent_span_id, _ = parent
            attributes: dict[str, AttributeValue] = {
                "messaging.system": "kafka", "messaging.operation.type": "send",
                "messaging.operation.name": "publish", "messaging.destination.name": record.topic}
            message_id = getattr(record, "id", None)
            if message_id is not None:
                attributes["messaging.message.id"] = str(message_id)
            if record.key is not None:
                attributes["messaging.kafka.message.key"] = bytes(record.key).decode(
                    "utf-8", "replace")
            span_id = _new_span_id()
            traceparent = f"00-{trace_id:032x}-{span_id:016x}-01"
            out.append(TracedRecord(record.topic, record.key, record.value,
                                    _with_traceparent(headers, traceparent)))
            spans.append(_Pending(
                f"publish {record.topic}", SpanContext(trace_id, span_id, False, _SAMPLED),
                SpanContext(trace_id, parent_span_id, True, _SAMPLED), attributes, time.time_ns()))
        return out, (_Publishing(self, spans) if any(spans) else None)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A ``publish`` span waiting for the broker's answer."""

    name: str
    context: SpanContext
    parent: SpanContext
    attributes: Mapping[str, AttributeValue]
    start_ns: int


class _Publishing:
    """The ``publish`` spans of one produce call, ended with the broker's answers."""

    def __init__(self, tracing: Tracing, spans: list[_Pending | None]) -> None:
        self._tracing, self._spans = tracing, spans

    def end(self, errors: Sequence[object | None]) -> None:
        """End each span: OK when its record was acknowledged, ERROR with the error otherwise."""
        end_ns = time.time_ns()
        emit = self._tracing.emit
        for span, error in zip(self._spans, errors, strict=True):
            if span is None:
                continue
            status = _OK
            if error is not None:
                name = getattr(error, "name", None)
                status = Status(StatusCode.ERROR, name() if callable(name) else str(error))
            emit(span.name, span.context, span.parent, SpanKind.PRODUCER, span.attributes, (),
                 status, span.start_ns, end_ns)


def _stored_traceparent(headers: Any) -> bytes | None:
    """The ``traceparent`` among a record's headers (a mapping, or ``(name, value)`` pairs)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    value = next((item for name, item in reversed(list(pairs)) if name == TRACEPARENT), None)
    return None if value is None else value.encode() if isinstance(value, str) else bytes(value)


def _with_traceparent(headers: Any, traceparent: str) -> Any:
    """``headers`` (same container type) with ``traceparent`` replaced."""
    if isinstance(headers, Mapping):
        return {**headers, TRACEPARENT: traceparent}
    encoded = traceparent.encode()
    return [(name, encoded if name == TRACEPARENT else value) for name, value in headers]


def _new_span_id() -> int:
    return random.getrandbits(64) or 1


def _wall_ns(monotonic_at: float, now_ns: int) -> int | None:
    """The wall-clock time (ns) of a ``time.monotonic()`` reading; None for an unset one."""
    return None if monotonic_at <= 0 else now_ns - int((time.monotonic() - monotonic_at) * 1e9)


def _version() -> str:
    try:
        return metadata.version("user-activity-stream")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def resource_from_env(env: Mapping[str, str]) -> Resource:
    """Service name and version, pod, Bytewax process and first worker; ``OTEL_RESOURCE_*``."""
    process_id = env.get("BYTEWAX_PROCESS_ID", "").strip()
    pod = env.get("POD_NAME") or env.get("BYTEWAX_POD_NAME") or ""
    statefulset = env.get("BYTEWAX_STATEFULSET_NAME", "")
    if not process_id and pod and statefulset and pod.startswith(statefulset + "-"):
        process_id = pod[len(statefulset) + 1:]
    try:
        process = int(process_id or 0)
        per_process = int(env.get("BYTEWAX_WORKERS_PER_PROCESS", "") or 1)
    except ValueError:
        process, per_process = 0, 1
    attributes: dict[str, AttributeValue] = {
        "service.name": env.get("OTEL_SERVICE_NAME") or SERVICE_NAME, "service.version": _version(),
        "k8s.pod.name": pod or socket.gethostname(), "bytewax.process.id": process,
        "bytewax.worker.index": process * per_process}
    return Resource.create(attributes)  # OTEL_RESOURCE_ATTRIBUTES merged under these


_state: Tracing | None = None
_state_lock = threading.Lock()


def install(processor: SpanProcessor, sampling: Sampling, *, resource: Resource | None = None,
            consumer_group: str = "") -> Tracing:
    """Trace this process with ``processor`` and ``sampling`` (the demo and the tests)."""
    global _state  # noqa: PLW0603
    state = Tracing(processor, sampling, resource or resource_from_env(os.environ), consumer_group)
    with _state_lock:
        _state = state
    return state


def configure_from_env(consumer_group: str = "", env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on if the ``OTEL_*`` variables ask for it; True if on (idempotent)."""
    env = os.environ if env is None else env
    if _state is not None or not tracing_wanted(env):
        return _state is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    sampling = Sampling.from_env(env)
    install(BatchSpanProcessor(OTLPSpanExporter()), sampling, resource=resource_from_env(env),
            consumer_group=consumer_group)
    logger.info("tracing on: OTLP/HTTP to %s, sampler %s %s", env.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"), env.get(
        "OTEL_TRACES_SAMPLER", "parentbased_always_on"), env.get("OTEL_TRACES_SAMPLER_ARG", ""))
    return True


SHUTDOWN_FLUSH_SECONDS = 2.0
"""The longest the spans still queued at exit may take to export (the rest is dropped)."""


def shutdown(timeout: float = SHUTDOWN_FLUSH_SECONDS) -> None:
    """Flush and stop tracing, waiting at most ``timeout`` (then ``tracing-flush-abandoned``).

    The SDK's shutdown waits on an unanswering collector, so it runs on a daemon thread.
    """
    global _state
    with _state_lock:
        state, _state = _state, None
    if state is None:
        return
    flushing = threading.Thread(target=state.processor.shutdown, name="tracing-flush", daemon=True)
    flushing.start()
    flushing.join(timeout)
    if flushing.is_alive():
        log_event(logger, "tracing-flush-abandoned", logging.WARNING, waited_s=round(timeout, 1),
                  consequence="spans not exported yet are dropped (the collector did not"
                              " answer in time); the stop goes on")


def enabled() -> bool:
    """True while tracing is on in this process."""
    return _state is not None


def sample(record: SourceRecord) -> MessageTrace | None:
    """The message's trace if tracing is on and it is sampled, else None (module doc)."""
    state = _state
    return None if state is None else state.sample(record)


def finish_messages(handled: Sequence[Handled], started_ns: int | None = None,
                    ended_ns: int | None = None, database: DatabaseWork | None = None) -> None:
    """The spans of ``handled``, decided from ``started_ns`` (None: instantly) to ``ended_ns``.

    ``ended_ns`` None: now. ``database`` is the batch's one statement.
    """
    state = _state
    if state is None or not handled:
        return
    state.finish_messages(
        handled, started_ns, ended_ns if ended_ns is not None else time.time_ns(), database)


def finish_alone(record: SourceRecord, outcome: str, *, message_id: str | None = None,
                 error: str | None = None,
                 attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """Sample and trace a message decided on its own, at once (invalid, poison, duplicate)."""
    state = _state
    if state is None:
        return
    trace = state.sample(record)
    if trace is not None:
        state.finish_messages(
            [Handled(trace, record, outcome, message_id, error, attributes)], None, time.time_ns())


def start_publish(records: Sequence[Any]) -> tuple[Sequence[Any], _Publishing | None]:
    """``records`` to produce, each sampled one with its ``publish`` span's ``traceparent``.

    Also the spans to end with the delivery results (None: nothing sampled).
    """
    state = _state
    if state is None:
        return records, None
    return state.start_publish(records)

