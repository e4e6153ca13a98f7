"""The session-linking write path and its Bytewax sink: user-signed-in -> sessions + outbox.

Guarantees (SPEC §5, §7):
- One transaction per batch: the idempotency marks, every session change and the outbox rows
  announcing them commit together or not at all; the committed rows are then offered to the
  outbox publisher.
  ``write_batch`` returns only after that commit (and after its poison, if any, was acknowledged
  by the DLQ topic), so input offsets advance only after the commit.
- Race-free (INV-SES-002 LinkOnce): the device's Active session is row-locked before deciding,
  every UPDATE is conditional on the state it was decided on, and a new session is inserted with
  ``ON CONFLICT DO NOTHING`` on the one-Active-session-per-device index; a lost race re-reads
  and decides again. A second session-linked for a session is impossible: only a guest
  (``user_id IS NULL``) session can be linked, and linking sets ``user_id``.
- Idempotent: the mark ``user-activity-signed-in:{MessageId}`` is inserted first in the same
  transaction; an already marked sign-in (redelivery, replay of an old sign-in) changes nothing,
  so replaying an old sign-in can never end a newer session. Once its mark has expired (the
  retention drops marks by day), a replayed sign-in is found applied on its device's sessions
  (its user, at or after its SignedInAt): ``superseded``, no change; or it is a late conflict
  (:func:`~dataflows.session_linking.linking.late_verdict`).
- PostgreSQL unreachable, timeouts, serialization failures, deadlocks: retried forever with
  back-off; the worker blocks (back-pressure), nothing is skipped, nothing goes to the DLQ.
- A data error or an unexpected exception: the batch is bisected; a sign-in failing alone
  ``poison_attempts`` times is dead-lettered and its batch-mates are linked normally.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from uuid import UUID

import orjson
import psycopg
import uuid_utils.compat as uuid_compat
from typing_extensions import override

from dataflows.session_linking.decode import SignInMessage, sign_in_fields
from dataflows.session_linking.linking import (
    LOG_EVENTS,
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
from dataflows.session_linking.traces import trace_batch
from runtime.logs import log_event
from runtime.metrics import (
    SESSION_LINKING_DLQ,
    SESSION_LINKING_DURATION_MS,
    SESSION_LINKING_OUTCOMES,
    SESSION_LINKING_RETRIES,
)
from runtime.settings import Settings
from schemas.outbox import OutboxRow
from sinks.db import Connection
from sinks.transactional import PartitionedSink, TransactionalPartition
from sources.progress import INPUT_PROGRESS

logger = logging.getLogger(__name__)


DECISION_ROUNDS = 5
"""How often one sign-in re-reads the device's session after losing a race to another writer,
before the batch's transaction is abandoned as a serialization failure (and retried)."""


class SessionLinksStore:
    """Applies sign-ins to ``user_activity.sessions`` in one transaction per batch."""

    def __init__(self, topics: SessionTopics, new_id: Callable[[], UUID] = uuid_compat.uuid7,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC),
                 live_within: timedelta = timedelta(seconds=70)) -> None:
        """A store announcing changes on ``topics``.

        ``live_within``: how old a sign-in can be and still be live (clock skew + lateness);
        an older one is *stale* (:func:`~dataflows.session_linking.linking.late_verdict`).
        """
        self._topics = topics
        self._new_id = new_id
        self._clock = clock
        self._live_within = live_within

    def link_batch(self, conn: Connection, messages: Sequence[SignInMessage]) -> list[LinkResult]:
        """Apply ``messages`` in order in one transaction; return what each one did.

        On any exception the transaction is rolled back and nothing of the batch is written.
        """
        results: list[LinkResult] = []
        with conn.transaction():
            now = self._clock()
            for message in messages:
                results.append(self._link_one(conn, message, now))
            outbox = [row for result in results for row in result.outbox]
            if outbox:
                _insert_outbox(conn, outbox)
        return results

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
        active = None if locked is None else ActiveSession(
            cast(UUID, locked[0]), cast("UUID | None", locked[1]), cast(datetime, locked[2]))
        signed_in_at = message.signed_in_at
        last_row = conn.execute(query("link_session_device_last"), {
            **device, "user_id": message.user_id, "signed_in_at": signed_in_at}).fetchone()
        last = None if last_row is None else LastSignIn(
            cast(datetime, last_row[0]), cast("UUID | None", last_row[1]), bool(last_row[2]))
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
                "device_last_signed_in_at": last.signed_in_at, "reason": verdict.value,
            })
            return LinkResult(message, LinkOutcome.LATE_CONFLICT,
                              None if active is None else active.session_id, conflict=verdict)
        if outcome is LinkOutcome.ALREADY_LINKED:
            assert active is not None
            conn.execute(query("link_session_confirm"),
                         {"session_id": active.session_id, "signed_in_at": signed_in_at})
            return LinkResult(message, outcome, active.session_id)
        if outcome is LinkOutcome.LINKED:
            assert active is not None
            linked_at = _returned(conn, "link_session_link_guest", {
                "session_id": active.session_id, "user_id": message.user_id,
                "signed_in_at": signed_in_at})
            if linked_at is None:
                return None
            change = self._change(SessionEventKind.LINKED, active.session_id, message, linked_at)
            return LinkResult(message, outcome, active.session_id,
                              outbox=(self._event(change, message, now),))
        changes: list[SessionChange] = []
        ended_id = None
        if outcome is LinkOutcome.RELINKED:
            assert active is not None
            ended_at = _returned(conn, "link_session_end", {
                "session_id": active.session_id, "user_id": active.user_id,
                "signed_in_at": signed_in_at})
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
        changes.append(self._change(SessionEventKind.STARTED, session_id, message, started_at))
        return LinkResult(message, outcome, session_id, ended_id,
                          tuple(self._event(change, message, now) for change in changes))

    @staticmethod
    def _change(kind: SessionEventKind, session_id: UUID, message: SignInMessage, at: datetime
                ) -> SessionChange:
        return SessionChange(kind, session_id, message.anonymous_id, message.user_id, at)

    def _event(self, change: SessionChange, message: SignInMessage, now: datetime) -> OutboxRow:
        return build_session_event(change, message, message_id=self._new_id(),
                                   topics=self._topics, now=now)


