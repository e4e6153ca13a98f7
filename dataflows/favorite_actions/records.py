"""Map a favorites message and its owner's session to the rows of one transaction (pure).

The ActionEvent takes SessionId and AnonymousId from the owner's session (INV-ACT-003), and
UserId as the session's snapshot at the moment of the action: the session's user only when the
session was linked to that user at or before the action (``linked_at <= OccurredAt``; LinkedAt
is the server clock at linking), else null. A guest like processed late, after the sign-in was
applied (lag, a replay or a backfill), is thus still stored and announced with ``UserId = null``
and reaches the user's history through the linked session (AC6). OccurredAt comes from the
payload, never the server clock (INV-ACT-005). The
action-tracked outbox row gets a new UUIDv7 MessageId that stays stable across re-publication;
its bytes are rendered by :mod:`schemas.action_tracked`, which the publisher also renders a thin
outbox row with (the row the database keeps names the action instead of holding the bytes).

The rows are plain named tuples (immutable, cheap to build: this runs once per recorded message
on the sink's hot path); :class:`ActionRowBuilder` builds a batch's rows with the per-batch work
(CreatedAt, topic) done once.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple
from uuid import UUID

from dataflows.favorite_actions.decode import FavoriteMessage
from schemas.action_tracked import action_tracked_key, action_tracked_value, rendered_created_at
from schemas.favorites import ActionType
from schemas.outbox import OutboxRow, propagated_headers


class SessionSnapshot(NamedTuple):
    """The owner's session as resolved for a batch."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    linked_at: datetime | None
    """When the session got its user (null for a guest session)."""

    def user_at(self, moment: datetime) -> UUID | None:
        """The session's user as of ``moment``: the user once linked at or before it, else None."""
        linked_at = self.linked_at
        if linked_at is None or linked_at > moment:
            return None
        return self.user_id


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

    @property
    def idempotency_key(self) -> str:
        """The message's idempotency mark (``user-activity-favorites:{ActionType}:{MessageId}``)."""
        return self.message.idempotency_key


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
        # CreatedAt rendered once per batch (the thin outbox row keeps ``now`` as created_at).
        self._created_at = rendered_created_at(now)

    def build(
        self, message: FavoriteMessage, session: SessionSnapshot, action_event_id: UUID,
        outbox_message_id: UUID,
    ) -> RecordedAction:
        """The action_events row and the action-tracked outbox row for ``message``."""
        resolved = (session.session_id, session.anonymous_id,
                    session.user_at(message.envelope.payload.occurred_at))
        return self.build_resolved(message, resolved, action_event_id, outbox_message_id,
                                   propagated_headers(message.record, message.trace))

    def build_resolved(
        self, message: FavoriteMessage, resolved: tuple[UUID, UUID, UUID | None],
        action_event_id: UUID, outbox_message_id: UUID, headers: dict[str, str],
    ) -> RecordedAction:
        """The rows for ``message`` in a session already resolved, with the outbox ``headers``.

        ``resolved``: the session's id and AnonymousId, and the row's UserId, already the
        session's user as of the action (``record_actions.sql`` applies the rule of
        :meth:`SessionSnapshot.user_at`).
        """
        session_id, anonymous_id, user_id = resolved
        envelope = message.envelope
        payload = envelope.payload
        action_type = _ACTION_NAMES[message.action_type]
        # The value is kept as a right-sized copy: holding orjson's own output objects by the
        # thousand makes every later dumps take fresh memory (about twice the cost per value,
        # see docs/performance.md).
        value = _copy(action_tracked_value(
            outbox_message_id, self._created_at, action_event_id, envelope.correlation_id,
            action_type, session_id, anonymous_id, user_id, payload.occurred_at,
            payload.property_object_id, payload.favorite_id,
        ))
        event = _new_row(ActionEventRow, (
            action_event_id, action_type, session_id, anonymous_id, user_id,
            payload.occurred_at, payload.property_object_id, payload.favorite_id,
            envelope.message_id,
        ))
        outbox = OutboxRow(
            outbox_message_id, self._topic, action_tracked_key(action_event_id), value, headers,
        )
        return _new_row(RecordedAction, (message, event, outbox))


def build_recorded_action(
    message: FavoriteMessage,
    session: SessionSnapshot,
    *,
    action_event_id: UUID,
    outbox_message_id: UUID,
    topic: str,
    now: datetime,
) -> RecordedAction:
    """The action_events row and the action-tracked outbox row for ``message``."""
    return ActionRowBuilder(topic, now).build(message, session, action_event_id, outbox_message_id)
