#!/usr/bin/env python3
"""What the kernel does alone at a carrier loss, and what one plan change costs, with nexthop
objects (``[daemon] nexthop_objects = true``) and with inline multipath routes.

    sudo .venv/bin/python bench/kernel_reroute.py --plans 500 --cuts 5 --json bench/results/kernel_reroute.json

Part 1, ``apply_ms`` (namespace ``lpkr-a``/``lpkr-b`` pair, 2 veth rails, ``--peers`` /32 routes):
the route actuator (:class:`linkpass.adapters.routes.RouteActuator`, the daemon's own) applies
plans that alternate "rails 0+1" and "rail 1 only" ``--plans`` times; per plan: call ->
``RoutesApplied.t_ns`` (the kernel's ACK of the last add/replace), which is the "DOWN to routes
acknowledged" part of a local reroute that the actuator owns.  Also the kernel operations per
plan.

Part 1b, ``requests``: the kernel's part alone: per plan ``--peers`` inline route replaces sent
over the blocking rtnetlink socket in one datagram (``NexthopSocket.request_many``, as the
actuator sends a plan's replacements) and one request per datagram, each waiting for its ACK.

Part 2, ``stall_ms`` (emulated fabric ``--name``, 2 hosts x 2 rails, real daemons): a paced TCP
flow (1 KiB every 1 ms) from host 0 to host 1's host IP; the rail carrying it (tx counters) is
cut on host 0 with ``carrier-loss``; ``stall_ms`` is the longest gap between two receptions at
host 1 from 50 ms before the cut to 3 s after it (3 s: no recovery seen = the flow is stuck).
``ack_rail`` is the rail host 1's ACKs took before the cut (its own multipath hash): kernel
only, host 1 does not see host 0's carrier loss, so ACKs on the cut rail are lost until
something on host 1 moves them.
With the daemons up, host 0's history also gives ``detect_ms`` and ``reroute_ms`` (DOWN
recorded -> the first plan without the rail ACKed), defined as in bench/detect_reroute.py.
"daemon" runs with the daemons up; "kernel only" starts them (routes installed), stops them
(SIGTERM leaves routes as they are), then cuts.  Each cut uses a fresh daemon start.

Prints figures, never asserts them.  Root only; uses only namespaces it creates (198.18.0.0/15).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cluster import BenchCluster, machine_info, summary, write_json  # noqa: E402

from linkpass.lab import fabric as fab  # noqa: E402

SCHEMA = "linkpass.bench.kernel_reroute/v1"
NS_A, NS_B = "lpkr-a", "lpkr-b"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def pair_up(peers: int) -> None:
    pair_down()
    sh("ip", "netns", "add", NS_A)
    sh("ip", "netns", "add", NS_B)
    for k in (0, 1):
        sh("ip", "link", "add", f"r{k}", "netns", NS_A, "type", "veth", "peer", "name", f"r{k}", "netns", NS_B)
        sh("ip", "-n", NS_A, "addr", "add", f"198.18.{240 + k}.1/24", "dev", f"r{k}")
        sh("ip", "-n", NS_B, "addr", "add", f"198.18.{240 + k}.2/24", "dev", f"r{k}")
        for ns in (NS_A, NS_B):
            sh("ip", "-n", ns, "link", "set", f"r{k}", "up")


def pair_down() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


APPLY_CHILD = r"""
import asyncio, json, sys, time
from linkpass.adapters.routes import RouteActuator, RouteSettings
from linkpass.core.model import ApplyRoutes, Nexthop, RouteSpec
plans, peers, objects = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
nh = [Nexthop("198.18.240.2", "r0"), Nexthop("198.18.241.2", "r1")]
def plan(g, nhs):
    return ApplyRoutes(g, tuple(RouteSpec(f"198.19.{241 + p // 250}.{1 + p % 250}/32", tuple(nhs), None, 254, 0, 201) for p in range(peers)))
async def main():
    a = RouteActuator(lambda e: None, RouteSettings(201, 254, objects))
    await a.reconcile(plan(1, nh))
    out = []
    for g in range(2, plans + 2):
        nhs = nh if g % 2 else nh[1:]
        t0 = time.monotonic_ns()
        r = await a.reconcile(plan(g, nhs))
        out.append({"ms": (r.t_ns - t0) / 1e6, "ops": r.replaced + r.deleted, "errors": len(r.errors)})
    print(json.dumps(out))
asyncio.run(main())
"""


REQUESTS_CHILD = r"""
import json, socket, sys, time
from linkpass.adapters import nhlink
from linkpass.core.model import Nexthop, RouteSpec
plans, peers = int(sys.argv[1]), int(sys.argv[2])
idx = {"r0": socket.if_nametoindex("r0"), "r1": socket.if_nametoindex("r1")}
nh = [Nexthop("198.18.240.2", "r0"), Nexthop("198.18.241.2", "r1")]
def msgs(nhs):
    return [nhlink.inline_route_request(RouteSpec(f"198.19.{241 + p // 250}.{1 + p % 250}/32", tuple(nhs), None, 254, 0, 201), idx, 0)
            for p in range(peers)]
