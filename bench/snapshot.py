#!/usr/bin/env python3
"""What the hook's step-aligned snapshots cost an unmodified FSDP2 job, and what they save on a
device fault, next to the peers a script has without linkpass.

    .venv/bin/python bench/snapshot.py --json bench/results/snapshot.json
    .venv/bin/linkpass bench snapshot --json bench/results/snapshot.json     # the same

Every job is real: ``linkpass exec --no-daemon --no-live [--snapshot-every N --snapshot-dir D] --
python -m torch.distributed.run --nproc-per-node 2 ... SCRIPT ARGS`` on localhost, gloo on CPU,
``OMP_NUM_THREADS=1``, each in a fresh directory.  Step times are the hook's own (the worker
report, ``LINKPASS_REPORT``: ``step_ms``, the interval between consecutive optimizer steps,
monotonic clock), never timed from outside; the job's step time is the slower rank's.

**(a) step-time overhead** of ``examples/fsdp2_train.py``, unmodified, with its defaults
(``--epochs 2 --samples 8192 --batch-size 32``: 256 steps, about 0.33 MB of state), modes in one run:

* ``none``: no snapshots;
* ``async_dcp``: ``--snapshot-every N`` (``--every``, default 25): the hook's periodic snapshot
  (``dcp.async_save`` into ``D``: a copy to CPU memory at the step boundary, the write in a thread);
* ``sync_torch_save``: the peer, ``bench/_fsdp2_peer.py`` (the example plus ``torch.save(
  get_state_dict(model, optimizer))`` of each rank's shards every N steps, training waits);
* ``in_memory``: ``--snapshot-in-memory --snapshot-memory-every N`` (no disk snapshot): each
  rank copies its shards to CPU memory at the boundary (the stall), a thread serialises the copy
  into tmpfs and sends it through the job's store to its holder; only when ``linkpass exec
  --help`` lists ``--snapshot-in-memory``, otherwise skipped with a note;
* ``in_memory_every_K`` for each ``--memory-every`` K (default 5,10,25) other than N: the
  interval knob.

Per mode: ``step_ms`` (p50, p99, mean, max over the steps after ``--warmup``), ``snapshot_step_ms``
(the steps whose interval holds a snapshot: the one ending at step S+1 for S a multiple of the
mode's interval), ``train_s`` (sum of the step intervals), and ratios to ``none`` (p50, p99,
mean); the in-memory modes add ``memory_every`` and ``snapshots`` from the hook's
``memory_snapshots`` events (``stall_ms``; ``write_ms``: boundary -> part sent into the store;
``bytes``: both ranks' parts).  ``memory_intervals``: per K the cost (``extra_ms_per_step_mean``,
ratios) next to the steps a rollback redoes (``lag_steps``: steps before a snapshot is usable,
measured; ``steps_redone_mean_uniform_fault`` and ``steps_redone_max`` derived from it, see
:func:`memory_intervals`).

**(b) snapshot and restore time against state size**: ``bench/_fsdp2_peer.py --width W`` for each
``--widths`` (default 256,1600,4096: about 1, 32 and 205 MB of fp32 parameters + AdamW moments,
both ranks), ``--size-steps`` steps (default 10), a snapshot every ``--size-every`` (4):

* ``async_dcp``: the hook's snapshots; per snapshot the slower rank's ``stall_ms`` (training stood
  still: the wait at the boundary, get_state_dict, the copy to CPU) and ``write_ms`` (boundary ->
  the rank's part on disk), and ``bytes`` (both ranks, on disk);
* ``sync_torch_save``: the peer's ``--save-every``: per save the slower rank's ``ms`` (all of it is
  stall) and the bytes;
* ``restore``: ``linkpass exec --resume D`` (the newest complete snapshot): ``restore_ms`` from
  the hook's report (``resume.restore_ms``: dcp.load + set_state_dict + RNG, at the snapshot's
  batch), the slower rank;
* ``in_memory``: ``--snapshot-in-memory --snapshot-memory-every`` ``--size-every`` when
  available: per snapshot the slower rank's ``stall_ms`` (copy to CPU memory) and ``write_ms``
  (boundary -> serialised into tmpfs and put in the store for the holder), both ranks' ``bytes``.
  Restoring from peer memory happens only after a device fault: part (c), one size.

**(c) device fault of the sharded job**:

* ``torchrun_restart``: ``linkpass exec --snapshot-every N -- torchrun --max-restarts 1
  --monitor-interval 0.1 --no-python sh bench/_on_restart.sh python examples/fsdp2_train.py``
  (the example unmodified; the 10-line shell entry gives each attempt its own report, progress
  file and store prefix, and sets ``LINKPASS_RESUME`` to the snapshots directory from the second
  attempt on: the hook resumes from the newest complete snapshot there).  Rank 1's worker is
  SIGKILLed once it has done ``--fault-frac`` (0.4) of the 256 steps and a snapshot is complete;
  torchrun stops rank 0 and starts both again (``--rdzv c10d``, the default, or ``static``: both
  keep one store across the restart; the hook keys each attempt apart, ``linkpass/attempt<N>/``,
  so the restarted gloo group does not read the dead attempt's addresses).  ``kill_to_first_step_s``: SIGKILL -> both restarted ranks did their first
  step (progress files, polled every ms); ``steps_redone`` = steps done at the kill - the
  snapshot's step; ``time_lost_s`` = faulted wall time - the fault-free wall time of the same
  command; ``weights_match_fault_free``: final weights bitwise equal per rank.  A restarted group
  that fails, or does no step within ``--restart-timeout-s`` (hung: the workers' stacks go to its
  log, SIGUSR1), is recorded in ``restart_failures`` (with ``cause``, the log's last error line)
  and the pair repeated (``--restart-retries``).
* ``linkpass_spare``: ``linkpass demo --scenario device-fault --script examples/fsdp2_train.py
  --memory-every N`` (Xid 79 at about 30 % of the run; a warm spare takes the rank, every rank
  rolls back to the newest in-memory snapshot held by its peer, the spare's part from the peer's
  copy): ``recovery``, ``recovery_ms`` (fault -> the slowest rank's next step), ``steps_redone``,
  ``step_at_fault`` (the demo's progress when it wrote the Xid), ``step_at_rollback`` (the step
  the ranks had reached when they acted on it), ``rollback_step``, ``replay_ms``, ``steps_lost``, ``weights_match_reference`` (bitwise,
  against the demo's own fault-free run).  ``linkpass_spare_by_interval``: the same at each
  ``--memory-every`` K (one fault each, so ``steps_redone`` is one sample of the phase of the
  fault against K).  Run only as root with ``--device-fault-demo auto``, else ``available:
  false`` and why.

Prints the figures and writes JSON (``--json``); asserts nothing, judges no timing.  Needs no
root except the ``linkpass_spare`` mode.  About 7-8 minutes on 2 busy cores with the defaults
(each device-fault demo about 45 s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import BenchError, install_sigterm, machine_info, quantile, summary, write_json  # noqa: E402

from linkpass.lab.benchcmd import add_snapshot_options  # noqa: E402

from linkpass.lab.ports import listen_port  # noqa: E402
SCHEMA = "linkpass.bench.snapshot/v1"
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp2_train.py"
PEER = ROOT / "bench" / "_fsdp2_peer.py"
ON_RESTART = ROOT / "bench" / "_on_restart.sh"
PROG = "bench/snapshot.py"
LINKPASS = [sys.executable, "-m", "linkpass.cli"]
PARTS = ("a", "b", "c")

#: processes this benchmark started and has not seen end (session leaders)
_live: list[subprocess.Popen] = []


# --------------------------------------------------------------------------- processes


def _port() -> int:
    return listen_port()  # outside the ephemeral range: see linkpass.lab.ports


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
        os.killpg(p.pid, signal.SIGKILL)  # workers torchrun left behind
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


def exec_flags() -> str:
    """``linkpass exec --help`` (to learn which snapshot flags this tree has)."""
    p = subprocess.run(LINKPASS + ["exec", "--help"], capture_output=True, text=True, timeout=60)
    return p.stdout


class Job:
    """``linkpass exec --no-daemon --no-live EXEC_ARGS -- torchrun --nproc-per-node 2 TORCHRUN_ARGS
    SCRIPT ARGS`` in ``dir``, its own session, reports ``dir/r{rank}.json``, progress ``dir/p{rank}``."""

    def __init__(self, work: Path, tag: str, script: list[str], exec_args: list[str] = (),
                 torchrun_args: list[str] = ("--max-restarts", "0"), env: dict | None = None, rdzv: list[str] | None = None):
        self.dir = work / tag
        self.dir.mkdir(parents=True)
        self.tag = tag
        self.log = self.dir / "log"
        self.env = dict(os.environ, LINKPASS_JOB=f"bench-{tag}-{os.getpid()}", LINKPASS_REPORT=str(self.dir / "r{rank}.json"),
                        LINKPASS_PROGRESS=str(self.dir / "p{rank}"), LINKPASS_JOBS_DIR=str(work / "jobs"),
                        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                                      if os.environ.get("PYTHONPATH") else [])))
        self.env.update(env or {})
        self.cmd = LINKPASS + ["exec", "--no-daemon", "--no-live", *exec_args, "--", sys.executable, "-m",
                               "torch.distributed.run", "--nproc-per-node", "2",
                               *(rdzv or ["--master-addr", "127.0.0.1", "--master-port", str(_port())]),
                               *torchrun_args, *script]
        self.t0 = time.monotonic_ns()
        self.p = subprocess.Popen(self.cmd, cwd=self.dir, env=self.env, stdout=open(self.log, "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        _live.append(self.p)
        self.t_end: int | None = None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop(self.p)
            rc = None
        self.t_end = time.monotonic_ns()
        if self.p in _live:
            _live.remove(self.p)
        if rc is None:
            raise BenchError(f"{self.tag}: did not end within {timeout:.0f} s (log {self.log}):\n{self.tail()}")
        return rc

    def run(self, timeout: float) -> list[dict]:
        """Wait for the job; its two reports.  Raises BenchError on a failed job."""
        rc = self.wait(timeout)
        if rc != 0:
            raise BenchError(f"{self.tag}: exit status {rc} (log {self.log}):\n{self.tail()}")
        return self.reports()

    def reports(self, prefix: str = "r") -> list[dict]:
        out = []
        for r in (0, 1):
            f = self.dir / f"{prefix}{r}.json"
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError) as e:
                raise BenchError(f"{self.tag}: no worker report {f} ({e}); log {self.log}:\n{self.tail()}") from None
        return out

    def wall_s(self) -> float:
        return round(((self.t_end or time.monotonic_ns()) - self.t0) / 1e9, 3)

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def saves(self) -> list[dict]:
        """The peer's ``bench-save`` lines."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("bench-save "):
                try:
                    out.append(json.loads(line[len("bench-save "):]))
                except ValueError:
                    pass
        return out


