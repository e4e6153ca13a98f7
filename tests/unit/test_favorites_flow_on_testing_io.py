"""The real favorites ``build_flow`` on Bytewax's TestingSource/TestingSink, 1 and 2 workers.

No Kafka, no PostgreSQL: the flow's own steps (decode, routing, dedup) run as in production; the
outputs are the items the real sinks would receive.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main
from prometheus_client import REGISTRY

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.flow import (
    FavoritesSinks,
    build_flow,
    owner_shard,
    owner_shards,
)
from devenv.harness.messages import favorite_envelope
from runtime.settings import Settings
from schemas.dlq import DlqReason
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord

SETTINGS = Settings(http_port=0, outbox_enabled=False)


def _record(offset: int, value: bytes | None, topic: str = SETTINGS.topic_favorite_added) -> (
    SourceRecord
):
    return SourceRecord(topic, offset % 6, offset, b"key", value)


def _run_1(flow: Any) -> None:
    run_main(flow)


def _run_2(flow: Any) -> None:
    cluster_main(flow, addresses=[], proc_id=0, worker_count_per_proc=2)


@pytest.mark.parametrize("run", [_run_1, _run_2], ids=["1-worker", "2-workers"])
def test_the_real_flow_routes_every_record_to_its_one_outcome(
    run: Callable[[Any], None],
) -> None:
    owners = [uuid.uuid4() for _ in range(5)]
    added = [favorite_envelope(anonymous_id=owners[i % 5]) for i in range(20)]
    removed = [favorite_envelope(user_id=owners[i % 5]) for i in range(5)]
    records = [_record(i, orjson.dumps(e)) for i, e in enumerate(added)]
    records += [_record(100 + i, orjson.dumps(e), SETTINGS.topic_favorite_removed)
                for i, e in enumerate(removed)]
    records += [
        _record(200, orjson.dumps(added[3])),  # a redelivery of the same MessageId
        _record(201, orjson.dumps(favorite_envelope())),  # neither owner: invalid-owner
        _record(202, b"not json"),  # poison
        _record(203, None),  # tombstone
    ]
    history: list[tuple[str, FavoriteMessage]] = []
    letters: list[DeadLetter] = []
    flow = build_flow(
        SETTINGS, source=TestingSource(records, batch_size=7),
        sinks=FavoritesSinks(TestingSink(history), TestingSink(letters)),
    )

    run(flow)

    recorded = {m.message_id for _, m in history}
    assert len(history) == 25 == len(recorded)  # the redelivery was dropped by the dedup step
    assert recorded == {uuid.UUID(e["MessageId"]) for e in added + removed}
    shards = owner_shards(SETTINGS.sink_partitions)
    assert all(key == owner_shard(m, shards) for key, m in history)  # each owner: its one shard
    assert len({key for key, _ in history}) > 1  # the owners spread over several shards
    assert sum(m.action_type is ActionType.REMOVE_FROM_FAVORITES for _, m in history) == 5
    assert sorted((letter.record.offset, letter.reason) for letter in letters) == [
        (202, DlqReason.INVALID_JSON), (203, DlqReason.TOMBSTONE),
    ]


@pytest.mark.parametrize("run", [_run_1, _run_2], ids=["1-worker", "2-workers"])
def test_a_full_dedup_window_forgets_its_oldest_ids_and_passes_their_redeliveries_on(
    run: Callable[[Any], None],
) -> None:
    # 1 sink partition: 8 shards sharing 16 ids, so one owner's shard remembers 2 of them
    settings = SETTINGS.model_copy(update={"sink_partitions": 1, "dedup_max_ids": 16})
    owner = uuid.uuid4()
    sent = [favorite_envelope(anonymous_id=owner) for _ in range(5)]
    records = [_record(i, orjson.dumps(e)) for i, e in enumerate(sent)]
    records += [_record(10, orjson.dumps(sent[0])),  # forgotten early: passed on (the DB decides)
                _record(11, orjson.dumps(sent[4]))]  # still remembered: dropped here
    history: list[tuple[str, FavoriteMessage]] = []
    forgotten = ("user_activity_dedup_forgotten_early_total", {"flow": "favorites"})
    before = REGISTRY.get_sample_value(*forgotten) or 0.0
    flow = build_flow(
        settings, source=TestingSource(records, batch_size=3),
        sinks=FavoritesSinks(TestingSink(history), TestingSink([])),
    )

    run(flow)

    ids = [str(m.message_id) for _, m in history]
    assert ids == [e["MessageId"] for e in [*sent, sent[0]]]
    assert REGISTRY.get_sample_value(*forgotten) == before + 4  # 5 + 1 admitted, 2 kept
