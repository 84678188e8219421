"""`linkpass inject device-fault`: a GPU fault on an emulated host, as kernel-log evidence;
`linkpass inject counters`: a rail's or GPU's error counters climb (issue 18).

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

::

    linkpass inject counters --host 1 --rail 0 [--counter port_rcv_errors] [--rate 100 --for 10 | --add N]
    linkpass inject counters --host 1 --gpu 0 [--counter aer_correctable] [...]

raises one counter in host I's emulated sysfs tree (``<state_dir>/h<I>.sys``, which its daemon
polls: ``[risk] sysfs_root``, :mod:`linkpass.lab.fabric.counters`): by ``--add N`` at once, or
``--rate`` per second for ``--for`` seconds (in steps of 0.1 s; the command returns when done).
Default counter: ``port_rcv_errors`` for a rail (the rule ``ib.port_rcv_errors.rate``: more than
10 a second), ``aer_correctable`` for a GPU (``gpu.aer_correctable.burst``).  ``--json``: one line
``{"host", "kind", "subject", "counter", "path", "from", "to", "t_issued_ns", "t_done_ns"}``.

Prints one line for a person: what was written where (:func:`describe`).  With ``--json`` it
prints one JSON line instead, ``{"host", "gpu", "pci", "xid", "kmsg", "line", "t_issued_ns"}``
(``t_issued_ns``: monotonic clock, just before the write), for scripts.  Exit 0; 2 with one line on stderr
for bad arguments (unknown kind, host or GPU out of range, Xid not 1..999, no such fabric).
"""

from __future__ import annotations

import math
import json
import os
import sys
import time
from pathlib import Path

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


def _number(name: str, text, default: float, hi: float, unit: str) -> float:
    """``--NAME``: a number in (0, hi], ``default`` when not given; the message names only this option."""
    if text is None:
        return default
    try:
        v = float(str(text))
    except ValueError:
        v = math.nan
    if not 0 < v <= hi:  # also NaN
        raise InjectError(f"--{name} must be a number above 0 and at most {hi:.0f} ({unit}), got {text!r}")
    return v


def _fabric(name: str, host: int) -> dict:
    """Fabric ``name``'s description, with ``host`` checked against it.

    Raises:
        InjectError: no such fabric, or no such host on it.
    """
    from linkpass.lab import fabric as fab

    try:
        desc = fab.load(name)
    except fab.FabricError as e:
        raise InjectError(str(e).splitlines()[0] if str(e) else f"no fabric named {name!r}") from None
    if not 0 <= host < len(desc["hosts"]):
        raise InjectError(f"--host must be 0..{len(desc['hosts']) - 1} on fabric {name!r}, got {host}")
    return desc


def inject_device_fault(name: str, host: int, gpu: int, xid: int) -> dict:
    """Append the Xid record to host ``host``'s kernel log on fabric ``name``."""

    desc = _fabric(name, host)
    hosts = desc["hosts"]
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


def inject_counters(name: str, host: int, kind: str, subject: int, counter: str | None = None, add: int | None = None,
                    rate: float = 100.0, duration_s: float = 10.0, stop=None) -> dict:
    """Raise ``counter`` of rail / GPU ``subject`` on host ``host`` of fabric ``name`` (see the
    module docstring).  ``stop``: a callable polled between steps; True ends the climb early.

    Raises:
        InjectError: no such fabric, host, rail, GPU or counter.
    """
    from linkpass.lab.fabric import counters as fc

    desc = _fabric(name, host)
    hosts = desc["hosts"]
    counter = counter or ("port_rcv_errors" if kind == "rail" else "aer_correctable")
    if counter not in fc.counters_for(kind):
        raise InjectError(f"--counter {counter!r} is not a {kind} counter here (known: {', '.join(fc.counters_for(kind))})")
    if kind == "rail" and subject not in [r["rail"] for r in hosts[host]["rails"]]:
        raise InjectError(f"--rail must be one of {[r['rail'] for r in hosts[host]['rails']]} on host {host}, got {subject}")
    if kind == "gpu" and not 0 <= subject < fc.GPUS_WITH_COUNTERS:
        raise InjectError(f"--gpu must be 0..{fc.GPUS_WITH_COUNTERS - 1} for counters, got {subject}")
    path, fmt = fc.counter_path(desc, host, kind, subject, counter)
    if not Path(fc.tree_root(desc, host)).is_dir():
        raise InjectError(f"host {host} of fabric {name!r} has no counter tree ({fc.tree_root(desc, host)}): "
                          "bring the fabric up again with this linkpass")
    try:
        start = fc.read_count(path, fmt)
    except (OSError, ValueError) as e:
        raise InjectError(f"cannot read {path}: {e}") from None
    t0 = time.monotonic_ns()
    value = start
    try:
        if add is not None:
            value = start + add
            fc.write_count(path, fmt, value)
        else:
            step_s = 0.1
            n = max(1, round(duration_s / step_s))
            for k in range(1, n + 1):
                if stop is not None and stop():
                    break
                value = start + round(rate * step_s * k)
                fc.write_count(path, fmt, value)
                time.sleep(max(0.0, t0 / 1e9 + step_s * k - time.monotonic()))
    except OSError as e:
        raise InjectError(f"cannot write {path}: {e.strerror or e}") from None
    return {"host": host, "kind": kind, "subject": subject, "counter": counter, "path": str(path), "from": start,
            "to": value, "t_issued_ns": t0, "t_done_ns": time.monotonic_ns()}


