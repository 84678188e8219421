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
    later = threading.Thread(target=threading.Event().wait, daemon=True)
    later.start()  # a thread started afterwards (the loop's executor grows lazily) inherits it
    ids = [int(x) for x in os.listdir("/proc/self/task")]
    assert len(ids) == 3
    real = sched.os.sched_getscheduler
    pols = sorted({real(i) for i in ids}) if sys.argv[1] != "eperm" else []
    print(json.dumps({"got": got, "thread_policies": pols}))
""")


def _run(how: str, prio: int) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, how, str(prio)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_RR needs CAP_SYS_NICE")
def test_every_thread_runs_at_sched_rr_those_started_later_too():
    r = _run("ok", 7)
    assert r["got"] == {"policy": "rr", "priority": 7, "asked": 7, "error": None}
    assert r["thread_policies"] == [os.SCHED_RR]


def test_zero_keeps_the_normal_policy():
    r = _run("ok", 0)
    assert r["got"]["policy"] == "other" and r["got"]["error"] is None and r["thread_policies"] == [os.SCHED_OTHER]


def test_without_cap_sys_nice_the_daemon_runs_on_and_says_why():
    got = _run("eperm", 10)["got"]
    assert got["policy"] == "other" and got["asked"] == 10
    assert "CAP_SYS_NICE" in got["error"] and "priority 10" in got["error"]
