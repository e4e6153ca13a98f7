"""JSON log lines, configured once at the entry point.

Callers pass fields, not formatted strings: ``log_event(logger, "recorded", MessageId=...)``;
payload notes, IPs, user agents and secrets are never passed. ``log_events`` writes a batch of
one event's lines with one ``write``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import orjson

LIBRDKAFKA_LOGGER = logging.getLogger("librdkafka")
"""Where every Kafka client's own log lines go (instead of raw stderr)."""

_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a JSON line."""
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "event": record.getMessage()}
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            line["exception"] = record.exc_info[0].__name__
            line["traceback"] = self.formatException(record.exc_info)
        return _dumps_line(line).decode()


_INT_RANGE = range(-(1 << 63), 1 << 64)  # orjson raises on any other integer


def _dumps_line(line: dict[str, Any], option: int = 0) -> bytes:
    """``line`` as JSON, each integer orjson cannot write as its decimal string."""
    try:
        return orjson.dumps(line, default=str, option=option)
    except TypeError:
        return orjson.dumps(_writable(line), default=str, option=option)


def _writable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _writable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_writable(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT_RANGE:
        return str(value)
    return value


class RepeatThrottle(logging.Filter):
    """Let one line of each message shape through per ``window`` seconds; count the rest.

    For librdkafka's repeated lines while a broker is down; the next line of a shape that passes
    carries ``suppressed``: how many were dropped since the last one.
    """

    def __init__(self, window: float = 10.0, max_shapes: int = 1000) -> None:
        super().__init__()
        self._window, self._max_shapes = window, max_shapes
        self._seen: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """True to emit ``record``."""
        shape = _DIGITS.sub("#", record.getMessage())[:160]
        now = time.monotonic()
        with self._lock:
            first, suppressed = self._seen.get(shape, (-self._window, 0))
            if now - first < self._window:
                self._seen[shape] = (first, suppressed + 1)
                return False
            if len(self._seen) >= self._max_shapes:
                self._seen.clear()
            self._seen[shape] = (now, 0)
        if suppressed:
            record.suppressed = suppressed
        return True


_DIGITS = re.compile(r"\d+")


class _DescriptorStream:
    """Text written straight to a file descriptor, no buffer in between.

    A line logged by a signal handler can interrupt the main thread's own write: through a
    buffered file that is ``RuntimeError: reentrant call`` and the handler's line is lost.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, text: str) -> int:
        """Write all of ``text`` (UTF-8)."""
        left = memoryview(text.encode())
        while left:
            left = left[os.write(self._fd, left):]
        return len(text)

    def flush(self) -> None:
        """Nothing is held back."""


def configure_logging(level: str = "INFO") -> None:
    """Send JSON lines at ``level`` to stderr, each write at once; idempotent."""
    handler = logging.StreamHandler(_DescriptorStream(sys.stderr.fileno()))
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for old_filter in list(LIBRDKAFKA_LOGGER.filters):
        LIBRDKAFKA_LOGGER.removeFilter(old_filter)
    LIBRDKAFKA_LOGGER.addFilter(RepeatThrottle())


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``event`` with ``fields`` as top-level JSON keys (None values are left out)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={k: v for k, v in fields.items() if v is not None})


def log_events(logger: logging.Logger, event: str, rows: Iterable[dict[str, Any]],
               level: int = logging.INFO) -> None:
    """``log_event(logger, event, level, **row)`` for each row, written in one go.

    When the only handler reached is a plain JSON stream handler, the lines are rendered here
    (byte for byte what :class:`JsonFormatter` writes, one timestamp) and written at once;
    anything else (filters, several handlers, ``caplog``) gets one ``log_event`` per row.
    """
    if not logger.isEnabledFor(level):
        return
    handler = _batch_handler(logger, level)
    if handler is None:
        for row in rows:
            log_event(logger, event, level, **row)
        return
    formatter = handler.formatter
    assert isinstance(formatter, JsonFormatter)  # checked by _batch_handler
    header = logger.makeRecord(logger.name, level, "(unknown file)", 0, event, (), None)
    # '{"ts":...,"event":...}' -> '{"ts":...,"event":...,': each row's own JSON object follows.
    head = formatter.format(header).encode()[:-1] + b","
    shapes: dict[tuple[str, ...], bool] = {}
    lines: list[bytes] = []
    for row in rows:
        keys = tuple(row)
        plain = shapes.get(keys)
        if plain is None:
            plain = shapes[keys] = _plain_keys(keys)
        if plain and None not in row.values():
            lines.append(head + _dumps_line(row, orjson.OPT_APPEND_NEWLINE)[1:])
        else:
            lines.append(_format_row(logger, formatter, header, row))
    if not lines:
        return
    data = b"".join(lines)
    handler.acquire()
    try:
        handler.stream.write(data.decode())
        handler.flush()
    except RecursionError:
        raise
    except Exception:  # noqa: BLE001 - as StreamHandler.emit: report, never raise
        handler.handleError(header)
    finally:
        handler.release()


_HEADER_KEYS = frozenset({"ts", "level", "logger", "event"})
_LOG_EVENT_PARAMS = frozenset({"logger", "event", "level"})


def _batch_handler(logger: logging.Logger, level: int) -> logging.StreamHandler[Any] | None:
    """The one JSON stream handler a record of ``logger`` at ``level`` reaches, else None."""
    if logger.filters or logger.disabled:
        return None
    found: logging.Handler | None = None
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if level >= handler.level:
                if found is not None:
                    return None
                found = handler
        current = current.parent if current.propagate else None
    if type(found) is not logging.StreamHandler or found.filters or type(
            found.formatter) is not JsonFormatter or getattr(found, "terminator", None) != "\n":
        return None
    return found


def _plain_keys(keys: tuple[str, ...]) -> bool:
    """True when a row with ``keys`` renders as its own JSON object after the header's."""
    return bool(keys) and all(isinstance(key, str) and not key.startswith("_")
                              and key not in _STANDARD_ATTRS and key not in _HEADER_KEYS
                              for key in keys)


def _format_row(logger: logging.Logger, formatter: JsonFormatter, header: logging.LogRecord,
                row: dict[str, Any]) -> bytes:
    # one line the slow way (a LogRecord through the formatter), at the batch's timestamp
    for name in _LOG_EVENT_PARAMS.intersection(row):
        raise TypeError(f"log_event() got multiple values for argument {name!r}")
    fields = {k: v for k, v in row.items() if v is not None}
    record = logger.makeRecord(  # raises on a reserved key, as log_event does
        logger.name, header.levelno, header.pathname, header.lineno, header.msg, (), None,
        extra=fields)
    record.created, record.msecs = header.created, header.msecs
    return formatter.format(record).encode() + b"\n"

