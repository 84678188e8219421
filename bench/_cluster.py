"""Shared helpers of the benchmarks: an emulated fabric with one real daemon per host, the
daemons' control socket, and per-process CPU / memory figures from ``/proc``.

Not a test helper: nothing here asserts timings.  Everything is torn down by
:meth:`BenchCluster.close` (call it in ``finally``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import signal
import tempfile
from pathlib import Path

from linkpass.lab import fabric as fab
from linkpass.lab.fabric.cluster import Cluster, ClusterError

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024

#: Figures the product aims at (DESIGN/issue targets), printed next to what was measured.
TARGETS = {
    "rss_mb": 80.0,
    "idle_cpu_pct": 0.5,
    "detect_p99_ms": 2.0,
    "reroute_p99_ms": 5.0,
}

_LOG_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


class BenchError(Exception):
    """The benchmark could not run (fabric, daemon start); the message says which."""


# --------------------------------------------------------------------------- /proc


def proc_cpu(pid: int) -> dict:
    """CPU time used by process ``pid`` so far (all threads).

    Returns ``{"stat_ns": utime+stime from /proc/PID/stat (clock-tick resolution),
    "sched_ns": sum of every thread's on-CPU time from /proc/PID/task/*/schedstat (ns
    resolution; None where schedstat is not available)}``.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # fields[0] is field 3 (state); utime is field 14, stime field 15
    ticks = int(fields[11]) + int(fields[12])
    sched = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    sched += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # thread ended between listdir and open
    except FileNotFoundError:
        sched = None
    return {"stat_ns": ticks * 1_000_000_000 // CLK_TCK, "sched_ns": sched}


def proc_mem(pid: int) -> dict:
    """``{"vmrss_kb", "vmhwm_kb", "threads"}`` of process ``pid`` from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k == "VmRSS":
                out["vmrss_kb"] = int(v.split()[0])
            elif k == "VmHWM":
                out["vmhwm_kb"] = int(v.split()[0])
            elif k == "Threads":
                out["threads"] = int(v.split()[0])
    return out


def proc_cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def machine_info() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": list(os.getloadavg()),
    }


# --------------------------------------------------------------------------- stats


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default), None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary(values: list[float]) -> dict:
    """``{"n", "p50", "p99", "max", "min", "mean"}`` in the values' unit, rounded to µs."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "min": None, "mean": None}

    def r(x):
        return round(x, 3)

    return {"n": len(values), "p50": r(quantile(values, 0.5)), "p99": r(quantile(values, 0.99)),
            "max": r(max(values)), "min": r(min(values)), "mean": r(sum(values) / len(values))}


# --------------------------------------------------------------------------- cluster


class BenchCluster(Cluster):
    """:class:`linkpass.lab.fabric.cluster.Cluster` plus what the benchmarks measure: the daemons'
    pids (checked), the count of control-socket queries, and problems in the daemon logs.

    ``launch()`` builds the fabric, starts every daemon and waits until each is ready.
    """

    def __init__(self, hosts: int, rails: int, name: str, hold_down_ms: int, workdir: Path | None = None,
                 daemon_argv: list[str] | None = None):
        super().__init__(hosts, rails, name, hold_down_ms,
                         workdir=workdir or Path(tempfile.mkdtemp(prefix=f"linkpass-bench-{name}-")), daemon_argv=daemon_argv)
        self.pids: list[int] = []
        self.pid_check: list[str] = []

    def launch(self, ready_timeout: float = 30.0) -> None:
        """Build the fabric, start the daemons, wait until each has applied a plan and
        heard from every peer; resolve the daemons' pids.

        Raises:
            BenchError: the fabric name is in use (a benchmark never takes over, and at its end
                tears down, a fabric someone else built), the fabric or a daemon failed.
        """
        why = name_in_use(self.name)
        if why:
            raise BenchError(why)
        try:
            self.up()
        except fab.FabricError as e:
            raise BenchError(f"fabric: {e}") from None
        try:
            statuses = self.start_all(ready_timeout)
        except ClusterError as e:
            raise BenchError(str(e)) from None
        # `ip netns exec NS cmd` execs cmd after setns(), so the Popen pid should be the python
        # daemon itself; check that against its cmdline and the pid it reports.
        for i, st in enumerate(statuses):
            p = self.procs[i]
            argv = proc_cmdline(p.pid)
            is_daemon = bool(argv) and "python" in os.path.basename(argv[0]) and argv[1:1 + len(self.daemon_argv)] == self.daemon_argv
            if is_daemon and st.get("pid") == p.pid:
                self.pids.append(p.pid)
                self.pid_check.append(f"pid {p.pid}: Popen pid is the python daemon (cmdline and status agree)")
            else:
                self.pids.append(int(st["pid"]))
                self.pid_check.append(f"Popen pid {p.pid} ({' '.join(argv[:3])}) is not the daemon; using status pid {st['pid']}")

    def add_config(self, i: int, tables: dict) -> None:
        """Merge ``tables`` (``{"mqtt": {...}, ...}``: TOML tables by name, each a dict) into host
        i's daemon config after :meth:`up` and before the daemon starts; keys of a table the
        config already has are replaced one by one.  The result is validated like the fabric's
        own configs (:func:`linkpass.config.parse_config`) and written back.

        Raises:
            BenchError: the merged config is invalid (the message names the file and field).
        """
        import tomllib

        import tomli_w

        from linkpass.config import ConfigError, parse_config

        path = self.host(i)["config"]
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
        for name, table in tables.items():
            cfg.setdefault(name, {}).update(table)
        text = tomli_w.dumps(cfg)
        try:
            parse_config(text, path)
        except ConfigError as e:
            raise BenchError(f"extra daemon config: {e}") from None
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for _, p in sorted(self.procs.items())]

    def log_problems(self, limit: int = 50) -> list[str]:
        """Lines of the daemon logs that say WARNING/ERROR/CRITICAL or carry a traceback."""
        out = []
        for _, path in sorted(self.logs.items()):
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                if _LOG_PROBLEM.search(line):
                    out.append(f"{path.name}: {line}")
        return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def name_in_use(name: str) -> str | None:
    """Why fabric ``name`` cannot be used by a benchmark (one exists), or None."""
    try:
        fab.load(name)
    except fab.FabricError:
        return None
    return (f"name in use: a fabric named {name!r} exists; pick another --name "
            f"or remove it with `linkpass fabric down --name {name}`")


