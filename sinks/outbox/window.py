"""The publication watermark: which committed outbox rows are published (migration 0006).

Each ``user_activity.outbox`` row keeps ``txid``, the transaction that wrote it; the one-row
``outbox_watermark`` keeps ``delivered``, a ``pg_current_snapshot()`` such that every committed
row whose txid is visible in it was acknowledged by the broker, parked or held. A window is the
rows visible in a later snapshot ``target`` and not in ``delivered``, read in ``(txid, id)`` order
a page at a time. The watermark moves by ONE UPDATE, conditional on the generation it was read
at, which also records a long window's progress (``target``, the last row sent): no write per
row. Sink transactions commit in any order; a snapshot lists those still in progress, so none is
skipped. A crash before the UPDATE leaves the rows after the watermark: sent again, never lost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from schemas.action_tracked import (
    action_tracked_key,
    action_tracked_value,
    rendered_created_at,
    with_offset,
)
from sinks.db import Connection
from sinks.outbox import parking
from sinks.outbox.sql import query

Row = tuple[Any, ...]
"""A whole outbox row: ``(txid, id, topic, key, value, headers, created_at)``."""

_NO_ROW = ("0", UUID(int=0))
_MAX_UUID = UUID(int=(1 << 128) - 1)


class LeaseLostError(Exception):
    """The watermark was moved by someone else: this publisher no longer holds the lease."""


@dataclass(frozen=True, slots=True)
class Window:
    """The watermark as read: the window (delivered, target] and the last row sent of it."""

    delivered: str
    target: str
    after: tuple[str, UUID]
    generation: int
    resumed: bool
    """A window of several pages was under way (its cursor ``after``)."""
    current: str
    """The current snapshot when it was read."""


def read_window(conn: Connection) -> Window:
    """The window to send: the one under way (from its cursor), else up to the current snapshot."""
    row = conn.execute(query("watermark")).fetchone()
    if row is None:
        raise RuntimeError("user_activity.outbox_watermark has no row: run the migrations")
    delivered, target, after_txid, after_id, generation, current = row
    if target is not None:
        return Window(delivered, target, (after_txid, after_id), generation, True, current)
    return Window(delivered, current, _NO_ROW, generation, False, current)


def page_start(delivered: str, after: tuple[str, UUID]) -> tuple[str, UUID]:
    """The lower bound, in ``(txid, id)`` order, of a window's rows past ``delivered``'s xmax.

    The cursor ``after`` when it is past that xmax, else the last possible row before it (so
    ``(txid, id) > start`` is ``txid >= xmax``): the scan starts there, not at the cursor.
    """
    xmax = int(delivered.split(":")[1])
    return after if int(after[0]) >= xmax else (str(xmax - 1), _MAX_UUID)


def read_page(conn: Connection, window: Window, after: tuple[str, UUID], limit: int
              ) -> list[tuple[Any, Any]]:
    """The next ``limit`` rows of ``window`` after ``after``, as ``(txid, id)`` pairs."""
    start = page_start(window.delivered, after)
    return conn.execute(query("page"), {
        "delivered": window.delivered, "target": window.target, "after_txid": after[0],
        "after_id": after[1], "start_txid": start[0], "start_id": start[1], "limit": limit,
    }).fetchall()


def whole_rows(conn: Connection, keys: Sequence[tuple[Any, Any]]) -> list[Row]:
    """The whole rows of ``keys`` (``(txid, id)`` pairs), in that order; a thin row rendered.

    A thin row's key and value are rendered from the action it announces; a missing row is an
    error (only a published row's partition is ever dropped).
    """
    if not keys:
        return []
    stored: list[Row] = conn.execute(query("rows"), {
        "txids": [str(k[0]) for k in keys], "ids": [k[1] for k in keys]}).fetchall()
    if len(stored) != len(keys):
        raise RuntimeError(f"{len(keys) - len(stored)} outbox rows of the window are gone")
    created: dict[Any, str] = {}  # CreatedAt rendered once per batch of the writing sink
    return [row[:7] if row[4] is not None else _rendered(row, created) for row in stored]


def _rendered(row: Row, created: dict[Any, str]) -> Row:
    """A thin action-tracked row of ``rows.sql`` as a whole row, its key and value rendered."""
    (txid, row_id, topic, _, _, headers, created_at, action_event_id, correlation_id, offset,
     found, action_type, session_id, anonymous_id, user_id, occurred_local, property_object_id,
     favorite_id) = row
    if found is None:  # never: an action and its outbox row commit together, neither is deleted
        raise RuntimeError(f"outbox row {row_id} names action {action_event_id}, which is missing")
    created_text = created.get(created_at)
    if created_text is None:
        created_text = created[created_at] = rendered_created_at(created_at)
    value = action_tracked_value(row_id, created_text, action_event_id,
                                 None if correlation_id is None else bytes(correlation_id).decode(),
                                 action_type, session_id, anonymous_id, user_id,
                                 with_offset(occurred_local, offset), property_object_id,
                                 favorite_id)
    return (txid, row_id, topic, action_tracked_key(action_event_id), value, headers, created_at)


def visible_in(snapshot: str) -> Callable[[Any], bool]:
    """``pg_visible_in_snapshot(txid, snapshot)`` for a committed txid (``xmin:xmax:xip,...``)."""
    xmin, xmax, xip = snapshot.split(":")
    low, high = int(xmin), int(xmax)
    running = frozenset(int(x) for x in xip.split(",") if x)

    def visible(txid: Any) -> bool:
        value = int(txid)
        return value < low or (value < high and value not in running)

    return visible


def advance(conn: Connection, window: Window, cursor: tuple[Any, Any] | None, generation: int, *,
            parked: Sequence[tuple[Row, str]] = (), held: Sequence[tuple[Row, str]] = ()) -> int:
    """Move the watermark past the window (``cursor`` None) or up to ``cursor``; the generation.

    ``parked`` and ``held`` are set aside in the same transaction. Raises
    :class:`LeaseLostError`, changing nothing, when another publisher moved it since ``generation``.
    """
    state: tuple[Any, ...] = (window.target, None, None, None)
    if cursor is not None:
        state = (window.delivered, window.target, str(cursor[0]), cursor[1])
    params = {"delivered": state[0], "target": state[1], "after_txid": state[2],
              "after_id": state[3], "generation": generation}
    with conn.transaction() if parked or held else contextlib.nullcontext(), conn.cursor() as cur:
        for how, rows in (("park", parked), ("hold", held)):
            if rows:
                parking.set_aside(cur, how, rows)
        if cur.execute(query("advance"), params).rowcount != 1:  # a transaction: all rolled back
            raise LeaseLostError("the outbox watermark was moved by another publisher")
    return generation + 1
