"""Memory and admit() cost of the packed dedup window against a plain dict window.

``python -m bench.dedup_memory [--ids N] [--owners K]`` fills one window per owner with ``N``
fresh 17-byte ids (``b"A"``/``b"R"`` + a random UUID) spread round-robin over ``K`` owners, as
the favorites job does, and prints:

- bytes per id held by the windows (``tracemalloc``: every Python allocation, containers and
  per-owner objects included, not the owner keys), and the process RSS growth per id;
- bytes per id of the snapshots (the in-memory snapshot values, and pickled, as Bytewax stores
  them in the recovery store);
- the cost of one ``admit`` of a fresh id and of a duplicate, and of a fresh id in one large
  window (the O(n) scan against the hash index), as ratios measured in this one process
  (best of several rounds: the machine is noisy, absolute timings are indicative only).

The dict baseline is the previous implementation (``dict[bytes, float]`` of id -> expiry,
insertion = expiry order), re-implemented here.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import time
import tracemalloc
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

from dataflows.dedup import DedupWindow

TTL = 86_400.0
NOW = 1_800_000_000.0


class DictWindow:
    """The previous window: a ``dict`` of id -> expiry (the baseline)."""

    __slots__ = ("_seen", "_ttl")

    def __init__(self, ttl: float, state: dict[bytes, float] | None = None) -> None:
        self._ttl = ttl
        self._seen: dict[bytes, float] = dict(state) if state else {}

    def admit(self, dedup_id: bytes, now: float) -> bool:
        """True (and remember it) if ``dedup_id`` was not seen within the window."""
        expiry = self._seen.get(dedup_id)
        if expiry is not None and expiry > now:
            return False
        if expiry is not None:
            del self._seen[dedup_id]
        self._seen[dedup_id] = now + self._ttl
        return True

    def snapshot(self) -> dict[bytes, float]:
        """A copy of the state."""
        return dict(self._seen)


class Window(Protocol):
    """What both windows offer."""

    def admit(self, dedup_id: bytes, now: float) -> bool:
        """True (and remember it) if ``dedup_id`` is new."""
        ...

    def snapshot(self) -> Any:
        """The state for recovery."""
        ...


Factory = Callable[[], Window]


def _ids(count: int) -> list[bytes]:
    return [(b"A" if i % 2 else b"R") + os.urandom(16) for i in range(count)]


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fill(factory: Factory, ids: list[bytes], owners: int) -> list[Window]:
    windows = [factory() for _ in range(owners)]
    for i, dedup_id in enumerate(ids):
        windows[i % owners].admit(dedup_id, NOW + i * 1e-3)
    return windows


def _traced(build: Callable[[], Any]) -> tuple[Any, int]:
    """What ``build`` returns and the bytes it holds (tracemalloc, after a collection)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        gc.collect()
        return built, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _snapshots(windows: list[Window]) -> list[Any]:
    return [window.snapshot() for window in windows]


def _admit_all(windows: list[Window], ids: Iterable[bytes], owners: int) -> None:
    for i, dedup_id in enumerate(ids):
        windows[i % owners].admit(dedup_id, NOW + 10.0)


def _fill_fresh(factory: Factory, blob: bytes, width: int, owners: int) -> list[Window]:
    """``_fill`` with a new ``bytes`` object per admitted id, as the job decodes each message."""
    windows = [factory() for _ in range(owners)]
    for i in range(len(blob) // width):
        windows[i % owners].admit(blob[i * width : (i + 1) * width], NOW + i * 1e-3)
    return windows


def memory(ids: list[bytes], owners: int, factories: dict[str, Factory]) -> None:
    n = len(ids)
    blob, width = b"".join(ids), len(ids[0])
    print(f"memory: {n:,} ids over {owners:,} owners ({n // owners} per owner; each window holds"
          " its own id objects, as in the job)")
    rss: dict[str, int] = {}
    kept: list[Any] = []
    for name, factory in factories.items():  # all kept alive: no reuse of freed memory
        gc.collect()
        rss0 = _rss()
        kept.append(_fill_fresh(factory, blob, width, owners))
        gc.collect()
        rss[name] = _rss() - rss0
    del kept
    for name, factory in factories.items():
        windows, traced = _traced(partial(_fill_fresh, factory, blob, width, owners))
        snapshots, snap_traced = _traced(partial(_snapshots, windows))
        pickled = sum(len(pickle.dumps(s, pickle.HIGHEST_PROTOCOL)) for s in snapshots)
        del windows, snapshots
        print(f"  {name:>6}: {traced / n:6.1f} B/id held (tracemalloc), {rss[name] / n:6.1f} B/id"
              f" RSS growth; snapshots {snap_traced / n:5.1f} B/id in memory, {pickled / n:5.1f}"
              " B/id pickled")


def admit_cost(ids: list[bytes], owners: int, factories: dict[str, Factory], rounds: int) -> None:
    n = len(ids)
    fresh = dict.fromkeys(factories, float("inf"))
    dup = dict.fromkeys(factories, float("inf"))
    for _ in range(rounds):  # the candidates alternate, so that noise hits both alike
        for name, factory in factories.items():
            t0 = time.perf_counter()
            windows = _fill(factory, ids, owners)
            fresh[name] = min(fresh[name], (time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            _admit_all(windows, ids, owners)
            dup[name] = min(dup[name], (time.perf_counter() - t0) / n)
            del windows
    base = next(iter(factories))
    print(f"admit() per call, {n // owners} ids per owner (best of {rounds}; ratio to {base}):")
    for name in factories:
        print(f"  {name:>6}: fresh {fresh[name] * 1e9:6.0f} ns ({fresh[name] / fresh[base]:.2f}x),"
              f" duplicate {dup[name] * 1e9:6.0f} ns ({dup[name] / dup[base]:.2f}x)")


def large_window(sizes: Iterable[int], rounds: int) -> None:
    """Fresh-id admit cost in ONE window holding ``size`` ids: scan vs index vs dict."""
    print("admit() of a fresh id into one window already holding N ids (ns per call):")
    print(f"  {'N':>7} {'dict':>7} {'scan':>8} {'index':>7}")
    probes = _ids(200)
    restorers: list[Callable[[Any], Window]] = [
        lambda state: DictWindow(TTL, state),
        lambda state: DedupWindow(TTL, state, index_above=1 << 30),  # never indexed
        lambda state: DedupWindow(TTL, state, index_above=0),  # always indexed
    ]
    for size in sizes:
        held = _ids(size)
        row = []
        for restore in restorers:
            full = restore(None)
            for dedup_id in held:
                full.admit(dedup_id, NOW)
            state = full.snapshot()
            best = float("inf")
            for _ in range(rounds):
                window = restore(state)  # a fresh copy: the probes are fresh ids each round
                t0 = time.perf_counter()
                for dedup_id in probes:
                    window.admit(dedup_id, NOW + 1.0)
                best = min(best, time.perf_counter() - t0)
            row.append(best / len(probes) * 1e9)
        print(f"  {size:>7,} {row[0]:7.0f} {row[1]:8.0f} {row[2]:7.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--owners", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    ids = _ids(args.ids)
    factories: dict[str, Factory] = {
        "dict": lambda: DictWindow(TTL),
        "packed": lambda: DedupWindow(TTL),
    }
    memory(ids, args.owners, factories)
    admit_cost(ids, args.owners, factories, args.rounds)
    large_window((100, 250, 500, 1_000, 10_000, 100_000), args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
