"""The write path's cost per event: the previous ``FavoritesStore``, a JSON candidate, the current.

``python -m bench.row_cost [--messages N] [--sessions N] [--prefill-rows N] [--dsn URL]``

All run in this one process on the same decoded messages, interleaved, so the machine's noise
hits them alike (compare the ratios, not the absolute numbers):

- ``previous``: the implementation before this change, kept here verbatim in behaviour (frozen
  dataclasses, ``uuid_utils.compat`` ids, ``str(UUID)`` keys, 15 lists that psycopg dumps element
  by element into binary arrays, the inserted ids returned and looked up).
- ``json_document``: a candidate measured and rejected (:class:`JsonDocumentStore`): the current
  row building, the parameters as one jsonb document + one bytea of values.
- ``current``: :class:`sinks.favorites_store.FavoritesStore` (named tuples, fast ids, the same
  binary arrays encoded column by column by the store itself; same statements as ``previous``).

Sections:

- ``decode_keys``: building a :class:`FavoriteMessage` (its idempotency key, dedup id and owner
  key) and reading ``owner_key`` once, as the flow's ``key_on`` does: previous vs current.
- ``params``: no database. Per batch of ``--batch-size`` (deduplicated as ``record_batch`` does):
  the session-resolution parameters, the rows (:class:`RecordedAction` and the outbox rows) and
  the ``record_actions`` parameters, dumped by psycopg to what would go on the wire.
  Sessions are taken from memory. CPU microseconds per event, best of ``--repeat`` rounds.
- ``orjson_output_retention``: why the current store copies each action-tracked value.
- ``record_batch``: end to end on a real PostgreSQL (one of its own, ``devenv.postgres_server``,
  unless ``--dsn``): one migrated, seeded database per store, the batches fed to the stores in
  turn; wall events/s, this process's CPU per event and the server backend's CPU per event (from
  ``/proc``, when readable). Then a replay of the same batches (all duplicates). The outcomes and
  the rows written must be the same for every store.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import orjson
import psycopg
import uuid_utils.compat as uuid_compat
from psycopg import sql
from psycopg._queries import PostgresQuery
from psycopg.adapt import AdaptersMap, Transformer

from bench.ceiling import decode_backlog
from bench.services import database_url
from bench.workload import EnvelopeFactory, Session, make_backlog, make_sessions, seed_sessions
from dataflows.favorite_actions.decode import IDEMPOTENCY_PREFIX, FavoriteMessage
from dataflows.favorite_actions.records import ActionRowBuilder, RecordedAction, SessionSnapshot
from dataflows.favorite_actions.wire import FavoriteWire
from schemas.envelope import CONTRACT_VERSION
from schemas.favorites import ACTION_EVENT_AGGREGATE_TYPE, ActionType, FavoriteEnvelope
from schemas.kafka_record import SourceRecord
from schemas.outbox import OutboxRow, propagated_headers
from sinks.favorites_store import BatchOutcome, FavoritesStore, register_binary_arrays
from sinks.sql import query

# ---- the previous implementation (baseline) -----------------------------------------------

# The statements did not change: the previous store sends them the same parameters (plain lists
# that psycopg dumps element by element). The JSON candidate sends one JSON document instead.

JSON_RESOLVE_SQL = """
WITH owners AS (
    SELECT o.owner_index, (o.owner->>0)::uuid AS anonymous_id, (o.owner->>1)::uuid AS user_id
      FROM jsonb_array_elements(%(owners)s::jsonb) WITH ORDINALITY AS o (owner, owner_index)
)
SELECT o.owner_index, s.id, s.anonymous_id, s.user_id
  FROM owners o
 CROSS JOIN LATERAL (
        SELECT c.id, c.anonymous_id, c.user_id
          FROM user_activity.sessions c
         WHERE o.anonymous_id IS NOT NULL AND c.anonymous_id = o.anonymous_id
         ORDER BY (c.status = 'Active') DESC, c.last_activity_at DESC, c.id DESC
         LIMIT 1
       ) s
UNION ALL
SELECT o.owner_index, s.id, s.anonymous_id, s.user_id
  FROM owners o
 CROSS JOIN LATERAL (
        SELECT c.id, c.anonymous_id, c.user_id
          FROM user_activity.sessions c
         WHERE o.anonymous_id IS NULL AND c.user_id = o.user_id
         ORDER BY (c.status = 'Active') DESC, c.last_activity_at DESC, c.id DESC
         LIMIT 1
       ) s
