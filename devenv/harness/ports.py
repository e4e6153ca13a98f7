"""A free TCP port on loopback."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port(host: str = HOST, *, below_ephemeral: bool = False, exclude: int = 0) -> int:
    """A TCP port on ``host`` that nothing listens on right now (never ``exclude``).

    ``below_ephemeral``: below the kernel's ephemeral range if possible, so that no outgoing
    connection can take it while the server that owns it is stopped for a restart.
    """
    low = ephemeral_low() if below_ephemeral else 0
    below = [random.randint(20000, low - 1) for _ in range(100)] if low > 20100 else []
    for port in [*below, 0, 0, 0]:  # 0: any port the kernel picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            if (chosen := int(sock.getsockname()[1])) != exclude:
                return chosen
    raise OSError(f"no free port on {host}")
