"""The in-memory dedup window of one owner (SPEC §4 step 3): an optimisation, not the authority.

The database (idempotency mark + unique ``source_message_id``) decides; this window only spares
it the obvious redeliveries. Ids expire ``ttl`` seconds after they were first seen. State is a
plain ``dict`` of 17-byte ids to expiry times, small per owner, so a snapshot copies little.
"""

from __future__ import annotations


class DedupWindow:
    """Ids seen for one owner, each remembered until its expiry (insertion order = expiry order)."""

    __slots__ = ("_seen", "_ttl")

    def __init__(self, ttl: float, state: dict[bytes, float] | None = None) -> None:
        self._ttl = ttl
        self._seen: dict[bytes, float] = dict(state) if state else {}

    def admit(self, dedup_id: bytes, now: float) -> bool:
        """True (and remember it) if ``dedup_id`` was not seen within the window."""
        expiry = self._seen.get(dedup_id)
        if expiry is not None and expiry > now:
            return False
        if expiry is not None:
            del self._seen[dedup_id]  # re-insert at the end to keep expiry order
        self._seen[dedup_id] = now + self._ttl
        return True

    def evict(self, now: float) -> None:
        """Forget every id whose expiry has passed."""
        seen = self._seen
        while seen:
            first = next(iter(seen))
            if seen[first] > now:
                break
            del seen[first]

    def next_expiry(self) -> float | None:
        """When the oldest id expires (None when empty)."""
        for expiry in self._seen.values():
            return expiry
        return None

    def snapshot(self) -> dict[bytes, float]:
        """A copy of the state for recovery (a snapshot is never mutated afterwards)."""
        return dict(self._seen)

    def __len__(self) -> int:
        return len(self._seen)