"""

JSON_RECORD_SQL = """
WITH input AS (
    SELECT r.n,
           r.e->>0                      AS idempotency_key,
           (r.e->>1)::uuid              AS id,
           r.e->>2                      AS action_type,
           (r.e->>3)::uuid              AS session_id,
           (r.e->>4)::uuid              AS anonymous_id,
           (r.e->>5)::uuid              AS user_id,
           (r.e->>6)::timestamptz       AS occurred_at,
           (r.e->>7)::uuid              AS property_object_id,
           (r.e->>8)::uuid              AS favorite_id,
           (r.e->>9)::uuid              AS source_message_id,
           (r.e->>10)::uuid             AS outbox_id,
           substring(%(values)b::bytea FROM (r.e->>11)::int FOR (r.e->>12)::int) AS outbox_value,
           r.e->13                      AS outbox_headers
      FROM jsonb_array_elements(%(rows)s::jsonb) WITH ORDINALITY AS r (e, n)
),
marked AS (
    INSERT INTO user_activity.consumer_idempotency_marks (key)
    SELECT idempotency_key FROM input
    ON CONFLICT (key) DO NOTHING
    RETURNING key
),
recorded AS (
    INSERT INTO user_activity.action_events
           (id, action_type, session_id, anonymous_id, user_id, occurred_at,
            property_object_id, favorite_id, source_message_id)
    SELECT i.id, i.action_type, i.session_id, i.anonymous_id, i.user_id, i.occurred_at,
           i.property_object_id, i.favorite_id, i.source_message_id
      FROM input i
      JOIN marked m ON m.key = i.idempotency_key
    ON CONFLICT (source_message_id) WHERE source_message_id IS NOT NULL DO NOTHING
    RETURNING id
),
announced AS (
    INSERT INTO user_activity.outbox (id, topic, key, value, headers)
    SELECT i.outbox_id, %(topic)s::text, convert_to(i.id::text, 'UTF8'), i.outbox_value,
           i.outbox_headers
      FROM input i
      JOIN recorded r ON r.id = i.id
    RETURNING id
)
SELECT i.n FROM input i WHERE NOT EXISTS (SELECT FROM recorded r WHERE r.id = i.id)
"""

Owner = tuple[UUID | None, UUID | None]


@dataclass(frozen=True, slots=True)
class LegacyMessage:
    """The previous ``FavoriteMessage``: keys by f-string with ``str(UUID)``."""

    record: SourceRecord
    action_type: ActionType
    envelope: FavoriteEnvelope | FavoriteWire
    idempotency_key: str = field(init=False)
    dedup_id: bytes = field(init=False)

    def __post_init__(self) -> None:
        message_id = self.envelope.message_id
        add = self.action_type is ActionType.ADD_TO_FAVORITES
        object.__setattr__(
            self, "idempotency_key",
            f"{IDEMPOTENCY_PREFIX}:{_LEGACY_ACTION_NAMES[self.action_type]}:{message_id}",
        )
        object.__setattr__(self, "dedup_id", (b"A" if add else b"R") + message_id.bytes)

    @property
    def owner_key(self) -> str:
        """``anonymous:{id}``, else ``user:{id}``."""
        payload = self.envelope.payload
        if payload.anonymous_id is not None:
            return f"anonymous:{payload.anonymous_id}"
        return f"user:{payload.user_id}"


_LEGACY_ACTION_NAMES = {action: action.value for action in ActionType}


@dataclass(frozen=True, slots=True)
class LegacySession:
    """The previous ``SessionSnapshot``."""

    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None


@dataclass(frozen=True, slots=True)
class LegacyEvent:
    """The previous ``ActionEventRow``."""

    id: UUID
    action_type: str
    session_id: UUID
    anonymous_id: UUID
    user_id: UUID | None
    occurred_at: datetime
    property_object_id: UUID
    favorite_id: UUID
    source_message_id: UUID


@dataclass(frozen=True, slots=True)
class LegacyAction:
    """The previous ``RecordedAction``."""

    message: FavoriteMessage
    idempotency_key: str
    event: LegacyEvent
    outbox: OutboxRow


def legacy_build(message: FavoriteMessage, session: LegacySession, *, action_event_id: UUID,
                 outbox_message_id: UUID, topic: str, now: datetime) -> LegacyAction:
    """The previous ``build_recorded_action``."""
    envelope = message.envelope
    payload = envelope.payload
    event = LegacyEvent(
        id=action_event_id, action_type=message.action_type.value,
        session_id=session.session_id, anonymous_id=session.anonymous_id,
        user_id=session.user_id, occurred_at=payload.occurred_at,
        property_object_id=payload.property_object_id, favorite_id=payload.favorite_id,
        source_message_id=envelope.message_id,
    )
    value = orjson.dumps({
        "MessageId": outbox_message_id, "CreatedAt": now, "Version": CONTRACT_VERSION,
        "AggregateId": action_event_id, "AggregateType": ACTION_EVENT_AGGREGATE_TYPE,
        "CorrelationId": envelope.correlation_id,
        "Payload": {
            "ActionType": event.action_type, "SessionId": event.session_id,
            "AnonymousId": event.anonymous_id, "UserId": event.user_id,
            "OccurredAt": event.occurred_at, "PropertyObjectId": event.property_object_id,
            "FavoriteId": event.favorite_id,
        },
    })
    outbox = OutboxRow(
        id=outbox_message_id, topic=topic, key=str(action_event_id).encode(), value=value,
        headers=propagated_headers(message.record),
    )
    return LegacyAction(message, message.idempotency_key, event, outbox)


def legacy_owner(message: FavoriteMessage) -> Owner:
    """The previous ``owner_of``."""
    payload = message.envelope.payload
    if payload.anonymous_id is not None:
        return (payload.anonymous_id, None)
    return (None, payload.user_id)


@dataclass
class LegacyOutcome:
    """The previous ``BatchOutcome``."""

    recorded: list[LegacyAction] = field(default_factory=list)
    duplicates: list[FavoriteMessage] = field(default_factory=list)
    no_session: list[FavoriteMessage] = field(default_factory=list)


class LegacyStore:
    """The previous ``FavoritesStore`` (same statements, same parameters)."""

    def __init__(self, topic: str) -> None:
        self._topic = topic
        self._new_id: Callable[[], UUID] = uuid_compat.uuid7

    def record_batch(self, conn: psycopg.Connection[Any], messages: Sequence[FavoriteMessage]
                     ) -> LegacyOutcome:
        """The previous ``record_batch``."""
        outcome = LegacyOutcome()
        unique = dedup(messages, outcome.duplicates)
        if not unique:
            return outcome
        with conn.transaction():
            sessions = self.resolve_sessions(conn, unique)
            actions, params = self.action_rows(unique, sessions, outcome.no_session)
            if actions:
                with conn.cursor(binary=True) as cur:
                    cur.execute(query("record_actions"), params, binary=True)
                    inserted = {row[0] for row in cur.fetchall()}
                for action in actions:
                    if action.event.id in inserted:
                        outcome.recorded.append(action)
                    else:
                        outcome.duplicates.append(action.message)
        return outcome

    def resolve_sessions(self, conn: psycopg.Connection[Any], messages: list[FavoriteMessage]
                         ) -> dict[Owner, LegacySession]:
        """The previous ``resolve_sessions``."""
        owners, params = self.owner_params(messages)
        found: dict[Owner, LegacySession] = {}
        with conn.cursor(binary=True) as cur:
            cur.execute(query("resolve_owner_sessions"), params, binary=True)
            for owner_index, session_id, anonymous_id, user_id in cur.fetchall():
                found[owners[owner_index - 1]] = LegacySession(session_id, anonymous_id, user_id)
        return found

    @staticmethod
    def owner_params(messages: Sequence[FavoriteMessage]) -> tuple[list[Owner], dict[str, Any]]:
        """Distinct owners and the session query's parameters."""
        owners = list(dict.fromkeys(legacy_owner(m) for m in messages))
        return owners, {"anonymous_ids": [a for a, _ in owners],
                        "user_ids": [u for _, u in owners]}

    def action_rows(self, messages: Sequence[FavoriteMessage], sessions: dict[Owner, LegacySession],
                    no_session: list[FavoriteMessage]) -> tuple[list[LegacyAction], dict[str, Any]]:
        """The previous row building (``record_batch`` loop + ``_insert`` parameters)."""
        now = datetime.now(UTC)
        actions: list[LegacyAction] = []
        for message in messages:
            session = sessions.get(legacy_owner(message))
            if session is None:
                no_session.append(message)
                continue
            actions.append(legacy_build(
                message, session, action_event_id=self._new_id(),
                outbox_message_id=self._new_id(), topic=self._topic, now=now))
        return actions, previous_record_params(actions)


