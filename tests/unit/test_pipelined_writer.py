"""The background writer behind the sinks: order, coalescing, back-pressure, barrier, failure."""

from __future__ import annotations

import threading
import time

import pytest

from sinks.pipelined_writer import PipelinedWriter, WriterFailedError


class Recorder:
    """A write function that records its calls and can be held or made to fail."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_on: int | None = None

    def __call__(self, batch: list[int]) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        if self.fail_on is not None and self.fail_on in batch:
            raise ValueError(f"cannot write {self.fail_on}")
        self.calls.append(batch)


def test_batches_are_written_in_order_and_wait_idle_is_a_barrier() -> None:
    rec = Recorder()
    writer = PipelinedWriter(rec, max_pending=1000, max_batch=1000, name="t")
    for i in range(50):
        writer.submit([2 * i, 2 * i + 1])
    writer.wait_idle()
    assert [x for call in rec.calls for x in call] == list(range(100))
    assert writer.pending == 0
    writer.close()


def test_queued_batches_are_coalesced_up_to_max_batch_and_never_split() -> None:
    rec = Recorder()
    rec.gate.clear()
    writer = PipelinedWriter(rec, max_pending=100, max_batch=5, name="t")
    writer.submit([0])
    assert rec.entered.wait(5)  # [0] is being written; the rest queue behind it
    writer.submit([1, 2])
    writer.submit([3, 4])
    writer.submit([5, 6, 7])
    writer.submit([8])
    rec.gate.set()
    writer.wait_idle()
    assert rec.calls == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]
    writer.close()


def test_submit_blocks_while_the_writer_is_max_pending_items_behind() -> None:
    rec = Recorder()
    rec.gate.clear()
    writer = PipelinedWriter(rec, max_pending=4, max_batch=100, name="t")
    writer.submit([0, 1, 2])
    assert rec.entered.wait(5)
    returned = threading.Event()

    def submit_more() -> None:
        writer.submit([3, 4])  # 3 pending + 2 > 4: must wait for the write
        returned.set()

    t = threading.Thread(target=submit_more)
    t.start()
    assert not returned.wait(0.3)
    assert writer.pending == 3
    rec.gate.set()
    assert returned.wait(5)
    t.join()
    writer.close()
    assert [x for call in rec.calls for x in call] == [0, 1, 2, 3, 4]


def test_a_batch_larger_than_max_pending_is_accepted_when_nothing_is_pending() -> None:
    rec = Recorder()
    writer = PipelinedWriter(rec, max_pending=2, max_batch=2, name="t")
    writer.submit(list(range(10)))
    writer.close()
    assert rec.calls == [list(range(10))]


def test_wait_idle_blocks_until_the_running_write_returned() -> None:
    rec = Recorder()
    rec.gate.clear()
    writer = PipelinedWriter(rec, max_pending=10, max_batch=10, name="t")
    writer.submit([1])
    assert rec.entered.wait(5)
    done = threading.Event()
    def wait_then_signal() -> None:
        writer.wait_idle()
        done.set()

    t = threading.Thread(target=wait_then_signal)
    t.start()
    assert not done.wait(0.3)
    assert rec.calls == []
    rec.gate.set()
    assert done.wait(5)
    assert rec.calls == [[1]]
    t.join()
    writer.close()


def test_a_failed_write_is_raised_by_the_next_call_and_stops_the_writer() -> None:
    rec = Recorder()
    rec.fail_on = 3
    writer = PipelinedWriter(rec, max_pending=100, max_batch=1, name="t")
    writer.submit([1])
    writer.submit([3])
    writer.submit([4])
    with pytest.raises(WriterFailedError) as info:
        writer.wait_idle()
    assert isinstance(info.value.__cause__, ValueError)
    assert rec.calls == [[1]]  # [4] is never written after the failure
    with pytest.raises(WriterFailedError):
        writer.submit([5])
    with pytest.raises(WriterFailedError):
        writer.close()


def test_a_submit_blocked_on_back_pressure_is_released_by_a_failure() -> None:
    rec = Recorder()
    rec.gate.clear()
    rec.fail_on = 0
    writer = PipelinedWriter(rec, max_pending=1, max_batch=1, name="t")
    writer.submit([0])
    assert rec.entered.wait(5)
    errors: list[BaseException] = []

    def submit_more() -> None:
        try:
            writer.submit([1])
        except WriterFailedError as exc:
            errors.append(exc)

    t = threading.Thread(target=submit_more)
    t.start()
    time.sleep(0.1)
    rec.gate.set()
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1
    with pytest.raises(WriterFailedError):
        writer.close()


def test_close_writes_everything_pending_then_stops_the_thread() -> None:
    rec = Recorder()
    writer = PipelinedWriter(rec, max_pending=1000, max_batch=3, name="t")
    for i in range(10):
        writer.submit([i])
    writer.close()
    assert [x for call in rec.calls for x in call] == list(range(10))
    assert not writer._thread.is_alive()
