"""The favorites sink's batched ``report``: one JSON line per message, counters moved per batch.

The expected lines are written out: one per message, each outcome's recorded messages first,
then its duplicates, then its no-session skips, with the SPEC §6 fields only. They must come
out the same whether ``log_events`` renders a batch itself (the plain JSON handler) or falls
back to one ``log_event`` per row (a handler with a filter).
"""

from __future__ import annotations

import io
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import orjson
import pytest
from prometheus_client import REGISTRY

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.records import RecordedAction
from dataflows.favorite_actions.sink import _ActionHistoryPartition
from dataflows.favorite_actions.sink import logger as sink_logger
from dataflows.favorite_actions.store import BatchOutcome
from runtime.logs import JsonFormatter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from tests.rows import SessionSnapshot, build_recorded_action

ADDED, REMOVED = "favorite-added", "favorite-removed"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES, REMOVED: ActionType.REMOVE_FROM_FAVORITES}
_TS = re.compile(r'^\{"ts":"[^"]*",')
_SAMPLES = [
    ("user_activity_favorites_recorded_total", {"action_type": "AddToFavorites"}),
    ("user_activity_favorites_recorded_total", {"action_type": "RemoveFromFavorites"}),
    ("user_activity_favorites_skipped_total", {"reason": "duplicate"}),
    ("user_activity_favorites_skipped_total", {"reason": "no-session"}),
    ("user_activity_favorites_consume_duration_ms_count", {}),
    ("user_activity_favorites_write_duration_ms_count", {}),
    ("user_activity_favorites_write_duration_ms_sum", {}),
]


def _id(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def _message(n: int, topic: str, offset: int, *, user: bool = False) -> FavoriteMessage:
    """MessageId ``_id(n)``, FavoriteId ``_id(100 + n)``, PropertyObjectId ``_id(200 + n)``."""
    owner = _id(300 + n)
    value = orjson.dumps({
        "MessageId": _id(n), "CreatedAt": "2026-11-29T08:00:00+00:00", "Version": 1,
        "AggregateId": "f", "AggregateType": "Favorite", "CorrelationId": "c",
        "Payload": {
            "FavoriteId": _id(100 + n).upper(), "PropertyObjectId": _id(200 + n),
            "AnonymousId": None if user else owner, "UserId": owner if user else None,
            "OccurredAt": "2026-11-29T07:59:59+00:00",
        },
    })
    record = SourceRecord(topic, n % 3, offset, b"k", value, (), time.monotonic() - 0.05)
    message = decode_favorite(record, ACTION_TYPES)
    assert isinstance(message, FavoriteMessage)
    return message


def _recorded(message: FavoriteMessage, session: int) -> RecordedAction:
    snapshot = SessionSnapshot(uuid.UUID(_id(session)), uuid.UUID(_id(900)), None, None)
    return build_recorded_action(
        message, snapshot, action_event_id=uuid.uuid4(), outbox_message_id=uuid.uuid4(),
        topic="action-tracked", now=datetime.now(UTC),
    )


def _outcomes() -> list[BatchOutcome]:
    return [
        BatchOutcome(
            recorded=[_recorded(_message(1, ADDED, 10), session=501),
                      _recorded(_message(2, REMOVED, 11, user=True), session=502)],
            duplicates=[_message(3, ADDED, 12)],
            no_session=[_message(4, REMOVED, 13)],
            written_ns=(1_000_000, 3_500_000),  # its statement took 2.5 ms to commit
        ),
        BatchOutcome(),  # nothing committed: no line, no count
        BatchOutcome(recorded=[_recorded(_message(5, ADDED, 14), session=505)],
                     no_session=[_message(6, ADDED, 15, user=True)],
                     written_ns=(2_000_000, 42_000_000)),  # 40 ms
    ]


def _line(event: str, n: int, topic: str, offset: int, session: int | None = None) -> str:
    action = "AddToFavorites" if topic == ADDED else "RemoveFromFavorites"
    session_field = "" if session is None else f'"SessionId":"{_id(session)}",'
    return (
        f'{{"level":"INFO","logger":"{sink_logger.name}","event":"{event}",'
        f'"outcome":"{event}",{session_field}"MessageId":"{_id(n)}",'
        f'"FavoriteId":"{_id(100 + n)}","PropertyObjectId":"{_id(200 + n)}",'
        f'"ActionType":"{action}","source":"{topic}[{n % 3}]@{offset}"}}'
    )


EXPECTED_LINES = [
    _line("recorded", 1, ADDED, 10, session=501),
    _line("recorded", 2, REMOVED, 11, session=502),
    _line("skipped-duplicate", 3, ADDED, 12),
    _line("skipped-no-session", 4, REMOVED, 13),
    _line("recorded", 5, ADDED, 14, session=505),
    _line("skipped-no-session", 6, ADDED, 15),
]


@pytest.fixture(params=["batched", "per-record"])
def sink_log(request: pytest.FixtureRequest) -> Iterator[Callable[[], io.StringIO]]:
    """Call it in the test: the sink logger's lines go to a StringIO through the JSON formatter.

    ``per-record``: the handler has a filter, so ``log_events`` writes one record per row.
    """
    saved = sink_logger.handlers[:], sink_logger.propagate, sink_logger.level
    stream = io.StringIO()

    def start() -> io.StringIO:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter())
        if request.param == "per-record":
            handler.addFilter(lambda _record: True)
        sink_logger.handlers[:] = [handler]  # alone (pytest attaches its own at each phase)
        sink_logger.propagate = False
        sink_logger.setLevel(logging.INFO)
        return stream

    yield start
    sink_logger.handlers[:], sink_logger.propagate, _ = saved
    sink_logger.setLevel(saved[2])


def test_report_writes_one_line_per_message_and_moves_each_counter_once(
    sink_log: Callable[[], io.StringIO],
) -> None:
    outcomes = _outcomes()
    stream = sink_log()
    partition = object.__new__(_ActionHistoryPartition)  # report uses no instance state
    before = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in _SAMPLES]

    for outcome in outcomes:
        partition.report(outcome)

    after = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in _SAMPLES]
    lines = [_TS.sub("{", line) for line in stream.getvalue().splitlines()]
    assert lines == EXPECTED_LINES
    assert all(_TS.match(line) for line in stream.getvalue().splitlines())
    # recorded Add / Remove, skipped duplicate / no-session, consume-duration observations,
    # write-duration observations (one per committed batch) and their milliseconds
    deltas = [b - a for a, b in zip(before, after, strict=True)]
    assert deltas[:-1] == [2, 1, 1, 2, 6, 2]
    # the histogram's sum is a float over every observation of the session (other tests
    # observe real durations first), so its difference carries that sum's rounding
    assert deltas[-1] == pytest.approx(42.5, abs=1e-6)
