"""The Bytewax recovery store a job starts on: checked and locked before Bytewax opens it.

Bytewax 0.21.1 keeps no flow name in a store and panics on SQLite's errors. A missing, empty,
foreign or incomplete store, ``-s 0``, or a second job process on it: one ``recovery-refused``
line, exit 78. A volume with less than ``USER_ACTIVITY_RECOVERY_MIN_FREE_BYTES`` free, at start
or at a crash: one ``recovery-volume-full`` line, exit 74. Nothing is read or written first.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import sqlite3
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from runtime.logs import log_event
from runtime.metrics import RECOVERY_VOLUME_FREE_BYTES, RECOVERY_VOLUME_MIN_FREE_BYTES

logger = logging.getLogger(__name__)

RECOVERY_REFUSED = 78
"""``EX_CONFIG``: the job was refused its recovery store; fix what the line names."""

REPLAY_MARKER = "replay.json"
"""Written by ``user-activity replay`` into a recovery directory it made (the job refuses it)."""

_PARTITION_GLOB = "part-*.sqlite3"
_INIT = "create it with `user-activity init-recovery DIR --partitions N` (N >= the workers)"


@dataclass(frozen=True)
class RunOptions:
    """What ``python -m bytewax.run`` was told about recovery and the cluster."""

    recovery_dir: Path | None
    snapshot_seconds: int | None
    process_id: int
    processes: int


@dataclass(frozen=True)
class Partition:
    """One ``part-N.sqlite3`` file: the index and count it was made with, the steps it holds."""

    name: str
    index: int | None
    count: int | None
    steps: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Store:
    """What a recovery directory holds (read, not changed)."""

    exists: bool
    partitions: tuple[Partition, ...] = ()
    replay_marker: bool = False


def run_options(argv: Sequence[str], environ: Mapping[str, str]) -> RunOptions:
    """The options of ``python -m bytewax.run`` (arguments, else its variables), as it reads."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-r", "--recovery-directory")
    parser.add_argument("-s", "--snapshot-interval")
    parser.add_argument("-i", "--process-id")
    parser.add_argument("-a", "--addresses")
    known, _rest = parser.parse_known_args(list(argv[1:]))
    directory = known.recovery_directory or environ.get("BYTEWAX_RECOVERY_DIRECTORY")
    snapshot = known.snapshot_interval or environ.get("BYTEWAX_SNAPSHOT_INTERVAL")
    process = known.process_id or environ.get("BYTEWAX_PROCESS_ID")
    if process is None and "BYTEWAX_POD_NAME" in environ and "BYTEWAX_STATEFULSET_NAME" in environ:
        process = environ["BYTEWAX_POD_NAME"].replace(environ["BYTEWAX_STATEFULSET_NAME"] + "-", "")
    addresses = known.addresses or environ.get("BYTEWAX_ADDRESSES")
    if process is not None and addresses is None and environ.get("BYTEWAX_HOSTFILE_PATH"):
        try:
            addresses = ";".join(line.strip() for line in Path(
                environ["BYTEWAX_HOSTFILE_PATH"]).read_text().splitlines() if line.strip())
        except OSError:
            addresses = None
    processes = len([a for a in addresses.split(";") if a]) if addresses else 1
    return RunOptions(
        Path(directory) if directory else None,
        int(snapshot) if snapshot is not None and snapshot.strip().isdigit() else None,
        int(process) if process is not None and str(process).strip().isdigit() else 0,
        max(processes, 1))


def read_store(directory: Path) -> Store:
    """The partitions in ``directory``, each opened read-only; nothing is written."""
    if not directory.is_dir():
        return Store(exists=False)
    partitions = tuple(_read_partition(path) for path in sorted(directory.glob(_PARTITION_GLOB)))
    return Store(True, partitions, (directory / REPLAY_MARKER).exists())


