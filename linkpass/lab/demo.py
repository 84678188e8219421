"""`linkpass demo`: a real training job keeps training through a rail cut.

Steps:

1. bring up the emulated fabric (``linkpass fabric up``), one daemon per host;
2. run the training job (:mod:`linkpass.lab.demo_train`, gloo over the host IPs) once without
   faults: the reference weights;
3. run it again; while it trains, read the rail netdevs' byte counters on the faulty host to
   find the rail carrying the job's traffic, cut THAT rail (``carrier-loss`` by default), let
   it train on, heal the rail and wait for the daemon to fail back after hold-down;
4. compare the final weights bitwise with the reference and read the daemons' histories to
   measure detection and reroute latency;
5. tear everything down (also on Ctrl-C or SIGTERM).

Latencies (monotonic clock, one machine so all processes share it):

* ``detect_ms``: cut issued (just before the kernel change) -> the faulty host's daemon
  declares the rail DOWN;
* ``reroute_ms``: declared -> the faulty host's routes without the rail are in the kernel
  (netlink ACK);
* ``peer_reroute_ms``: declared on the faulty host -> the slowest peer's routes are replaced
  (negative when the peer's own probes saw a blackhole before the faulty host did);
* ``failback_ms``: heal issued -> routes using the rail again are in the kernel on the faulty
  host (includes the hold-down, 2 s by default).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from linkpass.lab import fabric as fab
from linkpass.lab.fabric.cluster import Cluster, ClusterError, ask_socket


class DemoError(Exception):
    """The demo could not run; the message says why.  ``exit_code`` is 2 for bad input
    (arguments, not root, name in use) and 1 for a failure while running."""

    def __init__(self, msg: str, exit_code: int = 1):
        super().__init__(msg)
        self.exit_code = exit_code


#: Cut modes the demo can show: link-down faults (seen through netlink) and a blackhole (carrier
#: up, seen by the per-rail probes about 30 ms later).  Random loss and flaps are not a single
#: cut with a clear before and after; `linkpass bench detect` and bench/soak.py measure them.
DEMO_MODES = ("carrier-loss", "admin-down", "blackhole")


def _rail_bytes(ns: str, netdev: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", netdev], capture_output=True, text=True, check=True).stdout
    st = json.loads(out)[0]["stats64"]
    return int(st["rx"]["bytes"]) + int(st["tx"]["bytes"])


def _counters(desc: dict, host: int) -> dict[int, int]:
    h = desc["hosts"][host]
    return {r["rail"]: _rail_bytes(h["netns"], r["netdev"]) for r in h["rails"]}


def _status(sock: str, cmd: str = "status") -> dict:
    return ask_socket(sock, cmd, timeout=10)


class Demo:
    """Holds the processes and fabric of one demo run; :meth:`close` undoes everything."""

    def __init__(self, hosts: int, rails: int, steps: int, name: str, mode: str, hold_down_ms: int = 2000, log=print):
        if not 2 <= hosts <= 16:
            raise DemoError("--hosts must be 2..16 (data-parallel training needs peers; one trainer per host on 2 cores)", 2)
        if not 2 <= rails <= 16:
            raise DemoError("--rails must be 2..16 (failover needs a rail to fail over to)", 2)
        if steps < 50:
            raise DemoError("--steps must be at least 50 (the cut happens mid-run)", 2)
        if mode not in DEMO_MODES:
            raise DemoError(f"--mode must be one of {', '.join(DEMO_MODES)} (loss and flaps: see `linkpass bench detect`)", 2)
        self.hosts, self.rails, self.steps, self.name, self.mode = hosts, rails, steps, name, mode
        self.hold_down_ms = hold_down_ms
        self.log = log
        self.jobs: list[subprocess.Popen] = []
        self.desc: dict | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="linkpass-demo-"))
        self.cluster = Cluster(hosts, rails, name, hold_down_ms, workdir=self.workdir)
        self.built = False

    # --------------------------------------------------------------- setup

    def start(self) -> None:
        self.log(f"fabric: {self.hosts} hosts x {self.rails} rails (name {self.name})")
        try:
            fab.load(self.name)
        except fab.FabricError:
            pass  # no such fabric: good
        else:
            raise DemoError(f"name in use: a fabric named {self.name!r} exists; pick another --name "
                            f"or remove it with `linkpass fabric down --name {self.name}`", 2)
        try:
            self.desc = self.cluster.up()
        except fab.FabricError as e:
            raise DemoError(f"fabric: {e}", getattr(e, "exit_code", 1)) from None
        self.built = True
        try:
            self.cluster.start_all()
        except ClusterError as e:
            raise DemoError(str(e)) from None
        self.log(f"daemons ready on {self.hosts} hosts; routes to every peer over all rails")

    def _launch_job(self, tag: str, port: int) -> list[Path]:
        outs = []
        self.jobs = []
        master = self.desc["hosts"][0]["host_ip"]
        for h in self.desc["hosts"]:
            out = self.workdir / f"{tag}-rank{h['index']}.json"
            prog = self.workdir / f"{tag}-rank{h['index']}.progress"
            for f in (out, prog):
                f.unlink(missing_ok=True)
            outs.append(out)
            logf = open(self.workdir / f"{tag}-rank{h['index']}.log", "w")
            self.jobs.append(subprocess.Popen(
                fab.netns_exec(self.name, h["index"]) + [
                    sys.executable, "-m", "linkpass.lab.demo_train", "--rank", str(h["index"]), "--world-size", str(self.hosts),
                    "--master-addr", master, "--master-port", str(port), "--iface", h["host_netdev"], "--steps", str(self.steps),
                    "--out", str(out), "--progress", str(prog)],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
        return outs

    def _progress(self, tag: str, rank: int) -> int:
        try:
            return int((self.workdir / f"{tag}-rank{rank}.progress").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def _wait_progress(self, tag: str, rank: int, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self._progress(tag, rank) < step:
            if any(j.poll() not in (None, 0) for j in self.jobs):
                raise DemoError(f"training job failed; see {self.workdir}/{tag}-rank*.log")
            if all(j.poll() == 0 for j in self.jobs):
                return
            if time.monotonic() > deadline:
                raise DemoError(f"training made no progress to step {step} in {timeout:.0f} s")
            time.sleep(0.01)

    def _wait_jobs(self, outs: list[Path], timeout: float = 180) -> list[dict]:
        deadline = time.monotonic() + timeout
        for j in self.jobs:
            try:
                j.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise DemoError("training job did not finish in time") from None
        res = []
        for o in outs:
            try:
                res.append(json.loads(o.read_text()))
            except (OSError, json.JSONDecodeError):
                raise DemoError(f"training rank wrote no result ({o}); see its .log beside it") from None
        return res

    # --------------------------------------------------------------- run

    def run(self) -> dict:
        self.start()
        self.log(f"reference run: {self.steps} steps, no fault")
        ref = self._wait_jobs(self._launch_job("reference", 29500))
        if any(r["errors"] for r in ref):
            raise DemoError(f"reference run failed: {ref[0]['errors'] or ref[-1]['errors']}")

        fault_host = self.hosts - 1
        outs = self._launch_job("faulted", 29501)
        self._wait_progress("faulted", fault_host, max(5, self.steps // 10))
        c0 = _counters(self.desc, fault_host)
        self._wait_progress("faulted", fault_host, self.steps * 3 // 10)
        c1 = _counters(self.desc, fault_host)
        before = {r: c1[r] - c0[r] for r in c1}
        rail = max(before, key=lambda r: before[r])
        self.log(f"bytes per rail on h{fault_host} while training: {before}; the job runs on rail {rail}: cutting it ({self.mode})")
        cut = fab.cut(self.name, fault_host, rail, self.mode)
        t_cut = cut["t_issued_ns"]
        # "after the cut" counts from the moment the cut is in place: traffic sent between reading
        # c1 and the cut (slow `ip` calls on a busy machine) belongs to before
        c_cut = _counters(self.desc, fault_host)
        step_at_cut = self._progress("faulted", fault_host)
        self._wait_progress("faulted", fault_host, self.steps * 6 // 10)
        c2 = _counters(self.desc, fault_host)
        after = {r: c2[r] - c_cut[r] for r in c2}
        self.log(f"bytes per rail on h{fault_host} after the cut: {after}")
        heal = fab.heal(self.name, fault_host, rail)
        t_heal = heal.get("t_issued_ns") or time.monotonic_ns()
        self.log(f"healed rail {rail}; waiting for fail-back after hold-down ({self.hold_down_ms} ms)")
        results = self._wait_jobs(outs)
        failback_ns = self._wait_failback(fault_host, rail, t_heal)
        return self._summarize(ref, results, fault_host, rail, t_cut, failback_ns, t_heal, before, after, step_at_cut)

    def _wait_failback(self, host: int, rail: int, t_heal: int, timeout: float = 15) -> int | None:
        sock = self.desc["hosts"][host]["control_socket"]
        deadline = time.monotonic() + timeout + self.hold_down_ms / 1000
        while time.monotonic() < deadline:
            hist = _status(sock, "history")["history"]
            up = [e for e in hist if e["kind"] == "plan" and e["t_ns"] > t_heal and rail in e["usable"]]
            if up:
                gen = up[0]["generation"]
                applied = [e for e in hist if e["kind"] == "routes_applied" and e["generation"] >= gen]
                if applied:
                    return applied[0]["t_ns"]
            time.sleep(0.1)
        return None

    def _summarize(self, ref, res, host, rail, t_cut, failback_ns, t_heal, before, after, step_at_cut) -> dict:
        hist = {h["index"]: _status(h["control_socket"], "history")["history"] for h in self.desc["hosts"]}
        mine = hist[host]
        down = next((e for e in mine if e["kind"] == "rail" and e["rail"] == rail and e["new"] == "DOWN" and e["t_ns"] >= t_cut), None)
        detect_ms = reroute_ms = peer_ms = None
        if down:
            t_dec = down["t_ns"]
            detect_ms = (t_dec - t_cut) / 1e6
            plan = next((e for e in mine if e["kind"] == "plan" and e["t_ns"] >= t_dec and rail not in e["usable"]), None)
            if plan:
                ap = next((e for e in mine if e["kind"] == "routes_applied" and e["generation"] >= plan["generation"]), None)
                reroute_ms = None if ap is None else (ap["t_ns"] - t_dec) / 1e6
            peer_times = []
            for idx, hh in hist.items():
                if idx == host:
                    continue
                pr = next((e for e in hh if e["kind"] == "peer_rails" and e["peer"] == f"h{host}" and e["t_ns"] >= t_cut and rail not in e["usable"]), None)
                if pr:
                    # the peer's first plan without that rail: after the notice, or earlier when its
                    # own probes saw the fault first (a blackhole looks the same from both ends)
                    pplan = next((e for e in hh if e["kind"] == "plan" and e["t_ns"] >= t_cut
                                  and (e["t_ns"] >= pr["t_ns"] or rail not in e["usable"])), None)
                    ap = pplan and next((e for e in hh if e["kind"] == "routes_applied" and e["generation"] >= pplan["generation"]), None)
                    if ap:
                        peer_times.append((ap["t_ns"] - t_dec) / 1e6)
                    else:
                        peer_times.append(None)
                else:
                    peer_times.append(None)
            peer_ms = None if (not peer_times or None in peer_times) else max(peer_times)
        steps_done = min(r["steps_done"] for r in res)
        stall = max(max(r["step_ms"]) if r["step_ms"] else 0.0 for r in res)
        same = all(r["weights_sha256"] == ref[0]["weights_sha256"] for r in res + ref)
        out = {
            "steps": self.steps,
            "steps_lost": self.steps - steps_done,
            "max_step_stall_ms": round(stall, 3),
            "median_step_ms": round(sorted(res[0]["step_ms"])[len(res[0]["step_ms"]) // 2], 3) if res[0]["step_ms"] else None,
            "weights_match_reference": same,
            "fault": {"host": host, "rail": rail, "mode": self.mode, "step_at_cut": step_at_cut},
            "rail_bytes_before_cut": {str(k): v for k, v in before.items()},
            "rail_bytes_after_cut": {str(k): v for k, v in after.items()},
            "detect_ms": None if detect_ms is None else round(detect_ms, 3),
            "reroute_ms": None if reroute_ms is None else round(reroute_ms, 3),
            "peer_reroute_ms": None if peer_ms is None else round(peer_ms, 3),
            "failback_ms": None if failback_ns is None else round((failback_ns - t_heal) / 1e6, 3),
            "hold_down_ms": self.hold_down_ms,
            "hosts": self.hosts,
            "rails": self.rails,
            "errors": [e for r in res for e in r["errors"]],
            "workdir": str(self.workdir),
        }
        return out

    # --------------------------------------------------------------- teardown

    def close(self) -> None:
        for p in self.jobs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.jobs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.built:  # never tear down a fabric this demo did not build
            self.cluster.close()


def _print_summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(emoji=False)
    ok = r["steps_lost"] == 0 and r["weights_match_reference"]
    t = Table(title="linkpass demo: training through a rail cut", show_header=False)
    t.add_row("result", "[green]job kept training, weights identical to the fault-free run[/]" if ok else "[red]job was disturbed[/]")
    t.add_row("fault", f"host h{r['fault']['host']}, rail {r['fault']['rail']}, {r['fault']['mode']} at step {r['fault']['step_at_cut']}")
    t.add_row("steps / lost", f"{r['steps']} / {r['steps_lost']}")
    t.add_row("longest step (stall)", f"{r['max_step_stall_ms']} ms (median {r['median_step_ms']} ms)")
    t.add_row("weights match reference", str(r["weights_match_reference"]))
    t.add_row("rail bytes before cut", json.dumps(r["rail_bytes_before_cut"]))
    t.add_row("rail bytes after cut", json.dumps(r["rail_bytes_after_cut"]))
    t.add_row("detect", f"{r['detect_ms']} ms")
    t.add_row("local reroute", f"{r['reroute_ms']} ms")
    t.add_row("peer reroute", f"{r['peer_reroute_ms']} ms")
    t.add_row("failback (incl. hold-down)", f"{r['failback_ms']} ms")
    c.print(t)


def main(args) -> int:
    """Entry point of ``linkpass demo``.  Exit 0 when the job lost no step and the weights
    match the reference, 1 otherwise."""
    if os.geteuid() != 0:
        raise DemoError("must run as root (it creates network namespaces)", 2)
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise DemoError(f"--json {args.json}: directory {parent} does not exist or is not writable", 2)
    scenario = getattr(args, "scenario", "reroute")
    from linkpass.lab import demo_script

    if scenario not in ("reroute", "rebuild", "guard-device-fault") + demo_script.SCENARIOS:
        raise DemoError("--scenario must be reroute (kernel routes), rail, rail-latched or device-fault (an unmodified "
                        "--script under linkpass exec), or rebuild / guard-device-fault (the explicit LinkPassGuard API)", 2)
    if scenario in demo_script.SCENARIOS:
        demo = demo_script.ScriptDemo(getattr(args, "script", None) or str(demo_script.DEFAULT_SCRIPT),
                                      getattr(args, "script_args", None) if getattr(args, "script_args", None) is not None
                                      else (demo_script.DEFAULT_SCRIPT_ARGS if not getattr(args, "script", None) else ""),
                                      scenario, args.hosts, args.rails, args.name, args.mode, spares=getattr(args, "spares", 1),
                                      fault_host=getattr(args, "fault_host", None))
    elif scenario == "guard-device-fault":
        if getattr(args, "fault_host", None) == "all":
            raise DemoError("--fault-host all: only for the rail scenarios (rail, rail-latched)", 2)
        demo = DeviceFaultDemo(args.hosts, args.rails, args.steps, args.name, args.mode, spares=getattr(args, "spares", 1),
                               fault_host=getattr(args, "fault_host", None))
    else:
        demo = (RebuildDemo if scenario == "rebuild" else Demo)(args.hosts, args.rails, args.steps, args.name, args.mode)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    ok = False
    keep = getattr(args, "keep_logs", False)
    result = None
    try:
        result = demo.run()
        ok = result.get("ok", result["steps_lost"] == 0 and result["weights_match_reference"])
    except KeyboardInterrupt:
        print("linkpass demo: interrupted; tearing down", file=sys.stderr)
        return 130
    except DemoError as e:
        keep = keep or e.exit_code == 1  # a failure while running: its logs explain it
        raise
    finally:
        demo.close()
        signal.signal(signal.SIGTERM, old)
        if keep or (result is not None and not ok):
            print(f"linkpass demo: logs kept in {demo.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(demo.workdir, ignore_errors=True)
            if result is not None:
                result["workdir"] = None
    {"rebuild": _print_rebuild_summary, "guard-device-fault": _print_device_fault_summary,
     **{s: demo_script.print_summary for s in demo_script.SCENARIOS}}.get(scenario, _print_summary)(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


# --------------------------------------------------------------------------- scenario "rebuild"


class RebuildDemo(Demo):
    """``linkpass demo --scenario rebuild``: the torch hook moves the job instead of the kernel.

    The fabric is in per-rail-IP mode and every daemon runs with ``reroute = "notify-only"``:
    no route changes.  The job's gloo process group is bound to rail 0's interfaces (the
    guard's device is ``rail0``); its TCPStore listens on host 0's rail-1 address (the store
    stands for the rendezvous on a front-end network the fault does not touch).  Rail 0 of the
    last host is cut (carrier loss) at 30 % of the run and healed at 60 %; the hook
    (:class:`torch_hooks.guard.LinkPassGuard`) aborts the group, rebuilds it on rail 1 and
    replays the interrupted step.  The reference run uses the same hook with no fault.

    Report additions: ``rebuild_ms`` (slowest rank: fault notice received by its hook -> first
    step completed on the new process group), ``rebuild_ms_per_rank``, ``cut_to_resume_ms``
    (cut issued -> the slowest rank's first step on the new group), ``cut_to_notice_ms`` (cut ->
    the faulty host's hook has the notice), ``rebuilds`` (each rank's guard events),
    ``kernel_routes`` (linkpass routes found in the hosts' kernels: none in notify-only mode).
    """

    STORE_RAIL = 1
    PG_RAIL = 0

    def __init__(self, hosts: int, rails: int, steps: int, name: str, mode: str, hold_down_ms: int = 2000, log=print):
        super().__init__(hosts, rails, steps, name, mode, hold_down_ms, log)
        self.cluster = Cluster(hosts, rails, name, hold_down_ms, mode="per-rail-ip", workdir=self.workdir)

    def start(self) -> None:
        import tomllib

        import tomli_w

        self.log(f"fabric: {self.hosts} hosts x {self.rails} rails, per-rail-IP mode (name {self.name})")
        try:
            fab.load(self.name)
        except fab.FabricError:
            pass
        else:
            raise DemoError(f"name in use: a fabric named {self.name!r} exists; pick another --name "
                            f"or remove it with `linkpass fabric down --name {self.name}`", 2)
        try:
            self.desc = self.cluster.up()
        except fab.FabricError as e:
            raise DemoError(f"fabric: {e}", getattr(e, "exit_code", 1)) from None
        self.built = True
        try:
            for h in self.desc["hosts"]:
                raw = tomllib.loads(Path(h["config"]).read_text())
                raw["daemon"]["reroute"] = "notify-only"
                cfg = self.workdir / f"h{h['index']}-notify-only.toml"
                cfg.write_text(tomli_w.dumps(raw))
                self.cluster.start(h["index"], config=str(cfg), wait=False)
            for h in self.desc["hosts"]:
                self.cluster.wait_ready(h["index"])
        except ClusterError as e:
            raise DemoError(str(e)) from None
        self.log(f"daemons ready on {self.hosts} hosts (reroute = notify-only: they never change a route)")

    def _launch_job(self, tag: str, port: int) -> list[Path]:
        from linkpass.adapters.hook_server import default_socket_path

        outs = []
        self.jobs = []
        store_addr = self.desc["hosts"][0]["rails"][self.STORE_RAIL]["address"]
        names = [h["name"] for h in self.desc["hosts"]]
        for h in self.desc["hosts"]:
            out = self.workdir / f"{tag}-rank{h['index']}.json"
            prog = self.workdir / f"{tag}-rank{h['index']}.progress"
            for f in (out, prog):
                f.unlink(missing_ok=True)
            outs.append(out)
            ifaces = ",".join(f"{r['rail']}={r['netdev']}" for r in sorted(h["rails"], key=lambda r: r["rail"] != self.PG_RAIL))
            logf = open(self.workdir / f"{tag}-rank{h['index']}.log", "w")
            self.jobs.append(subprocess.Popen(
                fab.netns_exec(self.name, h["index"]) + [
                    sys.executable, "-m", "linkpass.lab.demo_train", "--rank", str(h["index"]), "--world-size", str(self.hosts),
                    "--master-addr", store_addr, "--master-port", str(port), "--steps", str(self.steps),
                    "--hook", "--rail-ifaces", ifaces, "--rail", str(self.PG_RAIL),
                    "--hooks-socket", default_socket_path(h["control_socket"]),
                    "--peers", ",".join(n for n in names if n != h["name"]), "--timeout-s", "30",
                    "--out", str(out), "--progress", str(prog)],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
        return outs

    def run(self) -> dict:
        self.start()
        self.log(f"reference run: {self.steps} steps, no fault (process group on rail {self.PG_RAIL}, under the hook)")
        ref = self._wait_jobs(self._launch_job("reference", 29500))
        if any(r["errors"] for r in ref):
            raise DemoError(f"reference run failed: {ref[0]['errors'] or ref[-1]['errors']}")
        fault_host, rail = self.hosts - 1, self.PG_RAIL
        outs = self._launch_job("faulted", 29501)
        self._wait_progress("faulted", fault_host, max(5, self.steps // 10))
        c0 = _counters(self.desc, fault_host)
        self._wait_progress("faulted", fault_host, self.steps * 3 // 10)
        c1 = _counters(self.desc, fault_host)
        before = {r: c1[r] - c0[r] for r in c1}
        self.log(f"bytes per rail on h{fault_host} while training: {before}; cutting rail {rail} ({self.mode})")
        t_cut = fab.cut(self.name, fault_host, rail, self.mode)["t_issued_ns"]
        c_cut = _counters(self.desc, fault_host)  # "after" starts once the cut is in place
        step_at_cut = self._progress("faulted", fault_host)
        self._wait_progress("faulted", fault_host, self.steps * 6 // 10)
        c2 = _counters(self.desc, fault_host)
        after = {r: c2[r] - c_cut[r] for r in c2}
        self.log(f"bytes per rail on h{fault_host} after the cut: {after}")
        fab.heal(self.name, fault_host, rail)
        self.log(f"healed rail {rail}: the process group stays on its new rail")
        results = self._wait_jobs(outs)
        routes = {}
        for h in self.desc["hosts"]:
            out = subprocess.run(["ip", "-n", h["netns"], "-j", "route", "show", "proto", "201"], capture_output=True, text=True).stdout
            routes[h["name"]] = len(json.loads(out or "[]"))
        return self._summarize_rebuild(ref, results, fault_host, rail, t_cut, before, after, step_at_cut, routes)

    def _summarize_rebuild(self, ref, res, host, rail, t_cut, before, after, step_at_cut, routes) -> dict:
        mine = _status(self.desc["hosts"][host]["control_socket"], "history")["history"]
        down = next((e for e in mine if e["kind"] == "rail" and e["rail"] == rail and e["new"] == "DOWN" and e["t_ns"] >= t_cut), None)
        # the first rebuild after the cut (one before it would mean the job started on a rail
        # still held down; it is counted in rebuilds_before_cut)
        firsts = [(r["rank"], next((e for e in r.get("rebuilds", []) if e["notice_t_ns"] >= t_cut), None)) for r in res]
        early = sum(1 for r in res for e in r.get("rebuilds", []) if e["notice_t_ns"] < t_cut)
        per_rank = {str(k): (None if e is None else e.get("rebuild_ms")) for k, e in firsts}
        done = [e for _, e in firsts if e is not None and e.get("first_step_t_ns")]
        faulty = next((e for k, e in firsts if k == host), None)
        steps_done = min(r["steps_done"] for r in res)
        stall = max(max(r["step_ms"]) if r["step_ms"] else 0.0 for r in res)
        same = all(r["weights_sha256"] == ref[0]["weights_sha256"] for r in res + ref)
        keep = ("epoch", "trigger", "rail_from", "rail_to", "interrupted_step", "resume_step", "notice_generation",
                "abort_ms", "agree_ms", "build_ms", "rebuild_ms")
        return {
            "scenario": "rebuild",
            "steps": self.steps,
            "steps_lost": self.steps - steps_done,
            "max_step_stall_ms": round(stall, 3),
            "median_step_ms": round(sorted(res[0]["step_ms"])[len(res[0]["step_ms"]) // 2], 3) if res[0]["step_ms"] else None,
            "weights_match_reference": same,
            "fault": {"host": host, "rail": rail, "mode": self.mode, "step_at_cut": step_at_cut},
            "rebuild_ms": max(per_rank.values()) if per_rank and None not in per_rank.values() else None,
            "rebuild_ms_per_rank": per_rank,
            "cut_to_notice_ms": None if faulty is None else round((faulty["notice_t_ns"] - t_cut) / 1e6, 3),
            "cut_to_resume_ms": round((max(e["first_step_t_ns"] for e in done) - t_cut) / 1e6, 3) if done and len(done) == len(res) else None,
            "detect_ms": None if down is None else round((down["t_ns"] - t_cut) / 1e6, 3),
            "rebuilds": {str(r["rank"]): [{k: e.get(k) for k in keep} for e in r.get("rebuilds", [])] for r in res},
            "rebuilds_before_cut": early,
            "rail_bytes_before_cut": {str(k): v for k, v in before.items()},
            "rail_bytes_after_cut": {str(k): v for k, v in after.items()},
            "kernel_routes": routes,
            "reroute": "notify-only",
            "hosts": self.hosts,
            "rails": self.rails,
            "errors": [e for r in res for e in r["errors"]],
            "workdir": str(self.workdir),
        }


def _print_rebuild_summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = r["steps_lost"] == 0 and r["weights_match_reference"]
    t = Table(title="linkpass demo --scenario rebuild: the hook moves the process group", show_header=False)
    t.add_row("result", "[green]job kept training on a rebuilt process group, weights identical to the fault-free run[/]" if ok
              else "[red]job was disturbed[/]")
    t.add_row("fault", f"host h{r['fault']['host']}, rail {r['fault']['rail']}, {r['fault']['mode']} at step {r['fault']['step_at_cut']}")
    t.add_row("steps / lost", f"{r['steps']} / {r['steps_lost']}")
    t.add_row("weights match reference", str(r["weights_match_reference"]))
    t.add_row("rebuild (notice -> first step on new group)", f"{r['rebuild_ms']} ms (per rank {json.dumps(r['rebuild_ms_per_rank'])})")
    t.add_row("cut -> notice in the hook", f"{r['cut_to_notice_ms']} ms")
    t.add_row("cut -> training resumed", f"{r['cut_to_resume_ms']} ms")
    t.add_row("longest step (stall)", f"{r['max_step_stall_ms']} ms (median {r['median_step_ms']} ms)")
    t.add_row("rail bytes before / after cut", f"{json.dumps(r['rail_bytes_before_cut'])} / {json.dumps(r['rail_bytes_after_cut'])}")
    t.add_row("linkpass kernel routes", f"{json.dumps(r['kernel_routes'])} (reroute = notify-only)")
    Console(emoji=False).print(t)


# --------------------------------------------------------------------------- scenario "device-fault"


class DeviceFaultDemo(RebuildDemo):
    """``linkpass demo --scenario device-fault``: a GPU fails under a rank; a hot spare takes the
    rank over (rank migration, :mod:`torch_hooks.spare`).

    Same fabric and daemons as ``--scenario rebuild`` (per-rail IPs, notify-only).  Each host
    runs one rank on its GPU 0 and one hot spare (GPU 1 of that host, :func:`linkpass.lab.inject.fake_pci_bus_id`).
    At 30 % of the run ``linkpass inject device-fault --host <last> --gpu 0 --xid 79`` appends
    an Xid 79 record to that host's kernel log; its daemon classifies it (gpu, migrate-rank),
    maps the PCI id to GPU 0 and sends ``device_fault`` to the hook on GPU 0; that rank hands
    its rank to the spare on its host and exits (fenced); the other rank finds the request in
    the store, the group is re-formed with the spare in its place, the spare gets the state
    from rank 0 and the interrupted step is replayed.  The reference run has no spares, no fault.

    Report additions: ``migration_ms`` (inject issued -> first step completed by the spare),
    ``steps_lost``, ``weights_match_reference`` (the surviving rank and the spare, bitwise,
    against the fault-free run), ``migration`` (the spare's join event: agree/build/state
    timings, state bytes, how the faulty process was fenced), ``faulty_exit`` (its exit status:
    74, or -9 when the spare's fence killed it first), ``rank_exits`` (every rank's exit status),
    ``ok`` and ``result`` (one line).  With ``--spares 0`` the expected outcome is that every rank
    stops with 69 (no spare left): ``ok`` is true then, and the demo exits 0.
    """

    def __init__(self, hosts: int, rails: int, steps: int, name: str, mode: str, hold_down_ms: int = 2000, log=print,
                 spares: int = 1, fault_host: int | None = None):
        super().__init__(hosts, rails, steps, name, mode, hold_down_ms, log)
        if not 0 <= spares <= 4:
            raise DemoError("--spares must be 0..4", 2)
        fault_host = hosts - 1 if fault_host is None else fault_host
        if not 0 <= fault_host < hosts:
            raise DemoError(f"--fault-host must be 0..{hosts - 1} (the host whose rank loses its GPU), got {fault_host}", 2)
        self.spares, self.fault_host = spares, fault_host
        self.spare_jobs: list[subprocess.Popen] = []
        self.store_job: subprocess.Popen | None = None

    def _launch_job(self, tag: str, port: int, spares: int = 0) -> list[Path]:
        from linkpass.adapters.hook_server import default_socket_path

        outs = [self.workdir / f"{tag}-rank{h['index']}.json" for h in self.desc["hosts"]]
        self.jobs, self.spare_jobs = [], []
        store_addr = self.desc["hosts"][0]["rails"][self.STORE_RAIL]["address"]
        names = [h["name"] for h in self.desc["hosts"]]
        self._start_store(tag, store_addr, port)
        for h in self.desc["hosts"]:
            ifaces = ",".join(f"{r['rail']}={r['netdev']}" for r in sorted(h["rails"], key=lambda r: r["rail"] != self.PG_RAIL))
            common = ["--world-size", str(self.hosts), "--master-addr", store_addr, "--master-port", str(port),
                      "--steps", str(self.steps), "--hook", "--rail-ifaces", ifaces, "--rail", str(self.PG_RAIL),
                      "--hooks-socket", default_socket_path(h["control_socket"]), "--host", h["name"],
                      "--peers", ",".join(n for n in names if n != h["name"]), "--timeout-s", "30", "--external-store"]
            for k in range(spares + 1):
                tagk = f"rank{h['index']}" if k == 0 else f"spare{h['index']}-{k}"
                out, prog = self.workdir / f"{tag}-{tagk}.json", self.workdir / f"{tag}-{tagk}.progress"
                for f in (out, prog):
                    f.unlink(missing_ok=True)
                extra = ["--rank", str(h["index"]), "--gpu", "0"] if k == 0 else ["--rank", "0", "--gpu", str(k), "--spare",
                                                                               "--spare-wait-s", "300"]
                logf = open(self.workdir / f"{tag}-{tagk}.log", "w")
                p = subprocess.Popen(fab.netns_exec(self.name, h["index"]) + [sys.executable, "-m", "linkpass.lab.demo_train"]
                                     + extra + common + ["--out", str(out), "--progress", str(prog)],
                                     stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
                (self.jobs if k == 0 else self.spare_jobs).append(p)
        return outs

    def _start_store(self, tag: str, addr: str, port: int) -> None:
        """The job's TCPStore in a process of its own on host 0 (as torchrun's agent hosts it),
        so that any rank, rank 0 included, can lose its GPU and be migrated."""
        self._stop_store()
        prog = self.workdir / f"{tag}-store.progress"
        prog.unlink(missing_ok=True)
        logf = open(self.workdir / f"{tag}-store.log", "w")
        self.store_job = subprocess.Popen(fab.netns_exec(self.name, 0) + [
            sys.executable, "-m", "linkpass.lab.demo_train", "--store-only", "--rank", "0", "--world-size", str(self.hosts),
            "--master-addr", addr, "--master-port", str(port), "--out", os.devnull, "--progress", str(prog)],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not (prog.exists() and prog.read_text() == "ready"):
            if self.store_job.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"the job's store did not start on {addr}:{port}: "
                                f"{(self.workdir / f'{tag}-store.log').read_text()[-500:]}")
            time.sleep(0.05)

    def _stop_store(self) -> None:
        p, self.store_job = self.store_job, None
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def run(self) -> dict:
        from linkpass.lab.inject import inject_device_fault

        self.start()
        self.log(f"reference run: {self.steps} steps, no fault, no spares")
        ref = self._wait_jobs(self._launch_job("reference", 29500))
        if any(r["errors"] for r in ref):
            raise DemoError(f"reference run failed: {ref[0]['errors'] or ref[-1]['errors']}")
        fault_host = self.fault_host
        self.log(f"faulted run: {self.spares} hot spare(s) per host")
        self._launch_job("faulted", 29501, self.spares)
        self._wait_progress("faulted", fault_host, self.steps * 3 // 10)
        step_at_fault = self._progress("faulted", fault_host)
        inj = inject_device_fault(self.name, fault_host, 0, 79)
        self.log(f"injected Xid 79 on h{fault_host} GPU 0 ({inj['pci']}) at step {step_at_fault}")
        codes, taken, res = self._collect_faulted(fault_host, time.monotonic() + 180)
        return self._summarize_migration(ref, res, taken, codes, fault_host, inj, step_at_fault)

    def _collect_faulted(self, fault_host: int, deadline: float) -> tuple[dict, dict | None, list[dict]]:
        """After the fault: wait (until ``deadline``, monotonic s) for the ranks to exit, then for
        the spare that took a rank over; stop the other spares.  Returns ``(exit codes by rank,
        the taken spare's result or None, the healthy ranks' results)``."""
        codes = {}
        while len(codes) < len(self.jobs) and time.monotonic() < deadline:
            for i, j in enumerate(self.jobs):
                if i not in codes and j.poll() is not None:
                    codes[i] = j.returncode
            # the taken spare ends with the job; the others wait: stop when the taken one is done
            time.sleep(0.05)
        taken = None
        for k, sj in enumerate(self.spare_jobs):
            h, n = divmod(k, max(1, self.spares))
            f = self.workdir / f"faulted-spare{h}-{n + 1}.json"
            try:
                sj.wait(max(0.1, deadline - time.monotonic()) if self._spare_taken(h, n + 1) else 0.5)
            except subprocess.TimeoutExpired:
                pass
            if f.exists():
                d = json.loads(f.read_text())
                if not d.get("spare_unused") and "weights_sha256" in d:
                    taken = d
        self._stop_spares()
        res = []
        for h in self.desc["hosts"]:
            f = self.workdir / f"faulted-rank{h['index']}.json"
            if h["index"] != fault_host and f.exists():
                res.append(json.loads(f.read_text()))
        return codes, taken, res

    def _spare_taken(self, h: int, n: int) -> bool:
        try:
            return int((self.workdir / f"faulted-spare{h}-{n}.progress").read_text() or 0) > 0 or \
                "takes rank" in (self.workdir / f"faulted-spare{h}-{n}.log").read_text()
        except (OSError, ValueError):
            return False

    def _stop_spares(self) -> None:
        for p in self.spare_jobs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.spare_jobs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    def _summarize_migration(self, ref, res, taken, codes, host, inj, step_at_fault) -> dict:
        survivors = res + ([taken] if taken else [])
        ok_ranks = len(survivors) == self.hosts
        if ok_ranks:
            steps_done = min(r["steps_done"] for r in survivors)
        else:  # the job stopped: the steps every rank finished (progress files; a stopped rank writes no result)
            steps_done = min((self._progress("faulted", h["index"]) for h in self.desc["hosts"]), default=0)
        same = ok_ranks and all(r["weights_sha256"] == ref[0]["weights_sha256"] for r in survivors + ref)
        joined = next((e for e in (taken or {}).get("rebuilds", []) if e.get("event") == "joined"), None)
        mig_ms = None
        if joined and joined.get("first_step_t_ns"):
            mig_ms = round((joined["first_step_t_ns"] - inj["t_issued_ns"]) / 1e6, 3)
        keep = ("epoch", "interrupted_step", "resume_step", "spare", "fenced", "agree_ms", "build_ms", "state_ms",
                "state_bytes", "rebuild_ms")
        from torch_hooks.spare import EXIT_NO_SPARE

        if self.spares == 0:
            # nothing can take the rank over: as designed, every rank stops with EXIT_NO_SPARE
            ok = len(codes) == self.hosts and all(c == EXIT_NO_SPARE for c in codes.values())
            outcome = (f"no spare left: every rank stopped cleanly with status {EXIT_NO_SPARE} (as designed)" if ok else
                       f"no spare left, but the ranks did not all stop with {EXIT_NO_SPARE}: exits {codes}")
        else:
            ok = self.steps - steps_done == 0 and bool(same)
            outcome = ("job kept training on a spare, weights identical to the fault-free run" if ok else
                       f"job was disturbed: {self.steps - steps_done} steps lost, weights match: {bool(same)}, exits {codes}")
        return {
            "scenario": "device-fault",
            "ok": ok,
            "result": outcome,
            "steps": self.steps,
            "steps_lost": self.steps - steps_done,
            "weights_match_reference": bool(same),
            "migration_ms": mig_ms,
            "fault": {"host": host, "gpu": 0, "pci": inj["pci"], "xid": inj["xid"], "step_at_fault": step_at_fault},
            "faulty_exit": codes.get(host),
            "rank_exits": {str(k): v for k, v in codes.items()},
            "spares_per_host": self.spares,
            "migration": None if joined is None else {k: joined.get(k) for k in keep},
            "peer_events": {str(r["rank"]): [{k: e.get(k) for k in ("epoch", "trigger", "migrated_rank", "state_from",
                                                                 "resume_step", "state_ms")} for e in r.get("rebuilds", [])]
                            for r in res},
            "hosts": self.hosts,
            "rails": self.rails,
            "errors": [e for r in survivors for e in r["errors"]],
            "workdir": str(self.workdir),
        }

    def close(self) -> None:
        self._stop_spares()
        self._stop_store()
        super().close()


def _print_device_fault_summary(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = r["ok"]
    title = ("a hot spare takes the rank over" if r["spares_per_host"] else
             "no spare: every rank must stop cleanly (exit 69)")
    t = Table(title=f"linkpass demo --scenario device-fault: {title}", show_header=False)
    t.add_row("result", f"[green]{r['result']}[/]" if ok else f"[red]{r['result']}[/]")
    f = r["fault"]
    t.add_row("fault", f"host h{f['host']}, GPU {f['gpu']} ({f['pci']}), Xid {f['xid']} at step {f['step_at_fault']}")
    t.add_row("steps / lost", f"{r['steps']} / {r['steps_lost']}")
    t.add_row("weights match reference", str(r["weights_match_reference"]))
    t.add_row("migration (inject -> spare's first step)", "-" if r["migration_ms"] is None else f"{r['migration_ms']} ms")
    t.add_row("spare join", json.dumps(r["migration"]))
    t.add_row("faulty process exit", str(r["faulty_exit"]))
    t.add_row("rank exits", json.dumps(r["rank_exits"]))
    Console(emoji=False).print(t)
