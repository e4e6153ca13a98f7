"""Prometheus metrics of the service: SPEC §6 names exactly, plus session linking and health.

The input partitions' progress and lag gauges (``user_activity_input_*`` and the flows'
``*_lag_seconds``) are computed at scrape time by :mod:`sources.progress`.
Metrics live in prometheus_client's default registry, served on ``USER_ACTIVITY_HTTP_PORT``
(``/metrics``). Bytewax's own metrics come from its API server (``BYTEWAX_DATAFLOW_API_ENABLED``,
port 3030), which also renders this registry.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000)

# Favorites flow (SPEC §6).
FAVORITES_CONSUME_DURATION_MS = Histogram(
    "user_activity_favorites_consume_duration_ms",
    "Milliseconds from a favorites record being read from Kafka to its transaction committing.",
    buckets=_MS_BUCKETS,
)
FAVORITES_WRITE_DURATION_MS = Histogram(
    "user_activity_favorites_write_duration_ms",
    "Milliseconds from a favorites batch's statement being sent to PostgreSQL to its commit"
    " being known, one observation per committed batch (a storage stall shows here first).",
    buckets=_MS_BUCKETS,
)
FAVORITES_RECORDED = Counter(
    "user_activity_favorites_recorded",
    "Action-history rows recorded (one per source message).",
    ["action_type"],
)
FAVORITES_SKIPPED = Counter(
    "user_activity_favorites_skipped",
    "Favorites messages acknowledged without a row, by reason.",
    ["reason"],
)
FAVORITES_SESSION_WAITS = Counter(
    "user_activity_favorites_session_waits",
    "Favorites whose owner had no session yet, by outcome: `started` to wait, then"
    " `recorded` once a session appeared, or `skipped` (no-session) at the end of the wait.",
    ["outcome"],
)
FAVORITES_RETRIES = Counter(
    "user_activity_favorites_retries",
    "Retries after an infrastructure failure (PostgreSQL or Kafka unavailable, timeout).",
)
FAVORITES_DLQ = Counter(
    "user_activity_favorites_dlq",
    "Favorites records sent to the dead-letter topic.",
)

# Session linking flow (same style).
SESSION_LINKING_DURATION_MS = Histogram(
    "user_activity_session_linking_consume_duration_ms",
    "Milliseconds from a user-signed-in record being read to its transaction committing.",
    buckets=_MS_BUCKETS,
)
SESSION_LINKING_OUTCOMES = Counter(
    "user_activity_session_linking_outcomes",
    "user-signed-in messages by outcome (linked, already-linked, relinked, started, ...).",
    ["outcome"],
)
SESSION_LINKING_RETRIES = Counter(
    "user_activity_session_linking_retries",
    "Retries after an infrastructure failure in the session-linking flow.",
)
SESSION_LINKING_DLQ = Counter(
    "user_activity_session_linking_dlq",
    "user-signed-in records sent to the session-linking dead-letter topic.",
)
SESSION_LINKING_RELEASED_EARLY = Counter(
    "user_activity_session_linking_released_early",
    "Sign-ins applied before their lateness had passed: the reorder buffer held its bound"
    " (USER_ACTIVITY_SESSION_LINKING_MAX_PENDING), e.g. reading a backlog.",
)

# Outbox and health.
OUTBOX_READ_BACK = Counter(
    "user_activity_outbox_read_back",
    "Outbox rows a publish window read back from the table to send them: rows of other"
    " processes, rows a crash left, rows the fast path had not sent within the grace.",
)
OUTBOX_PUBLISHED = Counter(
    "user_activity_outbox_published",
    "Outbox rows acknowledged by the broker and marked published.",
    ["topic"],
)
OUTBOX_PUBLISH_FAILURES = Counter(
    "user_activity_outbox_publish_failures",
    "Outbox publication attempts that failed (retried with back-off).",
)
CONSUMER_ERRORS = Counter(
    "user_activity_consumer_errors",
    "Errors reported by the Kafka consumers (routed to the log, never silently dropped).",
    ["topic", "code"],
)
INPUT_RECORDS_EXPIRED = Counter(
    "user_activity_input_records_expired",
    "Input records deleted by the topic's retention (or DeleteRecords) before this job read"
    " them: the partition's log start had passed its next offset, so the consumer went on from"
    " the log start. Lost to the stream; replay cannot bring them back.",
    ["topic", "partition"],
)
INPUT_RECORDS_UNDECODABLE = Counter(
    "user_activity_input_records_undecodable",
    "Input records skipped because their record batch could not be decompressed (larger than"
    " USER_ACTIVITY_SOURCE_RECEIVE_MAX_BYTES once decompressed, or corrupt): the partition went"
    " on after the batch. Still in the topic until its retention: a replay of those offsets"
    " with a larger limit reads them.",
    ["topic", "partition"],
)
INPUT_TOPIC_RECREATED = Counter(
    "user_activity_input_topic_recreated",
    "Input partitions resumed on a topic deleted and created again since their snapshot: read"
    " from the new topic's first record (records below the old offset were skipped before).",
    ["topic"],
)
INPUT_TOPIC_COMPACTED = Gauge(
    "user_activity_input_topic_compacted",
    "1 while an input topic's cleanup.policy includes compact (read at start and at each"
    " partition check): records compacted"
    " away before they are read are lost and not counted.",
    ["topic"],
)
INPUT_TOPIC_UNAVAILABLE = Gauge(
    "user_activity_input_topic_unavailable",
    "1 while the broker answers the job's periodic metadata request for this input topic with an"
    " error (the topic deleted, or not authorized): its consumers then read nothing, and report"
    " nothing either. 0 once it answers again.",
    ["topic"],
)
OUTBOX_PARKED = Counter(
    "user_activity_outbox_parked",
    "Outbox rows parked: the broker refused the record itself (too large, invalid), so it is kept"
    " aside for an operator (python -m cli outbox requeue) and the rows behind it go on.",
    ["topic"],
)
OUTBOX_HELD = Counter(
    "user_activity_outbox_held",
    "Outbox rows held back because the broker refuses their topic (not authorized, the topic"
    " missing): kept in user_activity.outbox_held in order and sent once the topic accepts"
    " them; the other topics go on.",
    ["topic"],
)
OUTBOX_HELD_SECONDS = Gauge(
    "user_activity_outbox_held_seconds",
    "Seconds since the oldest row still held back for the topic was held (0 when none), as the"
    " watchdog last measured it.",
    ["topic"],
)
OUTBOX_OLDEST_UNPUBLISHED_SECONDS = Gauge(
    "user_activity_outbox_oldest_unpublished_seconds",
    "Age of the oldest committed, unpublished and unparked outbox row (0 when none), as the"
    " watchdog last measured it; while its query is blocked (a lock on the outbox), the most it"
    " can be (the last age plus the time since).",
)
OUTBOX_STALL_THRESHOLD_SECONDS = Gauge(
    "user_activity_outbox_stall_threshold_seconds",
    "USER_ACTIVITY_OUTBOX_STALL_SECONDS: /readyz is 503 while the oldest unpublished row is older.",
)
RECOVERY_VOLUME_FREE_BYTES = Gauge(
    "user_activity_recovery_volume_free_bytes",
    "Free bytes of the volume holding the Bytewax recovery store (-r), measured at scrape time;"
    " a snapshot fails once it is full (runtime.recovery_volume).",
)
RECOVERY_VOLUME_MIN_FREE_BYTES = Gauge(
    "user_activity_recovery_volume_min_free_bytes",
    "USER_ACTIVITY_RECOVERY_MIN_FREE_BYTES: the job does not start with less free on its"
    " recovery volume (exit code 74).",
)
STORAGE_EXPIRED_PARTITIONS = Gauge(
    "user_activity_storage_expired_partitions",
    "Daily partitions of the table past USER_ACTIVITY_RETENTION_DAYS and still there, as the job's"
    " maintenance last counted them (hourly): 1 for up to an hour after midnight UTC, then 0;"
    " more for longer means storage is no longer bounded (drops fail, or an outbox partition"
    " waits for its rows to be published).",
    ["table"],
)
STORAGE_PARTITION_DAYS_READY = Gauge(
    "user_activity_storage_partition_days_ready",
    "Consecutive UTC days from today on that have their daily partition of the table, as the"
    " job's maintenance last counted them (normally 4: today and 3 ahead); at 0 today's rows"
    " land in the DEFAULT partition, which only chunked DELETEs shrink.",
    ["table"],
)
BACKGROUND_ERRORS = Counter(
    "user_activity_background_errors",
    "Unexpected exceptions of a periodic housekeeping task (it runs again at its next time).",
    ["task"],
)
DEDUP_IDS = Gauge(
    "user_activity_dedup_ids",
    "MessageIds held by this process's in-memory dedup windows (at most USER_ACTIVITY_DEDUP_MAX_IDS"
    " over all the flow's processes).",
    ["flow"],
)
DEDUP_FORGOTTEN_EARLY = Counter(
    "user_activity_dedup_forgotten_early",
    "MessageIds the in-memory dedup windows forgot before USER_ACTIVITY_DEDUP_TTL_SECONDS because"
    " they were full (USER_ACTIVITY_DEDUP_MAX_IDS): their redeliveries are found duplicate by the"
    " database instead. Memory stays bounded; nothing is lost or recorded twice.",
    ["flow"],
)
PAUSED_SECONDS = Gauge(
    "user_activity_paused_seconds",
    "Seconds the stream has been paused waiting for a dependency (0 when running).",
)


def observe_durations_ms(histogram: Histogram, now: float, started: Iterable[float]) -> None:
    """``histogram.observe((now - t) * 1000)`` for each ``t`` in ``started``, grouped by ``t``.

    The messages of one Kafka poll share their ``received_at``, so a batch has a few distinct
    starts: each is observed once with its multiplicity (the same bucket counts, count and sum,
    up to float rounding of the sum), instead of one ``observe`` (two locks and a bucket scan)
    per message. Reaches into prometheus_client's ``Histogram`` (``_upper_bounds``,
    ``_buckets``, ``_sum``; checked by ``tests/unit/test_metrics_batching.py``).
    """
    bounds = histogram._upper_bounds
    buckets = histogram._buckets
    total = histogram._sum
    for start, count in Tally(started).items():
        amount = (now - start) * 1000
        total.inc(amount * count)
        for i, bound in enumerate(bounds):
            if amount <= bound:
                buckets[i].inc(count)
                break
