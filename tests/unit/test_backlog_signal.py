"""The backlog signal: some partition's last poll came back full."""

from __future__ import annotations

import threading

from runtime.backlog import BacklogSignal


def test_reading_while_some_partition_last_polled_full() -> None:
    signal = BacklogSignal()
    assert not signal.reading()

    signal.polled("a", 0, full=True)
    signal.polled("a", 1, full=True)
    signal.polled("a", 0, full=False)
    assert signal.reading()  # partition 1 still has more

    signal.polled("a", 1, full=False)
    assert not signal.reading()


def test_a_closed_partition_no_longer_counts() -> None:
    signal = BacklogSignal()
    signal.polled("b", 3, full=True)

    signal.closed("b", 3)

    assert not signal.reading()


def test_each_worker_thread_sees_only_its_own_polls() -> None:
    signal = BacklogSignal()
    signal.polled("c", 0, full=True)
    seen: list[bool] = []

    worker = threading.Thread(target=lambda: seen.append(signal.reading()))
    worker.start()
    worker.join()

    assert seen == [False]
    assert signal.reading()


def test_callbacks_run_once_when_the_thread_catches_up() -> None:
    signal = BacklogSignal()
    calls: list[str] = []
    signal.polled("d", 0, full=True)
    signal.polled("d", 1, full=True)
    signal.when_caught_up(lambda: calls.append("a"))

    signal.polled("d", 0, full=False)
    assert calls == []  # partition 1 is still behind
    signal.polled("d", 1, full=False)
    assert calls == ["a"]
    signal.polled("d", 1, full=False)
    assert calls == ["a"]  # once
