"""Map a favorites message and its resolved session to the rows of one transaction (pure).

SessionId and AnonymousId come from the owner's session (INV-ACT-003), UserId as
``record_actions.sql`` decided it; OccurredAt from the payload, never the server clock
(INV-ACT-005). The action-tracked outbox row's MessageId is stable across re-publication.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple
from uuid import UUID

from dataflows.favorite_actions.decode import FavoriteMessage
from schemas.action_tracked import action_tracked_key, action_tracked_value, rendered_created_at
from schemas.favorites import ActionType
from schemas.outbox import OutboxRow


class ActionEventRow(NamedTuple):
    """One ``user_activity.action_events`` row."""

    id: UUID
    action_type: str
    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    occurred_at: datetime
    property_object_id: UUID
    favorite_id: UUID
    source_message_id: UUID


class RecordedAction(NamedTuple):
    """The rows one message produces, committed together or not at all."""

    message: FavoriteMessage
    event: ActionEventRow
    outbox: OutboxRow


def _copy(data: bytes) -> bytes:
    """A new bytes object with the content of ``data`` (``bytes(data)`` would return ``data``)."""
    return bytes(memoryview(data))


_ACTION_NAMES = {action: action.value for action in ActionType}
_new_row = tuple.__new__


class ActionRowBuilder:
    """Builds the :class:`RecordedAction` of messages recorded in one batch at ``now``."""

    __slots__ = ("_created_at", "_topic")

    def __init__(self, topic: str, now: datetime) -> None:
        self._topic = topic
        self._created_at = rendered_created_at(now)

    def build_resolved(self, message: FavoriteMessage, resolved: tuple[UUID, UUID, UUID | None],
                       action_event_id: UUID, outbox_message_id: UUID,
                       headers: dict[str, str]) -> RecordedAction:
        """The rows for ``message``; ``resolved``: SessionId, AnonymousId and the row's UserId."""
        session_id, anonymous_id, user_id = resolved
        envelope = message.envelope
        payload = envelope.payload
        action_type = _ACTION_NAMES[message.action_type]
        # a right-sized copy: holding orjson's outputs makes every later dumps cost about twice
        value = _copy(action_tracked_value(outbox_message_id, self._created_at, action_event_id,
                                           envelope.correlation_id, action_type, session_id,
                                           anonymous_id, user_id, payload.occurred_at,
                                           payload.property_object_id, payload.favorite_id))
        event = _new_row(ActionEventRow, (
            action_event_id, action_type, session_id, anonymous_id, user_id,
            payload.occurred_at, payload.property_object_id, payload.favorite_id,
            envelope.message_id,
        ))
        outbox = OutboxRow(outbox_message_id, self._topic, action_tracked_key(action_event_id),
                           value, headers)
        return _new_row(RecordedAction, (message, event, outbox))
