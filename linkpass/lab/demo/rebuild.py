"""`linkpass demo --scenario rebuild`: the torch hook moves the job instead of the kernel
(:class:`RebuildDemo`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from linkpass.lab import fabric as fab
from linkpass.lab.demo.common import DemoError, _counters, _status
from linkpass.lab.demo.reroute import Demo
from linkpass.lab.fabric.cluster import Cluster, ClusterError


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