def _read_partition(path: Path) -> Partition:
    try:
        # a URI: ?, # or % in a path are not the URI's query or fragment
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            row = conn.execute("SELECT part_index, part_count FROM parts").fetchone()
            steps = frozenset(step for (step,) in conn.execute(
                "SELECT DISTINCT step_id FROM snaps"))
        finally:
            conn.close()
    except sqlite3.Error:
        return Partition(path.name, None, None)
    if row is None:
        return Partition(path.name, None, None, steps)
    return Partition(path.name, int(row[0]), int(row[1]), steps)


def stored_keys(directory: Path | None, step_id: str) -> frozenset[str]:
    """The partition keys ``step_id`` has snapshots of in the store at ``directory``.

    Bytewax 0.21.1 panics at start on a snapshot of a key its source does not list: a source
    lists these even while their topic is missing. Unreadable partitions are skipped.
    """
    keys: set[str] = set()
    for path in [] if directory is None else sorted(directory.glob(_PARTITION_GLOB)):
        try:
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
            try:
                keys.update(key for (key,) in conn.execute(
                    "SELECT DISTINCT state_key FROM snaps WHERE step_id = ?", (step_id,)))
            finally:
                conn.close()
        except sqlite3.Error:
            continue
    return frozenset(keys)


def problems(options: RunOptions, store: Store | None, flow_id: str) -> list[str]:
    """Why the job must not start on this store (empty: it may; no store given: nothing)."""
    directory = options.recovery_dir
    if directory is None or store is None:
        return []
    found: list[str] = []
    if options.snapshot_seconds == 0:
        found.append("-s 0 (BYTEWAX_SNAPSHOT_INTERVAL) snapshots at every activation, dozens a"
                     " second: give the snapshot interval in whole seconds >= 1 (-s 30)")
    if not store.exists:
        return [*found, f"the recovery directory does not exist: {_INIT}"]
    if store.replay_marker:
        found.append(f"this store was made by `user-activity replay` ({REPLAY_MARKER}): the job"
                     " would resume from the replay's offsets; give the job its own store")
    unreadable = [p.name for p in store.partitions if p.index is None]
    if unreadable:
        found.append(f"not Bytewax recovery partitions: {', '.join(unreadable)}")
    others = sorted({step.partition(".")[0] for p in store.partitions for step in p.steps}
                    - {flow_id})
    if others:
        found.append(f"the store holds snapshots of the flow {', '.join(others)}, not {flow_id}:"
                     " each flow needs its own store (the job would start from no snapshot,"
                     " silently, and mix its snapshots into the other flow's)")
    counts = sorted({p.count for p in store.partitions if p.count is not None})
    if len(counts) > 1:
        found.append(f"partitions of different stores (made with {counts} partitions):"
                     " a store's partitions come from one `init-recovery`")
    elif counts and options.processes == 1:
        missing = sorted(set(range(counts[0])) - {p.index for p in store.partitions})
        if missing:
            found.append(f"partitions {missing} of {counts[0]} are missing: the job cannot"
                         " resume without them; restore them from the volume they were moved"
                         " to or from a backup (k8s/README.md, Scaling)")
    if not store.partitions and options.processes == 1:
        found.append(f"the recovery directory holds no recovery partitions: {_INIT}")
    return found


_held: list[IO[bytes]] = []


def lock(directory: Path, process_id: int) -> str | None:
    """Hold this process's lock on ``directory``; the reason when another process holds it.

    One ``.job-lock-<process id>`` per cluster process; held till exit. None when locked (or
    the file cannot be made: Bytewax then says why).
    """
    path = directory / f".job-lock-{process_id}"
    if any(Path(held.name).resolve() == path.resolve() for held in _held):
        return None  # a flock is per open file: a second one would find us the holder
    try:
        handle = path.open("a+b")
    except OSError:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().decode(errors="replace").strip() or "?"
        handle.close()
        return (f"another job process (pid {holder}) runs on this store as process"
                f" {process_id}: two jobs on one store each read every input and overwrite each"
                " other's snapshots; stop one, or give each its own store")
    handle.truncate(0)
    handle.write(str(os.getpid()).encode())
    handle.flush()
    _held.append(handle)
    return None