# --------------------------------------------------------------------------- figures


def _job_steps(reports: list[dict]) -> list[float]:
    """The job's step intervals: per step, the slower rank's."""
    ms = [r["step_ms"] for r in reports]
    return [max(x) for x in zip(*ms)]


def _r(x):
    return None if x is None else round(x, 3)


def step_figures(reports: list[dict], warmup: int, every: int) -> dict:
    """Step-time figures of one job (see the module docstring).  ``step_ms[i]`` of a report is the
    interval from optimizer step i+1 to step i+2 (tracker.py), so the interval that holds the
    snapshot after step S (taken at the boundary before step S+1) is index S-1."""
    steps = _job_steps(reports)
    body = steps[warmup:]
    snap_idx = {s - 1 for s in range(every, len(steps) + 1, every)} if every else set()
    snap = [steps[i] for i in sorted(snap_idx) if warmup <= i < len(steps)]
    s = summary(body)
    return {"steps": reports[0]["steps"], "warmup": warmup,
            "step_ms": {k: s[k] for k in ("n", "p50", "p99", "mean", "max")},
            "snapshot_step_ms": summary(snap) if every else None,
            "train_s": round(sum(steps) / 1000, 3)}


def snapshot_figures(reports: list[dict]) -> dict:
    """The hook's snapshot events of one job: per snapshot the slower rank's stall and write and
    both ranks' bytes; ``ok`` and the count."""
    by_step: dict[int, list[dict]] = {}
    for r in reports:
        for e in r.get("snapshots") or []:
            by_step.setdefault(e["step"], []).append(e)
    snaps = []
    for step, es in sorted(by_step.items()):
        snaps.append({"step": step, "ok": all(e.get("ok") for e in es) and len(es) == len(reports),
                      "stall_ms": max((e.get("stall_ms") or 0.0) for e in es),
                      "write_ms": max((e.get("write_ms") or 0.0) for e in es),
                      # rank 0's event has the snapshot's bytes (every part), the others their own part's
                      "bytes": max((e.get("bytes") or 0) for e in es)})
    ok = [s for s in snaps if s["ok"]]
    return {"count": len(snaps), "ok": len(ok),
            "stall_ms": summary([s["stall_ms"] for s in ok]), "write_ms": summary([s["write_ms"] for s in ok]),
            "bytes": max((s["bytes"] for s in ok), default=None), "snapshots": snaps}


