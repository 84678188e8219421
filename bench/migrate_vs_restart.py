#!/usr/bin/env python3
"""Time lost to one dead worker of an unmodified DDP script: a ``torchrun --max-restarts 1``
restart from the script's own snapshot, next to linkpass migrating the rank to a warm spare.

    sudo .venv/bin/python bench/migrate_vs_restart.py --runs 3 --json bench/results/migrate_vs_restart.json

The script is ``examples/ddp_train.py`` (DDP-tutorial style: torchrun, DistributedSampler, DDP,
AdamW; rank 0 saves ``--snapshot`` at the end of every epoch, every rank resumes from it at
start), with the demo's arguments ``--epochs 3 --samples 16384 --batch-size 32``: 2 ranks, 256
optimizer steps per epoch, 768 in all.  Each of ``--runs`` runs has three parts:

1. **baseline** (torchrun alone, localhost, gloo, ``OMP_NUM_THREADS=1``)::

       python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.1 \
           --master-port P examples/ddp_train.py --epochs 3 --samples 16384 --batch-size 32 --snapshot S

   in a fresh temporary directory, once fault-free and once with rank 1's worker SIGKILLed (a
   GPU that fell off the bus) when it has done ``--fault-frac`` (30 %) of the fault-free run's
   steps.  No linkpass runs in the baseline: the step is learned from a 15-line
   ``sitecustomize`` put on the workers' ``PYTHONPATH`` (a global optimizer step post-hook that
   writes the step count to a file after every step; polled every ms).  ``--baseline-progress
   hook`` uses ``linkpass exec --no-daemon`` and the hook's ``LINKPASS_PROGRESS`` file instead
   (the whole hook then runs in the baseline).  torchrun sees the dead worker, stops the other
   one and starts both again; they resume from the snapshot.
   ``time_lost_s`` = faulted wall time - fault-free wall time (launch to exit of the agent);
   ``steps_redone`` = steps done at the kill - 256 x the epochs in the last snapshot saved
   before the kill (``[rank 0] epoch N: snapshot saved`` lines in the log up to the kill);
   ``kill_to_first_step_s`` = SIGKILL -> first optimizer step of the restarted workers;
   ``weights_match_fault_free``: the final snapshots hold bitwise equal tensors.
   torchrun's static rendezvous keeps its store across the restart, and the restarted group
   sometimes reads the dead attempt's gloo addresses: ``connectFullMesh failed ... Connection
   refused``, or a hang.  Such a faulted job (the real job would be dead) is recorded in
   ``restart_failures`` and repeated, up to ``--restart-retries`` times.
2. **linkpass, device fault**: ``python -m linkpass.cli demo --scenario device-fault`` (emulated
   2-host fabric in network namespaces, the same script and arguments, one worker per host
   under ``linkpass exec --spares 1`` + torchrun, fault-free then with an Xid 79 on the last
   host's GPU 0 at 30 % of the steps; the rank moves to its warm spare).  ``time_lost_s`` =
   faulted wall time - fault-free wall time, each from the demo's line announcing the launch to
   the last rank's hook report (written at the worker's exit).  ``stall_over_median_s`` =
   longest step - median step (the job standing still at the fault); ``span_lost_s``: the
   unmoved rank's first-to-last-step span, faulted - fault-free.  ``steps_redone`` = the demo's
   ``steps_lost``.  ``recovery_ms`` (fault issued -> the slowest rank's first step after
   recovery), ``max_step_stall_ms`` and ``retained_bytes`` (the memory the process-group
   wrapper keeps to re-issue collectives, max over ranks and groups) come from the demo's JSON.
3. **linkpass, rail cut, latched**: ``demo --scenario rail-latched``: rail 0 of the last host cut,
   gloo latched as NCCL is (no in-process interface change): the cut rank hands over to its
   warm spare.  Same figures.

Before each part the script waits (``--quiet-wait-s``) for the CPUs to be quiet, and it counts
the CPU time other processes used during the part (``other_cpu_s``: /proc/stat busy time minus
this process tree's); a part over ``--max-other-cpu-s`` is repeated up to ``--retries`` times.

Prints each run and the medians, and writes JSON; asserts nothing.  Needs root (the demos build
network namespaces; ``--baseline-only`` does not).  About 25 s per baseline pair and 20-25 s per
demo run on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cluster import BenchError, check_args, install_sigterm, machine_info, write_json  # noqa: E402
from linkpass.lab.ports import listen_port  # noqa: E402

SCHEMA = "linkpass.bench.migrate_vs_restart/v1"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_train.py"
PROG = "bench/migrate_vs_restart.py"

class RestartFailed(BenchError):
    """torchrun's restarted worker group failed in ``init_process_group`` (the job died)."""


