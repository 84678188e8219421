#!/usr/bin/env python3
"""Detection latency of linkpass next to FRR's bfdd, same fabric, same timers, same cuts.

    sudo .venv/bin/python bench/detect_bfd.py --mode blackhole --trials 10 \\
        --json bench/results/detect_bfd_blackhole.json
    # or: linkpass bench detect --mode blackhole --trials 10 --json FILE

One emulated fabric (name ``bnbfd`` by default), one linkpass daemon per host with
``[probe] interval_ms`` / ``detect_multiplier`` set to ``--interval-ms`` / ``--multiplier``, and
(unless ``--no-bfd``) one FRR ``bfdd`` per host namespace with a single-hop BFD peer over rail 0
to every other host, ``receive-interval`` = ``transmit-interval`` = ``--interval-ms`` and
``detect-multiplier`` = ``--multiplier``.  The daemons' flap damping is disabled (``[damping]
enabled = false``) unless ``--damping``: the trials are cuts about a second apart, which the damper would otherwise
treat as a flapping rail and keep suppressed after the third.  bfdd runs without zebra (it needs none for a
session bound to local/peer addresses), each instance under its own ``-N`` path space.

``--trials`` times: ``fab.cut(mode)`` on host 1 rail 0; poll bfdd's vty socket (``show bfd
peers json``, every ``--bfd-poll-ms``) until host 1's session to host 0 says "down", and the
linkpass daemon until the rail is unusable; heal; wait until linkpass uses the rail again and
the BFD session is back up.  Then, from the daemons' histories (monotonic clock):

* linkpass ``detect_ms``: cut issued -> host 1 records rail 0 DOWN (history ``rail``);
  ``avoid_ms``: cut issued -> host 1's routes leave rail 0: its own DOWN, or host 0's notice
  that rail 0 failed at its end (history ``peer_rails``), whichever comes first (with one peer
  per rail either end may be the first to judge a loss; ``avoided_by_peer_notice`` counts the
  trials where host 0 was);
  ``path_down_ms``: cut issued -> first probe path on rail 0 DOWN (history ``path``);
* ``reroute_ms``: DOWN -> kernel ACK of the first plan without the rail;
* ``false_failovers``: rail DOWN entries on any rail other than the cut one (any host);
  host 0's rail 0 going DOWN too is counted apart (``peer_side_down``): with one peer on the
  rail it cannot tell a blackhole on host 1's port from one on its own.  Under a light loss
  (``loss:PCT`` with PCT <= LIGHT_LOSS_PCT, 2: a loss the rail must keep its traffic through)
  every rail DOWN counts, the cut rail's too, ``misses`` is None (nothing to detect), and a
  bfdd session Down is counted in ``bfdd.false_downs``; run it as one long trial, e.g.
  ``--mode loss:2 --trials 1 --timeout-s 600``;
* ``route_changes``: routes_applied entries that replaced or deleted routes; per trial and host
  also those while the fault lasted (``route_changes_in_fault``: with ``--damping`` and a
  ``flap:MS:N`` burst held for ``--burst-s``, at most one per host is the target);
* bfdd ``detect_ms``: cut issued -> first poll that reads "down" (resolution: the poll period
  plus one vty round trip, about 0.1 ms);
* CPU time (utime+stime, /proc/PID/stat) and VmHWM of every linkpass daemon and bfdd over the
  trials; ``cpu_pct`` (per host, % of one core over the trials) in both ``linkpass`` and
  ``bfdd``, and per daemon in their ``daemons`` lists.  bfdd's CPU includes answering this script's polls; linkpass's includes its
  status queries.

Installs frr with apt-get when bfdd is missing; if that fails, says so and runs linkpass only.
Prints figures, never asserts them.  Must run as root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
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
    run_and_report,
    machine_info,
    proc_cpu,
    proc_mem,
    summary,
)

from linkpass.lab import fabric as fab
from linkpass.lab.benchcmd import add_detect_options

SCHEMA = "linkpass.bench.detect_bfd/v1"
BFDD_CANDIDATES = ("/usr/lib/frr/bfdd", "/usr/sbin/bfdd", "/usr/local/sbin/bfdd")
CUT_HOST, CUT_RAIL = 1, 0
TARGETS = {"blackhole_detect_p99_ms": 50.0, "carrier_loss_speedup_vs_bfdd": 10.0}
#: loss:PCT at or below this is no fault to fail over for: any rail DOWN under it is false
LIGHT_LOSS_PCT = 2


def light_loss(mode: str) -> bool:
    return mode.startswith("loss:") and int(mode.split(":")[1]) <= LIGHT_LOSS_PCT


# --------------------------------------------------------------------------- bfdd


def find_bfdd() -> str | None:
    for p in BFDD_CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    return shutil.which("bfdd")


def ensure_bfdd() -> tuple[str | None, str]:
    """Path of bfdd (installing frr with apt-get if needed) and a note of what happened."""
    p = find_bfdd()
    if p:
        return p, "bfdd present"
    if not shutil.which("apt-get"):
        return None, "bfdd missing and apt-get not available: frr not installed"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(["apt-get", "install", "-y", "frr"], check=False, capture_output=True, text=True, env=env, timeout=600)
    p = find_bfdd()
    if p:
        return p, "installed frr with apt-get"
    return None, f"apt-get install -y frr failed (rc {r.returncode}): {(r.stderr or r.stdout)[-400:].strip()}"


class Vty:
    """A connection to one bfdd's vty socket (the protocol vtysh speaks: command + NUL in,
    output + NUL NUL NUL status out).  About 0.1 ms a query, against ~40 ms for vtysh."""

    def __init__(self, path: str, timeout: float = 2.0):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(path)
        self.cmd("enable")

    def cmd(self, c: str) -> str:
        self.s.sendall(c.encode() + b"\0")
        buf = bytearray()
        while not (len(buf) >= 4 and buf[-4:-1] == b"\0\0\0"):
            chunk = self.s.recv(1 << 16)
            if not chunk:
                raise OSError("bfdd closed the vty connection")
            buf += chunk
        if buf[-1] != 0:
            raise OSError(f"bfdd: {c!r} failed: {bytes(buf[:-4]).decode(errors='replace').strip()}")
        return bytes(buf[:-4]).decode(errors="replace")

    def peers(self) -> dict[str, str]:
        return {p["peer"]: p["status"] for p in json.loads(self.cmd("show bfd peers json"))}

    def close(self) -> None:
        self.s.close()


class Bfd:
    """One bfdd per host namespace, peers over rail ``rail`` to every other host."""

    def __init__(self, binary: str, desc: dict, rail: int, interval_ms: int, multiplier: int, workdir: Path):
        self.binary, self.desc, self.rail = binary, desc, rail
        self.interval_ms, self.multiplier = interval_ms, multiplier
        self.workdir = workdir
        self.procs: dict[int, subprocess.Popen] = {}
        self.vty: dict[int, Vty] = {}
        self.rundirs: list[Path] = []
        self.polls = 0

    def addr(self, i: int) -> str:
        return next(r["address"] for r in self.desc["hosts"][i]["rails"] if r["rail"] == self.rail).split("/")[0]

    def start(self, timeout: float = 20.0) -> None:
        import pwd

        try:
            pw = pwd.getpwnam("frr")
            uid, gid = pw.pw_uid, pw.pw_gid
        except KeyError:
            uid = gid = None
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o755)
        if uid is not None:
            os.chown(self.workdir, uid, gid)
        for h in self.desc["hosts"]:
            i, ns = h["index"], h["netns"]
            lines = ["bfd"]
            for p in self.desc["hosts"]:
                if p["index"] == i:
                    continue
                lines += [f" peer {self.addr(p['index'])} local-address {self.addr(i)}",
                          f"  receive-interval {self.interval_ms}", f"  transmit-interval {self.interval_ms}",
                          f"  detect-multiplier {self.multiplier}", " exit"]
            lines += ["exit", ""]
            conf = self.workdir / f"bfdd-{ns}.conf"
            conf.write_text("\n".join(lines))
            rundir = Path("/var/run/frr") / ns
            rundir.mkdir(parents=True, exist_ok=True)
            self.rundirs.append(rundir)
            if uid is not None:
                os.chown(Path("/var/run/frr"), uid, gid)
                os.chown(rundir, uid, gid)
                os.chown(conf, uid, gid)
            log = self.workdir / f"bfdd-{ns}.log"
            with open(self.workdir / f"bfdd-{ns}.out", "w") as out:
                self.procs[i] = subprocess.Popen(
                    ["ip", "netns", "exec", ns, self.binary, "-N", ns, "-f", str(conf), "-A", "127.0.0.1",
                     "--log", f"file:{log}", "-i", str(self.workdir / f"bfdd-{ns}.pid")],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        for h in self.desc["hosts"]:
            i, ns = h["index"], h["netns"]
            path = f"/var/run/frr/{ns}/bfdd.vty"
            while True:
                if self.procs[i].poll() is not None:
                    tail = (self.workdir / f"bfdd-{ns}.out").read_text(errors="replace")[-800:]
                    raise BenchError(f"bfdd in {ns} exited with status {self.procs[i].returncode}: {tail}")
                try:
                    self.vty[i] = Vty(path)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise BenchError(f"bfdd in {ns}: no vty socket at {path} in {timeout:.0f} s") from None
                    time.sleep(0.05)
        if not self.wait_all_up(timeout):
            raise BenchError(f"bfdd sessions not up in {timeout:.0f} s: {[self.vty[i].peers() for i in self.vty]}")

    @property
    def pids(self) -> list[int]:
        return [self.procs[i].pid for i in sorted(self.procs)]

    def status(self, i: int, peer: int) -> str | None:
        self.polls += 1
        return self.vty[i].peers().get(self.addr(peer))

    def wait_all_up(self, timeout: float, poll_s: float = 0.02) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(set(self.vty[i].peers().values()) == {"up"} for i in self.vty):
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(poll_s)
        return False

    def close(self) -> None:
        for v in self.vty.values():
            try:
                v.close()
            except OSError:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 15)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait(5)
        for d in self.rundirs:
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- linkpass


class ProbeCluster(BenchCluster):
    """BenchCluster whose daemons' configs carry a ``[probe]`` table with the given timers."""

    def __init__(self, *a, interval_ms: int, multiplier: int, damping: bool = False, **kw):
        super().__init__(*a, **kw)
        self.interval_ms, self.multiplier, self.damping = interval_ms, multiplier, damping

    def up(self) -> dict:
        desc = super().up()
        for h in desc["hosts"]:
            with open(h["config"], "a", encoding="utf-8") as f:
                f.write(f"\n[probe]\ninterval_ms = {self.interval_ms}\ndetect_multiplier = {self.multiplier}\n")
                # repeated cuts a second apart are flaps to the damper: after 3 it would keep
                # the rail suppressed and later trials would measure nothing (--damping keeps it)
                if not self.damping:
                    f.write("\n[damping]\nenabled = false\n")
        return desc


