"""The outbox watchdog: the age of the oldest committed, unpublished row, reported to health.

Whatever state the publish loop is in, and whichever process holds the lease (or none): it
reads PostgreSQL only, on its own connection and thread (:class:`OutboxWatchdog`). Older than
``outbox_stall_seconds`` -> ``/readyz`` 503 with the reason
(``user_activity_outbox_oldest_unpublished_seconds`` is the age).

A measurement blocked past its own short timeout (a lock on the outbox or its watermark: an
``ALTER TABLE``, a ``VACUUM FULL``, a migration waiting for its lock, which block the publisher
too) reports the most the age can be: the last measured age plus the time since that
measurement. So a stall the watchdog cannot see into is still reported, and the gauge never
shows 0 for minutes in which nothing could be published.
"""

from __future__ import annotations

import time

import psycopg

from runtime.health import HEALTH
from runtime.metrics import OUTBOX_OLDEST_UNPUBLISHED_SECONDS, OUTBOX_STALL_THRESHOLD_SECONDS
from runtime.periodic import Periodic
from runtime.settings import Settings
from sinks.db import Database

# Pending: committed after the watermark (the first such transaction's rows stand for the
# oldest; txids follow transaction start closely), or requeued. A window under way (a backlog
# sent page by page: `target` and the cursor `after_*` set) has sent its rows up to the cursor:
# pending are the rows after the cursor and the transactions in progress at `target` (committed
# since, sent by a later window). So the age falls as a backlog drains, instead of staying at
# the backlog's oldest row until its last page. Index probes only; the generation says whether
# the publisher moved the watermark since the last measurement. The rows past the watermark's
# xmax are read from ONE lower bound (start_*: the cursor, or just before that xmax): with two,
# the btree scan starts at the lower row bound and reads the published rows before it.
_OLDEST_UNPUBLISHED = """
WITH m AS (SELECT delivered, coalesce(target, delivered) AS target,
                  coalesce(after_txid, '0'::xid8) AS after_txid,
                  coalesce(after_id, '00000000-0000-0000-0000-000000000000'::uuid) AS after_id,
                  (pg_snapshot_xmax(delivered)::text::numeric - 1)::text::xid8 AS before_xmax,
                  generation
             FROM user_activity.outbox_watermark WHERE id = 1),
     w AS (SELECT m.*,
                  CASE WHEN after_txid > before_xmax THEN after_txid ELSE before_xmax END
                      AS start_txid,
                  CASE WHEN after_txid > before_xmax THEN after_id
                       ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END AS start_id
             FROM m)
SELECT extract(epoch FROM now() - min(created_at))::float8, (SELECT generation FROM w) FROM (
    SELECT o.created_at FROM user_activity.outbox o
     WHERE o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(target) FROM w))
    UNION ALL
    SELECT o.created_at FROM user_activity.outbox o
     WHERE o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(delivered) FROM w))
       AND (o.txid, o.id) > ((SELECT after_txid FROM w), (SELECT after_id FROM w))
    UNION ALL
    (SELECT o.created_at FROM user_activity.outbox o
      WHERE (o.txid, o.id) > ((SELECT start_txid FROM w), (SELECT start_id FROM w))
      ORDER BY o.txid, o.id LIMIT 1)
    UNION ALL
    SELECT requeued_at FROM user_activity.outbox_parked WHERE requeued_at IS NOT NULL
) pending
"""


class OutboxWatchdog(Periodic):
    """Measures the oldest committed, unpublished row; reports a stall to health.

    Runs in its own thread on its own connection and reads PostgreSQL only (the watermark and
    the rows after it), so a crashed, stuck or starved publish loop, or a lease held by another
    process whose publisher is gone, is seen all the same. A measurement cancelled by its
    timeout (the statement ran, something blocked it) reports the most the age can be; one that
    failed otherwise (the database down) keeps the last value: the sinks report that outage.
    """

    def __init__(self, settings: Settings) -> None:
        self._threshold = settings.outbox_stall_seconds
        super().__init__(min(5.0, max(0.2, self._threshold / 3)), "outbox-watchdog")
        timeout_ms = min(settings.db_statement_timeout_ms, max(1000, int(self.interval * 1000)))
        self._db = Database(settings, "user-activity-outbox-watchdog",
                            statement_timeout_ms=timeout_ms)
        # (when, age) of the last measurement; before the first one, the start counts as one
        # that found nothing (so a query blocked from the start is reported all the same)
        self._measured: tuple[float, float] = (time.monotonic(), 0.0)
        self._generation: int | None = None  # the watermark's, at the last measurement
        OUTBOX_STALL_THRESHOLD_SECONDS.set(self._threshold)

    def tick(self) -> bool:
        """One measurement (or, when it was blocked, the most the age can be)."""
        try:
            row = self._db.connection().execute(_OLDEST_UNPUBLISHED).fetchone()
        except psycopg.errors.QueryCanceled:  # blocked past the timeout: the bound
            when, age = self._measured
            blocked = time.monotonic() - when
            self._report(age + blocked, f"the outbox cannot be measured: its query has been"
                                        f" blocked for {blocked:.0f}s, so its oldest row may be")
            return True
        except psycopg.Error:
            self._db.reset()
            return True
        age = max(0.0, float(row[0])) if row is not None and row[0] is not None else 0.0
        self._measured = (time.monotonic(), age)
        generation = None if row is None else row[1]
        moving = self._generation is not None and generation != self._generation
        self._generation = generation
        # a backlog being sent says so: a stall and a drain read alike otherwise
        self._report(age, "draining: the publisher moved the watermark since the last check;"
                          " oldest unpublished outbox row is" if moving
                     else "oldest unpublished outbox row is")
        return True

    def _report(self, age: float, what: str) -> None:
        OUTBOX_OLDEST_UNPUBLISHED_SECONDS.set(age)
        if age > self._threshold:
            HEALTH.stalled("outbox", f"{what} {age:.0f}s old (> {self._threshold:g}s)")
        else:
            HEALTH.unstalled("outbox")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop measuring; the stall it reported is withdrawn."""
        super().stop(timeout)
        self._db.close()
        HEALTH.unstalled("outbox")
