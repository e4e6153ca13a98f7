"""Rows of a recorded favorite built in Python, for unit tests of the mapping and its rendering.

The store resolves the session and the row's UserId in SQL (``record_actions.sql``); these
helpers apply the same rule to a session given by hand.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple
from uuid import UUID

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.records import ActionRowBuilder, RecordedAction
from schemas.outbox import propagated_headers


class SessionSnapshot(NamedTuple):
    """An owner's session: its id, AnonymousId, user, and when it became the user's."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    linked_at: datetime | None


def row_user(message: FavoriteMessage, session: SessionSnapshot) -> UUID | None:
    """The row's UserId (the rule of ``record_actions.sql``).

    The payload's for a user's own action; for a guest one, the session's user when it was
    linked at or before the action.
    """
    payload = message.envelope.payload
    if payload.anonymous_id is None:
        return payload.user_id
    if session.linked_at is None or session.linked_at > payload.occurred_at:
        return None
    return session.user_id


def build_recorded_action(
    message: FavoriteMessage, session: SessionSnapshot, *, action_event_id: UUID,
    outbox_message_id: UUID, topic: str, now: datetime,
) -> RecordedAction:
    """The action_events row and the action-tracked outbox row for ``message`` in ``session``."""
    return build_with(ActionRowBuilder(topic, now), message, session, action_event_id,
                      outbox_message_id)


def build_with(builder: ActionRowBuilder, message: FavoriteMessage, session: SessionSnapshot,
               action_event_id: UUID, outbox_message_id: UUID) -> RecordedAction:
    """:func:`build_recorded_action` with a batch's builder."""
    resolved = (session.session_id, session.anonymous_id, row_user(message, session))
    return builder.build_resolved(message, resolved, action_event_id, outbox_message_id,
                                  propagated_headers(message.record, message.trace))
