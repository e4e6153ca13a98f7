"""Candidate fixes measured in the benchmark, without touching production code.

Each candidate is a subclass or a stand-alone re-implementation of one hot spot the profile
shows, run on the same inputs as the production code it would replace, so the report can state
a measured gain:

- :class:`JsonParamsStore`: ``FavoritesStore`` with its two statements fed ONE JSON document
  (``orjson.dumps`` of the rows, unpacked server-side by ``json_to_recordset``) instead of 15
  binary arrays that psycopg dumps element by element in Python (``ListDumper._dump_list``).
- :class:`LeanJsonStore`: the same, plus building each row without the frozen dataclasses,
  ``str(UUID)`` calls and per-row ``utc_iso(now)`` of ``build_recorded_action`` (the
  action-tracked value is still byte-compatible: same fields, same formats).
- :func:`report_cost`: the sink's per-message ``_report`` (metrics + one JSON log line through
  ``logging`` per message) against one ``orjson`` line per message written in one call per batch.

The SQL of the candidates is the production SQL with only the input CTE changed.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import orjson
import psycopg
import uuid_utils

from dataflows.favorite_actions.decode import FavoriteMessage
from dataflows.favorite_actions.records import SessionSnapshot
from schemas.envelope import CONTRACT_VERSION, utc_iso
from schemas.favorites import ACTION_EVENT_AGGREGATE_TYPE
from sinks import favorites_store as _store
from sinks.favorites_store import BatchOutcome, FavoritesStore
from sinks.sql import query

# The production helper was renamed (_owner -> owner_of) while this was written; accept both.
_owner: Callable[[FavoriteMessage], tuple[UUID | None, UUID | None]] = getattr(
    _store, "owner_of", None) or _store._owner  # type: ignore[attr-defined]

RESOLVE_JSON = """
SELECT o.i, s.id, s.anonymous_id, s.user_id
  FROM json_to_recordset(%(owners)s::json) AS o (i int, a uuid, u uuid)
 CROSS JOIN LATERAL (
        SELECT c.id, c.anonymous_id, c.user_id
          FROM user_activity.sessions c
         WHERE o.a IS NOT NULL AND c.anonymous_id = o.a
         ORDER BY (c.status = 'Active') DESC, c.last_activity_at DESC, c.id DESC
         LIMIT 1
       ) s
UNION ALL
SELECT o.i, s.id, s.anonymous_id, s.user_id
  FROM json_to_recordset(%(owners)s::json) AS o (i int, a uuid, u uuid)
 CROSS JOIN LATERAL (
        SELECT c.id, c.anonymous_id, c.user_id
          FROM user_activity.sessions c
         WHERE o.a IS NULL AND c.user_id = o.u
         ORDER BY (c.status = 'Active') DESC, c.last_activity_at DESC, c.id DESC
         LIMIT 1
       ) s
"""

_JSON_INPUT = """WITH input AS (
    SELECT t.k AS idempotency_key, t.id, t.at AS action_type, t.s AS session_id,
           t.a AS anonymous_id, t.u AS user_id, t.o AS occurred_at,
           t.p AS property_object_id, t.f AS favorite_id, t.m AS source_message_id,
           t.ob AS outbox_id, t.tp AS outbox_topic, convert_to(t.ky, 'UTF8') AS outbox_key,
           convert_to(t.v, 'UTF8') AS outbox_value, t.h AS outbox_headers
      FROM json_to_recordset(%(rows)s::json) AS t (
               k text, id uuid, at text, s uuid, a uuid, u uuid, o timestamptz, p uuid,
               f uuid, m uuid, ob uuid, tp text, ky text, v text, h jsonb)
),"""


def record_actions_json() -> str:
    """``record_actions.sql`` with its ``unnest`` of 15 arrays replaced by one JSON document."""
    production = query("record_actions")
    start = production.index("WITH input AS (")
    end = production.index("marked AS (")
    sql = production[:start] + _JSON_INPUT + "\n" + production[end:]
    # headers arrive as jsonb already
    return sql.replace("i.outbox_headers::jsonb", "i.outbox_headers")


class JsonParamsStore(FavoritesStore):
    """``FavoritesStore`` whose statements take one JSON parameter each."""

    _record_sql = ""

    def resolve_sessions(
        self, conn: psycopg.Connection[tuple[object, ...]], messages: list[FavoriteMessage]
    ) -> dict[tuple[UUID | None, UUID | None], SessionSnapshot]:
        """Each distinct owner's session, the owners sent as one JSON document."""
        owners = list(dict.fromkeys(_owner(m) for m in messages))
        doc = orjson.dumps([{"i": n, "a": a, "u": u} for n, (a, u) in enumerate(owners)])
        found: dict[tuple[UUID | None, UUID | None], SessionSnapshot] = {}
        with conn.cursor(binary=True) as cur:
            cur.execute(RESOLVE_JSON, {"owners": doc.decode()}, binary=True)
            for index, session_id, anonymous_id, user_id in cur:
                found[owners[int(index)]] = SessionSnapshot(  # type: ignore[call-overload]
                    session_id, anonymous_id, user_id)  # type: ignore[arg-type]
        return found

    _resolve_sessions = resolve_sessions  # the production name before the rename

    def _insert(self, conn: psycopg.Connection[tuple[object, ...]], actions: list[Any]
                ) -> set[UUID]:
        rows = [
            {"k": a.idempotency_key, "id": a.event.id, "at": a.event.action_type,
             "s": a.event.session_id, "a": a.event.anonymous_id, "u": a.event.user_id,
             "o": a.event.occurred_at, "p": a.event.property_object_id,
             "f": a.event.favorite_id, "m": a.event.source_message_id, "ob": a.outbox.id,
             "tp": a.outbox.topic, "ky": a.outbox.key.decode(), "v": a.outbox.value.decode(),
             "h": a.outbox.headers}
            for a in actions
        ]
        if not type(self)._record_sql:
            type(self)._record_sql = record_actions_json()
        with conn.cursor(binary=True) as cur:
            cur.execute(self._record_sql, {"rows": orjson.dumps(rows).decode()}, binary=True)
            return {row[0] for row in cur}  # type: ignore[misc]


