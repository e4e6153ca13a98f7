"""JSON log lines and the librdkafka repeat throttle."""

from __future__ import annotations

import logging

import orjson
import pytest

from runtime.logs import JsonFormatter, RepeatThrottle


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("librdkafka", logging.ERROR, __file__, 1, message, None, None)


def test_a_repeated_librdkafka_line_passes_once_per_window_and_counts_the_rest() -> None:
    throttle = RepeatThrottle(window=3600)
    lines = [
        f"FAIL [user-activity-stream#consumer-{n}] 127.0.0.1:2{n}/bootstrap: Connection refused"
        for n in range(50)
    ]

    passed = [throttle.filter(_record(line)) for line in lines]

    assert passed.count(True) == 1


def test_the_next_line_after_a_window_reports_how_many_were_suppressed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("runtime.logs.time.monotonic", lambda: clock[0])
    throttle = RepeatThrottle(window=10)
    assert throttle.filter(_record("FAIL broker 1 down"))
    assert not throttle.filter(_record("FAIL broker 2 down"))
    assert not throttle.filter(_record("FAIL broker 3 down"))
    clock[0] = 111.0
    later = _record("FAIL broker 4 down")

    passed = throttle.filter(later)

    assert passed
    assert later.__dict__["suppressed"] == 2


def test_different_message_shapes_are_not_throttled_together() -> None:
    throttle = RepeatThrottle(window=3600)

    assert throttle.filter(_record("FAIL connect refused"))
    assert throttle.filter(_record("REQTMOUT timed out"))


def test_json_formatter_writes_the_event_and_extra_fields_as_top_level_keys() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "recorded", None, None)
    record.MessageId = "m-1"
    record.outcome = "recorded"

    line = orjson.loads(JsonFormatter().format(record))

    assert line["event"] == "recorded"
    assert line["MessageId"] == "m-1"
    assert line["outcome"] == "recorded"
    assert line["level"] == "INFO"
