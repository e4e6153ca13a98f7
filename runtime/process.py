"""What an adapter may ask of the process it runs in: its health, and whether to stop.

The composition root makes the one :class:`Process` of a job and hands it to every adapter;
tests make their own (``Process()`` starts nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.health import Health
from runtime.shutdown import Shutdown


@dataclass(frozen=True)
class Process:
    """The process's health (``/livez``, ``/readyz``) and stop request (SIGTERM, exit 75)."""

    health: Health = field(default_factory=Health)
    stopping: Shutdown = field(default_factory=Shutdown)
