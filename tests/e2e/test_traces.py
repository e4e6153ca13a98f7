"""Traces end to end: the real job (``python -m bytewax.run``) -> a real OTLP/HTTP receiver.

The job is configured by the ``OTEL_*`` variables only; the receiver is the test's own
``http.server`` decoding ``ExportTraceServiceRequest`` protobuf (:mod:`devenv.otlp_receiver`).
A favorite (and a sign-in) produced with a known, sampled trace id yields its consume, handle,
database and publish spans with that trace id, and the event on the topic carries a
``traceparent`` with that trace id and the publish span's id; an unsampled one yields no span
and its traceparent passes through as it came. A sign-in the sink dead-letters (a failure
injected into the store for that one message, as ``test_session_linking`` does) ends its trace
with an ERROR ``handle`` span (the in-memory exporter, the flow in-process).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from dataflows.session_linking import build_flow as build_session_linking_flow
from devenv.harness.jobs import SESSION_LINKING_FLOW, JobSupervisor, wait_until
from devenv.harness.messages import favorite_envelope, new_id, sign_in_envelope
from devenv.harness.sessions import insert_session
from devenv.harness.stream import PacedProducer, good_stream
from devenv.otlp_receiver import OtlpReceiver, ReceivedSpan
from runtime import tracing
from runtime.tracing import Sampling
from tests.chaos import (
    assert_exact_outcome,
    count_log_events,
    fail_sign_in_batches_of,
    stop_job,
    wait_until_drained,
)
from tests.conftest import SettingsFactory
from tests.support import consume_all, envelope_record, produce, run_flow

pytestmark = pytest.mark.e2e

# This module's own trace id: outbox rows other tests leave behind (with the unit tests' well-known
# id) are published by whichever job holds the lease, and must not count as this trace's spans.
TRACE_ID = uuid.uuid4().hex
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01".encode()
UNSAMPLED_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
UNSAMPLED = f"00-{UNSAMPLED_TRACE_ID}-b7ad6b7169203331-00".encode()


def _otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "user-activity-stream-test",
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: export promptly
    }


def _one(spans: list[ReceivedSpan], prefix: str) -> ReceivedSpan:
    found = [span for span in spans if span.name.startswith(prefix)]
    assert len(found) == 1, [span.name for span in spans]
    return found[0]


def _trace(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    return [span for span in receiver.spans() if span.trace_id == trace_id]


def test_a_sampled_favorite_is_one_trace_from_the_producer_through_action_tracked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    settings = make_settings(tail=False)
    device = new_id()
    insert_session(db, anonymous_id=device)
    traced = favorite_envelope(anonymous_id=device)
    untraced = favorite_envelope(anonymous_id=device)
    produce(settings, [
        envelope_record(settings.topic_favorite_added, traced,
                        headers=(("traceparent", SAMPLED),)),
        envelope_record(settings.topic_favorite_added, untraced,
                        headers=(("traceparent", UNSAMPLED),)),
    ])

    with OtlpReceiver() as receiver:
        job = jobs.job(settings, tail=False, extra_env=_otel_env(receiver))
        job.start()
        assert job.wait(120) == 0, job.log_tail()
        wait_until(lambda: len(_trace(receiver, TRACE_ID)) >= 4, 30, "the trace's spans")
        spans = _trace(receiver, TRACE_ID)
        untraced_spans = _trace(receiver, UNSAMPLED_TRACE_ID)

    consume, handle = _one(spans, "consume"), _one(spans, "handle")
    insert, publish = _one(spans, "INSERT"), _one(spans, "publish")
    assert consume.parent_span_id == PARENT_ID and consume.kind == "CONSUMER"
    assert consume.attributes["messaging.system"] == "kafka"
    assert consume.attributes["messaging.destination.name"] == settings.topic_favorite_added
    assert consume.attributes["messaging.message.id"] == traced["MessageId"]
    assert {"messaging.destination.partition.id", "messaging.kafka.offset"} <= set(
        consume.attributes)
    assert handle.parent_span_id == consume.span_id
    assert handle.attributes["user_activity.outcome"] == "recorded"
    assert handle.status == "OK"
    assert insert.parent_span_id == handle.span_id and insert.kind == "CLIENT"
    assert insert.attributes["db.system.name"] == "postgresql"
    assert publish.parent_span_id == handle.span_id and publish.kind == "PRODUCER"
    assert publish.attributes["messaging.destination.name"] == settings.topic_action_tracked
    assert consume.start_ns <= handle.start_ns <= insert.start_ns <= insert.end_ns
    assert insert.end_ns <= handle.end_ns <= consume.end_ns <= publish.end_ns
    assert consume.resource["service.name"] == "user-activity-stream-test"
    assert consume.resource["bytewax.worker.index"] == 0
    assert "service.version" in consume.resource and "k8s.pod.name" in consume.resource
    assert untraced_spans == []

    tracked = {
        record.json()["Payload"]["FavoriteId"].lower(): record
        for record in consume_all(settings, settings.topic_action_tracked, expect_at_least=2)
    }
    assert tracked[traced["Payload"]["FavoriteId"].lower()].header("traceparent") == (
        f"00-{TRACE_ID}-{publish.span_id}-01".encode())
    assert tracked[untraced["Payload"]["FavoriteId"].lower()].header("traceparent") == UNSAMPLED


def test_a_sampled_sign_in_is_one_trace_through_session_linked(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], jobs: JobSupervisor,
) -> None:
    settings = make_settings(tail=False, session_linking_lateness_seconds=0)
    device, user = new_id(), new_id()
    insert_session(db, anonymous_id=device)
    envelope = sign_in_envelope(user_id=user, anonymous_id=device)
    produce(settings, [envelope_record(settings.topic_user_signed_in, envelope,
                                       headers=(("traceparent", SAMPLED),))])

    with OtlpReceiver() as receiver:
        job = jobs.job(settings, flow=SESSION_LINKING_FLOW, tail=False,
                       extra_env=_otel_env(receiver))
        job.start()
        assert job.wait(120) == 0, job.log_tail()
        wait_until(lambda: len(_trace(receiver, TRACE_ID)) >= 4, 30, "the trace's spans")
        spans = _trace(receiver, TRACE_ID)

    consume, handle = _one(spans, "consume"), _one(spans, "handle")
    update, publish = _one(spans, "UPDATE user_activity.sessions"), _one(spans, "publish")
    assert consume.parent_span_id == PARENT_ID
    assert consume.attributes["messaging.message.id"] == envelope["MessageId"]
    assert handle.parent_span_id == consume.span_id
    assert handle.attributes["user_activity.outcome"] == "linked"
    assert update.parent_span_id == handle.span_id
    assert publish.parent_span_id == handle.span_id
    [linked] = consume_all(settings, settings.topic_session_linked, expect_at_least=1)
    assert linked.header("traceparent") == f"00-{TRACE_ID}-{publish.span_id}-01".encode()
    assert uuid.UUID(linked.json()["Payload"]["AnonymousId"]) == device


def test_a_sampled_sign_in_dead_lettered_by_the_sink_ends_its_trace_with_an_error(
    make_settings: SettingsFactory, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(tail=False, session_linking_lateness_seconds=0)
    good_device, poison_device, user = new_id(), new_id(), new_id()
    insert_session(db, anonymous_id=good_device)
    insert_session(db, anonymous_id=poison_device)
    fail_sign_in_batches_of(monkeypatch, poison_device)
    poison_parent = f"00-{UNSAMPLED_TRACE_ID}-b7ad6b7169203331-01".encode()
    produce(settings, [
        envelope_record(settings.topic_user_signed_in,
                        sign_in_envelope(user_id=user, anonymous_id=good_device),
                        headers=(("traceparent", SAMPLED),), partition=2),
        envelope_record(settings.topic_user_signed_in,
                        sign_in_envelope(user_id=user, anonymous_id=poison_device),
                        headers=(("traceparent", poison_parent),), partition=2),
    ])
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), Sampling.ratio(0.0))
    try:
        run_flow(build_session_linking_flow, settings)
    finally:
        tracing.shutdown()

    handles = {span.context.trace_id: span for span in exporter.get_finished_spans()
               if span.name == "handle"}
    poisoned, linked = handles[int(UNSAMPLED_TRACE_ID, 16)], handles[int(TRACE_ID, 16)]
    assert poisoned.attributes is not None and linked.attributes is not None
    assert poisoned.attributes["user_activity.outcome"] == "dead-lettered"
    assert poisoned.status.status_code is StatusCode.ERROR
    assert poisoned.status.description == "dead-lettered: processing-error"
    assert linked.attributes["user_activity.outcome"] == "linked"
    assert linked.status.status_code is StatusCode.OK


class _SilentCollector:
    """A TCP listener that accepts connections and never answers: a hung OTLP collector."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self.endpoint = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self._held.append(self._socket.accept()[0])

    def close(self) -> None:
        self._socket.close()
        for held in self._held:
            held.close()


