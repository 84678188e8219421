"""Make a gloo process group's pending work fail fast: find the TCP connections a group opened
and ``shutdown(SHUT_RDWR)`` them.

Why (measured with torch 2.13, tests/unit/test_torch_hooks_guard.py
``test_gloo_abort_alone_leaves_the_collective_blocked_socket_shutdown_frees_it``):
``ProcessGroupGloo.abort()`` returns but a collective blocked on a silent peer stays blocked until
the group's timeout, and the group's destructor joins gloo's worker threads, so dropping it blocks
too.  Shutting the group's connected sockets down makes gloo fail the pending work with
"Connection closed" within milliseconds.

Use: ``before = _socket_fds()``; build the group; ``fds = _tcp_fds(before, _socket_fds(), store_ports)``;
later ``_shutdown_fds(fds)``.  Only fds that still hold the same socket (same ``socket:[inode]``)
are touched, and the fds are never closed (gloo owns them).

Used by :mod:`torch_hooks.guard` and :mod:`torch_hooks.pg`.  No torch import (Linux ``/proc``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence


def _socket_fds() -> dict[int, str]:
    """This process's open socket fds -> their ``socket:[inode]`` link text."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def _tcp_fds(before: dict[int, str], after: dict[int, str], skip_ports: frozenset[int] = frozenset()
             ) -> list[tuple[int, str]]:
    """Connected TCP sockets that appeared between two snapshots (the group's connections).

    Listening sockets are left out: gloo's listener thread treats a failed ``accept`` as fatal
    (``gloo::EnforceNotMet`` in transport/tcp/listener.cc terminates the process).  So are
    sockets with a local or remote port in ``skip_ports`` (the job's TCPStore port): when this
    process hosts the store, its server thread accepts other processes' store connections at
    any time, also while a group is being built, and shutting one of those down when the group
    is aborted cut a spare's store connection in the middle of a migration ("Failed to recv,
    got 0 bytes", 2 demo runs in 16 under load).
    """
    out = []
    for fd, link in after.items():
        if before.get(fd) == link:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if (s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                peer = s.getpeername()  # raises when not connected
                if peer[1] in skip_ports or s.getsockname()[1] in skip_ports:
                    continue
                out.append((fd, link))
        except OSError:
            pass
        finally:
            s.detach()  # never close gloo's fd
    return out


def _shutdown_fds(fds: Sequence[tuple[int, str]]) -> int:
    """shutdown(SHUT_RDWR) each fd still holding the same socket; returns how many."""
    n = 0
    for fd, link in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed (and maybe reused) since: not ours any more
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n
