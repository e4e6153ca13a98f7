"""In-process memory probe for the RSS investigation (bench only, never in production).

Loaded by putting ``bench/memprobe`` on ``PYTHONPATH`` with ``MEMPROBE_DIR`` set: a daemon
thread polls ``$MEMPROBE_DIR/<pid>.req`` every 0.2 s. The request is one command per line:

- ``stats``: writes ``<pid>.resp.json`` with VmRSS/RssAnon/RssFile, threads (by name),
  ``mallinfo2`` (glibc: in use, free, mmapped), ``malloc_info`` per arena, pymalloc
  (``sys._debugmallocstats``: arenas, bytes in used blocks), the largest anonymous mappings,
  Python object counts by type (gc-tracked);
- ``trim``: ``malloc_trim(0)`` (timed) then the same stats.

``MEMPROBE_TRIM_INTERVAL`` (seconds) additionally starts :func:`runtime.memory.start_trimmer`
at another interval than the job's own. (The patches that replayed the retention bugs fixed in
6a8a210, a batch kept by an idle writer thread and a closure cycle in the poison bisection, are
gone with them; ``bench/results-rss-probe.json`` keeps what they measured.)
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _main() -> None:
    probe_dir = os.environ.get("MEMPROBE_DIR")
    interval = os.environ.get("MEMPROBE_TRIM_INTERVAL")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if interval:
        sys.path.insert(0, root)
    if interval:
        from runtime.memory import start_trimmer

        start_trimmer(float(interval))
    if probe_dir:
        import threading

        threading.Thread(target=_serve, args=(probe_dir,), name="memprobe", daemon=True).start()


def _serve(probe_dir: str) -> None:
    import json
    import time

    pid = os.getpid()
    req = os.path.join(probe_dir, f"{pid}.req")
    while True:
        time.sleep(0.2)
        try:
            with open(req) as fh:
                commands = fh.read().split()
            os.unlink(req)
        except OSError:
            continue
        out: dict[str, object] = {}
        try:
            for command in commands:
                if command == "referrers":
                    out["referrers"] = _referrers()
                    continue
                if command == "collect":
                    import gc
                    import time as _time

                    before = _status()["VmRSS"]
                    t0 = _time.perf_counter()
                    unreachable = gc.collect()
                    out["collect"] = {"unreachable": unreachable,
                                      "ms": round((_time.perf_counter() - t0) * 1000, 1),
                                      "rss_before_mb": before, "rss_after_mb": _status()["VmRSS"]}
                if command == "trim":
                    out["trim"] = _trim()
                out["stats" if command == "stats" else f"stats_after_{command}"] = _stats()
        except Exception as exc:  # report, never kill the job
            out["error"] = repr(exc)
        tmp = os.path.join(probe_dir, f"{pid}.resp.tmp")
        with open(tmp, "w") as fh:
            json.dump(out, fh, indent=1)
        os.replace(tmp, os.path.join(probe_dir, f"{pid}.resp.json"))


def _libc():  # type: ignore[no-untyped-def]
    import ctypes

    return ctypes.CDLL("libc.so.6")


def _trim() -> dict[str, float]:
    import time

    before = _status()
    t0 = time.perf_counter()
    released = _libc().malloc_trim(0)
    elapsed = time.perf_counter() - t0
    after = _status()
    return {"ms": round(elapsed * 1000, 2), "released": released,
            "rss_before_mb": before["VmRSS"], "rss_after_mb": after["VmRSS"]}


def _status() -> dict[str, float]:
    found: dict[str, float] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM", "Threads", "VmSize"):
                parts = value.split()
                found[key] = round(int(parts[0]) / 1024, 1) if key != "Threads" else int(parts[0])
    return found


def _threads() -> dict[str, int]:
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items(), key=lambda kv: -kv[1]))


def _mallinfo() -> dict[str, float]:
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = _libc()
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    mb = 1 / 2**20
    return {
        "sbrk_and_arenas_mb": round(info.arena * mb, 1),  # non-mmapped space of all arenas
        "mmapped_chunks_mb": round(info.hblkhd * mb, 1),
        "mmapped_chunks": info.hblks,
        "in_use_mb": round(info.uordblks * mb, 1),
        "free_mb": round(info.fordblks * mb, 1),
        "free_chunks": info.ordblks,
        "top_releasable_mb": round(info.keepcost * mb, 1),
    }


def _malloc_info() -> list[dict[str, float]]:
    import ctypes
    import re
    import tempfile

    libc = _libc()
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml", delete=False) as tmp:
        path = tmp.name
    fp = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    with open(path) as fh:
        xml = fh.read()
    os.unlink(path)
    heaps = []
    for nr, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):
        def val(kind: str, typ: str, body: str = body) -> int:
            m = re.search(rf'<{kind} type="{typ}" (?:count="\d+" )?size="(\d+)"/>', body)
            return int(m.group(1)) if m else 0
        heaps.append({
            "nr": int(nr),
            "system_mb": round(val("system", "current") / 2**20, 1),
            "free_fast_mb": round(val("total", "fast") / 2**20, 1),
            "free_rest_mb": round(val("total", "rest") / 2**20, 1),
            "aspace_mprotect_mb": round(val("aspace", "mprotect") / 2**20, 1),
        })
    return heaps


def _pymalloc() -> dict[str, float]:
    import re
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    found: dict[str, Any] = {}
    for label, key in (("# arenas allocated current", "arenas_current"),
                       ("# arenas highwater mark", "arenas_highwater"),
                       ("# bytes in allocated blocks", "bytes_in_blocks"),
                       ("# bytes in available blocks", "bytes_available"),
                       ("Total", "total_bytes")):
        m = re.search(re.escape(label) + r"\s*=\s*([\d,]+)", text)
        if m:
            found[key] = int(m.group(1).replace(",", ""))
    classes = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", text, re.M)
    found["pools_used"] = sum(int(c[2]) for c in classes)
    found["classes"] = [  # size, pools, blocks in use, available blocks
        [int(c[1]), int(c[2]), int(c[3]), int(c[4])] for c in classes if int(c[2]) >= 20]
    for label, key in (("# arenas reclaimed", "arenas_reclaimed"),
                       ("# arenas allocated total", "arenas_total"),
                       ("# bytes in available pools", "bytes_free_pools")):
        m = re.search(re.escape(label) + r"\s*=\s*([\d,]+)", text)
        if m:
            found[key] = int(m.group(1).replace(",", ""))
    if "bytes_in_blocks" in found:
        found["in_blocks_mb"] = round(found["bytes_in_blocks"] / 2**20, 1)
    if "total_bytes" in found:
        found["total_mb"] = round(found["total_bytes"] / 2**20, 1)
    return found


def _maps() -> dict[str, object]:
    """Resident anonymous memory by mapping kind, and the largest anonymous mappings."""
    kinds: dict[str, float] = {}
    anon: list[tuple[float, str]] = []
    current: list[str] | None = None
    rss = anon_kb = 0

    def flush() -> None:
        if current is None:
            return
        start, end = (int(x, 16) for x in current[0].split("-"))
        perms = current[1]
        path = current[5] if len(current) > 5 else ""
        size_mb = (end - start) / 2**20
        if path.startswith("/"):
            kind = "file"
        elif path:
            kind = path
        elif perms.startswith("---"):
            kind = "anon_guard"
        elif start % (64 * 2**20) == 0 and size_mb <= 64:
            kind = "glibc_thread_heap"  # 64 MB-aligned heap of a non-main arena
        else:
            kind = "anon_other"
        kinds[kind] = kinds.get(kind, 0.0) + anon_kb / 1024 + (rss / 1024 if kind == "file" else 0)
        if not path and anon_kb:
            anon.append((anon_kb / 1024, f"{current[0]} {perms} {size_mb:.1f}MB {kind}"))

    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                flush()
                current = line.split()
                rss = anon_kb = 0
            elif head == "Rss:":
                rss = int(line.split()[1])
            elif head == "Anonymous:":
                anon_kb = int(line.split()[1])
    flush()
    anon.sort(reverse=True)
    return {"resident_mb_by_kind": {k: round(v, 1) for k, v in sorted(kinds.items())},
            "anon_mappings": len(anon),
            "largest_anon": [f"{mb:.1f}MB resident: {desc}" for mb, desc in anon[:25]]}


def _objects() -> dict[str, int]:
    import gc

    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        name = type(obj).__name__
        counts[name] = counts.get(name, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:15]
    return {"gc_tracked": sum(counts.values()), **dict(top)}


def _referrers(type_name: str = "FavoriteMessage", samples: int = 3) -> list[list[str]]:
    """Chains of referrers (up to 6 levels) of a few live ``type_name`` objects.

    A chain ends at a container no Python object refers to (held by a frame, shown, or by
    native code such as Bytewax's Rust side).
    """
    import gc
    import sys as _sys
    import types

    found = [o for o in gc.get_objects() if type(o).__name__ == type_name][:samples]
    mine = {id(found)}
    here = _sys._getframe()
    chains: list[list[str]] = []
    for obj in found:
        chain: list[str] = []
        mine.add(id(chain))
        current: object = obj
        for _ in range(6):
            all_refs = gc.get_referrers(current)
            mine.add(id(all_refs))
            frames = [r for r in all_refs if isinstance(r, types.FrameType) and r is not here]
            refs = [r for r in all_refs if id(r) not in mine and not isinstance(r, types.FrameType)]
            mine.add(id(frames))
            mine.add(id(refs))
            where = ", ".join(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} "
                              f"{f.f_code.co_name}" for f in frames[:3])
            if not refs:
                chain.append(f"<no python referrer> frames=[{where}]")
                break
            current = refs[0]
            mine.add(id(current))
            desc = type(current).__name__
            if isinstance(current, (list, tuple)):
                desc += f" len={len(current)}"
            elif isinstance(current, dict):
                desc += " keys=" + ",".join(map(str, list(current)[:6]))
            chain.append(desc + f" (+{len(refs) - 1} others; frames=[{where}])")
        chains.append(chain)
    del found
    return chains


def _stats() -> dict[str, object]:
    return {
        "status": _status(),
        "threads": _threads(),
        "mallinfo2": _mallinfo(),
        "malloc_info_heaps": _malloc_info(),
        "pymalloc": _pymalloc(),
        "maps": _maps(),
        "allocated_blocks": sys.getallocatedblocks(),
        "objects": _objects(),
        "gc": {"count": __import__("gc").get_count(), "stats": __import__("gc").get_stats()},
    }


_main()
