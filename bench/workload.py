"""Synthetic sessions and favorites envelopes (:mod:`devenv.harness.messages`) for a backlog.

Everything is generated from a seeded ``random.Random`` (fast: no ``uuid.uuid4()`` syscalls);
MessageIds are UUIDv7 (time-ordered, as our producers send them), other ids random v4.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from confluent_kafka import Producer

from devenv.harness.messages import favorite_envelope
from devenv.harness.sessions import Session

_MASK48 = (1 << 48) - 1


def uuid4_from(rng: random.Random) -> uuid.UUID:
    """A random version-4 UUID drawn from ``rng``."""
    return uuid.UUID(int=rng.getrandbits(128), version=4)


def uuid7_from(rng: random.Random, ms: int | None = None) -> uuid.UUID:
    """A UUIDv7 for unix time ``ms`` (now if None) with random bits from ``rng``."""
    ms = time.time_ns() // 1_000_000 if ms is None else ms
    return uuid.UUID(int=((ms & _MASK48) << 80) | (0x7 << 76) | (rng.getrandbits(12) << 64)
                     | (0b10 << 62) | rng.getrandbits(62))


def make_sessions(count: int, rng: random.Random, linked_share: float = 0.6) -> list[Session]:
    """``count`` Active sessions, ``linked_share`` of them linked to a user."""
    return [Session(uuid4_from(rng), uuid4_from(rng),
                    uuid4_from(rng) if rng.random() < linked_share else None)
            for _ in range(count)]


@dataclass(frozen=True, slots=True)
class OutRecord:
    """One record to produce, and what the job must do with it (``kind``)."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    favorite_id: str
    kind: str  # "valid" | "duplicate" | "invalid-owner" | "no-session"


@dataclass
class Backlog:
    """A generated backlog and what the job must do with it."""

    records: list[OutRecord] = field(default_factory=list)
    removed_topic: str = ""

    def count(self, kind: str) -> int:
        """How many records are of ``kind``."""
        return sum(1 for r in self.records if r.kind == kind)

    @property
    def expected_recorded(self) -> int:
        """Messages that must become one row and one action-tracked message each."""
        return self.count("valid")

    def summary(self) -> dict[str, int]:
        """The backlog's composition."""
        removed = sum(1 for r in self.records if r.topic == self.removed_topic)
        return {"messages": len(self.records), "added": len(self.records) - removed,
                "removed": removed, "duplicate_message_ids": self.count("duplicate"),
                "invalid_owner": self.count("invalid-owner"),
                "no_session": self.count("no-session"),
                "expected_recorded": self.expected_recorded}


