"""FavoritesStore's statement parameters: the bytes psycopg itself would send for the lists.

The store encodes its binary array parameters itself (fast); these tests hold it to psycopg's
own list dumper (``Transformer().get_dumper(list, BINARY)``) on the same values as plain
lists, one per column of the rows, byte for byte.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.adapt import PyFormat, Transformer
from psycopg.types.numeric import Int4

from dataflows.favorite_actions.decode import FavoriteMessage, decode_favorite
from dataflows.favorite_actions.store import BatchOutcome, FavoritesStore, PendingBatch, owner_of
from schemas.action_tracked import utc_offset_seconds
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord
from schemas.outbox import propagated_headers

ADDED, REMOVED = "favorite-added", "favorite-removed"
ACTION_TYPES = {ADDED: ActionType.ADD_TO_FAVORITES, REMOVED: ActionType.REMOVE_FROM_FAVORITES}
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _message(
    *, topic: str = ADDED, anonymous: uuid.UUID | None = None, user: uuid.UUID | None = None,
    occurred_at: str = "2026-11-29T08:00:00.1234567+03:00", correlation_id: str | None = "c",
    headers: tuple[tuple[str, bytes], ...] = (),
) -> FavoriteMessage:
    value = orjson.dumps({
        "MessageId": str(uuid.uuid4()), "CreatedAt": "2026-11-29T08:00:00+00:00", "Version": 1,
        "AggregateId": "f", "AggregateType": "Favorite", "CorrelationId": correlation_id,
        "Payload": {
            "FavoriteId": str(uuid.uuid4()).upper(), "PropertyObjectId": str(uuid.uuid4()),
            "AnonymousId": None if anonymous is None else str(anonymous),
            "UserId": None if user is None else str(user), "OccurredAt": occurred_at,
        },
    })
    message = decode_favorite(SourceRecord(topic, 0, 0, b"k", value, headers), ACTION_TYPES)
    assert isinstance(message, FavoriteMessage)
    return message


def _psycopg_binary(value: list[Any]) -> tuple[int, bytes]:
    dumper = Transformer().get_dumper(value, PyFormat.BINARY)
    return dumper.oid, bytes(dumper.dump(value) or b"")


def _column_lists(pending: PendingBatch, topic: str) -> dict[str, list[Any]]:
    """The ``record_actions`` parameters as plain lists of the messages' values, one per column.

    The owner is the message's AnonymousId, else its UserId (the statement resolves the
    session). The outbox rows are thin (migration 0008): the source's CorrelationId (UTF-8) and
    its OccurredAt offset in seconds, and the batch's clock as created_at.
    """
    messages = pending.messages
    payloads = [m.envelope.payload for m in messages]
    return {
        "idempotency_keys": [m.idempotency_key for m in messages],
        "ids": pending.event_ids,
        "action_types": [m.action_type.value for m in messages],
        "owner_anonymous_ids": [owner_of(m)[0] for m in messages],
        "owner_user_ids": [owner_of(m)[1] for m in messages],
        "occurred_ats": [p.occurred_at for p in payloads],
        "property_object_ids": [p.property_object_id for p in payloads],
        "favorite_ids": [p.favorite_id for p in payloads],
        "source_message_ids": [m.envelope.message_id for m in messages],
        "outbox_ids": pending.outbox_ids,
        "outbox_topics": [topic for _ in messages],
        "outbox_headers": [orjson.dumps(propagated_headers(m.record, m.trace)).decode()
                           for m in messages],
        "correlation_ids": [None if (c := m.envelope.correlation_id) is None
                            else c.encode() for m in messages],
        "occurred_offsets": [Int4(utc_offset_seconds(p.occurred_at)) for p in payloads],
        "outbox_created_ats": [pending.now for _ in messages],
        "wait_seconds": [Int4(0)],
    }


def _encoded(param: Any) -> tuple[int, bytes]:
    return type(param).array_oid, param.data


def test_record_parameters_are_what_psycopg_sends_for_the_lists() -> None:
    messages = [
        _message(anonymous=uuid.uuid4(), headers=(("traceparent", TRACEPARENT),)),
        _message(topic=REMOVED, user=uuid.uuid4(), occurred_at="1999-12-31T23:59:59.999999-05:00"),
        _message(anonymous=uuid.uuid4(), correlation_id='é "q" \\ \n \x00 \U0001f600'),
        _message(anonymous=uuid.uuid4(), correlation_id=None, occurred_at="2026-11-29T08:00:00Z"),
        _message(user=uuid.uuid4()),
    ]
    now = datetime(2027, 1, 1, 12, 30, 1, 250, tzinfo=UTC)

    pending, params = FavoritesStore("t.action-tracked", clock=lambda: now).statement(
        messages, BatchOutcome())

    assert pending.messages == messages and pending.now == now
    assert len(set(pending.event_ids) | set(pending.outbox_ids)) == 2 * len(messages)
    lists = _column_lists(pending, "t.action-tracked")
    assert set(params) == set(lists)
    for name, values in lists.items():
        assert _encoded(params[name]) == _psycopg_binary(values), name


@settings(max_examples=50)
@given(
    owners=st.lists(st.tuples(st.booleans(), st.sampled_from(["+03:00", "Z", "-05:30", "+14:00"])),
                    min_size=1, max_size=20),
    correlation_id=st.none() | st.text(st.characters(codec="utf-8"), max_size=20),
    traced=st.booleans(),
)
def test_record_parameters_match_psycopg_for_any_batch(
    owners: list[tuple[bool, str]], correlation_id: str | None, traced: bool
) -> None:
    """Any mix of owners and OccurredAt offsets in one batch (offsets are cached per zone)."""
    headers = (("traceparent", TRACEPARENT),) if traced else ()
    messages = [
        _message(user=uuid.uuid4() if user else None,
                 anonymous=None if user else uuid.uuid4(), correlation_id=correlation_id,
                 headers=headers, occurred_at=f"2026-11-29T08:00:00.1234567{offset}")
        for user, offset in owners
    ]
    clock = datetime(2027, 1, 1, tzinfo=UTC)

    pending, params = FavoritesStore("t", clock=lambda: clock).statement(messages, BatchOutcome())

    for name, values in _column_lists(pending, "t").items():
        if all(v is None for v in values):  # psycopg cannot tell the type of an all-NULL list
            assert params[name].data.startswith(b"\x00\x00\x00\x01\x00\x00\x00\x01")
            continue
        assert _encoded(params[name]) == _psycopg_binary(values), name


def test_the_answer_settles_each_message_as_recorded_duplicate_or_without_session() -> None:
    recorded, duplicate, homeless = (_message(anonymous=uuid.uuid4()) for _ in range(3))
    store = FavoritesStore("t.action-tracked")
    pending, _params = store.statement([recorded, duplicate, homeless], BatchOutcome())
    session_id, device, user = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    # the statement's answer: (position, session id, its AnonymousId, the row's UserId, new?,
    # the transaction's id)
    outcome = store.settle(pending, [(2, uuid.uuid4(), device, None, False, 77),
                                     (1, session_id, device, user, True, 77)])

    assert outcome.duplicates == [duplicate] and outcome.no_session == [homeless]
    assert outcome.txid == 77
    [action] = outcome.recorded
    assert action.message is recorded
    assert action.event.id == pending.event_ids[0] and action.outbox.id == pending.outbox_ids[0]
    assert (action.event.session_id, action.event.anonymous_id, action.event.user_id) == (
        session_id, device, user)
    value = orjson.loads(action.outbox.value)
    assert value["Payload"]["SessionId"] == str(session_id)
    assert value["Payload"]["UserId"] == str(user)


@pytest.mark.parametrize("count", [0, 1])
def test_an_empty_or_single_batch_encodes(count: int) -> None:
    messages = [_message(anonymous=uuid.uuid4()) for _ in range(count)]

    pending, params = FavoritesStore("t").statement(messages, BatchOutcome())

    assert len(pending.event_ids) == count
    if count:
        assert _encoded(params["ids"]) == _psycopg_binary(pending.event_ids)
    else:  # an empty array: no dimensions
        assert params["ids"].data == b"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x0b\x86"