def _first(entries, pred):
    return next((e for e in entries if pred(e)), None)


def rail_usable(cl: BenchCluster, host: int, rail: int) -> bool:
    st = cl.ask(host)
    r = next(x for x in st["rails"] if x["id"] == rail)
    return bool(r["usable"]) and st["applied_generation"] >= st["generation"]


def rail_avoided(cl: BenchCluster, host: int, rail: int) -> bool:
    """``host`` no longer routes to its peers over ``rail``: its own rail is unusable, or every
    peer announced the rail unusable at its end (with one peer per rail, either end may be the
    first to call the rail failed; the other follows the notice)."""
    st = cl.ask(host)
    r = next(x for x in st["rails"] if x["id"] == rail)
    if st["applied_generation"] < st["generation"]:
        return False
    peers = st["peers"]
    return not r["usable"] or (bool(peers) and all(p["usable_rails"] is not None and rail not in p["usable_rails"] for p in peers))


def all_usable(cl: BenchCluster, hosts: int, rails: int) -> bool:
    for i in range(hosts):
        st = cl.ask(i)
        if not all(x["usable"] for x in st["rails"]) or st["applied_generation"] < st["generation"]:
            return False
        if any(p["usable_rails"] is None or len(p["usable_rails"]) < rails for p in st["peers"]):
            return False
    return True


