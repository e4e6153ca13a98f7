"""The volume of the Bytewax recovery store: its free space, checked at start, watched, and named.

Bytewax 0.21.1 writes its snapshots to SQLite files in the recovery directory (``-r``) and
unwraps every SQLite error. When that volume is full (ENOSPC), the job died of a Rust panic and a
Python traceback, exit code 1, with no line of ours: ``database or disk is full`` while running
(read as PostgreSQL by the on-call engineer), ``disk I/O error`` at a start on a full volume
(SQLite cannot size its ``-shm`` file), about a second into each start of the crash loop that
follows. Nothing was lost (a snapshot is one SQLite transaction, and the store was intact once
space was freed), but nothing said where the space was missing. Hence, for the process that
runs a flow with recovery (:func:`dataflows.entry.flow_attribute`):

- **At start**, before Bytewax opens the store: a volume with less than
  ``USER_ACTIVITY_RECOVERY_MIN_FREE_BYTES`` free ends the process with one
  ``recovery-volume-full`` ERROR line (the directory, its free and total bytes, the minimum) and
  exit code :data:`RECOVERY_VOLUME_FULL` (74, ``EX_IOERR``). Nothing is read or written, so
  nothing is lost: a start with space resumes from the last snapshot.
- **While running**, ``user_activity_recovery_volume_free_bytes`` is measured when ``/metrics``
  is scraped, next to the minimum (``user_activity_recovery_volume_min_free_bytes``): the alert
  ``UserActivityRecoveryVolumeLow`` fires before a snapshot fails.
- **At a crash**: a process ending on an uncaught exception (Bytewax's panic on ``SQLITE_FULL``)
  while the volume has less than the minimum free logs the same line, then the traceback, and
  exits 74 too. The state of the volume decides, never the exception's text. No cleanup runs
  after it (like a SIGKILL, which recovery survives: the input since the last snapshot is read
  again, and the idempotent writes make that harmless).

The minimum has to cover the largest snapshot (the dedup windows, about 21 bytes per id) and its
copy in SQLite's write-ahead log; a volume short of it may still take a small snapshot, but the
next large one fails, so the job does not start on it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from runtime.logs import log_event
from runtime.metrics import RECOVERY_VOLUME_FREE_BYTES, RECOVERY_VOLUME_MIN_FREE_BYTES

logger = logging.getLogger(__name__)

RECOVERY_VOLUME_FULL = 74
"""The exit code of a process whose recovery volume is (nearly) full (``EX_IOERR``): free space
on it, or grow it, and start again; nothing is lost."""


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


def check_at_start(directory: Path, min_free_bytes: int) -> bool:
    """Whether the job may open its store: False (one ERROR line logged) if the volume is short."""
    space = measure(directory)
    if space is None or not is_short(space, min_free_bytes):
        return True
    _log_full(directory, space, min_free_bytes, "the job does not start")
    return False


def require_room(directory: Path, min_free_bytes: int) -> None:
    """:func:`check_at_start`, ending the process with :data:`RECOVERY_VOLUME_FULL` if short.

    For every command that opens a SQLite store there (the job, ``init-recovery``,
    ``replay``): on a full volume Bytewax panicked (exit code 1, no path named).
    """
    if not check_at_start(directory, min_free_bytes):
        raise SystemExit(RECOVERY_VOLUME_FULL)


def watch(directory: Path, min_free_bytes: int) -> None:
    """Export the volume's free space (measured at each scrape) and name it at a crash.

    Installs a ``sys.excepthook`` that, when the process ends on an uncaught exception while
    the volume is short, logs ``recovery-volume-full``, prints the traceback as Python does, and
    exits :data:`RECOVERY_VOLUME_FULL` at once; any other crash is left as it was.
    """
    RECOVERY_VOLUME_MIN_FREE_BYTES.set(min_free_bytes)
    RECOVERY_VOLUME_FREE_BYTES.set_function(lambda: _free_bytes(directory))
    sys.excepthook = _crash_hook(directory, min_free_bytes, sys.excepthook)


def _crash_hook(
    directory: Path, min_free_bytes: int,
    previous: Callable[[type[BaseException], BaseException, TracebackType | None], object],
) -> Callable[[type[BaseException], BaseException, TracebackType | None], None]:
    def hook(kind: type[BaseException], error: BaseException,
             traceback: TracebackType | None) -> None:
        space = measure(directory)
        if space is None or not is_short(space, min_free_bytes):
            previous(kind, error, traceback)
            return
        _log_full(directory, space, min_free_bytes, "the job stopped: a snapshot could not be"
                  " written (the traceback follows)")
        previous(kind, error, traceback)
        logging.shutdown()  # the INFO lines still buffered, as at a normal exit
        sys.stderr.flush()
        os._exit(RECOVERY_VOLUME_FULL)

    return hook


def _log_full(directory: Path, space: VolumeSpace, min_free_bytes: int, what: str) -> None:
    """The one ERROR line an on-call engineer reads (WARNING and above are flushed at once)."""
    log_event(logger, "recovery-volume-full", logging.ERROR, recovery_dir=str(directory),
              free_bytes=space.free_bytes, size_bytes=space.size_bytes,
              min_free_bytes=min_free_bytes, error="no space left on device (ENOSPC)",
              consequence=f"{what}; nothing is lost: free space on the volume (or grow it) and"
                          " start again, it resumes from its last snapshot",
              exit_code=RECOVERY_VOLUME_FULL)


def _free_bytes(directory: Path) -> float:
    space = measure(directory)
    return float("nan") if space is None else float(space.free_bytes)
