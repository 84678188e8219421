#!/usr/bin/env python3
"""How fast the torch hook rebuilds a job's process group after a rail cut, and how long the
same cut leaves the job stuck without it.

    sudo .venv/bin/python bench/rebuild.py --trials 10 --steps 120 --json bench/results/rebuild.json

One emulated fabric (name ``bnrb`` by default), 2 hosts x 2 rails in per-rail-IP mode, one
daemon per host with ``reroute = "notify-only"`` (no route changes: only the hook can move the
job), exactly the setup of ``linkpass demo --scenario rebuild``
(:class:`linkpass.lab.demo.RebuildDemo`):

1. one fault-free run under the hook: the reference weights;
2. ``--trials`` runs: the gloo process group starts on rail 0, rail 0 of the last host is cut
   (carrier loss) at 30 % of the run, healed after the run.  Per trial: ``rebuild_ms`` (slowest
   rank: fault notice received by its hook -> first step completed on the new process group),
   ``cut_to_resume_ms``, ``steps_lost`` and whether the weights are bitwise equal to the
   reference;
3. without linkpass's hook: the same job with a plain ``init_process_group`` (gloo bound to
   rail 0 by ``GLOO_SOCKET_IFNAME``, process group timeout ``--timeout-s``), the same cut;
   ``stuck_s`` = cut -> the collective fails with gloo's timeout error (the job is stuck that
   long, then dies).

Prints figures and writes JSON; asserts nothing.  Must run as root.  Takes about
``20 + 6 x trials + timeout`` seconds on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from _cluster import BenchError, machine_info, run_and_report, summary

from linkpass.lab import fabric as fab
from linkpass.lab.demo import DemoError, RebuildDemo, _counters

SCHEMA = "linkpass.bench.rebuild/v1"


class Bench(RebuildDemo):
    def wait_usable(self, timeout: float = 20.0) -> None:
        """Wait until every daemon has every rail usable here and at its peers (fail-back after
        the previous trial's heal includes the hold-down): a job must not start on a held rail."""
        deadline = time.monotonic() + timeout
        allr = list(range(self.rails))
        while True:
            sts = [self.cluster.ask(h["index"]) for h in self.desc["hosts"]]
            if all(all(r["usable"] for r in st["rails"]) and all(p["usable_rails"] == allr for p in st["peers"]) for st in sts):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"rails not all usable again {timeout:.0f} s after the heal")
            time.sleep(0.1)

    def faulted(self, tag: str, port: int, ref_sha: str) -> dict:
        host, rail = self.hosts - 1, self.PG_RAIL
        self.wait_usable()
        outs = self._launch_job(tag, port)
        self._wait_progress(tag, host, self.steps * 3 // 10)
        c1 = _counters(self.desc, host)
        t_cut = fab.cut(self.name, host, rail, self.mode)["t_issued_ns"]
        res = self._wait_jobs(outs)
        c2 = _counters(self.desc, host)
        fab.heal(self.name, host, rail)
        r = self._summarize_rebuild([{"weights_sha256": ref_sha}], res, host, rail, t_cut,
                                    {}, {k: c2[k] - c1[k] for k in c2}, None, {})
        return {k: r[k] for k in ("steps_lost", "weights_match_reference", "rebuild_ms", "rebuild_ms_per_rank", "rebuilds_before_cut",
                                  "cut_to_resume_ms", "cut_to_notice_ms", "max_step_stall_ms", "rail_bytes_after_cut", "errors")}

    def no_hook(self, port: int, timeout_s: float) -> dict:
        """The job without the hook: gloo on rail 0 (GLOO_SOCKET_IFNAME), store on rail 1."""
        host, rail = self.hosts - 1, self.PG_RAIL
        store_addr = self.desc["hosts"][0]["rails"][self.STORE_RAIL]["address"]
        outs, self.jobs = [], []
        steps = self.steps * 4
        for h in self.desc["hosts"]:
            out = self.workdir / f"nohook-rank{h['index']}.json"
            prog = self.workdir / f"nohook-rank{h['index']}.progress"
            outs.append(out)
            logf = open(self.workdir / f"nohook-rank{h['index']}.log", "w")
            self.jobs.append(subprocess.Popen(
                fab.netns_exec(self.name, h["index"]) + [
                    sys.executable, "-m", "linkpass.lab.demo_train", "--rank", str(h["index"]), "--world-size", str(self.hosts),
                    "--master-addr", store_addr, "--master-port", str(port), "--iface", h["rails"][rail]["netdev"],
                    "--steps", str(steps), "--timeout-s", str(timeout_s), "--out", str(out), "--progress", str(prog)],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
        self._wait_progress("nohook", host, self.steps // 3)
        t_cut = fab.cut(self.name, host, rail, self.mode)["t_issued_ns"]
        step_at_cut = self._progress("nohook", host)
        deadline = time.monotonic() + timeout_s * 3 + 60
        for j in self.jobs:
            j.wait(max(1, deadline - time.monotonic()))
        fab.heal(self.name, host, rail)
        res = [json.loads(o.read_text()) for o in outs]
        errs = [r.get("error_t_ns") for r in res if r.get("error_t_ns")]
        return {"timeout_s": timeout_s, "steps": steps, "step_at_cut": step_at_cut,
                "steps_done": [r["steps_done"] for r in res],
                "stuck_s": None if not errs else round((min(errs) - t_cut) / 1e9, 3),
                "stuck_s_slowest_rank": None if not errs else round((max(errs) - t_cut) / 1e9, 3),
                "errors": [e[:200] for r in res for e in r["errors"]]}


def run(args) -> dict:
    b = Bench(2, 2, args.steps, args.name, "carrier-loss", log=lambda m: print(m, flush=True))
    try:
        try:
            b.start()
        except DemoError as e:
            raise BenchError(str(e)) from None
        ref = b._wait_jobs(b._launch_job("reference", 29500))
        if any(r["errors"] for r in ref):
            raise BenchError(f"reference run failed: {ref[0]['errors'] or ref[1]['errors']}")
        ref_sha = ref[0]["weights_sha256"]
        trials = []
        for i in range(args.trials):
            t = b.faulted(f"trial{i}", 29600 + i, ref_sha)
            print(f"trial {i + 1}/{args.trials}: rebuild {t['rebuild_ms']} ms, cut->resume {t['cut_to_resume_ms']} ms, "
                  f"steps lost {t['steps_lost']}, weights equal {t['weights_match_reference']}", flush=True)
            trials.append(t)
        nohook = None
        if not args.skip_no_hook:
            b.wait_usable()
            print(f"without the hook: same cut, process group timeout {args.timeout_s} s ...", flush=True)
            nohook = b.no_hook(29590, args.timeout_s)
        ok = [t for t in trials if t["rebuild_ms"] is not None]
        result = {
            "schema": SCHEMA,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "params": {"trials": args.trials, "steps": args.steps, "hosts": 2, "rails": 2, "mode": "carrier-loss",
                       "timeout_s": args.timeout_s},
            "machine": machine_info(),
            "rebuild_ms": summary([t["rebuild_ms"] for t in ok]),
            "cut_to_resume_ms": summary([t["cut_to_resume_ms"] for t in ok if t["cut_to_resume_ms"] is not None]),
            "all_steps_kept": all(t["steps_lost"] == 0 for t in trials),
            "all_weights_equal": all(t["weights_match_reference"] for t in trials),
            "failed_trials": len(trials) - len(ok),
            "trials": trials,
            "without_hook": nohook,
            "target_rebuild_p50_ms": 2000,
        }
    except (BaseException) as e:
        b.close()
        print(f"logs kept in {b.workdir}", file=sys.stderr)
        if isinstance(e, DemoError):
            raise BenchError(str(e)) from None
        raise
    b.close()
    import shutil

    shutil.rmtree(b.workdir, ignore_errors=True)
    return result


def print_report(r: dict) -> None:
    rb, cr = r["rebuild_ms"], r["cut_to_resume_ms"]
    print(f"\nrebuild_ms (notice in the hook -> first step on the new process group), {rb['n']} trials: "
          f"p50 {rb['p50']} / p99 {rb['p99']} / max {rb['max']} ms (target p50 <= {r['target_rebuild_p50_ms']} ms)")
    print(f"cut -> training resumed: p50 {cr['p50']} / p99 {cr['p99']} ms")
    print(f"steps lost 0 in every trial: {r['all_steps_kept']}; weights bitwise equal in every trial: {r['all_weights_equal']}")
    nh = r["without_hook"]
    if nh:
        print(f"without the hook: stuck {nh['stuck_s']} s after the cut (process group timeout {nh['timeout_s']} s), "
              f"then the job failed at steps {nh['steps_done']}: {(nh['errors'] or ['no error?'])[0][:120]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--timeout-s", type=float, default=30.0, help="process group timeout of the run without the hook")
    p.add_argument("--skip-no-hook", action="store_true", help="leave out the run without the hook")
    p.add_argument("--name", default="bnrb")
    p.add_argument("--json")
    args = p.parse_args()
    if args.steps < 50 or args.trials < 1:
        p.error("--steps must be >= 50 and --trials >= 1")
    return run_and_report("bench/rebuild.py", run, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