def _ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


# --------------------------------------------------------------------------- parts


def part_a(args, work: Path, in_memory: bool, log) -> dict:
    ex_args = ["--epochs", str(args.epochs), "--samples", str(args.samples), "--batch-size", str(args.batch_size)]
    every = ["--snapshot-every", str(args.every)]
    modes: dict[str, dict] = {
        "none": {"script": [str(EXAMPLE), *ex_args], "exec": []},
        "async_dcp": {"script": [str(EXAMPLE), *ex_args], "exec": every},
        "sync_torch_save": {"script": [str(PEER), *ex_args, "--save-every", str(args.every)], "exec": []},
    }
    if in_memory:  # in-memory only (no disk snapshot), at the same interval as the other modes
        modes["in_memory"] = {"script": [str(EXAMPLE), *ex_args], "memory_every": args.every,
                              "exec": ["--snapshot-in-memory", "--snapshot-memory-every", str(args.every)]}
        for k in args.memory_every:  # the interval knob; the one equal to --every is the in_memory job itself
            if k != args.every:
                modes[f"in_memory_every_{k}"] = {"script": [str(EXAMPLE), *ex_args], "memory_every": k,
                                                 "exec": ["--snapshot-in-memory", "--snapshot-memory-every", str(k)]}
    out: dict = {"script": "examples/fsdp2_train.py", "script_args": ex_args, "every": args.every, "modes": {},
                 "notes": [] if in_memory else ["in_memory skipped: `linkpass exec --help` does not list --snapshot-in-memory"]}
    for name, m in modes.items():
        exec_args = list(m["exec"])
        if name == "async_dcp":
            exec_args += ["--snapshot-dir", str(work / f"a-{name}" / "snaps"), "--snapshot-keep", "2"]
        job = Job(work, f"a-{name}", m["script"], exec_args)
        reports = job.run(args.timeout_s)
        f = step_figures(reports, args.warmup, m.get("memory_every", args.every) if name != "none" else 0)
        f["wall_s"] = job.wall_s()
        if name == "async_dcp":
            f["snapshots"] = snapshot_figures(reports)
        elif "memory_every" in m:
            f["memory_every"] = m["memory_every"]
            f["snapshots"] = memory_figures(reports, job)
            if not f["snapshots"]["ok"]:
                raise BenchError(f"a-{name}: no in-memory snapshot was sent on every rank "
                                 f"({'; '.join(f['snapshots']['notes']) or 'no line from the hook'}; log {job.log})")
        elif name == "sync_torch_save":
            f["saves"] = _save_figures(job.saves())
        out["modes"][name] = f
        log(f"  (a) {name:18s} step p50 {f['step_ms']['p50']} ms, p99 {f['step_ms']['p99']} ms, "
            f"mean {f['step_ms']['mean']} ms ({f['steps']} steps, {f['wall_s']} s)")
    base = out["modes"]["none"]["step_ms"]
    for name, f in out["modes"].items():
        f["ratio_to_none"] = {k: _ratio(f["step_ms"][k], base[k]) for k in ("p50", "p99", "mean")}
    if in_memory:
        out["memory_intervals"] = memory_intervals(out["modes"], base)
    return out


