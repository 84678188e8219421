"""CPU scheduling of the daemon: a probe verdict is a timing verdict, so the daemon must not
wait behind the host's busy threads for the CPU.

With ``[daemon] realtime_priority = N`` (1-99) every thread of the daemon runs under
``SCHED_RR`` at priority N (sched(7)); threads it starts later inherit it.  Not with
``SCHED_RESET_ON_FORK``: that flag also resets the threads a process creates (they are made by
``clone``, like a fork), so only the calling thread would stay real-time.  The daemon starts no
programs (routes over netlink, sysctls through /proc).  Busy ``SCHED_OTHER`` threads (data loaders,
compilers) can then delay the daemon by a scheduler tick at most, instead of a share of the
CPU: the same choice corosync makes for its heartbeat (it runs ``SCHED_RR`` at the highest
priority unless started with ``-p``; corosync(8)) and keepalived offers (``vrrp_rt_priority``,
keepalived.conf(5)).  The kernel's RT throttling (``/proc/sys/kernel/sched_rt_runtime_us``,
default 950000 of every 1000000 us) still leaves the rest of the host 5 % of each CPU should
the daemon spin.

``N = 0`` keeps the normal policy.  Setting it needs ``CAP_SYS_NICE`` (root has it; a
container needs it granted) unless the process already runs so (systemd's
``CPUSchedulingPolicy=rr``, deploy/linkpass.service): without either the daemon runs on at the
normal policy and says so.

Measured (2026-12-03, 3 daemons x 8 rails x 2 peers on 2 cores under two busy loops and two
process spawners, tests/integration/test_do_no_harm.py's load, a 56 s window each, 2 runs):
probe timeouts per host 60-220 at SCHED_OTHER, 0-8 at SCHED_RR 10; misses judged peer-wide
("silent") 19-183 vs 0.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("linkpass.sched")


def _tasks() -> list[int]:
    """Thread ids of this process (the policy is per thread on Linux)."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [0]


def apply(priority: int) -> dict:
    """Put every thread of this process at ``SCHED_RR`` ``priority`` (0: ``SCHED_OTHER``).

    Threads started later inherit the calling thread's policy.

    Returns:
        ``{"policy": "rr" | "other", "priority": int, "asked": int, "error": str | None}``:
        what the daemon runs at now, and why not what was asked (``error``).  Never raises.
    """
    if priority <= 0:
        policy, param = os.SCHED_OTHER, os.sched_param(0)
    else:
        policy, param = os.SCHED_RR, os.sched_param(priority)
    error = None
    for tid in _tasks():
        try:
            if os.sched_getscheduler(tid) == policy and os.sched_getparam(tid).sched_priority == param.sched_priority:
                continue  # already so (systemd's CPUSchedulingPolicy=): raising needs CAP_SYS_NICE even to the same value
            os.sched_setscheduler(tid, policy, param)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as e:
            error = (f"cannot run at SCHED_RR priority {priority} ({e.strerror or e}; needs CAP_SYS_NICE): "
                     "running at the normal policy, so busy threads on this host can delay probes"
                     if priority > 0 else f"cannot return to the normal policy ({e.strerror or e})")
            break
    now = os.sched_getscheduler(0)
    cur = os.sched_getparam(0).sched_priority
    return {"policy": "rr" if now == os.SCHED_RR else "fifo" if now == os.SCHED_FIFO else "other",
            "priority": cur, "asked": priority, "error": error}
