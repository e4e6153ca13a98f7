"""The pure favorites steps wired in tiny Bytewax flows, under one worker and under two."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import bytewax.operators as op
import orjson
import pytest
from bytewax.dataflow import Dataflow
from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main

from dataflows.common import deduplicated
from dataflows.favorite_actions.decode import (
    Decoded,
    FavoriteMessage,
    Skipped,
    decode_favorite,
)
from schemas.dlq_letter import DeadLetter
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord

ADDED, REMOVED = "favorite-added", "favorite-removed"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES, REMOVED: ActionType.REMOVE_FROM_FAVORITES}


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


def _records() -> tuple[list[SourceRecord], set[tuple[str, str]]]:
    owners = [uuid.uuid4() for _ in range(7)]
    records: list[SourceRecord] = []
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
    return records, expected


def _valid(decoded: Decoded) -> FavoriteMessage | None:
    return decoded if isinstance(decoded, FavoriteMessage) else None


def _rejected(decoded: Decoded) -> Skipped | DeadLetter | None:
    return None if isinstance(decoded, FavoriteMessage) else decoded


def _owner(message: FavoriteMessage) -> str:
    return message.owner_key


def _ignore(_message: FavoriteMessage) -> None:
    return None


def _owner_and_key(item: tuple[str, FavoriteMessage]) -> tuple[str, str]:
    owner, message = item
    return owner, message.idempotency_key.split(":", 1)[1]


def _flow(records: list[SourceRecord], out: list[Any], rejected: list[Any]) -> Dataflow:
    flow = Dataflow("favorite_steps")
    stream = op.input("records", flow, TestingSource(records))
    decoded = op.map("decode_favorite", stream, lambda r: decode_favorite(r, ACTION_TYPES))
    valid = op.filter_map("valid", decoded, _valid)
    op.output(
        "collect_rejected",
        op.filter_map("rejected", decoded, _rejected),
        TestingSink(rejected),
    )
    keyed = op.key_on("key_by_owner", valid, _owner)
    fresh = deduplicated("dedup_by_message_id", keyed, 3600, _ignore)
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
def test_each_valid_message_passes_once_keyed_by_its_owner(runner: str) -> None:
    records, expected = _records()
    out: list[Any] = []
    rejected: list[Any] = []

    RUNNERS[runner](_flow(records, out, rejected))

    assert len(out) == len(expected)
    assert set(out) == expected
    kinds = sorted(type(r).__name__ for r in rejected)
    assert kinds == ["DeadLetter", "DeadLetter", "Skipped"]
    assert {r.reason.value for r in rejected if isinstance(r, DeadLetter)} == {
        "invalid-json", "tombstone",
    }
    assert all(r.reason.value == "invalid-owner" for r in rejected if isinstance(r, Skipped))