def memory_intervals(modes: dict, base: dict) -> list[dict]:
    """Per in-memory interval K (the knob): its step-time cost next to ``none`` and the steps a
    rollback redoes.  The redo figures follow from how the hook picks the snapshot
    (torch_hooks/memsnap.py, ``usable_step``: the newest step whose every part is held by its
    holder): a snapshot taken at step S becomes usable ``lag_steps`` steps later, so a fault at
    step c goes back to the newest multiple of K at or below c - lag_steps and redoes
    lag_steps + ((c - lag_steps) mod K) steps: (K-1)/2 + lag_steps on average over a uniformly
    random c, at most K - 1 + lag_steps, each plus the step in progress.  ``lag_steps`` comes
    from the measurements: the p50 of boundary -> part sent into the store (``write_ms``) plus
    the holder's whole poll period (POLL_S; so an upper estimate), over the job's step p50,
    rounded up.  This holds while a copy is sent within K steps; otherwise the hook drops the
    older one and the figures are None with a note.  Part (c) has one measured fault per K."""
    import math

    from torch_hooks import memsnap

    rows = []
    for name, f in modes.items():
        k = f.get("memory_every")
        if k is None:
            continue
        sn, p50 = f["snapshots"], f["step_ms"]["p50"]
        w = sn["write_ms"]["p50"]
        lag = None if w is None or not p50 else math.ceil((w + memsnap.POLL_S * 1000) / p50)
        slow = w is not None and bool(p50) and math.ceil(w / p50) >= k
        rows.append({"memory_every": k, "mode": name, "step_ms": f["step_ms"], "ratio_to_none": f["ratio_to_none"],
                     "extra_ms_per_step_mean": _r(f["step_ms"]["mean"] - base["mean"]),
                     "snapshot_step_ms_p50": (f.get("snapshot_step_ms") or {}).get("p50"),
                     "stall_ms_p50": sn["stall_ms"]["p50"], "write_ms_p50": w, "bytes": sn["bytes"],
                     "taken": sn["count"], "sent": sn["ok"], "lag_steps": lag,
                     "steps_redone_mean_uniform_fault": None if lag is None or slow else round((k - 1) / 2 + lag, 1),
                     "steps_redone_max": None if lag is None or slow else k - 1 + lag,
                     "note": "sending a copy takes K steps or more: the hook drops snapshots" if slow else None})
    return sorted(rows, key=lambda x: x["memory_every"])


def memory_figures(reports: list[dict], job: "Job | None" = None) -> dict:
    """The hook's in-memory snapshot events of one job (``memory_snapshots`` of each report:
    ``memory_snapshot`` at the boundary with ``stall_ms``, the copy to CPU memory; then
    ``memory_snapshot_sent`` with ``write_ms``, boundary -> part serialised into this host's tmpfs
    and put in the store for its holder, and ``bytes``, the rank's part).  Per snapshot the slower
    rank's stall and write and both ranks' bytes; ``ok``: sent by every rank.  ``notes``: the
    hook's lines about in-memory snapshots in the job's log (off, dropped)."""
    by_step: dict[int, dict] = {}
    for r in reports:
        for e in r.get("memory_snapshots") or []:
            d = by_step.setdefault(e["step"], {"taken": [], "sent": []})
            d["taken" if e.get("event") == "memory_snapshot" else "sent"].append(e)
    snaps = []
    for step, d in sorted(by_step.items()):
        snaps.append({"step": step, "ok": len(d["sent"]) == len(reports) and len(d["taken"]) == len(reports),
                      "stall_ms": max((e.get("stall_ms") or 0.0) for e in d["taken"]) if d["taken"] else None,
                      "write_ms": max((e.get("write_ms") or 0.0) for e in d["sent"]) if d["sent"] else None,
                      "bytes": sum((e.get("bytes") or 0) for e in d["sent"])})
    ok = [s for s in snaps if s["ok"]]
    notes = []
    if job is not None:
        try:
            notes = sorted({ln.strip()[:300] for ln in job.log.read_text(errors="replace").splitlines()
                            if "in-memory snapshot" in ln})
        except OSError:
            pass
    return {"count": len(snaps), "ok": len(ok),
            "stall_ms": summary([s["stall_ms"] for s in ok]), "write_ms": summary([s["write_ms"] for s in ok]),
            "bytes": max((s["bytes"] for s in ok), default=None), "snapshots": snaps, "notes": notes}


def _save_figures(saves: list[dict]) -> dict:
    by_step: dict[int, list[dict]] = {}
    for s in saves:
        by_step.setdefault(s["step"], []).append(s)
    per = [{"step": k, "ms": max(x["ms"] for x in v), "bytes": sum(x["bytes"] for x in v)} for k, v in sorted(by_step.items())]
    return {"count": len(per), "ms": summary([p["ms"] for p in per]), "bytes": max((p["bytes"] for p in per), default=None),
            "saves": per}


def _state_mb(width: int) -> float:
    """fp32 parameters + AdamW's two moments of the peer at ``width``, both ranks (MB, 1e6 bytes)."""
    params = 64 * width + width + width * width + width + width * 16 + 16
    return round(params * 4 * 3 / 1e6, 3)


