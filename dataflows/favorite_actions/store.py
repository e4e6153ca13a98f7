"""The favorites write path: one transaction per batch (SPEC §4 steps 4-5).

``record_batch`` resolves every owner's session with one query, then inserts the idempotency
marks, the action_events rows and the action-tracked outbox rows with one statement, and commits;
the caller then offers the committed outbox rows to the publisher.
Idempotent: a message already recorded (mark or source_message_id present) changes nothing, so
redelivery, replay and two racing processes are harmless. Parameters are sent as binary arrays,
encoded here column by column (the bytes psycopg's list dumper would send, without its per-element
Python calls).
On any exception the transaction is rolled back and nothing of the batch is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import orjson
from psycopg.abc import Buffer

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.records import (
    ActionRowBuilder,
    RecordedAction,
    SessionSnapshot,
    uuid7,
)
from dataflows.favorite_actions.sql import query
from schemas.action_tracked import utc_offset_seconds
from schemas.favorites import ActionType
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
    uuid_element,
)
from sinks.db import Connection


@dataclass
class BatchOutcome:
    """What one committed batch did with each message."""

    recorded: list[RecordedAction] = field(default_factory=list)
    duplicates: list[FavoriteMessage] = field(default_factory=list)
    no_session: list[FavoriteMessage] = field(default_factory=list)
    written_ns: tuple[int, int] | None = None
    """Wall-clock start and commit (ns) of the write that committed it, for its trace spans
    (set by the sink; None when not timed)."""

    def extend(self, other: BatchOutcome) -> None:
        """Add ``other``'s messages to this outcome."""
        self.recorded.extend(other.recorded)
        self.duplicates.extend(other.duplicates)
        self.no_session.extend(other.no_session)


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

    def __init__(
        self,
        action_tracked_topic: str,
        new_id: Callable[[], UUID] = uuid7,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._topic = action_tracked_topic
        self._topic_element = frame(action_tracked_topic.encode())
        self._new_id = new_id
        self._clock = clock

    def record_batch(
        self, conn: Connection, messages: Sequence[FavoriteMessage]
    ) -> BatchOutcome:
        """Record ``messages`` in one transaction; return what happened to each of them."""
        outcome, batch = _unique(messages)
        if not batch:
            return outcome
        with conn.transaction():
            sessions = self._sessions_by_owner_key(conn, batch)
            actions, params = self.action_rows(batch, sessions, outcome.no_session)
            if actions:
                inserted = self._execute(conn, query("record_actions"), params)
                _settle(outcome, actions, len(inserted), lambda: {row[0] for row in inserted})
        return outcome

    def send_batch(self, conn: Connection, messages: Sequence[FavoriteMessage]) -> SentBatch:
        """``record_batch`` in two halves: this one resolves the sessions and sends the insert.

        The insert is one statement on the autocommit ``conn``, so its own transaction; it is
        sent without waiting (:mod:`sinks.deferred_statement`). Nothing is known to be
        committed until :meth:`finish_batch` returned; ``conn`` is busy until then.
        """
        outcome, batch = _unique(messages)
        if not batch:
            return SentBatch(outcome, [])
        sessions = self._sessions_by_owner_key(conn, batch)
        actions, params = self.action_rows(batch, sessions, outcome.no_session)
        if actions:
            deferred_statement.send(conn, _RECORD_ACTIONS, params)
        return SentBatch(outcome, actions)

    @staticmethod
    def finish_batch(conn: Connection, sent: SentBatch) -> BatchOutcome:
        """Wait for the insert :meth:`send_batch` sent; the batch is committed when this returns.

        Raises when the statement failed (nothing of the batch was written) or the connection
        broke (the batch may or may not be committed: redo it; the write is idempotent).
        """
        if not sent.actions:
            return sent.outcome
        result = deferred_statement.finish(conn)
        _settle(
            sent.outcome, sent.actions, result.ntuples,
            lambda: {UUID(bytes=result.get_value(i, 0)) for i in range(result.ntuples)},
        )
        return sent.outcome

    def action_rows(
        self, messages: Sequence[FavoriteMessage], sessions: dict[str, SessionSnapshot],
        no_session: list[FavoriteMessage],
    ) -> tuple[list[RecordedAction], dict[str, Any]]:
        """The rows of the messages whose owner has a session, and the parameters inserting them.

        ``sessions`` is keyed by ``owner_key``; messages without a session go to ``no_session``.
        Pure (no database): the ``record_actions`` parameters are encoded here.
        """
        now = self._clock()
        build = ActionRowBuilder(self._topic, now).build
        new_id = self._new_id
        topic = self._topic_element
        actions: list[RecordedAction] = []
        keys: list[bytes] = []
        ids: list[bytes] = []
        action_types: list[bytes] = []
        session_ids: list[bytes] = []
        anonymous_ids: list[bytes] = []
        user_ids: list[bytes] = []
        occurred_ats: list[Buffer] = []
        property_object_ids: list[bytes] = []
        favorite_ids: list[bytes] = []
        source_message_ids: list[bytes] = []
        outbox_ids: list[bytes] = []
        correlation_ids: list[bytes] = []
        occurred_offsets: list[bytes] = []
        outbox_headers: list[bytes] = []
        users_null = correlations_null = False
        for message in messages:
            session = sessions.get(message.owner_key)
            if session is None:
                no_session.append(message)
                continue
            action = build(message, session, new_id(), new_id())
            actions.append(action)
            (event_id, _, session_id, anonymous_id, user_id, occurred_at, property_object_id,
             favorite_id, source_message_id) = action.event
            outbox = action.outbox
            key = message.idempotency_key.encode()
            keys.append(len(key).to_bytes(4, "big"))
            keys.append(key)
            ids.append((UUID_FRAME | event_id.int).to_bytes(20, "big"))
            action_types.append(_ACTION_TYPES[message.action_type])
            session_ids.append((UUID_FRAME | session_id.int).to_bytes(20, "big"))
            anonymous_ids.append((UUID_FRAME | anonymous_id.int).to_bytes(20, "big"))
            if user_id is None:
                user_ids.append(NULL)
                users_null = True
            else:
                user_ids.append((UUID_FRAME | user_id.int).to_bytes(20, "big"))
            occurred_ats.append(LENGTH_8)
            occurred_ats.append(timestamptz(occurred_at))
            property_object_ids.append((UUID_FRAME | property_object_id.int).to_bytes(20, "big"))
            favorite_ids.append((UUID_FRAME | favorite_id.int).to_bytes(20, "big"))
            source_message_ids.append((UUID_FRAME | source_message_id.int).to_bytes(20, "big"))
            outbox_ids.append((UUID_FRAME | outbox.id.int).to_bytes(20, "big"))
            # the thin outbox row (0008): what the event needs beyond the action_events row
            correlation_id = message.envelope.correlation_id
            if correlation_id is None:
                correlation_ids.append(NULL)
                correlations_null = True
            else:
                data = correlation_id.encode()
                correlation_ids.append(len(data).to_bytes(4, "big"))
                correlation_ids.append(data)
            occurred_offsets.append(int4_element(utc_offset_seconds(occurred_at)))
            if outbox.headers:
                headers = orjson.dumps(outbox.headers)
                outbox_headers.append(len(headers).to_bytes(4, "big"))
                outbox_headers.append(headers)
            else:
                outbox_headers.append(_NO_HEADERS)
        count = len(actions)
        params = {
            "idempotency_keys": TextArray(keys, count),
            "ids": UuidArray(ids, count),
            "action_types": TextArray(action_types, count),
            "session_ids": UuidArray(session_ids, count),
            "anonymous_ids": UuidArray(anonymous_ids, count),
            "user_ids": UuidArray(user_ids, count, users_null),
            "occurred_ats": TimestamptzArray(occurred_ats, count),
            "property_object_ids": UuidArray(property_object_ids, count),
            "favorite_ids": UuidArray(favorite_ids, count),
            "source_message_ids": UuidArray(source_message_ids, count),
            "outbox_ids": UuidArray(outbox_ids, count),
            "outbox_topics": TextArray([topic] * count, count),
            "outbox_headers": TextArray(outbox_headers, count),
            "correlation_ids": ByteaArray(correlation_ids, count, correlations_null),
            "occurred_offsets": Int4Array(occurred_offsets, count),
            "outbox_created_ats": TimestamptzArray([LENGTH_8 + bytes(timestamptz(now))] * count,
                                                   count),
        }
        return actions, params

    def resolve_sessions(
        self, conn: Connection, messages: list[FavoriteMessage]
    ) -> dict[tuple[UUID | None, UUID | None], SessionSnapshot]:
        """Each distinct owner's session (INV-ACT-003), by one query; owners without one absent.

        Keyed by :func:`owner_of`; ``record_batch`` uses the same query keyed by ``owner_key``.
        """
        by_key = self._sessions_by_owner_key(conn, messages)
        return {
            owner_of(m): by_key[m.owner_key] for m in messages if m.owner_key in by_key
        }

    def _sessions_by_owner_key(
        self, conn: Connection, messages: Sequence[FavoriteMessage]
    ) -> dict[str, SessionSnapshot]:
        """Each distinct owner's session keyed by ``FavoriteMessage.owner_key``."""
        keys, params = self.owner_params(messages)
        return {
            keys[row[0] - 1]: _new_snapshot(SessionSnapshot, row[1:])
            for row in self._execute(conn, query("resolve_owner_sessions"), params)
        }

    @staticmethod
    def owner_params(messages: Sequence[FavoriteMessage]) -> tuple[list[str], dict[str, Any]]:
        """The distinct owner keys of ``messages`` and the ``resolve_owner_sessions`` parameters.

        The owner of index ``i`` in the query's result is ``keys[i - 1]``.
        """
        owners: dict[str, tuple[UUID | None, UUID | None]] = {}
        for message in messages:
            if message.owner_key not in owners:
                owners[message.owner_key] = owner_of(message)
        anonymous_ids = [uuid_element(anonymous) for anonymous, _ in owners.values()]
        user_ids = [uuid_element(user) for _, user in owners.values()]
        count = len(owners)
        return list(owners), {
            "anonymous_ids": UuidArray(anonymous_ids, count, NULL in anonymous_ids),
            "user_ids": UuidArray(user_ids, count, NULL in user_ids),
        }

    @staticmethod
    def _execute(conn: Connection, statement: str, params: dict[str, Any]) -> list[Any]:
        with conn.cursor(binary=True) as cur:
            register_binary_arrays(cur.adapters)
            cur.execute(statement, params, binary=True)
            return cur.fetchall()


_new_snapshot = tuple.__new__
_RECORD_ACTIONS = deferred_statement.Positional.of(query("record_actions"))


@dataclass(frozen=True, slots=True)
class SentBatch:
    """A batch whose insert was sent (:meth:`FavoritesStore.send_batch`), not yet confirmed."""

    outcome: BatchOutcome
    """Duplicates within the batch and messages without a session (final); ``recorded`` empty."""
    actions: list[RecordedAction]
    """The rows sent: recorded once the insert is confirmed, unless already in the database."""


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


def _settle(
    outcome: BatchOutcome, actions: list[RecordedAction], inserted: int,
    inserted_ids: Callable[[], set[UUID]],
) -> None:
    """Split the sent ``actions`` into recorded and duplicates (``inserted`` rows came back)."""
    if inserted == len(actions):  # the usual case: every action is new
        outcome.recorded = actions
        return
    ids = inserted_ids()
    for action in actions:
        if action.event.id in ids:
            outcome.recorded.append(action)
        else:
            outcome.duplicates.append(action.message)
