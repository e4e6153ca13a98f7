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
    LATE_CONFLICT = "late-conflict"
    """Later than the allowed lateness, and applying it would change who owns the device's
    session (LinkOnce forbids re-linking): not applied, recorded in ``sign_in_conflicts``."""


LOG_EVENTS: Mapping[LinkOutcome, str] = {
    LinkOutcome.LINKED: "linked",
    LinkOutcome.ALREADY_LINKED: "already-linked",
    LinkOutcome.RELINKED: "relinked",
    LinkOutcome.STARTED: "started",
    LinkOutcome.DUPLICATE: "skipped-duplicate",
    LinkOutcome.INVALID: "invalid-sign-in",
    LinkOutcome.LATE_CONFLICT: "late-conflict",
}
"""The log line (event and ``outcome`` field) of each outcome."""


@dataclass(frozen=True, slots=True)
class ActiveSession:
    """The device's Active session, as read under its row lock."""

    session_id: UUID
    user_id: UUID | None
    started_at: datetime | None = None


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


class ConflictReason(StrEnum):
    """Why a late sign-in was not applied (``sign_in_conflicts.reason``)."""

    WOULD_RELINK = "would-relink"
    """The device's Active session belongs to another user: applying it would end that session
    and start one for the late user, though a later sign-in was already applied."""
    PREDATES_SESSION = "predates-session"
    """The device's Active session is a guest session that started after the sign-in: linking
    it would give the late user activity that happened after a later sign-in."""


def late_conflict(
    outcome: LinkOutcome, signed_in_at: datetime, device_last_signed_in_at: datetime | None,
    active_started_at: datetime | None,
) -> ConflictReason | None:
    """Why a sign-in cannot be applied although :func:`decide` says ``outcome``, or None.

    Only a late sign-in (``signed_in_at`` before the SignedInAt of the device's last applied
    sign-in: it arrived after the reorder buffer had let a later one through) can conflict, and
    only when applying it would change who owns a session: ending another user's session and
    starting one for this user (``RELINKED``), or linking a guest session that did not exist yet
    when this user signed in (``LINKED`` of a session started after ``signed_in_at``). A late
    sign-in that conflicts with nothing (the same user again, or a device without an Active
    session) is applied by the normal rules.
    """
    if device_last_signed_in_at is None or signed_in_at >= device_last_signed_in_at:
        return None
    if outcome is LinkOutcome.RELINKED:
        return ConflictReason.WOULD_RELINK
    if (outcome is LinkOutcome.LINKED and active_started_at is not None
            and active_started_at > signed_in_at):
        return ConflictReason.PREDATES_SESSION
    return None


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
        """The topic of ``kind`` (the field named like the kind)."""
        return str(getattr(self, kind.name.lower()))


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
    conflict: ConflictReason | None = None
    """Why a LATE_CONFLICT sign-in was not applied."""


def session_payload(change: SessionChange) -> dict[str, Any]:
    """The event payload of ``change``: SessionId, AnonymousId, UserId and one timestamp."""
    return {
        "SessionId": str(change.session_id),
        "AnonymousId": str(change.anonymous_id),
        "UserId": None if change.user_id is None else str(change.user_id),
        _TIMESTAMP_FIELD[change.kind]: utc_iso(change.at.astimezone(UTC)),
    }


def build_session_event(
    change: SessionChange, message: SignInMessage, *, message_id: UUID, topics: SessionTopics,
    now: datetime,
) -> OutboxRow:
    """The outbox row announcing ``change``, caused by the sign-in ``message``.

    Envelope: the new ``message_id`` (UUIDv7, stable across re-publication since it is the outbox
    row's id), CreatedAt ``now``, Version 1, AggregateId = SessionId, AggregateType ``Session``,
    the sign-in's CorrelationId. Kafka key = SessionId; ``traceparent`` passed through.
    """
    value = orjson.dumps({
        "MessageId": str(message_id), "CreatedAt": utc_iso(now), "Version": CONTRACT_VERSION,
        "AggregateId": str(change.session_id), "AggregateType": SESSION_AGGREGATE_TYPE,
        "CorrelationId": message.envelope.correlation_id, "Payload": session_payload(change),
    })
    return OutboxRow(id=message_id, topic=topics.of(change.kind),
                     key=str(change.session_id).encode(), value=value,
                     headers=propagated_headers(message.record, message.trace))
