"""The session-linking write path: a batch of sign-ins in one transaction (SPEC §7).

Per sign-in: its idempotency mark (already there: ``duplicate``), the device's Active session
read under a row lock, the decision (:mod:`.linking`); every write is conditional on the state
it was decided on, so a lost race re-reads and decides again (LinkOnce holds whatever runs
concurrently). Marks, session changes and outbox rows commit together or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from uuid import UUID

import orjson
import psycopg
import uuid_utils.compat as uuid_compat

from dataflows.session_linking.decode import SignInMessage
from dataflows.session_linking.linking import (
    ActiveSession,
    ConflictReason,
    LastSignIn,
    LinkOutcome,
    LinkResult,
    SessionChange,
    SessionEventKind,
    SessionTopics,
    build_session_event,
    decide,
    late_verdict,
)
from dataflows.session_linking.sql import query
from schemas.outbox import OutboxRow
from sinks.db import Connection

DECISION_ROUNDS = 5  # races lost by one sign-in before its batch fails as a serialization failure


@dataclass(frozen=True, slots=True)
class LinkedBatch:
    """What one committed batch did, and its transaction (the txid of its outbox rows)."""

    results: list[LinkResult]
    txid: int


class SessionLinksStore:
    """Applies sign-ins to ``user_activity.sessions`` in one transaction per batch."""

    def __init__(self, topics: SessionTopics, new_id: Callable[[], UUID] = uuid_compat.uuid7,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 live_within: timedelta = timedelta(seconds=70), *, lifecycle: bool = True) -> None:
        """``live_within``: skew + lateness; ``lifecycle`` False: no session-started/-ended."""
        self._topics = topics
        self._lifecycle = lifecycle
        self._new_id = new_id
        self._clock = clock
        self._live_within = live_within

    def link_batch(self, conn: Connection, messages: Sequence[SignInMessage]) -> LinkedBatch:
        """Apply ``messages`` in order in one transaction (nothing written on an exception)."""
        txid = 0
        with conn.transaction():
            now = self._clock()
            results = [self._link_one(conn, message, now) for message in messages]
            if rows := [row for result in results for row in result.outbox]:
                txid = conn.execute(query("link_session_outbox"), {
                    "ids": [r.id for r in rows], "topics": [r.topic for r in rows],
                    "keys": [r.key for r in rows], "values": [r.value for r in rows],
                    "headers": [orjson.dumps(r.headers).decode() for r in rows]}).fetchall()[0][0]
        return LinkedBatch(results, txid)

    def _link_one(self, conn: Connection, message: SignInMessage, now: datetime) -> LinkResult:
        marked = conn.execute(query("link_session_mark"), {"key": message.idempotency_key})
        if marked.fetchone() is None:
            return LinkResult(message, LinkOutcome.DUPLICATE)
        for _ in range(DECISION_ROUNDS):
            result = self._apply(conn, message, now)
            if result is not None:
                return result
        raise psycopg.errors.SerializationFailure(
            "the device's Active session kept changing while linking")

    def _apply(self, conn: Connection, message: SignInMessage, now: datetime) -> LinkResult | None:
        """One decision on the locked Active session; None when a concurrent writer won."""
        device = {"anonymous_id": message.anonymous_id}
        locked = conn.execute(query("link_session_lock_active"), device).fetchone()
        active = None if locked is None else ActiveSession(*locked)
        signed_in_at = message.signed_in_at
        last_row = conn.execute(query("link_session_device_last"), {
            **device, "user_id": message.user_id, "signed_in_at": signed_in_at}).fetchone()
        last = None if last_row is None else LastSignIn(last_row[0], last_row[1], bool(last_row[2]))
        outcome = decide(active, message.user_id)
        verdict = late_verdict(outcome, message.user_id, signed_in_at, last,
                               None if active is None else active.started_at,
                               stale=signed_in_at < now - self._live_within)
        if verdict is LinkOutcome.SUPERSEDED:
            return LinkResult(message, verdict, None if active is None else active.session_id)
        if isinstance(verdict, ConflictReason):
            assert last is not None
            conn.execute(query("link_session_conflict"), {
                "message_id": message.message_id, "anonymous_id": message.anonymous_id,
                "session_id": None if active is None else active.session_id,
                "session_user_id": None if active is None else active.user_id,
                "sign_in_user_id": message.user_id, "signed_in_at": message.signed_in_at,
                "device_last_signed_in_at": last.signed_in_at, "reason": verdict.value})
            return LinkResult(message, LinkOutcome.LATE_CONFLICT,
                              None if active is None else active.session_id, conflict=verdict)
        if outcome is LinkOutcome.ALREADY_LINKED:
            assert active is not None
            conn.execute(query("link_session_confirm"),
                         {"session_id": active.session_id, "signed_in_at": signed_in_at})
            return LinkResult(message, outcome, active.session_id)
        if outcome is LinkOutcome.LINKED:
            assert active is not None
            linked_at = _returned(conn, "link_session_link_guest", {"session_id": active.session_id,
                                  "user_id": message.user_id, "signed_in_at": signed_in_at})
            if linked_at is None:
                return None
            change = SessionChange(SessionEventKind.LINKED, active.session_id,
                                   message.anonymous_id, message.user_id, linked_at)
            return LinkResult(message, outcome, active.session_id,
                              outbox=(self._event(change, message, now),))
        changes: list[SessionChange] = []
        ended_id = None
        if outcome is LinkOutcome.RELINKED:
            assert active is not None
            ended_at = _returned(conn, "link_session_end", {"session_id": active.session_id,
                                 "user_id": active.user_id, "signed_in_at": signed_in_at})
            if ended_at is None:
                return None
            ended_id = active.session_id
            changes.append(SessionChange(
                SessionEventKind.ENDED, ended_id, message.anonymous_id, active.user_id, ended_at))
        session_id = self._new_id()
        started_at = _returned(conn, "link_session_start", {
            "session_id": session_id, "anonymous_id": message.anonymous_id,
            "user_id": message.user_id, "signed_in_at": signed_in_at})
        if started_at is None:
            if ended_id is not None:  # cannot happen: we hold the only Active row's lock
                raise psycopg.errors.SerializationFailure("an Active session appeared")
            return None
        changes.append(SessionChange(SessionEventKind.STARTED, session_id, message.anonymous_id,
                                     message.user_id, started_at))
        return LinkResult(message, outcome, session_id, ended_id,
                          tuple(self._event(change, message, now) for change in changes
                                if self._lifecycle))

    def _event(self, change: SessionChange, message: SignInMessage, now: datetime) -> OutboxRow:
        return build_session_event(change, message, message_id=self._new_id(),
                                   topics=self._topics, now=now)


def _returned(conn: Connection, name: str, params: dict[str, Any]) -> datetime | None:
    """The timestamp the named statement returned, or None if it changed no row."""
    row = conn.execute(query(name), params).fetchone()
    return None if row is None else cast(datetime, row[0])


