"""What an adapter may ask of the process it runs in: its health, and whether to stop.

The composition root (:mod:`dataflows.entry`) makes the one :class:`Process` of a job and hands
it to every adapter; an adapter never reaches for a process-wide object, and never starts a
thread. Tests make their own (``Process()``): nothing is started by making one.
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