#: processes this benchmark started and has not seen end (process-group leaders)
_live: list[subprocess.Popen] = []


# --------------------------------------------------------------------------- processes


def _stop(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group of ``p`` (its own session), then SIGKILL after ``grace_s``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group (workers torchrun left)
    except (ProcessLookupError, PermissionError):
        pass
    if p.poll() is None:
        p.wait()


def _stop_all() -> None:
    while _live:
        _stop(_live.pop())


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank`` in the first attempt (a child of the agent)."""
    for c in _children(agent):
        e = _env_of(c)
        if e.get("RANK") == str(rank) and e.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            return c
    return None


def _read_int(p: Path) -> int | None:
    try:
        return int(p.read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def _cpu_busy(window_s: float = 1.0) -> float:
    """Share of all CPUs busy over ``window_s`` (from /proc/stat), 0..1."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = snap()
    time.sleep(window_s)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent in user, nice and system time (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:4]]
    return sum(v) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU-seconds of this process and of its reaped descendants (torchrun's workers, the demo's
    processes: each is waited for by its parent)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measured(args, what: str, fn):
    """``fn()`` with the CPU other processes on the machine used meanwhile (``other_cpu_s``):
    other test suites on a 2-CPU machine slow one side of a comparison.  Repeated up to
    ``--retries`` times while ``other_cpu_s`` exceeds ``--max-other-cpu-s``; the last try is
    kept, with the discarded tries' ``other_cpu_s`` in ``retried_other_cpu_s``."""
    retried = []
    while True:
        busy, la = wait_quiet(args, what), os.getloadavg()[0]
        b0, o0, t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
        r = fn()
        other = max(0.0, (_busy_cpu_s() - b0) - (_own_cpu_s() - o0))
        r.update({"cpu_busy_before": busy, "loadavg_1m_before_after": [round(la, 2), round(os.getloadavg()[0], 2)],
                  "other_cpu_s": round(other, 2), "part_wall_s": round(time.monotonic() - t0, 1)})
        if other <= args.max_other_cpu_s or len(retried) >= args.retries or r.get("error"):
            if retried:
                r["retried_other_cpu_s"] = retried
            if other > args.max_other_cpu_s:
                print(f"  {what}: other processes used {other:.1f} CPU-s during it (kept after {len(retried)} retries)", flush=True)
            return r
        retried.append(round(other, 2))
        print(f"  {what}: other processes used {other:.1f} CPU-s during it (> {args.max_other_cpu_s}); repeating", flush=True)


def wait_quiet(args, what: str) -> float:
    """Wait up to ``--quiet-wait-s`` until the machine is quiet (busy share < ``--quiet-busy``
    over 1 s: other jobs would slow one side of a pair); returns the last busy share."""
    deadline = time.monotonic() + args.quiet_wait_s
    said = False
    while True:
        b = _cpu_busy()
        if b < args.quiet_busy or time.monotonic() > deadline:
            if said or b >= args.quiet_busy:
                print(f"  {what}: CPUs {b:.0%} busy" + (" (still; measuring anyway)" if b >= args.quiet_busy else ", quiet now"), flush=True)
            return round(b, 3)
        if not said:
            print(f"  {what}: CPUs {b:.0%} busy with other work; waiting up to {args.quiet_wait_s:.0f} s for quiet", flush=True)
            said = True
        time.sleep(2)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.rstrip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


# --------------------------------------------------------------------------- baseline