def describe(r: dict) -> str:
    """The human line for a result of :func:`inject_device_fault` or :func:`inject_counters`."""
    if "counter" in r:
        return (f"raised {r['counter']} of host {r['host']} {r['kind']} {r['subject']} from {r['from']} to {r['to']} "
                f"in {(r['t_done_ns'] - r['t_issued_ns']) / 1e9:.1f} s ({r['path']}); its daemon polls it "
                "(`linkpass status` shows AT RISK once a rule is breached)")
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


def _counters_parser():
    import argparse

    p = argparse.ArgumentParser(prog="linkpass inject counters", add_help=False,
                                description="Raise an error counter of host I's rail R or GPU G in its emulated sysfs "
                                "tree (the daemon polls it: [risk] sysfs_root); a rate past a rule's threshold puts "
                                "the rail (drained) or GPU (rank moved to a spare) at risk.")

    def error(message):
        raise InjectError(message)

    p.error = error
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--host", metavar="I", help="emulated host index (0-based)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rail", metavar="R", help="rail id")
    g.add_argument("--gpu", metavar="G", help="emulated GPU index")
    p.add_argument("--counter", help="counter name (default port_rcv_errors for a rail, aer_correctable for a GPU)")
    p.add_argument("--add", metavar="N", help="add N at once (instead of --rate/--for)")
    p.add_argument("--rate", metavar="PER_S", help="increase per second (default 100)")
    p.add_argument("--for", dest="duration", metavar="S", help="seconds to keep climbing (default 10; the command returns then)")
    p.add_argument("--name", default="lp", help="fabric name (default lp)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the human line")
    return p


def _cmd_counters(rest) -> int:
    p = _counters_parser()
    o = p.parse_args(rest)
    if o.help:
        print(p.format_help(), end="")
        return 0
    rate = _number("rate", o.rate, 100.0, 1e7, "increase per second")  # a value given is checked first
    duration = _number("for", o.duration, 10.0, 3600, "seconds")
    host = _int("host", o.host, 0, 15)
    if o.rail is None and o.gpu is None:
        raise InjectError("say what climbs: --rail R or --gpu G")
    kind, subject = ("rail", _int("rail", o.rail, 0, 63)) if o.rail is not None else ("gpu", _int("gpu", o.gpu, 0, MAX_GPUS - 1))
    add = _int("add", o.add, 1, 2**31) if o.add is not None else None
    if add is not None and (o.rate is not None or o.duration is not None):
        raise InjectError("--add N raises the counter at once: leave --rate and --for out")
    r = inject_counters(o.name or "lp", host, kind, subject, o.counter, add, rate, duration)
    print(json.dumps(r) if o.json else describe(r))
    return 0


def cmd_inject(args) -> int:
    try:
        if args.kind is None:
            raise InjectError("say which fault: linkpass inject device-fault --host I --gpu G [--xid 79] [--name NAME], "
                              "or linkpass inject counters --host I --rail R")
        if args.kind == "counters":
            return _cmd_counters(args.rest)
        if args.kind != "device-fault":
            raise InjectError(f"unknown fault kind {args.kind!r} (known: device-fault, counters)")
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

    p = sub.add_parser("inject", help="inject a device fault (kernel-log Xid line) or climbing error counters on the "
                       "emulated fabric",
                       description="linkpass inject device-fault --host I --gpu G [--xid 79] [--name NAME] [--json]: "
                       "append an NVRM Xid record for emulated GPU G (PCI 0000:<0x18+G>:00.0) to host I's kernel log; "
                       "linkpass inject counters --host I --rail R | --gpu G [--counter C] [--rate N --for S | --add N]: "
                       "make a rail's or GPU's error counters climb")
    p.add_argument("kind", nargs="?", help="device-fault or counters (`linkpass inject KIND --help` for its options)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="device-fault: --host I --gpu G [--xid 79] [--name NAME] [--json]; "
                   "counters: --host I --rail R | --gpu G [--counter C] [--rate N --for S | --add N] [--name NAME] [--json]")
    p.set_defaults(func=cmd_inject)