def part_b(args, work: Path, in_memory: bool, log) -> dict:
    samples = args.size_steps * args.batch_size * 2
    out: dict = {"script": "bench/_fsdp2_peer.py", "steps": args.size_steps, "every": args.size_every, "sizes": [],
                 "notes": [] if in_memory else ["in_memory skipped: `linkpass exec --help` does not list --snapshot-in-memory"]}
    for w in args.widths:
        sargs = [str(PEER), "--epochs", "1", "--samples", str(samples), "--batch-size", str(args.batch_size), "--width", str(w)]
        snaps = work / f"b-{w}-async" / "snaps"
        row: dict = {"width": w, "state_mb": _state_mb(w)}
        j = Job(work, f"b-{w}-async", sargs, ["--snapshot-every", str(args.size_every), "--snapshot-dir", str(snaps)])
        rep = j.run(args.timeout_s)
        row["async_dcp"] = snapshot_figures(rep)
        row["async_dcp"]["step_ms_p50"] = _r(quantile(_job_steps(rep), 0.5))
        j = Job(work, f"b-{w}-sync", sargs + ["--save-every", str(args.size_every), "--save-dir", "torch-save"])
        rep = j.run(args.timeout_s)
        row["sync_torch_save"] = _save_figures(j.saves())
        row["sync_torch_save"]["step_ms_p50"] = _r(quantile(_job_steps(rep), 0.5))
        j = Job(work, f"b-{w}-restore", sargs, ["--resume", str(snaps)])
        rep = j.run(args.timeout_s)
        res = [r.get("resume") or {} for r in rep]
        row["restore"] = {"step": res[0].get("step"), "restore_ms": max((x.get("restore_ms") or 0.0) for x in res)
                          if all(res) else None, "restore_ms_per_rank": [x.get("restore_ms") for x in res],
                          "wall_s": j.wall_s()}
        if in_memory:
            j = Job(work, f"b-{w}-mem", sargs, ["--snapshot-in-memory", "--snapshot-memory-every", str(args.size_every)])
            rep = j.run(args.timeout_s)
            row["in_memory"] = memory_figures(rep, j)
            row["in_memory"]["step_ms_p50"] = _r(quantile(_job_steps(rep), 0.5))
        out["sizes"].append(row)
        a, s = row["async_dcp"], row["sync_torch_save"]
        log(f"  (b) width {w:5d} ({row['state_mb']:.1f} MB): async_dcp stall p50 {a['stall_ms']['p50']} ms, write p50 "
            f"{a['write_ms']['p50']} ms, {a['bytes']} B; torch.save p50 {s['ms']['p50']} ms, {s['bytes']} B; "
            f"restore {row['restore']['restore_ms']} ms"
            + (f"; in-memory stall p50 {row['in_memory']['stall_ms']['p50']} ms, send p50 "
               f"{row['in_memory']['write_ms']['p50']} ms" if "in_memory" in row else ""))
    return out


def _read_int(p: Path) -> int | None:
    try:
        return int(p.read_text() or 0)
    except (OSError, ValueError):
        return None


def _worker_pid(agent: int, rank: int) -> int | None:
    for c in _children(agent):
        e = _env_of(c)
        if e.get("RANK") == str(rank) and e.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            return c
    return None