def _baseline_once(args, work: Path, port: int, fault_step: int | None) -> dict:
    """One torchrun job in ``work``; with ``fault_step``, rank 1's worker is SIGKILLed once its
    progress reaches it."""
    work.mkdir(parents=True)
    log_path = work / "torchrun.log"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                "--monitor-interval", "0.1"] + (["--master-port", str(port)] if args.rdzv == "static" else
                                                ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]) + [str(SCRIPT)] + args.script_args + ["--snapshot", str(work / "snapshot.pt")]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", LINKPASS_PROGRESS=str(work / "rank{rank}.progress"))
    for k in ("LINKPASS_SPARES", "LINKPASS_LATCHED", "LINKPASS_HOOK", "LINKPASS_REPORT"):
        env.pop(k, None)
    if args.baseline_progress == "hook":
        cmd = [sys.executable, "-m", "linkpass.cli", "exec", "--no-daemon", "--no-live", "--"] + torchrun
        env["LINKPASS_JOB"] = f"bench-mvr-{work.name}"
    else:
        cmd = torchrun
        env["PYTHONPATH"] = os.pathsep.join([str(_counter_dir(work.parent))] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    prog = [work / f"rank{r}.progress" for r in range(2)]
    out: dict = {"cmd": cmd, "dir": str(work)}
    deadline = time.monotonic() + args.baseline_timeout_s
    with open(log_path, "w") as logf:
        t0 = time.monotonic_ns()
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, cwd=work, env=env)
        _live.append(p)
        try:
            if fault_step is not None:
                victim = None
                while True:
                    if p.poll() is not None:
                        raise BenchError(f"baseline job ended (exit {p.returncode}) before step {fault_step}; see {log_path}")
                    if time.monotonic() > deadline:
                        raise BenchError(f"baseline job did not reach step {fault_step} in {args.baseline_timeout_s:.0f} s; see {log_path}")
                    if victim is None and prog[1].exists():
                        victim = _worker_pid(p.pid, 1)
                    v = _read_int(prog[1])
                    if victim is not None and v is not None and v >= fault_step:
                        break
                    time.sleep(0.001)
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic_ns()
                log_size_at_kill = log_path.stat().st_size
                time.sleep(0.01)
                at_kill = [_read_int(f) for f in prog]  # rank 1 is dead: its count is final
                out.update({"victim_pid": victim, "steps_at_kill": at_kill[1], "rank0_steps_at_kill": at_kill[0]})
                # the restarted workers count from 1 again: the first small count is their first step
                low = max(1, min(x for x in at_kill if x is not None) - 2)
                t_first = None
                while t_first is None:
                    if any((x := _read_int(f)) is not None and x < low for f in prog):
                        t_first = time.monotonic_ns()
                    elif p.poll() is not None:
                        break
                    elif time.monotonic_ns() - t_kill > args.restart_timeout_s * 1e9:
                        raise RestartFailed(f"the restarted workers made no step within {args.restart_timeout_s:.0f} s of the "
                                            f"kill (hung); see {log_path}")
                    else:
                        time.sleep(0.001)
                out["kill_to_first_step_s"] = None if t_first is None else round((t_first - t_kill) / 1e9, 3)
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"baseline job did not finish in {args.baseline_timeout_s:.0f} s; see {log_path}") from None
            t1 = time.monotonic_ns()
        finally:
            _stop(p)
            _live.remove(p)
    text = log_path.read_text(errors="replace")
    out["rc"] = rc
    out["wall_s"] = round((t1 - t0) / 1e9, 3)
    if rc != 0:
        tail = " | ".join(ln for ln in text.splitlines() if ln.strip())[-400:]
        mesh = next((ln.strip() for ln in text.splitlines() if "connectFullMesh failed" in ln), None)
        if fault_step is not None and mesh:
            raise RestartFailed(f"the restarted workers could not form their gloo group ({mesh[-200:]}); see {log_path}")
        raise BenchError(f"baseline job exited {rc} ({tail}); see {log_path}")
    out["steps_last_attempt"] = [_read_int(f) for f in prog]
    out["snapshot"] = str(work / "snapshot.pt")
    out["epoch_lines"] = sum(1 for ln in text.splitlines() if ln.startswith("[rank 0] epoch") and "steps" in ln)
    # ranks' prints can share a line (two processes, one pipe): match the pattern, not lines
    per_epoch = [int(x) for x in re.findall(r"\[rank 0\] epoch \d+: (\d+) steps", text)]
    out["steps_per_epoch"] = per_epoch[0] if per_epoch else None
    if fault_step is not None:
        before = text.encode()[:log_size_at_kill].decode(errors="replace")
        snaps = [int(x) for x in re.findall(r"\[rank 0\] epoch (\d+): snapshot saved", before)]
        out["snapshot_epoch_at_kill"] = max(snaps, default=0)
        out["resumed_from_snapshot"] = "resuming from snapshot" in text
    return out


#: ``sitecustomize`` of the baseline's progress counter: in a torchrun worker (RANK set), a global
#: optimizer step post-hook writes the step count to LINKPASS_PROGRESS ({rank} replaced) after
#: every step.  Nothing else: no process group is wrapped, no fault is handled.
COUNTER = """\
import os
if os.environ.get("RANK") is not None and os.environ.get("LINKPASS_PROGRESS"):
    def _install():
        import torch.optim.optimizer as _o
        path = os.environ["LINKPASS_PROGRESS"].replace("{rank}", os.environ["RANK"])
        n = [0]
        def _post(opt, args, kwargs):
            n[0] += 1
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(n[0]))
            os.replace(tmp, path)
        _o.register_optimizer_step_post_hook(_post)
    try:
        _install()
    except Exception as e:
        import sys
        print(f"bench progress counter not installed: {e}", file=sys.stderr)
"""


