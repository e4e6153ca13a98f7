"""The fast path's input: the transactions this process's sinks committed, with their rows.

A sink offers each committed transaction's outbox rows, all of them, with its txid; the lease
holder publishes them from memory, so no row is read back. The queue is bounded and never blocks
a sink: an offer that does not fit is dropped, and the time of the drop tells the publisher to
read everything committed by then from the table before it sends an ordered offer from memory
again. An offer is ordered when a later row may share a key with its rows (a session's events):
it never overtakes an earlier transaction's rows. One whose every key is its own row's (an
action's announcement) may.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.outbox import OutboxRow

QUEUED_OFFERS = 64


@dataclass(frozen=True, slots=True)
class Offer:
    """Every outbox row transaction ``txid`` wrote (it committed)."""

    txid: int
    rows: Sequence[OutboxRow]
    ordered: bool = True


class Offers:
    """Offers from the sinks' threads to the publisher's thread (module doc)."""

    def __init__(self, limit: int = QUEUED_OFFERS) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._offers: list[Offer] = []
        self._dropped_at: float | None = None

    def put(self, offer: Offer) -> None:
        """Queue ``offer``, or drop it (and remember when) if the queue is full."""
        with self._lock:
            if len(self._offers) >= self._limit:
                self._dropped_at = time.monotonic()
            else:
                self._offers.append(offer)

    def take(self, rows: int | None = None) -> tuple[list[Offer], float | None]:
        """The queued offers in order, up to ``rows`` rows (one offer at least).

        And when an offer was last dropped since the last take (None: none was).
        """
        with self._lock:
            count, taken = 0, 0
            for offer in self._offers:
                if rows is not None and taken and count + len(offer.rows) > rows:
                    break
                count, taken = count + len(offer.rows), taken + 1
            offers, self._offers = self._offers[:taken], self._offers[taken:]
            dropped, self._dropped_at = self._dropped_at, None
        return offers, dropped

