"""The favorites write path: one transaction per batch (SPEC §4 steps 4-5).

``record_batch`` resolves every owner's session with one query, then inserts the idempotency
marks, the action_events rows and the action-tracked outbox rows with one statement, and commits;
the caller then offers the committed outbox rows to the publisher.
Idempotent: a message already recorded (mark or source_message_id present) changes nothing, so
redelivery, replay and two racing processes are harmless. Parameters are sent as binary arrays.
On any exception the transaction is rolled back and nothing of the batch is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from uuid import UUID

import orjson
import uuid_utils.compat as uuid_compat

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.records import (
    RecordedAction,
    SessionSnapshot,
    build_recorded_action,
)
from sinks.db import Connection
from sinks.sql import query


@dataclass
class BatchOutcome:
    """What one committed batch did with each message."""

    recorded: list[RecordedAction] = field(default_factory=list)
    duplicates: list[FavoriteMessage] = field(default_factory=list)
    no_session: list[FavoriteMessage] = field(default_factory=list)

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


class FavoritesStore:
    """Writes batches of favorites messages to PostgreSQL, one transaction each."""

    def __init__(
        self,
        action_tracked_topic: str,
        new_id: Callable[[], UUID] = uuid_compat.uuid7,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._topic = action_tracked_topic
        self._new_id = new_id
        self._clock = clock

    def record_batch(
        self, conn: Connection, messages: Sequence[FavoriteMessage]
    ) -> BatchOutcome:
        """Record ``messages`` in one transaction; return what happened to each of them."""
        outcome = BatchOutcome()
        unique: dict[str, FavoriteMessage] = {}
        for message in messages:
            if message.idempotency_key in unique:
                outcome.duplicates.append(message)
            else:
                unique[message.idempotency_key] = message
        if not unique:
            return outcome
        with conn.transaction():
            sessions = self.resolve_sessions(conn, list(unique.values()))
            now = self._clock()
            actions: list[RecordedAction] = []
            for message in unique.values():
                session = sessions.get(owner_of(message))
                if session is None:
                    outcome.no_session.append(message)
                    continue
                actions.append(
                    build_recorded_action(
                        message,
                        session,
                        action_event_id=self._new_id(),
                        outbox_message_id=self._new_id(),
                        topic=self._topic,
                        now=now,
                    )
                )
            if actions:
                inserted = self._insert(conn, actions)
                for action in actions:
                    if action.event.id in inserted:
                        outcome.recorded.append(action)
                    else:
                        outcome.duplicates.append(action.message)
        return outcome

    def resolve_sessions(
        self, conn: Connection, messages: list[FavoriteMessage]
    ) -> dict[tuple[UUID | None, UUID | None], SessionSnapshot]:
        """Each distinct owner's session (INV-ACT-003), by one query; owners without one absent."""
        owners = list(dict.fromkeys(owner_of(m) for m in messages))
        params = {
            "anonymous_ids": [anonymous for anonymous, _ in owners],
            "user_ids": [user for _, user in owners],
        }
        found: dict[tuple[UUID | None, UUID | None], SessionSnapshot] = {}
        with conn.cursor(binary=True) as cur:
            cur.execute(query("resolve_owner_sessions"), params, binary=True)
            for owner_index, session_id, anonymous_id, user_id in cur.fetchall():
                found[owners[owner_index - 1]] = SessionSnapshot(session_id, anonymous_id, user_id)
        return found

    def _insert(
        self, conn: Connection, actions: list[RecordedAction]
    ) -> set[UUID]:
        events = [a.event for a in actions]
        outbox = [a.outbox for a in actions]
        params = {
            "idempotency_keys": [a.idempotency_key for a in actions],
            "ids": [e.id for e in events],
            "action_types": [e.action_type for e in events],
            "session_ids": [e.session_id for e in events],
            "anonymous_ids": [e.anonymous_id for e in events],
            "user_ids": [e.user_id for e in events],
            "occurred_ats": [e.occurred_at for e in events],
            "property_object_ids": [e.property_object_id for e in events],
            "favorite_ids": [e.favorite_id for e in events],
            "source_message_ids": [e.source_message_id for e in events],
            "outbox_ids": [o.id for o in outbox],
            "outbox_topics": [o.topic for o in outbox],
            "outbox_keys": [o.key for o in outbox],
            "outbox_values": [o.value for o in outbox],
            "outbox_headers": [orjson.dumps(o.headers).decode() for o in outbox],
        }
        with conn.cursor(binary=True) as cur:
            cur.execute(query("record_actions"), params, binary=True)
            return {row[0] for row in cur.fetchall()}
