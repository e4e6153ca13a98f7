"""Session contracts: user-signed-in (inbound, ASSUMED), session-linked, -started, -ended.

ASSUMPTION: the user-signed-in contract is not among our documents. Its payload is assumed to be
``UserId``, ``AnonymousId`` (the device that signed in) and ``SignedInAt``; this module is the
only place that assumption lives. The session-started / session-ended payloads are likewise not
specified: they are kept minimal (SessionId, AnonymousId, UserId, a timestamp).
"""

from __future__ import annotations

from uuid import UUID

from schemas.base import WireModel
from schemas.envelope import Envelope, Moment, Timestamp

SESSION_AGGREGATE_TYPE = "Session"
USER_AGGREGATE_TYPE = "User"


class UserSignedInPayload(WireModel):
    """ASSUMED payload of ``pin.identity.user-signed-in.v1``."""

    user_id: UUID
    anonymous_id: UUID
    signed_in_at: Moment
    """Stored as the device's last sign-in, which the job reads back: refused when it is no
    moment Python can hold (a valid local time pushed past year 1 or 9999 by its offset)."""


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