def previous_record_params(actions: Sequence[Any]) -> dict[str, list[Any]]:
    """What the previous implementation passed to record_actions: plain lists psycopg dumped.

    ``actions`` have ``idempotency_key``, ``event`` and ``outbox`` (old or current rows).
    """
    events = [a.event for a in actions]
    outbox = [a.outbox for a in actions]
    return {
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


def dedup(messages: Sequence[FavoriteMessage], duplicates: list[FavoriteMessage]
          ) -> list[FavoriteMessage]:
    """The batch's distinct messages by idempotency key (as both ``record_batch`` do)."""
    unique: dict[str, FavoriteMessage] = {}
    for message in messages:
        if message.idempotency_key in unique:
            duplicates.append(message)
        else:
            unique[message.idempotency_key] = message
    return list(unique.values())


class JsonDocumentStore(FavoritesStore):
    """The candidate measured and rejected: one JSON document per statement instead of arrays.

    The rows go as one jsonb array (parsed server side) plus one bytea of all values; same SQL
    effects. Its Python side is the cheapest (one ``orjson.dumps``); its server side costs a few
    microseconds per row more than binary arrays (jsonb parsing, a ``->>`` and a cast per field).
    """

    def record_batch(self, conn: psycopg.Connection[Any], messages: Sequence[FavoriteMessage]
                     ) -> BatchOutcome:
        """``FavoritesStore.record_batch`` with JSON parameters."""
        outcome = BatchOutcome()
        batch = dedup(messages, outcome.duplicates)
        if not batch:
            return outcome
        with conn.transaction():
            keys, owner_params = self.json_owner_params(batch)
            with conn.cursor(binary=True) as cur:
                cur.execute(JSON_RESOLVE_SQL, owner_params, binary=True)
                sessions = {keys[row[0] - 1]: SessionSnapshot(*row[1:]) for row in cur.fetchall()}
            actions, params = self.json_action_rows(batch, sessions, outcome.no_session)
            if actions:
                with conn.cursor(binary=True) as cur:
                    cur.execute(JSON_RECORD_SQL, params, binary=True)
                    not_recorded = {row[0] for row in cur.fetchall()}
                for position, action in enumerate(actions, 1):
                    if position in not_recorded:
                        outcome.duplicates.append(action.message)
                    else:
                        outcome.recorded.append(action)
        return outcome

    @staticmethod
    def json_owner_params(messages: Sequence[FavoriteMessage]
                          ) -> tuple[list[str], dict[str, Any]]:
        """Distinct owner keys and the owners as one JSON array of pairs."""
        owners: dict[str, Owner] = {}
        for message in messages:
            if message.owner_key not in owners:
                owners[message.owner_key] = legacy_owner(message)
        return list(owners), {"owners": orjson.dumps(list(owners.values())).decode()}

    def json_action_rows(self, messages: Sequence[FavoriteMessage],
                         sessions: dict[str, SessionSnapshot], no_session: list[FavoriteMessage]
                         ) -> tuple[list[RecordedAction], dict[str, Any]]:
        """The rows, and one JSON array of row arrays + the values concatenated."""
        build = ActionRowBuilder(self._topic, self._clock()).build
        actions: list[RecordedAction] = []
        rows: list[list[object]] = []
        values: list[bytes] = []
        offset = 1
        for message in messages:
            session = sessions.get(message.owner_key)
            if session is None:
                no_session.append(message)
                continue
            action = build(message, session, self._new_id(), self._new_id())
            outbox = action.outbox
            value = outbox.value
            rows.append([message.idempotency_key, *action.event, outbox.id, offset, len(value),
                         outbox.headers])
            values.append(value)
            offset += len(value)
            actions.append(action)
        return actions, {"rows": orjson.dumps(rows).decode(), "values": b"".join(values),
                         "topic": self._topic}


# ---- measurements ---------------------------------------------------------------------------


class _DumpContext:
    """A psycopg adapt context without a connection: the default adapters + the store's."""

    def __init__(self) -> None:
        self.adapters = AdaptersMap(psycopg.adapters)
        register_binary_arrays(self.adapters)
        self.connection = None


_DUMP_CONTEXT = _DumpContext()


def wire(statement: str, params: dict[str, Any]) -> int:
    """Dump ``params`` for ``statement`` as psycopg would on ``execute`` (no connection)."""
    converted = PostgresQuery(Transformer(_DUMP_CONTEXT))
    converted.convert(statement, params)
    converted.dump(params)
    return sum(len(p) for p in converted.params or () if p is not None)


def measure_decode_keys(messages: Sequence[FavoriteMessage], repeat: int) -> dict[str, Any]:
    """CPU ns per message: build the message (keys) and read ``owner_key`` once."""
    inputs = [(m.record, m.action_type, m.envelope) for m in messages]

    def legacy() -> None:
        for record, action_type, envelope in inputs:
            _ = LegacyMessage(record, action_type, envelope).owner_key

    def current() -> None:
        for record, action_type, envelope in inputs:
            _ = FavoriteMessage(record, action_type, envelope).owner_key

    best = {"previous": float("inf"), "current": float("inf")}
    for _ in range(repeat):
        for name, run in (("previous", legacy), ("current", current)):
            t0 = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - t0)
    for m in messages[:1000]:  # same keys
        old = LegacyMessage(m.record, m.action_type, m.envelope)
        assert (old.idempotency_key, old.dedup_id, old.owner_key) == (
            m.idempotency_key, m.dedup_id, m.owner_key)
    n = len(inputs)
    return {
        "previous_us_per_message": round(1e6 * best["previous"] / n, 2),
        "current_us_per_message": round(1e6 * best["current"] / n, 2),
        "speedup": round(best["previous"] / best["current"], 2),
    }


