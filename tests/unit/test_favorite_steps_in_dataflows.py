"""The favorites decode step and the dedup wired in tiny Bytewax flows, one worker and two."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import bytewax.operators as op
import orjson
import pytest
from bytewax.dataflow import Dataflow, Stream
from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.flow import decoder, is_keyed, owner_shard, owner_shards
from dataflows.favorite_actions.store import owner_of
from dataflows.operators import deduplicated
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import ConsumerError, SourceRecord
from sources.kafka_input import InputItem

ADDED, REMOVED = "favorite-added", "favorite-removed"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES, REMOVED: ActionType.REMOVE_FROM_FAVORITES}
SHARDS = owner_shards(2)


def _value(message_id: uuid.UUID, anonymous: uuid.UUID | None, user: uuid.UUID | None) -> bytes:
    return orjson.dumps({
        "MessageId": str(message_id), "CreatedAt": "2026-11-29T08:00:00.1234567+03:00",
        "Version": 1, "AggregateId": "f", "AggregateType": "Favorite",
        "Payload": {
            "FavoriteId": str(uuid.uuid4()).upper(), "PropertyObjectId": str(uuid.uuid4()),
            "AnonymousId": None if anonymous is None else str(anonymous),
            "UserId": None if user is None else str(user),
            "OccurredAt": "2026-11-29T07:59:59Z",
        },
    })


def _records() -> tuple[list[InputItem], set[tuple[str, str]]]:
    owners = [uuid.uuid4() for _ in range(7)]
    records: list[InputItem] = []
    expected: set[tuple[str, str]] = set()
    for i in range(60):
        message_id, owner = uuid.uuid4(), owners[i % 7]
        topic = ADDED if i % 3 else REMOVED
        anonymous, user = (owner, None) if i % 2 else (None, owner)
        value = _value(message_id, anonymous, user)
        record = SourceRecord(topic, i % 6, i, b"k", value)
        records.append(record)
        records.append(SourceRecord(topic, (i + 1) % 6, 1000 + i, b"k", value))  # redelivery
        kind = "anonymous" if anonymous else "user"
        expected.add((f"{kind}:{owner}", f"{ACTION_TYPES[topic].value}:{message_id}"))
    records.append(SourceRecord(ADDED, 0, 5000, b"k", _value(uuid.uuid4(), None, None)))
    records.append(SourceRecord(ADDED, 0, 5001, b"k", b"{not json"))
    records.append(SourceRecord(ADDED, 0, 5002, b"k", None))
    records.append(ConsumerError(ADDED, 1, "_TRANSPORT", "broker down", fatal=False))
    return records, expected


def _ignore(_message: FavoriteMessage) -> None:
    return None


def _owner_and_key(item: tuple[str, FavoriteMessage]) -> tuple[str, str]:
    shard, message = item
    assert shard == owner_shard(message, SHARDS)
    anonymous, user = owner_of(message)
    owner = f"anonymous:{anonymous}" if anonymous is not None else f"user:{user}"
    return owner, message.idempotency_key.split(":", 1)[1]


def _flow(records: list[InputItem], out: list[Any], rejected: list[Any]) -> Dataflow:
    flow = Dataflow("favorite_steps")
    stream: Stream[InputItem] = op.input("records", flow, TestingSource(records, batch_size=7))
    routed = op.flat_map_batch("decode_favorites", stream, decoder(ACTION_TYPES, SHARDS))
    by_kind = op.branch("route_poison", routed, is_keyed)
    op.output("collect_rejected", by_kind.falses, TestingSink(rejected))
    fresh = deduplicated("dedup_by_message_id", by_kind.trues, 3600, _ignore)  # type: ignore[arg-type]
    pairs = op.map("idempotency", fresh, _owner_and_key)
    op.output("out", pairs, TestingSink(out))
    return flow


RUNNERS: dict[str, Callable[[Dataflow], None]] = {
    "one worker": run_main,
    "two workers": lambda flow: cluster_main(
        flow, addresses=[], proc_id=0, worker_count_per_proc=2
    ),
}


@pytest.mark.parametrize("runner", list(RUNNERS), ids=list(RUNNERS))
def test_each_valid_message_passes_once_keyed_by_its_owners_shard(
    runner: str, caplog: pytest.LogCaptureFixture
) -> None:
    records, expected = _records()
    out: list[Any] = []
    rejected: list[Any] = []

    with caplog.at_level(logging.INFO):
        RUNNERS[runner](_flow(records, out, rejected))

    assert len(out) == len(expected)
    assert set(out) == expected
    assert all(isinstance(r, DeadLetter) for r in rejected)
    assert sorted(r.reason.value for r in rejected) == ["invalid-json", "tombstone"]
    events = [r.getMessage() for r in caplog.records]
    assert events.count("invalid-owner") == 1  # acknowledged without a row, logged
    assert events.count("kafka-consumer-error") == 1  # logged, never passed on


def test_decode_step_keeps_order_and_logs_a_version_mismatch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    records, _ = _records()
    valid = [r for r in records if isinstance(r, SourceRecord) and r.offset < 1000]
    other = orjson.loads(valid[0].value or b"")
    other["Version"] = 2
    valid[0] = SourceRecord(ADDED, 0, 0, b"k", orjson.dumps(other))

    with caplog.at_level(logging.INFO):
        routed = decoder(ACTION_TYPES, SHARDS)(list(valid))

    assert [m.record.offset for _, m in routed] == [r.offset for r in valid]  # type: ignore[misc]
    keyed = [item for item in routed if isinstance(item, tuple)]
    assert len(keyed) == len(routed)
    assert all(shard == owner_shard(m, SHARDS) for shard, m in keyed)
    owners = [m.envelope.payload.anonymous_id or m.envelope.payload.user_id for _, m in keyed]
    # the shard is the owner's AnonymousId (else UserId) modulo the shard count (16)
    assert [int(shard) for shard, _ in keyed] == [o.int % 16 for o in owners if o is not None]
    assert [r.getMessage() for r in caplog.records] == ["contract-version-mismatch", "consumed"]
    assert caplog.records[-1].records == len(valid)  # type: ignore[attr-defined]
