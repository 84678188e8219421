"""`linkpass demo` (``--scenario reroute``, the default): a real training job keeps training
through a rail cut.

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

:class:`Demo` is also the runner the other scenarios build on: the fabric and its daemons, the
ranks' processes, their progress files and results, and the teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from linkpass.lab import fabric as fab
from linkpass.lab.demo.common import DEMO_MODES, DemoError, _counters, _status
from linkpass.lab.fabric.cluster import Cluster, ClusterError


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
