"""What an adapter may ask of the process it runs in: its health, whether to stop, its store.

The composition root makes the one :class:`Process` of a job and hands it to every adapter;
tests make their own (``Process()`` starts nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runtime.health import Health
from runtime.shutdown import Shutdown


@dataclass(frozen=True)
class Process:
    """The process's health, stop request (SIGTERM, exit 75) and recovery store (None: none)."""

    health: Health = field(default_factory=Health)
    stopping: Shutdown = field(default_factory=Shutdown)
    recovery_dir: Path | None = None