def check_args(prog: str, args, positive=(), non_negative=()) -> int | None:
    """Refuse bad benchmark arguments before anything is built: one line naming the option,
    exit status 2.  ``positive``/``non_negative``: attribute names of ``args``.  Also checks
    that ``args.json``'s directory exists and that ``args.name`` is free.  Returns 2 or None."""
    for attr in positive:
        if getattr(args, attr) <= 0:
            print(f"{prog}: --{attr.replace('_', '-')} must be positive, got {getattr(args, attr)}", file=sys.stderr)
            return 2
    for attr in non_negative:
        if getattr(args, attr) < 0:
            print(f"{prog}: --{attr.replace('_', '-')} must not be negative, got {getattr(args, attr)}", file=sys.stderr)
            return 2
    if getattr(args, "json", None):
        parent = Path(args.json).parent
        if not parent.is_dir():
            print(f"{prog}: --json {args.json}: no such directory {str(parent)!r}", file=sys.stderr)
            return 2
    why = name_in_use(args.name)
    if why:
        print(f"{prog}: {why}", file=sys.stderr)
        return 2
    return None


def run_and_report(prog: str, run, print_report, args) -> int:
    """The common end of every benchmark's main(): run it (SIGTERM and Ctrl-C tear down), print
    the report, write the JSON.  Returns the exit status: 0, 1 on BenchError, 130 interrupted."""
    install_sigterm()
    try:
        r = run(args)
    except BenchError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; torn down", file=sys.stderr)
        return 130
    print_report(r)
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    return 0


def install_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks tear the fabric down."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


def write_json(path: str, data: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, p)