def measure_params(messages: Sequence[FavoriteMessage], sessions: Sequence[Session],
                   batch_size: int, repeat: int) -> dict[str, Any]:
    """CPU us per event for session parameters + rows + record parameters (+ psycopg dump)."""
    by_owner: dict[Owner, Session] = {(s.anonymous_id, None): s for s in sessions}
    by_owner.update({(None, s.user_id): s for s in sessions if s.user_id is not None})
    legacy_sessions: dict[Owner, LegacySession] = {}
    current_sessions: dict[str, SessionSnapshot] = {}
    for m in messages:
        found = by_owner.get(legacy_owner(m))
        if found is not None:
            legacy_sessions[legacy_owner(m)] = LegacySession(
                found.id, found.anonymous_id, found.user_id)
            current_sessions[m.owner_key] = SessionSnapshot(
                found.id, found.anonymous_id, found.user_id)
    batches = [dedup(messages[i : i + batch_size], [])
               for i in range(0, len(messages), batch_size)]
    legacy_store = LegacyStore("bench.action-tracked")
    json_store = JsonDocumentStore("bench.action-tracked")
    store = FavoritesStore("bench.action-tracked")
    resolve_sql, record_sql = query("resolve_owner_sessions"), query("record_actions")
    wire_bytes: dict[str, int] = {}

    def previous(dump: bool) -> None:
        for batch in batches:
            _, owner_params = legacy_store.owner_params(batch)
            _, params = legacy_store.action_rows(batch, legacy_sessions, [])
            if dump:
                wire_bytes["previous"] = wire(resolve_sql, owner_params) + wire(record_sql, params)

    def json_document(dump: bool) -> None:
        for batch in batches:
            _, owner_params = json_store.json_owner_params(batch)
            _, params = json_store.json_action_rows(batch, current_sessions, [])
            if dump:
                wire_bytes["json_document"] = wire(JSON_RESOLVE_SQL, owner_params) + wire(
                    JSON_RECORD_SQL, params)

    def current(dump: bool) -> None:
        for batch in batches:
            _, owner_params = store.owner_params(batch)
            _, params = store.action_rows(batch, current_sessions, [])
            if dump:
                wire_bytes["current"] = wire(resolve_sql, owner_params) + wire(record_sql, params)

    runs = {"previous": previous, "json_document": json_document, "current": current}
    best: dict[str, float] = {}
    for round_ in range(repeat):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            for dump in (False, True):
                key = f"{name}_{'with_dump' if dump else 'rows_only'}"
                t0 = time.process_time()
                runs[name](dump)
                best[key] = min(best.get(key, float("inf")), time.process_time() - t0)
    events = sum(len(b) for b in batches)
    result: dict[str, Any] = {
        f"{key}_us_per_event": round(1e6 * seconds / events, 2) for key, seconds in best.items()
    }
    for name in ("json_document", "current"):
        result[f"speedup_{name}_with_dump"] = round(
            best["previous_with_dump"] / best[f"{name}_with_dump"], 2)
    result["wire_bytes_per_event_last_batch"] = {
        k: round(v / len(batches[-1])) for k, v in wire_bytes.items()}
    return result


