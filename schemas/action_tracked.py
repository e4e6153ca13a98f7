"""The action-tracked event's bytes (record key and value), rendered from the action it announces.

One renderer for the two places that need the bytes: the favorites sink renders them in memory
at record time (the outbox publisher's fast path sends that copy), and the publisher renders a
thin outbox row (migration 0008: no stored value) from the ``action_events`` row it names. The
bytes are a pure function of facts that never change once committed: the outbox row's id
(MessageId), its ``created_at`` (CreatedAt), the source's CorrelationId and OccurredAt offset
(kept on the outbox row) and the action_events row (immutable, INV-ACT-001). So a row sent
twice (by the fast path, then again by a window after a crash) is the same bytes both times.

orjson renders UUIDs (lower-case, hyphenated) and aware datetimes (RFC 3339, the offset kept,
microseconds only when non-zero) itself; the field order is the contract's.
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
    """The record value: the action-tracked envelope of one recorded action (UTF-8 JSON).

    ``created_at`` is :func:`rendered_created_at`'s text; ``occurred_at`` carries the offset
    the source wrote it with.
    """
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
    """The aware datetime of a naive local time ``local`` at UTC offset ``offset_seconds``.

    The publisher reads OccurredAt back as the local time at the stored offset (PostgreSQL's
    ``AT TIME ZONE``), so a moment near the end of year 9999 with a negative offset, which has
    no UTC ``datetime`` in Python, still renders.
    """
    return local.replace(tzinfo=_zone(offset_seconds))


@functools.lru_cache(maxsize=256)
def _zone(offset_seconds: int) -> timezone:
    """The fixed-offset zone of ``offset_seconds`` (one object per offset: a row's is reused)."""
    return UTC if offset_seconds == 0 else timezone(timedelta(seconds=offset_seconds))