# --------------------------------------------------------------------------- run


def run_trials(args, cl: BenchCluster, bfd: Bfd | None) -> list[dict]:
    trials = []
    poll_s = args.bfd_poll_ms / 1000
    for k in range(args.trials):
        c = fab.cut(args.name, CUT_HOST, CUT_RAIL, args.mode)
        t_cut = c["t_issued_ns"]
        deadline = time.monotonic() + args.timeout_s
        bfd_down_ns = None
        lp_down_seen = False
        next_lp = time.monotonic() + 0.02
        while time.monotonic() < deadline:
            if bfd and bfd_down_ns is None:
                try:
                    if bfd.status(CUT_HOST, 0) == "down":
                        bfd_down_ns = time.monotonic_ns()
                except (OSError, ValueError):
                    pass
            now = time.monotonic()
            if not lp_down_seen and now >= next_lp:
                try:
                    lp_down_seen = rail_avoided(cl, CUT_HOST, CUT_RAIL)
                except (OSError, ValueError, KeyError, StopIteration):
                    pass
                next_lp = now + 0.02
            if lp_down_seen and (bfd is None or bfd_down_ns is not None):
                break
            time.sleep(poll_s)
        if args.burst_s > 0:  # keep the fault (a flap burst) going
            time.sleep(max(0.0, t_cut / 1e9 + args.burst_s - time.monotonic()))
        h = fab.heal(args.name, CUT_HOST, CUT_RAIL)
        t_heal = h["t_issued_ns"] or time.monotonic_ns()
        time.sleep(args.hold_down_ms / 1000)
        up_deadline = time.monotonic() + args.timeout_s + 5
        lp_up = bfd_up = False
        while time.monotonic() < up_deadline and not (lp_up and bfd_up):
            try:
                lp_up = lp_up or all_usable(cl, args.hosts, args.rails)
            except (OSError, ValueError, KeyError, StopIteration):
                pass
            bfd_up = bfd is None or bfd.wait_all_up(0.001)
            time.sleep(0.02)
        trials.append({"i": k, "t_cut_ns": t_cut, "t_heal_ns": t_heal, "lp_down_seen": lp_down_seen,
                       "bfd_detect_ms": None if bfd_down_ns is None else round((bfd_down_ns - t_cut) / 1e6, 3),
                       "lp_failback_ok": lp_up, "bfd_back_up": bfd_up if bfd else None})
        print(f"  trial {k}: bfdd {trials[-1]['bfd_detect_ms']} ms, linkpass down seen {lp_down_seen}", flush=True)
        time.sleep(args.settle_ms / 1000)
    return trials


