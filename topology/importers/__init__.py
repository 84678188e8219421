"""Importers for captured tool outputs (NCCL topology XML, nvidia-smi topo, ibstat, ...).

Each importer module exposes ``looks_like(text) -> bool`` and ``parse(text, source) -> Topology``.
:func:`parse_text` runs every importer whose format it recognises in a text and merges the
results, so a paste of several tools' outputs (ibdev2netdev + ibv_devinfo, a dump plus lspci)
works; :func:`parse_file` adds the file handling (unreadable, empty, binary files give a
result with a warning, never a traceback).
"""

from __future__ import annotations

import errno
import importlib
import os
import select
import stat
from pathlib import Path

from topology.model import Topology, merge

#: (format name, module name), tried in this order.
IMPORTERS = (("nccl-topo-xml", "nccl_xml"), ("nvidia-smi-topo", "nvsmi"), ("ib-tools", "ibtools"))

MAX_BYTES = 16 * 1024 * 1024


def parse_text(text: str, source: str) -> Topology:
    """Parse one text with every importer that recognises it; merge what they found.

    A text no importer recognises gives an empty Topology with a warning naming ``source``.
    """
    parts = []
    for fmt, name in IMPORTERS:
        mod = importlib.import_module(f"topology.importers.{name}")
        try:
            if mod.looks_like(text):
                parts.append(mod.parse(text, source))
        except Exception as e:  # an importer bug must not lose the other importers' results
            t = Topology()
            t.warnings.append(f"{source}: the {fmt} importer failed: {type(e).__name__}: {e}")
            parts.append(t)
    if not parts:
        t = Topology(sources=[source])
        t.warnings.append(f"{source}: not a format linkpass reads (NCCL topology XML, nvidia-smi topo -m/-mp, "
                          "ibstat, ibstatus, ibv_devinfo, ibdev2netdev, rdma link)")
        return t
    out = merge(parts)
    out.sources = [source]
    return out


#: Seconds a pipe (``--from <(nvidia-smi topo -m)``) may stay silent before the read gives up.
PIPE_IDLE_S = 30.0

_DEVICES = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class Refused(OSError):
    """A file :func:`read_capped` will not read; ``str()`` says why (one line, no path)."""


def read_capped(path: str | Path, limit: int = MAX_BYTES, pipe_idle_s: float = PIPE_IDLE_S) -> bytes:
    """At most ``limit`` + 1 bytes of a regular file or a pipe; never the whole of a huge input.

    A regular file is read up to ``limit`` + 1 bytes.  A FIFO or pipe (``--from <(cmd)``,
    ``/dev/stdin`` fed by a pipe) is opened non-blocking, so a FIFO with no writer never hangs the
    reader (it reads as empty); it is read up to its end or ``limit`` + 1 bytes, and given up on
    (:class:`Refused`, "no data for N s") when its writer sends nothing for ``pipe_idle_s``
    seconds.  Devices (``/dev/zero``, a disk, a terminal) and sockets are refused unread: a
    device has no end, and a captured tool output is a file.

    Args:
        path: the file.
        limit: bytes wanted; one more is read so that the caller can tell "larger".
        pipe_idle_s: seconds a pipe may be silent.

    Raises:
        Refused: "not a regular file (a character device)", "no data for N s (...)".
        OSError: the OS's own error (FileNotFoundError, IsADirectoryError, PermissionError...).
    """
    def check(st: os.stat_result) -> None:
        kind = next((k for test, k in _DEVICES if test(st.st_mode)), None)
        if kind is not None:
            raise Refused(f"not a regular file ({kind})")
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory")

    check(os.stat(path))  # before open(): opening a device may already do something
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        check(os.fstat(fd))  # the file opened, not one swapped in since the stat
        poller = None
        chunks: list[bytes] = []
        n = 0
        while n <= limit:
            try:
                b = os.read(fd, min(1 << 20, limit + 1 - n))
            except BlockingIOError:  # a pipe whose writer has sent nothing yet
                if poller is None:
                    poller = select.poll()
                    poller.register(fd, select.POLLIN)
                if not poller.poll(int(pipe_idle_s * 1000)):
                    raise Refused(f"no data for {pipe_idle_s:g} s (a pipe or FIFO whose writer sends nothing)")
                continue
            if not b:
                break
            chunks.append(b)
            n += len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_file(path: str | Path) -> Topology:
    """Read and parse one captured file (:func:`read_capped`: at most :data:`MAX_BYTES` + 1 bytes).

    Never raises for bad input: a missing, unreadable, empty, oversized (over 16 MiB: refused,
    not cut) or binary file, a directory, a device or a stuck pipe gives an empty Topology whose
    warning names the file and the problem.
    """
    p = Path(path)
    t = Topology(sources=[str(p)])
    try:
        data = read_capped(p, MAX_BYTES)
    except FileNotFoundError:
        t.warnings.append(f"{p}: no such file")
        return t
    except IsADirectoryError:
        t.warnings.append(f"{p}: is a directory (use --sysfs-root for a captured sysfs tree)")
        return t
    except PermissionError:
        t.warnings.append(f"{p}: permission denied")
        return t
    except Refused as e:
        t.warnings.append(f"{p}: {e}")
        return t
    except OSError as e:
        t.warnings.append(f"{p}: cannot read: {e.strerror or e}")
        return t
    if len(data) > MAX_BYTES:
        size = f"{MAX_BYTES >> 20} MiB" if MAX_BYTES % (1 << 20) == 0 else f"{MAX_BYTES} bytes"
        t.warnings.append(f"{p}: larger than {size}; not read "
                          "(a captured tool output is far smaller: is it the right file?)")
        return t
    if not data.strip():
        t.warnings.append(f"{p}: empty file")
        return t
    if b"\x00" in data[:4096]:
        t.warnings.append(f"{p}: binary data, not a tool's text output")
        return t
    text = data.decode("utf-8", errors="replace")
    if "\ufffd" in text:
        t.warnings.append(f"{p}: not valid UTF-8; undecodable bytes were replaced")
    parsed = parse_text(text, str(p))
    parsed.warnings = t.warnings + parsed.warnings
    return parsed