def test_a_collector_that_never_answers_does_not_hold_up_a_clean_stop(
    make_settings: SettingsFactory, database_url: str, jobs: JobSupervisor,
) -> None:
    """The spans queued at exit are flushed for 2 s at most, then dropped; the stop goes on.

    Before: the SDK's shutdown waited for its worker, whose export to this collector waited
    the exporter's 10 s time-out and retried: the stop took 20 s and ended in the harness's
    SIGKILL (-9; Kubernetes' grace is 30 s), every message recorded all the same.
    """
    settings = make_settings(tail=True)
    stream = good_stream(settings, database_url, 6_000, seed=31)
    collector = _SilentCollector()
    try:
        job = jobs.job(settings, extra_env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
                                            "OTEL_SERVICE_NAME": "user-activity-stream-test",
                                            "OTEL_BSP_SCHEDULE_DELAY": "200"})
        job.start()
        producer = PacedProducer(settings, stream.records, rate=2_000)
        producer.start()
        deliveries = producer.result()
        wait_until_drained(job, database_url, stream)
        stopped = stop_job(job)
    finally:
        collector.close()
    assert stopped["stop_exit_code"] == 0, stopped
    assert stopped["stop_s"] is not None and stopped["stop_s"] < 10, stopped  # the job's clock
    wait_until(lambda: count_log_events(job, "tracing-flush-abandoned") == 1, 5,
               "the abandoned flush said once")
    assert_exact_outcome(settings, database_url, stream, deliveries)
