"""Rows set aside from the outbox's stream: parked (refused for good) and held (topic refused).

Parked (``outbox_parked``): the broker refused the record itself (confirmed by sending it alone);
kept until an operator requeues it (``user-activity outbox parked | requeue``). Held
(``outbox_held``): the broker refuses the row's topic, so that topic's rows wait there in order
(``seq``) while the other topics go on; each held topic is retried with back-off
(:class:`HeldTopics`). A row is set aside in PostgreSQL before the Kafka transaction whose
progress passes it commits; a window never sends a row set aside (``rows.sql``), so a crash in
between sends nothing twice. Held rows are deleted once a progress past their ``seq`` committed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID

from psycopg.types.json import Jsonb

from runtime.backoff import Backoff
from sinks.db import Connection
from sinks.outbox.sql import query


class HeldRow(NamedTuple):
    """A row of ``outbox_held``, in its topic's order."""

    seq: int
    id: UUID
    topic: str
    key: bytes | None
    value: bytes
    headers: dict[str, Any]
    created_at: datetime


class AsideRow(NamedTuple):
    """What setting a row aside keeps of it."""

    id: UUID
    topic: str
    key: bytes | None
    value: bytes
    headers: dict[str, Any]
    created_at: datetime


def set_aside(conn: Connection, how: str, rows: Sequence[tuple[AsideRow, str]]) -> None:
    """Park (``how`` "park") or hold for their topics ("hold") ``rows``, with their errors.

    One transaction. A row parked before gets attempts + 1; a row held already stays where it
    is; a held row parked leaves the held rows.
    """
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(query(how), [(r.id, r.topic, r.key, r.value, Jsonb(r.headers),
                                      r.created_at, error) for r, error in rows])
        if how == "park":
            cur.execute(query("unhold"), ([r.id for r, _ in rows],))


def held_topics(conn: Connection) -> list[str]:
    """The topics that have rows held back."""
    return [topic for (topic,) in conn.execute(query("held_topics")).fetchall()]


def held_rows(conn: Connection, topic: str, after: int, limit: int) -> list[HeldRow]:
    """The first ``limit`` held rows of ``topic`` after seq ``after``, in order."""
    return [HeldRow(*row) for row in conn.execute(query("held_page"), {
        "topic": topic, "after": after, "limit": limit}).fetchall()]


def forget_held(conn: Connection, held: Mapping[str, int]) -> None:
    """Held rows published (per topic, up to a seq Kafka committed) leave the side table."""
    for topic, seq in held.items():
        conn.execute(query("held_sent"), {"topic": topic, "seq": seq})


def requeue_parked(conn: Connection, ids: Sequence[UUID] | None) -> int:
    """Hold parked rows (all when ``ids`` is None) for the publisher to send; how many.

    Idempotent: a row already requeued or published is left alone.
    """
    return conn.execute(query("requeue"), {"ids": None if ids is None else list(ids)}).rowcount


def parked_rows(conn: Connection, limit: int = 100) -> list[tuple[Any, ...]]:
    """``(id, topic, attempts, last_error, parked_at, value size)`` of parked rows, oldest first."""
    return conn.execute(query("parked"), (limit,)).fetchall()


@dataclass
class _Hold:
    error: str
    attempts: int = 0
    due: float = 0.0


class HeldTopics:
    """The lease holder's held topics: the last error of each and when it is tried next."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
        self._topics: dict[str, _Hold] = {}

    def __contains__(self, topic: object) -> bool:
        return topic in self._topics

    def error(self, topic: str) -> str:
        """The last error ``topic`` was refused with."""
        return self._topics[topic].error

    def hold(self, topic: str, error: str) -> bool:
        """Hold ``topic`` back, first tried after one back-off delay; True if it was not held."""
        if topic in self._topics:
            return False
        self._topics[topic] = _Hold(error, due=time.monotonic() + self._backoff.delay(0))
        return True

    def known(self, topics: Iterable[str]) -> None:
        """Topics found held in the table (requeued rows, another holder's): tried at once."""
        for topic in topics:
            self._topics.setdefault(topic, _Hold("held"))

    def due(self, *, force: bool = False) -> list[str]:
        """The held topics to try now (all of them with ``force``)."""
        now = time.monotonic()
        return [topic for topic, hold in self._topics.items() if force or hold.due <= now]

    def failed(self, topic: str, error: str) -> float:
        """A try of ``topic`` failed with ``error``: the delay before the next one."""
        hold = self._topics[topic]
        delay = self._backoff.delay(hold.attempts)
        hold.attempts, hold.error, hold.due = hold.attempts + 1, error, time.monotonic() + delay
        return delay

    def sent(self, topic: str) -> None:
        """A try of ``topic`` delivered its rows: the next page goes at once."""
        self._topics[topic] = _Hold(self._topics[topic].error)

    def release(self, topic: str) -> None:
        """``topic`` has no held row left: its rows go with the others again."""
        self._topics.pop(topic, None)

    def clear(self) -> None:
        """Forget every topic (the lease was lost; the next holder reads them from the table)."""
        self._topics.clear()