class LeanJsonStore(JsonParamsStore):
    """``JsonParamsStore`` that also builds rows without dataclasses and ``str(UUID)``.

    Ids come from ``uuid_utils.uuid7()`` as strings (no ``uuid.UUID`` construction); the
    action-tracked value is produced by one ``orjson.dumps`` with native UUID handling;
    ``CreatedAt`` is rendered once per batch. Returns counts only (the benchmark needs no more).
    """

    def record_batch(
        self, conn: psycopg.Connection[tuple[object, ...]], messages: Sequence[FavoriteMessage]
    ) -> BatchOutcome:
        """``FavoritesStore.record_batch`` with lean row building (same SQL effects)."""
        outcome = BatchOutcome()
        unique: dict[bytes, FavoriteMessage] = {}
        for message in messages:
            key = message.dedup_id
            if key in unique:
                outcome.duplicates.append(message)
            else:
                unique[key] = message
        if not unique:
            return outcome
        with conn.transaction():
            sessions = self.resolve_sessions(conn, list(unique.values()))
            created_at = utc_iso(datetime.now(UTC))
            rows = []
            kept = []
            for message in unique.values():
                session = sessions.get(_owner(message))
                if session is None:
                    outcome.no_session.append(message)
                    continue
                envelope = message.envelope
                payload = envelope.payload
                event_id = str(uuid_utils.uuid7())
                action_type = message.action_type.value
                headers = {}
                traceparent = message.record.header("traceparent")
                if traceparent is not None:
                    headers["traceparent"] = traceparent.decode("ascii", "replace")
                occurred = utc_iso(payload.occurred_at)
                value = orjson.dumps({
                    "MessageId": str(uuid_utils.uuid7()), "CreatedAt": created_at,
                    "Version": CONTRACT_VERSION, "AggregateId": event_id,
                    "AggregateType": ACTION_EVENT_AGGREGATE_TYPE,
                    "CorrelationId": envelope.correlation_id,
                    "Payload": {
                        "ActionType": action_type, "SessionId": session.session_id,
                        "AnonymousId": session.anonymous_id, "UserId": session.user_id,
                        "OccurredAt": occurred, "PropertyObjectId": payload.property_object_id,
                        "FavoriteId": payload.favorite_id,
                    },
                })
                rows.append({
                    "k": f"user-activity-favorites:{action_type}:{envelope.message_id}",
                    "id": event_id, "at": action_type, "s": session.session_id,
                    "a": session.anonymous_id, "u": session.user_id, "o": occurred,
                    "p": payload.property_object_id, "f": payload.favorite_id,
                    "m": envelope.message_id, "ob": str(uuid_utils.uuid7()), "tp": self._topic,
                    "ky": event_id, "v": value.decode(), "h": headers,
                })
                kept.append(message)
            if rows:
                if not type(self)._record_sql:
                    type(self)._record_sql = record_actions_json()
                with conn.cursor(binary=True) as cur:
                    cur.execute(self._record_sql, {"rows": orjson.dumps(rows).decode()},
                                binary=True)
                    inserted = {str(row[0]) for row in cur}
                for row, message in zip(rows, kept, strict=True):
                    if row["id"] in inserted:
                        outcome.recorded.append(message)  # type: ignore[arg-type]
                    else:
                        outcome.duplicates.append(message)
        return outcome


