"""The action-tracked event's bytes (record key and value), rendered from the action it announces.

One renderer for the favorites sink (in memory, for the publisher's fast path) and the publisher
(from a thin outbox row and the ``action_events`` row it names). The bytes are a pure function
of facts that never change once committed, so a row sent twice is the same bytes both times.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta, timezone
from uuid import UUID

import orjson

from schemas.envelope import CONTRACT_VERSION
from schemas.favorites import ACTION_EVENT_AGGREGATE_TYPE

_dumps = orjson.dumps


def rendered_created_at(moment: datetime) -> str:
    """CreatedAt as the event carries it: ``moment`` (aware) in UTC, as orjson writes it."""
    return _dumps(moment.astimezone(UTC))[1:-1].decode()


def action_tracked_key(action_event_id: UUID) -> bytes:
    """The record key: the ActionEvent id as text (36 bytes)."""
    return _dumps(action_event_id)[1:-1]


def action_tracked_value(  # noqa: PLR0917 (the hot path: positional, no kwargs dict)
    message_id: UUID, created_at: str, action_event_id: UUID, correlation_id: str | None,
    action_type: str, session_id: UUID, anonymous_id: UUID, user_id: UUID | None,
    occurred_at: datetime, property_object_id: UUID, favorite_id: UUID,
) -> bytes:
    """The action-tracked envelope of one recorded action (``created_at``: rendered already)."""
    return _dumps({
        "MessageId": message_id,
        "CreatedAt": created_at,
        "Version": CONTRACT_VERSION,
        "AggregateId": action_event_id,
        "AggregateType": ACTION_EVENT_AGGREGATE_TYPE,
        "CorrelationId": correlation_id,
        "Payload": {
            "ActionType": action_type,
            "SessionId": session_id,
            "AnonymousId": anonymous_id,
            "UserId": user_id,
            "OccurredAt": occurred_at,
            "PropertyObjectId": property_object_id,
            "FavoriteId": favorite_id,
        },
    })


def utc_offset_seconds(moment: datetime) -> int:
    """The UTC offset of an aware ``moment`` in whole seconds (what a thin outbox row keeps)."""
    offset = moment.utcoffset()
    if offset is None:
        raise ValueError(f"{moment!r} has no UTC offset")
    return offset // timedelta(seconds=1)


def with_offset(local: datetime, offset_seconds: int) -> datetime:
    """The aware datetime of a naive local time at ``offset_seconds`` (year 9999 too)."""
    return local.replace(tzinfo=_zone(offset_seconds))


@functools.lru_cache(maxsize=256)
def _zone(offset_seconds: int) -> timezone:
    return UTC if offset_seconds == 0 else timezone(timedelta(seconds=offset_seconds))
