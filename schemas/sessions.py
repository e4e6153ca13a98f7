"""Session contracts: user-signed-in (inbound, ASSUMED), session-linked, -started, -ended.

ASSUMPTION (this module is its only place): user-signed-in carries ``UserId``, ``AnonymousId``
(the device) and ``SignedInAt``; session-started/-ended are kept minimal.
"""

from __future__ import annotations

from uuid import UUID

from schemas.base import WireModel
from schemas.envelope import Envelope, Moment, Timestamp

SESSION_AGGREGATE_TYPE = "Session"


class UserSignedInPayload(WireModel):
    """ASSUMED payload of ``pin.identity.user-signed-in.v1``."""

    user_id: UUID
    anonymous_id: UUID
    signed_in_at: Moment
    """Stored and read back, so a :data:`~schemas.envelope.Moment`."""


class UserSignedInEnvelope(Envelope[UserSignedInPayload]):
    """A user-signed-in message value (ASSUMED contract)."""


class SessionLinkedPayload(WireModel):
    """session-linked: a guest session got its user (LinkOnce). Nothing else: no PII."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID
    linked_at: Timestamp


class SessionLinkedEnvelope(Envelope[SessionLinkedPayload]):
    """A session-linked message value (key and AggregateId = SessionId)."""


class SessionStartedPayload(WireModel):
    """ASSUMED minimal session-started payload."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    started_at: Timestamp


class SessionStartedEnvelope(Envelope[SessionStartedPayload]):
    """A session-started message value (ASSUMED contract)."""


class SessionEndedPayload(WireModel):
    """ASSUMED minimal session-ended payload."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    ended_at: Timestamp


class SessionEndedEnvelope(Envelope[SessionEndedPayload]):
    """A session-ended message value (ASSUMED contract)."""