def report_cost(messages: Sequence[FavoriteMessage], batch: int = 1000) -> dict[str, Any]:
    """CPU microseconds per message: the sink's per-message report vs a batched writer.

    Current: per message ``FAVORITES_RECORDED.labels(...).inc()``, a histogram observation and
    ``log_event(... **message_fields(m))`` through a ``JsonFormatter`` handler (to a buffer).
    Candidate: per batch one counter ``inc(n)`` per action type and ``observe`` per message, and
    one ``orjson.dumps`` line per message joined and written with a single ``write``.
    """
    from runtime.logs import JsonFormatter, log_event
    from runtime.metrics import FAVORITES_CONSUME_DURATION_MS, FAVORITES_RECORDED
    from sinks.action_history import message_fields

    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("bench.report_cost")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    session = "0192b3c4-0000-7000-8000-000000000000"

    def current() -> None:
        for m in messages:
            FAVORITES_RECORDED.labels(action_type=m.action_type.value).inc()
            FAVORITES_CONSUME_DURATION_MS.observe(1.0)
            log_event(logger, "recorded", outcome="recorded", SessionId=session,
                      **message_fields(m))

    def batched() -> None:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        for start in range(0, len(messages), batch):
            chunk = messages[start : start + batch]
            lines = []
            by_type: dict[str, int] = {}
            for m in chunk:
                action = m.action_type.value
                by_type[action] = by_type.get(action, 0) + 1
                FAVORITES_CONSUME_DURATION_MS.observe(1.0)
                payload = m.envelope.payload
                lines.append(orjson.dumps({
                    "ts": ts, "level": "INFO", "logger": "sinks.action_history",
                    "event": "recorded", "outcome": "recorded",
                    "MessageId": m.envelope.message_id, "FavoriteId": payload.favorite_id,
                    "PropertyObjectId": payload.property_object_id, "ActionType": action,
                    "SessionId": session,
                    "source": f"{m.record.topic}[{m.record.partition}]@{m.record.offset}",
                }))
            for action, n in by_type.items():
                FAVORITES_RECORDED.labels(action_type=action).inc(n)
            sink.write(b"\n".join(lines).decode() + "\n")

    result = {}
    for name, fn in (("per_message_logging", current), ("batched_orjson_lines", batched)):
        sink.seek(0)
        sink.truncate()
        t0 = time.process_time()
        fn()
        result[f"{name}_cpu_us_per_message"] = round(
            1e6 * (time.process_time() - t0) / max(1, len(messages)), 2)
    return result


def store_variants(make_db: Callable[[str], str], drop_db: Callable[[str], None],
                   messages: Sequence[FavoriteMessage], action_tracked: str,
                   batch_size: int = 1000) -> dict[str, Any]:
    """The ceiling (``record_batch`` x ``batch_size``) of the production store and candidates.

    Each runs on its own copy of the template database. Reported: wall rate, and the CPU time of
    this process per event (the Python side of the write path).
    """
    from bench.ceiling import wal_lsn

    results: dict[str, Any] = {}
    for name, cls in (("production FavoritesStore", FavoritesStore),
                      ("JsonParamsStore", JsonParamsStore),
                      ("LeanJsonStore", LeanJsonStore)):
        db = make_db(f"exp_{cls.__name__.lower()}")
        store = cls(action_tracked)
        recorded = fed = 0
        with psycopg.connect(db, autocommit=True) as conn:
            wal0 = wal_lsn(conn)
            t0 = time.monotonic()
            c0 = time.process_time()
            for i in range(0, len(messages), batch_size):
                batch = messages[i : i + batch_size]
                outcome = store.record_batch(conn, batch)
                fed += len(batch)
                recorded += len(outcome.recorded)
            wall = time.monotonic() - t0
            cpu = time.process_time() - c0
            wal = wal_lsn(conn) - wal0
            rows = conn.execute("SELECT count(*) FROM user_activity.outbox").fetchone()
        drop_db(f"exp_{cls.__name__.lower()}")
        results[name] = {
            "events_per_s": round(fed / wall, 1),
            "python_cpu_us_per_event": round(1e6 * cpu / fed, 1),
            "recorded": recorded,
            "outbox_rows": int(rows[0]) if rows else None,
            "wal_bytes_per_recorded_event": round(wal / recorded) if recorded else None,
        }
    return results
