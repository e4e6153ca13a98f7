"""The in-memory dedup window of one owner (SPEC §4 step 3): an optimisation, not the authority.

The database (idempotency mark + unique ``source_message_id``) decides; this window only spares
it the obvious redeliveries. Ids expire ``ttl`` seconds (rounded up to a whole second) after
they were first seen, or earlier when the window holds ``max_ids`` (the oldest is forgotten for
each new one), so memory and snapshots stay bounded. After a restart the window is what its
last snapshot held. Packed: ids back to back in one ``bytearray``, expiries (whole seconds) in
an ``array('I')``, in insertion = expiry order; ``len(id) + 4`` bytes per id.
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_right

DedupState = tuple[bytes, bytes]
"""A snapshot ``(ids, expiries)``: the live ids of one width concatenated in expiry order, and
one little-endian uint32 per id (Unix seconds, non-decreasing)."""

INDEX_ABOVE = 1024  # above this many ids a window also keeps a hash index

_EXPIRY_TYPE = "I"
_UNKNOWN_WIDTH = -1  # an empty window's width until its first id
if array(_EXPIRY_TYPE).itemsize != 4 or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("DedupWindow needs a little-endian 4-byte array('I') (its snapshot format)")


class DedupWindow:
    """Ids seen for one owner, each remembered until its expiry.

    - ``admit`` of an id before its expiry ``ceil(now + ttl)`` returns False and does not
      extend it; expiries never go backwards (a clock going back keeps the latest one).
    - An id is forgotten when its expiry has come (at the next ``admit`` or ``evict``), or as
      the oldest beyond ``max_ids``, also in a restored state (counted in
      :attr:`forgotten_early`); nothing else is.
    - All ids of one window have one length; another raises ``ValueError``. ``now + ttl`` must
      fit a uint32 of seconds, else ``OverflowError``.

    Membership is a ``bytearray.find`` over the live records; above ``index_above`` ids an
    open-addressing hash index of record numbers is kept as well (rebuilt at compaction).
    """

    __slots__ = ("_exp", "_ids", "_index", "_index_above", "_max_ids", "_start", "_ttl", "_used",
                 "_width", "forgotten_early")

    def __init__(self, ttl: float, state: DedupState | None = None, *,
                 index_above: int = INDEX_ABOVE, max_ids: int | None = None) -> None:
        """Restored from ``state`` (a :meth:`snapshot`) if given; ``max_ids`` None: unbounded."""
        if max_ids is not None and max_ids < 1:
            raise ValueError(f"max_ids must be at least 1, not {max_ids}")
        self._ttl = ttl
        self._index_above = index_above
        self._max_ids = max_ids
        self.forgotten_early = 0  # ids forgotten before their expiry (the window was full)
        self._start = 0  # records [0, _start) are dead (evicted, not yet compacted away)
        self._index: array[int] | None = None  # slot -> record number + 1 (0 = empty)
        self._used = 0  # non-empty slots of _index (live and dead records)
        if state is None:
            self._width = _UNKNOWN_WIDTH  # fixed by the first id
            self._ids = bytearray()
            self._exp: array[int] = array(_EXPIRY_TYPE)
        else:
            self._width, self._ids, self._exp = _from_snapshot(state)
            if max_ids is not None and len(self) > max_ids:  # the bound was lowered
                self._forget_oldest(len(self) - max_ids)
        if len(self) > index_above and self._index is None:
            self._build_index()

    def admit(self, dedup_id: bytes, now: float) -> bool:
        """True (and remember it) if ``dedup_id`` was not seen within the window."""
        width = self._width
        if len(dedup_id) != width:
            width = self._first_width(dedup_id)
        if self._start < len(self._exp) and self._exp[self._start] <= now:
            self._trim(now)  # every remaining record is live from here on (may compact)
        exp = self._exp
        ids = self._ids
        index = self._index
        slot = 0
        if index is None:
            pos = ids.find(dedup_id, self._start * width)
            while pos >= 0:
                misaligned = pos % width
                if not misaligned:
                    return False
                pos = ids.find(dedup_id, pos - misaligned + width)
        else:
            start = self._start
            mask = len(index) - 1
            slot = hash(dedup_id) & mask
            while entry := index[slot]:
                record = entry - 1
                if record >= start and ids.startswith(dedup_id, record * width):
                    return False
                slot = (slot + 1) & mask
        expiry = math.ceil(now + self._ttl)
        if exp and exp[-1] > expiry:  # the clock went back: keep expiries non-decreasing
            expiry = exp[-1]
        record = len(exp)
        exp.append(expiry)
        ids += dedup_id
        if index is not None:
            index[slot] = record + 1
            self._used += 1
            if self._used * 4 > len(index) * 3:
                self._build_index()
        elif record + 1 - self._start > self._index_above:
            self._build_index()
        if self._max_ids is not None and record + 1 - self._start > self._max_ids:
            self._forget_oldest(1)
        return True

    def evict(self, now: float) -> None:
        """Forget every id whose expiry has passed (``expiry <= now``)."""
        if self._start < len(self._exp) and self._exp[self._start] <= now:
            self._trim(now)

    def next_expiry(self) -> float | None:
        """When the oldest id expires (None when empty)."""
        return float(self._exp[self._start]) if self._start < len(self._exp) else None

    def snapshot(self) -> DedupState:
        """The live ids and expiries as ``(bytes, bytes)`` (see :data:`DedupState`)."""
        start = self._start
        with memoryview(self._ids) as ids, memoryview(self._exp) as exp:
            live_ids = ids[start * self._width :].tobytes()
            return live_ids, exp[start:].tobytes()

    def __len__(self) -> int:
        """How many ids are remembered (including expired ones not evicted yet)."""
        return len(self._exp) - self._start

    def _first_width(self, dedup_id: bytes) -> int:
        if not dedup_id:
            raise ValueError("empty dedup id")
        if self._width != _UNKNOWN_WIDTH:
            raise ValueError(
                f"dedup id of {len(dedup_id)} bytes in a window of {self._width}-byte ids"
            )
        self._width = len(dedup_id)
        return self._width

    def _trim(self, now: float) -> None:
        self._drop_prefix(bisect_right(self._exp, now, self._start))  # expiries non-decreasing

    def _forget_oldest(self, count: int) -> None:
        self.forgotten_early += count
        self._drop_prefix(self._start + count)

    def _drop_prefix(self, start: int) -> None:
        """Records before ``start`` are dead; compact when more than half of them are."""
        exp = self._exp
        self._start = start
        if start * 2 <= len(exp):
            return
        live = len(exp) - start
        if live == 0:
            self._ids = bytearray()
            self._exp = array(_EXPIRY_TYPE)
        else:
            self._ids = self._ids[start * self._width :]
            self._exp = exp[start:]
        self._start = 0
        if self._index is not None:  # record numbers moved: rebuild, or drop when small
            if live * 2 < self._index_above:
                self._index = None
                self._used = 0
            else:
                self._build_index()

    def _build_index(self) -> None:
        start, end, width = self._start, len(self._exp), self._width
        live = end - start
        size = 8
        while size < live * 2:
            size *= 2
        index = array(_EXPIRY_TYPE, bytes(4 * size))
        mask = size - 1
        with memoryview(self._ids) as ids:
            for record in range(start, end):
                offset = record * width
                slot = hash(ids[offset : offset + width].tobytes()) & mask
                while index[slot]:
                    slot = (slot + 1) & mask
                index[slot] = record + 1
        self._index = index
        self._used = live


def _from_snapshot(state: DedupState) -> tuple[int, bytearray, array[int]]:
    ids, expiries = state
    if len(expiries) % 4:
        raise ValueError(f"dedup snapshot: {len(expiries)} bytes of expiries")
    exp = array(_EXPIRY_TYPE, expiries)
    if not exp:
        if ids:
            raise ValueError("dedup snapshot: ids without expiries")
        return _UNKNOWN_WIDTH, bytearray(), exp
    width, rest = divmod(len(ids), len(exp))
    if rest or not width:
        raise ValueError(f"dedup snapshot: {len(ids)} bytes of ids for {len(exp)} expiries")
    return width, bytearray(ids), exp