def _counter_dir(top: Path) -> Path:
    d = top / "counter"
    if not (d / "sitecustomize.py").exists():
        d.mkdir(exist_ok=True)
        (d / "sitecustomize.py").write_text(COUNTER)
    return d


def _same_snapshot(a: str, b: str) -> bool | None:
    """Whether two of the script's snapshots hold bitwise equal model and optimizer tensors."""
    import torch

    try:
        x, y = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    except Exception:  # noqa: BLE001 - reported as unknown
        return None

    def eq(u, v):
        if isinstance(u, torch.Tensor):
            return isinstance(v, torch.Tensor) and u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v)
        if isinstance(u, dict):
            return isinstance(v, dict) and u.keys() == v.keys() and all(eq(u[k], v[k]) for k in u)
        if isinstance(u, (list, tuple)):
            return isinstance(v, (list, tuple)) and len(u) == len(v) and all(eq(p, q) for p, q in zip(u, v))
        return u == v

    return eq(x, y)


def _free_port() -> int:
    return listen_port()  # outside the ephemeral range: see linkpass.lab.ports


def run_baseline(args, top: Path, i: int) -> dict:
    pair = Path(tempfile.mkdtemp(dir=top, prefix=f"baseline{i}-"))
    ref = _baseline_once(args, pair / "fault-free", _free_port(), None)
    steps = ref["steps_last_attempt"][0]
    if steps < 10 or not ref["steps_per_epoch"]:
        raise BenchError(f"baseline fault-free run made {steps} steps (per epoch {ref['steps_per_epoch']}): too few; see {ref['dir']}")
    fault_step = max(3, int(steps * args.fault_frac))
    failures = []
    while True:
        try:
            flt = _baseline_once(args, pair / f"faulted{len(failures) or ''}", _free_port(), fault_step)
            break
        except RestartFailed as e:
            failures.append(str(e))
            print(f"  baseline run {i + 1}: torchrun's restart failed: {e}", flush=True)
            if len(failures) > args.restart_retries:
                return {"error": f"torchrun's restart failed {len(failures)} times in a row; last: {e}", "restart_failures": failures,
                        "steps": steps, "fault_step_target": fault_step, "wall_fault_free_s": ref["wall_s"], "fault_free": ref,
                        "time_lost_s": None, "steps_redone": None, "kill_to_first_step_s": None, "steps_at_kill": None}
    spe = ref["steps_per_epoch"]
    redone = flt["steps_at_kill"] - spe * flt["snapshot_epoch_at_kill"]
    # cross-check from the restarted attempt's own step count
    from_report = (steps - flt["steps_last_attempt"][0]) / spe
    return {
        "steps": steps, "steps_per_epoch": spe, "fault_step_target": fault_step,
        "steps_at_kill": flt["steps_at_kill"], "snapshot_epoch_at_kill": flt["snapshot_epoch_at_kill"],
        "snapshot_epoch_resumed_from_report": from_report,
        "steps_redone": redone,
        "wall_fault_free_s": ref["wall_s"], "wall_faulted_s": flt["wall_s"],
        "time_lost_s": round(flt["wall_s"] - ref["wall_s"], 3),
        "kill_to_first_step_s": flt["kill_to_first_step_s"],
        "restart_failures": failures,
        "resumed_from_snapshot": flt["resumed_from_snapshot"],
        "weights_match_fault_free": _same_snapshot(ref["snapshot"], flt["snapshot"]),
        "fault_free": ref, "faulted": flt,
    }


# --------------------------------------------------------------------------- linkpass demos


def _span_ms(report: dict) -> float:
    return sum(report.get("step_ms") or [])