class EnvelopeFactory:
    """Builds favorites envelopes for owners drawn from ``sessions``."""

    def __init__(
        self, sessions: Sequence[Session], rng: random.Random, added_topic: str,
        removed_topic: str, *, removed_share: float = 0.2, by_user_share: float = 0.3,
    ) -> None:
        self._sessions = sessions
        self._rng = rng
        self._added = added_topic
        self.removed_topic = removed_topic
        self._removed_share = removed_share
        self._by_user_share = by_user_share

    def owner(self, kind: str) -> tuple[uuid.UUID | None, uuid.UUID | None]:
        """(UserId, AnonymousId) for a message of ``kind``."""
        rng = self._rng
        if kind == "invalid-owner":
            if rng.random() < 0.5:
                return uuid4_from(rng), uuid4_from(rng)  # both set
            return None, None  # neither
        if kind == "no-session":
            return None, uuid4_from(rng)  # a device we never saw
        session = self._sessions[rng.randrange(len(self._sessions))]
        if session.user_id is not None and rng.random() < self._by_user_share:
            return session.user_id, None
        return None, session.anonymous_id

    def topic(self) -> str:
        """favorite-removed for ``removed_share`` of the messages, else favorite-added."""
        return self.removed_topic if self._rng.random() < self._removed_share else self._added

    def envelope(
        self, user_id: uuid.UUID | None, anonymous_id: uuid.UUID | None,
        created_at: datetime | None = None,
    ) -> tuple[dict[str, Any], str]:
        """An envelope (as a dict) and its FavoriteId."""
        rng = self._rng
        favorite_id = uuid4_from(rng)
        property_object_id = uuid4_from(rng)
        note = {"Note": "a private note that must never be stored"} if rng.random() < 0.1 else None
        envelope = favorite_envelope(
            message_id=uuid7_from(rng), favorite_id=favorite_id,
            property_object_id=property_object_id, user_id=user_id, anonymous_id=anonymous_id,
            created_at=created_at, correlation_id=f"corr-{rng.getrandbits(32):08x}",
            extra_payload=note,
        )
        return envelope, str(favorite_id)

    def headers(self) -> tuple[tuple[str, bytes], ...]:
        """A W3C traceparent on half of the messages."""
        if self._rng.random() < 0.5:
            trace = f"00-{self._rng.getrandbits(128):032x}-{self._rng.getrandbits(64):016x}-01"
            return (("traceparent", trace.encode()),)
        return ()

    def record(self, kind: str, created_at: datetime | None = None) -> OutRecord:
        """One record of ``kind`` (not a duplicate)."""
        user_id, anonymous_id = self.owner(kind)
        envelope, favorite_id = self.envelope(user_id, anonymous_id, created_at)
        return OutRecord(self.topic(), favorite_id.encode(), orjson.dumps(envelope),
                         self.headers(), favorite_id, kind)


def make_backlog(
    factory: EnvelopeFactory, count: int, rng: random.Random, *,
    duplicate_share: float = 0.01, invalid_share: float = 0.005, no_session_share: float = 0.005,
) -> Backlog:
    """A backlog of ``count`` records.

    ``duplicate_share`` are exact re-sends of earlier valid records (same key, value, topic),
    ``invalid_share`` invalid owners, ``no_session_share`` owners without a session, the rest
    valid. Duplicates come after their original, at a random later position.
    """
    duplicates = round(count * duplicate_share)
    invalid = round(count * invalid_share)
    no_session = round(count * no_session_share)
    originals = count - duplicates
    kinds = (["invalid-owner"] * invalid + ["no-session"] * no_session
             + ["valid"] * (originals - invalid - no_session))
    rng.shuffle(kinds)
    keyed = [(float(i), factory.record(kind)) for i, kind in enumerate(kinds)]
    valid_positions = [i for i, kind in enumerate(kinds) if kind == "valid"]
    for _ in range(duplicates):
        source_index = rng.choice(valid_positions)
        src = keyed[source_index][1]
        dup = OutRecord(src.topic, src.key, src.value, src.headers, src.favorite_id, "duplicate")
        keyed.append((rng.uniform(source_index + 0.5, originals), dup))
    keyed.sort(key=lambda kv: kv[0])
    return Backlog([r for _, r in keyed], factory.removed_topic)


def producer(bootstrap: str, **overrides: Any) -> Producer:
    """A throughput-oriented producer (acks=all, lz4, batches)."""
    return Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                     "linger.ms": 20, "batch.num.messages": 10_000, "compression.type": "lz4",
                     "queue.buffering.max.messages": 1_000_000,
                     "queue.buffering.max.kbytes": 1_048_576, **overrides})


def produce_all(bootstrap: str, records: Iterable[OutRecord]) -> int:
    """Produce ``records`` and fail unless every one is acknowledged; return the count."""
    prod = producer(bootstrap)
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    count = 0
    for r in records:
        while True:
            try:
                prod.produce(r.topic, r.value, r.key, headers=list(r.headers),
                             on_delivery=on_delivery)
                break
            except BufferError:
                prod.poll(0.05)
        count += 1
        if count % 10_000 == 0:
            prod.poll(0)
    remaining = prod.flush(120)
    if remaining or errors:
        raise RuntimeError(f"produce failed: {remaining} undelivered, errors {errors[:3]}")
    return count
