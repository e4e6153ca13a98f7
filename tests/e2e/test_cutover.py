"""Cutover from an existing consumer group: the job starts where that group stopped."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from dataflows.favorite_actions import build_flow
from devenv.harness.messages import favorite_envelope, new_id
from devenv.harness.sessions import insert_session
from schemas.favorites import ActionTrackedEnvelope
from tests.conftest import SettingsFactory
from tests.support import action_rows, consume_all, envelope_record, produce, run_flow

pytestmark = pytest.mark.e2e

PARTITIONS, PER_PARTITION, COMMITTED = 6, 3, 2


def _commit(settings: Any, group: str, topic: str, offset: int) -> None:
    """What the consumer being replaced left: ``offset`` committed on every partition."""
    consumer = Consumer({**settings.kafka_client_config(), "group.id": group,
                         "enable.auto.commit": False})
    try:
        consumer.commit(offsets=[TopicPartition(topic, p, offset) for p in range(PARTITIONS)],
                        asynchronous=False)
    finally:
        consumer.close()


def test_a_job_started_from_a_group_reads_from_its_committed_offsets_and_announces_nothing_before(
    make_settings: SettingsFactory, db: psycopg.Connection[Any],
) -> None:
    group = f"legacy-{uuid.uuid4().hex[:8]}"
    settings = make_settings(start_from_group=group)
    anonymous = new_id()
    insert_session(db, anonymous_id=anonymous)
    added = [[favorite_envelope(anonymous_id=anonymous) for _ in range(PER_PARTITION)]
             for _ in range(PARTITIONS)]
    removed = favorite_envelope(anonymous_id=anonymous)  # a topic the group has no offset on
    produce(settings, [envelope_record(settings.topic_favorite_added, envelope, partition=p)
                       for p, envelopes in enumerate(added) for envelope in envelopes])
    produce(settings, [envelope_record(settings.topic_favorite_removed, removed, partition=0)])
    _commit(settings, group, settings.topic_favorite_added, COMMITTED)

    run_flow(build_flow, settings)

    def ids(envelopes: list[dict[str, Any]]) -> list[uuid.UUID]:
        return [uuid.UUID(e["MessageId"]) for e in envelopes]

    before = ids([e for envelopes in added for e in envelopes[:COMMITTED]])
    after = ids([e for envelopes in added for e in envelopes[COMMITTED:]] + [removed])
    assert action_rows(db, before) == []
    rows = action_rows(db, after)
    assert len(rows) == len(after) == PARTITIONS * (PER_PARTITION - COMMITTED) + 1
    tracked = consume_all(settings, settings.topic_action_tracked, expect_at_least=len(after))
    announced = [ActionTrackedEnvelope.model_validate_json(c.value or b"").aggregate_id
                 for c in tracked]
    assert sorted(announced) == sorted(str(row["id"]) for row in rows)
