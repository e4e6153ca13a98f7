"""One device's sign-ins applied in SignedInAt order: an event-time reorder buffer (issue 14).

The user-signed-in topic is keyed by UserId upstream, so two users' sign-ins on one device can
arrive in either order. The flow keys sign-ins by device (AnonymousId) and holds each device's
pending ones here, released in ``SignedInAt`` order once the device's event-time watermark,
minus the allowed lateness ``L`` (``USER_ACTIVITY_SESSION_LINKING_LATENESS_SECONDS``, default
10 s), has passed them. The watermark is the latest SignedInAt seen for the device, advanced by
the wall clock since it was seen (so it moves on while the input is idle, and never goes back).

What that guarantees: a device's sign-in waits at least ``L`` (wall clock) after it became the
device's newest, so sign-ins of one device that arrive within ``L`` of each other are applied in
the order they happened; an older one arriving at once is released at once, before the newer.
What it costs: linking waits up to ``L`` (the newest sign-in of a device is applied ``L`` after it
arrived). A sign-in that comes later than that is decided by the database instead
(:func:`~dataflows.session_linking.linking.late_conflict`, the device's last applied SignedInAt).

The pending sign-ins are the key's state: snapshotted with the epoch, so a crash or a clean stop
loses none (a tailing job resumes them; a bounded run, which has no later epoch, applies what is
pending in order when its input ends).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from bytewax.operators import StatefulBatchLogic

from dataflows.session_linking.decode import SignInMessage


@dataclass(frozen=True)
class ReorderState:
    """A device's pending sign-ins (in SignedInAt order) and its watermark."""

    pending: tuple[SignInMessage, ...]
    watermark: float
    """Event time (epoch seconds) of the watermark as of ``at``."""
    at: float
    """Wall time (epoch seconds) the watermark was last set."""


class ReorderBuffer:
    """The pure buffer of one device (see the module doc); times are epoch seconds."""

    def __init__(
        self, lateness: float, state: ReorderState | None = None, now: float | None = None
    ) -> None:
        """A buffer restored from ``state`` at wall time ``now`` (default: the state's own).

        Restored after a restart, the watermark stands still while the job was down: it goes
        on from ``now``, so a pending sign-in still waits its lateness after the restart (the
        other user's sign-in may be on a partition read only after it).
        """
        self._lateness = lateness
        self._pending: list[SignInMessage] = list(state.pending) if state else []
        self._watermark = state.watermark if state else float("-inf")
        self._at = state.at if state else 0.0
        if state is not None and now is not None:
            self._at = now  # the watermark goes on from where the last newest sign-in set it

    def watermark(self, now: float) -> float:
        """The device's watermark at wall time ``now``."""
        return self._watermark + max(0.0, now - self._at)

    def add(self, messages: list[SignInMessage], now: float) -> list[SignInMessage]:
        """Take ``messages``; return the sign-ins now due, in SignedInAt order."""
        for message in messages:
            moment = message.signed_in_at.timestamp()
            if moment > self.watermark(now):
                self._watermark, self._at = moment, now
            self._pending.append(message)
        self._pending.sort(key=_order)
        return self.release(now)

    def release(self, now: float) -> list[SignInMessage]:
        """The pending sign-ins due at ``now`` (at or before watermark - lateness), in order."""
        horizon = self.watermark(now) - self._lateness
        due = 0
        while due < len(self._pending) and self._pending[due].signed_in_at.timestamp() <= horizon:
            due += 1
        released, self._pending = self._pending[:due], self._pending[due:]
        return released

    def flush(self) -> list[SignInMessage]:
        """Everything pending, in order (the input ended)."""
        released, self._pending = self._pending, []
        return released

    def next_release_at(self) -> float | None:
        """Wall time the first pending sign-in becomes due, or None."""
        if not self._pending:
            return None
        first = self._pending[0].signed_in_at.timestamp()
        return self._at + (first + self._lateness - self._watermark)

    def __len__(self) -> int:
        return len(self._pending)

    def snapshot(self) -> ReorderState:
        """The state to resume from."""
        return ReorderState(tuple(self._pending), self._watermark, self._at)


def _order(message: SignInMessage) -> tuple[datetime, str]:
    return (message.signed_in_at, str(message.message_id))


class ReorderLogic(StatefulBatchLogic[SignInMessage, SignInMessage, ReorderState]):
    """The ``reorder_by_signed_in_at`` step of one device (a Bytewax stateful batch logic).

    ``flush_on_eof``: apply what is pending when the input ends (a bounded run); a tailing job
    keeps it in its snapshot instead, for the next start.
    """

    def __init__(self, lateness: float, state: ReorderState | None, *, flush_on_eof: bool) -> None:
        self._buffer = ReorderBuffer(lateness, state, now=time.time())
        self._flush_on_eof = flush_on_eof

    def on_batch(self, values: list[SignInMessage]) -> tuple[list[SignInMessage], bool]:
        """Buffer the device's new sign-ins, release those due."""
        released = self._buffer.add(values, time.time())
        return released, len(self._buffer) == 0

    def on_notify(self) -> tuple[list[SignInMessage], bool]:
        """Release what became due while the input was idle."""
        released = self._buffer.release(time.time())
        return released, len(self._buffer) == 0

    def on_eof(self) -> tuple[list[SignInMessage], bool]:
        """A bounded run ends: apply what is pending, in order."""
        if self._flush_on_eof:
            return self._buffer.flush(), True
        return [], len(self._buffer) == 0

    def notify_at(self) -> datetime | None:
        """When the first pending sign-in becomes due."""
        due = self._buffer.next_release_at()
        return None if due is None else datetime.fromtimestamp(due, UTC)

    def snapshot(self) -> ReorderState:
        """The pending sign-ins and the watermark."""
        return self._buffer.snapshot()
