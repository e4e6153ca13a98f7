"""The naive reference consumer: one message at a time, one transaction per message.

One confluent-kafka consumer on both favorites topics (auto-commit), the job's own decode and
validation (pydantic), then per message: ``resolve_owner_sessions`` and ``record_actions`` (the
job's SQL, from :func:`sinks.sql.query`) with single-element arrays in one transaction, commit,
then produce the action-tracked message (asynchronously, delivery served by ``poll(0)``; flushed
at the end). No in-memory dedup: the database's idempotency decides, as the SQL is written to.

It is time-bounded: the rate is measured over ``seconds`` and extrapolated to the backlog.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import orjson
import psycopg
import uuid_utils.compat as uuid_compat
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.records import (
    SessionSnapshot,
    build_recorded_action,
)
from dataflows.favorite_actions.sql import query
from runtime.settings import Settings
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord


def run_naive(settings: Settings, db_url: str, seconds: float, backlog_size: int) -> dict[str, Any]:
    """Consume the backlog naively for at most ``seconds``; the measured rate."""
    action_types = {
        settings.topic_favorite_added: ActionType.ADD_TO_FAVORITES,
        settings.topic_favorite_removed: ActionType.REMOVE_FROM_FAVORITES,
    }
    consumer = Consumer({
        **settings.kafka_client_config(),
        "group.id": f"bench-naive-{time.time_ns()}",
        "enable.auto.commit": True,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
    })
    consumer.assign([
        TopicPartition(topic, p, OFFSET_BEGINNING)
        for topic in action_types for p in range(settings.topic_partitions)
    ])
    producer = Producer({
        **settings.kafka_client_config(), "acks": "all", "enable.idempotence": True,
        "linger.ms": 5,
    })
    delivered = [0]

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            delivered[0] += 1

    resolve_sql = query("resolve_owner_sessions")
    record_sql = query("record_actions")
    counts = {"processed": 0, "recorded": 0, "skipped": 0, "no_session": 0, "duplicate": 0}
    conn = psycopg.connect(db_url, autocommit=True)
    try:
        start = time.monotonic()
        deadline = start + seconds
        while counts["processed"] < backlog_size and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            record = SourceRecord(
                topic=msg.topic() or "", partition=msg.partition() or 0,
                offset=msg.offset() or 0, key=msg.key(), value=msg.value(),
                headers=_headers(msg.headers()),
                received_at=time.monotonic(),
            )
            counts["processed"] += 1
            decoded = decode_favorite(record, action_types)
            if not isinstance(decoded, FavoriteMessage):
                counts["skipped"] += 1
                continue
            payload = decoded.envelope.payload
            anonymous = payload.anonymous_id
            user = None if anonymous is not None else payload.user_id
            with conn.transaction(), conn.cursor(binary=True) as cur:
                cur.execute(resolve_sql, {"anonymous_ids": [anonymous], "user_ids": [user]},
                            binary=True)
                row = cur.fetchone()
                if row is None:
                    counts["no_session"] += 1
                    continue
                action = build_recorded_action(
                    decoded, SessionSnapshot(row[1], row[2], row[3], row[4]),
                    action_event_id=uuid_compat.uuid7(), outbox_message_id=uuid_compat.uuid7(),
                    topic=settings.topic_action_tracked, now=datetime.now(UTC),
                )
                event, outbox = action.event, action.outbox
                cur.execute(record_sql, {
                    "idempotency_keys": [action.idempotency_key], "ids": [event.id],
                    "action_types": [event.action_type], "session_ids": [event.session_id],
                    "anonymous_ids": [event.anonymous_id], "user_ids": [event.user_id],
                    "occurred_ats": [event.occurred_at],
                    "property_object_ids": [event.property_object_id],
                    "favorite_ids": [event.favorite_id],
                    "source_message_ids": [event.source_message_id],
                    "outbox_ids": [outbox.id], "outbox_topics": [outbox.topic],
                    "outbox_keys": [outbox.key], "outbox_values": [outbox.value],
                    "outbox_headers": [orjson.dumps(outbox.headers).decode()],
                }, binary=True)
                inserted = cur.fetchone() is not None
            if not inserted:
                counts["duplicate"] += 1
                continue
            counts["recorded"] += 1
            producer.produce(
                outbox.topic, outbox.value, outbox.key,
                headers=[(k, v.encode()) for k, v in outbox.headers.items()],
                on_delivery=on_delivery,
            )
            producer.poll(0)
        elapsed = time.monotonic() - start
        producer.flush(30)
    finally:
        conn.close()
        consumer.close()
    rate = counts["processed"] / elapsed if elapsed > 0 else 0.0
    return {
        **counts,
        "action_tracked_delivered": delivered[0],
        "seconds": round(elapsed, 2),
        "events_per_s": round(rate, 1),
        "extrapolated": counts["processed"] < backlog_size,
        "extrapolated_backlog_seconds": round(backlog_size / rate, 1) if rate else None,
    }


def _headers(raw: Any) -> tuple[tuple[str, bytes], ...]:
    if not isinstance(raw, list):
        return ()
    return tuple((str(item[0]), item[1] or b"") for item in raw)
