"""`linkpass ...` sub-commands.

    linkpass run --config FILE            run the daemon (foreground)
    linkpass status [--config FILE | --socket PATH] [--json]
    linkpass fabric up|down|cut|heal|show  the emulated fabric (see linkpass.lab.fabric)
    linkpass demo [--hosts 2] [--rails 2] [--steps N] [--json FILE]
    linkpass demo --scenario rail|rail-latched|device-fault|snapshot|at-risk [--script FILE] [--script-args ARGS] [--hosts H] [--json FILE]
    linkpass topology [--sysfs-root DIR] [--from FILE ...] [--json] [--matrix]
    linkpass topology capture --out DIR
    linkpass nccl-env [--local-rank N | --gpu N] [--format shell|json|env-file]
    linkpass exec [--local-rank N] -- CMD ARGS...
    linkpass classify [FILE ...|-] [--json] [--topology FILE]
    linkpass alerts tail [--config FILE] [--broker HOST:PORT] [--host H] [--json]
    linkpass config check [--no-files] FILE  validate a config and its files: OK, or one line per problem (exit 2)
    linkpass config show FILE | --defaults [--example]

Exit codes: 0 success, 1 runtime failure, 2 bad input (config, arguments), 3 daemon not reachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import sys

#: Exit status when the reader of stdout went away (``linkpass status --history | head -1``):
#: 128 + SIGPIPE, what a shell reports for a command that SIGPIPE ends (``yes | head -1``).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _die(msg: str, code: int) -> int:
    print(f"linkpass: {msg}", file=sys.stderr)
    return code


def cmd_run(args) -> int:
    from linkpass import daemon
    from linkpass.config import ConfigError

    try:
        return daemon.run(args.config, args.log_level)
    except (ConfigError, daemon.StartError) as e:
        return _die(str(e), 2)
    except KeyboardInterrupt:
        return 0


def _fault_host(text: str) -> int | str:
    """``--fault-host``: a host index or ``all``."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a host index (0, 1, ...) or 'all'") from None


def _socket_from_args(args) -> str:
    from linkpass.config import DEFAULT_CONTROL_SOCKET, load_config

    if args.socket:
        return args.socket
    if args.config:
        return load_config(args.config).daemon.control_socket
    return DEFAULT_CONTROL_SOCKET


def cmd_status(args) -> int:
    st = _ask(args, "history" if args.history else "status")
    if isinstance(st, int):
        return st
    if args.json or args.history:
        print(json.dumps(st, indent=2))
        return 0
    _print_status(st)
    return 0


def cmd_drain(args) -> int:
    """``linkpass drain RAIL`` / ``undrain RAIL``: exit 0 when the daemon took the request (also
    for a rail already in the state asked for, said so); 2 for a rail the daemon's config does not
    have; 1 for another refusal."""
    resp = _ask(args, args.command, rail=args.rail)
    if isinstance(resp, int):
        return resp
    if "error" in resp:
        return _die(f"the daemon refused: {resp['error']}", 2 if resp.get("bad_input") else 1)
    was = resp.get("was_drained")
    if args.command == "undrain" and was is False:
        print(f"rail {args.rail}: not drained; nothing to undrain")
    elif args.command == "drain" and was is True:
        print(f"rail {args.rail}: already drained")
    else:
        print(f"rail {args.rail}: {args.command} requested (see `linkpass status`)")
    return 0


def _ask(args, cmd: str, **fields) -> dict | int:
    """The daemon's reply to ``cmd``, or the exit code after saying why there is none."""
    from linkpass.config import ConfigError
    from linkpass.daemon import query

    try:
        path = _socket_from_args(args)
    except ConfigError as e:
        return _die(str(e), 2)
    import os
    import stat

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return _die(f"{path} is not a socket (is --socket/--config pointing at the daemon's control_socket?)", 3)
    except FileNotFoundError:
        return _die(f"no daemon answers on {path}: no such socket (is `linkpass run` running?)", 3)
    except OSError as e:
        return _die(f"cannot use {path}: {e.strerror}", 3)
    try:
        return asyncio.run(query(path, cmd, **fields))
    except asyncio.TimeoutError:
        return _die(f"the daemon on {path} did not answer within 5 s (is it stuck?)", 3)
    except PermissionError:
        return _die(f"permission denied on {path}: the control socket is for root (mode 0660)", 3)
    except OSError as e:
        return _die(f"no daemon answers on {path}: {e.strerror or e}", 3)
    except ValueError as e:
        return _die(f"the daemon on {path} sent a reply that is not JSON: {e}", 1)


def _status_lines(st: dict, max_clients: int = 8) -> list[str]:
    """The reroute mode and the hook clients, one line each (plain text)."""
    out = []
    mode = st.get("reroute")
    if mode:
        out.append(f"reroute: {mode}" + (" (kernel routes are not changed; torch hooks get the notices)"
                                         if mode == "notify-only" else ""))
    hooks = st.get("hooks")
    if hooks is None:
        out.append("hook clients: hooks off")
    else:
        clients = hooks.get("clients") or []
        names = [f"{x['job']}/{x['rank']}" if "job" in x else f"unregistered(pid {x.get('pid', '?')})" for x in clients]
        more = f", +{len(names) - max_clients} more" if len(names) > max_clients else ""
        out.append(f"hook clients: {len(clients)}" + (f" ({', '.join(names[:max_clients])}{more})" if names else "")
                   + f"  on {hooks.get('socket', '?')}")
    for job, j in sorted(((st.get("snapshots") or {}).get("jobs") or {}).items())[:max_clients]:
        last = j.get("last") or {}
        what = "snapshot" if last.get("scope") == "snapshot" else f"rank {last.get('rank')}'s part"
        res = (f"ok, {last.get('bytes')} bytes, stall {last.get('stall_ms')} ms, write {last.get('write_ms')} ms"
               if last.get("ok") else f"FAILED: {last.get('reason')}")
        out.append(f"snapshots of job {job}: {j.get('ok')} ok, {j.get('failed')} failed; last {what} at step "
                   f"{last.get('step')} ({res}), {last.get('age_s')} s ago")
    for v in st.get("at_risk") or []:
        who = f"{v.get('subject_kind')} {v.get('subject')}"
        what = str(v.get("summary") or v.get("rule"))
        what = what.removeprefix(f"{who} at risk: ")  # the tracker's summary names the subject too
        out.append(f"AT RISK: {'GPU' if v.get('subject_kind') == 'gpu' else 'rail'} {v.get('subject')}: {what}; {v.get('action')}")
    counts = st.get("incident_counts")
    if counts is not None:
        srcs = ",".join(sorted(st.get("device_sources") or {})) or "none"
        out.append(f"device incidents: {sum(counts.values())}"
                   + (f" ({', '.join(f'{d} {n}' for d, n in sorted(counts.items()))})" if counts else "")
                   + f"  sources: {srcs}")
    mq = st.get("mqtt")
    if mq:
        ob = mq.get("outbox") or {}
        out.append(f"mqtt: {'connected to' if mq.get('connected') else 'NOT connected to'} {mq.get('broker')} (MQTT {mq.get('protocol')})"
                   f", outbox {ob.get('depth')} waiting, {ob.get('dropped_total')} dropped"
                   + (f"; last error: {mq['last_error']}" if mq.get("last_error") else ""))
    return out