def measure_orjson_retention(messages: Sequence[FavoriteMessage], repeat: int
                             ) -> dict[str, Any]:
    """CPU ns per action-tracked value: keeping ``orjson.dumps`` output vs a right-sized copy.

    Every value is kept (as outbox rows are, until published); the current store keeps copies.
    """
    now = datetime.now(UTC)
    docs = [{
        "MessageId": m.message_id, "CreatedAt": now, "Version": 1, "AggregateId": m.message_id,
        "AggregateType": "ActionEvent", "CorrelationId": m.envelope.correlation_id,
        "Payload": {"ActionType": m.action_type.value, "SessionId": m.message_id,
                    "AnonymousId": m.message_id, "UserId": None,
                    "OccurredAt": m.envelope.payload.occurred_at,
                    "PropertyObjectId": m.envelope.payload.property_object_id,
                    "FavoriteId": m.envelope.payload.favorite_id},
    } for m in messages]
    best = {"kept_as_returned": float("inf"), "kept_as_copy": float("inf")}
    for _ in range(repeat):
        for name in ("kept_as_returned", "kept_as_copy"):
            copy = name == "kept_as_copy"
            t0 = time.process_time()
            kept = [bytes(memoryview(orjson.dumps(d))) if copy else orjson.dumps(d) for d in docs]
            best[name] = min(best[name], time.process_time() - t0)
            del kept
    return {f"{k}_ns_per_value": round(1e9 * v / len(docs)) for k, v in best.items()}


