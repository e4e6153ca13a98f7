"""The window: what the fast path did not send, read from the table and sent in order.

A window sends the rows of the transactions a ``target`` snapshot sees and the progress's
``delivered`` does not, a page at a time in ``(txid, id)`` order (:func:`~.table.read_page`),
each page with the progress up to its last row. It reads back only the rows of transactions
the fast path has not sent (``progress.sent``). Its target is the newest snapshot taken at
least ``outbox_fast_path_grace_seconds`` ago, so the rows this process's sinks are about to
offer are left to the fast path; the current snapshot while the fast path is behind. A window
longer than one slice (a backlog) goes on in the next cycle, and logs how it drains.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from runtime.logs import log_event
from runtime.metrics import OUTBOX_READ_BACK
from runtime.settings import Settings
from sinks.db import Connection
from sinks.outbox.progress import Progress, snapshot
from sinks.outbox.sending import Sender
from sinks.outbox.table import Key, current_snapshot, read_page, whole_rows

logger = logging.getLogger(__name__)

_DRAIN_LOG_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Target:
    """A snapshot a window reads up to, and when it was taken (monotonic seconds)."""

    snapshot: str
    taken_at: float


@dataclass
class _Drain:
    """A window longer than one slice under way: logged as it drains."""

    target: str
    began: float
    logged: float
    sent: int = 0


class Window:
    """The lease holder's windows (module doc)."""

    def __init__(self, settings: Settings, sender: Sender,
                 conn: Callable[[], Connection]) -> None:
        self._grace = settings.outbox_fast_path_grace_seconds
        self._page_rows = settings.outbox_batch_size
        self._sender = sender
        self._conn = conn
        self._snapshots: collections.deque[Target] = collections.deque()
        self._under_way: Target | None = None
        self._drain: _Drain | None = None

    def restart(self) -> None:
        """A new holder (or this one again): nothing known of earlier windows."""
        self._snapshots.clear()
        self._under_way = self._drain = None

    def target(self, *, behind: bool) -> Target | None:
        """The target of the next window (module doc); None: none is due yet.

        ``behind``: the fast path waits for a window up to now.
        """
        taken_at = time.monotonic()  # (before the query: a drop after it is not seen as read)
        current = Target(current_snapshot(self._conn()), taken_at)
        if behind or self._grace <= 0:
            self._snapshots.clear()  # older than what this window reads
            return current
        snapshots = self._snapshots
        snapshots.append(current)
        while len(snapshots) > 1 and taken_at - snapshots[1].taken_at >= self._grace:
            snapshots.popleft()
        oldest = snapshots[0]
        return oldest if taken_at - oldest.taken_at >= self._grace else None

    def send(self, target: Target, slice_seconds: float) -> tuple[int, Target | None]:
        """Send the window up to ``target`` (or the one under way) page by page.

        Returns the rows sent, and the target it read up to once it is done; None while it is
        under way: a page ended ``slice_seconds`` after the call (its progress committed).
        """
        began, sent = time.monotonic(), 0
        progress = self._sender.progress
        assert progress is not None
        if progress.target is not None:  # the window under way first
            under_way = self._under_way
            target = under_way if under_way is not None and \
                under_way.snapshot == progress.target else Target(progress.target, -1e18)
        if not snapshot(target.snapshot).sees_all_of(snapshot(progress.delivered)):
            self._snapshots.clear()  # taken before a window that read further: done already
            return 0, None
        while True:
            keys = read_page(self._conn(), progress, target.snapshot, self._page_rows)
            done = len(keys) < self._page_rows
            after = progress.window_done(target.snapshot) if done else \
                progress.window_until(target.snapshot, (keys[-1].txid, keys[-1].id))
            sent += self._send_page(keys, progress, after)
            progress = self._sender.progress
            assert progress is not None
            if done:
                self._under_way = None
                self._report_drain(target.snapshot, sent, done=True)
                return sent, target
            if time.monotonic() - began >= slice_seconds:
                self._under_way = target
                self._report_drain(target.snapshot, sent, done=False)
                return sent, None

    def _send_page(self, keys: list[Key], progress: Progress, after: Progress) -> int:
        """Read back the page's rows the fast path did not send; send them up to ``after``."""
        if not keys and after.sent == progress.sent and progress.target is None:
            self._sender.progress = after  # nothing in the window: nothing to record
            return 0
        todo = [key for key in keys if key.txid not in progress.sent]
        rows = whole_rows(self._conn(), todo)
        OUTBOX_READ_BACK.inc(len(rows))
        return self._sender.send([row for row in rows if not row.set_aside], after)

    def _report_drain(self, target: str, sent: int, *, done: bool) -> None:
        """A window longer than one slice logs how it drains (every 10 s, and its end)."""
        now, drain = time.monotonic(), self._drain
        if drain is None or drain.target != target:
            if done:
                return  # a window of one slice says nothing
            drain = self._drain = _Drain(target, now, now)
        drain.sent += sent
        rate = round(drain.sent / (now - drain.began)) if now > drain.began else None
        if done:
            self._drain = None
            log_event(logger, "outbox-drained", logging.INFO, sent=drain.sent,
                      seconds=round(now - drain.began, 1), rows_per_s=rate)
        elif now - drain.logged >= _DRAIN_LOG_SECONDS:
            drain.logged = now
            log_event(logger, "outbox-draining", logging.WARNING, sent=drain.sent, rows_per_s=rate)