def _returned(conn: Connection, name: str, params: dict[str, Any]) -> datetime | None:
    """Run the named statement; the timestamp it returned, or None if it changed no row."""
    row = conn.execute(query(name), params).fetchone()
    return None if row is None else cast(datetime, row[0])


def _insert_outbox(conn: Connection, rows: Sequence[OutboxRow]) -> None:
    conn.execute(query("link_session_outbox"), {
        "ids": [r.id for r in rows], "topics": [r.topic for r in rows],
        "keys": [r.key for r in rows], "values": [r.value for r in rows],
        "headers": [orjson.dumps(r.headers).decode() for r in rows]})


class SessionLinkSink(PartitionedSink[SignInMessage]):
    """Links ``(device shard, SignInMessage)`` items: one device's sign-ins go to one partition.

    Shard ``i`` goes to partition ``i`` modulo the count. A key that is no shard (a device's
    AnonymousId: pending sign-ins restored from a recovery store of the step keyed by device)
    is hashed, as before.
    """

    @override
    def part_fn(self, item_key: str) -> int:
        return int(item_key) if item_key.isdigit() else zlib.adler32(item_key.encode())

    @override
    def build_partition(self, part: str) -> _SessionLinkPartition:
        return _SessionLinkPartition(self._settings, part)


class _SessionLinkPartition(TransactionalPartition[SignInMessage, list[LinkResult]]):
    def __init__(self, settings: Settings, part: str) -> None:
        super().__init__(settings, name=f"user-activity-session-linking-{part}",
                         dlq_topic=settings.topic_session_linking_dlq,
                         dlq_counter=SESSION_LINKING_DLQ, retries_counter=SESSION_LINKING_RETRIES,
                         logger=logger, flow="session-linking", lag=INPUT_PROGRESS)
        self._store = SessionLinksStore(SessionTopics(
            linked=settings.topic_session_linked, started=settings.topic_session_started,
            ended=settings.topic_session_ended), live_within=timedelta(
                seconds=settings.session_linking_max_clock_skew_seconds
                + settings.session_linking_lateness_seconds))
        self._written: dict[int, tuple[int, int]] = {}
        """Start and commit time (wall ns) of each result not yet reported, for its spans."""

    def write(self, conn: Connection, batch: Sequence[SignInMessage]) -> list[LinkResult]:
        """One transaction: marks, session changes, outbox rows (:class:`SessionLinksStore`)."""
        started_ns = time.time_ns()
        results = self._store.link_batch(conn, batch)
        self._written[id(results)] = (started_ns, time.time_ns())
        return results

    def fields(self, message: SignInMessage) -> dict[str, Any]:
        """Ids of the sign-in and where it came from."""
        return sign_in_fields(message.record, message.envelope)

    def outbox_rows(self, result: list[LinkResult]) -> list[OutboxRow]:
        """The session events of the batch."""
        return [row for link in result for row in link.outbox]

    def report(self, results: list[LinkResult]) -> None:
        """Metrics, one log line per sign-in and the spans of the sampled ones."""
        started_ns, ended_ns = self._written.pop(id(results), (0, 0))
        trace_batch(results, started_ns or None, ended_ns or None)
        now_mono = time.monotonic()
        for result in results:
            message = result.message
            SESSION_LINKING_OUTCOMES.labels(outcome=result.outcome.value).inc()
            SESSION_LINKING_DURATION_MS.observe((now_mono - message.record.received_at) * 1000)
            event = LOG_EVENTS[result.outcome]
            late = result.outcome is LinkOutcome.LATE_CONFLICT
            ended = result.ended_session_id
            log_event(logger, event, logging.WARNING if late else logging.INFO, outcome=event,
                      SessionId=None if result.session_id is None else str(result.session_id),
                      EndedSessionId=None if ended is None else str(ended),
                      reason=None if result.conflict is None else result.conflict.value,
                      SignedInAt=message.signed_in_at.isoformat()
                      if late or result.outcome is LinkOutcome.SUPERSEDED else None,
                      **sign_in_fields(message.record, message.envelope))
