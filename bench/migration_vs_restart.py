#!/usr/bin/env python3
"""Time lost to one device fault: linkpass rank migration next to a torchrun restart from the
last checkpoint, the same job and the same fault, in the same run.

    sudo .venv/bin/python bench/migration_vs_restart.py --json bench/results/migration_vs_restart.json

The job: 2 data-parallel ranks (gloo), a model of ``--model-mb`` MB of float32 parameters
(Linear 1024x1024 layers), plain SGD, ``--step-s`` seconds per step (compute + all-reduce,
padded with a sleep inside the step, before the all-reduce, up to ``--step-s``).  Data and
initial weights are seeded per step and rank, so both paths must end with the same weights.

(a) **linkpass**: the fabric and daemons of ``linkpass demo --scenario device-fault``
    (:class:`linkpass.lab.demo.DeviceFaultDemo`: 2 hosts, per-rail IPs, notify-only daemons, one
    rank plus one hot spare per host).  When the last host's rank has finished
    ``--fault-step`` steps, an Xid 79 is injected on its GPU 0 (``linkpass inject
    device-fault``); the spare takes the rank over.  ``migration_ms`` = inject issued -> the
    spare has completed the interrupted step (step index ``--fault-step``).
(b) **torchrun**: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` on loopback;
    rank 0 writes a checkpoint every ``--checkpoint-every`` steps; when the last rank has
    finished ``--fault-step`` steps it SIGKILLs itself (as a device fault would end it);
    torchrun restarts the whole worker group, which reloads the last checkpoint and recomputes
    the steps since.  ``restart_lost_ms`` = SIGKILL -> step ``--fault-step`` completed again.

Both figures run from the fault to the moment the interrupted step is done, so each includes
one step's work.  The fault step defaults to ``checkpoint_every + checkpoint_every // 2``: the
restart path recomputes half a checkpoint interval, the expected loss for a fault at a random
time.  Steps before the last checkpoint ahead of the fault (``fast_until``) run without padding
in both paths (they are in neither figure); every later step, recomputed ones included, takes
``--step-s``.

Prints figures and writes JSON; asserts nothing.  Must run as root (namespaces for (a)).
Defaults take about ``2 x (fault_step - fast_until) x step_s + 60`` s plus the fast steps.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = "linkpass.bench.migration_vs_restart/v1"
HERE = Path(__file__).resolve()

# --------------------------------------------------------------------------- worker (both paths)


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def build_model(torch, model_mb: float, seed: int):
    """``model_mb`` MB of float32 parameters: Linear(D, D)+ReLU layers and a 10-way head."""
    n = int(model_mb * (1 << 20) / 4)
    d = 1024
    if n >= d * d + d:
        layers = max(1, round(n / (d * d + d)))
    else:
        d, layers = max(8, int(n ** 0.5)), 1
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(d, d), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(d, 10))
    return torch.nn.Sequential(*mods), d


def worker(argv: list[str]) -> int:
    t_start = time.monotonic_ns()
    p = argparse.ArgumentParser(prog="migration_vs_restart.py _worker")
    p.add_argument("--mode", choices=("hook", "torchrun"), required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--model-mb", type=float, required=True)
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--fast-until", type=int, default=0)
    p.add_argument("--fault-step", type=int, default=-1, help="torchrun mode: the last rank SIGKILLs itself here, first attempt")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--workdir", help="torchrun mode: checkpoint and outputs")
    p.add_argument("--progress")
    p.add_argument("--out")
    p.add_argument("--timeout-s", type=float, default=60.0)
    # hook mode (the device-fault demo's worker arguments)
    p.add_argument("--rail-ifaces", default="")
    p.add_argument("--rail", type=int, default=0)
    p.add_argument("--hooks-socket")
    p.add_argument("--peers", default="")
    p.add_argument("--gpu", type=int)
    p.add_argument("--host")
    p.add_argument("--spare", action="store_true")
    p.add_argument("--spare-wait-s", type=float, default=600.0)
    p.add_argument("--hook", action="store_true")  # accepted (the demo's argument list); hook mode implies it
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    attempt = 0
    if a.mode == "torchrun":
        a.rank, a.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        a.out = os.path.join(a.workdir, f"torchrun-rank{a.rank}-attempt{attempt}.json")
        a.progress = os.path.join(a.workdir, f"torchrun-rank{a.rank}.progress")
    result = {"rank": a.rank, "world_size": a.world_size, "steps": a.steps, "steps_done": 0, "attempt": attempt,
              "t_start_ns": t_start, "step_ms": [], "step_end_ns": [], "errors": []}
    guard = None
    store = None
    if a.mode == "hook":
        store = dist.TCPStore(a.master_addr, a.master_port, a.world_size, a.rank == 0 and not a.spare,
                              timeout=datetime.timedelta(seconds=a.timeout_s))
        ifaces = {int(k): v for k, v in (kv.split("=", 1) for kv in a.rail_ifaces.split(",") if kv)}
    else:
        # the agent's store, under a prefix of this attempt: keys a killed attempt left behind
        # (its gloo addresses) can never be read by the restarted group
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), a.world_size, False,
                              timeout=datetime.timedelta(seconds=a.timeout_s))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"mvr/attempt{attempt}", agent), rank=a.rank,
                                world_size=a.world_size, timeout=datetime.timedelta(seconds=a.timeout_s))
    result["t_pg_ns"] = time.monotonic_ns()
    model, width = build_model(torch, a.model_mb, a.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    result["model_bytes"] = sum(q.numel() * q.element_size() for q in params)
    target_w = torch.randn(width, 10, generator=torch.Generator().manual_seed(a.seed + 1))
    start = 0
    ckpt = os.path.join(a.workdir, "checkpoint.pt") if a.mode == "torchrun" else None
    if ckpt and os.path.exists(ckpt):
        st = torch.load(ckpt, weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = int(st["steps_done"])
        result["loaded_checkpoint_step"] = start
    result["t_loaded_ns"] = time.monotonic_ns()
    join = None
    if a.spare:
        from torch_hooks.spare import Spare

        sp = Spare(store, job="demo", host=a.host)
        result["spare"] = sp.id
        if a.progress:
            _write(a.progress, "0")
        join = sp.wait(a.spare_wait_s)
        if join is None:
            result["spare_unused"] = True
            _write(a.out, json.dumps(result))
            return 0
        a.rank = result["rank"] = join.rank
    if a.mode == "hook":
        from torch_hooks.guard import LinkPassGuard

        guard = LinkPassGuard(store, a.rank, a.world_size, rails=ifaces, rail=a.rail, state=[model, opt], job="demo",
                              peers=[x for x in a.peers.split(",") if x], hooks_socket=a.hooks_socket,
                              timeout=datetime.timedelta(seconds=a.timeout_s), gpu=a.gpu, host=a.host, join=join)
        start = guard.step_index
    pad = {"s": 0.0}

    def train_step(step: int):
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(a.seed * 100_003 + step * 131 + a.rank)
        x = torch.randn(16, width, generator=g)
        y = (x @ target_w).argmax(dim=1)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        if step >= a.fast_until and pad["s"] > 0:
            time.sleep(pad["s"])  # the rest of a --step-s step's compute
        if guard is not None:
            guard.all_reduce(flat)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= a.world_size
        off = 0
        for q in params:
            k = q.numel()
            q.grad.copy_(flat[off:off + k].view_as(q))
            off += k
        opt.step()
        pad["work_s"] = time.monotonic() - t0 - (pad["s"] if step >= a.fast_until else 0.0)
        return loss

    try:
        for step in range(start, a.steps):
            if a.mode == "torchrun" and attempt == 0 and step == a.fault_step and a.rank == a.world_size - 1:
                _write(os.path.join(a.workdir, "fault.json"), json.dumps({"t_fault_ns": time.monotonic_ns(), "step": step,
                                                                         "rank": a.rank, "pid": os.getpid()}))
                os.kill(os.getpid(), signal.SIGKILL)  # the device is gone: the process dies without a word
            t0 = time.monotonic_ns()
            loss = guard.step(train_step, step) if guard is not None else train_step(step)
            t1 = time.monotonic_ns()
            pad["s"] = max(0.0, a.step_s - pad.get("work_s", 0.0))
            result["step_ms"].append((t1 - t0) / 1e6)
            result["step_end_ns"].append(t1)
            result["steps_done"] = step + 1
            result.setdefault("first_step", step)
            result["loss_last"] = loss.item()
            if a.progress:
                _write(a.progress, str(step + 1))
            if ckpt and a.rank == 0 and (step + 1) % a.checkpoint_every == 0:
                tc = time.monotonic_ns()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "steps_done": step + 1}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
                result.setdefault("checkpoint_ms", []).append(round((time.monotonic_ns() - tc) / 1e6, 1))
            if a.out and (step + 1) % 10 == 0:
                _write(a.out, json.dumps(result))  # partial result, in case this attempt is killed
    except Exception as e:  # a failed collective ends the attempt
        result["errors"].append(f"step {result['steps_done']}: {type(e).__name__}: {str(e)[:300]}")
        result["error_t_ns"] = time.monotonic_ns()
    if guard is not None:
        result["rebuilds"] = guard.events
        guard.close()
    h = hashlib.sha256()
    for q in params:
        h.update(q.detach().contiguous().numpy().tobytes())
    result["weights_sha256"] = h.hexdigest()
    if a.out:
        _write(a.out, json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0 if result["steps_done"] == a.steps else 1


if len(sys.argv) > 1 and sys.argv[1] == "_worker":
    sys.exit(worker(sys.argv[2:]))

# --------------------------------------------------------------------------- benchmark

from _cluster import BenchError, check_args, machine_info, run_and_report  # noqa: E402

from linkpass.lab import fabric as fab  # noqa: E402
from linkpass.lab.demo import DemoError, DeviceFaultDemo  # noqa: E402


def _torchrun() -> str:
    cand = Path(sys.executable).with_name("torchrun")
    return str(cand) if cand.exists() else "torchrun"


def run_torchrun(args, workdir: Path) -> dict:
    """Path (b): torchrun with one restart, checkpoints, the last rank SIGKILLed at the fault step."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [_torchrun(), "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(args.max_restarts),
           str(HERE), "_worker", "--mode", "torchrun", "--steps", str(args.steps), "--model-mb", str(args.model_mb),
           "--step-s", str(args.step_s), "--fast-until", str(args.fast_until), "--fault-step", str(args.fault_step),
           "--checkpoint-every", str(args.checkpoint_every), "--workdir", str(workdir), "--timeout-s", "60"]
    budget = args.steps * args.step_s * 2 + 600
    t0 = time.monotonic_ns()
    with open(workdir / "torchrun.log", "w") as logf:
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(budget)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise BenchError(f"torchrun did not finish in {budget:.0f} s; see {workdir}/torchrun.log") from None
        except BaseException:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    wall_s = (time.monotonic_ns() - t0) / 1e9

    def load(name):
        try:
            return json.loads((workdir / name).read_text())
        except (OSError, json.JSONDecodeError):
            return None

    fault = load("fault.json")
    last = max((n for n in range(1, args.max_restarts + 1) if (workdir / f"torchrun-rank0-attempt{n}.json").exists()), default=1)
    after = [load(f"torchrun-rank{r}-attempt{last}.json") for r in range(2)]
    first = [load(f"torchrun-rank{r}-attempt0.json") for r in range(2)]
    out = {"rc": rc, "restart_rounds": last, "wall_s": round(wall_s, 1), "restarted": all(after), "log": str(workdir / "torchrun.log"),
           "first_attempt_errors": [e for r in first if r for e in r["errors"]][:4]}
    if not fault or not all(after):
        out["error"] = "no fault recorded or no restarted attempt; see the log"
        return out
    t_f = fault["t_fault_ns"]
    r1 = after[fault["rank"]]
    done = [r for r in after if r["steps_done"] > args.fault_step]
    # the interrupted step completed again: the later of the ranks (a step is done when all are)
    ends = [r["step_end_ns"][args.fault_step - r["first_step"]] for r in done]
    lost = (max(ends) - t_f) / 1e6 if len(done) == 2 else None
    recompute_steps = args.fault_step - r1.get("loaded_checkpoint_step", 0)
    ms = lambda a, b: round((b - a) / 1e6, 1)  # noqa: E731
    first_step_end = max(r["step_end_ns"][0] for r in after)
    out.update({
        "fault": fault,
        "restart_lost_ms": None if lost is None else round(lost, 1),
        "loaded_checkpoint_step": r1.get("loaded_checkpoint_step"),
        "recomputed_steps": recompute_steps,
        "breakdown_ms": {
            "restart (fault -> new worker process running)": ms(t_f, max(r["t_start_ns"] for r in after)),
            "import + rendezvous + init_process_group": ms(max(r["t_start_ns"] for r in after), max(r["t_pg_ns"] for r in after)),
            "build model + reload checkpoint": ms(max(r["t_pg_ns"] for r in after), max(r["t_loaded_ns"] for r in after)),
            "recompute (first step after reload -> interrupted step done)": ms(max(r["t_loaded_ns"] for r in after), max(ends)),
            "first recomputed step done": ms(t_f, first_step_end),
        },
        "steps_done": [r["steps_done"] for r in after],
        "weights_sha256": [r["weights_sha256"] for r in after],
        "checkpoint_ms": next((r.get("checkpoint_ms") for r in first if r and r.get("checkpoint_ms")), None),
        "step_ms_median_after_restart": round(sorted(r1["step_ms"])[len(r1["step_ms"]) // 2], 1) if r1["step_ms"] else None,
        "errors": [e for r in after for e in r["errors"]],
    })
    return out


class MigrationBench(DeviceFaultDemo):
    """Path (a): the device-fault demo's fabric, daemons, spares and injection, with this script's
    worker (model size, step time) and the fault at a chosen step."""

    def __init__(self, args, log):
        super().__init__(2, 2, args.steps, args.name, "carrier-loss", log=log, spares=1)
        self.args = args

    def _launch_job(self, tag: str, port: int, spares: int = 0) -> list[Path]:
        from linkpass.adapters.hook_server import default_socket_path

        a = self.args
        outs = [self.workdir / f"{tag}-rank{h['index']}.json" for h in self.desc["hosts"]]
        self.jobs, self.spare_jobs = [], []
        store_addr = self.desc["hosts"][0]["rails"][self.STORE_RAIL]["address"]
        names = [h["name"] for h in self.desc["hosts"]]
        wait_s = a.steps * a.step_s * 2 + 300
        for h in self.desc["hosts"]:
            ifaces = ",".join(f"{r['rail']}={r['netdev']}" for r in sorted(h["rails"], key=lambda r: r["rail"] != self.PG_RAIL))
            common = ["--mode", "hook", "--world-size", str(self.hosts), "--master-addr", store_addr, "--master-port", str(port),
                      "--steps", str(self.steps), "--rail-ifaces", ifaces, "--rail", str(self.PG_RAIL),
                      "--hooks-socket", default_socket_path(h["control_socket"]), "--host", h["name"],
                      "--peers", ",".join(n for n in names if n != h["name"]), "--timeout-s", "60",
                      "--model-mb", str(a.model_mb), "--step-s", str(a.step_s), "--fast-until", str(a.fast_until)]
            for k in range(spares + 1):
                tagk = f"rank{h['index']}" if k == 0 else f"spare{h['index']}-{k}"
                out, prog = self.workdir / f"{tag}-{tagk}.json", self.workdir / f"{tag}-{tagk}.progress"
                for f in (out, prog):
                    f.unlink(missing_ok=True)
                extra = ["--rank", str(h["index"]), "--gpu", "0"] if k == 0 else \
                    ["--rank", "0", "--gpu", str(k), "--spare", "--spare-wait-s", str(wait_s)]
                logf = open(self.workdir / f"{tag}-{tagk}.log", "w")
                p = subprocess.Popen(fab.netns_exec(self.name, h["index"]) + [sys.executable, str(HERE), "_worker"]
                                     + extra + common + ["--out", str(out), "--progress", str(prog)],
                                     stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
                (self.jobs if k == 0 else self.spare_jobs).append(p)
        return outs

    def migrate(self, ref_sha: str | None) -> dict:
        from linkpass.lab.inject import inject_device_fault

        a = self.args
        self.start()
        fault_host = self.hosts - 1
        self._launch_job("faulted", 29501, self.spares)
        self._wait_progress("faulted", fault_host, a.fault_step, timeout=a.fast_until * 5 + (a.fault_step - a.fast_until) * a.step_s * 2 + 120)
        step_at_fault = self._progress("faulted", fault_host)
        inj = inject_device_fault(self.name, fault_host, 0, 79)
        self.log(f"  injected Xid 79 on h{fault_host} GPU 0 after step {step_at_fault}")
        codes, taken, res = self._collect_faulted(fault_host, time.monotonic() + (a.steps - step_at_fault) * a.step_s * 2 + 180)
        r = self._summarize_migration([{"weights_sha256": ref_sha or ""}], res, taken, codes, fault_host, inj, step_at_fault)
        r["weights_sha256"] = [x["weights_sha256"] for x in res + ([taken] if taken else [])]
        if taken and taken.get("step_ms"):
            r["spare_first_step_ms"] = round(taken["step_ms"][0], 1)
        steady = [ms for x in res for ms in x["step_ms"][a.fast_until + 2:step_at_fault]]
        r["step_ms_median_before_fault"] = round(sorted(steady)[len(steady) // 2], 1) if steady else None
        return r


def run(args) -> dict:
    import tempfile

    log = lambda m: print(m, flush=True)  # noqa: E731
    workdir = Path(tempfile.mkdtemp(prefix="linkpass-bench-mvr-"))
    machine = machine_info()
    log(f"fault at step {args.fault_step} (checkpoint every {args.checkpoint_every}: last checkpoint at step "
        f"{args.fast_until}, so the restart recomputes {args.fault_step - args.fast_until} steps); "
        f"{args.steps} steps, {args.model_mb} MB model, {args.step_s} s steps from step {args.fast_until}")
    log(f"(b) torchrun --max-restarts 1, checkpoint every {args.checkpoint_every} steps, SIGKILL of rank 1 at step {args.fault_step} ...")
    tr = run_torchrun(args, workdir / "torchrun")
    if tr.get("restart_lost_ms") is None:
        raise BenchError(f"torchrun path failed: {tr.get('error') or tr.get('errors')}; log {tr['log']}")
    log(f"  time lost {tr['restart_lost_ms'] / 1000:.1f} s (torchrun exit {tr['rc']})")
    log("(a) linkpass: device-fault demo fabric, 1 hot spare per host, Xid 79 at the same step ...")
    b = MigrationBench(args, log=lambda m: log("  " + m))
    try:
        mig = b.migrate(tr["weights_sha256"][0])
    except DemoError as e:
        b.close()
        raise BenchError(f"{e}; logs kept in {b.workdir}") from None
    except BaseException:
        b.close()
        print(f"logs kept in {b.workdir}", file=sys.stderr)
        raise
    b.close()
    mig_ms, lost_ms = mig["migration_ms"], tr["restart_lost_ms"]
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": {"max_restarts": args.max_restarts, "model_mb": args.model_mb, "step_s": args.step_s, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
                   "fault_step": args.fault_step, "fast_until": args.fast_until, "ranks": 2, "spares_per_host": 1,
                   "fault_step_rule": "checkpoint_every + checkpoint_every // 2 unless --fault-step is given"},
        "machine": machine | {"loadavg_at_end": list(os.getloadavg())},
        "migration_ms": mig_ms,
        "restart_lost_ms": lost_ms,
        "ratio_restart_over_migration": None if not mig_ms else round(lost_ms / mig_ms, 1),
        "targets": {"ratio_min": 10, "migration_ms_p50_max": 5000},
        "weights_equal_across_paths": bool(mig["weights_sha256"]) and len(set(mig["weights_sha256"] + tr["weights_sha256"])) == 1,
        "linkpass": mig,
        "torchrun": tr,
        "workdir": str(workdir),
    }


def print_report(r: dict) -> None:
    p, m, t = r["params"], r["linkpass"], r["torchrun"]
    print(f"\njob: 2 ranks, {p['model_mb']} MB model, {p['step_s']} s steps, checkpoint every {p['checkpoint_every']} steps; "
          f"fault at step {p['fault_step']} (= checkpoint_every + checkpoint_every // 2 unless given)")
    print(f"  measured step time before the fault: {m.get('step_ms_median_before_fault')} ms (linkpass path), "
          f"{t.get('step_ms_median_after_restart')} ms (torchrun, after restart)")
    print(f"linkpass migration (Xid 79 injected -> spare completed the interrupted step): {r['migration_ms']} ms "
          f"(target <= {r['targets']['migration_ms_p50_max']} ms, one sample); steps lost {m['steps_lost']}; "
          f"spare join {m['migration']}")
    print(f"torchrun restart (SIGKILL -> interrupted step completed again): {t['restart_lost_ms']} ms; "
          f"reloaded checkpoint of step {t['loaded_checkpoint_step']}, recomputed {t['recomputed_steps']} steps; "
          f"restart rounds {t['restart_rounds']} of --max-restarts {p['max_restarts']}")
    for k, v in t["breakdown_ms"].items():
        print(f"    {k}: {v} ms")
    ratio = r["ratio_restart_over_migration"]
    print(f"ratio restart / migration: {ratio}x (target >= {r['targets']['ratio_min']}x)")
    print(f"final weights bitwise equal across both paths (and every rank): {r['weights_equal_across_paths']}")
    if m["errors"] or t["errors"]:
        print(f"errors: {(m['errors'] + t['errors'])[:3]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mb", type=float, default=50.0, help="model size, MB of float32 parameters")
    p.add_argument("--step-s", type=float, default=1.0, help="step time (padded with a sleep inside the step)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="torchrun path: checkpoint interval, steps")
    p.add_argument("--fault-step", type=int, help="the step the fault interrupts (default checkpoint_every * 1.5)")
    p.add_argument("--steps", type=int, help="steps of the job (default fault step + 5)")
    p.add_argument("--max-restarts", type=int, default=1, help="torchrun --max-restarts")
    p.add_argument("--name", default="bnmvr", help="fabric name")
    p.add_argument("--json")
    args = p.parse_args()
    if args.fault_step is None:
        args.fault_step = args.checkpoint_every + args.checkpoint_every // 2
    if args.steps is None:
        args.steps = max(50, args.fault_step + 5)
    rc = check_args("bench/migration_vs_restart.py", args, positive=("max_restarts", "model_mb", "step_s", "checkpoint_every", "fault_step", "steps"))
    if rc:
        return rc
    if args.steps < 50 or args.fault_step >= args.steps or args.fault_step < 3:
        print(f"bench/migration_vs_restart.py: --fault-step must be 3..steps-1 and --steps >= 50, got "
              f"--fault-step {args.fault_step} --steps {args.steps}", file=sys.stderr)
        return 2
    args.fast_until = (args.fault_step // args.checkpoint_every) * args.checkpoint_every
    return run_and_report("bench/migration_vs_restart.py", run, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
