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
from dataflows.favorite_actions.records import RecordedAction, SessionSnapshot
from dataflows.favorite_actions.store import FavoritesStore, owner_of
from devenv.harness.sessions import LINKED_LONG_AGO
from schemas.action_tracked import utc_offset_seconds
from schemas.favorites import ActionType
from schemas.kafka_record import SourceRecord

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


def _column_lists(actions: list[RecordedAction], now: datetime) -> dict[str, list[Any]]:
    """The ``record_actions`` parameters as plain lists of the rows' values, one per column.

    The outbox rows are thin (migration 0008): the source's CorrelationId (UTF-8) and its
    OccurredAt offset in seconds, and the batch's clock as created_at.
    """
    events = [a.event for a in actions]
    outbox = [a.outbox for a in actions]
    return {
        "idempotency_keys": [a.idempotency_key for a in actions],
        "ids": [e.id for e in events],
        "action_types": [e.action_type for e in events],
        "session_ids": [e.session_id for e in events],
        "anonymous_ids": [e.anonymous_id for e in events],
        "user_ids": [e.user_id for e in events],
        "occurred_ats": [e.occurred_at for e in events],
        "property_object_ids": [e.property_object_id for e in events],
        "favorite_ids": [e.favorite_id for e in events],
        "source_message_ids": [e.source_message_id for e in events],
        "outbox_ids": [o.id for o in outbox],
        "outbox_topics": [o.topic for o in outbox],
        "outbox_headers": [orjson.dumps(o.headers).decode() for o in outbox],
        "correlation_ids": [None if (c := a.message.envelope.correlation_id) is None
                            else c.encode() for a in actions],
        "occurred_offsets": [Int4(utc_offset_seconds(e.occurred_at)) for e in events],
        "outbox_created_ats": [now for _ in actions],
    }


def _encoded(param: Any) -> tuple[int, bytes]:
    return type(param).array_oid, param.data


def _session(user: bool) -> SessionSnapshot:
    return SessionSnapshot(uuid.uuid4(), uuid.uuid4(), uuid.uuid4() if user else None,
                           LINKED_LONG_AGO if user else None)


def test_record_parameters_are_what_psycopg_sends_for_the_lists() -> None:
    messages = [
        _message(anonymous=uuid.uuid4(), headers=(("traceparent", TRACEPARENT),)),
        _message(topic=REMOVED, user=uuid.uuid4(), occurred_at="1999-12-31T23:59:59.999999-05:00"),
        _message(anonymous=uuid.uuid4(), correlation_id='é "q" \\ \n \x00 \U0001f600'),
        _message(anonymous=uuid.uuid4(), correlation_id=None, occurred_at="2026-11-29T08:00:00Z"),
        _message(anonymous=uuid.uuid4()),  # no session
    ]
    sessions = {m.owner_key: _session(user=i % 2 == 0) for i, m in enumerate(messages[:4])}
    no_session: list[FavoriteMessage] = []
    now = datetime(2027, 1, 1, 12, 30, 1, 250, tzinfo=UTC)

    actions, params = FavoritesStore("t.action-tracked", clock=lambda: now).action_rows(
        messages, sessions, no_session)

    assert [a.message for a in actions] == messages[:4]
    assert no_session == messages[4:]
    lists = _column_lists(actions, now)
    assert set(params) == set(lists)
    for name, values in lists.items():
        assert _encoded(params[name]) == _psycopg_binary(values), name


@settings(max_examples=50)
@given(
    users=st.lists(st.booleans(), min_size=1, max_size=20),
    correlation_id=st.none() | st.text(st.characters(codec="utf-8"), max_size=20),
    traced=st.booleans(),
)
def test_record_parameters_match_psycopg_for_any_batch(
    users: list[bool], correlation_id: str | None, traced: bool
) -> None:
    headers = (("traceparent", TRACEPARENT),) if traced else ()
    messages = [_message(anonymous=uuid.uuid4(), correlation_id=correlation_id, headers=headers)
                for _ in users]
    sessions = {m.owner_key: _session(user) for m, user in zip(messages, users, strict=True)}
    clock = datetime(2027, 1, 1, tzinfo=UTC)

    actions, params = FavoritesStore("t", clock=lambda: clock).action_rows(messages, sessions, [])

    for name, values in _column_lists(actions, clock).items():
        if all(v is None for v in values):  # psycopg cannot tell the type of an all-NULL list
            assert params[name].data.startswith(b"\x00\x00\x00\x01\x00\x00\x00\x01")
            continue
        assert _encoded(params[name]) == _psycopg_binary(values), name


def test_owner_parameters_are_what_psycopg_sends_for_the_lists() -> None:
    device, user = uuid.uuid4(), uuid.uuid4()
    messages = [_message(anonymous=device), _message(user=user), _message(anonymous=device),
                _message(user=uuid.uuid4())]

    keys, params = FavoritesStore.owner_params(messages)

    owners = list(dict.fromkeys(owner_of(m) for m in messages))
    assert keys == list(dict.fromkeys(m.owner_key for m in messages))
    assert len(keys) == len(owners) == 3
    assert _encoded(params["anonymous_ids"]) == _psycopg_binary([a for a, _ in owners])
    assert _encoded(params["user_ids"]) == _psycopg_binary([u for _, u in owners])


@pytest.mark.parametrize("count", [0, 1])
def test_an_empty_or_single_batch_encodes(count: int) -> None:
    messages = [_message(anonymous=uuid.uuid4()) for _ in range(count)]
    sessions = {m.owner_key: _session(user=False) for m in messages}

    actions, params = FavoritesStore("t").action_rows(messages, sessions, [])

    assert len(actions) == count
    if count:
        assert _encoded(params["ids"]) == _psycopg_binary([a.event.id for a in actions])
    else:  # an empty array: no dimensions
        assert params["ids"].data == b"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x0b\x86"
