"""linkpass.adapters.sched: the daemon's threads at SCHED_RR, in a child process (the policy is
per thread and would otherwise stay on the test runner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, os, sys, threading
    from linkpass.adapters import sched
    if sys.argv[1] == "eperm":
        def refuse(*a):
            raise PermissionError(1, "Operation not permitted")
        os.sched_setscheduler = refuse
    t = threading.Thread(target=threading.Event().wait, daemon=True)
    t.start()  # a thread that exists before apply: it must be moved too
    got = sched.apply(int(sys.argv[2]))
    ids = [int(x) for x in os.listdir("/proc/self/task")]
    real = sched.os.sched_getscheduler
    pols = sorted({real(i) & ~os.SCHED_RESET_ON_FORK for i in ids}) if sys.argv[1] != "eperm" else []
    child = os.fork()
    if child == 0:
        os._exit(os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK)
    _, st = os.waitpid(child, 0)
    print(json.dumps({"got": got, "thread_policies": pols, "child_policy": os.waitstatus_to_exitcode(st)}))
""")


def _run(how: str, prio: int) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, how, str(prio)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_RR needs CAP_SYS_NICE")
def test_every_thread_runs_at_sched_rr_and_programs_it_starts_do_not():
    r = _run("ok", 7)
    assert r["got"] == {"policy": "rr", "priority": 7, "asked": 7, "error": None}
    assert r["thread_policies"] == [os.SCHED_RR]
    assert r["child_policy"] == os.SCHED_OTHER  # SCHED_RESET_ON_FORK


def test_zero_keeps_the_normal_policy():
    r = _run("ok", 0)
    assert r["got"]["policy"] == "other" and r["got"]["error"] is None and r["thread_policies"] == [os.SCHED_OTHER]


def test_without_cap_sys_nice_the_daemon_runs_on_and_says_why():
    got = _run("eperm", 10)["got"]
    assert got["policy"] == "other" and got["asked"] == 10
    assert "CAP_SYS_NICE" in got["error"] and "priority 10" in got["error"]
