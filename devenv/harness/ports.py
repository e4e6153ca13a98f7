"""A free TCP port on loopback; disjoint shares of ports for processes running side by side."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
_LOWEST = 20000


class _Share:
    """The ports of this process (none: any free port), handed out in turn from ``cursor``."""

    ports: range = range(0)
    cursor = 0


_share = _Share()  # set by use_port_share


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def use_port_share(index: int, count: int) -> None:
    """From now on, hand out only ports of share ``index`` of ``count``, each in turn.

    Shares are disjoint and below the ephemeral range: side-by-side workers never collide.
    """
    low = ephemeral_low()
    if not 0 <= index < count or low - _LOWEST < 100 * count:
        raise ValueError(f"no share {index} of {count} below port {low}")
    size = (low - _LOWEST) // count
    _share.ports = range(_LOWEST + index * size, _LOWEST + (index + 1) * size)
    _share.cursor = random.randrange(size)  # two runs side by side rarely walk in step


def free_port(host: str = HOST, *, below_ephemeral: bool = False, exclude: int = 0) -> int:
    """A TCP port on ``host`` that nothing listens on right now (never ``exclude``)."""
    if ports := _share.ports:
        for _ in ports:
            port = ports[_share.cursor]
            _share.cursor = (_share.cursor + 1) % len(ports)
            if port != exclude and _bindable(host, port):
                return port
        raise OSError(f"no free port on {host} in this process's share")
    low = ephemeral_low() if below_ephemeral else 0
    below = [random.randint(_LOWEST, low - 1) for _ in range(100)] if low > _LOWEST + 100 else []
    for port in [*below, 0, 0, 0]:  # 0: any port the kernel picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            if (chosen := int(sock.getsockname()[1])) != exclude:
                return chosen
    raise OSError(f"no free port on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
