#!/usr/bin/env python3
"""Detection and reroute latency of linkpass daemons under repeated rail cuts.

    sudo .venv/bin/python bench/detect_reroute.py --cuts 50 --modes admin-down,carrier-loss \\
        --hosts 2 --rails 2 --hold-down-ms 200 --json bench/results/detect_reroute.json

One emulated fabric (name ``bndr`` by default), one daemon per host.  For each fault mode,
``--cuts`` times, on (host, rail) pairs taken in turn so that both hosts and all rails get cut:

1. cut the link (``fab.cut``; its ``t_issued_ns`` is taken just before the kernel change);
2. wait until the faulty host has routes without the rail and every peer has replaced its
   routes to the faulty host (control-socket ``status``; more than ``--timeout-s`` = a miss);
3. heal the link and wait for fail-back on every host (hold-down included);

then read the daemons' histories and compute, per cut (monotonic clock, shared by all
processes on this machine):

* ``detect_ms``: cut issued -> the faulty host's daemon records the rail DOWN;
* ``reroute_ms``: DOWN recorded -> routes of the first plan without the rail ACKed by the kernel;
* ``peer_reroute_ms``: DOWN recorded on the faulty host -> the slowest peer's routes replaced
  after it heard the faulty host's notice;
* ``failback_ms``: heal issued -> routes using the rail again ACKed on the faulty host
  (includes the hold-down);
* breakdown (JSON only): ``netlink_rx_ms`` (cut -> netlink event received), ``peer_notice_ms``
  (DOWN -> slowest peer accepted the notice), ``peer_failback_ms``.

Modes that leave the carrier up (``blackhole``, ``loss:PCT``) are seen only by the probes; such a
mode is tried once first and, when that cut is not detected (a low loss is not a failure),
reported as "not detected" and not repeated.

Flap damping (``[damping]``, on by default in the product) is off in the daemons' configs unless
``--damping``: the cuts come a few seconds apart, which the damper rightly treats as a flapping
rail, and after the third it keeps the rail suppressed, so later cuts would measure the damper
rather than detection and reroute (issue 17: 25 of 30 cuts missed).  Every figure printed and the
JSON's ``params.damping`` say which setting it was measured with.

Also reports the daemons' CPU time over the run (utime+stime from /proc/PID/stat; includes
serving this benchmark's status/history queries) and their peak RSS (VmHWM).
Prints figures, never asserts them.  Must run as root (network namespaces).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

from _cluster import (
    TARGETS,
    BenchCluster,
    run_and_report,
    machine_info,
    proc_cpu,
    proc_mem,
    summary,
)

from linkpass.lab import fabric as fab

SCHEMA = "linkpass.bench.detect_reroute/v1"
NOT_DETECTED = "not detected"
METRICS = ("detect_ms", "reroute_ms", "peer_reroute_ms", "failback_ms")
EXTRA = ("netlink_rx_ms", "peer_notice_ms", "peer_failback_ms")
POLL_S = 0.02
HISTORY_EVERY = 20  # cuts between history reads (the daemon keeps the last 2000 entries)


def cut_order(hosts: int, rails: int) -> list[tuple[int, int]]:
    """Every (host, rail) pair once, consecutive pairs differing in host (and rail when possible)."""
    return [(k % hosts, (k + k // hosts) % rails) for k in range(hosts * rails)]


def _first(entries, pred):
    return next((e for e in entries if pred(e)), None)


class Runner:
    def __init__(self, args, cl: BenchCluster):
        self.args, self.cl = args, cl
        self.hist: dict[int, dict[tuple, dict]] = {i: {} for i in range(args.hosts)}

    # ---------------------------------------------------------------- waiting

    def _down_done(self, host: int, rail: int) -> bool:
        st = self.cl.ask(host)
        r = next(x for x in st["rails"] if x["id"] == rail)
        if r["usable"] or st["applied_generation"] < st["generation"]:
            return False
        for i in range(self.args.hosts):
            if i == host:
                continue
            ps = self.cl.ask(i)
            p = next(x for x in ps["peers"] if x["name"] == f"h{host}")
            if p["usable_rails"] is None or rail in p["usable_rails"] or ps["applied_generation"] < ps["generation"]:
                return False
        return True

    def _up_done(self, host: int, rail: int) -> bool:
        st = self.cl.ask(host)
        r = next(x for x in st["rails"] if x["id"] == rail)
        if not r["usable"] or st["applied_generation"] < st["generation"]:
            return False
        for i in range(self.args.hosts):
            if i == host:
                continue
            ps = self.cl.ask(i)
            p = next(x for x in ps["peers"] if x["name"] == f"h{host}")
            if p["usable_rails"] is None or rail not in p["usable_rails"] or ps["applied_generation"] < ps["generation"]:
                return False
        return True

    def _wait(self, pred, timeout: float, first_sleep: float) -> bool:
        """Sleep ``first_sleep`` without touching the daemons (so queries do not compete with
        the event being measured), then poll ``pred`` every POLL_S until ``timeout``."""
        deadline = time.monotonic() + timeout
        time.sleep(min(first_sleep, timeout))
        while True:
            try:
                if pred():
                    return True
            except (OSError, ValueError, KeyError, StopIteration):
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def _pull_history(self) -> None:
        for i in range(self.args.hosts):
            for e in self.cl.ask(i, "history", timeout=10)["history"]:
                self.hist[i][(e["kind"], e["t_ns"], json.dumps(e, sort_keys=True))] = e

    def history(self, i: int) -> list[dict]:
        return sorted(self.hist[i].values(), key=lambda e: e["t_ns"])

    # ---------------------------------------------------------------- one mode

    def run_mode(self, mode: str) -> dict:
        a = self.args
        kind = fab.parse_fault_mode(mode)[0]
        no_probe_mode = kind in ("blackhole", "loss")
        order = cut_order(a.hosts, a.rails)
        cuts = []
        t_mode0 = time.monotonic_ns()
        for k in range(a.cuts):
            host, rail = order[k % len(order)]
            c = fab.cut(a.name, host, rail, mode)
            t_cut = c["t_issued_ns"]
            down_ok = self._wait(lambda: self._down_done(host, rail), a.timeout_s, a.first_poll_ms / 1000)
            t_down_seen = time.monotonic_ns()
            h = fab.heal(a.name, host, rail)
            t_heal = h["t_issued_ns"] or time.monotonic_ns()
            up_ok = self._wait(lambda: self._up_done(host, rail), a.timeout_s + a.hold_down_ms / 1000,
                               (a.hold_down_ms + a.first_poll_ms) / 1000)
            cuts.append({"i": k, "host": host, "rail": rail, "t_cut": t_cut, "t_heal": t_heal,
                         "waited_ms": round((t_down_seen - t_cut) / 1e6, 1), "down_ok": down_ok, "up_ok": up_ok})
            if not up_ok:
                # the next cut would start from a broken picture: give it a little longer
                self._wait(lambda: self._up_done(host, rail), a.timeout_s, 0)
            if (k + 1) % HISTORY_EVERY == 0:
                self._pull_history()
            if no_probe_mode and k == 0 and not down_ok:
                break  # expected: nothing in this version can see a carrier-up fault
        time.sleep(0.05)
        self._pull_history()
        t_mode1 = time.monotonic_ns()
        return self.analyse(mode, cuts, t_mode0, t_mode1, no_probe_mode)

    # ---------------------------------------------------------------- analysis

    def analyse(self, mode: str, cuts: list[dict], t0: int, t1: int, no_probe_mode: bool) -> dict:
        H = {i: self.history(i) for i in range(self.args.hosts)}
        samples = []
        for n, c in enumerate(cuts):
            host, rail, t_cut, t_heal = c["host"], c["rail"], c["t_cut"], c["t_heal"]
            t_end = cuts[n + 1]["t_cut"] if n + 1 < len(cuts) else t1
            win = {i: [e for e in H[i] if t_cut <= e["t_ns"] < t_end] for i in H}
            mine = win[host]
            s = {"i": c["i"], "host": host, "rail": rail, "down_ok": c["down_ok"], "up_ok": c["up_ok"],
                 "t_cut_ns": t_cut, "t_heal_ns": t_heal}
            s.update({m: None for m in METRICS + EXTRA})
            down = _first(mine, lambda e: e["kind"] == "rail" and e["rail"] == rail and e["new"] == "DOWN" and e["t_ns"] < t_heal)
            if down:
                t_dec = down["t_ns"]
                s["detect_ms"] = (t_dec - t_cut) / 1e6
                s["netlink_rx_ms"] = (down["event_t_ns"] - t_cut) / 1e6
                plan = _first(mine, lambda e: e["kind"] == "plan" and e["t_ns"] >= t_dec and rail not in e["usable"])
                ap = plan and _first(mine, lambda e: e["kind"] == "routes_applied" and e["generation"] >= plan["generation"])
                if ap:
                    s["reroute_ms"] = (ap["t_ns"] - t_dec) / 1e6
                peer_t, notice_t = [], []
                for i, ev in win.items():
                    if i == host:
                        continue
                    pr = _first(ev, lambda e: e["kind"] == "peer_rails" and e["peer"] == f"h{host}" and rail not in e["usable"] and e["t_ns"] < t_heal)
                    pplan = pr and _first(ev, lambda e: e["kind"] == "plan" and e["t_ns"] >= pr["t_ns"])
                    pap = pplan and _first(ev, lambda e: e["kind"] == "routes_applied" and e["generation"] >= pplan["generation"])
                    notice_t.append(None if not pr else (pr["t_ns"] - t_dec) / 1e6)
                    peer_t.append(None if not pap else (pap["t_ns"] - t_dec) / 1e6)
                if peer_t and None not in peer_t:
                    s["peer_reroute_ms"] = max(peer_t)
                if notice_t and None not in notice_t:
                    s["peer_notice_ms"] = max(notice_t)
            upplan = _first(mine, lambda e: e["kind"] == "plan" and e["t_ns"] >= t_heal and rail in e["usable"])
            fap = upplan and _first(mine, lambda e: e["kind"] == "routes_applied" and e["generation"] >= upplan["generation"])
            if fap:
                s["failback_ms"] = (fap["t_ns"] - t_heal) / 1e6
            pf = []
            for i, ev in win.items():
                if i == host:
                    continue
                pr = _first(ev, lambda e: e["kind"] == "peer_rails" and e["peer"] == f"h{host}" and rail in e["usable"] and e["t_ns"] >= t_heal)
                pplan = pr and _first(ev, lambda e: e["kind"] == "plan" and e["t_ns"] >= pr["t_ns"])
                pap = pplan and _first(ev, lambda e: e["kind"] == "routes_applied" and e["generation"] >= pplan["generation"])
                pf.append(None if not pap else (pap["t_ns"] - t_heal) / 1e6)
            if pf and None not in pf:
                s["peer_failback_ms"] = max(pf)
            for m in METRICS + EXTRA:
                if s[m] is not None:
                    s[m] = round(s[m], 3)
            samples.append(s)

        applied = [e for i in H for e in H[i] if e["kind"] == "routes_applied" and t0 <= e["t_ns"] < t1]
        changes = [e for e in applied if (e.get("replaced", 0) + e.get("deleted", 0)) > 0]
        route_errors = [f"h{i} gen {e['generation']}: {err}" for i in H for e in H[i]
                        if e["kind"] == "routes_applied" and t0 <= e["t_ns"] < t1 for err in e.get("errors", [])]
        disturbed = sum(1 for i in H for e in H[i] if e["kind"] == "route_disturbed" and t0 <= e["t_ns"] < t1)
        detected = sum(1 for s in samples if s["detect_ms"] is not None)
        out = {
            "status": "ok",
            "cuts": len(samples),
            "detected": detected,
            "misses": sum(1 for s in samples if not (s["down_ok"] and s["detect_ms"] is not None and s["reroute_ms"] is not None
                                                    and s["peer_reroute_ms"] is not None)),
            "failback_misses": sum(1 for s in samples if not (s["up_ok"] and s["failback_ms"] is not None)),
            **{m: summary([s[m] for s in samples if s[m] is not None]) for m in METRICS + EXTRA},
            "failback_over_hold_down_ms": summary([s["failback_ms"] - self.args.hold_down_ms for s in samples if s["failback_ms"] is not None]),
            "route_changes": len(changes),
            "route_changes_expected": len(samples) * 2 * self.args.hosts,
            "routes_applied_total": len(applied),
            "route_errors": route_errors,
            "routes_disturbed": disturbed,
            "wall_s": round((t1 - t0) / 1e9, 2),
            "samples": samples,
        }
        if no_probe_mode and detected == 0:
            out["status"] = NOT_DETECTED
            out["misses"] = 0
            out["failback_misses"] = 0
        out["route_changes_expected"] = 0 if out["status"] != "ok" else out["route_changes_expected"]
        return out


_GC_LINE = re.compile(r"GCTRACE gen(\d) ([0-9.]+) ms start_ns (\d+)")


def gc_pauses(logs: list[Path]) -> dict[int, list[tuple[int, int, float]]]:
    """Per host index, the (generation, start_ns, ms) GC pauses a ``--gc-trace`` daemon logged."""
    out = {}
    for i, path in enumerate(logs):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            text = ""
        out[i] = [(int(m[1]), int(m[3]), float(m[2])) for m in _GC_LINE.finditer(text)]
    return out


def attach_gc(modes: dict, pauses: dict, targets: dict) -> dict:
    """Mark each sample with the daemon GC pauses that overlap its measured interval, and
    count how many over-target samples have one."""
    outliers = with_gc = 0
    for d in modes.values():
        for s in d["samples"]:
            if s["detect_ms"] is None:
                continue
            t0 = s["t_cut_ns"]
            t1 = t0 + int((s["detect_ms"] + max(s["reroute_ms"] or 0, s["peer_reroute_ms"] or 0)) * 1e6)
            s["gc_pauses"] = [{"host": f"h{h}", "gen": g, "ms": ms} for h, ps in pauses.items() for g, st, ms in ps
                              if st < t1 and st + ms * 1e6 > t0]
            if s["detect_ms"] > targets["detect_p99_ms"] or (s["reroute_ms"] or 0) > targets["reroute_p99_ms"]:
                outliers += 1
                with_gc += bool(s["gc_pauses"])
    per_host = {}
    for h, ps in pauses.items():
        per_host[f"h{h}"] = {f"gen{g}": {"count": sum(1 for x in ps if x[0] == g),
                                         "max_ms": max((x[2] for x in ps if x[0] == g), default=None)} for g in (0, 1, 2)}
    return {"pauses": per_host, "over_target_samples": outliers, "over_target_samples_with_gc_pause": with_gc,
            "note": "pauses listed are collections of 1 ms or more and every full (gen2) collection"}


class RerouteCluster(BenchCluster):
    """BenchCluster whose daemons run with flap damping off unless ``damping``."""

    def __init__(self, *a, damping: bool = False, **kw):
        super().__init__(*a, **kw)
        self.damping = damping

    def up(self) -> dict:
        desc = super().up()
        if not self.damping:
            for h in desc["hosts"]:
                with open(h["config"], "a", encoding="utf-8") as f:
                    f.write("\n[damping]\nenabled = false\n")
        return desc


def run(args) -> dict:
    argv = [str(Path(__file__).resolve().with_name("_gctrace.py"))] if args.gc_trace else None
    machine = machine_info()  # load average before the run
    cl = RerouteCluster(args.hosts, args.rails, args.name, args.hold_down_ms, daemon_argv=argv, damping=args.damping)
    t_start = time.monotonic()
    try:
        cl.launch()
        time.sleep(0.5)
        cpu0 = [proc_cpu(p) for p in cl.pids]
        tw0 = time.monotonic_ns()
        q0 = cl.queries
        runner = Runner(args, cl)
        modes = {}
        for mode in args.modes:
            print(f"mode {mode}: {args.cuts} cuts ...", flush=True)
            modes[mode] = runner.run_mode(mode)
            m = modes[mode]
            print(f"  {m['status']} (damping {'on' if args.damping else 'off'}): {m['cuts']} cuts, {m['misses']} misses, detect p50 {m['detect_ms']['p50']} ms, "
                  f"{m['wall_s']} s", flush=True)
        cpu1 = [proc_cpu(p) for p in cl.pids]
        tw1 = time.monotonic_ns()
        mem = [proc_mem(p) for p in cl.pids]
        queries = cl.queries - q0
        problems = cl.log_problems()
        rcs = cl.exit_codes()
        pid_check = cl.pid_check
    finally:
        cl.close()
    wall = tw1 - tw0
    gc_info = attach_gc(modes, gc_pauses([cl.logs[i] for i in sorted(cl.logs)]), TARGETS) if args.gc_trace else None
    daemons = []
    for i, pid in enumerate(cl.pids):
        d = cpu1[i]["stat_ns"] - cpu0[i]["stat_ns"]
        ds = None if cpu1[i]["sched_ns"] is None else cpu1[i]["sched_ns"] - cpu0[i]["sched_ns"]
        daemons.append({"host": f"h{i}", "pid": pid, "cpu_s": round(d / 1e9, 3),
                        "cpu_s_sched": None if ds is None else round(ds / 1e9, 3),
                        "cpu_pct": round(100 * d / wall, 3),
                        "vmrss_mb": round(mem[i]["vmrss_kb"] / 1024, 2), "vmhwm_mb": round(mem[i]["vmhwm_kb"] / 1024, 2)})
    return {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "params": {"cuts": args.cuts, "modes": args.modes, "hosts": args.hosts, "rails": args.rails,
                   "hold_down_ms": args.hold_down_ms, "timeout_s": args.timeout_s, "first_poll_ms": args.first_poll_ms,
                   "fabric_name": args.name, "cut_order": cut_order(args.hosts, args.rails), "gc_trace": args.gc_trace,
                   "damping": args.damping},
        "targets": {"detect_p99_ms": TARGETS["detect_p99_ms"], "reroute_p99_ms": TARGETS["reroute_p99_ms"],
                    "rss_mb": TARGETS["rss_mb"]},
        "modes": modes,
        "daemons": daemons,
        "daemons_max": {"cpu_s": max(d["cpu_s"] for d in daemons), "cpu_pct": max(d["cpu_pct"] for d in daemons),
                        "vmhwm_mb": max(d["vmhwm_mb"] for d in daemons)},
        "gc_trace": gc_info,
        "measured_wall_s": round(wall / 1e9, 2),
        "control_queries": queries,
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
    p, m, tg = r["params"], r["machine"], r["targets"]
    t = Table(title=f"linkpass detect/reroute: {p['hosts']} hosts x {p['rails']} rails, {p['cuts']} cuts per mode, "
                    f"hold-down {p['hold_down_ms']} ms, flap damping {'on' if p.get('damping') else 'off'} "
                    f"({m['cpus']} CPUs, kernel {m['kernel']}, Python {m['python']})")
    for col in ("mode", "figure", "n", "p50 ms", "p99 ms", "max ms", "target"):
        t.add_column(col, justify="right" if col not in ("mode", "figure") else "left")
    target = {"detect_ms": tg["detect_p99_ms"], "reroute_ms": tg["reroute_p99_ms"]}
    for mode, d in r["modes"].items():
        if d["status"] != "ok":
            t.add_row(mode, f"[yellow]{d['status']}[/]", str(d["cuts"]), "", "", "", "")
            t.add_section()
            continue
        for k, fig in enumerate(METRICS):
            s = d[fig]
            tcell = ""
            if fig in target and s["p99"] is not None:
                ok = s["p99"] <= target[fig]
                tcell = f"p99 <= {target[fig]:g} " + ("[green]ok[/]" if ok else "[red]over[/]")
            fmt = (lambda x: "-" if x is None else f"{x:.3f}")
            t.add_row(mode if k == 0 else "", fig, str(s["n"]), fmt(s["p50"]), fmt(s["p99"]), fmt(s["max"]), tcell)
        miss = "[red]" if d["misses"] or d["failback_misses"] else ""
        t.add_row("", f"{miss}misses {d['misses']}, failback misses {d['failback_misses']}",
                  "", "", "", "", "")
        t.add_row("", f"route changes {d['route_changes']} (expected {d['route_changes_expected']}), "
                      f"route errors {len(d['route_errors'])}", "", "", "", "", "")
        t.add_section()
    c.print(t)
    dt = Table(title=f"daemons over the measured {r['measured_wall_s']} s ({r['control_queries']} control queries served)")
    for col in ("daemon", "pid", "CPU s", "CPU % of one core", "VmRSS MB", "VmHWM MB"):
        dt.add_column(col, justify="right")
    for d in r["daemons"]:
        dt.add_row(d["host"], str(d["pid"]), f"{d['cpu_s']:.2f}", f"{d['cpu_pct']:.2f}", f"{d['vmrss_mb']:.1f}",
                   f"{d['vmhwm_mb']:.1f} " + ("[green]ok[/]" if d["vmhwm_mb"] <= tg["rss_mb"] else "[red]over[/]"))
    c.print(dt)
    for line in r["pid_check"]:
        c.print(f"  {line}")
    g = r.get("gc_trace")
    if g:
        worst = {h: max((v["max_ms"] or 0) for v in x.values()) for h, x in g["pauses"].items()}
        gen2 = {h: x["gen2"]["count"] for h, x in g["pauses"].items()}
        c.print(f"  GC trace: {g['over_target_samples_with_gc_pause']} of {g['over_target_samples']} over-target samples overlap a "
                f"daemon GC pause; full collections per daemon {gen2}, longest pause (ms) {worst}")
    if r["daemons_exited_early"]:
        c.print(f"[red]daemons exited early: {r['daemons_exited_early']}[/]")
    if r["daemon_log_problems"]:
        c.print(f"[yellow]{len(r['daemon_log_problems'])} warning/error line(s) in the daemon logs ({r['logs']}):[/]")
        for line in r["daemon_log_problems"][:10]:
            c.print(f"  {line}", markup=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuts", type=int, default=50, help="cuts per mode (default 50)")
    ap.add_argument("--modes", default="admin-down,carrier-loss",
                    help="comma-separated fault modes (default admin-down,carrier-loss)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--hold-down-ms", type=int, default=200)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="a cut not rerouted everywhere in this time is a miss (default 5)")
    ap.add_argument("--first-poll-ms", type=float, default=30.0,
                    help="quiet time after a cut (and after hold-down on heal) before polling the daemons (default 30)")
    ap.add_argument("--name", default="bndr", help="fabric name (default bndr)")
    ap.add_argument("--gc-trace", action="store_true",
                    help="start the daemons through bench/_gctrace.py, which logs their garbage-collector pauses, and "
                         "match the pauses with the slow samples (diagnostic; not for the reference figures)")
    ap.add_argument("--damping", action="store_true",
                    help="keep flap damping on as configured by default (off otherwise: cuts seconds apart are flaps to it)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here (e.g. bench/results/detect_reroute.json)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("detect_reroute: must run as root (it creates network namespaces)", file=sys.stderr)
        return 2
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    try:
        args.modes = [fab.parse_fault_mode(x)[2] for x in args.modes]
    except fab.FabricError as e:
        print(f"detect_reroute: {e}", file=sys.stderr)
        return 2
    if args.hosts < 2 or args.rails < 2 or args.cuts < 1 or not args.modes:
        print("detect_reroute: need --hosts >= 2, --rails >= 2 (a rail to fail over to), --cuts >= 1, a mode", file=sys.stderr)
        return 2
    return run_and_report("detect_reroute", run, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
