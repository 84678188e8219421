"""`linkpass topology`: show this host's (or captured files') GPUs, NICs, affinity and rails.

    linkpass topology [--sysfs-root DIR] [--from FILE ...] [--json] [--matrix] [--no-live]
    linkpass topology capture --out DIR [--sysfs-root DIR]

With ``--from`` only the given files are read (several files may describe one host); without
it the live host is read (sysfs under ``--sysfs-root``, default ``/``; netlink; NVML when a
driver is present).  Exit 0 with warnings when some input was bad; 2 when nothing could be
read at all from the files given.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys

from topology.affinity import analyse, gpu_nic_path, to_json
from topology.model import PATH_TYPES, Topology, merge


CAPTURE_META = "linkpass-capture.json"


class InputError(Exception):
    """The inputs named on the command line cannot be used at all (exit 2)."""


def _check_sysfs_root(root: str) -> None:
    from pathlib import Path

    p = Path(root)
    if not p.exists():
        raise InputError(f"--sysfs-root {root}: no such directory")
    if not p.is_dir():
        raise InputError(f"--sysfs-root {root}: not a directory")
    if not any((p / "sys" / sub).is_dir() for sub in ("bus/pci/devices", "class/net", "class/infiniband")):
        raise InputError(f"--sysfs-root {root}: not a captured sysfs tree (no {root.rstrip('/')}/sys/bus/pci/devices, "
                         f"sys/class/net or sys/class/infiniband); make one with `linkpass topology capture --out DIR`")


#: The largest capture metadata file read, in bytes (`topology capture` writes about 200).
MAX_META_BYTES = 64 * 1024


def _captured_host(root: str) -> str:
    """The host name a captured tree's metadata gives; "" when it cannot be read (missing, over
    :data:`MAX_META_BYTES`, not JSON, nested too deeply, a device or FIFO...)."""
    from pathlib import Path

    from topology.importers import read_capped

    try:
        data = read_capped(Path(root) / CAPTURE_META, MAX_META_BYTES, pipe_idle_s=0)
        if len(data) > MAX_META_BYTES:
            return ""
        return str(json.loads(data).get("host") or "")
    except (OSError, ValueError, AttributeError, RecursionError):
        return ""


def _load(args) -> Topology:
    parts: list[Topology] = []
    if args.sysfs_root:
        _check_sysfs_root(args.sysfs_root)
    if args.from_files:
        from topology.importers import parse_file

        parts += [parse_file(f) for f in args.from_files]
    if args.sysfs_root or not args.from_files:
        from topology.live import discover

        live = not args.sysfs_root and not args.no_live
        parts.append(discover(args.sysfs_root or "/", use_netlink=live, use_nvml=live))
    host = args.host or (_captured_host(args.sysfs_root) if args.sysfs_root else "") \
        or (socket.gethostname() if not args.from_files and not args.sysfs_root else "")
    return analyse(merge(parts, host=host))


def _table(doc: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    c = Console(emoji=False)
    title = f"host {doc['host'] or '(from files)'}: {len(doc['gpus'])} GPU(s), {len(doc['nics'])} NIC(s), {len(doc['rails'])} rail(s)"
    c.print(f"[bold]{title}[/]")
    def ids(table: Table, rows: list[str], *names: str) -> None:
        """Columns whose cells are identifiers (NIC names, PCI bus ids, roles): on one line, whole,
        never cut to "0000:18:…" in a narrow terminal or a pipe (80 columns); the others wrap."""
        for name in names:
            table.add_column(name, no_wrap=True, min_width=max([len(name.split()[0]), *map(len, rows)]))

    if doc["gpus"]:
        t = Table()
        ids(t, [], "GPU")
        ids(t, [g["pci_bus_id"] or "-" for g in doc["gpus"]], "PCI bus id")
        for name in ("NUMA", "nearest compute NICs", "path"):
            t.add_column(name, overflow="fold")
        for g in doc["gpus"]:
            t.add_row("-" if g["index"] is None else str(g["index"]), g["pci_bus_id"] or "-",
                      "-" if g["numa_node"] is None else str(g["numa_node"]), ", ".join(g["nearest_nics"]) or "(none)", g["path"])
        c.print(t)
    if doc["nics"]:
        t = Table()
        ids(t, [n["name"] for n in doc["nics"]], "NIC")
        ids(t, [n["pci_bus_id"] or "-" for n in doc["nics"]], "PCI bus id")
        t.add_column("netdevs", overflow="fold")
        ids(t, [n["role"] for n in doc["nics"]], "role")
        for name in ("rail", "ports", "why"):
            t.add_column(name, overflow="fold")  # a long word breaks across lines, never cut to "…"
        colors = {"compute": "green", "front-end": "cyan", "storage": "blue", "unused": "dim", "undecided": "yellow"}
        for n in doc["nics"]:
            ports = "; ".join(
                f"{p['port']}: {p['state'] if p['state'] != 'UNKNOWN' else 'state ?'}"
                + (f" {p['link_layer']}" if p["link_layer"] else "")
                + (f" {p['rate_gbps']:g}G" if p["rate_gbps"] else "")
                + (f" {p['netdev']}" if p["netdev"] else "")
                for p in n["ports"]) or "-"
            devs = sorted({*n["netdevs"], *(p["netdev"] for p in n["ports"] if p["netdev"])})
            t.add_row(n["name"], n["pci_bus_id"] or "-", ", ".join(devs) or "-",  # the id even when it names the NIC
                      f"[{colors.get(n['role'], 'white')}]{n['role']}[/]",
                      "-" if n["rail"] is None else str(n["rail"]), ports, n["role_reason"])
        c.print(t)
    if doc["unclassified_devices"]:
        c.print(f"unclassified PCI devices: {', '.join(doc['unclassified_devices'])}")
    for w in doc["warnings"]:
        c.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)


def matrix(topo: Topology) -> str:
    """nvidia-smi-like GPU x NIC matrix of path types (``-`` where unknown), plus a legend."""
    nics = [n for n in topo.nics]
    if not topo.gpus or not nics:
        return f"no GPU x NIC matrix: {len(topo.gpus)} GPU(s) and {len(nics)} NIC(s) known"
    head = ["", *[f"NIC{i}" for i in range(len(nics))], "NUMA"]
    rows = [head]
    for g in topo.gpus:
        label = f"GPU{g.index}" if g.index is not None else (g.pci_bus_id or "GPU?")
        rows.append([label, *[(gpu_nic_path(topo, g, n) or "-") for n in nics], "-" if g.numa_node is None else str(g.numa_node)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines += ["", "NIC Legend:", *[f"  NIC{i}: {n.name}" + (f" ({n.pci_bus_id})" if n.pci_bus_id and n.pci_bus_id != n.name else "")
                                   for i, n in enumerate(nics)]]
    lines += ["", "Legend: " + ", ".join(PATH_TYPES) + " (nvidia-smi's path types, nearest first)"]
    return "\n".join(lines)


def _capture_args_problem(out: str, sysfs_root: str | None) -> str | None:
    """Why ``capture --out OUT [--sysfs-root DIR]`` cannot write its tree, one line naming the
    option, the path and the OS's reason; None when it can: OUT is (or is made as) an empty
    directory in which a file can be created (one is created and removed)."""
    import os
    import tempfile

    if sysfs_root is not None and not os.path.isdir(sysfs_root):
        return f"--sysfs-root {sysfs_root}: {'not a directory' if os.path.exists(sysfs_root) else 'no such directory'}"
    try:
        os.makedirs(out, exist_ok=True)
        if os.listdir(out):
            return f"--out {out}: directory not empty (capture writes only into an empty one)"
        with tempfile.NamedTemporaryFile(dir=out, prefix=".linkpass-write-test-"):
            pass
    except FileExistsError:
        return f"--out {out}: exists and is not a directory"
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e})"
    return None


def cmd_topology(args) -> int:
    if args.action == "capture":
        if not args.out:
            print("linkpass topology capture: --out DIR is required", file=sys.stderr)
            return 2
        from topology.capture import capture

        why = _capture_args_problem(args.out, args.sysfs_root)
        if why:  # the user's paths: bad input, said before anything is read
            print(f"linkpass topology capture: {why}", file=sys.stderr)
            return 2
        try:
            files = capture(args.out, args.sysfs_root or "/")
            from pathlib import Path

            host = _captured_host(args.sysfs_root) if args.sysfs_root else socket.gethostname()
            (Path(args.out) / CAPTURE_META).write_text(json.dumps({"schema": "linkpass.capture/v1", "host": host,
                                                                    "files": len(files)}) + "\n")
        except OSError as e:
            print(f"linkpass topology capture: {args.out}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"captured {len(files)} sysfs files into {args.out}; read them back with `linkpass topology --sysfs-root {args.out}`")
        return 0
    try:
        topo = _load(args)
    except InputError as e:
        print(f"linkpass topology: {e}", file=sys.stderr)
        return 2
    doc = to_json(topo)
    if args.from_files and not args.sysfs_root and not topo.gpus and not topo.nics and not topo.unclassified:
        for w in topo.warnings:
            print(f"linkpass topology: {w}", file=sys.stderr)
        print("linkpass topology: nothing could be read from the files given", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=2))
    elif args.matrix:
        print(matrix(topo))
        for w in topo.warnings:
            print(f"warning: {w}", file=sys.stderr)
    else:
        _table(doc)
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``topology`` sub-command to the ``linkpass`` parser."""
    p = subparsers.add_parser("topology", help="GPUs, NICs, PCIe affinity and rails of this host or of captured files")
    p.add_argument("action", nargs="?", choices=["show", "capture"], default="show",
                   help="show (default) or capture the sysfs files discovery reads into --out DIR")
    p.add_argument("--sysfs-root", metavar="DIR", help="read a captured sysfs tree instead of /")
    p.add_argument("--from", dest="from_files", nargs="+", action="extend", metavar="FILE", default=None,
                   help="captured tool outputs: NCCL topology XML, nvidia-smi topo -m/-mp, ibstat, ibstatus, "
                        "ibv_devinfo, ibdev2netdev, rdma link (several files may describe one host)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the linkpass.topology/v1 JSON document")
    out.add_argument("--matrix", action="store_true", help="print an nvidia-smi-like GPU x NIC matrix")
    p.add_argument("--no-live", action="store_true", help="do not ask netlink or NVML (sysfs only)")
    p.add_argument("--host", help="host name to report (default: this host's name when reading it live)")
    p.add_argument("--out", metavar="DIR", help="capture: where to write the sysfs tree")
    p.set_defaults(func=cmd_topology)
    return p
