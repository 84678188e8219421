"""Benchmark: the CPU of ``CounterPoller.poll()`` alone (no tracker) on a synthetic host's
sysfs tree (``linkpass.lab.counter_trees.synthetic_host``, 8 mlx5 rails by default, no GPUs:
the emulated host the daemon's CPU budget is set for), polled back to back.

Figures: process CPU (``time.process_time``) per poll, and the CPU of each thread of the
process (``/proc/self/task/*/schedstat``, ns) split into the polling thread and the reader
threads; wall time per poll.  The tree is written once (the values do not change: the kernel's
side is not measured).  Futex calls are counted from outside, e.g.
``strace -f -c -e trace=futex .venv/bin/python bench/counters_poll.py --polls 300``.

No fabric, no root.  Prints one line and writes JSON:

    .venv/bin/python bench/counters_poll.py --polls 300 --json bench/results/counters_poll.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linkpass.adapters.counters import CounterPoller  # noqa: E402
from linkpass.adapters.counters_fake import FakeNvml  # noqa: E402
from linkpass.lab import counter_trees as ct  # noqa: E402


def thread_cpu_ns() -> dict[int, int]:
    """tid -> CPU ns of every thread of this process (schedstat; stat ticks where it is missing)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except OSError:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // tick
            except OSError:
                continue
    return out


def run(polls: int, rails: int, gpus: int) -> dict:
    host = ct.synthetic_host(rails, gpus)
    seq = {"steps": 1, "interval_s": 1, "series": {}}
    with tempfile.TemporaryDirectory(prefix="lp-counters-poll-") as d:
        ct.build_host(d, host)
        ct.write_step(d, host, seq, 0)
        nv = FakeNvml(ct.nvml_steps(seq, host)) if gpus else None
        p = CounterPoller(ct.rail_sources(host), ct.gpu_sources(host), root=d, nvml=nv)
        try:
            samples, problems = p.poll()  # warm-up: the threads exist, the plan is made
            me = threading.get_native_id()
            t0, c0, w0 = thread_cpu_ns(), time.process_time(), time.perf_counter()
            wall = []
            for _ in range(polls):
                w = time.perf_counter()
                samples, problems = p.poll()
                wall.append(time.perf_counter() - w)
            c1, w1, t1 = time.process_time(), time.perf_counter(), thread_cpu_ns()
        finally:
            p.close()
    per_thread = {tid: t1[tid] - t0.get(tid, 0) for tid in t1}
    readers = sum(v for tid, v in per_thread.items() if tid != me)
    cpu = c1 - c0
    return {"rails": rails, "gpus": gpus, "polls": polls, "samples_per_poll": len(samples),
            "problems_per_poll": len(problems),
            "cpu_ms_per_poll": round(cpu / polls * 1e3, 3),
            "polling_thread_cpu_ms_per_poll": round(per_thread.get(me, 0) / polls / 1e6, 3),
            "reader_threads_cpu_ms_per_poll": round(readers / polls / 1e6, 3),
            "threads": len(per_thread),
            "wall_ms_per_poll_median": round(statistics.median(wall) * 1e3, 3),
            "wall_s": round(w1 - w0, 3),
            "core_pct_at_1hz": round(cpu / polls * 100.0, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--polls", type=int, default=300)
    ap.add_argument("--rails", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs (their AER files and the fake NVML)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    r = run(a.polls, a.rails, a.gpus)
    r["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "loadavg": os.getloadavg()}
    print(f"poll, {r['rails']} rails / {r['gpus']} GPUs, {r['samples_per_poll']} samples, {r['polls']} polls: "
          f"{r['cpu_ms_per_poll']} ms CPU a poll (polling thread {r['polling_thread_cpu_ms_per_poll']}, "
          f"readers {r['reader_threads_cpu_ms_per_poll']}, {r['threads']} threads), "
          f"wall {r['wall_ms_per_poll_median']} ms median; {r['core_pct_at_1hz']} % of a core at 1 Hz")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
