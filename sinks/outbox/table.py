"""The outbox table in PostgreSQL: pages of committed rows, and the watermark cache.

Each ``user_activity.outbox`` row keeps ``txid``, the transaction that wrote it. A window is the
rows of the transactions a later snapshot ``target`` sees and the progress's ``delivered`` does
not, read in ``(txid, id)`` order a page at a time (:func:`read_page`). Sink transactions commit
in any order; a snapshot lists those still in progress, so none is skipped. ``outbox_watermark``
is a cache of a progress Kafka committed (:mod:`sinks.outbox.progress`): it may lag Kafka, never
lead it; the watchdog, retention and the operator commands read it. Its one UPDATE is
conditional on the generation the lease holder read, so a former holder cannot move it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID

from schemas.action_tracked import (
    action_tracked_key,
    action_tracked_value,
    rendered_created_at,
    with_offset,
)
from sinks.db import Connection
from sinks.outbox.progress import Progress
from sinks.outbox.sql import query

_MAX_UUID = UUID(int=(1 << 128) - 1)
_NO_ROW = (0, UUID(int=0))


class LeaseLostError(Exception):
    """The watermark was moved by someone else: this publisher no longer holds the lease."""


class Key(NamedTuple):
    """A committed outbox row's place in the stream."""

    txid: int
    id: UUID


class StoredRow(NamedTuple):
    """A committed outbox row, rendered (a thin action-tracked row's key and value too)."""

    txid: int
    id: UUID
    topic: str
    key: bytes | None
    value: bytes
    headers: dict[str, Any]
    created_at: datetime
    set_aside: bool
    """Parked or held already: never sent by a window."""


class Cache(NamedTuple):
    """``outbox_watermark`` as stored: a progress (without ``sent``), and its generation."""

    progress: Progress
    generation: int


def current_snapshot(conn: Connection) -> str:
    """``pg_current_snapshot()``: what has committed by now."""
    row = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
    assert row is not None
    return str(row[0])


def page_start(delivered: str, after: tuple[int, UUID]) -> tuple[int, UUID]:
    """The lower bound, in ``(txid, id)`` order, of a window's rows past ``delivered``'s xmax.

    The cursor ``after`` when it is past that xmax, else the last possible row before it (so
    ``(txid, id) > start`` is ``txid >= xmax``): the scan starts there, not at the cursor.
    """
    xmax = int(delivered.split(":")[1])
    return after if after[0] >= xmax else (xmax - 1, _MAX_UUID)


def read_page(conn: Connection, progress: Progress, target: str, limit: int) -> list[Key]:
    """The next ``limit`` rows of the window from ``progress`` to ``target``, as keys.

    Past the cursor when ``progress`` has a window under way (to this ``target``).
    """
    after = progress.after if progress.after is not None else _NO_ROW
    start = page_start(progress.delivered, after)
    return [Key(int(txid), row_id) for txid, row_id in conn.execute(query("page"), {
        "delivered": progress.delivered, "target": target, "after_txid": str(after[0]),
        "after_id": after[1], "start_txid": str(start[0]), "start_id": start[1], "limit": limit,
    }).fetchall()]


def whole_rows(conn: Connection, keys: Sequence[Key]) -> list[StoredRow]:
    """The rows of ``keys``, in that order, rendered; raises if one is missing.

    Only a published row's partition is ever dropped, so a missing row is an error.
    """
    if not keys:
        return []
    stored = conn.execute(query("rows"), {
        "txids": [str(k.txid) for k in keys], "ids": [k.id for k in keys]}).fetchall()
    if len(stored) != len(keys):
        raise RuntimeError(f"{len(keys) - len(stored)} outbox rows of the window are gone")
    created: dict[Any, str] = {}  # CreatedAt rendered once per batch of the writing sink
    return [_whole(row, created) for row in stored]


def _whole(row: tuple[Any, ...], created: dict[Any, str]) -> StoredRow:
    """A row of ``rows.sql``: a thin action-tracked row is rendered from its action."""
    (txid, row_id, topic, key, value, headers, created_at, set_aside, action_event_id,
     correlation_id, offset, found, action_type, session_id, anonymous_id, user_id,
     occurred_local, property_object_id, favorite_id) = row
    if value is None:
        if found is None:  # never: an action and its row commit together, neither is deleted
            raise RuntimeError(f"outbox row {row_id} names action {action_event_id}, which is"
                               " missing")
        created_text = created.get(created_at)
        if created_text is None:
            created_text = created[created_at] = rendered_created_at(created_at)
        key = action_tracked_key(action_event_id)
        value = action_tracked_value(
            row_id, created_text, action_event_id,
            None if correlation_id is None else bytes(correlation_id).decode(), action_type,
            session_id, anonymous_id, user_id, with_offset(occurred_local, offset),
            property_object_id, favorite_id)
    return StoredRow(int(txid), row_id, topic, None if key is None else bytes(key), bytes(value),
                     headers or {}, created_at, set_aside)


def read_cache(conn: Connection) -> Cache:
    """``outbox_watermark`` (raises if the migrations did not make its row)."""
    row = conn.execute(query("watermark")).fetchone()
    if row is None:
        raise RuntimeError("user_activity.outbox_watermark has no row: run the migrations")
    delivered, target, after_txid, after_id, generation = row
    after = None if after_txid is None else (int(after_txid), after_id)
    return Cache(Progress(delivered, target=target, after=after), generation)


def write_cache(conn: Connection, progress: Progress, generation: int) -> int:
    """Store ``progress`` (Kafka committed it) if the cache is still at ``generation``.

    Returns the next generation; raises :class:`LeaseLostError`, changing nothing, if another
    publisher moved it since.
    """
    after = progress.after
    updated = conn.execute(query("advance"), {
        "delivered": progress.delivered, "target": progress.target,
        "after_txid": None if after is None else str(after[0]),
        "after_id": None if after is None else after[1], "generation": generation}).rowcount
    if updated != 1:
        raise LeaseLostError("the outbox watermark was moved by another publisher")
    return generation + 1