def analyse(args, cl: BenchCluster, trials: list[dict], t0: int, t1: int) -> dict:
    H = {}
    for i in range(args.hosts):
        H[i] = sorted(cl.ask(i, "history", timeout=10)["history"], key=lambda e: e["t_ns"])
    for tr in trials:
        t_cut, t_heal = tr["t_cut_ns"], tr["t_heal_ns"]
        mine = [e for e in H[CUT_HOST] if t_cut <= e["t_ns"] < t_heal]
        down = _first(mine, lambda e: e["kind"] == "rail" and e["rail"] == CUT_RAIL and e["new"] == "DOWN")
        pdown = _first(mine, lambda e: e["kind"] == "path" and e["rail"] == CUT_RAIL and e["new"] == "DOWN")
        tr["detect_ms"] = None if not down else round((down["t_ns"] - t_cut) / 1e6, 3)
        # avoided: h1's own DOWN, or the peer's notice that its end of the rail failed (h1's
        # routes leave the rail either way; with one peer per rail either end may decide first)
        peer_off = _first(mine, lambda e: e["kind"] == "peer_rails" and CUT_RAIL not in e["usable"])
        t_av = [e["t_ns"] for e in (down, peer_off) if e]
        tr["avoid_ms"] = round((min(t_av) - t_cut) / 1e6, 3) if t_av else None
        tr["avoided_by"] = None if not t_av else ("own" if down and down["t_ns"] == min(t_av) else "peer notice")
        tr["path_down_ms"] = None if not pdown else round((pdown["t_ns"] - t_cut) / 1e6, 3)
        tr["reroute_ms"] = None
        if down:
            t_down = down["t_ns"]
            plan = _first(mine, lambda e, t=t_down: e["kind"] == "plan" and e["t_ns"] >= t and CUT_RAIL not in e["usable"])
            gen = plan["generation"] if plan else None
            ap = plan and _first(mine, lambda e, g=gen: e["kind"] == "routes_applied" and e["generation"] >= g)
            if ap:
                tr["reroute_ms"] = round((ap["t_ns"] - down["t_ns"]) / 1e6, 3)
        # route changes while the fault lasted (cut -> heal), per host: with damping on, a flap
        # burst should cost each host at most one (off the rail), whatever the link does
        tr["route_changes_in_fault"] = {
            f"h{i}": sum(1 for e in H[i] if t_cut <= e["t_ns"] < t_heal and e["kind"] == "routes_applied"
                         and (e.get("replaced", 0) + e.get("deleted", 0)) > 0) for i in H}
    in_run = {i: [e for e in H[i] if t0 <= e["t_ns"] < t1] for i in H}
    rail_downs = [(i, e) for i in in_run for e in in_run[i] if e["kind"] == "rail" and e["new"] == "DOWN"]
    light = light_loss(args.mode)
    false_ff = [f"h{i} rail {e['rail']} ({e.get('reason')})" for i, e in rail_downs if e["rail"] != CUT_RAIL or light]
    peer_side = [f"h{i} rail {e['rail']} ({e.get('reason')})" for i, e in rail_downs if e["rail"] == CUT_RAIL and i != CUT_HOST]
    applied = [e for i in in_run for e in in_run[i] if e["kind"] == "routes_applied"]
    changes = [e for e in applied if (e.get("replaced", 0) + e.get("deleted", 0)) > 0]
    lp = {
        "detect_ms": summary([t["detect_ms"] for t in trials if t["detect_ms"] is not None]),
        "path_down_ms": summary([t["path_down_ms"] for t in trials if t["path_down_ms"] is not None]),
        "reroute_ms": summary([t["reroute_ms"] for t in trials if t["reroute_ms"] is not None]),
        "misses": None if light else sum(1 for t in trials if t["detect_ms"] is None),
        "avoid_ms": summary([t["avoid_ms"] for t in trials if t["avoid_ms"] is not None]),
        "avoid_misses": None if light else sum(1 for t in trials if t["avoid_ms"] is None),
        "avoided_by_peer_notice": sum(1 for t in trials if t.get("avoided_by") == "peer notice"),
        "failback_misses": sum(1 for t in trials if not t["lp_failback_ok"]),
        "false_failovers": len(false_ff), "false_failover_list": false_ff,
        "peer_side_down": len(peer_side), "peer_side_down_list": peer_side,
        "route_changes": len(changes), "routes_applied_total": len(applied),
        "route_changes_in_fault_max": max((v for t in trials for v in t["route_changes_in_fault"].values()), default=0),
        "route_errors": [err for e in applied for err in e.get("errors", [])],
    }
    return lp