def check_at_start(options: RunOptions, flow_id: str, *, tail: bool) -> bool:
    """Whether the job may start: False (one ``recovery-refused`` ERROR line logged) if not."""
    directory = options.recovery_dir
    store = None if directory is None else read_store(directory)
    if directory is None and tail:
        log_event(logger, "recovery-disabled", logging.WARNING, flow=flow_id,
                  problem="the job tails its input with no recovery store (-r DIR or"
                          " BYTEWAX_RECOVERY_DIRECTORY)",
                  consequence="every start reads from USER_ACTIVITY_STARTING_OFFSET again"
                              " (earliest: the whole retention; latest: what arrived while it"
                              " was stopped is skipped); run it with -r DIR -s 30 -b 300")
    found = problems(options, store, flow_id)
    if not found and directory is not None and (held := lock(directory, options.process_id)):
        found = [held]
    if not found:
        return True
    log_event(logger, "recovery-refused", logging.ERROR,
              recovery_dir=None if directory is None else str(directory), flow=flow_id,
              problem="; ".join(found),
              consequence="the job does not start; nothing was read or written",
              exit_code=RECOVERY_REFUSED)
    return False


RECOVERY_VOLUME_FULL = 74
"""``EX_IOERR``: the recovery volume is (nearly) full; free space on it and start again."""


@dataclass(frozen=True)
class VolumeSpace:
    """The space of the filesystem that holds a directory, as an unprivileged writer sees it."""

    free_bytes: int
    size_bytes: int


def is_short(space: VolumeSpace, min_free_bytes: int) -> bool:
    """Whether ``space`` leaves less than ``min_free_bytes`` free (``0``: never short)."""
    return min_free_bytes > 0 and space.free_bytes < min_free_bytes


def measure(directory: Path) -> VolumeSpace | None:
    """The space of ``directory``'s filesystem; None if it cannot be asked (Bytewax says why)."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return VolumeSpace(stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize)


def require_room(directory: Path, min_free_bytes: int) -> None:
    """End the process with :data:`RECOVERY_VOLUME_FULL` (one line) when the volume is short."""
    space = measure(directory)
    if space is not None and is_short(space, min_free_bytes):
        _log_full(directory, space, min_free_bytes, "the job does not start")
        raise SystemExit(RECOVERY_VOLUME_FULL)


def watch(directory: Path, min_free_bytes: int) -> None:
    """Export the volume's free space; a crash while it is short exits 74 (one line)."""
    RECOVERY_VOLUME_MIN_FREE_BYTES.set(min_free_bytes)
    RECOVERY_VOLUME_FREE_BYTES.set_function(lambda: float(
        "nan") if (space := measure(directory)) is None else float(space.free_bytes))
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException,
             traceback: TracebackType | None) -> None:
        space = measure(directory)
        short = space is not None and is_short(space, min_free_bytes)
        if space is not None and short:
            _log_full(directory, space, min_free_bytes, "the job stopped: a snapshot could not"
                      " be written (the traceback follows)")
        previous(kind, error, traceback)
        if short:
            sys.stderr.flush()
            os._exit(RECOVERY_VOLUME_FULL)

    sys.excepthook = hook


def _log_full(directory: Path, space: VolumeSpace, min_free_bytes: int, what: str) -> None:
    log_event(logger, "recovery-volume-full", logging.ERROR, recovery_dir=str(directory),
              free_bytes=space.free_bytes, size_bytes=space.size_bytes,
              min_free_bytes=min_free_bytes, error="no space left on device (ENOSPC)",
              consequence=f"{what}; nothing is lost: free space on the volume (or grow it) and"
                          " start again, it resumes from its last snapshot",
              exit_code=RECOVERY_VOLUME_FULL)
