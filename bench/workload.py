"""What a benchmark run feeds the job: sessions, favorites envelopes, a backlog, prefilled rows.

Everything is drawn from a seeded ``random.Random``; MessageIds are UUIDv7 (time-ordered, as our
producers send them), other ids random v4. :func:`prefill` fills the template database: the
sessions, then ``rows`` action_events (and their idempotency marks) generated server-side with
UUIDv7-shaped ids over the 30 days before now, an empty outbox (as after the publisher's purge),
then VACUUM ANALYZE and a CHECKPOINT, so each copy starts with clean pages and statistics.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import psycopg
from confluent_kafka import Producer

from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import Session, seed_sessions


def uuid4_from(rng: random.Random) -> uuid.UUID:
    """A random version-4 UUID drawn from ``rng``."""
    return uuid.UUID(int=rng.getrandbits(128), version=4)


def _uuid7_from(rng: random.Random) -> uuid.UUID:
    ms = time.time_ns() // 1_000_000
    return uuid.UUID(int=((ms & (1 << 48) - 1) << 80) | (0x7 << 76) | (rng.getrandbits(12) << 64)
                     | (0b10 << 62) | rng.getrandbits(62))


def make_sessions(count: int, rng: random.Random, linked_share: float = 0.6) -> list[Session]:
    """``count`` Active sessions, ``linked_share`` of them linked to a user."""
    return [Session(uuid4_from(rng), uuid4_from(rng),
                    uuid4_from(rng) if rng.random() < linked_share else None)
            for _ in range(count)]


@dataclass(frozen=True, slots=True)
class OutRecord:
    """One record to produce, and what the job must do with it."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    favorite_id: str
    kind: str  # "valid" | "duplicate" | "invalid-owner" | "no-session"


@dataclass
class Backlog:
    """A generated backlog; ``expected_recorded``: its messages that must become a row each."""

    records: list[OutRecord]
    removed_topic: str = ""

    def count(self, kind: str) -> int:
        """How many records are of ``kind``."""
        return sum(1 for r in self.records if r.kind == kind)

    @property
    def expected_recorded(self) -> int:
        """Messages that must become one row and one action-tracked each."""
        return self.count("valid")

    def summary(self) -> dict[str, int]:
        """The backlog's composition."""
        removed = sum(1 for r in self.records if r.topic == self.removed_topic)
        return {"messages": len(self.records), "added": len(self.records) - removed,
                "removed": removed, "duplicate_message_ids": self.count("duplicate"),
                "invalid_owner": self.count("invalid-owner"),
                "no_session": self.count("no-session"), "expected_recorded": self.expected_recorded}


class EnvelopeFactory:
    """Favorites envelopes for owners drawn from ``sessions``; 20 % on favorite-removed."""

    def __init__(self, sessions: Sequence[Session], rng: random.Random, added_topic: str,
                 removed_topic: str) -> None:
        self._sessions, self._rng = sessions, rng
        self._added, self.removed_topic = added_topic, removed_topic

    def owner(self, kind: str) -> tuple[uuid.UUID | None, uuid.UUID | None]:
        """(UserId, AnonymousId) of a message of ``kind``: 30 % by user where linked."""
        rng = self._rng
        if kind == "invalid-owner":  # both set, or neither
            return (uuid4_from(rng), uuid4_from(rng)) if rng.random() < 0.5 else (None, None)
        if kind == "no-session":
            return None, uuid4_from(rng)  # a device we never saw
        session = self._sessions[rng.randrange(len(self._sessions))]
        if session.user_id is not None and rng.random() < 0.3:
            return session.user_id, None
        return None, session.anonymous_id

    def topic(self) -> str:
        """favorite-removed for a fifth of the messages, else favorite-added."""
        return self.removed_topic if self._rng.random() < 0.2 else self._added

    def envelope(self, user_id: uuid.UUID | None, anonymous_id: uuid.UUID | None,
                 created_at: datetime | None = None) -> tuple[dict[str, Any], str]:
        """An envelope (a private note on a tenth of them) and its FavoriteId."""
        rng = self._rng
        favorite_id, property_object_id = uuid4_from(rng), uuid4_from(rng)
        note = {"Note": "a private note that must never be stored"} if rng.random() < 0.1 else None
        envelope = favorite_envelope(
            message_id=_uuid7_from(rng), favorite_id=favorite_id,
            property_object_id=property_object_id, user_id=user_id, anonymous_id=anonymous_id,
            created_at=created_at, correlation_id=f"corr-{rng.getrandbits(32):08x}",
            extra_payload=note)
        return envelope, str(favorite_id)

    def record(self, kind: str, created_at: datetime | None = None) -> OutRecord:
        """One record of ``kind`` (not a duplicate); a W3C traceparent on half of them."""
        envelope, favorite_id = self.envelope(*self.owner(kind), created_at)
        rng, topic = self._rng, self.topic()
        headers = ((("traceparent",
                     f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01".encode()),)
                   if rng.random() < 0.5 else ())
        return OutRecord(topic, favorite_id.encode(), orjson.dumps(envelope), headers,
                         favorite_id, kind)


def make_backlog(factory: EnvelopeFactory, count: int, rng: random.Random) -> Backlog:
    """A backlog of ``count`` records.

    1 % are exact re-sends of an earlier valid record (at a random later position), 0.5 %
    invalid owners, 0.5 % owners without a session, the rest valid.
    """
    duplicates, invalid = round(count * 0.01), round(count * 0.005)
    no_session = invalid
    originals = count - duplicates
    kinds = (["invalid-owner"] * invalid + ["no-session"] * no_session
             + ["valid"] * (originals - invalid - no_session))
    rng.shuffle(kinds)
    keyed = [(float(i), factory.record(kind)) for i, kind in enumerate(kinds)]
    valid = [i for i, kind in enumerate(kinds) if kind == "valid"]
    for _ in range(duplicates):
        at = rng.choice(valid)
        src = keyed[at][1]
        keyed.append((rng.uniform(at + 0.5, originals), OutRecord(
            src.topic, src.key, src.value, src.headers, src.favorite_id, "duplicate")))
    keyed.sort(key=lambda kv: kv[0])
    return Backlog([r for _, r in keyed], factory.removed_topic)


def producer(bootstrap: str, **overrides: Any) -> Producer:
    """A throughput-oriented producer (acks=all, idempotent, lz4, large batches)."""
    return Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                     "linger.ms": 20, "batch.num.messages": 10_000, "compression.type": "lz4",
                     "queue.buffering.max.messages": 1_000_000,
                     "queue.buffering.max.kbytes": 1_048_576, **overrides})


