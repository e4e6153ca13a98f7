"""Session contracts: user-signed-in (inbound, ASSUMED), session-linked, -started, -ended.

ASSUMPTION: the user-signed-in contract is not among our documents. Its payload is assumed to be
``UserId``, ``AnonymousId`` (the device that signed in) and ``SignedInAt``; this module is the
only place that assumption lives. The session-started / session-ended payloads are likewise not
specified: they are kept minimal (SessionId, AnonymousId, UserId, a timestamp).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated
from uuid import UUID

from pydantic import AfterValidator, AwareDatetime

from schemas.base import WireModel
from schemas.envelope import Envelope

SESSION_AGGREGATE_TYPE = "Session"
USER_AGGREGATE_TYPE = "User"


def _a_moment_in_utc(value: datetime) -> datetime:
    """``value`` when it is a moment of years 1-9999 in UTC; else the contract is broken.

    Offsets can push a valid local time outside that range: ``0001-01-01T00:00:00+03:00`` (what
    a .NET ``default(DateTime)`` becomes as a DateTimeOffset on a Moscow server) is a moment of
    1 BC. PostgreSQL stores it, but Python cannot read it back: applied, it would be the
    device's last SignedInAt, and every later sign-in of the device would fail on reading it
    (dead-lettered, the device never linked again). Refused here, it is one dead letter.
    """
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("not a moment of years 1-9999 in UTC") from None
    return value


SignedInAt = Annotated[AwareDatetime, AfterValidator(_a_moment_in_utc)]
"""A sign-in's ``SignedInAt``: an aware timestamp that is a moment of years 1-9999 in UTC."""


class UserSignedInPayload(WireModel):
    """ASSUMED payload of ``pin.identity.user-signed-in.v1``."""

    user_id: UUID
    anonymous_id: UUID
    signed_in_at: SignedInAt


class UserSignedInEnvelope(Envelope[UserSignedInPayload]):
    """A user-signed-in message value (ASSUMED contract)."""


class SessionLinkedPayload(WireModel):
    """session-linked: a guest session got its user (LinkOnce). Nothing else: no PII."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID
    linked_at: AwareDatetime


class SessionLinkedEnvelope(Envelope[SessionLinkedPayload]):
    """A session-linked message value (key and AggregateId = SessionId)."""


class SessionStartedPayload(WireModel):
    """ASSUMED minimal session-started payload."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    started_at: AwareDatetime


class SessionStartedEnvelope(Envelope[SessionStartedPayload]):
    """A session-started message value (ASSUMED contract)."""


class SessionEndedPayload(WireModel):
    """ASSUMED minimal session-ended payload."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    ended_at: AwareDatetime


class SessionEndedEnvelope(Envelope[SessionEndedPayload]):
    """A session-ended message value (ASSUMED contract)."""
