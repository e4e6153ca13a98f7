"""The favorites write path: one statement, so one transaction, per batch (SPEC §4 steps 4-5).

``record_actions`` resolves every owner's session and inserts the idempotency marks, the
action_events rows and the action-tracked outbox rows; its answer names each message's session.
Idempotent: a message already recorded (mark or source_message_id present) changes nothing.
A batch is first sent without the ``ON CONFLICT`` clauses; a conflict wrote nothing, and the
batch goes again with them (:class:`ConflictGuess`). Parameters are binary arrays encoded here.
On any exception nothing of the batch is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timezone
from typing import Any, NamedTuple
from uuid import UUID

import orjson
import psycopg
import uuid_utils.compat as uuid_compat
from psycopg.abc import Buffer
from psycopg.adapt import Transformer
from psycopg.pq import Format

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.records import ActionRowBuilder, RecordedAction
from dataflows.favorite_actions.sql import query
from runtime.logs import log_event
from schemas.action_tracked import utc_offset_seconds
from schemas.favorites import ActionType
from schemas.outbox import propagated_headers
from sinks import deferred_statement
from sinks.binary_codec import (
    LENGTH_8,
    NULL,
    UUID_FRAME,
    ByteaArray,
    Int4Array,
    TextArray,
    TimestamptzArray,
    UuidArray,
    frame,
    int4_element,
    register_binary_arrays,
    timestamptz,
)
from sinks.db import Connection

logger = logging.getLogger(__name__)


@dataclass
class BatchOutcome:
    """What one committed batch did with each message."""

    recorded: list[RecordedAction] = field(default_factory=list)
    duplicates: list[FavoriteMessage] = field(default_factory=list)
    no_session: list[FavoriteMessage] = field(default_factory=list)
    waiting: list[FavoriteMessage] = field(default_factory=list)  # in waiting_actions
    written_ns: tuple[int, int] | None = None  # wall-clock start and commit (ns), for spans
    txid: int = 0  # the transaction that wrote the outbox rows of ``recorded``


def owner_of(message: FavoriteMessage) -> tuple[UUID | None, UUID | None]:
    """The owner a session is resolved for: ``(anonymous_id, None)`` or ``(None, user_id)``."""
    payload = message.envelope.payload
    if payload.anonymous_id is not None:
        return (payload.anonymous_id, None)
    return (None, payload.user_id)


_ACTION_TYPES = {action: frame(action.value.encode()) for action in ActionType}
_NO_HEADERS = frame(b"{}")


class FavoritesStore:
    """Writes batches of favorites messages to PostgreSQL, one transaction each."""

    def __init__(self, action_tracked_topic: str, new_id: Callable[[], UUID] = uuid_compat.uuid7,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC), *,
                 wait_seconds: int = 0) -> None:
        """``wait_seconds``: how long a message without a session waits for one (0: skipped)."""
        self._topic = action_tracked_topic
        self._wait = Int4Array([int4_element(wait_seconds)], 1)
        self._topic_element = frame(action_tracked_topic.encode())
        self._new_id = new_id
        self._clock = clock
        self._guess = ConflictGuess()

    def record_batch(self, conn: Connection, messages: Sequence[FavoriteMessage]) -> BatchOutcome:
        """Record ``messages`` in one transaction; return what happened to each of them."""
        outcome, batch = _unique(messages)
        if not batch:
            return outcome
        pending, params = self.statement(batch, outcome)
        fresh = self._guess.fresh()
        try:
            with conn.transaction():
                rows = self._execute(conn, _STATEMENTS[fresh], params)
        except psycopg.errors.UniqueViolation as exc:
            if not fresh:
                raise
            self._conflicted(exc, len(batch))
            with conn.transaction():  # nothing of the batch was written: the whole batch again
                rows = self._execute(conn, _STATEMENTS[False], params)
        else:
            self._guess.passed(fresh)
        return self.settle(pending, rows)

    def send_batch(self, conn: Connection, messages: Sequence[FavoriteMessage]) -> SentBatch:
        """Send the batch's statement on the autocommit ``conn`` without waiting for it.

        Nothing is known to be committed until :meth:`finish_batch` returned; ``conn`` is busy.
        """
        outcome, batch = _unique(messages)
        if not batch:
            return SentBatch(outcome, None)
        pending, params = self.statement(batch, outcome)
        fresh = self._guess.fresh()
        deferred_statement.send(conn, _POSITIONAL[fresh], params)
        return SentBatch(outcome, pending, params if fresh else None)

    def finish_batch(self, conn: Connection, sent: SentBatch) -> BatchOutcome:
        """Wait for :meth:`send_batch`'s statement; the batch is committed when this returns.

        Raises when it failed (nothing written) or the connection broke (redo it: idempotent).
        """
        if sent.pending is None:
            return sent.outcome
        try:
            result = deferred_statement.finish(conn)
        except psycopg.errors.UniqueViolation as exc:
            if sent.fresh_params is None:
                raise
            self._conflicted(exc, len(sent.pending.messages))  # nothing was written
            return self.settle(sent.pending, self._execute(conn, _STATEMENTS[False],
                                                           sent.fresh_params))
        self._guess.passed(sent.fresh_params is not None)
        transformer = Transformer.from_context(conn)
        transformer.set_pgresult(result, format=Format.BINARY)
        return self.settle(sent.pending, transformer.load_rows(0, result.ntuples, tuple))

    def _conflicted(self, exc: psycopg.errors.UniqueViolation, messages: int) -> None:
        self._guess.conflicted()
        log_event(logger, "write-conflict-retried", logging.INFO, messages=messages,
                  constraint=exc.diag.constraint_name,
                  next_batches_with_on_conflict=self._guess.left)

    def statement(self, messages: Sequence[FavoriteMessage],
                  outcome: BatchOutcome) -> tuple[PendingBatch, dict[str, Any]]:
        """The ``record_actions`` parameters for ``messages`` (distinct keys); pure."""
        now = self._clock()
        new_id = self._new_id
        topic = self._topic_element
        event_ids: list[UUID] = []
        outbox_ids: list[UUID] = []
        keys: list[bytes] = []
        ids: list[bytes] = []
        action_types: list[bytes] = []
        owner_anonymous_ids: list[bytes] = []
        owner_user_ids: list[bytes] = []
        occurred_ats: list[Buffer] = []
        property_object_ids: list[bytes] = []
        favorite_ids: list[bytes] = []
        source_message_ids: list[bytes] = []
        outbox_id_elements: list[bytes] = []
        correlation_ids: list[bytes] = []
        occurred_offsets: list[bytes] = []
        offset_of: dict[object, bytes] = {}  # a fixed-offset zone's element, once per batch
        outbox_headers: list[bytes] = []
        headers_of: list[dict[str, str]] = []
        anonymous_null = users_null = correlations_null = False
        for message in messages:
            envelope = message.envelope
            payload = envelope.payload
            event_id, outbox_id = new_id(), new_id()
            event_ids.append(event_id)
            outbox_ids.append(outbox_id)
            key = message.idempotency_key.encode()
            keys += (len(key).to_bytes(4, "big"), key)
            ids.append((UUID_FRAME | event_id.int).to_bytes(20, "big"))
            action_types.append(_ACTION_TYPES[message.action_type])
            anonymous_id, user_id = owner_of(message)  # the one the statement resolves
            if anonymous_id is None:
                owner_anonymous_ids.append(NULL)
                anonymous_null = True
            else:
                owner_anonymous_ids.append((UUID_FRAME | anonymous_id.int).to_bytes(20, "big"))
            if user_id is None:
                owner_user_ids.append(NULL)
                users_null = True
            else:
                owner_user_ids.append((UUID_FRAME | user_id.int).to_bytes(20, "big"))
            occurred_at = payload.occurred_at
            occurred_ats += (LENGTH_8, timestamptz(occurred_at))
            property_object_ids.append(
                (UUID_FRAME | payload.property_object_id.int).to_bytes(20, "big"))
            favorite_ids.append((UUID_FRAME | payload.favorite_id.int).to_bytes(20, "big"))
            source_message_ids.append((UUID_FRAME | envelope.message_id.int).to_bytes(20, "big"))
            outbox_id_elements.append((UUID_FRAME | outbox_id.int).to_bytes(20, "big"))
            correlation_id = envelope.correlation_id
            if correlation_id is None:
                correlation_ids.append(NULL)
                correlations_null = True
            else:
                data = correlation_id.encode()
                correlation_ids += (len(data).to_bytes(4, "big"), data)
            zone = occurred_at.tzinfo
            offset = offset_of.get(zone)
            if offset is None:
                offset = int4_element(utc_offset_seconds(occurred_at))
                if type(zone) is timezone:  # the same offset at every moment
                    offset_of[zone] = offset
            occurred_offsets.append(offset)
            headers = propagated_headers(message.record, message.trace)
            headers_of.append(headers)
            if headers:
                encoded = orjson.dumps(headers)
                outbox_headers += (len(encoded).to_bytes(4, "big"), encoded)
            else:
                outbox_headers.append(_NO_HEADERS)
        count = len(messages)
        params = {
            "idempotency_keys": TextArray(keys, count), "ids": UuidArray(ids, count),
            "action_types": TextArray(action_types, count),
            "owner_anonymous_ids": UuidArray(owner_anonymous_ids, count, anonymous_null),
            "owner_user_ids": UuidArray(owner_user_ids, count, users_null),
            "occurred_ats": TimestamptzArray(occurred_ats, count),
            "property_object_ids": UuidArray(property_object_ids, count),
            "favorite_ids": UuidArray(favorite_ids, count),
            "source_message_ids": UuidArray(source_message_ids, count),
            "outbox_ids": UuidArray(outbox_id_elements, count),
            "outbox_topics": TextArray([topic] * count, count),
            "outbox_headers": TextArray(outbox_headers, count),
            "correlation_ids": ByteaArray(correlation_ids, count, correlations_null),
            "occurred_offsets": Int4Array(occurred_offsets, count),
            "outbox_created_ats": TimestamptzArray(
                [LENGTH_8 + bytes(timestamptz(now))] * count, count),
            "wait_seconds": self._wait}
        return PendingBatch(outcome, list(messages), event_ids, outbox_ids, headers_of, now), params

    def settle(self, pending: PendingBatch, rows: Sequence[tuple[Any, ...]]) -> BatchOutcome:
        """The outcome of a committed ``record_actions`` from its answer ``rows``."""
        outcome = pending.outcome
        by_position = {row[0]: row for row in rows}
        build = ActionRowBuilder(self._topic, pending.now).build_resolved
        recorded, duplicates, no_session = outcome.recorded, outcome.duplicates, outcome.no_session
        event_ids, outbox_ids, headers = pending.event_ids, pending.outbox_ids, pending.headers
        if rows:
            outcome.txid = rows[0][5]
        for index, message in enumerate(pending.messages):
            row = by_position.get(index + 1)
            if row is None:
                no_session.append(message)
            elif row[1] is None:
                (outcome.waiting if row[4] else duplicates).append(message)
            elif row[4]:
                recorded.append(build(message, row[1:4], event_ids[index], outbox_ids[index],
                                      headers[index]))
            else:
                duplicates.append(message)
        return outcome

    def sweep_waiting(self, conn: Connection, limit: int = 500) -> list[WaitingSwept]:
        """One sweep of ``waiting_actions`` in one transaction (``record_waiting_actions.sql``).

        Records those whose owner now has a session, gives up those past ``wait_until``;
        several processes may sweep at once. On a psycopg error nothing is written.
        """
        with conn.transaction():
            rows = conn.execute(_SWEEP, {"limit": limit}).fetchall()
        return [WaitingSwept(*row) for row in rows]

    @staticmethod
    def _execute(conn: Connection, statement: str, params: dict[str, Any]) -> list[Any]:
        with conn.cursor(binary=True) as cur:
            register_binary_arrays(cur.adapters)
            cur.execute(statement, params, binary=True)
            return cur.fetchall()


_CONFLICT_CLAUSES = (
    "    ON CONFLICT (key, processed_on) DO NOTHING\n",
    "    ON CONFLICT (source_message_id) WHERE source_message_id IS NOT NULL DO NOTHING\n",
)


def without_conflict_clauses(statement: str) -> str:
    """``record_actions`` without its two ``ON CONFLICT DO NOTHING`` clauses (else ``ValueError``).

    It fails with a unique violation, writing nothing, when any message was recorded before.
    """
    for clause in _CONFLICT_CLAUSES:
        if statement.count(clause) != 1:
            raise ValueError(f"record_actions must hold {clause.strip()!r} once")
        statement = statement.replace(clause, "")
    return statement


# record_actions with its ON CONFLICT clauses [0] and without them [1], indexed by ``fresh``
_STATEMENTS = (query("record_actions"), without_conflict_clauses(query("record_actions")))
_SWEEP = query("record_waiting_actions")
_POSITIONAL = tuple(deferred_statement.Positional.of(text) for text in _STATEMENTS)


class ConflictGuess:
    """Whether the next batch is sent without ``ON CONFLICT`` (pure).

    After a conflict the next ``wait`` batches go with ``ON CONFLICT``; ``wait`` doubles with
    each conflict in a row (up to :data:`MAX_WAIT`) and is back to 1 after a fresh batch passed.
    """

    MAX_WAIT = 1024

    __slots__ = ("_wait", "left")

    def __init__(self) -> None:
        self._wait = 1
        self.left = 0  # how many of the next batches go with ``ON CONFLICT`` at once

    def fresh(self) -> bool:
        """True: send the next batch without ``ON CONFLICT``."""
        if self.left:
            self.left -= 1
            return False
        return True

    def conflicted(self) -> None:
        """A fresh batch conflicted: the next ones go with ``ON CONFLICT`` for a while."""
        self.left = self._wait
        self._wait = min(self._wait * 2, self.MAX_WAIT)

    def passed(self, fresh: bool) -> None:
        """A batch was committed as sent (``fresh``: without ``ON CONFLICT``)."""
        if fresh:
            self._wait = 1


@dataclass(frozen=True, slots=True)
class PendingBatch:
    """A batch whose statement was made (:meth:`FavoritesStore.statement`), not yet answered."""

    outcome: BatchOutcome  # duplicates within the batch; the rest filled in by settle
    messages: list[FavoriteMessage]  # the statement's positions 1..n
    event_ids: list[UUID]
    outbox_ids: list[UUID]
    headers: list[dict[str, str]]
    now: datetime  # the outbox rows' created_at


@dataclass(frozen=True, slots=True)
class SentBatch:
    """A batch whose statement was sent (:meth:`FavoritesStore.send_batch`), not yet confirmed."""

    outcome: BatchOutcome
    pending: PendingBatch | None  # None: nothing to send
    fresh_params: dict[str, Any] | None = None  # sent without ON CONFLICT: kept to resend


class WaitingSwept(NamedTuple):
    """What one sweep did with one waiting action (a row of ``record_waiting_actions.sql``)."""

    idempotency_key: str
    message_id: UUID
    favorite_id: UUID
    property_object_id: UUID
    action_type: str
    session_id: UUID | None  # None: still no session
    inserted: bool  # False with a session: recorded before
    given_up: bool  # no session by its wait_until: skipped as no-session


def _unique(messages: Sequence[FavoriteMessage]) -> tuple[BatchOutcome, list[FavoriteMessage]]:
    """A new outcome with the batch's repeated idempotency keys, and the first of each key."""
    outcome = BatchOutcome()
    unique: dict[str, FavoriteMessage] = {}
    for message in messages:
        if message.idempotency_key in unique:
            outcome.duplicates.append(message)
        else:
            unique[message.idempotency_key] = message
    return outcome, list(unique.values())
