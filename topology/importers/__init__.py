"""Importers for captured tool outputs (NCCL topology XML, nvidia-smi topo, ibstat, ...).

Each importer module exposes ``looks_like(text) -> bool`` and ``parse(text, source) -> Topology``.
:func:`parse_text` runs every importer whose format it recognises in a text and merges the
results, so a paste of several tools' outputs (ibdev2netdev + ibv_devinfo, a dump plus lspci)
works; :func:`parse_file` adds the file handling (unreadable, empty, binary files give a
result with a warning, never a traceback).
"""

from __future__ import annotations

from pathlib import Path

import importlib

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


def parse_file(path: str | Path) -> Topology:
    """Read and parse one captured file.

    Never raises for bad input: a missing, unreadable, empty, oversized or binary file gives an
    empty Topology whose warning names the file and the problem.
    """
    p = Path(path)
    t = Topology(sources=[str(p)])
    try:
        data = p.read_bytes()[: MAX_BYTES + 1]
    except FileNotFoundError:
        t.warnings.append(f"{p}: no such file")
        return t
    except IsADirectoryError:
        t.warnings.append(f"{p}: is a directory (use --sysfs-root for a captured sysfs tree)")
        return t
    except OSError as e:
        t.warnings.append(f"{p}: cannot read: {e.strerror or e}")
        return t
    if len(data) > MAX_BYTES:
        t.warnings.append(f"{p}: larger than {MAX_BYTES // (1024 * 1024)} MiB; only the first part was read")
        data = data[:MAX_BYTES]
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
