"""One device's sign-ins applied in SignedInAt order: an event-time reorder buffer (issue 14).

A device's pending sign-ins are released in SignedInAt order once the device's watermark (its
latest SignedInAt seen, advanced by the wall clock since) minus the lateness ``L``
(``USER_ACTIVITY_SESSION_LINKING_LATENESS_SECONDS``) has passed them: sign-ins of one device
arriving within ``L`` of each other are applied in the order they happened; a later one is
decided by the database (``late-conflict``). The step is keyed by the device's shard; at most
``max_pending`` sign-ins a shard are held, over it the devices due first are released early
(``user_activity_session_linking_released_early_total``). Pending sign-ins are the key's
snapshotted state: a crash or a stop loses none; a bounded run applies them at its end.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from bytewax.operators import StatefulBatchLogic

from dataflows.session_linking.decode import SignInMessage
from runtime.metrics import SESSION_LINKING_RELEASED_EARLY


@dataclass(frozen=True)
class ReorderState:
    """A device's sign-ins (in SignedInAt order) and its watermark as of wall time ``at``."""

    pending: tuple[SignInMessage, ...]
    watermark: float
    at: float


class ReorderBuffer:
    """The pure buffer of one device (see the module doc); times are epoch seconds."""

    def __init__(self, lateness: float, state: ReorderState | None = None,
                 now: float | None = None) -> None:
        """Restored from ``state``; the watermark stood still while the job was down (``now``)."""
        self._lateness = lateness
        self._pending: list[SignInMessage] = list(state.pending) if state else []
        self._watermark = state.watermark if state else float("-inf")
        # restored at ``now``: the watermark goes on from where the last newest sign-in set it
        self._at = (state.at if now is None else now) if state else 0.0

    def watermark(self, now: float | None) -> float:
        """The device's watermark at wall time ``now`` (None: in event time only)."""
        return self._watermark if now is None else self._watermark + max(0.0, now - self._at)

    def add(self, messages: list[SignInMessage], now: float,
            reading: bool = False) -> list[SignInMessage]:
        """Take ``messages``; return those now due, in order (``reading``: event time only)."""
        for message in messages:
            moment = message.signed_in_at.timestamp()
            if moment > self.watermark(now):
                self._watermark, self._at = moment, now
            self._pending.append(message)
        self._pending.sort(key=_order)
        return self.release(now, reading)

    def release(self, now: float, reading: bool = False) -> list[SignInMessage]:
        """The pending sign-ins due at ``now`` (at or before watermark - lateness), in order."""
        horizon = self.watermark(None if reading else now) - self._lateness
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


@dataclass(frozen=True)
class ShardReorderState:
    """A shard's devices with sign-ins pending."""

    devices: dict[str, ReorderState]


