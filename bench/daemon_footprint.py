#!/usr/bin/env python3
"""Memory and idle CPU of linkpass daemons on an idle emulated fabric.

    sudo .venv/bin/python bench/daemon_footprint.py --hosts 2 --rails 2 --idle-s 30 \\
        --json bench/results/daemon_footprint.json

Brings up a fabric (name ``bnfp`` by default), starts one daemon per host, waits until every
daemon is ready, lets them settle, then leaves them alone for ``--idle-s`` seconds (no
control-socket queries during the window) and reads /proc:

* ``vmrss_mb``: resident memory at the end of the window (max of 1 s samples in ``vmrss_max_mb``);
* ``vmhwm_mb``: peak resident memory since the daemon started (includes start-up);
* ``idle_cpu_pct``: (utime+stime delta) / wall time of the window, in % of one core; also
  from the threads' schedstat (ns resolution) as ``idle_cpu_pct_sched``.

Targets printed beside the figures: RSS <= 80 MB, idle CPU <= 0.5 % of one core.
Prints figures, never asserts them.  Must run as root (network namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from _cluster import TARGETS, BenchCluster, machine_info, proc_cpu, proc_mem, run_and_report

SCHEMA = "linkpass.bench.daemon_footprint/v1"


def measure(args) -> dict:
    machine = machine_info()  # load average before the run
    cl = BenchCluster(args.hosts, args.rails, args.name, args.hold_down_ms)
    t_start = time.monotonic()
    try:
        cl.launch()
        time.sleep(args.settle_s)
        st0 = [cl.ask(i) for i in range(args.hosts)]
        cpu0 = [proc_cpu(p) for p in cl.pids]
        t0 = time.monotonic_ns()
        rss_max = [proc_mem(p)["vmrss_kb"] for p in cl.pids]
        end = time.monotonic() + args.idle_s
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            for k, p in enumerate(cl.pids):
                rss_max[k] = max(rss_max[k], proc_mem(p)["vmrss_kb"])
        cpu1 = [proc_cpu(p) for p in cl.pids]
        t1 = time.monotonic_ns()
        mem = [proc_mem(p) for p in cl.pids]
        st1 = [cl.ask(i) for i in range(args.hosts)]
        wall_ns = t1 - t0
        daemons = []
        for i, pid in enumerate(cl.pids):
            d_stat = cpu1[i]["stat_ns"] - cpu0[i]["stat_ns"]
            d_sched = None if cpu1[i]["sched_ns"] is None else cpu1[i]["sched_ns"] - cpu0[i]["sched_ns"]
            c0, c1 = st0[i]["counters"], st1[i]["counters"]
            daemons.append({
                "host": f"h{i}",
                "pid": pid,
                "vmrss_mb": round(mem[i]["vmrss_kb"] / 1024, 2),
                "vmrss_max_mb": round(max(rss_max[i], mem[i]["vmrss_kb"]) / 1024, 2),
                "vmhwm_mb": round(mem[i]["vmhwm_kb"] / 1024, 2),
                "threads": mem[i].get("threads"),
                "idle_cpu_pct": round(100 * d_stat / wall_ns, 4),
                "idle_cpu_pct_sched": None if d_sched is None else round(100 * d_sched / wall_ns, 4),
                "idle_cpu_ms": round(d_stat / 1e6, 1),
                "startup_cpu_ms": round(cpu0[i]["stat_ns"] / 1e6, 1),
                "events_handled_during_idle": c1["events_handled"] - c0["events_handled"],
                "notices_sent_during_idle": c1.get("notices_sent", 0) - c0.get("notices_sent", 0),
            })
        problems = cl.log_problems()
        rcs = cl.exit_codes()
        pid_check = cl.pid_check
    finally:
        cl.close()

    def mx(key):
        vals = [d[key] for d in daemons if d[key] is not None]
        return max(vals) if vals else None

    return {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "params": {"hosts": args.hosts, "rails": args.rails, "idle_s": args.idle_s, "settle_s": args.settle_s,
                   "hold_down_ms": args.hold_down_ms, "fabric_name": args.name},
        "idle_wall_s": round(wall_ns / 1e9, 3),
        "daemons": daemons,
        "max": {k: mx(k) for k in ("vmrss_mb", "vmrss_max_mb", "vmhwm_mb", "idle_cpu_pct", "idle_cpu_pct_sched")},
        "targets": {"rss_mb": TARGETS["rss_mb"], "idle_cpu_pct": TARGETS["idle_cpu_pct"]},
        "pid_check": pid_check,
        "daemons_exited_early": [f"h{i} rc {rc}" for i, rc in enumerate(rcs) if rc is not None],
        "daemon_log_problems": problems,
        "logs": str(cl.workdir),
        "loadavg_at_end": list(os.getloadavg()),
        "run_wall_s": round(time.monotonic() - t_start, 1),
    }


def print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=max(Console().width, 110))
    m = r["machine"]
    t = Table(title=f"linkpass daemon footprint: {r['params']['hosts']} hosts x {r['params']['rails']} rails, "
                    f"idle {r['idle_wall_s']} s  ({m['cpus']} CPUs, kernel {m['kernel']}, Python {m['python']})")
    for col in ("daemon", "pid", "VmRSS MB", "VmHWM MB", "idle CPU % (stat)", "idle CPU % (schedstat)", "threads", "events"):
        t.add_column(col, justify="right")
    for d in r["daemons"]:
        t.add_row(d["host"], str(d["pid"]), f"{d['vmrss_mb']:.1f}", f"{d['vmhwm_mb']:.1f}", f"{d['idle_cpu_pct']:.3f}",
                  "-" if d["idle_cpu_pct_sched"] is None else f"{d['idle_cpu_pct_sched']:.3f}", str(d["threads"]),
                  str(d["events_handled_during_idle"]))
    mx, tg = r["max"], r["targets"]

    def mark(v, lim):
        return "" if v is None else ("[green]ok[/]" if v <= lim else "[red]over[/]")

    t.add_section()
    t.add_row("max", "", f"{mx['vmrss_mb']:.1f}", f"{mx['vmhwm_mb']:.1f}", f"{mx['idle_cpu_pct']:.3f}",
              "-" if mx["idle_cpu_pct_sched"] is None else f"{mx['idle_cpu_pct_sched']:.3f}", "", "")
    t.add_row("target", "", f"<= {tg['rss_mb']:.0f} {mark(mx['vmhwm_mb'], tg['rss_mb'])}", "",
              f"<= {tg['idle_cpu_pct']} {mark(mx['idle_cpu_pct'], tg['idle_cpu_pct'])}", "", "", "")
    c.print(t)
    for line in r["pid_check"]:
        c.print(f"  {line}")
    if r["daemons_exited_early"]:
        c.print(f"[red]daemons exited early: {r['daemons_exited_early']}[/]")
    if r["daemon_log_problems"]:
        c.print(f"[yellow]{len(r['daemon_log_problems'])} warning/error line(s) in the daemon logs ({r['logs']}):[/]")
        for line in r["daemon_log_problems"][:10]:
            c.print(f"  {line}", markup=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=30.0, help="length of the idle measuring window (default 30)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="wait after the daemons are ready, before measuring (default 3)")
    ap.add_argument("--hold-down-ms", type=int, default=2000)
    ap.add_argument("--name", default="bnfp", help="fabric name (default bnfp)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here (e.g. bench/results/daemon_footprint.json)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("daemon_footprint: must run as root (it creates network namespaces)", file=sys.stderr)
        return 2
    if args.hosts < 2 or args.rails < 1 or args.idle_s <= 0:
        print("daemon_footprint: need --hosts >= 2, --rails >= 1, --idle-s > 0", file=sys.stderr)
        return 2
    return run_and_report("daemon_footprint", measure, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
