"""The fast path: the transactions this process's sinks committed, sent from memory.

A sink offers each committed transaction's outbox rows, all of them, with its txid; the lease
holder sends them from memory in one Kafka transaction, so no row is read back. The queue is
bounded and never blocks a sink: an offer that does not fit is dropped. An offer is ordered
when a later row may share a key with its rows (a session's events): it never overtakes an
earlier transaction's rows. One whose every key is its own row's (an action's announcement)
may. So the fast path falls *behind* when an offer was dropped, a transaction of it failed, a
held topic's row was offered, or the lease was taken: from then on its ordered offers are left
to the window until a window has read everything committed by then (:meth:`FastPath.caught_up`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass

from schemas.outbox import OutboxRow
from sinks.outbox.progress import Progress
from sinks.outbox.sending import Sender

QUEUED_OFFERS = 64
_TRANSACTION_ROWS = 5_000  # rows of offers in one transaction at most (the rest: the next one)


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



def sendable(offers: Sequence[Offer], progress: Progress, *, behind: bool,
             held: Container[str]) -> tuple[list[Offer], bool]:
    """The offers to send now, and whether any other is left to the window.

    An offer the progress covers was sent already (by a window that read its rows, or by this
    path before a restart) and is neither. An ordered one waits while the fast path is
    ``behind`` or a window is under way; one with a ``held`` topic's row always waits.
    """
    waiting = behind or progress.target is not None
    fresh = [o for o in offers if not progress.covers(o.txid)]
    send = [o for o in fresh if not (o.ordered and waiting)
            and not any(row.topic in held for row in o.rows)]
    return send, len(send) < len(fresh)


class FastPath:
    """The lease holder's fast path (module doc)."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self._offers = Offers()
        self._behind_since: float | None = None

    def put(self, offer: Offer) -> None:
        """From a sink's thread: queue ``offer`` (never blocks)."""
        self._offers.put(offer)

    @property
    def behind(self) -> bool:
        """True while ordered offers wait for a window up to now (module doc)."""
        return self._behind_since is not None

    def restart(self) -> None:
        """The lease was taken: what was offered meanwhile is the window's."""
        self._behind_since = time.monotonic()
        self._offers.take()

    def caught_up(self, taken_at: float) -> None:
        """A window read all committed by ``taken_at``: caught up if it fell behind before."""
        if self._behind_since is not None and self._behind_since <= taken_at:
            self._behind_since = None

    def send(self) -> int:
        """Send the offered transactions in one Kafka transaction; how many rows went out."""
        offers, dropped = self._offers.take(_TRANSACTION_ROWS)
        if dropped is not None:
            self._fall_behind(dropped)
        progress = self._sender.progress
        assert progress is not None
        chosen, left = sendable(offers, progress, behind=self.behind, held=self._sender.held)
        if left:
            self._fall_behind(time.monotonic())
        if not chosen:
            return 0
        rows = [row for offer in chosen for row in offer.rows]
        attempt = self._sender.commit(rows, progress.with_sent(o.txid for o in chosen))
        if not attempt.committed:
            self._fall_behind(time.monotonic())  # the window parks or holds what was refused
            return 0
        return len(rows)

    def _fall_behind(self, since: float) -> None:
        self._behind_since = max(since, self._behind_since or since)
