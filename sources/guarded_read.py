"""A partition whose starts keep dying is read through memory-capped child processes.

librdkafka decompresses a gzip, lz4 or snappy record batch whole, whatever it inflates to (a
gzip record of 990 MB fits a 1 MiB topic limit compressed). Such a batch kills the job (OOM,
or librdkafka's abort on a failed allocation) before any record of it reaches Python, so
nothing in the job can catch it; the next start resumes before it and dies again: a crash loop
on that partition, everything behind it waiting. (zstd is bounded per batch:
:mod:`sources.undecodable`.)

What breaks the loop:

- **Counting starts.** Each start of a partition records itself in the flow's consumer group,
  as the metadata of the committed offset (``ua-starts=N`` at the offset it resumes from:
  :func:`count_start`). A snapshot that moves the offset, and a clean stop, commit without it:
  the count goes back to nothing. So the count is the number of starts at this offset that
  ended neither by progress nor by a clean stop.
- **Guarded reading.** From the :data:`GUARD_AFTER_STARTS`-th such start, the partition does
  not join the worker's consumer: :class:`GuardedReader` reads it, up to the high watermark as
  of the start, through a child process (:mod:`sources.guarded_child`) that caps its own memory
  and fetches one batch at a time, and hands the records over. Then the partition joins the
  worker's consumer and reads on as usual.
- **Finding the batch.** A child that dies (killed, aborted, out of memory) died at or after
  the first offset it did not deliver. A new child that reads only the batch holding that
  offset tells which: it dies again (that batch is the bomb) or delivers it (the bomb is
  further; reading goes on). A fetch from any offset inside a batch gets the whole batch, so
  its end is found by probing later offsets (:func:`sources.undecodable.find_batch_end`).
  Its records are skipped, counted and logged (``input-records-undecodable``, as an
  undecodable zstd batch): they stay in the topic for a replay with more memory. Every other
  record is read, in order, once.

A child that gets nothing from the broker in time (Kafka down) is started again after a
back-off; nothing is skipped for it.
"""

from __future__ import annotations

import json
import logging
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from runtime.backoff import Backoff
from runtime.logs import log_event
from sources.guarded_child import NO_MEMORY, NO_PROGRESS
from sources.undecodable import find_batch_end

logger = logging.getLogger(__name__)

GUARD_AFTER_STARTS = 3
"""The start at one offset from which the partition is read guarded: two ended unclean."""

_STARTS = "ua-starts="


def start_count(metadata: str | None) -> int:
    """The starts recorded in a committed offset's metadata (0: none)."""
    if not metadata or not metadata.startswith(_STARTS):
        return 0
    count = metadata[len(_STARTS):]
    return int(count) if count.isdigit() else 0


def count_start(consumer: Consumer, topic: str, partition: int, offset: int) -> int:
    """Record one more start of ``topic[partition]`` at ``offset``; the starts there so far.

    The count is the committed metadata's, plus one, when the committed offset is ``offset``;
    else 1. Raises ``KafkaException`` when the group cannot be read within 2 s (the caller then
    reads as usual: the guard is for a partition that keeps dying, not for an outage). The new
    count is committed asynchronously: a start never waits on the group coordinator (on the
    main thread, a long wait would hold back a SIGTERM's handler); it is sent long before a
    bomb's fetch, inflated, kills the process.
    """
    committed = consumer.committed([TopicPartition(topic, partition)], timeout=2)[0]
    starts = (start_count(committed.metadata) if committed.offset == offset else 0) + 1
    consumer.commit(offsets=[TopicPartition(topic, partition, offset,
                                            metadata=f"{_STARTS}{starts}")],
                    asynchronous=True)
    return starts


Record = tuple[int, int | None, bytes | None, bytes | None, list[tuple[str, bytes | None]] | None]
"""What a child hands over: offset, CreateTime (ms), key, value, headers (None: unreadable)."""


_FRAMES_AHEAD = 8
"""Frames (one fetch each) read from a child and not yet taken, at most: when the job is slower
than the child, the child waits on its pipe instead of the backlog piling up in memory."""