def run(args) -> dict:
    machine = machine_info()
    bfd_note = "disabled (--no-bfd)"
    bfdd = None
    if not args.no_bfd:
        bfdd, bfd_note = ensure_bfdd()
        print(f"bfdd: {bfdd or 'unavailable'} ({bfd_note})", flush=True)
    cl = ProbeCluster(args.hosts, args.rails, args.name, args.hold_down_ms,
                      interval_ms=args.interval_ms, multiplier=args.multiplier, damping=args.damping)
    bfd = None
    bfd_error = None
    t_start = time.monotonic()
    try:
        cl.launch()
        if bfdd:
            bfd = Bfd(bfdd, cl.desc, CUT_RAIL, args.interval_ms, args.multiplier, Path(tempfile.mkdtemp(prefix=f"linkpass-bfdd-{args.name}-")))
            try:
                bfd.start()
            except BenchError as e:
                bfd_error = str(e)
                print(f"bfdd: {e}; continuing with linkpass only", file=sys.stderr, flush=True)
                bfd.close()
                bfd = None
        time.sleep(0.5)
        lp_pids = list(cl.pids)
        bfd_pids = bfd.pids if bfd else []
        cpu0 = {p: proc_cpu(p) for p in lp_pids + bfd_pids}
        t0 = time.monotonic_ns()
        print(f"mode {args.mode}: {args.trials} trials on h{CUT_HOST} rail {CUT_RAIL} ...", flush=True)
        trials = run_trials(args, cl, bfd)
        t1 = time.monotonic_ns()
        cpu1 = {p: proc_cpu(p) for p in lp_pids + bfd_pids}
        mem = {p: proc_mem(p) for p in lp_pids + bfd_pids}
        lp = analyse(args, cl, trials, t0, t1)
        problems = cl.log_problems()
        bfd_polls = bfd.polls if bfd else 0
        bfd_workdir = str(bfd.workdir) if bfd else None
    finally:
        if bfd:
            bfd.close()
        cl.close()
    wall = t1 - t0

    def procs(pids, label):
        out = []
        for i, p in enumerate(pids):
            d = cpu1[p]["stat_ns"] - cpu0[p]["stat_ns"]
            out.append({"host": f"h{i}", "pid": p, "what": label, "cpu_s": round(d / 1e9, 3),
                        "cpu_pct": round(100 * d / wall, 3),
                        "vmrss_mb": round(mem[p].get("vmrss_kb", 0) / 1024, 2), "vmhwm_mb": round(mem[p].get("vmhwm_kb", 0) / 1024, 2)})
        return out

    lp["daemons"] = procs(lp_pids, "linkpass")
    lp["cpu_s_total"] = round(sum(d["cpu_s"] for d in lp["daemons"]), 3)
    lp["cpu_pct"] = {d["host"]: d["cpu_pct"] for d in lp["daemons"]}
    bfd_res = None
    if bfd_pids:
        det = [t["bfd_detect_ms"] for t in trials if t["bfd_detect_ms"] is not None]
        light = light_loss(args.mode)
        bfd_res = {"detect_ms": summary(det), "misses": None if light else sum(1 for t in trials if t["bfd_detect_ms"] is None),
                   "false_downs": len(det) if light else 0,
                   "not_back_up": sum(1 for t in trials if t["bfd_back_up"] is False),
                   "daemons": procs(bfd_pids, "bfdd"), "polls": bfd_polls, "workdir": bfd_workdir}
        bfd_res["cpu_s_total"] = round(sum(d["cpu_s"] for d in bfd_res["daemons"]), 3)
        bfd_res["cpu_pct"] = {d["host"]: d["cpu_pct"] for d in bfd_res["daemons"]}
    comparison = None
    if bfd_res and bfd_res["detect_ms"]["p99"] is not None:
        bd, ld, la = bfd_res["detect_ms"], lp["detect_ms"], lp["avoid_ms"]

        def le(a, b):
            return None if a is None or b is None else a <= b

        comparison = {
            "p50_linkpass_le_bfdd": le(ld["p50"], bd["p50"]),
            "p99_linkpass_le_bfdd": le(ld["p99"], bd["p99"]),
            "avoid_p50_le_bfdd": le(la["p50"], bd["p50"]),
            "avoid_p99_le_bfdd": le(la["p99"], bd["p99"]),
            "p50_speedup": None if ld["p50"] is None else round(bd["p50"] / max(ld["p50"], 1e-3), 2),
            "p99_speedup": None if ld["p99"] is None else round(bd["p99"] / max(ld["p99"], 1e-3), 2),
            "avoid_p50_speedup": None if la["p50"] is None else round(bd["p50"] / max(la["p50"], 1e-3), 2),
            "avoid_p99_speedup": None if la["p99"] is None else round(bd["p99"] / max(la["p99"], 1e-3), 2),
        }
    return {
        "schema": SCHEMA,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "params": {"mode": args.mode, "trials": args.trials, "hosts": args.hosts, "rails": args.rails,
                   "interval_ms": args.interval_ms, "multiplier": args.multiplier, "hold_down_ms": args.hold_down_ms,
                   "bfd_poll_ms": args.bfd_poll_ms, "fabric_name": args.name, "damping": args.damping, "burst_s": args.burst_s, "cut": {"host": CUT_HOST, "rail": CUT_RAIL}},
        "targets": TARGETS,
        "linkpass": lp,
        "bfdd": bfd_res,
        "bfdd_note": bfd_note if not bfd_error else f"{bfd_note}; start failed: {bfd_error}",
        "bfdd_available": bfd_res is not None,
        "comparison": comparison,
        "trials": trials,
        "measured_wall_s": round(wall / 1e9, 2),
        "daemon_log_problems": problems,
        "logs": str(cl.workdir),
        "loadavg_at_end": list(os.getloadavg()),
        "run_wall_s": round(time.monotonic() - t_start, 1),
    }