def produce_all(bootstrap: str, records: Iterable[OutRecord]) -> None:
    """Produce ``records``; raises unless every one is acknowledged."""
    prod, errors = producer(bootstrap), []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    for count, r in enumerate(records, 1):
        while True:
            try:
                prod.produce(r.topic, r.value, r.key, headers=list(r.headers),
                             on_delivery=on_delivery)
                break
            except BufferError:
                prod.poll(0.05)
        if count % 10_000 == 0:
            prod.poll(0)
    if (remaining := prod.flush(120)) or errors:
        raise RuntimeError(f"produce failed: {remaining} undelivered, errors {errors[:3]}")


_UUID7 = ("(lpad(to_hex({ms}), 12, '0') || '7' || substr({h}, 1, 3) || '8'"
          " || substr({h}, 4, 15))::uuid")
_PREFILL = f"""
WITH s AS (SELECT row_number() OVER (ORDER BY id) AS rn, id, anonymous_id, user_id
             FROM user_activity.sessions),
g AS (SELECT i, %(base_ms)s::bigint + i * %(step_ms)s::bigint AS ms, md5(i::text || 'e') AS he,
             md5(i::text || 'm') AS hm, 1 + (i * 7919) %% %(sessions)s AS rn
        FROM generate_series(%(start)s::bigint, %(stop)s::bigint) AS i)
INSERT INTO user_activity.action_events
       (id, action_type, session_id, anonymous_id, user_id, occurred_at, property_object_id,
        favorite_id, source_message_id, recorded_at)
SELECT {_UUID7.format(ms="g.ms", h="g.he")},
       CASE WHEN g.i %% 5 = 0 THEN 'RemoveFromFavorites' ELSE 'AddToFavorites' END,
       s.id, s.anonymous_id, s.user_id, to_timestamp(g.ms / 1000.0), md5(g.i::text || 'p')::uuid,
       md5(g.i::text || 'f')::uuid, {_UUID7.format(ms="g.ms", h="g.hm")},
       to_timestamp(g.ms / 1000.0)
  FROM g JOIN s ON s.rn = g.rn
"""
_MARKS = """
INSERT INTO user_activity.consumer_idempotency_marks (key, processed_at)
SELECT 'user-activity-favorites:' || action_type || ':' || source_message_id, recorded_at
  FROM user_activity.action_events
"""


def prefill(url: str, sessions: Sequence[Session], rows: int, log: Callable[[str], None],
            chunk: int = 500_000) -> dict[str, Any]:
    """Seed ``sessions`` and ``rows`` action_events (+ marks) into the migrated ``url``."""
    result: dict[str, Any] = {"sessions": len(sessions), "rows": rows}

    def timed(name: str, *statements: str) -> None:
        t0 = time.monotonic()
        for statement in statements:
            conn.execute(statement)
        result[name] = round(time.monotonic() - t0, 2)

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET maintenance_work_mem = '256MB'")
        t0 = time.monotonic()
        seed_sessions(conn, sessions)
        result["seed_sessions_s"] = round(time.monotonic() - t0, 2)
        t0, span = time.monotonic(), 30 * 86_400_000
        base, step = int(time.time() * 1000) - span - 60_000, max(1, span // max(rows, 1))
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            conn.execute(_PREFILL, {"base_ms": base, "step_ms": step, "sessions": len(sessions),
                                    "start": start + 1, "stop": stop})
            log(f"  prefill: {stop:,}/{rows:,} action_events rows ({time.monotonic() - t0:.0f}s)")
        result["action_events_s"] = round(time.monotonic() - t0, 2)
        timed("idempotency_marks_s", _MARKS)
        timed("vacuum_analyze_checkpoint_s", "VACUUM (ANALYZE)", "CHECKPOINT")
        row = conn.execute("SELECT (SELECT count(*) FROM user_activity.action_events),"
                           " pg_database_size(current_database())").fetchone()
        assert row is not None
        result["action_events_rows"], result["database_mb"] = int(row[0]), round(row[1] / 2**20, 1)
    return result