def run_demo(args, top: Path, scenario: str, i: int) -> dict:
    here = Path(tempfile.mkdtemp(dir=top, prefix=f"{scenario}{i}-"))
    js, log_path = here / "demo.json", here / "demo.log"
    cmd = [sys.executable, "-m", "linkpass.cli", "demo", "--scenario", scenario, "--name", args.name,
           "--json", str(js), "--keep-logs"]
    t0 = time.monotonic()
    stamps: dict[str, float] = {}  # first line starting with each phase marker -> wall clock (time.time())

    def pump(stream, logf):
        for raw in iter(stream.readline, b""):
            now = time.time()
            line = raw.decode(errors="replace")
            for mark in ("reference run:", "faulted run:"):
                if line.startswith(mark):
                    stamps.setdefault(mark, now)
            logf.write(line)
            logf.flush()

    with open(log_path, "w") as logf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                             env=dict(os.environ, COLUMNS="120", PYTHONUNBUFFERED="1"))
        _live.append(p)
        reader = threading.Thread(target=pump, args=(p.stdout, logf), daemon=True)
        reader.start()
        try:
            rc = p.wait(args.demo_timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop(p, grace_s=60)  # SIGTERM: the demo tears its fabric down
            _live.remove(p)
            reader.join(10)
    wall = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    workdir = next((ln.split("logs kept in", 1)[1].strip() for ln in text.splitlines() if "logs kept in" in ln), None)
    base = {"scenario": scenario, "rc": rc, "demo_wall_s": round(wall, 1), "log": str(log_path)}
    if rc is None:
        return base | {"error": f"did not finish in {args.demo_timeout_s:.0f} s; log {log_path}" + (f", work dir {workdir}" if workdir else "")}
    try:
        r = json.loads(js.read_text())
    except (OSError, json.JSONDecodeError):
        tail = " | ".join(ln for ln in text.splitlines() if ln.strip())[-500:]
        return base | {"error": f"exit {rc}, no JSON: {tail}", "workdir": workdir}
    out = base | {k: r.get(k) for k in ("steps", "steps_lost", "weights_match_reference", "recovery_ms", "max_step_stall_ms",
                                        "median_step_ms", "fault")}
    out["steps_redone"] = r.get("steps_lost")
    per = r.get("per_rank") or {}
    retained = [g.get("retained_bytes") or 0 for pr in per.values() for g in (pr.get("groups") or [])]
    out["retained_bytes"] = max(retained) if retained else None
    out["retained_bytes_per_rank"] = {k: max([g.get("retained_bytes") or 0 for g in (pr.get("groups") or [])], default=None)
                                      for k, pr in per.items()}
    out["recoveries"] = {k: pr.get("recoveries") for k, pr in per.items()}
    moved = {k for k, pr in per.items() if any(e.get("event") == "handover" for e in pr.get("recoveries") or [])}
    out["moved_ranks"] = sorted(moved)
    wd = Path(r.get("workdir") or workdir or "")
    spans = {}
    if wd and wd.is_dir():
        for k in per:
            try:
                ref = json.loads((wd / f"reference-rank{k}.json").read_text())
                flt = json.loads((wd / f"faulted-rank{k}.json").read_text())
            except (OSError, json.JSONDecodeError):
                continue
            spans[k] = {"reference_span_s": round(_span_ms(ref) / 1e3, 3), "faulted_span_s": round(_span_ms(flt) / 1e3, 3),
                        "faulted_report_from_spare": bool(flt.get("spare")), "faulted_step_times": len(flt.get("step_ms") or [])}
    out["spans"] = spans
    stay = [k for k in sorted(spans) if k not in moved and not spans[k]["faulted_report_from_spare"]]
    if stay:
        k = stay[0]
        out["span_rank"] = int(k)
        out["span_lost_s"] = round(spans[k]["faulted_span_s"] - spans[k]["reference_span_s"], 3)
    # wall time of each run as the baseline measures it: the demo's line announcing the launch ->
    # the last rank's hook report written (at the worker's exit)
    walls = {}
    if wd and wd.is_dir():
        for tag, mark in (("reference", "reference run:"), ("faulted", "faulted run:")):
            ends = [f.stat().st_mtime for f in wd.glob(f"{tag}-rank*.json")]
            if mark in stamps and ends:
                walls[tag] = round(max(ends) - stamps[mark], 3)
    out["wall_s"] = walls
    if len(walls) == 2:
        out["time_lost_s"] = round(walls["faulted"] - walls["reference"], 3)
    else:
        out["time_lost_s"] = None
        out["time_lost_note"] = "launch lines or reports missing (work dir gone?)"
    if r.get("max_step_stall_ms") is not None and r.get("median_step_ms") is not None:
        out["stall_over_median_s"] = round((r["max_step_stall_ms"] - r["median_step_ms"]) / 1e3, 3)
    if rc != 0:
        out["error"] = f"demo exit {rc} (steps lost {r.get('steps_lost')}, weights match {r.get('weights_match_reference')})"
    if wd and wd.is_dir() and str(wd).startswith(tempfile.gettempdir()) and rc == 0 and not args.keep:
        shutil.rmtree(wd, ignore_errors=True)
        out["workdir"] = None
    else:
        out["workdir"] = str(wd) if wd else None
    js.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- report


def _med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def run(args) -> dict:
    top = Path(tempfile.mkdtemp(prefix="linkpass-bench-mvrs-"))
    machine = machine_info()
    # outside a git checkout (an export of a commit: `git archive`), BENCH_COMMIT names it
    commit = _git("rev-parse", "--short", "HEAD").strip() or os.environ.get("BENCH_COMMIT", "unknown")
    dirty = [ln[3:] for ln in _git("status", "--porcelain", "--untracked-files=no").splitlines() if ln.strip()]
    print(f"commit {commit}" + (f" (uncommitted changes in: {', '.join(dirty)})" if dirty else ""), flush=True)
    res: dict = {"baseline": [], "device-fault": [], "rail-latched": []}
    failed = False
    try:
        for i in range(args.runs):
            if not args.skip_baseline:
                b = measured(args, f"baseline run {i + 1}", lambda: run_baseline(args, top, i))
                res["baseline"].append(b)
                if b.get("error"):
                    failed = True
                    print(f"baseline run {i + 1}: FAILED: {b['error']}", flush=True)
                else:
                    print(f"baseline run {i + 1}: time lost {b['time_lost_s']:.2f} s (wall {b['wall_faulted_s']:.2f} - "
                          f"{b['wall_fault_free_s']:.2f} s), killed rank 1 at step {b['steps_at_kill']} of {b['steps']} "
                          f"(target {b['fault_step_target']}), last snapshot epoch {b['snapshot_epoch_at_kill']}: "
                          f"{b['steps_redone']} steps redone; kill -> first step {b['kill_to_first_step_s']} s; "
                          f"weights = fault-free: {b['weights_match_fault_free']}"
                          + (f"; {len(b['restart_failures'])} earlier faulted job(s) died in the restart" if b["restart_failures"] else ""),
                          flush=True)
            for sc in ([] if args.baseline_only else ["device-fault", "rail-latched"]):
                d = measured(args, f"{sc} run {i + 1}", lambda: run_demo(args, top, sc, i))
                res[sc].append(d)
                if d.get("error") and d.get("recovery_ms") is None:
                    failed = True
                    print(f"{sc} run {i + 1}: FAILED: {d['error']}", flush=True)
                    continue
                print(f"{sc} run {i + 1}: time lost {d.get('time_lost_s')} s (wall {d['wall_s'].get('faulted')} - "
                      f"{d['wall_s'].get('reference')} s; stall at the fault {d.get('stall_over_median_s')} s, unmoved rank's span "
                      f"+{d.get('span_lost_s')} s), "
                      f"steps lost {d['steps_lost']} of {d['steps']} (fault at step {(d.get('fault') or {}).get('step_at_fault')}), "
                      f"recovery {d['recovery_ms']} ms, longest step {d['max_step_stall_ms']} ms, retained {d['retained_bytes']} B, "
                      f"weights = reference: {d['weights_match_reference']}" + (f"; {d['error']}" if d.get("error") else ""), flush=True)
    except BaseException:
        _stop_all()
        print(f"{PROG}: logs kept in {top}", file=sys.stderr)
        raise
    bl, df, rl = res["baseline"], res["device-fault"], res["rail-latched"]
    med = {
        "baseline": {k: _med([b.get(k) for b in bl]) for k in ("time_lost_s", "steps_redone", "kill_to_first_step_s", "steps_at_kill")},
        **{sc: {k: _med([d.get(k) for d in res[sc]]) for k in ("time_lost_s", "steps_redone", "recovery_ms", "max_step_stall_ms",
                                                               "retained_bytes", "stall_over_median_s", "span_lost_s")}
           for sc in ("device-fault", "rail-latched")},
    }
    def ratio(a, b):
        return round(a / b, 1) if a is not None and b is not None and b > 0 else None

    med_b, med_d = med["baseline"], med["device-fault"]
    summary = {"medians": med,
               "ratio_per_run": [ratio(b.get("time_lost_s"), d.get("time_lost_s")) for b, d in zip(bl, df)],
               "ratio_of_medians": ratio(med_b["time_lost_s"], med_d["time_lost_s"]),
               "ratio_over_stall_per_run": [ratio(b.get("time_lost_s"), d.get("stall_over_median_s")) for b, d in zip(bl, df)],
               "ratio_over_stall_of_medians": ratio(med_b["time_lost_s"], med_d["stall_over_median_s"]),
               "baseline_restart_failures": sum(len(b["restart_failures"]) for b in bl),
               "baseline_faulted_jobs": sum(len(b["restart_failures"]) + (0 if b.get("error") else 1) for b in bl)}
    if failed and not args.keep:
        print(f"{PROG}: logs of the failed parts kept in {top}", file=sys.stderr)
    elif not args.keep:
        shutil.rmtree(top, ignore_errors=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "uncommitted_changes": dirty,
        "command": " ".join([PROG] + sys.argv[1:]),
        "params": {"runs": args.runs, "script": str(SCRIPT.relative_to(ROOT)), "script_args": args.script_args,
                   "fault_frac": args.fault_frac, "ranks": 2, "quiet_busy": args.quiet_busy, "quiet_wait_s": args.quiet_wait_s,
                   "max_other_cpu_s": args.max_other_cpu_s, "retries": args.retries,
                   "baseline": "torchrun --max-restarts 1 --monitor-interval 0.1 --master-port P, gloo on lo, OMP_NUM_THREADS=1; "
                               "SIGKILL of rank 1; step learned with --baseline-progress",
                   "baseline_progress": args.baseline_progress, "baseline_rdzv": args.rdzv,
                   "linkpass": "linkpass demo --scenario device-fault / rail-latched (defaults: 1 spare per worker, fault on the last host)"},
        "machine": machine,
        "summary": summary,
        "failed": failed,
        "baseline": bl, "device_fault": df, "rail_latched": rl,
        "workdir": str(top) if args.keep or failed else None,
    }


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def print_report(r: dict) -> None:
    bl, df, rl = r["baseline"], r["device_fault"], r["rail_latched"]
    sm = r["summary"]
    med = sm["medians"]
    n = max(len(bl), len(df), len(rl))
    print(f"\n{r['params']['script']} {' '.join(r['params']['script_args'])}, 2 ranks; fault at "
          f"{r['params']['fault_frac']:.0%} of the steps; commit {r['commit']}")
    head = (f"{'run':>6} | {'restart lost s':>14} {'redone':>6} {'kill->step s':>12} | {'migrate lost s':>14} {'stall s':>7} "
            f"{'lost':>4} {'recov ms':>8} {'retained B':>10} | {'ratio':>6} {'/stall':>6} | {'latched lost s':>14} {'stall s':>7} "
            f"{'lost':>4} {'recov ms':>8} {'retained B':>10}")
    print(head)
    print("-" * len(head))
    ratios = sm["ratio_per_run"] + [None] * n
    ratios_st = sm["ratio_over_stall_per_run"] + [None] * n

    def row(name, b, d, lt, ra, rs):
        b, d, lt = b or {}, d or {}, lt or {}
        print(f"{name:>6} | {_f(b.get('time_lost_s')):>14} {_f(b.get('steps_redone'), '{:.0f}'):>6} {_f(b.get('kill_to_first_step_s')):>12} | "
              f"{_f(d.get('time_lost_s')):>14} {_f(d.get('stall_over_median_s')):>7} {_f(d.get('steps_redone'), '{:.0f}'):>4} "
              f"{_f(d.get('recovery_ms'), '{:.0f}'):>8} {_f(d.get('retained_bytes'), '{:.0f}'):>10} | "
              f"{_f(ra, '{:.1f}x'):>6} {_f(rs, '{:.1f}x'):>6} | {_f(lt.get('time_lost_s')):>14} {_f(lt.get('stall_over_median_s')):>7} "
              f"{_f(lt.get('steps_redone'), '{:.0f}'):>4} {_f(lt.get('recovery_ms'), '{:.0f}'):>8} {_f(lt.get('retained_bytes'), '{:.0f}'):>10}")

    for i in range(n):
        row(str(i + 1), bl[i] if i < len(bl) else None, df[i] if i < len(df) else None, rl[i] if i < len(rl) else None,
            ratios[i], ratios_st[i])
    print("-" * len(head))
    row("median", med["baseline"], med["device-fault"], med["rail-latched"], sm["ratio_of_medians"], sm["ratio_over_stall_of_medians"])
    print("restart (torchrun --max-restarts 1): lost = faulted wall - fault-free wall (agent launch -> exit); redone = steps at "
          "the kill - steps in the last snapshot; kill->step = SIGKILL -> first step of the restarted workers")
    print("migrate (demo device-fault) and latched (demo rail-latched): lost = faulted wall - fault-free wall (launch -> last "
          "rank's exit); stall = longest step - median step (the job standing still at the fault); lost (steps) = steps_lost; "
          "recov = fault -> slowest rank's first step after recovery; retained = re-issue memory, max over ranks and groups")
    print("ratio = restart lost / migrate lost; /stall = restart lost / migrate stall (median row: of the medians)")
    if bl:
        print(f"baseline: weights equal to the fault-free run's in every run: {all(b.get('weights_match_fault_free') for b in bl if not b.get('error'))}; "
              f"resumed from a snapshot: {[b.get('resumed_from_snapshot') for b in bl]}; torchrun restarts that failed "
              f"(job died, repeated): {sm['baseline_restart_failures']} of {sm['baseline_faulted_jobs']} faulted jobs")
    for name, runs in (("device-fault", df), ("rail-latched", rl)):
        if runs:
            print(f"{name}: weights equal to the reference in every run: {all(d.get('weights_match_reference') for d in runs)}; "
                  f"unmoved rank's training span longer by {[d.get('span_lost_s') for d in runs]} s; "
                  f"errors: {[d['error'] for d in runs if d.get('error')] or 'none'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each part (default 3)")
    ap.add_argument("--fault-frac", type=float, default=0.3, help="baseline: kill at this fraction of the fault-free run's steps "
                    "(default 0.3, as the demo)")
    ap.add_argument("--baseline-progress", choices=("counter", "hook"), default="counter",
                    help="how the baseline learns the step: counter (default: a 15-line sitecustomize with a global optimizer "
                    "step post-hook, nothing else) or hook (linkpass exec --no-daemon: the whole linkpass hook, whose "
                    "LINKPASS_PROGRESS file gives the step)")
    ap.add_argument("--rdzv", choices=("static", "c10d"), default="static",
                    help="baseline rendezvous: static (default: --master-port P, the command of the brief; its store outlives "
                    "the restart) or c10d (--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P: a fresh store per round)")
    ap.add_argument("--restart-timeout-s", type=float, default=60.0, help="baseline: a restart with no step this long after "
                    "the kill counts as failed (hung) and is repeated (default 60)")
    ap.add_argument("--restart-retries", type=int, default=5, help="baseline: repeat a faulted job whose torchrun restart "
                    "failed (the job died or hung) up to this many times; every failure is recorded (default 5)")
    ap.add_argument("--baseline-timeout-s", type=float, default=300.0, help="per baseline job")
    ap.add_argument("--demo-timeout-s", type=float, default=600.0, help="per demo run")
    ap.add_argument("--quiet-wait-s", type=float, default=180.0, help="before each part, wait up to this long for the "
                    "machine to be quiet (default 180)")
    ap.add_argument("--quiet-busy", type=float, default=0.25, help="quiet = less than this share of the CPUs busy over 1 s "
                    "(default 0.25)")
    ap.add_argument("--max-other-cpu-s", type=float, default=2.0, help="repeat a part during which other processes used more "
                    "CPU-seconds than this (default 2.0)")
    ap.add_argument("--retries", type=int, default=2, help="repeats of a disturbed part (default 2)")
    ap.add_argument("--name", default="bnmrs", help="fabric name for the demos (default bnmrs)")
    ap.add_argument("--baseline-only", action="store_true", help="no demos (no root needed)")
    ap.add_argument("--skip-baseline", action="store_true", help="demos only")
    ap.add_argument("--keep", action="store_true", help="keep the work directories (logs, reports)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = ap.parse_args(argv)
    args.script_args = ["--epochs", "3", "--samples", "16384", "--batch-size", "32"]
    rc = check_args(PROG, args, positive=("runs", "fault_frac", "baseline_timeout_s", "demo_timeout_s"))
    if rc:
        return rc
    if not 0 < args.fault_frac < 1:
        print(f"{PROG}: --fault-frac must be between 0 and 1, got {args.fault_frac}", file=sys.stderr)
        return 2
    if args.baseline_only and args.skip_baseline:
        print(f"{PROG}: --baseline-only and --skip-baseline leave nothing to run", file=sys.stderr)
        return 2
    if not args.baseline_only and os.geteuid() != 0:
        print(f"{PROG}: the demos need root (network namespaces); run with sudo, or --baseline-only", file=sys.stderr)
        return 2
    if not SCRIPT.is_file():
        print(f"{PROG}: {SCRIPT} not found (run from the source tree)", file=sys.stderr)
        return 2
    install_sigterm()
    try:
        r = run(args)
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; processes stopped", file=sys.stderr)
        return 130
    finally:
        _stop_all()
    print_report(r)
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    return 1 if r["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
