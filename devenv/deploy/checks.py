"""What the deployed pods wrote, counted in PostgreSQL and Kafka, and the records fed to them.

Every count reads the real services the pods use; nothing is inferred from logs.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from devenv.harness.messages import favorite_envelope, sign_in_envelope

__all__ = [
    "Exactness",
    "consume_json",
    "exactness",
    "produce_favorites",
    "produce_sign_ins",
    "session_users",
    "unpublished",
]


def produce_favorites(bootstrap: str, topics: Sequence[str], devices: Sequence[uuid.UUID],
                      count: int, *, seed: int) -> list[uuid.UUID]:
    """``count`` valid favorites events of the guest ``devices``, alternating over ``topics``.

    Returns their MessageIds (each must become exactly one row and one action-tracked).
    """
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 10})
    ids = []
    for i in range(count):
        device = devices[(seed * 7919 + i) % len(devices)]
        envelope = favorite_envelope(anonymous_id=device,
                                     occurred_at=datetime.now(UTC).isoformat())
        ids.append(uuid.UUID(envelope["MessageId"]))
        _produce(producer, topics[i % len(topics)], str(envelope["AggregateId"]).encode(),
                 orjson.dumps(envelope))
    producer.flush(60)
    return ids


def produce_sign_ins(bootstrap: str, topic: str, devices: Sequence[uuid.UUID]
                     ) -> dict[uuid.UUID, uuid.UUID]:
    """One sign-in of a new user on each guest device; {device: user}."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    users = {device: uuid.uuid4() for device in devices}
    for device, user in users.items():
        envelope = sign_in_envelope(user_id=user, anonymous_id=device,
                                    signed_in_at=datetime.now(UTC).isoformat())
        _produce(producer, topic, str(user).encode(), orjson.dumps(envelope))
    producer.flush(60)
    return users


def _produce(producer: Producer, topic: str, key: bytes, value: bytes) -> None:
    while True:
        try:
            producer.produce(topic, key=key, value=value)
            return
        except BufferError:
            producer.poll(0.05)


def consume_json(bootstrap: str, topic: str, *, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every record of ``topic`` from the beginning up to the end offsets seen now, as JSON."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"deploy-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in partitions}
        pending = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                if msg.error() is not None:
                    continue
                partition, offset = msg.partition() or 0, msg.offset() or 0
                if offset < ends[partition]:
                    found.append(orjson.loads(msg.value() or b"null"))
                if offset >= ends[partition] - 1:
                    pending.discard(partition)
        if pending:
            raise TimeoutError(f"{topic}: partitions {sorted(pending)} not read to their end")
        return found
    finally:
        consumer.close()


@dataclass(frozen=True)
class Exactness:
    """Rows and action-tracked records of the produced messages.

    ``exact``: every message has exactly one row, every row exactly one action-tracked record
    (one MessageId), and the topic holds nothing else.
    """

    messages: int
    rows: int
    messages_without_row: int
    messages_with_two_rows: int
    tracked_records: int
    rows_announced_once: int
    unpublished: int
    rows_announced_twice: int = 0
    """Rows with more than one action-tracked record: a duplicate, whenever it is counted (the
    rows and the topic are read one after the other, so the counts of each may differ)."""

    @property
    def exact(self) -> bool:
        """Nothing lost, nothing doubled."""
        return (self.rows == self.messages and self.messages_without_row == 0
                and self.messages_with_two_rows == 0 and self.unpublished == 0
                and self.tracked_records == self.rows == self.rows_announced_once)


def exactness(dsn: str, bootstrap: str, topic: str, message_ids: Sequence[uuid.UUID]
              ) -> Exactness:
    """Count rows per message in PostgreSQL and action-tracked records per row on Kafka."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, source_message_id FROM user_activity.action_events",
        ).fetchall()
    per_message = Counter(source for _id, source in rows)
    wanted = set(message_ids)
    tracked = consume_json(bootstrap, topic)
    per_row = Counter(str(record["AggregateId"]) for record in tracked)
    row_ids = {str(row_id) for row_id, _source in rows}
    return Exactness(
        messages=len(wanted),
        rows=len(rows),
        messages_without_row=sum(1 for m in wanted if per_message[m] == 0),
        messages_with_two_rows=sum(1 for count in per_message.values() if count > 1),
        tracked_records=len(tracked),
        rows_announced_once=sum(1 for r in row_ids if per_row[r] == 1),
        unpublished=unpublished(dsn, topic),
        rows_announced_twice=sum(1 for count in per_row.values() if count > 1),
    )


def holds_lease(log: str) -> bool:
    """Whether a container's log (every run of it) ends holding the outbox lease.

    That is, its last ``outbox-lease-taken`` / ``outbox-lease-released`` event is a take. (The
    pods reach PostgreSQL on 127.0.0.1, so ``pg_locks`` cannot tell them apart.)
    """
    last = None
    for line in log.splitlines():
        if '"outbox-lease-taken"' in line:
            last = True
        elif '"outbox-lease-released"' in line:
            last = False
    return bool(last)


def unpublished(dsn: str, topic: str) -> int:
    """Outbox rows of ``topic`` not yet published (past the watermark, or parked and requeued)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM user_activity.outbox_unpublished"
                           " WHERE topic = %s", (topic,)).fetchone()
    return int(row[0]) if row else 0


def session_users(dsn: str, devices: Sequence[uuid.UUID]) -> dict[uuid.UUID, uuid.UUID | None]:
    """The user of each device's session (None: still a guest)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT anonymous_id, user_id FROM user_activity.sessions"
            " WHERE anonymous_id = ANY(%s)", (list(devices),),
        ).fetchall()
    return {device: user for device, user in found}
