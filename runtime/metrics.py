"""Prometheus metrics of the service: SPEC §6 names exactly, plus session linking and health.

In prometheus_client's default registry, served on ``/metrics``; the input's progress and lag
gauges are computed at scrape time by :mod:`sources.progress`.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000)

# Favorites flow (SPEC §6).
FAVORITES_CONSUME_DURATION_MS = Histogram(
    "user_activity_favorites_consume_duration_ms",
    "Milliseconds from a favorites record read from Kafka to its commit.", buckets=_MS_BUCKETS)
FAVORITES_WRITE_DURATION_MS = Histogram(
    "user_activity_favorites_write_duration_ms",
    "Milliseconds of a favorites batch's statement, sent to commit known (per batch).",
    buckets=_MS_BUCKETS)
FAVORITES_RECORDED = Counter(
    "user_activity_favorites_recorded",
    "Action-history rows recorded (one per source message).", ["action_type"])
FAVORITES_SKIPPED = Counter(
    "user_activity_favorites_skipped",
    "Favorites messages acknowledged without a row, by reason.", ["reason"])
FAVORITES_SESSION_WAITS = Counter(
    "user_activity_favorites_session_waits",
    "Favorites whose owner had no session yet, by outcome: started, recorded, skipped.",
    ["outcome"])
FAVORITES_RETRIES = Counter(
    "user_activity_favorites_retries",
    "Retries after an infrastructure failure (PostgreSQL or Kafka unavailable, timeout).")
FAVORITES_DLQ = Counter(
    "user_activity_favorites_dlq", "Favorites records sent to the dead-letter topic.")

# Session linking flow (same style).
SESSION_LINKING_DURATION_MS = Histogram(
    "user_activity_session_linking_consume_duration_ms",
    "Milliseconds from a user-signed-in record being read to its transaction committing.",
    buckets=_MS_BUCKETS)
SESSION_LINKING_OUTCOMES = Counter(
    "user_activity_session_linking_outcomes",
    "user-signed-in messages by outcome (linked, already-linked, relinked, started, ...).",
    ["outcome"])
SESSION_LINKING_RETRIES = Counter(
    "user_activity_session_linking_retries",
    "Retries after an infrastructure failure in the session-linking flow.")
SESSION_LINKING_DLQ = Counter(
    "user_activity_session_linking_dlq",
    "user-signed-in records sent to the session-linking dead-letter topic.")
SESSION_LINKING_RELEASED_EARLY = Counter(
    "user_activity_session_linking_released_early",
    "Sign-ins applied before their lateness passed: the reorder buffer was full.")

# Outbox and health.
OUTBOX_READ_BACK = Counter(
    "user_activity_outbox_read_back",
    "Outbox rows a publish window read back from the table (not sent by the fast path).")
OUTBOX_PUBLISHED = Counter(
    "user_activity_outbox_published",
    "Outbox rows acknowledged by the broker and marked published.", ["topic"])
OUTBOX_PUBLISH_FAILURES = Counter(
    "user_activity_outbox_publish_failures",
    "Outbox publication attempts that failed (retried with back-off).")
CONSUMER_ERRORS = Counter(
    "user_activity_consumer_errors",
    "Errors reported by the Kafka consumers (routed to the log, never silently dropped).",
    ["topic", "code"])
INPUT_RECORDS_EXPIRED = Counter(
    "user_activity_input_records_expired",
    "Input records deleted by retention before the job read them (lost to the stream).",
    ["topic", "partition"])
INPUT_RECORDS_UNDECODABLE = Counter(
    "user_activity_input_records_undecodable",
    "Input records skipped: their batch could not be decompressed (replay can read them).",
    ["topic", "partition"])
INPUT_TOPIC_RECREATED = Counter(
    "user_activity_input_topic_recreated",
    "Input partitions resumed on a recreated topic: read from its first record.", ["topic"])
INPUT_TOPIC_COMPACTED = Gauge(
    "user_activity_input_topic_compacted",
    "1 while an input topic's cleanup.policy includes compact (compacted records are lost).",
    ["topic"])
INPUT_TOPIC_UNAVAILABLE = Gauge(
    "user_activity_input_topic_unavailable",
    "1 while the broker answers the metadata request for this input topic with an error.",
    ["topic"])
OUTBOX_PARKED = Counter(
    "user_activity_outbox_parked",
    "Outbox rows parked: the broker refused the record itself (user-activity outbox requeue).",
    ["topic"])
OUTBOX_HELD = Counter(
    "user_activity_outbox_held",
    "Outbox rows held back while the broker refuses their topic; sent once it accepts them.",
    ["topic"])
OUTBOX_HELD_SECONDS = Gauge(
    "user_activity_outbox_held_seconds",
    "Seconds since the oldest row still held back for the topic was held (0: none).", ["topic"])
OUTBOX_UNSTABLE_SECONDS = Gauge(
    "user_activity_outbox_unstable_seconds",
    "How long the last stable offset of the topic's worst partition has stood still below its"
    " end: a transaction left open holds read_committed readers back (0: none).", ["topic"])
OUTBOX_OLDEST_UNPUBLISHED_SECONDS = Gauge(
    "user_activity_outbox_oldest_unpublished_seconds",
    "Age of the oldest committed, unpublished, unparked outbox row (0: none).")
OUTBOX_STALL_THRESHOLD_SECONDS = Gauge(
    "user_activity_outbox_stall_threshold_seconds",
    "USER_ACTIVITY_OUTBOX_STALL_SECONDS: /readyz is 503 while the oldest unpublished row is older.")
RECOVERY_VOLUME_FREE_BYTES = Gauge(
    "user_activity_recovery_volume_free_bytes",
    "Free bytes of the recovery store's volume, measured at scrape time.")
RECOVERY_VOLUME_MIN_FREE_BYTES = Gauge(
    "user_activity_recovery_volume_min_free_bytes",
    "USER_ACTIVITY_RECOVERY_MIN_FREE_BYTES: less free and the job does not start.")
STORAGE_EXPIRED_PARTITIONS = Gauge(
    "user_activity_storage_expired_partitions",
    "Daily partitions past the retention still there (1 after midnight UTC, then 0).", ["table"])
STORAGE_PARTITION_DAYS_READY = Gauge(
    "user_activity_storage_partition_days_ready",
    "Consecutive UTC days from today that have their daily partition (normally 4).", ["table"])
BACKGROUND_ERRORS = Counter(
    "user_activity_background_errors",
    "Unexpected exceptions of a periodic housekeeping task (it runs again at its next time).",
    ["task"])
DEDUP_IDS = Gauge(
    "user_activity_dedup_ids",
    "MessageIds held by this process's in-memory dedup windows.", ["flow"])
DEDUP_FORGOTTEN_EARLY = Counter(
    "user_activity_dedup_forgotten_early",
    "MessageIds the dedup windows forgot before the TTL (full); the database dedups them.",
    ["flow"])
PAUSED_SECONDS = Gauge(
    "user_activity_paused_seconds",
    "Seconds the stream has been paused waiting for a dependency (0 when running).")


def observe_durations_ms(histogram: Histogram, now: float, started: Iterable[float]) -> None:
    """``histogram.observe((now - t) * 1000)`` for each ``t`` in ``started``, grouped by ``t``.

    A poll's messages share their start, so each distinct one is observed once with its count.
    Uses the Histogram's private fields (checked by ``tests/unit/test_metrics_batching.py``).
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