def print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=max(Console().width, 110))
    p = r["params"]
    t = Table(title=f"detection, {p['mode']}, {p['trials']} trials, h{p['cut']['host']} rail {p['cut']['rail']}, "
                    f"{p['interval_ms']} ms x {p['multiplier']} ({r['machine']['cpus']} CPUs, kernel {r['machine']['kernel']})")
    for col in ("figure", "n", "p50 ms", "p99 ms", "max ms", "misses", "CPU s (all daemons)", "VmHWM MB (max)"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    f = (lambda x: "-" if x is None else f"{x:.3f}")
    lp = r["linkpass"]
    hwm = max(d["vmhwm_mb"] for d in lp["daemons"])
    for k, fig in enumerate(("detect_ms", "avoid_ms", "path_down_ms", "reroute_ms")):
        s = lp[fig]
        miss = lp["misses"] if k == 0 else lp["avoid_misses"] if k == 1 else ""
        t.add_row(f"linkpass {fig}", str(s["n"]), f(s["p50"]), f(s["p99"]), f(s["max"]),
                  "-" if miss is None else str(miss), f"{lp['cpu_s_total']:.3f}" if k == 0 else "", f"{hwm:.1f}" if k == 0 else "")
    b = r["bfdd"]
    if b:
        s = b["detect_ms"]
        t.add_row("bfdd detect_ms", str(s["n"]), f(s["p50"]), f(s["p99"]), f(s["max"]), "-" if b["misses"] is None else str(b["misses"]),
                  f"{b['cpu_s_total']:.3f}", f"{max(d['vmhwm_mb'] for d in b['daemons']):.1f}")
    else:
        t.add_row(f"bfdd: {r['bfdd_note']}", "", "", "", "", "", "", "")
    c.print(t)
    c.print(f"  flap damping {'on' if p.get('damping') else 'off'}; CPU % of one core: linkpass {lp['cpu_pct']}"
            + (f", bfdd {b['cpu_pct']}" if b else ""))
    if b and b.get("false_downs"):
        c.print(f"  bfdd sessions down under a light loss: {b['false_downs']}")
    c.print(f"  linkpass: false failovers {lp['false_failovers']}, peer-side rail DOWN {lp['peer_side_down']}, "
            f"route changes {lp['route_changes']}, route errors {len(lp['route_errors'])}, failback misses {lp['failback_misses']}")
    c.print(f"  route changes while each fault lasted, per host: max {lp['route_changes_in_fault_max']} "
            f"(damping {'on' if p.get('damping') else 'off'}; per trial: {[t['route_changes_in_fault'] for t in r['trials']]})")
    if r["comparison"]:
        cm = r["comparison"]
        c.print(f"  bfdd/linkpass avoid: p50 x{cm['avoid_p50_speedup']}, p99 x{cm['avoid_p99_speedup']}; "
                f"avoid p50 <= bfdd p50: {cm['avoid_p50_le_bfdd']}, p99 <= bfdd p99: {cm['avoid_p99_le_bfdd']} "
                f"({lp['avoided_by_peer_notice']} trials avoided by the peer's notice first)")
        c.print(f"  bfdd/linkpass detect: p50 x{cm['p50_speedup']}, p99 x{cm['p99_speedup']}; "
                f"linkpass p50 <= bfdd p50: {cm['p50_linkpass_le_bfdd']}, p99 <= bfdd p99: {cm['p99_linkpass_le_bfdd']}")
    if b:
        c.print(f"  bfdd CPU includes answering {b['polls']} vty polls from this script")
    if r["daemon_log_problems"]:
        c.print(f"[yellow]{len(r['daemon_log_problems'])} warning/error line(s) in the daemon logs ({r['logs']}):[/]")
        for line in r["daemon_log_problems"][:10]:
            c.print(f"  {line}", markup=False)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_detect_options(ap)
    return ap


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        args = build_parser().parse_args(argv)  # the numbers' ranges: their type= (linkpass.lab.benchcmd)
    prog = getattr(args, "prog", None) or "detect_bfd"
    try:
        args.mode = fab.parse_fault_mode(args.mode)[2]
    except fab.FabricError as e:
        print(f"{prog}: --mode: {e}", file=sys.stderr)
        return 2
    bad = check_args(prog, args, positive=("interval_ms", "multiplier", "timeout_s", "bfd_poll_ms"),
                     non_negative=("hold_down_ms", "settle_ms", "burst_s"))
    if bad:
        return bad
    if os.geteuid() != 0:  # after the arguments: a bad one is said first
        print(f"{prog}: must run as root (it creates network namespaces)", file=sys.stderr)
        return 2
    return run_and_report(prog, run, print_report, args)

if __name__ == "__main__":
    sys.exit(main())
