"""JSON log lines and the librdkafka repeat throttle."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from runtime.logs import JsonFormatter, RepeatThrottle, log_event, log_events
from schemas.favorites import ActionType


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


def test_an_integer_orjson_cannot_write_is_written_as_a_string_not_lost() -> None:
    # A message's Version of 2**64 (both decoders accept any integer) lost its warning line, and
    # a non-JSON "--- Logging error ---" traceback was written instead.
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "contract-version-mismatch",
                               None, None)
    record.version = 1 << 64
    record.low = -(1 << 63) - 1
    record.fits = (1 << 64) - 1

    line = orjson.loads(JsonFormatter().format(record))

    assert (line["version"], line["low"], line["fits"]) == (
        str(1 << 64), str(-(1 << 63) - 1), (1 << 64) - 1)


class _CountingStream(io.StringIO):
    """A text stream that counts its ``write`` calls."""

    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


class _ListHandler(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


JsonLogger = Callable[[], tuple[logging.Logger, _CountingStream]]


@pytest.fixture
def json_logger(request: pytest.FixtureRequest) -> Iterator[JsonLogger]:
    """Call it in the test: a logger whose only handler is a JSON stream handler, and its stream.

    Called in the test itself: pytest attaches its capture handlers to non-propagating loggers
    when a test phase starts; this takes them off again (log_events would fall back for them).
    """
    stream = _CountingStream()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(f"test.logs.{request.node.name}")
    logger.propagate = False
    logger.setLevel(logging.INFO)

    def only_json() -> tuple[logging.Logger, _CountingStream]:
        logger.handlers[:] = [handler]
        return logger, stream

    yield only_json
    logger.handlers.clear()


_TS = re.compile(r'^\{"ts":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z",')


def _without_ts(text: str) -> list[str]:
    lines = text.splitlines()
    assert all(_TS.match(line) for line in lines), lines
    return [_TS.sub("{", line) for line in lines]


_ROWS: list[dict[str, Any]] = [
    {"outcome": "recorded", "SessionId": uuid.uuid4(), "MessageId": uuid.uuid4(),
     "FavoriteId": uuid.uuid4(), "PropertyObjectId": uuid.uuid4(),
     "ActionType": ActionType.ADD_TO_FAVORITES, "source": "favorite-added[3]@17"},
    {"outcome": "recorded", "SessionId": None, "MessageId": uuid.uuid4(), "n": 3, "ok": True},
    {"unicode": "Grüße \u2603", "quote": 'a "b" \\ c\nd', "nested": {"_k": [1, None]}},
    {"_private": "dropped", "ts": "2001-02-03T04:05:06.007Z", "kept": 1},
    {},
    {"odd": object.__new__(type("Odd", (), {"__str__": lambda self: "odd!"}))},
    {"version": 1 << 64, "nested": {"v": [-(1 << 63) - 1, 1 << 63, True]}},
]


def test_log_events_writes_the_lines_log_event_writes_in_one_write(
    json_logger: JsonLogger,
) -> None:
    logger, stream = json_logger()
    for row in _ROWS:
        log_event(logger, "recorded", **row)
    one_by_one = stream.getvalue()
    stream.seek(0)
    stream.truncate()
    stream.writes = 0

    log_events(logger, "recorded", _ROWS)

    assert stream.writes == 1
    assert _without_ts(stream.getvalue()) == _without_ts(one_by_one)
    assert len(stream.getvalue().splitlines()) == len(_ROWS)


def test_log_events_respects_the_level_and_writes_nothing_for_no_rows(
    json_logger: JsonLogger,
) -> None:
    logger, stream = json_logger()

    log_events(logger, "debug-only", _ROWS, logging.DEBUG)
    log_events(logger, "nothing", [])

    assert stream.getvalue() == ""
    assert stream.writes == 0


def test_a_reserved_field_name_is_refused_as_log_event_refuses_it(
    json_logger: JsonLogger,
) -> None:
    logger, stream = json_logger()

    with pytest.raises(KeyError):
        log_event(logger, "x", msg="clash")
    with pytest.raises(KeyError):
        log_events(logger, "x", [{"msg": "clash"}])
    for name in ("event", "level", "logger"):
        clash: dict[str, Any] = {name: "clash"}
        with pytest.raises(TypeError):
            log_event(logger, "x", **clash)
        with pytest.raises(TypeError):
            log_events(logger, "x", [{name: "clash"}])
    assert stream.getvalue() == ""


def test_filters_and_other_handlers_still_get_one_record_per_row(
    json_logger: JsonLogger,
) -> None:
    logger, stream = json_logger()
    seen: list[logging.LogRecord] = []

    def keep(record: logging.LogRecord) -> bool:
        seen.append(record)
        return True

    logger.addFilter(keep)
    log_events(logger, "filtered", _ROWS[:2])
    logger.removeFilter(keep)
    assert len(seen) == 2
    assert stream.writes == 2
    assert seen[0].__dict__["MessageId"] == _ROWS[0]["MessageId"]
    assert "SessionId" not in seen[1].__dict__  # None left out, as log_event does

    logger.addHandler(_ListHandler(seen))
    log_events(logger, "two-handlers", _ROWS[:3])
    assert [r.getMessage() for r in seen[2:]] == ["two-handlers"] * 3
    assert stream.writes == 5


def test_pytest_caplog_sees_every_record(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.logs.caplog")

    with caplog.at_level(logging.INFO):
        log_events(logger, "captured", _ROWS[:3])

    captured = [r for r in caplog.records if r.name == logger.name]
    assert [r.getMessage() for r in captured] == ["captured"] * 3
    assert captured[0].__dict__["outcome"] == "recorded"


def test_a_line_logged_by_a_signal_handler_while_the_main_thread_logs_is_written_whole() -> None:
    """SIGTERM's ``shutdown-requested`` came while librdkafka lines were being written.

    Through a buffered stream the handler's write was a reentrant call: the line was lost and
    a ``Logging error`` traceback written instead.
    """
    script = (
        "import logging, os, signal, sys, threading, time\n"
        "from runtime.logs import configure_logging, log_event\n"
        "configure_logging('INFO'); log = logging.getLogger('t'); handled = []\n"
        "def handle(_signum, _frame):\n"
        "    log_event(log, 'shutdown-requested', logging.WARNING, reason='SIGTERM')\n"
        "    handled.append(1)\n"
        "signal.signal(signal.SIGTERM, handle)\n"
        "def kill():\n"
        "    for _ in range(100):\n"
        "        time.sleep(0.003); os.kill(os.getpid(), signal.SIGTERM)\n"
        "killer = threading.Thread(target=kill); killer.start()\n"
        "while killer.is_alive():\n"
        "    log_event(log, 'busy', logging.WARNING, text='x' * 300)\n"
        "time.sleep(0.1); print(len(handled))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = done.stderr.splitlines()
    handled = int(done.stdout)

    assert handled > 0
    assert sum('"event":"shutdown-requested"' in line for line in lines) == handled
    assert all(line.startswith("{") and line.endswith("}") for line in lines), \
        [line for line in lines if not line.startswith("{")][:5]
