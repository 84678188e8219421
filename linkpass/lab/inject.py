"""`linkpass inject device-fault`: a GPU fault on an emulated host, as kernel-log evidence.

::

    linkpass inject device-fault --host 1 --gpu 0 --xid 79 [--name lp] [--json]

appends one kmsg-style record (``prio,seq,usec,flags;message``, what ``/dev/kmsg`` yields) with
an NVRM Xid line for that host's GPU to the host's kernel-log file on the emulated fabric
(``<state_dir>/h<I>.kmsg``, which the host's daemon follows: ``[device] kmsg_path`` in its
config, see :func:`linkpass.lab.fabric.spec._host_config`).  The daemon classifies it (Xid 79
-> domain gpu, action migrate-rank) and sends ``device_fault`` to the hook clients on that GPU.

The fabric has no GPUs: emulated GPU ``G`` of every emulated host has the PCI bus id
:func:`fake_pci_bus_id` ``(G)`` = ``0000:<0x18+G>:00.0`` (GPU 0 -> ``0000:18:00.0``, GPU 1 ->
``0000:19:00.0``...; the same on every host, as on identical real nodes).  ``fabric up``
writes that mapping into each host's daemon config (``[device] gpus``, bus id -> index), and the
daemon uses it to map an incident's PCI id to the GPU index hooks register (``gpu``).

``--help`` (``-h``) after ``device-fault`` prints its options (exit 0).

Prints one line for a person: what was written where (:func:`describe`).  With ``--json`` it
prints one JSON line instead, ``{"host", "gpu", "pci", "xid", "kmsg", "line", "t_issued_ns"}``
(``t_issued_ns``: monotonic clock, just before the write), for scripts.  Exit 0; 2 with one line on stderr
for bad arguments (unknown kind, host or GPU out of range, Xid not 1..999, no such fabric).
"""

from __future__ import annotations

import json
import os
import sys
import time

from linkpass.lab.fabric.gpus import MAX_GPUS, fake_pci_bus_id, gpu_map  # noqa: F401 (part of this module's API)

_XID_TEXT = {79: "GPU has fallen off the bus.", 48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
             94: "Contained: CE User Channel (0x9). RST: No, D-RST: No", 95: "Uncontained: LTC TAG (0x2,0x1). RST: Yes, D-RST: No",
             119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL)."}


class InjectError(Exception):
    """Bad input; the message is the one line printed."""


def xid_line(gpu: int, xid: int, pid: int = 0) -> str:
    """The NVRM line the driver prints (``NVRM: Xid (PCI:0000:18:00): 79, pid=..., ...``)."""
    bus = fake_pci_bus_id(gpu)[:-2]  # the driver prints domain:bus:device, without the function
    return f"NVRM: Xid (PCI:{bus}): {xid}, pid='<unknown>', name=<unknown>, {_XID_TEXT.get(xid, 'injected by linkpass inject')}"


def _int(name: str, text, lo: int, hi: int) -> int:
    if text is None:
        raise InjectError(f"--{name} is required")
    try:
        v = int(str(text), 10)
    except ValueError:
        raise InjectError(f"--{name} must be an integer, got {text!r}") from None
    if not lo <= v <= hi:
        raise InjectError(f"--{name} must be {lo}..{hi}, got {v}")
    return v


def inject_device_fault(name: str, host: int, gpu: int, xid: int) -> dict:
    """Append the Xid record to host ``host``'s kernel log on fabric ``name``."""
    from linkpass.lab import fabric as fab

    try:
        desc = fab.load(name)
    except fab.FabricError as e:
        raise InjectError(str(e).splitlines()[0] if str(e) else f"no fabric named {name!r}") from None
    hosts = desc["hosts"]
    if not 0 <= host < len(hosts):
        raise InjectError(f"--host must be 0..{len(hosts) - 1} on fabric {name!r}, got {host}")
    path = os.path.join(os.path.dirname(hosts[host]["control_socket"]), f"h{host}.kmsg")
    line = xid_line(gpu, xid)
    seq_file = path + ".seq"
    try:
        with open(seq_file) as f:
            seq = int(f.read() or 0) + 1
    except (OSError, ValueError):
        seq = 1
    t = time.monotonic_ns()
    rec = f"3,{seq},{t // 1000},-;{line}\n"  # prio 3 (err), like the driver's Xid messages
    try:
        with open(path, "a") as f:
            f.write(rec)
        with open(seq_file, "w") as f:
            f.write(str(seq))
    except OSError as e:
        raise InjectError(f"cannot append to {path}: {e.strerror or e}") from None
    return {"host": host, "gpu": gpu, "pci": fake_pci_bus_id(gpu), "xid": xid, "kmsg": path, "line": line, "t_issued_ns": t}


def describe(r: dict) -> str:
    """The human line for a result of :func:`inject_device_fault`."""
    return (f"injected Xid {r['xid']} on host {r['host']} GPU {r['gpu']} ({r['pci']}): appended to {r['kmsg']}, "
            "which that host's daemon follows (`linkpass status` counts its device incidents)")


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="linkpass inject device-fault", add_help=False,
                                description="Append a kmsg-style NVRM Xid record for emulated GPU G (PCI bus id "
                                "0000:<0x18+G>:00.0) to host I's kernel log on the emulated fabric; the host's daemon "
                                "follows that log, classifies the Xid and tells the hook client on GPU G to move its rank.")

    def error(message):  # one line, exit 2 (argparse would print the usage too)
        raise InjectError(message)

    p.error = error
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--host", metavar="I", help="emulated host index (0-based, as `linkpass fabric up` numbers them)")
    p.add_argument("--gpu", metavar="G", help=f"emulated GPU index, 0..{MAX_GPUS - 1}")
    p.add_argument("--xid", default="79", metavar="N",
                   help="Xid code, 1..999 (default 79, GPU fallen off the bus: migrate-rank; 48, 95, 119 also move the rank)")
    p.add_argument("--name", default="lp", help="fabric name (default lp)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON line {"host", "gpu", "pci", "xid", "kmsg", "line", "t_issued_ns"} '
                   "instead of the human line")
    return p


def cmd_inject(args) -> int:
    try:
        if args.kind is None:
            raise InjectError("say which fault: linkpass inject device-fault --host I --gpu G [--xid 79] [--name NAME]")
        if args.kind != "device-fault":
            raise InjectError(f"unknown fault kind {args.kind!r} (known: device-fault)")
        p = _parser()
        o = p.parse_args(args.rest)
        if o.help:
            print(p.format_help(), end="")
            return 0
        host = _int("host", o.host, 0, 15)
        gpu = _int("gpu", o.gpu, 0, MAX_GPUS - 1)
        xid = _int("xid", o.xid, 1, 999)
        r = inject_device_fault(o.name or "lp", host, gpu, xid)
    except InjectError as e:
        print(f"linkpass inject: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if o.json else describe(r))
    return 0


def register(sub) -> None:
    import argparse

    p = sub.add_parser("inject", help="inject a device fault on the emulated fabric (kernel-log Xid line)",
                       description="linkpass inject device-fault --host I --gpu G [--xid 79] [--name NAME] [--json]: "
                       "append an NVRM Xid record for emulated GPU G (PCI 0000:<0x18+G>:00.0) to host I's kernel log")
    p.add_argument("kind", nargs="?", help="device-fault (`linkpass inject device-fault --help` for its options)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="--host I --gpu G [--xid 79] [--name NAME] [--json]")
    p.set_defaults(func=cmd_inject)
