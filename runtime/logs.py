"""JSON log lines, configured once at the entry point.

Callers pass fields, not formatted strings: ``log_event(logger, "recorded", MessageId=...)``.
Only the fields given are written; payload notes, IPs, user agents and secrets are never passed.
"""

from __future__ import annotations

import logging
import sys
import time
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
            "level": record.levelname,
            "logger": record.name,
            "event": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            line["exception"] = record.exc_info[0].__name__
            line["traceback"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def configure_logging(level: str = "INFO") -> None:
    """Send JSON lines at ``level`` to stderr; idempotent (replaces earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("kafka.client").setLevel(logging.WARNING)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``event`` with ``fields`` as top-level JSON keys (None values are left out)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={k: v for k, v in fields.items() if v is not None})
