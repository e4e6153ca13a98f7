"""The outbox watchdog: the age of the oldest committed, unpublished row, reported to health.

:meth:`OutboxWatchdog.measure` reads PostgreSQL only, so a stuck publisher, or a lease held by a
process whose publisher is gone, is seen all the same. Older than ``outbox_stall_seconds``:
``/readyz`` 503 with the reason. Held topics are measured one by one
(``user_activity_outbox_held_seconds{topic}``). A measurement blocked past its timeout reports
the most the age can be: the last age plus the time since.
"""

from __future__ import annotations

import time

import psycopg

from runtime.metrics import (
    OUTBOX_HELD_SECONDS,
    OUTBOX_OLDEST_UNPUBLISHED_SECONDS,
    OUTBOX_STALL_THRESHOLD_SECONDS,
)
from runtime.process import Process
from runtime.settings import Settings
from sinks.db import Database
from sinks.outbox.sql import query

INTERVAL_SECONDS = 5.0  # the longest interval between two measurements


class OutboxWatchdog:
    """Measures the oldest unpublished row on its own connection; reports a stall to health."""

    def __init__(self, settings: Settings, *, process: Process) -> None:
        self._threshold = settings.outbox_stall_seconds
        self.interval = min(INTERVAL_SECONDS, max(0.2, self._threshold / 3))
        """How often to call :meth:`measure`: a stall is seen within a third of the threshold."""
        timeout_ms = min(settings.db_statement_timeout_ms, max(1000, int(self.interval * 1000)))
        self._db = Database(settings, "user-activity-outbox-watchdog",
                            statement_timeout_ms=timeout_ms)
        self._health = process.health
        # (when, age) of the last measurement; the start counts as one that found nothing
        self._measured: tuple[float, float] = (time.monotonic(), 0.0)
        self._generation: int | None = None  # the watermark's, at the last measurement
        self._held: set[str] = set()
        OUTBOX_STALL_THRESHOLD_SECONDS.set(self._threshold)

    def measure(self) -> None:
        """One measurement; never raises (a failed one keeps the last value: the sinks say why)."""
        try:
            conn = self._db.connection()
            row = conn.execute(query("oldest_unpublished")).fetchone()
            held = conn.execute(query("held_ages")).fetchall()
        except psycopg.errors.QueryCanceled:  # blocked past the timeout: the bound
            when, age = self._measured
            blocked = time.monotonic() - when
            self._report(age + blocked, f"the outbox cannot be measured: its query has been"
                                        f" blocked for {blocked:.0f}s, so its oldest row may be")
            return
        except psycopg.Error:
            self._db.reset()
            return
        ages = {topic: max(0.0, float(seconds)) for topic, seconds, _ in held}
        for topic in self._held | ages.keys():  # a topic released: its gauge back to 0
            OUTBOX_HELD_SECONDS.labels(topic=topic).set(ages.get(topic, 0.0))
        self._held = set(ages)
        age = max([0.0, *ages.values()])
        if row is not None and row[0] is not None:
            age = max(age, float(row[0]))
        self._measured = (time.monotonic(), age)
        generation = None if row is None else row[1]
        moving = self._generation is not None and generation != self._generation
        self._generation = generation
        what = "oldest unpublished outbox row is"
        if held:
            what = f"topics held back: {', '.join(sorted(self._held))}; {what}"
        if moving:  # a backlog being sent says so: a stall and a drain read alike otherwise
            what = f"draining: the publisher moved the watermark since the last check; {what}"
        self._report(age, what)

    def _report(self, age: float, what: str) -> None:
        OUTBOX_OLDEST_UNPUBLISHED_SECONDS.set(age)
        if age > self._threshold:
            self._health.stalled("outbox", f"{what} {age:.0f}s old (> {self._threshold:g}s)")
        else:
            self._health.unstalled("outbox")

    def close(self) -> None:
        """Close the connection; the stall it reported is withdrawn."""
        self._db.close()
        self._health.unstalled("outbox")
