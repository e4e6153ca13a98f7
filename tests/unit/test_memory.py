"""runtime.memory: malloc_trim(0) once and periodically."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from runtime import memory
from runtime.memory import Trimmer, start_trimmer, trim_heap

glibc = pytest.mark.skipif(memory._malloc_trim() is None, reason="needs glibc malloc_trim")

# Frees 128 MB of 64 KiB chunks (below the mmap threshold: they live in the brk heap) except
# the last, which pins the heap's top so glibc cannot give any of it back by itself.
_FRAGMENTED_HEAP = """
import ctypes, sys
from runtime.memory import trim_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss_mb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

size = 64 * 1024
blocks = [libc.malloc(size) for _ in range(2048)]
for block in blocks:
    ctypes.memset(block, 1, size)
for block in blocks[:-1]:
    libc.free(block)
before = rss_mb()
released = trim_heap()
print(before, rss_mb(), released)
"""


@glibc
def test_trim_heap_returns_freed_pages_to_the_os() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True,
        timeout=60,
    ).stdout.split()
    before, after, released = float(out[0]), float(out[1]), out[2]
    assert released == "True"
    assert before - after > 100, (before, after)


@glibc
def test_trim_heap_is_a_bool_on_glibc() -> None:
    assert trim_heap() in (True, False)


def test_trimmer_calls_trim_every_interval_until_stopped() -> None:
    calls = threading.Semaphore(0)

    def trim() -> bool:
        calls.release()
        return True

    trimmer = Trimmer(0.01, trim).start()
    try:
        for _ in range(3):
            assert calls.acquire(timeout=5)
    finally:
        trimmer.stop()
    assert trimmer.calls >= 3
    assert trimmer.released == trimmer.calls
    assert not trimmer._thread.is_alive()


@pytest.mark.parametrize("outcome", [None, RuntimeError("boom")])
def test_trimmer_ends_when_unsupported_or_failing(outcome: BaseException | None) -> None:
    seen: list[int] = []

    def trim() -> bool | None:
        seen.append(1)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    trimmer = Trimmer(0.01, trim).start()
    trimmer._thread.join(5)
    assert not trimmer._thread.is_alive()  # stopped by itself, the process goes on
    assert seen == [1]


def test_trimmer_rejects_a_non_positive_interval() -> None:
    with pytest.raises(ValueError):
        Trimmer(0)


@glibc
def test_start_trimmer_starts_one_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_STARTED", None)
    assert start_trimmer(0) is None
    first = start_trimmer(3600)
    try:
        assert first is not None
        assert start_trimmer(1) is first
        assert first.interval == 3600
        time.sleep(0.01)
        assert first._thread.is_alive()
    finally:
        if first is not None:
            first.stop()


def test_start_trimmer_without_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_STARTED", None)
    monkeypatch.setattr(memory, "_TRIM", None)
    assert start_trimmer(30) is None
    assert trim_heap() is None
