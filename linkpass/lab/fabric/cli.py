"""``linkpass fabric ...``: build, break, heal and tear down the emulated fabric.

:func:`register` adds the ``fabric`` sub-command to an argparse subparsers object; every leaf
parser carries ``func=handler`` where ``handler(args) -> int`` is the exit code.  Expected errors
print one line ``linkpass fabric: <message>`` on stderr and exit 2 (bad input, not root, name in
use) or 1 (a kernel operation failed).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

from linkpass.lab.fabric import fabric as F

_FAULT_HELP = (
    "admin-down | carrier-loss | blackhole | loss:PCT (1..100, each direction) | "
    "flap:PERIOD_MS:COUNT (switch port down PERIOD_MS/2 then up PERIOD_MS/2, COUNT times)"
)


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except F.FabricError as e:
            print(f"linkpass fabric: {e}", file=sys.stderr)
            return e.exit_code

    return run


def up_line(desc: dict, existed: bool) -> str:
    """What ``fabric up`` tells a person: the fabric, and whether it was built now or was
    already there (then nothing in the kernel changed)."""
    hosts = desc["hosts"]
    last = f"..{hosts[-1]['netns']}" if len(hosts) > 1 else ""
    what = (f"{desc['hosts_count']} host(s) x {desc['rails_count']} rail(s), mode {desc['mode']}; "
            f"namespaces {desc['fabric_netns']}, {hosts[0]['netns']}{last}; "
            f"daemon configs and fabric.json in {desc['state_dir']}")
    if existed:
        faults = desc.get("faults") or {}
        cut = f"; {len(faults)} cut link(s) still in place (`linkpass fabric show --name {desc['name']}`)" if faults else ""
        return (f"fabric {desc['name']} exists already, nothing built (`linkpass fabric down --name {desc['name']}` "
                f"removes it): {what}{cut}")
    return f"fabric {desc['name']}: {what}"


@_guarded
def cmd_up(args: argparse.Namespace) -> int:
    desc, existed = F.up_report(args.hosts, args.rails, args.name, hold_down_ms=args.hold_down_ms, mode=args.mode)
    if args.json:
        print(json.dumps({**desc, "existed": existed}, indent=2))  # existed: this call's finding, not in fabric.json
    else:
        print(up_line(desc, existed))
        if desc.get("configs_rewritten"):
            print(f"note: the fabric existed; its daemon configs were rewritten ({desc['configs_rewritten']}): "
                  "send SIGHUP to running daemons (hold-down) or restart them (mode)")
    return 0


@_guarded
def cmd_down(args: argparse.Namespace) -> int:
    if F.down(args.name):
        n = F.down_report(args.name)
        extra = f" (stopped {n} process{'es' if n != 1 else ''} running in it)" if n else ""
        print(f"fabric {args.name} removed{extra}")
    else:
        print(f"no fabric named {args.name}; nothing to do")
    return 0


@_guarded
def cmd_cut(args: argparse.Namespace) -> int:
    r = F.cut(args.name, args.host, args.rail, args.mode)
    if not r["changed"]:
        print(f"h{args.host} rail{args.rail}: already {r['mode']} (no change)")
    else:
        extra = f" (replaced {r['replaced']})" if r["replaced"] else ""
        pid = f", helper pid {r['pid']}" if r["pid"] else ""
        print(f"h{args.host} rail{args.rail}: {r['mode']}{extra}{pid}")
    return 0


@_guarded
def cmd_heal(args: argparse.Namespace) -> int:
    r = F.heal(args.name, args.host, args.rail)
    if not r["healed"]:
        print("nothing to heal")
    for h in r["healed"]:
        print(f"h{h['host']} rail{h['rail']}: healed ({h['mode']})")
    return 0


@_guarded
def cmd_show(args: argparse.Namespace) -> int:
    desc = F.load(args.name)
    if args.json:
        print(json.dumps(desc, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    live: dict[tuple[int, int], dict] = {}
    live_error = None
    if desc.get("status") == "ready":
        try:
            live = {(s["host"], s["rail"]): s for s in F.link_states(args.name)}
        except Exception as e:  # noqa: BLE001 - show what we can, say why the rest is missing
            live_error = str(e)
    faults = {(f["host"], f["rail"]): f for f in desc["faults"]}
    title = (
        f"fabric {desc['name']}: {desc['hosts_count']} host(s) x {desc['rails_count']} rail(s), "
        f"mode {desc['mode']}, {desc['status']}"
    )
    t = Table(title=title, title_justify="left")
    for col in ("host", "netns", "host IP"):
        t.add_column(col)
    for r in desc["rails"]:
        t.add_column(f"rail{r['id']} ({r['bridge']})")
    for h in desc["hosts"]:
        cells = [h["name"], h["netns"], h["host_ip"]]
        for hr in h["rails"]:
            key = (h["index"], hr["rail"])
            f, s = faults.get(key), live.get(key)
            if s is None:
                state = "[dim]?[/dim]"
            elif not s["host_up"]:
                state = "[red]admin down[/red]"
            elif not s["host_running"]:
                state = "[red]no carrier[/red]"
            else:
                state = "[green]up[/green]"
            if f is not None:
                state += f" [bold yellow]{f['mode']}[/bold yellow]"
            cells.append(f"{hr['address']} {state}")
        t.add_row(*cells)
    con = Console(emoji=False)
    con.print(t)
    con.print(f"state: {desc['state_dir']}  key: {desc['notice_key_file']}")
    if live_error:
        con.print(f"[yellow]live link state unavailable: {live_error}[/yellow]")
    return 0


def _name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="lp", help="fabric name, 1-12 chars [a-z][a-z0-9]* (default: lp)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``fabric`` (with up/down/cut/heal/show) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "fabric",
        help="emulated multi-host, multi-rail fabric (network namespaces, veth, bridges, nftables)",
        description="Build and break an emulated fabric: host namespaces {name}-h{i}, one bridge per rail "
        "in {name}-fab, addresses from 198.18.0.0/15. Needs root.",
    )
    sub = p.add_subparsers(dest="fabric_command", metavar="COMMAND", required=True)

    s = sub.add_parser("up", help="create the fabric (idempotent) and write per-host daemon configs")
    s.add_argument("--hosts", type=int, required=True, help=f"number of hosts, 1..{F.MAX_HOSTS}")
    s.add_argument("--rails", type=int, required=True, help=f"number of rails, 1..{F.MAX_RAILS}")
    _name_arg(s)
    s.add_argument("--mode", choices=F.MODES, default="host-ip", help="addressing mode written to the daemon configs")
    s.add_argument("--hold-down-ms", type=int, default=2000, help="hold_down_ms written to the daemon configs")
    s.add_argument("--json", action="store_true", help="print the description as JSON")
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("down", help="remove the fabric and everything it made")
    _name_arg(s)
    s.set_defaults(func=cmd_down)

    s = sub.add_parser("cut", help="break one host-rail link")
    s.add_argument("--host", type=int, required=True, help="host index (0-based)")
    s.add_argument("--rail", type=int, required=True, help="rail id (0-based)")
    s.add_argument("--mode", required=True, help=_FAULT_HELP)
    _name_arg(s)
    s.set_defaults(func=cmd_cut)

    s = sub.add_parser("heal", help="undo faults (all, one host's, one rail's, or one link's)")
    s.add_argument("--host", type=int, default=None, help="only this host")
    s.add_argument("--rail", type=int, default=None, help="only this rail")
    _name_arg(s)
    s.set_defaults(func=cmd_heal)

    s = sub.add_parser("show", help="show hosts, addresses, link state and active faults")
    _name_arg(s)
    s.add_argument("--json", action="store_true", help="print the description as JSON")
    s.set_defaults(func=cmd_show)
    return p
