"""A free TCP port for a server that another process binds later (a vLLM engine, a side
channel).

Asking the kernel for a free port (binding port 0) returns one from its ephemeral range
(``net.ipv4.ip_local_port_range``), the range every implicit bind on the host draws from: a
vLLM server binds its port 10 to 60 s after it starts, and meanwhile an outgoing connection
or a listener on a random port of any process (UCX, ZeroMQ, torch) can take it; the server
then fails with "address already in use". The kernel never hands out a port below that range
on its own, so :func:`free_port` picks one there at random and checks that it is free now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux's default
LOWEST_PORT = 10000  # below: well-known and commonly registered services
TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last)."""
    try:
        first, last = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split()[:2])
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return first, last


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, below the ephemeral range where that range leaves room
    (else one the kernel picks)."""
    first, _ = ephemeral_range()
    if first - LOWEST_PORT >= 1000:
        pick = rng or random.Random()
        for _ in range(TRIES):
            port = pick.randrange(LOWEST_PORT, first)
            if is_free(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen
