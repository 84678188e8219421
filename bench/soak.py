#!/usr/bin/env python3
"""Probe cost and false failovers: linkpass next to FRR's bfdd, idle and under random loss.

    sudo .venv/bin/python bench/soak.py --hosts 2 --rails 2 --idle-s 30 --loss-pct 2 \\
        --duration-s 600 --json bench/results/soak.json

One emulated fabric (name ``bnsoak``), one linkpass daemon per host with the *default*
configuration except ``[probe] interval_ms`` / ``detect_multiplier`` (``--interval-ms`` /
``--multiplier``; flap damping stays on), and (unless ``--no-bfd``) one FRR ``bfdd`` per host
namespace with a single-hop session over rail 0 to every other host at the same timers (the
same set-up as ``detect_bfd.py``).

Phase 1, idle (``--idle-s``): nobody queries the daemons.  CPU time (``schedstat``, ns) of every
linkpass daemon and every bfdd over the window, and per *monitored path*: a linkpass daemon
monitors ``hosts-1`` peers on each of its rails (its probe paths), a bfdd ``hosts-1`` sessions.
This is the issue's "CPU per probed path at equal interval, next to bfdd's per session".

Phase 2, load (``--load-s``, skipped with 0): ``--busy-loops`` processes (default: one per
core) spin for the window on a healthy fabric, the normal state of a GPU node (data loaders,
compilers).  Counted as in phase 3 (every rail DOWN, DEGRADED and route change is false: nothing
is wrong with the fabric), next to bfdd's session down events over the same window.

Phase 3, loss (``--duration-s``, skipped with 0): ``loss:PCT`` on every host's port on every
rail at once (each port drops PCT % of frames in each direction, so a probe round trip between
two hosts crosses four lossy hops: about 1-(1-PCT/100)^4 of round trips are lost, 7.8 % at
2 %).  Nobody queries the daemons during the phase; the counts are the difference of each
daemon's ``status()["totals"]`` before and after it:

* ``false_failovers``: history ``rail`` entries that made a rail DOWN (the rail is fine: only
  random loss);
* ``path_down``: probe paths declared DOWN;
* ``degraded``: rails marked DEGRADED (expected only above ``[probe] degraded_loss``, 10 %);
* ``route_changes``: ``routes_applied`` entries that replaced or deleted routes;
* bfdd: sessions that went down (``show bfd peers counters json``, ``session-down-events``).

Prints figures and never asserts them.  Must run as root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import (
    BenchCluster,
    BenchError,
    check_args,
    machine_info,
    proc_cpu,
    proc_mem,
    run_and_report,
)
from detect_bfd import Bfd, ensure_bfdd

from linkpass.lab import fabric as fab

SCHEMA = "linkpass.bench.soak/v1"
TARGETS = {"false_failovers": 0, "daemon_cpu_pct_8_rails": 10.0}


class SoakCluster(BenchCluster):
    """Daemons with the default config plus the probe timers (damping stays on)."""

    def __init__(self, *a, interval_ms: int, multiplier: int, realtime_priority: int | None = None, datapath: str = "auto", **kw):
        super().__init__(*a, **kw)
        self.interval_ms, self.multiplier, self.datapath = interval_ms, multiplier, datapath
        self.realtime_priority = realtime_priority

    def up(self) -> dict:
        desc = super().up()
        for h in desc["hosts"]:
            with open(h["config"], "a", encoding="utf-8") as f:
                f.write(f"\n[probe]\ninterval_ms = {self.interval_ms}\ndetect_multiplier = {self.multiplier}\n"
                        f'datapath = "{self.datapath}"\n')
            if self.realtime_priority is not None:
                self.add_config(h["index"], {"daemon": {"realtime_priority": self.realtime_priority}})
        return desc


def _cpu_ns(pid: int) -> int:
    c = proc_cpu(pid)
    return c["sched_ns"] if c["sched_ns"] is not None else c["stat_ns"]


def _bfd_down_events(bfd: Bfd) -> dict[int, int | None]:
    out = {}
    for i, v in bfd.vty.items():
        try:
            rows = json.loads(v.cmd("show bfd peers counters json"))
            out[i] = sum(int(r.get("session-down-events", 0)) for r in rows)
        except (OSError, ValueError, TypeError):
            out[i] = None
    return out


#: a busy loop (a data loader's decode thread)
SPIN = "while True: pass"
#: short processes one after another, each importing modules and exiting (a compiler's
#: workers, a launcher's helpers): new processes, page faults and exits keep the scheduler busy
#: in a way a steady spinner does not
SPAWN = ("import subprocess, sys\n"
         "while True: subprocess.run([sys.executable, '-c', 'import json, decimal, email.parser, http.client'])")


def _load_kinds(kind: str, n: int) -> list[str]:
    """``n`` load processes of ``kind`` (spin, spawn, or mixed: both, half each)."""
    if kind == "mixed":
        return ["spin" if i % 2 == 0 else "spawn" for i in range(2 * n)]
    return [kind] * n


def _window_counts(cl, hosts: int, tot0: list[dict], st: list[dict]) -> list[dict]:
    counts = []
    for i in range(hosts):
        d = {k: v - tot0[i].get(k, 0) for k, v in st[i].get("totals", {}).items()}
        counts.append({"host": f"h{i}", "false_failovers": d.get("rail_down", 0), "path_down": d.get("path_down", 0),
                       "path_suspect": d.get("path_suspect", 0), "degraded": d.get("degraded", 0),
                       "route_changes": d.get("route_changes", 0), "totals_delta": d})
    return counts


def _load_phase(args, cl, bfd, lp_pids: list[int], bfd_pids: list[int]) -> dict:
    """Busy loops on a healthy fabric: every rail DOWN, DEGRADED and route change is false."""
    n = args.busy_loops or os.cpu_count() or 2
    tot0 = [cl.ask(i).get("totals", {}) for i in range(args.hosts)]
    bfd_down0 = _bfd_down_events(bfd) if bfd else {}
    t0 = time.monotonic_ns()
    print(f"load window {args.load_s} s with {n} busy loop(s) ...", flush=True)
    nice = args.busy_nice
    procs = [subprocess.Popen([sys.executable, "-c", SPIN if k == "spin" else SPAWN],
                              preexec_fn=(lambda: os.nice(nice)) if nice else None)
             for k in _load_kinds(args.load_kind, n)]
    try:
        c0 = {p: _cpu_ns(p) for p in lp_pids + bfd_pids}
        time.sleep(args.load_s)  # nobody queries the daemons meanwhile
        c1 = {p: _cpu_ns(p) for p in lp_pids + bfd_pids}
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    t1 = time.monotonic_ns()
    bfd_down1 = _bfd_down_events(bfd) if bfd else {}
    st = [cl.ask(i) for i in range(args.hosts)]
    counts = _window_counts(cl, args.hosts, tot0, st)
    reasons = [f"h{i}: {e.get('reason')}" for i in range(args.hosts) for e in cl.history(i)
               if e.get("kind") == "rail" and e.get("new") == "DOWN" and t0 <= e.get("t_ns", 0) <= t1]
    w = t1 - t0
    return {
        "busy_loops": n, "busy_nice": args.busy_nice, "load_kind": args.load_kind, "window_s": round(w / 1e9, 1), "hosts": counts,
        "false_failovers": sum(c["false_failovers"] for c in counts),
        "false_failover_reasons": reasons,
        "path_down": sum(c["path_down"] for c in counts),
        "degraded": sum(c["degraded"] for c in counts),
        "route_changes": sum(c["route_changes"] for c in counts),
        "linkpass_cpu_pct": [round(100 * (c1[p] - c0[p]) / w, 3) for p in lp_pids],
        "bfdd_cpu_pct": [round(100 * (c1[p] - c0[p]) / w, 3) for p in bfd_pids],
        "bfdd_session_down_events": ({i: (None if bfd_down1.get(i) is None or bfd_down0.get(i) is None
                                          else bfd_down1[i] - bfd_down0[i]) for i in bfd_down1} if bfd else None),
        "probe_counters": [{k: v for k, v in s["counters"].items() if k.startswith("probes_")} for s in st],
    }


def run(args) -> dict:
    machine = machine_info()
    bfdd, bfd_note = (None, "disabled (--no-bfd)") if args.no_bfd else ensure_bfdd()
    if not args.no_bfd:
        print(f"bfdd: {bfdd or 'unavailable'} ({bfd_note})", flush=True)
    cl = SoakCluster(args.hosts, args.rails, args.name, args.hold_down_ms, interval_ms=args.interval_ms, multiplier=args.multiplier,
                      realtime_priority=args.realtime_priority, datapath=args.datapath)
    bfd = None
    t_start = time.monotonic()
    result: dict = {}
    try:
        cl.launch()
        if bfdd:
            bfd = Bfd(bfdd, cl.desc, 0, args.interval_ms, args.multiplier, Path(tempfile.mkdtemp(prefix=f"linkpass-bfdd-{args.name}-")))
            try:
                bfd.start()
            except BenchError as e:
                bfd_note += f"; start failed: {e}"
                bfd.close()
                bfd = None
        # every probe path has answered once before the window
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sts = [cl.ask(i) for i in range(args.hosts)]
            if all(len(s["paths"]) == args.rails * (args.hosts - 1) and all(p["state"] == "UP" for p in s["paths"]) for s in sts):
                break
            time.sleep(0.2)
        time.sleep(args.settle_s)
        lp_pids, bfd_pids = list(cl.pids), (bfd.pids if bfd else [])
        print(f"idle window {args.idle_s} s ...", flush=True)
        idle_tot0 = [cl.ask(i).get("totals", {}) for i in range(args.hosts)]
        idle_down0 = _bfd_down_events(bfd) if bfd else {}
        c0 = {p: _cpu_ns(p) for p in lp_pids + bfd_pids}
        w0 = time.monotonic_ns()
        time.sleep(args.idle_s)
        w1 = time.monotonic_ns()
        c1 = {p: _cpu_ns(p) for p in lp_pids + bfd_pids}
        wall = w1 - w0
        lp_paths = args.rails * (args.hosts - 1)
        idle = {
            "window_s": round(wall / 1e9, 3),
            "linkpass": [{"host": f"h{i}", "pid": p, "cpu_pct": round(100 * (c1[p] - c0[p]) / wall, 3),
                          "paths": lp_paths, "cpu_pct_per_path": round(100 * (c1[p] - c0[p]) / wall / lp_paths, 3)}
                         for i, p in enumerate(lp_pids)],
            "bfdd": [{"host": f"h{i}", "pid": p, "cpu_pct": round(100 * (c1[p] - c0[p]) / wall, 3),
                      "sessions": args.hosts - 1, "cpu_pct_per_session": round(100 * (c1[p] - c0[p]) / wall / (args.hosts - 1), 3)}
                     for i, p in enumerate(bfd_pids)],
        }
        if idle["linkpass"] and idle["bfdd"]:
            per_path = statistics.median(d["cpu_pct_per_path"] for d in idle["linkpass"])
            per_session = statistics.median(d["cpu_pct_per_session"] for d in idle["bfdd"])
            idle["bfdd_per_session_over_linkpass_per_path"] = round(per_session / per_path, 2) if per_path > 0 else None
        st = [cl.ask(i) for i in range(args.hosts)]
        # a healthy idle fabric: every rail DOWN, path DOWN, DEGRADED and route change is false
        ic = _window_counts(cl, args.hosts, idle_tot0, st)
        idle_down1 = _bfd_down_events(bfd) if bfd else {}
        idle["harm"] = {k: sum(c[k] for c in ic) for k in ("false_failovers", "path_down", "degraded", "route_changes")}
        idle["bfdd_session_down_events"] = ({i: (None if idle_down1.get(i) is None or idle_down0.get(i) is None
                                                 else idle_down1[i] - idle_down0[i]) for i in idle_down1} if bfd else None)
        idle["probe_counters"] = [{k: v for k, v in s["counters"].items() if k.startswith("probes_")} for s in st]
        result["idle"] = idle
        result["paths_fast"] = [sum(1 for p in s["paths"] if p.get("fast", True)) for s in st]
        if args.load_s > 0:
            result["load"] = _load_phase(args, cl, bfd, lp_pids, bfd_pids)

        if args.duration_s > 0:
            tot0 = [cl.ask(i).get("totals", {}) for i in range(args.hosts)]
            t_cut = time.monotonic_ns()
            bfd_down0 = _bfd_down_events(bfd) if bfd else {}
            for h in range(args.hosts):
                for r in range(args.rails):
                    fab.cut(args.name, h, r, f"loss:{args.loss_pct}")
            print(f"loss:{args.loss_pct} on every port for {args.duration_s} s ...", flush=True)
            l0 = {p: _cpu_ns(p) for p in lp_pids + bfd_pids}
            time.sleep(args.duration_s)  # nobody queries the daemons meanwhile
            l1 = {p: _cpu_ns(p) for p in lp_pids + bfd_pids}
            t_end = time.monotonic_ns()
            bfd_down1 = _bfd_down_events(bfd) if bfd else {}
            st = [cl.ask(i) for i in range(args.hosts)]
            fab.heal(args.name)
            counts = _window_counts(cl, args.hosts, tot0, st)
            # the reasons, from what the history still holds
            reasons = [f"h{i}: {e.get('reason')}" for i in range(args.hosts) for e in cl.history(i)
                       if e.get("kind") == "rail" and e.get("new") == "DOWN" and t_cut <= e.get("t_ns", 0) <= t_end]
            lw = t_end - t_cut
            result["loss"] = {
                "loss_pct_per_port": args.loss_pct, "duration_s": round((t_end - t_cut) / 1e9, 1),
                "round_trip_loss_expected": round(1 - (1 - args.loss_pct / 100) ** 4, 4),
                "hosts": counts,
                "false_failovers": sum(c["false_failovers"] for c in counts),
                "false_failover_reasons": reasons,
                "path_down": sum(c["path_down"] for c in counts),
                "degraded": sum(c["degraded"] for c in counts),
                "route_changes": sum(c["route_changes"] for c in counts),
                "probe_loss_seen": [{str(r["id"]): r.get("probe_loss") for r in s["rails"]} for s in st],
                "linkpass_cpu_pct": [round(100 * (l1[p] - l0[p]) / lw, 3) for p in lp_pids],
                "bfdd_cpu_pct": [round(100 * (l1[p] - l0[p]) / lw, 3) for p in bfd_pids],
                "bfdd_session_down_events": ({i: (None if bfd_down1.get(i) is None or bfd_down0.get(i) is None
                                                  else bfd_down1[i] - bfd_down0[i]) for i in bfd_down1} if bfd else None),
                "probe_counters": [{k: v for k, v in s["counters"].items() if k.startswith("probes_")} for s in st],
            }
        result["mem"] = {f"h{i}": round(proc_mem(p).get("vmhwm_kb", 0) / 1024, 1) for i, p in enumerate(lp_pids)}
        result["daemon_log_problems"] = cl.log_problems(20)
    finally:
        if bfd:
            bfd.close()
        cl.close()
    return {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "params": {k: getattr(args, k) for k in ("hosts", "rails", "interval_ms", "multiplier", "idle_s", "load_s",
                                                 "busy_loops", "busy_nice", "load_kind", "realtime_priority", "loss_pct", "duration_s", "hold_down_ms", "datapath", "name")},
        "targets": TARGETS,
        "bfdd_note": bfd_note,
        **result,
        "logs": str(cl.workdir),
        "run_wall_s": round(time.monotonic() - t_start, 1),
    }


def print_report(r: dict) -> None:
    p = r["params"]
    print(f"\nsoak: {p['hosts']} hosts x {p['rails']} rails, {p['interval_ms']} ms x {p['multiplier']}, datapath {p.get('datapath', 'auto')} "
          f"({r['machine'].get('cpus')} CPUs); bfdd: {r['bfdd_note']}")
    idle = r["idle"]
    print(f"idle {idle['window_s']} s, CPU % of one core (schedstat):")
    for d in idle["linkpass"]:
        print(f"  linkpass {d['host']}: {d['cpu_pct']:.2f} % for {d['paths']} paths = {d['cpu_pct_per_path']:.2f} % per path")
    for d in idle["bfdd"]:
        print(f"  bfdd     {d['host']}: {d['cpu_pct']:.2f} % for {d['sessions']} session(s) = {d['cpu_pct_per_session']:.2f} % per session")
    ratio = idle.get("bfdd_per_session_over_linkpass_per_path")
    if ratio is not None:
        print(f"  bfdd per session / linkpass per path: x{ratio} (median of each)")
    h = idle.get("harm") or {}
    print(f"  healthy idle fabric: false failovers {h.get('false_failovers')}, path DOWN {h.get('path_down')}, "
          f"DEGRADED {h.get('degraded')}, route changes {h.get('route_changes')} (target 0 each); "
          f"bfdd session downs {idle.get('bfdd_session_down_events')}")
    for i, c in enumerate(idle["probe_counters"]):
        print(f"  h{i} probe counters: " + ", ".join(f"{k[7:]}={v}" for k, v in sorted(c.items())))
    load = r.get("load")
    if load:
        print(f"load: {load['busy_loops']} x {load.get('load_kind', 'spin')} load (nice {load.get('busy_nice', 0)}) for {load['window_s']} s on a healthy fabric:")
        print(f"  false failovers {load['false_failovers']} (target 0), DEGRADED {load['degraded']} (target 0), "
              f"route changes {load['route_changes']} (target 0), path DOWN {load['path_down']}")
        for why in load["false_failover_reasons"]:
            print(f"    rail DOWN: {why}")
        print(f"  linkpass CPU % {load['linkpass_cpu_pct']}, bfdd CPU % {load['bfdd_cpu_pct']}, "
              f"bfdd session down events {load['bfdd_session_down_events']}")
        for i, c in enumerate(load["probe_counters"]):
            keep = {k[7:]: v for k, v in c.items() if k[7:] in ("timeouts", "voided_lag", "late_wakeups", "peer_silent_misses", "rx_dropped", "late")}
            print(f"  h{i} probe counters since start: {keep}")
    loss = r.get("loss")
    if loss:
        print(f"loss:{loss['loss_pct_per_port']} on every port for {loss['duration_s']} s "
              f"(round trips lost: about {100 * loss['round_trip_loss_expected']:.1f} %):")
        print(f"  false failovers {loss['false_failovers']} (target 0), path DOWN {loss['path_down']}, "
              f"DEGRADED {loss['degraded']}, route changes {loss['route_changes']}")
        for why in loss["false_failover_reasons"]:
            print(f"    rail DOWN: {why}")
        for c in loss["hosts"]:
            print(f"  {c['host']}: {c}")
        print(f"  probe loss seen per rail: {loss['probe_loss_seen']}")
        print(f"  linkpass CPU % {loss['linkpass_cpu_pct']}, bfdd CPU % {loss['bfdd_cpu_pct']}, "
              f"bfdd session down events {loss['bfdd_session_down_events']}")
    print(f"VmHWM MB: {r['mem']}")
    for line in r.get("daemon_log_problems", [])[:10]:
        print(f"  log: {line}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--interval-ms", type=int, default=10)
    ap.add_argument("--multiplier", type=int, default=3)
    ap.add_argument("--hold-down-ms", type=int, default=2000)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--load-s", type=float, default=60.0, help="busy-loop phase length; 0 skips it")
    ap.add_argument("--busy-loops", type=int, default=0, help="busy processes in the load phase (0: one per core)")
    ap.add_argument("--load-kind", choices=("spin", "spawn", "mixed"), default="mixed",
                    help="spin: busy loops; spawn: short processes back to back; mixed: --busy-loops of each")
    ap.add_argument("--busy-nice", type=int, default=0, help="nice increment of the busy processes (negative: they "
                    "outrank the daemons, like a training job given priority)")
    ap.add_argument("--realtime-priority", type=int, default=None, metavar="N",
                    help="the daemons' [daemon] realtime_priority (0: the normal policy; default: the config's default)")
    ap.add_argument("--loss-pct", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=600.0, help="loss phase length; 0 skips it")
    ap.add_argument("--datapath", choices=("auto", "c", "python"), default="auto",
                    help="[probe] datapath of the daemons (default: the config default, auto)")
    ap.add_argument("--no-bfd", action="store_true")
    ap.add_argument("--name", default="bnsoak")
    ap.add_argument("--json", metavar="FILE")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hosts < 2 or args.rails < 1 or not 1 <= args.loss_pct <= 100 or args.idle_s <= 0:
        print("soak.py: needs --hosts >= 2, --rails >= 1, --loss-pct 1..100, --idle-s > 0", file=sys.stderr)
        return 2
    bad = check_args("soak.py", args, positive=("interval_ms", "multiplier"),
                     non_negative=("hold_down_ms", "settle_s", "duration_s", "load_s", "busy_loops"))
    if bad:
        return bad
    return run_and_report("soak.py", run, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