def _restart_job(args, work: Path, tag: str, kill_at: int | None) -> dict:
    """One ``torchrun --max-restarts 1`` job of (c); ``kill_at``: SIGKILL rank 1 at that step."""
    ex_args = ["--epochs", str(args.epochs), "--samples", str(args.samples), "--batch-size", str(args.batch_size)]
    d = work / tag
    snaps = d / "snaps"
    env = {"BENCH_RUN_DIR": str(d), "BENCH_SNAPSHOT_ROOT": str(snaps), "BENCH_JOB": f"bench-{tag}-{os.getpid()}"}
    job = Job(work, tag, ["sh", str(ON_RESTART), sys.executable, str(EXAMPLE), *ex_args],
              ["--snapshot-every", str(args.every), "--snapshot-dir", str(snaps), "--snapshot-keep", "0"],
              ["--max-restarts", "1", "--monitor-interval", "0.1", "--no-python"], env=env,
              rdzv=["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}"] if args.rdzv == "c10d" else None)
    out: dict = {}
    if kill_at is not None:
        deadline = time.monotonic() + args.timeout_s
        while True:  # the kill comes at kill_at or later, once a snapshot is complete (else nothing to resume)
            n = _read_int(d / "a0-p1")
            if n is not None and n >= kill_at and any(snaps.glob("step-*/COMPLETE")):
                break
            if job.p.poll() is not None or time.monotonic() > deadline:
                job.wait(1)
                raise BenchError(f"{tag}: the job ended or stalled before step {kill_at} with a complete snapshot "
                                 f"(log {job.log}):\n{job.tail()}")
            time.sleep(0.001)
        pid = _worker_pid(job.p.pid, 1)
        if pid is None:
            raise BenchError(f"{tag}: rank 1's worker not found among torchrun's children")
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic_ns()
        first = d / "a1-p0", d / "a1-p1"
        t_first = None
        hung_at = time.monotonic() + args.restart_timeout_s
        while job.p.poll() is None and time.monotonic() < hung_at:
            if all(f.exists() for f in first):
                t_first = time.monotonic_ns()
                break
            time.sleep(0.001)
        at_kill = [_read_int(d / f"a0-p{r}") or 0 for r in (0, 1)]
        out.update(t_kill_ns=t_kill, kill_to_first_step_s=None if t_first is None else round((t_first - t_kill) / 1e9, 3),
                   steps_at_kill=max(at_kill), killed_pid=pid)
        if t_first is None and job.p.poll() is None:
            for c in _children(job.p.pid):  # the hook's faulthandler: every thread's stack into the log
                try:
                    os.kill(c, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(1)
            _stop(job.p)
            out["hung"] = f"no step of the restarted group within {args.restart_timeout_s:.0f} s of the kill"
    rc = job.wait(args.timeout_s)
    out.update(rc=rc, wall_s=job.wall_s(), log=str(job.log), tail=job.tail(600) if rc else None)
    last = "a1-r" if kill_at is not None else "a0-r"
    if rc == 0:
        out["reports"] = job.reports(last)
    return out


def _failure_cause(log_path: Path) -> str | None:
    """The last line of a failed job's log that names an error, outside torchrun's failure
    table (which only says which rank exited with which status)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    words = ("Error", "error:", "failed", "linkpass:", "Traceback")
    hits = [ln.strip() for ln in lines if any(w in ln for w in words) and "ChildFailedError" not in ln
            and "elastic/errors.html" not in ln]
    return hits[-1][:300] if hits else None


def part_c(args, work: Path, log) -> dict:
    steps = args.epochs * (args.samples // 2 // args.batch_size)
    kill_at = max(1, int(steps * args.fault_frac))
    out: dict = {"script": "examples/fsdp2_train.py", "every": args.every, "steps": steps, "kill_at_step": kill_at,
                 "rdzv": args.rdzv}
    failures = []
    tr = None
    for attempt in range(args.restart_retries + 1):
        ref = _restart_job(args, work, f"c-ref-{attempt}", None)
        if ref["rc"] != 0:
            raise BenchError(f"(c) the fault-free job failed (exit {ref['rc']}, log {ref['log']}):\n{ref['tail']}")
        f = _restart_job(args, work, f"c-kill-{attempt}", kill_at)
        if f["rc"] != 0 or f.get("kill_to_first_step_s") is None:
            failures.append({"rc": f["rc"], "hung": f.get("hung"), "log": f["log"], "tail": (f.get("tail") or "")[-300:],
                             "cause": _failure_cause(Path(f["log"]))})
            log(f"  (c) torchrun restart failed (exit {f['rc']}), repeated: {f['log']}")
            continue
        res = [r.get("resume") or {} for r in f["reports"]]
        step = res[0].get("step")
        tr = {"available": True, "kill_to_first_step_s": f["kill_to_first_step_s"], "steps_at_kill": f["steps_at_kill"],
              "resumed_step": step, "steps_redone": None if step is None else f["steps_at_kill"] - step,
              "restore_ms": max((x.get("restore_ms") or 0.0) for x in res) if all(res) else None,
              "time_lost_s": round(f["wall_s"] - ref["wall_s"], 3), "wall_s": f["wall_s"], "wall_s_fault_free": ref["wall_s"],
              "weights_match_fault_free": all(a["weights_sha256"] and a["weights_sha256"] == b["weights_sha256"]
                                              for a, b in zip(ref["reports"], f["reports"])),
              "steps_final": [r["steps"] for r in f["reports"]]}
        break
    out["restart_failures"] = failures
    out["torchrun_restart"] = tr or {"available": False, "reason": f"every restart failed ({len(failures)})"}
    if tr:
        log(f"  (c) torchrun restart: kill -> first step {tr['kill_to_first_step_s']} s, {tr['steps_redone']} steps redone "
            f"(killed at {tr['steps_at_kill']}, resumed at {tr['resumed_step']}), time lost {tr['time_lost_s']} s, "
            f"weights match {tr['weights_match_fault_free']}")
    # the spare at each in-memory interval; ``linkpass_spare`` is the one at --every (the torchrun side's interval)
    ks = sorted(set(args.memory_every) | {args.every})
    by_k = []
    for k in ks:
        res = linkpass_spare(args, work, log, k)
        by_k.append(res)
        if not res.get("available"):
            break  # the same reason for every interval (root, the demo off, the hook)
    out["linkpass_spare"] = next(x for x in by_k if x.get("memory_every") == args.every) \
        if any(x.get("memory_every") == args.every for x in by_k) else by_k[0]
    out["linkpass_spare_by_interval"] = by_k
    return out


def linkpass_spare(args, work: Path, log, every: int) -> dict:
    """``linkpass demo --scenario device-fault --memory-every EVERY`` with the FSDP2 example
    (needs root): a warm spare takes the faulty rank and every rank rolls back to the newest
    in-memory snapshot held by its peer."""
    if args.device_fault_demo == "off":
        return {"available": False, "reason": "--device-fault-demo off"}
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nft")):
        why = "needs root, ip and nft (network namespaces)"
        log(f"  (c) linkpass spare: not run: {why}")
        return {"available": False, "reason": why}
    out = work / f"c-demo-{every}.json"
    cmd = LINKPASS + ["demo", "--scenario", "device-fault", "--script", str(EXAMPLE), "--script-args",
                      f"--epochs {args.epochs} --samples {args.samples} --batch-size {args.batch_size}",
                      "--memory-every", str(every), "--name", args.name, "--json", str(out)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": f"the demo did not end within {args.timeout_s:.0f} s"}
    try:
        r = json.loads(out.read_text())
    except (OSError, ValueError):
        r = None
    if p.returncode != 0 or not r:
        lines = [x for x in (p.stderr + p.stdout).splitlines() if x.strip()]
        why = next((x for x in reversed(lines) if "sharded" in x), lines[-1] if lines else f"exit {p.returncode}")
        if "the model is sharded" in why:  # the hook's own reason, without torchrun's failure table around it
            why = why[why.index("the model is sharded"):].split(";")[0]
        log(f"  (c) linkpass spare (in-memory every {every}): not available: {why.strip()[:300]}")
        return {"available": False, "reason": why.strip()[:500], "rc": p.returncode, "memory_every": every}
    keep = ("steps", "steps_lost", "recovery_ms", "max_step_stall_ms", "weights_match_reference", "recovery",
            "steps_redone", "rollback_step", "median_step_ms")
    rb = [e for pr in (r.get("per_rank") or {}).values() for e in pr.get("recoveries") or [] if e.get("event") == "rollback"]
    res = {"available": True, "memory_every": every, **{k: r.get(k) for k in keep},
           # the demo's progress when it wrote the Xid, and the step the ranks had reached when they acted on it
           "step_at_fault": (r.get("fault") or {}).get("step_at_fault"),
           "step_at_rollback": max((e["at_step"] for e in rb if e.get("at_step") is not None), default=None),
           "replay_ms": max((e.get("replay_ms") or 0.0) for e in rb) if rb else None,
           "state_bytes": max((e.get("state_bytes") or 0) for e in rb) if rb else None}
    log(f"  (c) linkpass spare (in-memory every {every}): {res['recovery']}, recovery {res['recovery_ms']} ms, "
        f"{res['steps_redone']} steps redone (Xid at step {res['step_at_fault']}, acted on at {res['step_at_rollback']}, "
        f"back to {res['rollback_step']}), "
        f"{res['steps_lost']} steps lost, weights match {res['weights_match_reference']}")
    return res


# --------------------------------------------------------------------------- run, print


def run(args, log=print) -> dict:
    flags = exec_flags()
    in_memory = "--snapshot-in-memory" in flags
    if not in_memory:
        log("note: `linkpass exec --help` does not list --snapshot-in-memory: the in_memory mode is skipped")
    work = Path(tempfile.mkdtemp(prefix="lp-bench-snapshot-"))
    r: dict = {"schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": _commit(), "command": args.command_line, "machine": machine_info(),
               "in_memory_available": in_memory, "parts": list(args.parts), "work": str(work)}
    t0 = time.monotonic()
    try:
        if "a" in args.parts:
            log("(a) step-time overhead")
            r["overhead"] = part_a(args, work, in_memory, log)
        if "b" in args.parts:
            log("(b) snapshot and restore time against state size")
            r["sizes"] = part_b(args, work, in_memory, log)
        if "c" in args.parts:
            log("(c) device fault of the sharded job")
            r["device_fault"] = part_c(args, work, log)
    finally:
        _stop_all()
        r["machine"]["loadavg_at_end"] = list(os.getloadavg())
        r["elapsed_s"] = round(time.monotonic() - t0, 1)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            r["work"] = None
    return r


def _commit() -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return p.stdout.strip() + ("-dirty" if dirty else "") if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def print_report(r: dict) -> None:
    print(f"\nbench/snapshot.py  {r['date']}  commit {r['commit']}  {r['machine']['cpus']} CPUs  ({r['elapsed_s']} s)")
    o = r.get("overhead")
    if o:
        print(f"\n(a) step time, {o['script']} {' '.join(o['script_args'])}, snapshot every {o['every']} steps (ms, slower rank)")
        print(f"  {'mode':16s} {'p50':>8s} {'p99':>8s} {'mean':>8s} {'snap-step p50':>14s} {'p50 x':>7s} {'p99 x':>7s} {'mean x':>7s}")
        for name, f in o["modes"].items():
            ss = (f.get("snapshot_step_ms") or {}).get("p50")
            x = f["ratio_to_none"]
            print(f"  {name:16s} {f['step_ms']['p50']:8.3f} {f['step_ms']['p99']:8.3f} {f['step_ms']['mean']:8.3f} "
                  f"{'-' if ss is None else f'{ss:.3f}':>14s} {x['p50']:7.3f} {x['p99']:7.3f} {x['mean']:7.3f}")
        for n in o["notes"]:
            print(f"  note: {n}")
        mi = o.get("memory_intervals")
        if mi:
            print("\n  in-memory interval K: step-time cost and steps a rollback redoes (derived from lag_steps)")
            print(f"  {'K':>4s} {'mean ms':>8s} {'mean x':>7s} {'+ms/step':>9s} {'stall p50':>10s} {'send p50':>9s} "
                  f"{'lag':>4s} {'redo mean':>10s} {'redo max':>9s}")
            for m in mi:
                print(f"  {m['memory_every']:4d} {m['step_ms']['mean']:8.3f} {m['ratio_to_none']['mean']:7.3f} "
                      f"{m['extra_ms_per_step_mean']:9.3f} {_f(m['stall_ms_p50'], 10)} {_f(m['write_ms_p50'], 9)} "
                      f"{m['lag_steps'] if m['lag_steps'] is not None else '-':>4} "
                      f"{m['steps_redone_mean_uniform_fault'] if m['steps_redone_mean_uniform_fault'] is not None else '-':>10} "
                      f"{m['steps_redone_max'] if m['steps_redone_max'] is not None else '-':>9}")
    s = r.get("sizes")
    if s:
        print(f"\n(b) snapshot and restore against state size ({s['steps']} steps, every {s['every']}; ms p50, slower rank)")
        print(f"  {'width':>6s} {'state MB':>9s} {'DCP MB':>8s} {'stall':>8s} {'write':>8s} {'torch.save':>11s} {'restore':>8s}")
        for row in s["sizes"]:
            a, t, rs = row["async_dcp"], row["sync_torch_save"], row["restore"]
            mb = None if a["bytes"] is None else a["bytes"] / 1e6
            im = row.get("in_memory")
            print(f"  {row['width']:6d} {row['state_mb']:9.2f} {'-' if mb is None else f'{mb:.2f}':>8s} "
                  f"{_f(a['stall_ms']['p50'])} {_f(a['write_ms']['p50'])} {_f(t['ms']['p50'], 11)} {_f(rs['restore_ms'])}"
                  + (f"   in-memory stall {_f(im['stall_ms']['p50'])} send {_f(im['write_ms']['p50'])}" if im else ""))
        for n in s["notes"]:
            print(f"  note: {n}")
    c = r.get("device_fault")
    if c:
        t = c["torchrun_restart"]
        print(f"\n(c) device fault, {c['script']} ({c['steps']} steps, snapshot every {c['every']}, kill rank 1 at step "
              f"{c['kill_at_step']})")
        if t.get("available"):
            print(f"  torchrun --max-restarts 1 + --resume: kill -> first step {t['kill_to_first_step_s']} s, "
                  f"{t['steps_redone']} steps redone, restore {t['restore_ms']} ms, time lost {t['time_lost_s']} s, "
                  f"weights match fault-free: {t['weights_match_fault_free']}")
        else:
            print(f"  torchrun restart: {t['reason']}")
        if c["restart_failures"]:
            print(f"  restart failures: {len(c['restart_failures'])}")
        for lp in c.get("linkpass_spare_by_interval") or [c["linkpass_spare"]]:
            if lp.get("available"):
                print(f"  linkpass spare, in-memory every {lp['memory_every']}: {lp['recovery']}, recovery "
                      f"{lp['recovery_ms']} ms, {lp['steps_redone']} steps redone (Xid at {lp['step_at_fault']}, acted on at "
                      f"{lp['step_at_rollback']}, back to {lp['rollback_step']}), {lp['steps_lost']} lost, weights match: "
                      f"{lp['weights_match_reference']}")
            else:
                print(f"  linkpass spare: not available ({lp['reason']})")


def _f(x, w: int = 8) -> str:
    return f"{'-' if x is None else f'{x:.1f}':>{w}s}"


def main(argv: list[str] | None = None, args=None) -> int:
    if args is None:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        add_snapshot_options(ap)
        args = ap.parse_args(argv)
        args.command_line = " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])
    elif not getattr(args, "command_line", None):
        args.command_line = " ".join(["linkpass", *sys.argv[1:]])
    prog = getattr(args, "prog", None) or PROG  # `linkpass bench snapshot` when run as that
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        print(f"{prog}: --parts {args.parts!r}: each part is one of {', '.join(PARTS)}", file=sys.stderr)
        return 2
    args.parts = parts
    try:
        args.widths = [int(w) for w in str(args.widths).split(",") if w.strip()]
    except ValueError:
        print(f"{prog}: --widths {args.widths!r}: comma-separated positive integers", file=sys.stderr)
        return 2
    for attr in ("every", "epochs", "samples", "batch_size", "size_steps", "size_every", "timeout_s", "restart_timeout_s"):
        if getattr(args, attr) <= 0:
            print(f"{prog}: --{attr.replace('_', '-')} must be positive, got {getattr(args, attr)}", file=sys.stderr)
            return 2
    raw = str(args.memory_every)
    try:
        args.memory_every = sorted({int(k) for k in raw.split(",") if k.strip()})
    except ValueError:
        args.memory_every = []
    if not args.memory_every or min(args.memory_every) <= 0:
        print(f"{prog}: --memory-every {raw!r}: comma-separated positive integers (steps)", file=sys.stderr)
        return 2
    if not args.widths or min(args.widths) <= 0:
        print(f"{prog}: --widths {args.widths!r}: comma-separated positive integers", file=sys.stderr)
        return 2
    if args.warmup < 0 or args.restart_retries < 0:
        print(f"{prog}: --warmup and --restart-retries must not be negative", file=sys.stderr)
        return 2
    if not 0 < args.fault_frac < 1:
        print(f"{prog}: --fault-frac must be between 0 and 1, got {args.fault_frac}", file=sys.stderr)
        return 2
    if "c" in args.parts and args.epochs * (args.samples // 2 // args.batch_size) < 2 * args.every:
        print(f"{prog}: (c) needs at least 2 x --every steps before the end ({args.epochs} epochs of "
              f"{args.samples // 2 // args.batch_size} steps, --every {args.every})", file=sys.stderr)
        return 2
    if args.json and not Path(args.json).parent.is_dir():
        print(f"{prog}: --json {args.json}: no such directory {str(Path(args.json).parent)!r}", file=sys.stderr)
        return 2
    if not EXAMPLE.is_file():
        print(f"{prog}: {EXAMPLE} not found (run from the source tree)", file=sys.stderr)
        return 2
    install_sigterm()
    try:
        r = run(args)
    except BenchError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; processes stopped", file=sys.stderr)
        return 130
    finally:
        _stop_all()
    print_report(r)
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