both, one = msgs(nh), msgs(nh[1:])
nl = nhlink.NexthopSocket()
nl.request_many(both)
out = {"one_datagram": [], "one_by_one": []}
for g in range(plans):
    m = both if g % 2 else one
    batched = g % 4 < 2  # alternate the two ways in pairs, so each sees both plans
    t0 = time.monotonic_ns()
    if batched:
        errs = nl.request_many(m)
    else:
        errs = []
        for x in m:
            errs += nl.request_many([x])
    out["one_datagram" if batched else "one_by_one"].append(((time.monotonic_ns() - t0) / 1e6, sum(1 for e in errs if e)))
print(json.dumps(out))
"""


def request_times(plans: int, peers: int) -> dict:
    """The kernel's part alone: ``peers`` inline route replaces per plan sent over the blocking
    rtnetlink socket in one datagram (``request_many``, as the actuator does) and one request per
    datagram, each waiting for its ACK (as before d0bac21); plans alternate as in part 1."""
    pair_up(peers)
    try:
        p = subprocess.run(["ip", "netns", "exec", NS_A, sys.executable, "-c", REQUESTS_CHILD, str(plans), str(peers)],
                           capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
        rows = json.loads(p.stdout)
    finally:
        pair_down()
    return {k: {"ms": summary([ms for ms, _ in v]), "errors": sum(e for _, e in v)} for k, v in rows.items()}


def apply_times(plans: int, peers: int, objects: bool) -> dict:
    pair_up(peers)
    try:
        p = subprocess.run(["ip", "netns", "exec", NS_A, sys.executable, "-c", APPLY_CHILD, str(plans), str(peers), "1" if objects else "0"],
                           capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
        rows = json.loads(p.stdout)
    finally:
        pair_down()
    down = [r["ms"] for i, r in enumerate(rows) if i % 2 == 0]  # plans "rail 1 only" (a reroute away from rail 0)
    return {"apply_ms": summary([r["ms"] for r in rows]), "reroute_apply_ms": summary(down),
            "ops_per_plan": summary([float(r["ops"]) for r in rows]), "errors": sum(r["errors"] for r in rows)}


RECEIVER = r"""
import socket, sys, time, json
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); ts = []
c.settimeout(float(sys.argv[3]))
try:
    while True:
        d = c.recv(65536)
        if not d: break
        ts.append(time.monotonic_ns())
except socket.timeout:
    pass
print(json.dumps(ts))
"""

SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), source_address=(sys.argv[3], 0))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.setblocking(False)  # a stuck flow must not stop the pacing clock
end = time.monotonic() + float(sys.argv[4]); buf = b"x" * 1024
while time.monotonic() < end:
    try:
        c.send(buf)
    except BlockingIOError:
        pass
    time.sleep(0.001)
c.close()
"""


def tx_bytes(cl: BenchCluster, i: int) -> list[int]:
    out = []
    for hr in cl.host(i)["rails"]:
        out.append(int(sh("ip", "netns", "exec", cl.ns(i), "cat", f"/sys/class/net/{hr['netdev']}/statistics/tx_bytes").strip()))
    return out


