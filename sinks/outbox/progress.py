"""The outbox stream's progress: exactly which committed outbox rows are in Kafka.

A :class:`Progress` is a PostgreSQL snapshot ``delivered`` (every row of a transaction visible in
it is published, parked or held), the transactions past it that the fast path published whole
(``sent``), a window under way (rows of the transactions ``target`` adds, in ``(txid, id)`` order,
up to and including ``after``) and, per held topic, the last held row published (``held``). It is
the last record of every Kafka transaction of the stream: what Kafka committed is the truth, and
the publisher resumes exactly after it. Pure values; no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from uuid import UUID

import orjson

FORMAT = 1
"""The version of the encoded record; a record of another version is refused."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A parsed ``pg_snapshot`` (``xmin:xmax:xip,...``): which transactions it sees committed."""

    xmin: int
    xmax: int
    running: frozenset[int]

    def visible(self, txid: int) -> bool:
        """``pg_visible_in_snapshot(txid, self)`` for a committed ``txid``."""
        return txid < self.xmin or (txid < self.xmax and txid not in self.running)

    def sees_all_of(self, other: Snapshot) -> bool:
        """Every transaction ``other`` sees, this one sees too (it is not older)."""
        return self.xmax >= other.xmax and not any(other.visible(t) for t in self.running)


@functools.lru_cache(maxsize=64)
def snapshot(text: str) -> Snapshot:
    """``text`` (``xmin:xmax:xip,...``) parsed; raises ValueError if it is no snapshot."""
    xmin, xmax, xip = text.split(":")
    return Snapshot(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))


@dataclass(frozen=True, slots=True)
class Progress:
    """What the stream has published (module doc); every method returns a new value."""

    delivered: str
    sent: frozenset[int] = frozenset()
    target: str | None = None
    after: tuple[int, UUID] | None = None
    held: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.target is None) != (self.after is None):
            raise ValueError("a window under way has both a target and a cursor")

    def covers(self, txid: int) -> bool:
        """Whether transaction ``txid`` (committed) is published, or left to the window under way.

        An offered transaction that this answers True for is not sent from memory.
        """
        if txid in self.sent or snapshot(self.delivered).visible(txid):
            return True
        return self.target is not None and snapshot(self.target).visible(txid)

    def with_sent(self, txids: Iterable[int]) -> Progress:
        """The fast path published every row of ``txids`` (none of them covered)."""
        return replace(self, sent=self.sent | frozenset(txids))

    def window_until(self, target: str, after: tuple[int, UUID]) -> Progress:
        """A window ending at ``target`` has published its rows up to and including ``after``."""
        return replace(self, target=target, after=after)

    def window_done(self, target: str) -> Progress:
        """Every row of the window ending at ``target`` is out: ``target`` is delivered.

        ``sent`` keeps only the transactions ``target`` does not see (bounded by one window).
        """
        seen = snapshot(target)
        return replace(self, delivered=target, target=None, after=None,
                       sent=frozenset(t for t in self.sent if not seen.visible(t)))

    def with_held(self, topic: str, seq: int) -> Progress:
        """The held rows of ``topic`` up to ``seq`` are published."""
        return replace(self, held={**self.held, topic: seq})

    def without_held(self, topics: Iterable[str]) -> Progress:
        """``topics`` have no held row left: their entries go."""
        gone = set(topics)
        return replace(self, held={t: s for t, s in self.held.items() if t not in gone})

    def encode(self) -> bytes:
        """The progress record's value (JSON)."""
        return orjson.dumps({
            "format": FORMAT, "delivered": self.delivered, "sent": sorted(self.sent),
            "target": self.target,
            "after": None if self.after is None else [self.after[0], str(self.after[1])],
            "held": dict(sorted(self.held.items())),
        })

    @classmethod
    def decode(cls, value: bytes) -> Progress:
        """A progress record's value; raises ValueError if it is not one of this format."""
        try:
            doc: Any = orjson.loads(value)
            if doc.get("format") != FORMAT:
                raise ValueError(f"progress record of format {doc.get('format')!r}, not {FORMAT}")
            after = doc["after"]
            progress = cls(str(doc["delivered"]), frozenset(int(t) for t in doc["sent"]),
                           doc["target"], None if after is None else (int(after[0]),
                                                                      UUID(after[1])),
                           {str(t): int(s) for t, s in doc["held"].items()})
            snapshot(progress.delivered)
            if progress.target is not None:
                snapshot(progress.target)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise ValueError(f"not a progress record: {exc}") from exc
        return progress
