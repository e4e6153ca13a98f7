"""Create the topics this service owns, and nothing else.

Ours: the outbox's outputs (session-started/-ended only while published), the two dead-letter
topics and the outbox's progress topic (one partition, compacted, no retention), made with the
USER_ACTIVITY_TOPIC_* partitions, replication factor and min.insync.replicas (1 and 1 on a
one-broker cluster). An existing topic is never changed: one that differs is named (exit 2).
Replication factor 1 on several brokers is refused unless --allow-single-replica.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
)

from cli import table
from runtime.logs import LIBRDKAFKA_LOGGER
from runtime.settings import Settings

MIN_ISR = "min.insync.replicas"


def own_topics(settings: Settings) -> list[str]:
    """The topics this service writes and owns: the outbox's, and the dead letters."""
    return [*settings.outbox_topics(), settings.topic_favorites_dlq,
            settings.topic_session_linking_dlq, settings.topic_outbox_progress]


PROGRESS_CONFIG = {"cleanup.policy": "compact", "retention.ms": "-1", "retention.bytes": "-1"}
"""The progress topic keeps its stream's last record for ever (one partition)."""


def input_topics(settings: Settings) -> list[str]:
    """The topics this service reads; other teams own them."""
    return [settings.topic_favorite_added, settings.topic_favorite_removed,
            settings.topic_user_signed_in]


def admin_client(client_config: Mapping[str, Any]) -> Any:
    """An AdminClient whose librdkafka lines go through the JSON log."""
    config: dict[str, Any] = {**client_config, "logger": LIBRDKAFKA_LOGGER}
    return AdminClient(config)


def ensure_topics(client_config: Mapping[str, Any], topics: Sequence[str], partitions: int = 6,
                  replication_factor: int = 1, timeout: float = 60.0, *,
                  config: Mapping[str, str] | None = None) -> None:
    """Create the missing ``topics`` and wait until each has a leader for every partition.

    Raises :class:`KafkaException` when no broker answers within 10 s or the broker refuses.
    """
    admin = admin_client(client_config)
    try:
        admin.list_topics(timeout=10)  # KafkaException when no broker answers
    finally:
        admin.poll(0)  # serves librdkafka's lines (the reason: refused, TLS, SASL) to the log
    futures = admin.create_topics(
        [NewTopic(t, num_partitions=partitions, replication_factor=replication_factor,
                  config=dict(config or {})) for t in topics],
        operation_timeout=timeout,
    )
    for future in futures.values():
        try:
            future.result(timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    deadline = time.monotonic() + timeout
    while True:
        metadata = admin.list_topics(timeout=10)
        missing = [t for t in topics if t not in metadata.topics
                   or not metadata.topics[t].partitions
                   or any(p.leader < 0 for p in metadata.topics[t].partitions.values())]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics not visible after {timeout}s: {missing}")
        time.sleep(0.2)


def create_topics(settings: Settings, *, dry_run: bool = False,
                  allow_single_replica: bool = False, out: TextIO | None = None) -> int:
    """Create our missing topics (module doc); print the plan as a table; the exit code."""
    out = out or sys.stdout
    admin = admin_client(settings.kafka_client_config())
    metadata = admin.list_topics(timeout=10)
    brokers = _brokers(metadata)
    replicas = 1 if brokers == 1 else settings.topic_replication_factor
    min_isr = min(settings.topic_min_insync_replicas, replicas)
    wanted = (settings.topic_partitions, replicas, min_isr)
    said = (" (one broker: replication factor 1)"
            if brokers == 1 and settings.topic_replication_factor > 1 else "")
    print(f"cluster: {brokers} broker(s); our topics: {wanted[0]} partitions, replication"
          f" factor {replicas}, min.insync.replicas {min_isr}{said}", file=out)
    refusal = None
    if replicas > brokers:
        refusal = (f"replication factor {replicas} needs {replicas} brokers, the cluster has"
                   f" {brokers}: set USER_ACTIVITY_TOPIC_REPLICATION_FACTOR")
    elif replicas == 1 and brokers > 1 and not allow_single_replica:
        refusal = (f"replication factor 1 on a cluster of {brokers} brokers loses data with one"
                   " broker; pass --allow-single-replica to do it anyway")
    existing = {t: metadata.topics[t] for t in own_topics(settings) if t in metadata.topics}
    found_isr = _min_isr(admin, list(existing))
    rows: list[tuple[str, int, int, object, str]] = []
    differing = []
    progress = settings.topic_outbox_progress
    for topic in own_topics(settings):
        want = (1, *wanted[1:]) if topic == progress else wanted
        if topic not in existing:
            action = "would create" if dry_run or refusal else "create"
            rows.append((topic, *want, action))
            continue
        parts = existing[topic].partitions
        has = (len(parts), len(parts[0].replicas) if 0 in parts else 0, found_isr.get(topic))
        diff = [f"{name} {h} (want {w})" for name, h, w
                in zip(("partitions", "RF", "min ISR"), has, want, strict=True)
                if h is not None and h != w]
        rows.append((topic, has[0], has[1], "?" if has[2] is None else has[2],
                     f"exists, differs: {', '.join(diff)}; left as is" if diff else "exists"))
        if diff:
            differing.append(f"{topic}: {', '.join(diff)}")
    print(table(("topic", "partitions", "RF", "min ISR", "action"), rows), file=out, flush=True)
    if refusal:
        print(f"user-activity create-topics: {refusal}", file=sys.stderr)
        return 2
    missing = [row[0] for row in rows if row[4] == "create"]
    if missing and not dry_run:
        if progress in missing:
            ensure_topics(settings.kafka_client_config(), [progress], 1, replicas,
                          config={MIN_ISR: str(min_isr), **PROGRESS_CONFIG})
        if rest := [topic for topic in missing if topic != progress]:
            ensure_topics(settings.kafka_client_config(), rest, wanted[0], replicas,
                          config={MIN_ISR: str(min_isr)})
    for line in differing:
        print(f"user-activity create-topics: {line}: an existing topic is never changed (change"
              " it by hand, or the settings)", file=sys.stderr)
    return 2 if differing else 0


def _brokers(metadata: Any) -> int:
    offsets = metadata.topics.get("__consumer_offsets")
    replicas = len(offsets.partitions[0].replicas) if offsets and 0 in offsets.partitions else 0
    return max(len(metadata.brokers), replicas)


def _min_isr(admin: Any, topics: list[str]) -> dict[str, int]:
    found: dict[str, int] = {}
    if not topics:
        return found
    futures = admin.describe_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics], request_timeout=10)
    for resource, future in futures.items():
        try:
            found[resource.name] = int(future.result()[MIN_ISR].value)
        except KafkaException:
            continue
    return found
