"""The in-memory dedup window of one owner (SPEC §4 step 3): an optimisation, not the authority.

The database (idempotency mark + unique ``source_message_id``) decides; this window only spares
it the obvious redeliveries. Ids expire ``ttl`` seconds (rounded up to a whole second) after
they were first seen, or earlier when the window holds ``max_ids``: then the oldest id is
forgotten for each new one, so memory (and each snapshot) stays bounded whatever the input's
volume (a backfill, a replay, a day busier than the TTL was sized for). Across a restart the
window is what its last snapshot held: ids admitted after that snapshot are forgotten (their
redeliveries reach the database, which decides).

The window is packed, because the job holds about a million ids at once (24 h TTL): the ids
sit back to back in one ``bytearray`` of fixed-width records and their expiries, in whole
seconds, in an ``array('I')`` (uint32). Appending keeps insertion order, which is also expiry
order, so eviction only moves a start offset forward; the dead prefix is dropped once it is
more than half of the buffer (each record is copied O(1) times, amortised). A snapshot is two
``bytes`` objects.

Memory per id: ``width + 4`` bytes (21 for the favorites' 17-byte ids, 20 for the
session-linking 16-byte MessageIds) plus the containers' growth slack (at most about 12%), about
250 bytes per owner, and, for an owner above :data:`INDEX_ABOVE` ids only, 5 to 16 bytes per id
of hash index. Measured (1M ids over 10k owners; docs/performance.md): 24 bytes per
id held, 22 per id for a snapshot of every owner, 21 per id pickled; the previous
``dict[bytes, float]`` held 121 bytes per id (snapshots 47, pickled 29).
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_right

DedupState = tuple[bytes, bytes]
"""A snapshot: ``(ids, expiries)``. ``ids`` is the live ids concatenated in expiry order, all
of one width; ``expiries`` is one little-endian uint32 per id (Unix time in whole seconds),
non-decreasing. The width is ``len(ids) // (len(expiries) // 4)``."""

INDEX_ABOVE = 1024
"""Above this many ids an owner's window also keeps a hash index (see :class:`DedupWindow`)."""

_EXPIRY_TYPE = "I"
_UNKNOWN_WIDTH = -1  # an empty window's width until its first id
_BIG_ENDIAN = sys.byteorder == "big"

if array(_EXPIRY_TYPE).itemsize != 4:  # pragma: no cover - every supported platform
    raise ImportError("DedupWindow needs a 4-byte array('I')")


class DedupWindow:
    """Ids seen for one owner, each remembered until its expiry (insertion order = expiry order).

    Guarantees:

    - Remembered: every admitted id, until its expiry ``ceil(now + ttl)`` (Unix time in whole
      seconds, so up to one second longer than ``ttl``, never shorter). ``admit`` of an id
      before its expiry returns False and does not extend it; so an id is admitted at most
      once per ``ttl``. Expiries never go backwards: if the clock does, a new id gets the
      latest expiry already held (remembered a little longer, never shorter).
    - Forgotten: an id whose expiry has come (``now >= expiry``), at the next ``admit`` or
      ``evict``; it is then admitted again, with a fresh expiry. And the oldest ids beyond
      ``max_ids`` (when given): admitting an id to a full window forgets the oldest one at once,
      and a restored state larger than ``max_ids`` keeps its newest ``max_ids`` ids. Those are
      counted in :attr:`forgotten_early`. Nothing else is forgotten.
    - Ids are compared as exact bytes. All ids of one window have one length (fixed by the first
      id or by the restored state); another length raises ``ValueError``. ``now + ttl`` must
      fit a uint32 of seconds (until 2106), else ``OverflowError``.
    - Memory: ``len(id) + 4`` bytes per id plus growth slack (see the module docstring).
      Snapshots are immutable ``(bytes, bytes)`` of ``len(id) + 4`` bytes per id.

    Membership is a C-speed ``bytearray.find`` over the live records: O(n) in the window's
    bytes (about 0.3 ns per byte; 0.5 to 1 us for the typical ~100 ids of an owner), where a
    match not on a record boundary (an id whose bytes straddle two records) is skipped. The
    scan grows to about 4 us at 1k ids and 35 us at 10k, so above ``index_above`` live ids the
    window adds an open-addressing hash table of record numbers (``array('I')``, load factor
    at most 3/4, rebuilt at compaction, dropped again below half the threshold): about 1 us per
    admit at any size, 5 to 16 bytes per id.
    """

    __slots__ = ("_exp", "_ids", "_index", "_index_above", "_max_ids", "_start", "_ttl", "_used",
                 "_width", "forgotten_early")

    def __init__(
        self,
        ttl: float,
        state: DedupState | None = None,
        *,
        index_above: int = INDEX_ABOVE,
        max_ids: int | None = None,
    ) -> None:
        """A window remembering ids for ``ttl`` seconds, restored from ``state`` if given.

        ``state`` is a :meth:`snapshot` (copied). ``max_ids`` (at least 1): the most ids held;
        None: as many as arrive within the TTL.
        """
        if max_ids is not None and max_ids < 1:
            raise ValueError(f"max_ids must be at least 1, not {max_ids}")
        self._ttl = ttl
        self._index_above = index_above
        self._max_ids = max_ids
        self.forgotten_early = 0
        """How many ids were forgotten before their expiry because the window was full."""
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
        if self._start < len(self._exp):
            return float(self._exp[self._start])
        return None

    def snapshot(self) -> DedupState:
        """The live ids and expiries as ``(bytes, bytes)`` (see :data:`DedupState`)."""
        start = self._start
        with memoryview(self._ids) as ids, memoryview(self._exp) as exp:
            live_ids = ids[start * self._width :].tobytes()
            if _BIG_ENDIAN:  # pragma: no cover - the format is little-endian
                swapped = self._exp[start:]
                swapped.byteswap()
                return live_ids, swapped.tobytes()
            return live_ids, exp[start:].tobytes()

    def __len__(self) -> int:
        """How many ids are remembered (including expired ones not evicted yet)."""
        return len(self._exp) - self._start

    def _first_width(self, dedup_id: bytes) -> int:
        """Fix the width of an empty window to the first id's; refuse any other width."""
        if not dedup_id:
            raise ValueError("empty dedup id")
        if self._width != _UNKNOWN_WIDTH:
            raise ValueError(
                f"dedup id of {len(dedup_id)} bytes in a window of {self._width}-byte ids"
            )
        self._width = len(dedup_id)
        return self._width

    def _trim(self, now: float) -> None:
        """Drop the expired prefix; compact when more than half of the records are dead."""
        self._drop_prefix(bisect_right(self._exp, now, self._start))  # expiries non-decreasing

    def _forget_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest live ids before their expiry (the window is full)."""
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
        """(Re)build the hash index of the live records, at most half full."""
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
    if _BIG_ENDIAN:  # pragma: no cover - the format is little-endian
        exp.byteswap()
    if not exp:
        if ids:
            raise ValueError("dedup snapshot: ids without expiries")
        return _UNKNOWN_WIDTH, bytearray(), exp
    width, rest = divmod(len(ids), len(exp))
    if rest or not width:
        raise ValueError(f"dedup snapshot: {len(ids)} bytes of ids for {len(exp)} expiries")
    return width, bytearray(ids), exp

