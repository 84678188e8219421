#!/usr/bin/env python3
"""Per-thread CPU and wake-ups of the running linkpass daemons, over a window.

    .venv/bin/python bench/soak.py --hosts 5 --rails 8 --idle-s 70 --load-s 0 --duration-s 0 &
    sleep 30; .venv/bin/python bench/thread_cpu.py --window-s 30 --json bench/results/thread_cpu.json

A daemon is a process whose command line runs ``linkpass`` with ``run --config FILE``.  For each
of its threads, from ``/proc/PID/task/TID/stat`` (utime, stime in clock ticks: proc(5)) and
``/proc/PID/task/TID/status`` (``voluntary_ctxt_switches``: each one is a sleep, so the next
run is a wake-up; ``nonvoluntary_ctxt_switches``: preempted) at the start and the end of the
window: user and system CPU as % of one core, and switches per second.  The event loop is the
thread whose TID is the PID; the C responder thread (``linkpass.adapters._probe_io``) is named
``lp-responder``.  Threads with fewer
than 5 switches in the window are left out.  Prints figures, never asserts them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path


#: commands that start the daemon and stay its parent (their command line names it too)
WRAPPERS = {"sudo", "ip", "nsenter", "env", "timeout", "systemd-run", "unshare"}


def daemons() -> list[tuple[int, str]]:
    """(pid, config path) of every running ``linkpass ... run --config FILE``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) in WRAPPERS or "run" not in argv or not any("linkpass" in a for a in argv):
            continue
        config = None
        for i, a in enumerate(argv):
            if a == "--config" and i + 1 < len(argv):
                config = argv[i + 1]
            elif a.startswith("--config="):
                config = a.split("=", 1)[1]
        if config is not None:
            out.append((int(pid), config))
    return sorted(out)


def threads(pid: int) -> dict[int, tuple[str, int, int, int, int]]:
    """tid -> (name, voluntary, nonvoluntary switches, utime, stime ticks); {} if the process is gone."""
    out: dict[int, tuple[str, int, int, int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on: utime is field 14
        sw = {k: int(v) for k, v in (line.split(":") for line in status.splitlines() if line.endswith(tuple("0123456789"))
                                     and "ctxt_switches" in line)}
        out[int(tid)] = (name, sw.get("voluntary_ctxt_switches", 0), sw.get("nonvoluntary_ctxt_switches", 0),
                         int(fields[11]), int(fields[12]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if not math.isfinite(args.window_s) or args.window_s <= 0:
        print("thread_cpu: --window-s must be a number > 0", file=sys.stderr)
        return 2
    if args.json and Path(args.json).is_dir():
        print(f"thread_cpu: --json {args.json}: a directory", file=sys.stderr)
        return 2
    found = daemons()
    if not found:
        print("thread_cpu: no running `linkpass ... run --config FILE` found", file=sys.stderr)
        return 1
    if args.json:  # made and tried before the window, not after it
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).touch()
        except OSError as e:
            print(f"thread_cpu: --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    hz = os.sysconf("SC_CLK_TCK")
    before = {pid: threads(pid) for pid, _ in found}
    t0 = time.monotonic()
    time.sleep(args.window_s)
    after = {pid: threads(pid) for pid, _ in found}
    dt = time.monotonic() - t0
    report = {"schema": "linkpass.bench.thread_cpu/v1", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "window_s": round(dt, 3), "daemons": []}
    for pid, config in found:
        rows = []
        for tid, (name, v, nv, ut, st) in sorted(after[pid].items()):
            if tid not in before[pid]:
                continue
            _, v0, nv0, ut0, st0 = before[pid][tid]
            if v - v0 + nv - nv0 < 5:
                continue
            rows.append({"tid": tid, "name": name, "event_loop": tid == pid, "wakeups_per_s": round((v - v0) / dt, 1),
                         "preempted_per_s": round((nv - nv0) / dt, 1), "user_pct": round((ut - ut0) / hz / dt * 100, 2),
                         "sys_pct": round((st - st0) / hz / dt * 100, 2)})
        report["daemons"].append({"pid": pid, "config": config, "threads": rows})
        print(f"{Path(config).stem} (pid {pid})")
        for r in rows:
            what = "event loop" if r["event_loop"] else r["name"]
            print(f"  {r['tid']:>7} {what:12s} wake-ups/s {r['wakeups_per_s']:7.0f}  preempted/s {r['preempted_per_s']:5.0f}  "
                  f"user {r['user_pct']:5.2f} %  sys {r['sys_pct']:5.2f} %")
    if args.json:
        p = Path(args.json)
        p.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
