"""Session linking rules (INV-SES-002 LinkOnce) and the events they announce. Pure.

:func:`decide` says what a sign-in does to the device's Active session as it is *now* (the sink
calls it with the row it has locked, so the decision never rests on stale data).
:func:`build_session_event` turns a committed change into the outbox row that announces it.

session-linked is the seed's contract (``000_e9003787fb11a7ec.txt``): payload exactly SessionId,
AnonymousId, UserId, LinkedAt. ASSUMPTION: session-started / session-ended are not in our
documents; their payloads are kept minimal (SessionId, AnonymousId, UserId, StartedAt / EndedAt),
matching :mod:`schemas.sessions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any
from uuid import UUID

import orjson

from dataflows.session_linking.decode import SignInMessage
from schemas.envelope import CONTRACT_VERSION, utc_iso
from schemas.outbox import OutboxRow, propagated_headers
from schemas.sessions import SESSION_AGGREGATE_TYPE


class LinkOutcome(StrEnum):
    """What a sign-in did (the ``outcome`` label of ``user_activity_session_linking_outcomes``)."""

    LINKED = "linked"
    """The device's guest Active session got the user (session-linked)."""
    ALREADY_LINKED = "already-linked"
    """The Active session already belongs to this user: no change, no event."""
    RELINKED = "relinked"
    """The Active session belonged to another user: ended, and a new linked one started."""
    STARTED = "started"
    """The device had no Active session: a new one started, already linked."""
    DUPLICATE = "duplicate"
    """This MessageId was already processed (redelivery, replay): no change, no event."""
    INVALID = "invalid"
    """An empty GUID in MessageId, UserId or AnonymousId: skipped, no change, no DLQ."""


LOG_EVENTS: Mapping[LinkOutcome, str] = {
    LinkOutcome.LINKED: "linked",
    LinkOutcome.ALREADY_LINKED: "already-linked",
    LinkOutcome.RELINKED: "relinked",
    LinkOutcome.STARTED: "started",
    LinkOutcome.DUPLICATE: "skipped-duplicate",
    LinkOutcome.INVALID: "invalid-sign-in",
}
"""The log line (event and ``outcome`` field) of each outcome."""


@dataclass(frozen=True, slots=True)
class ActiveSession:
    """The device's Active session, as read under its row lock."""

    session_id: UUID
    user_id: UUID | None


def decide(active: ActiveSession | None, user_id: UUID) -> LinkOutcome:
    """What a sign-in of ``user_id`` does to the device's Active session ``active``.

    No session -> STARTED; a guest session -> LINKED; the same user -> ALREADY_LINKED; another
    user -> RELINKED (end it, start a new linked one; never a second session-linked).
    """
    if active is None:
        return LinkOutcome.STARTED
    if active.user_id is None:
        return LinkOutcome.LINKED
    if active.user_id == user_id:
        return LinkOutcome.ALREADY_LINKED
    return LinkOutcome.RELINKED


class SessionEventKind(StrEnum):
    """The session events this flow announces."""

    LINKED = "session-linked"
    STARTED = "session-started"
    ENDED = "session-ended"


_TIMESTAMP_FIELD: Mapping[SessionEventKind, str] = {
    SessionEventKind.LINKED: "LinkedAt",
    SessionEventKind.STARTED: "StartedAt",
    SessionEventKind.ENDED: "EndedAt",
}


@dataclass(frozen=True, slots=True)
class SessionTopics:
    """Where each session event goes."""

    linked: str
    started: str
    ended: str

    def of(self, kind: SessionEventKind) -> str:
        """The topic of ``kind``."""
        return {
            SessionEventKind.LINKED: self.linked,
            SessionEventKind.STARTED: self.started,
            SessionEventKind.ENDED: self.ended,
        }[kind]


@dataclass(frozen=True, slots=True)
class SessionChange:
    """A committed change of one session: what happened, to whom, at what server time."""

    kind: SessionEventKind
    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    """The session's user (for ENDED, the user the ended session belonged to)."""
    at: datetime


@dataclass(frozen=True, slots=True)
class LinkResult:
    """What one sign-in did, and the outbox rows written for it in the same transaction."""

    message: SignInMessage
    outcome: LinkOutcome
    session_id: UUID | None = None
    """The device's Active session after the sign-in (None for a duplicate)."""
    ended_session_id: UUID | None = None
    """The session ended by a RELINKED sign-in."""
    outbox: tuple[OutboxRow, ...] = field(default_factory=tuple)


def session_payload(change: SessionChange) -> dict[str, Any]:
    """The event payload of ``change``: SessionId, AnonymousId, UserId and one timestamp."""
    return {
        "SessionId": str(change.session_id),
        "AnonymousId": str(change.anonymous_id),
        "UserId": None if change.user_id is None else str(change.user_id),
        _TIMESTAMP_FIELD[change.kind]: utc_iso(change.at.astimezone(UTC)),
    }


def build_session_event(
    change: SessionChange,
    message: SignInMessage,
    *,
    message_id: UUID,
    topics: SessionTopics,
    now: datetime,
) -> OutboxRow:
    """The outbox row announcing ``change``, caused by the sign-in ``message``.

    Envelope: the new ``message_id`` (UUIDv7, stable across re-publication since it is the outbox
    row's id), CreatedAt ``now``, Version 1, AggregateId = SessionId, AggregateType ``Session``,
    the sign-in's CorrelationId. Kafka key = SessionId; ``traceparent`` passed through.
    """
    value = orjson.dumps(
        {
            "MessageId": str(message_id),
            "CreatedAt": utc_iso(now),
            "Version": CONTRACT_VERSION,
            "AggregateId": str(change.session_id),
            "AggregateType": SESSION_AGGREGATE_TYPE,
            "CorrelationId": message.envelope.correlation_id,
            "Payload": session_payload(change),
        }
    )
    return OutboxRow(
        id=message_id,
        topic=topics.of(change.kind),
        key=str(change.session_id).encode(),
        value=value,
        headers=propagated_headers(message.record),
    )
