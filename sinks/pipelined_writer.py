"""A background writer that overlaps a sink's database round trips with the Bytewax worker.

The worker thread ``submit``s batches and goes back to polling, decoding and deduplicating
while this writer's thread runs ``write`` (a transaction, which mostly waits on PostgreSQL with
the GIL released). Guarantees:

- Order: batches are written in submission order (FIFO), never concurrently with each other.
- Coalescing: batches queued while a write runs are merged into the next ``write`` call, up to
  ``max_batch`` items (a submitted batch is never split).
- Back-pressure: ``submit`` blocks while ``max_pending`` items are queued or being written (an
  outage that makes ``write`` retry forever therefore stops the worker, as a synchronous sink
  would). A batch larger than ``max_pending`` is accepted when nothing is pending.
- Barrier: ``wait_idle`` returns only once every item submitted before the call was written
  (``write`` returned). The sink calls it from ``snapshot()``, so Bytewax closes an epoch (and
  commits the input offsets of a recovery snapshot) only after that epoch's rows are committed.
- Failure: if ``write`` raises, the writer stops; the exception is re-raised, chained, by the
  next ``submit``, ``wait_idle`` or ``close``, which crashes the dataflow before the epoch's
  snapshot: nothing unwritten is ever acknowledged. Items queued behind it are dropped with the
  process and re-read from the last snapshot on restart.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class WriterFailedError(RuntimeError):
    """The background write raised; the writer has stopped (the cause is chained)."""


class PipelinedWriter(Generic[T]):
    """Writes submitted batches on one background thread, in order, with bounded lag."""

    def __init__(
        self,
        write: Callable[[list[T]], None],
        *,
        max_pending: int,
        max_batch: int,
        name: str,
    ) -> None:
        self._write = write
        self._max_pending = max(1, max_pending)
        self._max_batch = max(1, max_batch)
        self._queue: deque[list[T]] = deque()
        self._pending = 0  # items queued or being written
        self._failure: BaseException | None = None
        self._closing = False
        self._cond = threading.Condition()
        # A daemon: if Bytewax aborts without close(), unwritten items die with the process;
        # their offsets were never snapshotted, so a restart reads them again.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Items submitted and not yet written."""
        with self._cond:
            return self._pending

    def submit(self, items: list[T]) -> None:
        """Queue ``items`` for writing; block while the writer is ``max_pending`` items behind."""
        if not items:
            return
        with self._cond:
            while (
                self._failure is None
                and self._pending
                and self._pending + len(items) > self._max_pending
            ):
                self._cond.wait()
            self._raise_if_failed()
            if self._closing:
                raise WriterFailedError("submit after close")
            self._queue.append(items)
            self._pending += len(items)
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until everything submitted so far is written (raises if the writer failed)."""
        with self._cond:
            while self._pending and self._failure is None:
                self._cond.wait()
            self._raise_if_failed()

    def close(self) -> None:
        """Write what is pending, then stop the thread (raises if the writer failed)."""
        try:
            self.wait_idle()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WriterFailedError(
                f"background write failed: {type(self._failure).__name__}"
            ) from self._failure

    def _take(self) -> list[T] | None:
        """The next coalesced batch, or None once closing with nothing queued."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            batch = self._queue.popleft()
            while self._queue and len(batch) + len(self._queue[0]) <= self._max_batch:
                batch = batch + self._queue.popleft()
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            size = len(batch)
            try:
                self._write(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to the worker thread
                with self._cond:
                    self._failure = exc
                    self._cond.notify_all()
                return
            # Drop the written batch before waiting for the next: an idle writer must not keep
            # thousands of decoded messages alive (RSS after a burst).
            del batch
            with self._cond:
                self._pending -= size
                self._cond.notify_all()
