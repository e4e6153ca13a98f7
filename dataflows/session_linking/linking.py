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
    SUPERSEDED = "superseded"
    """An old sign-in whose user has a sign-in at or after it applied on the device: that one
    stands for it (a replay after this sign-in's mark expired, or an old sign-in a later one of
    the same user covers). No change, no event."""


LOG_EVENTS: Mapping[LinkOutcome, str] = {
    LinkOutcome.LINKED: "linked",
    LinkOutcome.ALREADY_LINKED: "already-linked",
    LinkOutcome.RELINKED: "relinked",
    LinkOutcome.STARTED: "started",
    LinkOutcome.DUPLICATE: "skipped-duplicate",
    LinkOutcome.INVALID: "invalid-sign-in",
    LinkOutcome.LATE_CONFLICT: "late-conflict",
    LinkOutcome.SUPERSEDED: "skipped-superseded",
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
    WOULD_START = "would-start"
    """The device has no Active session, and its last applied sign-in, later than this one, was
    another user's: starting a session would make the late user the device's current one after
    someone else signed in on it."""


@dataclass(frozen=True, slots=True)
class LastSignIn:
    """The device's last applied sign-in, as a sign-in being decided sees it."""

    signed_in_at: datetime
    user_id: UUID | None
    covers: bool = False
    """A session of the device holds a sign-in of the deciding sign-in's user at or after it:
    that sign-in (a replay of it) or a later one of the same user was already applied."""


def late_verdict(
    outcome: LinkOutcome, user_id: UUID, signed_in_at: datetime, last: LastSignIn | None,
    active_started_at: datetime | None, *, stale: bool = True,
) -> LinkOutcome | ConflictReason | None:
    """What a sign-in of ``user_id`` does instead of ``outcome`` (:func:`decide`), or None.

    None: apply ``outcome``. ``last`` is the device's last applied sign-in; ``stale``: the
    sign-in is older than any clock skew and lateness explain (``USER_ACTIVITY_SESSION_LINKING_*``),
    so it is not a live one.

    - The same user again on the Active session (``ALREADY_LINKED``): applied, it changes
      nothing.
    - :attr:`LinkOutcome.SUPERSEDED` (no change): a stale sign-in whose user has a sign-in at or
      after it applied on the device (``last.covers``). That is a replay of an applied one
      whose idempotency mark has expired (marks go with their daily partition), or an old one a
      later sign-in of the same user stands for; either would otherwise start a session again
      on a device whose session ended meanwhile. A live one (a producer clock a few seconds
      off, a sign-in again after a sign-out) is decided by the rules below.
    - A sign-in before the device's last applied one (late: it arrived after the reorder
      buffer let a later one through) is a conflict when applying it would end another user's
      session (``WOULD_RELINK``), link a guest session that started after it
      (``PREDATES_SESSION``), or start a session on a device whose last applied sign-in was
      another user's (``WOULD_START``); otherwise it is applied. A sign-in at the instant of
      the last applied one is not late: the two are in no defined order.
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