def one_cut(cl: BenchCluster, daemon: bool, port: int) -> dict:
    cl.start_all(30.0)
    time.sleep(0.3)
    if not daemon:
        for i in range(cl.hosts):
            cl.stop(i)
    h0, h1 = cl.host(0), cl.host(1)
    rx = subprocess.Popen(fab.netns_exec(cl.name, 1) + [sys.executable, "-c", RECEIVER, h1["host_ip"], str(port), "3.0"],
                          stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    tx = subprocess.Popen(fab.netns_exec(cl.name, 0) + [sys.executable, "-c", SENDER, h1["host_ip"], str(port), h0["host_ip"], "2.5"])
    time.sleep(0.5)
    a, a1 = tx_bytes(cl, 0), tx_bytes(cl, 1)
    time.sleep(0.2)
    b, b1 = tx_bytes(cl, 0), tx_bytes(cl, 1)
    rail = max(range(len(a)), key=lambda k: b[k] - a[k])
    ack_rail = max(range(len(a1)), key=lambda k: b1[k] - a1[k])  # host 1's ACKs: the reverse direction hashes on its own
    c = fab.cut(cl.name, 0, cl.host(0)["rails"][rail]["rail"], "carrier-loss")
    t_cut = c["t_issued_ns"]
    tx.wait(10)
    out, _ = rx.communicate(timeout=15)
    ts = json.loads(out.strip().splitlines()[-1])
    daemon_ms = daemon_figures(cl, cl.host(0)["rails"][rail]["rail"], t_cut) if daemon else {}
    fab.heal(cl.name)
    window = [t for t in ts if t >= t_cut - 50_000_000]
    prev = t_cut - 50_000_000
    gap = 0
    for t in window:
        gap = max(gap, t - prev)
        prev = t
    end = t_cut + 3_000_000_000
    if not window or window[-1] < t_cut:
        gap = max(gap, end - prev)
    for i in range(cl.hosts):
        if cl.procs.get(i) and cl.procs[i].poll() is None:
            cl.stop(i)
    return {"rail": rail, "ack_rail": ack_rail, "stall_ms": round(min(gap, 3_000_000_000) / 1e6, 3), "recovered": bool(window and window[-1] > t_cut),
            **daemon_ms}


def daemon_figures(cl: BenchCluster, rail: int, t_cut: int) -> dict:
    """From host 0's history: ``detect_ms`` (cut -> rail DOWN) and ``reroute_ms`` (DOWN -> the
    kernel's ACK of the first plan without the rail), as bench/detect_reroute.py defines them."""
    h = [e for e in cl.history(0) if e["t_ns"] >= t_cut]
    first = lambda pred: next((e for e in h if pred(e)), None)  # noqa: E731
    down = first(lambda e: e["kind"] == "rail" and e["rail"] == rail and e["new"] == "DOWN")
    if not down:
        return {"detect_ms": None, "reroute_ms": None}
    plan = first(lambda e: e["kind"] == "plan" and e["t_ns"] >= down["t_ns"] and rail not in e["usable"])
    ap = plan and first(lambda e: e["kind"] == "routes_applied" and e["generation"] >= plan["generation"])
    return {"detect_ms": round((down["t_ns"] - t_cut) / 1e6, 3),
            "reroute_ms": round((ap["t_ns"] - down["t_ns"]) / 1e6, 3) if ap else None}


def stalls(args, objects: bool) -> dict:
    cl = BenchCluster(2, 2, args.name, args.hold_down_ms)
    res = {}
    try:
        cl.launch()
        for i in range(cl.hosts):
            cl.stop(i)
            cl.add_config(i, {"daemon": {"nexthop_objects": objects}})
        for daemon in (True, False):
            rows = []
            for n in range(args.cuts):
                rows.append(one_cut(cl, daemon, 18000 + n))
                print(f"  {'nexthop_objects' if objects else 'inline'} {'daemon' if daemon else 'kernel only'} cut {n}: {rows[-1]}", flush=True)
            res["daemon" if daemon else "kernel_only"] = {"cuts": rows, "stall_ms": summary([r["stall_ms"] for r in rows]),
                                                          "not_recovered": sum(not r["recovered"] for r in rows)}
            if daemon:
                res["daemon"]["reroute_ms"] = summary([r["reroute_ms"] for r in rows if r.get("reroute_ms") is not None])
                res["daemon"]["detect_ms"] = summary([r["detect_ms"] for r in rows if r.get("detect_ms") is not None])
    finally:
        cl.close()
    return res


def commit() -> str:
    try:
        return sh("git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD").strip()
    except (subprocess.CalledProcessError, OSError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=500)
    ap.add_argument("--peers", type=int, default=1)
    ap.add_argument("--cuts", type=int, default=5)
    ap.add_argument("--name", default="bnkr")
    ap.add_argument("--hold-down-ms", type=int, default=200)
    ap.add_argument("--skip-stall", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.plans < 4 or not 1 <= args.peers <= 3750 or args.cuts < 0:
        # peers are 198.19.241.1 .. 198.19.255.250: 15 x 250 addresses
        print("kernel_reroute: --plans must be >= 4 (plans alternate in pairs), --peers 1..3750, --cuts >= 0", file=sys.stderr)
        return 2
    if args.json and Path(args.json).is_dir():
        print(f"kernel_reroute: --json {args.json}: a directory", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("kernel_reroute: must run as root (network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "command": " ".join(sys.argv), "machine": machine_info(), "modes": {}}
    for objects in (True, False):
        mode = "nexthop_objects" if objects else "inline"
        m = report["modes"][mode] = apply_times(args.plans, args.peers, objects)
        if not args.skip_stall:
            m["stall"] = stalls(args, objects)
        ra = m["reroute_apply_ms"]
        print(f"{mode:16s} reroute apply p50 {ra['p50']:.3f} ms p99 {ra['p99']:.3f} ms (target p99 <= 1 ms), "
              f"kernel ops/plan p50 {m['ops_per_plan']['p50']:.0f}, errors {m['errors']}")
        for k, v in m.get("stall", {}).items():
            s = v["stall_ms"]
            print(f"{'':16s} TCP stall at carrier loss, {k:11s}: p50 {s['p50']:.1f} ms max {s['max']:.1f} ms, "
                  f"not recovered {v['not_recovered']}/{len(v['cuts'])}")
            if "reroute_ms" in v and v["reroute_ms"]["n"]:
                r, d = v["reroute_ms"], v["detect_ms"]
                print(f"{'':16s} in the daemon: detect p50 {d['p50']:.2f} ms, local reroute (DOWN -> routes ACKed) "
                      f"p50 {r['p50']:.2f} p99 {r['p99']:.2f} ms over {r['n']} cuts")
    report["requests"] = rq = request_times(args.plans, args.peers)
    for k, v in rq.items():
        print(f"{'requests':16s} {args.peers} route replaces {k.replace('_', ' ')}: p50 {v['ms']['p50']:.3f} ms "
              f"p99 {v['ms']['p99']:.3f} ms, errors {v['errors']}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
