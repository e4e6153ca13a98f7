"""What the input asks the broker about a topic besides its partitions: its id and its cleanup.

A topic's id tells a topic deleted and created again under the same name apart.

Offsets belong to one incarnation of a topic. Deleted and created again, a topic starts its
partitions at offset 0 again, so a job resuming at its old offsets skips the new records below
them, without an error (a review helper measured 300 of 500 skipped, nothing said). The input
keeps the id with each partition's offset in its snapshot and compares it when it resumes; the
partition watch compares it while the job runs.
"""

from __future__ import annotations

from confluent_kafka import KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]


def topic_id(admin: AdminClient, topic: str, timeout: float = 10.0) -> str | None:
    """The broker's id of ``topic``, or None when it cannot be had (no answer, no right)."""
    try:
        future = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout)[topic]
        return str(future.result(timeout=timeout + 1).topic_id)
    except (KafkaException, TimeoutError, ValueError, TypeError, AttributeError):
        return None


def cleanup_policy(admin: AdminClient, topic: str, timeout: float = 10.0) -> str | None:
    """``topic``'s ``cleanup.policy`` (``delete``, ``compact`` or both), or None if not told.

    An input topic must not be compacted: compaction removes every record of a key but the
    last, so events the job has not read yet are gone without a trace (only the log start's
    move is counted as records expired; a compacted record leaves a gap like a transaction
    marker's).
    """
    try:
        resource = ConfigResource("topic", topic)
        entries = admin.describe_configs([resource], request_timeout=timeout)[resource].result(
            timeout + 1)
        return str(entries["cleanup.policy"].value)
    except (KafkaException, TimeoutError, KeyError, ValueError, TypeError, AttributeError):
        return None
