"""The naive reference consumer: one message at a time, one transaction per message.

One confluent-kafka consumer on both favorites topics (auto-commit), the job's own decode and
validation, then per message the job's own store (:meth:`FavoritesStore.record_batch`: the
session lookup and the insert, with one-element arrays) in one transaction, commit, then the
action-tracked message produced asynchronously (delivery served by ``poll(0)``; flushed at the
end). No in-memory dedup: the database's idempotency decides. Time-bounded: the rate is measured
over ``seconds`` and extrapolated to the backlog.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import FavoritesStore
from runtime.settings import Settings
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from sinks.db import SESSION_OPTIONS  # the job's session settings (jit off)


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

    store = FavoritesStore(settings.topic_action_tracked)
    counts = {"processed": 0, "recorded": 0, "skipped": 0, "no_session": 0, "duplicate": 0}
    conn = psycopg.connect(db_url, autocommit=True, options=SESSION_OPTIONS)
    try:
        start = time.monotonic()
        deadline = start + seconds
        while counts["processed"] < backlog_size and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            headers = tuple((str(h[0]), h[1]) for h in msg.headers() or []
                            if isinstance(h[1], bytes))
            record = SourceRecord(msg.topic() or "", msg.partition() or 0, msg.offset() or 0,
                                  msg.key(), msg.value(), headers, time.monotonic())
            counts["processed"] += 1
            decoded = decode_favorite(record, action_types)
            if not isinstance(decoded, FavoriteMessage):
                counts["skipped"] += 1
                continue
            outcome = store.record_batch(conn, [decoded])
            counts["no_session"] += len(outcome.no_session)
            counts["duplicate"] += len(outcome.duplicates)
            for action in outcome.recorded:
                counts["recorded"] += 1
                outbox = action.outbox
                producer.produce(outbox.topic, outbox.value, outbox.key,
                                 headers=[(k, v.encode()) for k, v in outbox.headers.items()],
                                 on_delivery=on_delivery)
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