class _Child:
    """One child process reading ``topic[partition]`` from ``offset``; its frames on a queue."""

    def __init__(self, order: dict[str, Any]) -> None:
        self.offset = order["offset"]
        self.single = order["single"]
        self.frames: queue.Queue[tuple[Any, ...]] = queue.Queue(_FRAMES_AHEAD)
        self._closed = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sources.guarded_child"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order).encode() + b"\n")
        self.proc.stdin.close()
        threading.Thread(target=self._pump, name="guarded-read", daemon=True).start()

    def _pump(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            try:
                frame = pickle.load(out)  # noqa: S301 - our own child's frames
            except (EOFError, pickle.UnpicklingError, OSError):
                break
            if not self._put(frame):
                return
        self._put(("exit", self.proc.wait()))

    def _put(self, frame: tuple[Any, ...]) -> bool:
        """Queue ``frame`` once there is room; False when the child was killed meanwhile."""
        while not self._closed.is_set():
            try:
                self.frames.put(frame, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def kill(self) -> None:
        self._closed.set()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def died(code: int) -> bool:
    """Whether a child's exit code says it could not hold what it read (not a broker outage)."""
    return code < 0 or code == NO_MEMORY


class GuardedReader:
    """Reads one partition from ``start`` to ``until`` through memory-capped children.

    :meth:`poll` never blocks for a fetch (it hands over what the child read so far), but
    finding a bomb's end runs one child per probed offset, on the caller's thread (a few
    seconds, once per bomb). ``skipped(first, end, reason)`` is told each skipped batch;
    ``undecodable(base, reason)`` is told a batch librdkafka refuses (zstd) and returns the
    offset to read on from, or None to try again later.
    """

    def __init__(self, config: Mapping[str, Any], topic: str, partition: int, *,
                 start: int, until: int, cap_bytes: int, backoff: Backoff,
                 skipped: Callable[[int, int, str], None],
                 undecodable: Callable[[int, str], int | None],
                 idle_timeout: float = 10.0) -> None:
        self._order: dict[str, Any] = {
            "config": dict(config), "topic": topic, "partition": partition,
            "cap_bytes": cap_bytes, "idle_timeout": idle_timeout}
        self._cap_mib = cap_bytes // 2**20
        self.next_offset = start
        self.until = until
        self._backoff = backoff
        self._skipped = skipped
        self._undecodable = undecodable
        self._attempts = 0
        self._resume_at = 0.0
        self._suspect = False  # the last child died: the next reads one batch (which one?)
        self._child: _Child | None = None

    @property
    def done(self) -> bool:
        """Whether the partition was read up to ``until``."""
        return self.next_offset >= self.until

    def _spawn(self, offset: int, *, single: bool, until: int | None = None) -> _Child:
        return _Child({**self._order, "offset": offset, "single": single,
                       "until": self.until if until is None else until})

    def poll(self, limit: int) -> list[Record]:
        """The records read since the last call (at most ``limit``), in offset order."""
        if self.done:
            return []
        child = self._child
        if child is None:
            if time.monotonic() < self._resume_at:
                return []
            try:
                child = self._child = self._spawn(self.next_offset, single=self._suspect)
            except OSError as exc:  # no process could be made (memory, limits): later
                self._later(f"cannot start a child: {exc}")
                return []
        records: list[Record] = []
        while len(records) < limit:
            try:
                frame = child.frames.get_nowait()
            except queue.Empty:
                break
            kind = frame[0]
            if kind == "records":
                records.extend(frame[1])
                self.next_offset = frame[1][-1][0] + 1
            elif kind == "passed":
                self.next_offset = max(self.next_offset, frame[1])
            elif kind == "undecodable":
                child.kill()
                self._child = None
                resumed = self._undecodable(frame[1], frame[2])
                if resumed is None:
                    self._later("the undecodable batch's end is not known yet")
                else:
                    self.next_offset = max(self.next_offset, resumed)
                break
            else:  # "exit"
                self._child = None
                self._exited(child, frame[1])
                break
        return records

    def _later(self, why: str) -> None:
        """Try again after a back-off; said at WARNING (nothing is skipped meanwhile)."""
        delay = self._backoff.delay(self._attempts)
        self._resume_at = time.monotonic() + delay
        self._attempts += 1
        log_event(logger, "input-guarded-read-retry", logging.WARNING,
                  topic=self._order["topic"], partition=self._order["partition"],
                  next_offset=self.next_offset, attempt=self._attempts, retry_in_s=round(delay, 1),
                  reason=why)

    def _exited(self, child: _Child, code: int) -> None:
        if code == 0:
            self._attempts = 0
            self._suspect = False
            return
        if not died(code):  # the broker gave nothing in time, or the child failed: try again
            self._later("no answer from the broker in time" if code == NO_PROGRESS
                        else f"the child exited with code {code}")
            return
        if not (child.single and self.next_offset == child.offset):
            self._suspect = True  # died at or after next_offset: one batch from there tells
            return
        # A child that read only the batch holding next_offset died of it: the bomb, unless a
        # child cannot live under the cap at all (then nothing may be skipped for it).
        try:
            if self._dies(self.next_offset, self.next_offset):  # a control: reads nothing
                self._later(f"a child cannot run within {self._cap_mib} MiB")
                return
            end = find_batch_end(self.next_offset, self.until,
                                 lambda offset: self._dies(offset, offset + 1))
        except _NoAnswerError:
            self._later("no answer from the broker in time")
            return
        self._skipped(self.next_offset, end, f"the batch could not be read within {self._cap_mib}"
                                             " MiB (a decompression bomb?)")
        self.next_offset = end
        self._suspect = False

    def _dies(self, offset: int, until: int) -> bool:
        """Whether a child reading the batch that holds ``offset`` dies of it.

        ``until`` at ``offset`` makes a control: the child only starts its client, so a death
        says that no child lives under the cap.
        """
        child = self._spawn(offset, single=True, until=until)
        while True:
            frame = child.frames.get()
            if frame[0] == "exit":
                code = frame[1]
                if died(code):
                    return True
                if code == 0:
                    return False
                raise _NoAnswerError(offset)
            if frame[0] in {"records", "passed", "undecodable"}:
                child.kill()
                return False

    def close(self) -> None:
        """Stop the child, if one runs."""
        if self._child is not None:
            self._child.kill()
            self._child = None


class _NoAnswerError(Exception):
    """A probe child got nothing from the broker in time."""


__all__ = ["GUARD_AFTER_STARTS", "GuardedReader", "count_start", "start_count"]