STORES: dict[str, Callable[[str], Any]] = {
    "previous": LegacyStore, "json_document": JsonDocumentStore, "current": FavoritesStore}


class BackendCpu:
    """CPU seconds used so far by the server backend of ``conn`` (None if /proc is unreadable)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        self._path = Path(f"/proc/{row[0] if row else 0}/stat")
        self._tick = os.sysconf("SC_CLK_TCK")

    def seconds(self) -> float | None:
        """User + system CPU seconds of the backend process."""
        try:
            fields = self._path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick


@dataclass
class Tally:
    """One store's totals over a pass."""

    wall: float = 0.0
    cpu: float = 0.0
    cpu_sys: float = 0.0
    server: float | None = 0.0
    fed: int = 0
    recorded: int = 0
    duplicates: int = 0
    no_session: int = 0

    def result(self) -> dict[str, Any]:
        """Rates per event."""
        return {
            "events_per_s": round(self.fed / self.wall, 1) if self.wall else None,
            "client_cpu_us_per_event": round(1e6 * self.cpu / self.fed, 2) if self.fed else None,
            "  of_which_kernel": round(1e6 * self.cpu_sys / self.fed, 2) if self.fed else None,
            "server_cpu_us_per_event": (
                round(1e6 * self.server / self.fed, 2) if self.server is not None and self.fed
                else None),
            "fed": self.fed, "recorded": self.recorded, "duplicates": self.duplicates,
            "no_session": self.no_session,
        }


def run_pass(stores: dict[str, Any], conns: dict[str, psycopg.Connection[Any]],
             batches: list[Sequence[FavoriteMessage]]) -> dict[str, Tally]:
    """Feed every batch to every store, rotating which goes first."""
    tallies = {name: Tally() for name in stores}
    backends = {name: BackendCpu(conn) for name, conn in conns.items()}
    names = list(stores)
    for i, batch in enumerate(batches):
        for name in names[i % len(names):] + names[: i % len(names)]:
            tally = tallies[name]
            s0 = backends[name].seconds()
            k0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            c0 = time.process_time()
            w0 = time.perf_counter()
            outcome: BatchOutcome | LegacyOutcome = stores[name].record_batch(conns[name], batch)
            tally.wall += time.perf_counter() - w0
            tally.cpu += time.process_time() - c0
            tally.cpu_sys += resource.getrusage(resource.RUSAGE_SELF).ru_stime - k0
            s1 = backends[name].seconds()
            if s0 is None or s1 is None or tally.server is None:
                tally.server = None
            else:
                tally.server += s1 - s0
            tally.fed += len(batch)
            tally.recorded += len(outcome.recorded)
            tally.duplicates += len(outcome.duplicates)
            tally.no_session += len(outcome.no_session)
    return tallies