def _print_status(st: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(emoji=False)
    c.print(f"[bold]{st['host']}[/] mode {st['mode']}  generation {st['generation']} (applied {st['applied_generation']})  uptime {st['uptime_s']} s")
    for line in _status_lines(st):
        c.print(line, markup=False, highlight=False, soft_wrap=True)
    t = Table("rail", "netdev", "state", "last change", "reason", "link", "probes")
    colors = {"UP": "green", "DOWN": "red", "HOLD_DOWN": "yellow", "SUSPECT": "yellow", "DRAINED": "blue"}
    for r in st["rails"]:
        link = r["link"]
        ltxt = "absent" if not link or not link["present"] else f"{link['operstate']}{'' if link['carrier'] else ' NO-CARRIER'}{'' if link['admin_up'] else ' admin-down'}"
        ago = "-" if r["last_change_ago_ms"] is None else f"{r['last_change_ago_ms'] / 1000:.1f} s ago"
        loss = r.get("probe_loss")
        ptxt = "-" if loss is None else f"loss {100 * loss:.1f}%" + (" DEGRADED" if r.get("degraded") else "")
        damp = r.get("damping") or {}
        if damp.get("suppressed"):
            ptxt += f", damped {damp.get('release_in_ms', 0) / 1000:.0f} s"
        t.add_row(str(r["id"]), r["netdev"], f"[{colors.get(r['state'], 'white')}]{r['state']}[/]", ago, r["reason"], ltxt, ptxt)
    c.print(t)
    if st["peers"]:
        paths: dict[str, list[str]] = {}
        for ph in st.get("paths", []):  # probe path states per peer: "rail 0 UP 0.05 ms"
            rtt = "" if ph.get("rtt_ms") is None else f" {ph['rtt_ms']:.2f} ms"
            paths.setdefault(ph["peer"], []).append(f"rail {ph['rail']} {ph['state']}{rtt}")
        p = Table("peer", "usable rails (announced)", "last notice", "probe paths")
        for peer in st["peers"]:
            p.add_row(peer["name"], "not heard" if peer["usable_rails"] is None else ",".join(map(str, peer["usable_rails"])) or "none",
                      "-" if peer["last_notice_ago_ms"] is None else f"{peer['last_notice_ago_ms'] / 1000:.1f} s ago",
                      ", ".join(paths.get(peer["name"], [])) or "-")
        c.print(p)
    if st.get("routes"):
        rt = Table("route", "src", "over rails")
        for r in st["routes"]:
            rt.add_row(r["dst"], r["prefsrc"] or "-", ", ".join(f"rail {n['rail']} ({n['netdev']} via {n['gateway']})" for n in r["nexthops"]))
        c.print(rt)
    for w in st.get("warnings", []) + st.get("route_errors", []) + st.get("route_conflicts", []):
        c.print(f"[yellow]warning:[/] {w}")


def cmd_demo(args) -> int:
    from linkpass.lab.demo import DemoError, main as demo_main

    fh, hosts = getattr(args, "fault_host", None), getattr(args, "hosts", None)
    if isinstance(fh, int) and isinstance(hosts, int) and not 0 <= fh < hosts:
        # every scenario, before any fabric is built (the default one used to ignore it)
        return _die(f"demo: --fault-host must be 0..{hosts - 1} or all, got {fh}", 2)
    try:
        return demo_main(args)
    except DemoError as e:
        return _die(f"demo: {e}", e.exit_code)


def build_parser() -> argparse.ArgumentParser:
    from linkpass import __version__

    p = argparse.ArgumentParser(prog="linkpass", description="Network-path failover for GPU training clusters.")
    p.add_argument("--version", action="version", version=f"linkpass {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run the daemon in the foreground")
    r.add_argument("--config", required=True, help="TOML config file")
    r.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override daemon.log_level")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="show a running daemon's rails, states and plan generation")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--config", help="config file of the daemon (to find its control socket)")
    g.add_argument("--socket", help="control socket path (default /run/linkpass/linkpass.sock)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--history", action="store_true", help="print the daemon's recent history as JSON")
    s.set_defaults(func=cmd_status)

    for name, what in (("drain", "take a rail out of use (DRAINED: routes and peer notices leave it) until undrained"),
                       ("undrain", "give a drained rail back (it returns through hold-down)")):
        dr = sub.add_parser(name, help=what)
        dr.add_argument("rail", type=int, help="rail id (as in `linkpass status`)")
        g = dr.add_mutually_exclusive_group()
        g.add_argument("--config", help="config file of the daemon (to find its control socket)")
        g.add_argument("--socket", help="control socket path (default /run/linkpass/linkpass.sock)")
        dr.set_defaults(func=cmd_drain)

    from linkpass.lab.fabric.cli import register as register_fabric

    register_fabric(sub)

    from topology.cli import register as register_topology

    register_topology(sub)

    from linkpass.lab.benchcmd import register as register_bench

    register_bench(sub)

    from linkpass.cli.nccl import register as register_nccl

    register_nccl(sub)

    from linkpass.cli.classify import register as register_classify

    register_classify(sub)

    from linkpass.lab.inject import register as register_inject

    register_inject(sub)

    from linkpass.cli.alerts import register as register_alerts

    register_alerts(sub)

    from linkpass.cli.config import register as register_config

    register_config(sub)

    from linkpass.cli.snapshot import register as register_snapshot

    register_snapshot(sub)

    d = sub.add_parser("demo", help="fabric + daemons + a gloo training job that keeps training through a rail cut")
    d.add_argument("--hosts", type=int, default=2)
    d.add_argument("--rails", type=int, default=2)
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--json", metavar="FILE", help="write the result as JSON")
    d.add_argument("--name", default="lpdemo", help="fabric name (default lpdemo)")
    d.add_argument("--mode", default="carrier-loss", help="cut mode: carrier-loss (default), admin-down or blackhole")
    d.add_argument("--scenario", default="reroute",
                   choices=["reroute", "rail", "rail-latched", "device-fault", "snapshot", "at-risk", "rebuild",
                            "guard-device-fault"],
                   help="reroute (default): kernel routes carry the job around the cut. With an unmodified --script "
                   "under linkpass exec + torchrun and no route changes (reroute = notify-only): rail (the hook rebuilds "
                   "the process groups on another rail), rail-latched (gloo latched as NCCL is: a warm spare takes the cut "
                   "rank), device-fault (Xid 79 on one rank's GPU: a warm spare takes the rank), snapshot (a snapshot of the "
                   "running job, then a fresh run resumed from it with linkpass exec --resume), at-risk (a rail's error "
                   "counters climb: the daemon drains it and the job leaves it before it is cut). rebuild / "
                   "guard-device-fault: the same with the explicit LinkPassGuard API (linkpass.lab.demo_train)")
    d.add_argument("--script", metavar="FILE", help="the training script for rail / rail-latched / device-fault / snapshot / at-risk "
                   "(default examples/ddp_train.py); run unchanged, one worker per host")
    d.add_argument("--script-args", metavar="ARGS", default=None,
                   help="arguments for --script, one string (default for the example: %r)" % "--epochs 3 --samples 16384 "
                   "--batch-size 32 --snapshot snapshot.pt")
    d.add_argument("--spares", type=int, default=1, help="hot spares per host (device-fault scenario, default 1)")
    d.add_argument("--memory-every", type=int, default=10, metavar="N",
                   help="device-fault with --script: an in-memory snapshot every N steps, so a sharded (FSDP2) rank can "
                   "be rebuilt from its peer's copy (the job redoes at most N steps); 0: none (default 10)")
    d.add_argument("--fault-host", type=_fault_host, default=None, metavar="N|all",
                   help="host whose rail is cut or whose rank loses its GPU (default the last host; 0 works too: the "
                   "job's store runs in a process of its own); 'all' (rail scenarios): the rail is cut on every host "
                   "at once, as when the rail's switch fails")
    d.add_argument("--fault-when", metavar="FILE",
                   help="--script scenarios but snapshot: inject the fault when FILE appears (it must not exist yet; "
                   "a relative path is taken from the current directory) instead of at 30 %% of the run, for a test "
                   "that arranges the moment from inside the workers")
    d.add_argument("--reference-cache", metavar="DIR",
                   help="--script scenarios: keep the fault-free run's reports in DIR and take them from there when "
                   "the script, its arguments, the hosts, the interpreter, torch, the CPU, linkpass's and the hook's code "
                   "and the environment (with any sitecustomize on PYTHONPATH) are the same (no second reference run)")
    d.add_argument("--keep-logs", action="store_true", help="keep the work directory (daemon and trainer logs) after a successful run")
    d.set_defaults(func=cmd_demo)
    return p


def _chosen_parser(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the sub-command ``args`` came from (``linkpass bench snapshot``'s), walking
    down from ``p`` through the chosen sub-command of each level."""
    while True:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs and subs[0].dest != argparse.SUPPRESS else None
        if name is None or name not in subs[0].choices:
            return p
        p = subs[0].choices[name]


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p.parse_args(argv)``, except that arguments no parser knows are the sub-command's error
    (its own message and usage, exit 2), not the top level's usage: argparse leaves them for
    the top-level parser, which knows nothing of the sub-command's options."""
    args, extra = p.parse_known_args(argv)
    if extra:
        _chosen_parser(p, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe or socket whose reading end is closed (poll reports POLLERR)."""
    try:
        fd = sys.__stdout__.fileno()
        p = select.poll()
        p.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so that the interpreter's flush at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Every sub-command.  A reader of stdout that goes away early (``| head -1``) ends the
    command quietly with :data:`EXIT_BROKEN_PIPE`, as SIGPIPE ends other tools, not with a
    BrokenPipeError traceback.  SIGPIPE itself stays ignored (Python's default), so the
    daemon's sockets still get EPIPE rather than a signal that would kill it."""
    try:
        args = parse_args(build_parser(), argv)
        rc = args.func(args)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
        return rc
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        _silence_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
