"""Create the service's topics (SPEC §2: 6 partitions each); existing topics are left alone."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from runtime.logs import LIBRDKAFKA_LOGGER


def ensure_topics(client_config: Mapping[str, Any], topics: Sequence[str], partitions: int = 6,
                  replication_factor: int = 1, timeout: float = 60.0) -> None:
    """Create the missing ``topics`` and wait until every one is visible in the metadata.

    A broker that does not answer within 10 s is a :class:`KafkaException` (before, the first
    topic's future waited ``timeout`` and raised a bare ``TimeoutError``).
    """
    # librdkafka's own lines through Python logging (JSON, repeats throttled): with the broker
    # down it wrote about 200 raw lines to stderr in the 10 s before the one line that matters
    config: dict[str, Any] = {**client_config, "logger": LIBRDKAFKA_LOGGER}
    admin = AdminClient(config)
    try:
        admin.list_topics(timeout=10)  # KafkaException when no broker answers
    finally:
        admin.poll(0)  # serves librdkafka's lines (the reason: refused, TLS, SASL) to the log
    futures = admin.create_topics(
        [NewTopic(t, num_partitions=partitions, replication_factor=replication_factor)
         for t in topics],
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