def measure_db(dsn: str | None, messages: Sequence[FavoriteMessage], sessions: Sequence[Session],
               batch_size: int, prefill_rows: int) -> dict[str, Any]:
    """``record_batch`` end to end on PostgreSQL, previous vs current store."""
    from runtime.migrate import apply_migrations

    with contextlib.ExitStack() as stack:
        if dsn is None:
            from devenv.postgres_server import PostgresServer

            server = PostgresServer()  # its own temporary run directory, removed on close
            server.start()
            stack.callback(server.close)
            admin_dsn = server.dsn("postgres")
        else:
            admin_dsn = dsn
        urls: dict[str, str] = {}
        for name in STORES:
            db = f"bench_row_cost_{name}"
            with psycopg.connect(admin_dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(db)))
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
            url = database_url(admin_dsn, db)
            apply_migrations(url)
            if prefill_rows:
                from bench.prefill import prefill

                prefill(url, sessions, prefill_rows, log=lambda _line: None)
            else:
                with psycopg.connect(url, autocommit=True) as conn:
                    seed_sessions(conn, sessions)
                    conn.execute("VACUUM (ANALYZE)")
            urls[name] = url

            def drop(db: str = db) -> None:
                with psycopg.connect(admin_dsn, autocommit=True) as admin:
                    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(db)))
            stack.callback(drop)
        conns = {name: stack.enter_context(psycopg.connect(url, autocommit=True))
                 for name, url in urls.items()}
        stores = {name: make("bench.action-tracked") for name, make in STORES.items()}
        batches = [messages[i : i + batch_size] for i in range(0, len(messages), batch_size)]
        result: dict[str, Any] = {}
        for pass_name in ("first_delivery", "replay_all_duplicates"):
            tallies = run_pass(stores, conns, batches)
            result[pass_name] = {name: t.result() for name, t in tallies.items()}
            prev = tallies["previous"]
            for name, tally in tallies.items():
                assert (prev.recorded, prev.duplicates, prev.no_session) == (
                    tally.recorded, tally.duplicates, tally.no_session), result[pass_name]
                if name != "previous":
                    result[pass_name][f"{name}_events_per_s_ratio"] = round(
                        (tally.fed / tally.wall) / (prev.fed / prev.wall), 2)
        counts = {}
        for name, conn in conns.items():
            row = conn.execute(
                "SELECT (SELECT count(*) FROM user_activity.action_events),"
                " (SELECT count(*) FROM user_activity.outbox),"
                " (SELECT count(*) FROM user_activity.consumer_idempotency_marks)").fetchone()
            counts[name] = list(row) if row else None
        assert all(c == counts["previous"] for c in counts.values()), counts
        result["rows_written_events_outbox_marks"] = counts["current"]
        return result


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements; print (and optionally write) the JSON results."""
    parser = argparse.ArgumentParser(prog="python -m bench.row_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--sessions", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5, help="rounds of the no-DB timings")
    parser.add_argument("--prefill-rows", type=int, default=0,
                        help="action_events rows already present in each database")
    parser.add_argument("--dsn", help="an existing server (the role must create databases)")
    parser.add_argument("--no-db", action="store_true", help="skip the PostgreSQL measurement")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    sessions = make_sessions(args.sessions, rng)
    factory = EnvelopeFactory(sessions, rng, "bench.favorite-added", "bench.favorite-removed")
    backlog = make_backlog(factory, args.messages, rng)
    messages, _ = decode_backlog(backlog, "bench.favorite-added", "bench.favorite-removed")
    # The inputs live for the whole run: keep them out of the cyclic GC's full collections, so
    # a collection's cost falls on whichever store allocates, not on whoever happens to be
    # running when the (large) input heap gets traversed.
    gc.collect()
    gc.freeze()
    results: dict[str, Any] = {
        "messages": len(messages), "sessions": args.sessions, "batch_size": args.batch_size,
        "decode_keys": measure_decode_keys(messages, args.repeat),
        "params": measure_params(messages, sessions, args.batch_size, args.repeat),
        "orjson_output_retention": measure_orjson_retention(messages, args.repeat),
    }
    print(json.dumps(results, indent=1), file=sys.stderr)
    if not args.no_db:
        results["record_batch"] = measure_db(args.dsn, messages, sessions, args.batch_size,
                                             args.prefill_rows)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
