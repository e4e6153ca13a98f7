"""The favorites sink's spans against a real PostgreSQL (the SDK's in-memory exporter).

A committed batch gives each sampled message its consume and handle spans and the batch one
``INSERT`` span with the transaction's real start and commit times, also when the commit was
deferred; the outbox row stored in the database carries the handle span's ``traceparent``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import psycopg
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.sink import _ActionHistoryPartition
from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import insert_session
from runtime import tracing
from runtime.process import Process
from runtime.settings import Settings
from runtime.tracing import Sampling
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from tests.chaos import outbox_locked

pytestmark = pytest.mark.integration

ADDED = "favorite-added"
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter), Sampling.ratio(0.0))  # roots off
    yield exporter
    tracing.shutdown()


def _messages(db: psycopg.Connection[Any], count: int, sampled: set[int]) -> list[FavoriteMessage]:
    device = uuid.uuid4()
    insert_session(db, anonymous_id=device)
    messages = []
    for offset in range(count):
        flags = "01" if offset in sampled else "00"
        headers = (("traceparent", f"00-{TRACE_ID:032x}-{offset + 1:016x}-{flags}".encode()),)
        value = orjson.dumps(favorite_envelope(anonymous_id=device))
        record = SourceRecord(ADDED, 0, offset, b"k", value, headers, time.monotonic())
        message = decode_favorite(record, {ADDED: ActionType.ADD_TO_FAVORITES})
        assert isinstance(message, FavoriteMessage)
        messages.append(message)
    return messages


def _partition(database_url: str, **overrides: Any) -> _ActionHistoryPartition:
    settings = Settings(
        database_url=database_url, kafka_bootstrap_servers="127.0.0.1:1", outbox_enabled=False,
        http_port=0, topic_action_tracked="t.traced.action-tracked", **overrides,
    )
    return _ActionHistoryPartition(settings, Process(), None, f"traced-{uuid.uuid4().hex[:6]}")


def _stored_headers(database_url: str, message: FavoriteMessage) -> Any:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT o.headers FROM user_activity.outbox o"
            "  JOIN user_activity.action_events e ON o.action_event_id = e.id"
            " WHERE e.source_message_id = %s", (message.message_id,),
        ).fetchone()
    assert row is not None
    return row[0]


def test_a_committed_batch_traces_its_sampled_messages_and_its_insert(
    db: psycopg.Connection[Any], database_url: str, spans: InMemorySpanExporter,
) -> None:
    messages = _messages(db, 6, sampled={1, 4})
    part = _partition(database_url)
    before = time.time_ns()
    try:
        part.write_batch(messages)
    finally:
        part.close()
    after = time.time_ns()

    finished = spans.get_finished_spans()
    handles = [s for s in finished if s.name == "handle"]
    (insert,) = [s for s in finished if s.name.startswith("INSERT")]
    assert len(handles) == 2 and len([s for s in finished if s.name.startswith("consume")]) == 2
    first, second = messages[1], messages[4]
    assert first.trace is not None and second.trace is not None
    assert insert.parent is not None and insert.parent.span_id == first.trace.handle_span_id
    assert insert.start_time is not None and insert.end_time is not None
    assert before <= insert.start_time < insert.end_time <= after
    assert insert.attributes is not None and insert.attributes["db.operation.batch.size"] == 6
    linked = next(s for s in handles if s.context.span_id == second.trace.handle_span_id)
    assert [link.context.span_id for link in linked.links] == [insert.context.span_id]
    assert _stored_headers(database_url, first) == {"traceparent": first.trace.traceparent}
    assert _stored_headers(database_url, messages[0]) == {  # unsampled: as it came
        "traceparent": f"00-{TRACE_ID:032x}-{1:016x}-00"}


def test_a_deferred_batch_s_insert_span_lasts_until_its_commit(
    db: psycopg.Connection[Any], database_url: str, spans: InMemorySpanExporter,
) -> None:
    messages = _messages(db, 12, sampled={0})
    part = _partition(database_url, sink_defer_min_batch=10)
    # the sent insert waits inside PostgreSQL until released
    with outbox_locked(database_url) as release:
        try:
            part.write_batch(messages)  # deferred: returns before the commit
            assert spans.get_finished_spans() == ()  # no outcome yet, no span yet
            time.sleep(0.3)
            released_at = time.time_ns()
            release.set()
            part.snapshot()  # waits for the commit, then reports
        finally:
            release.set()
            part.close()

    (insert,) = [s for s in spans.get_finished_spans() if s.name.startswith("INSERT")]
    assert insert.start_time is not None and insert.end_time is not None
    assert insert.start_time < released_at <= insert.end_time
