"""Low-level helpers for the emulated fabric: entering a network namespace, link flags, sysctls.

Kept free of heavy imports so that the flap helper process (``python -m linkpass.lab.fabric.flap``)
starts in a few tens of milliseconds.

Network namespaces are entered per *thread* with ``setns(2)`` (through ctypes: Python 3.11 has no
``os.setns``) and left again in a ``finally``.  While inside, anything the thread opens or spawns
belongs to that namespace: sockets (so an ioctl on them acts on that namespace's netdevs),
``/proc/sys/net`` files, and child processes started with :mod:`subprocess` (``nft``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import subprocess
from collections.abc import Iterator, Sequence

NETNS_RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFF_RUNNING = 0x40

_libc = ctypes.CDLL(None, use_errno=True)


class NsError(Exception):
    """A kernel or tool operation failed; the message is one line."""


def netns_path(ns: str) -> str:
    return os.path.join(NETNS_RUN_DIR, ns)


def netns_exists(ns: str) -> bool:
    return os.path.exists(netns_path(ns))


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def in_netns(ns: str) -> Iterator[None]:
    """Run the body with the calling thread inside network namespace ``ns``."""
    try:
        target = os.open(netns_path(ns), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NsError(f"network namespace {ns} does not exist") from None
    try:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                _setns(target)
            except OSError as e:
                raise NsError(f"cannot enter network namespace {ns}: {e.strerror}") from None
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(home)
    finally:
        os.close(target)


def ns_socket(ns: str) -> socket.socket:
    """An AF_INET datagram socket living in ``ns`` (for interface ioctls there)."""
    with in_netns(ns):
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def get_flags(sock: socket.socket, ifname: str) -> int:
    req = struct.pack("16sh22x", ifname.encode(), 0)
    try:
        res = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, req)
    except OSError as e:
        raise NsError(f"cannot read flags of {ifname}: {e.strerror}") from None
    return struct.unpack("16sh22x", res)[1] & 0xFFFF


def set_up(sock: socket.socket, ifname: str, up: bool, flags: int | None = None) -> None:
    """Set (up=True) or clear IFF_UP on ``ifname`` in the socket's namespace.

    ``flags`` may carry the current flags (read earlier) so that the call is exactly one ioctl.
    """
    if flags is None:
        flags = get_flags(sock, ifname)
    new = (flags | IFF_UP) if up else (flags & ~IFF_UP)
    req = struct.pack("16sH22x", ifname.encode(), new & 0xFFFF)
    try:
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, req)
    except OSError as e:
        raise NsError(f"cannot set {ifname} {'up' if up else 'down'}: {e.strerror}") from None


def write_sysctls(ns: str, values: dict[str, str]) -> None:
    """Write ``/proc/sys`` keys (dotted names, e.g. ``net.ipv4.conf.all.rp_filter``) inside ``ns``."""
    with in_netns(ns):
        for key, value in values.items():
            path = "/proc/sys/" + key.replace(".", "/")
            try:
                with open(path, "w") as f:
                    f.write(str(value))
            except OSError as e:
                raise NsError(f"cannot set sysctl {key}={value} in {ns}: {e.strerror}") from None


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def run(argv: Sequence[str], *, input: str | None = None, what: str | None = None) -> str:
    """Run a command, return stdout; on failure raise NsError naming it, with its stderr."""
    try:
        p = subprocess.run(list(argv), input=input, capture_output=True, text=True)
    except FileNotFoundError:
        raise NsError(f"{argv[0]} not found (is it installed?)") from None
    if p.returncode != 0:
        detail = _one_line(p.stderr) or _one_line(p.stdout) or f"exit status {p.returncode}"
        raise NsError(f"{what or ' '.join(argv)} failed: {detail}")
    return p.stdout


def ip_batch(lines: Sequence[str], ns: str | None = None, *, force: bool = False) -> None:
    """Run ``ip [-n ns] [-force] -batch -`` with the given command lines."""
    if not lines:
        return
    argv = ["ip"]
    if ns is not None:
        argv += ["-n", ns]
    if force:
        argv.append("-force")
    argv += ["-batch", "-"]
    where = f" in {ns}" if ns else ""
    run(argv, input="\n".join(lines) + "\n", what=f"ip -batch{where}")


def nft(ns: str, script: str, what: str) -> None:
    """Apply an nft script inside ``ns`` (nft inherits the thread's namespace)."""
    with in_netns(ns):
        run(["nft", "-f", "-"], input=script, what=what)
