"""A TCP port for a server that a child process binds later (a torchrun store, a broker).

A port taken from the kernel (bind to port 0, then close) lies in the ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default), from which every outgoing
connection also takes its local port: between the pick and the child's bind, any connection
(gloo opens dozens per process group) can take it, and the child's listen fails with
EADDRINUSE (seen: ``bench snapshot``'s torchrun store, port 46413).  Ports below the range are
never handed out that way; torchrun's own default (29500) is one of them.
"""

from __future__ import annotations

import random
import socket

_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOW = 10_000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (low, high); (32768, 60999) where it cannot be read."""
    try:
        with open(_RANGE) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        if 0 < lo <= hi <= 65535:
            return lo, hi
    except (OSError, ValueError):
        pass
    return 32768, 60999


def listen_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port on ``host`` that is free now and outside the ephemeral range: random below it
    (from 10,000), else above it; a kernel-chosen one if 200 tries find none free."""
    rng = rng or random.Random()
    lo, hi = ephemeral_range()
    spans = [(_LOW, lo - 1)] if lo - 1 >= _LOW + 1000 else []
    if hi < 65535 - 1000:
        spans.append((hi + 1, 65535))
    for _ in range(200 if spans else 0):
        a, b = rng.choice(spans)
        port = rng.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