class ShardReorder:
    """The buffers of one shard's devices with sign-ins pending (pure; epoch seconds).

    An emptied buffer is dropped with its watermark. Over ``max_pending`` sign-ins, the devices
    due first are released whole, early.
    """

    def __init__(self, lateness: float, max_pending: int,
                 state: ShardReorderState | None = None, now: float | None = None) -> None:
        self._lateness = lateness
        self._max_pending = max_pending
        self._buffers: dict[str, ReorderBuffer] = {}
        self._due: list[tuple[float, str]] = []  # (due, device) per change; stale ones skipped
        self._pending = 0
        self.released_early = 0
        for device, device_state in (state.devices if state else {}).items():
            buffer = ReorderBuffer(lateness, device_state, now=now)
            self._buffers[device] = buffer
            self._pending += len(buffer)
            self._schedule(device, buffer)

    def add(self, messages: list[SignInMessage], now: float,
            reading: bool = False) -> list[SignInMessage]:
        """Take ``messages``; return those now due (and released early), in order per device."""
        by_device: dict[str, list[SignInMessage]] = {}
        for message in messages:
            by_device.setdefault(str(message.anonymous_id), []).append(message)
        released: list[SignInMessage] = []
        for device, added in by_device.items():
            buffer = self._buffers.get(device)
            if buffer is None:
                buffer = self._buffers[device] = ReorderBuffer(self._lateness)
            before = len(buffer)
            released += buffer.add(added, now, reading)
            self._settle(device, buffer, before)
        while self._pending > self._max_pending:
            released += self._release_first_due_early()
        return released

    def release(self, now: float, reading: bool = False) -> list[SignInMessage]:
        """The pending sign-ins due at ``now``, in order per device (none while ``reading``)."""
        released: list[SignInMessage] = []
        while not reading and self._due and self._due[0][0] <= now:
            _, device = entry = heapq.heappop(self._due)
            buffer = self._current(*entry)
            if buffer is None:
                continue
            before = len(buffer)
            released += buffer.release(now)
            self._settle(device, buffer, before)
        return released

    def flush(self) -> list[SignInMessage]:
        """Everything pending, in order per device (the input ended)."""
        released = [m for buffer in self._buffers.values() for m in buffer.flush()]
        self._buffers.clear()
        self._due.clear()
        self._pending = 0
        return released

    def next_release_at(self) -> float | None:
        """Wall time the first pending sign-in of the shard becomes due, or None."""
        while self._due:
            if self._current(*self._due[0]) is not None:
                return self._due[0][0]
            heapq.heappop(self._due)
        return None

    def __len__(self) -> int:
        return self._pending

    def snapshot(self) -> ShardReorderState:
        """The state to resume from."""
        return ShardReorderState({d: b.snapshot() for d, b in self._buffers.items()})

    def _settle(self, device: str, buffer: ReorderBuffer, before: int) -> None:
        self._pending += len(buffer) - before
        if len(buffer) == 0:
            del self._buffers[device]
        else:
            self._schedule(device, buffer)

    def _current(self, due: float, device: str) -> ReorderBuffer | None:
        """``device``'s buffer if the heap entry ``(due, device)`` is not stale, else None."""
        buffer = self._buffers.get(device)
        return buffer if buffer is not None and buffer.next_release_at() == due else None

    def _schedule(self, device: str, buffer: ReorderBuffer) -> None:
        due = buffer.next_release_at()
        if due is not None:
            heapq.heappush(self._due, (due, device))

    def _release_first_due_early(self) -> list[SignInMessage]:
        while self._due:
            _, device = entry = heapq.heappop(self._due)
            buffer = self._current(*entry)
            if buffer is None:
                continue
            released = buffer.flush()
            self._pending -= len(released)
            self.released_early += len(released)
            del self._buffers[device]
            return released
        return []  # unreachable while anything is pending: every buffer has a current entry


class ReorderLogic(
    StatefulBatchLogic[SignInMessage, SignInMessage, ShardReorderState | ReorderState]
):
    """The ``reorder_by_signed_in_at`` step of one device shard.

    ``flush_on_eof``: apply what is pending when the input ends (a bounded run). A state of one
    device (from a store keyed by device) is restored as a shard holding only that device.
    """

    def __init__(self, lateness: float, state: ShardReorderState | ReorderState | None, *,
                 flush_on_eof: bool, max_pending: int,
                 reading: Callable[[], bool] = lambda: False) -> None:
        self._reading = reading
        if isinstance(state, ReorderState):
            pending = state.pending
            state = ShardReorderState({str(pending[0].anonymous_id): state} if pending else {})
        self._shard = ShardReorder(lateness, max_pending, state, now=time.time())
        self._flush_on_eof = flush_on_eof

    def on_batch(self, values: list[SignInMessage]) -> tuple[list[SignInMessage], bool]:
        """Buffer the shard's new sign-ins, release those due (and any released early)."""
        early = self._shard.released_early
        released = self._shard.add(values, time.time(), self._reading())
        if self._shard.released_early > early:
            SESSION_LINKING_RELEASED_EARLY.inc(self._shard.released_early - early)
        return released, len(self._shard) == 0

    def on_notify(self) -> tuple[list[SignInMessage], bool]:
        """Release what became due while the input was idle."""
        released = self._shard.release(time.time(), self._reading())
        return released, len(self._shard) == 0

    def on_eof(self) -> tuple[list[SignInMessage], bool]:
        """A bounded run ends: apply what is pending, in order."""
        return (self._shard.flush(), True) if self._flush_on_eof else ([], len(self._shard) == 0)

    def notify_at(self) -> datetime | None:
        """When the first pending sign-in becomes due (reading a backlog: a second from now)."""
        due = self._shard.next_release_at()
        if due is None:
            return None
        if self._reading():
            due = max(due, time.time() + 1.0)
        return datetime.fromtimestamp(due, UTC)

    def snapshot(self) -> ShardReorderState:
        """The devices' pending sign-ins and watermarks."""
        return self._shard.snapshot()
