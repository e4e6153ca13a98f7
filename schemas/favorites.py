"""favorite-added / favorite-removed (inbound) and action-tracked (outbound) contracts."""

from __future__ import annotations

from enum import StrEnum
from uuid import UUID

from schemas.base import WireModel
from schemas.envelope import Envelope, Moment, Timestamp

ACTION_EVENT_AGGREGATE_TYPE = "ActionEvent"


class ActionType(StrEnum):
    """The action-history row type; decided by the topic the event came from."""

    ADD_TO_FAVORITES = "AddToFavorites"
    REMOVE_FROM_FAVORITES = "RemoveFromFavorites"


class FavoritePayload(WireModel):
    """Payload of favorite-added and favorite-removed (the same shape).

    Exactly one owner id is set (INV-FAV-001), checked by the flow (``invalid-owner``), not
    here. Any other field (e.g. a Note) is dropped on parse, never stored or logged.
    """

    favorite_id: UUID
    property_object_id: UUID
    user_id: UUID | None = None
    anonymous_id: UUID | None = None
    occurred_at: Moment


class FavoriteEnvelope(Envelope[FavoritePayload]):
    """A favorite-added or favorite-removed message value."""


class ActionTrackedPayload(WireModel):
    """Payload of action-tracked: exactly these fields, the session's snapshot at the action."""

    action_type: ActionType
    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    occurred_at: Timestamp
    property_object_id: UUID
    favorite_id: UUID


class ActionTrackedEnvelope(Envelope[ActionTrackedPayload]):
    """An action-tracked message value (AggregateType ``ActionEvent``, Version 1)."""
