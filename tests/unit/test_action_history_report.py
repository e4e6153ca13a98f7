"""The favorites sink's batched ``report``: the same lines and metrics as one message at a time."""

from __future__ import annotations

import io
import logging
import random
import re
from collections.abc import Callable, Iterator

import orjson
import pytest
from prometheus_client import REGISTRY

from bench.report_cost import make_outcomes, old_report
from runtime.logs import JsonFormatter
from sinks.action_history import _ActionHistoryPartition
from sinks.action_history import logger as sink_logger
from sinks.favorites_store import BatchOutcome

_TS = re.compile(r'^\{"ts":"[^"]*",')
_SAMPLES = [
    ("user_activity_favorites_recorded_total", {"action_type": "AddToFavorites"}),
    ("user_activity_favorites_recorded_total", {"action_type": "RemoveFromFavorites"}),
    ("user_activity_favorites_skipped_total", {"reason": "duplicate"}),
    ("user_activity_favorites_skipped_total", {"reason": "no-session"}),
    ("user_activity_favorites_consume_duration_ms_count", {}),
]


@pytest.fixture
def sink_log() -> Iterator[Callable[[], io.StringIO]]:
    """Call it in the test: the sink logger's lines go to a StringIO through the JSON formatter."""
    saved = sink_logger.handlers[:], sink_logger.propagate, sink_logger.level
    stream = io.StringIO()

    def start() -> io.StringIO:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter())
        sink_logger.handlers[:] = [handler]  # alone (pytest attaches its own at each phase)
        sink_logger.propagate = False
        sink_logger.setLevel(logging.INFO)
        return stream

    yield start
    sink_logger.handlers[:], sink_logger.propagate, _ = saved
    sink_logger.setLevel(saved[2])


def _run(report: Callable[[BatchOutcome], None], outcomes: list[BatchOutcome],
         stream: io.StringIO) -> tuple[list[str], list[float]]:
    stream.seek(0)
    stream.truncate()
    before = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in _SAMPLES]
    for outcome in outcomes:
        report(outcome)
    after = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in _SAMPLES]
    lines = [_TS.sub("{", line) for line in stream.getvalue().splitlines()]
    return lines, [b - a for a, b in zip(before, after, strict=True)]


def test_batched_report_writes_the_same_lines_and_counts_as_per_message_report(
    sink_log: Callable[[], io.StringIO],
) -> None:
    outcomes = make_outcomes(600, 200, random.Random(7), skip_share=0.1)
    messages = sum(len(o.recorded) + len(o.duplicates) + len(o.no_session) for o in outcomes)
    stream = sink_log()
    partition = object.__new__(_ActionHistoryPartition)  # report uses no instance state

    old_lines, old_deltas = _run(old_report, outcomes, stream)
    new_lines, new_deltas = _run(partition.report, outcomes, stream)

    assert len(new_lines) == messages
    assert new_lines == old_lines
    assert new_deltas == old_deltas
    assert sum(new_deltas[:4]) == messages
    assert new_deltas[4] == messages
    events = {orjson.loads(line)["event"] for line in new_lines}
    assert events == {"recorded", "skipped-duplicate", "skipped-no-session"}
    recorded = next(orjson.loads(line) for line in new_lines if '"event":"recorded"' in line)
    assert list(recorded) == [
        "level", "logger", "event", "outcome", "SessionId", "MessageId", "FavoriteId",
        "PropertyObjectId", "ActionType", "source",
    ]
