"""Map a favorites message and its owner's session to the rows of one transaction (pure).

The ActionEvent takes SessionId, AnonymousId and UserId from the session as it is now
(INV-ACT-003) and OccurredAt from the payload, never the server clock (INV-ACT-005). The
action-tracked outbox row gets a new UUIDv7 MessageId that stays stable across re-publication.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import orjson

from dataflows.favorite_actions.decode import FavoriteMessage
from schemas.envelope import CONTRACT_VERSION
from schemas.favorites import ACTION_EVENT_AGGREGATE_TYPE
from schemas.outbox import OutboxRow, propagated_headers


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """The owner's session as resolved for a batch."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None


@dataclass(frozen=True, slots=True)
class ActionEventRow:
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


@dataclass(frozen=True, slots=True)
class RecordedAction:
    """The rows one message produces, committed together or not at all."""

    message: FavoriteMessage
    idempotency_key: str
    event: ActionEventRow
    outbox: OutboxRow


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
    envelope = message.envelope
    payload = envelope.payload
    event = ActionEventRow(
        id=action_event_id,
        action_type=message.action_type.value,
        session_id=session.session_id,
        anonymous_id=session.anonymous_id,
        user_id=session.user_id,
        occurred_at=payload.occurred_at,
        property_object_id=payload.property_object_id,
        favorite_id=payload.favorite_id,
        source_message_id=envelope.message_id,
    )
    # orjson renders UUIDs and aware datetimes (offset kept, RFC 3339) natively: no str() or
    # isoformat() per field on the hot path.
    value = orjson.dumps(
        {
            "MessageId": outbox_message_id,
            "CreatedAt": now,
            "Version": CONTRACT_VERSION,
            "AggregateId": action_event_id,
            "AggregateType": ACTION_EVENT_AGGREGATE_TYPE,
            "CorrelationId": envelope.correlation_id,
            "Payload": {
                "ActionType": event.action_type,
                "SessionId": event.session_id,
                "AnonymousId": event.anonymous_id,
                "UserId": event.user_id,
                "OccurredAt": event.occurred_at,
                "PropertyObjectId": event.property_object_id,
                "FavoriteId": event.favorite_id,
            },
        }
    )
    outbox = OutboxRow(
        id=outbox_message_id,
        topic=topic,
        key=str(action_event_id).encode(),
        value=value,
        headers=propagated_headers(message.record),
    )
    return RecordedAction(message, message.idempotency_key, event, outbox)
