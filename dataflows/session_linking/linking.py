"""Session linking rules (INV-SES-002 LinkOnce) and the events they announce. Pure.

:func:`decide` says what a sign-in does to the device's Active session (as locked by the sink);
:func:`build_session_event` turns a committed change into its outbox row. session-linked's
payload is the seed's contract (SessionId, AnonymousId, UserId, LinkedAt); session-started /
-ended are ASSUMED, as minimal (:mod:`schemas.sessions`).
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
    """Late, and applying it would re-link the device's session: recorded in
    ``sign_in_conflicts`` instead."""
    SUPERSEDED = "superseded"
    """Stale, and a sign-in of its user at or after it was applied on the device: no change."""


LOG_EVENTS: Mapping[LinkOutcome, str] = {
    **{outcome: outcome.value for outcome in LinkOutcome},
    LinkOutcome.DUPLICATE: "skipped-duplicate", LinkOutcome.INVALID: "invalid-sign-in",
    LinkOutcome.SUPERSEDED: "skipped-superseded"}
"""The log event (and ``outcome`` field) of each outcome."""


@dataclass(frozen=True, slots=True)
class ActiveSession:
    """The device's Active session, as read under its row lock."""

    session_id: UUID
    user_id: UUID | None
    started_at: datetime | None = None


def decide(active: ActiveSession | None, user_id: UUID) -> LinkOutcome:
    """What a sign-in of ``user_id`` does to the device's Active session ``active``."""
    if active is None:
        return LinkOutcome.STARTED
    if active.user_id is None:
        return LinkOutcome.LINKED
    return LinkOutcome.ALREADY_LINKED if active.user_id == user_id else LinkOutcome.RELINKED


class ConflictReason(StrEnum):
    """Why a late sign-in was not applied (``sign_in_conflicts.reason``)."""

    WOULD_RELINK = "would-relink"
    """It would end the Active session of another user."""
    PREDATES_SESSION = "predates-session"
    """It would link a guest session that started after it."""
    WOULD_START = "would-start"
    """It would start a session after another user's later sign-in on the device."""


@dataclass(frozen=True, slots=True)
class LastSignIn:
    """The device's last applied sign-in, as a sign-in being decided sees it."""

    signed_in_at: datetime
    user_id: UUID | None
    covers: bool = False
    """A sign-in of the deciding sign-in's user at or after it was applied on the device."""


def late_verdict(outcome: LinkOutcome, user_id: UUID, signed_in_at: datetime,
                 last: LastSignIn | None, active_started_at: datetime | None, *,
                 stale: bool = True) -> LinkOutcome | ConflictReason | None:
    """What a sign-in of ``user_id`` does instead of ``outcome`` (:func:`decide`); None: apply it.

    ``last`` is the device's last applied sign-in; ``stale``: older than clock skew plus
    lateness explain. A stale sign-in that ``last.covers`` is SUPERSEDED (a replay after its
    mark expired). A sign-in before ``last`` (not at its instant) is a :class:`ConflictReason`
    when applying it would re-link, link a later guest session, or start a session after
    another user's sign-in; otherwise it is applied. ALREADY_LINKED is always applied.
    """
    if last is None or outcome is LinkOutcome.ALREADY_LINKED:
        return None
    if last.covers and stale:
        return LinkOutcome.SUPERSEDED
    if signed_in_at >= last.signed_in_at:
        return None
    if outcome is LinkOutcome.RELINKED:
        return ConflictReason.WOULD_RELINK
    if (outcome is LinkOutcome.LINKED and active_started_at is not None
            and active_started_at > signed_in_at):
        return ConflictReason.PREDATES_SESSION
    if outcome is LinkOutcome.STARTED and user_id != last.user_id:
        return ConflictReason.WOULD_START
    return None


class SessionEventKind(StrEnum):
    """The session events this flow announces."""

    LINKED = "session-linked"
    STARTED = "session-started"
    ENDED = "session-ended"


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
    user_id: UUID | None  # for ENDED, the ended session's user
    at: datetime


@dataclass(frozen=True, slots=True)
class LinkResult:
    """What one sign-in did, and the outbox rows written for it in the same transaction."""

    message: SignInMessage
    outcome: LinkOutcome
    session_id: UUID | None = None  # the device's Active session after it (None: duplicate)
    ended_session_id: UUID | None = None  # ended by a RELINKED sign-in
    outbox: tuple[OutboxRow, ...] = field(default_factory=tuple)
    conflict: ConflictReason | None = None  # why a LATE_CONFLICT sign-in was not applied


def session_payload(change: SessionChange) -> dict[str, Any]:
    """The event payload of ``change``: SessionId, AnonymousId, UserId and one timestamp."""
    return {"SessionId": str(change.session_id), "AnonymousId": str(change.anonymous_id),
            "UserId": None if change.user_id is None else str(change.user_id),
            f"{change.kind.name.title()}At": utc_iso(change.at.astimezone(UTC))}  # LinkedAt...


def build_session_event(change: SessionChange, message: SignInMessage, *, message_id: UUID,
                        topics: SessionTopics, now: datetime) -> OutboxRow:
    """The outbox row announcing ``change`` (caused by ``message``), keyed by SessionId.

    ``message_id`` is the outbox row's id, so stable across re-publication; the sign-in's
    CorrelationId and ``traceparent`` are passed on.
    """
    value = orjson.dumps({
        "MessageId": str(message_id), "CreatedAt": utc_iso(now), "Version": CONTRACT_VERSION,
        "AggregateId": str(change.session_id), "AggregateType": SESSION_AGGREGATE_TYPE,
        "CorrelationId": message.envelope.correlation_id, "Payload": session_payload(change),
    })
    return OutboxRow(id=message_id, topic=topics.of(change.kind),
                     key=str(change.session_id).encode(), value=value,
                     headers=propagated_headers(message.record, message.trace))
