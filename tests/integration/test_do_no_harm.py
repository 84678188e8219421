"""Do no harm: healthy rails stay in service under CPU load, daemon stalls, someone else's
flap storm and someone else's blackhole.  Every figure is a count read from the daemons'
totals and the kernel's routing tables; nothing asserts on time.

All daemons run with the product's default probe timers (10 ms x 3) and damping, on the 2
shared cores of the test machine: that is harsher than a real node, where each daemon has its
host's CPUs to itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from linkpass.lab import fabric as fab

from .daemons import Cluster, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]

HARM = ("rail_down", "degraded", "route_changes")


def _all_paths_up(c, n_paths):
    return all(len(s["paths"]) == n_paths and all(p["state"] == "UP" for p in s["paths"])
               for s in (c.status(i) for i in range(c.hosts)))


def _totals(c):
    return [{k: c.status(i)["totals"].get(k, 0) for k in HARM} for i in range(c.hosts)]


def _kernel_routes(c):
    return [sorted((r.get("dst"), tuple(sorted(nh["dev"] for nh in r.get("nexthops", [r])))) for r in c.routes(i))
            for i in range(c.hosts)]


def _evidence(c):
    """Per host, the probe answers it has seen so far (replies to its probes plus passive
    proofs): the windows below are measured in these, not in seconds."""
    out = []
    for i in range(c.hosts):
        k = c.status(i)["counters"]
        out.append(k.get("probes_replies", 0) + k.get("probes_passive_ok", 0))
    return out


def _window(c, answers: int, timeout: float, sample=lambda: None):
    """Return once every host has seen ``answers`` more probe answers (a window of probing,
    whatever the machine's speed), calling ``sample`` meanwhile; fails after ``timeout`` s."""
    start = _evidence(c)
    def done():
        sample()
        return all(b - a >= answers for a, b in zip(start, _evidence(c)))
    wait_for(done, timeout=timeout, what=f"{answers} more probe answers on every host")


def _harm(before, after):
    return [{k: a[k] - b[k] for k in HARM if a[k] != b[k]} for b, a in zip(before, after)]


def _story(c, last: int = 40):
    """Per host, the last ``last`` history entries: why a route moved, for a failure message."""
    return "\n".join(f"h{i}: {json.dumps(h)}" for i in range(c.hosts)
                     for h in c.status(i, "history")["history"][-last:])


SPIN = "while True: pass"
SPAWN = ("import subprocess, sys\n"
         "while True: subprocess.run([sys.executable, '-c', 'import json, decimal, email.parser, http.client'])")


class BusyLoops:
    """Per core, one busy loop and one process spawning short-lived processes back to back:
    the normal state of a GPU node (data loaders' decode threads, compilers' workers)."""

    def __init__(self, n: int | None = None):
        self.n = n or os.cpu_count() or 2
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.n) for code in (SPIN, SPAWN)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _healthy_cluster(tmp_path, rails: int):
    """3 hosts x ``rails`` with default daemons, every probe path UP; closed at the end."""
    c = Cluster(hosts=3, rails=rails, hold_down_ms=2000, tmp=tmp_path)
    try:
        c.start_all()
        wait_for(lambda: _all_paths_up(c, 2 * rails), timeout=20, what="every path UP")
        yield c
    finally:
        c.close()


@pytest.fixture
def fabric_3x8(tmp_path):
    yield from _healthy_cluster(tmp_path, 8)


def test_idle_healthy_3x8_fabric_under_busy_loops_fails_nothing(fabric_3x8):
    c = fabric_3x8
    before, routes = _totals(c), _kernel_routes(c)
    with BusyLoops():
        # 16 paths at 10 ms: about 1,600 answers a second per host, so about a minute of load
        _window(c, 90_000, timeout=240)
    after = _totals(c)
    assert _harm(before, after) == [{}, {}, {}], f"{_harm(before, after)}\n{_story(c)}"
    assert _kernel_routes(c) == routes


@pytest.fixture
def fabric_3x2(tmp_path):
    yield from _healthy_cluster(tmp_path, 2)


def _silent_misses(c, i):
    return c.status(i)["counters"].get("probes_peer_silent_misses", 0)


def test_a_daemon_stopped_for_20_probe_intervals_five_times_changes_no_route_anywhere(fabric_3x2):
    """Each stall lasts until both peers have counted 40 misses of the stopped daemon as silent
    (2 paths each, 20 probe intervals: 200 ms at the default 10 ms), measured in the peers'
    evidence rather than slept."""
    c = fabric_3x2
    before, routes = _totals(c), _kernel_routes(c)
    pid = c.procs[1].pid
    for _ in range(5):
        start = {i: _silent_misses(c, i) for i in (0, 2)}
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: all(_silent_misses(c, i) - n >= 40 for i, n in start.items()), timeout=10,
                     what="both peers see the stopped daemon silent for 20 probe intervals")
        finally:
            os.kill(pid, signal.SIGCONT)
        # every path answers again before the next stall
        wait_for(lambda: _all_paths_up(c, 4), timeout=10, what="every path UP after the stall")
    assert _harm(before, _totals(c)) == [{}, {}, {}]
    assert _kernel_routes(c) == routes


def test_a_blackhole_on_one_hosts_rail_takes_no_other_hosts_rail_out_of_service(fabric_3x2):
    c = fabric_3x2
    before = _totals(c)
    fab.cut(c.name, 1, 0, "blackhole")
    # h0 and h2 route around h1's rail 0 ...
    wait_for(lambda: c.route_rails(0, 1) == [1] and c.route_rails(2, 1) == [1], timeout=10,
             what="h0 and h2 avoid h1's rail 0")
    # ... h1 fails its rail 0 (both its peers are unreachable over it, answering on rail 1) ...
    wait_for(lambda: next(r for r in c.status(1)["rails"] if r["id"] == 0)["state"] == "DOWN", timeout=10,
             what="h1's rail 0 DOWN")
    def healthy_between_h0_h2():  # ... and between the healthy hosts both rails stay in use throughout
        assert c.route_rails(0, 2) == [0, 1] and c.route_rails(2, 0) == [0, 1]
    _window(c, 400, timeout=30, sample=healthy_between_h0_h2)
    after = _totals(c)
    for i in (0, 2):
        assert after[i]["rail_down"] == before[i]["rail_down"], c.status(i)["rails"]
        assert all(r["state"] == "UP" for r in c.status(i)["rails"])
    fab.heal(c.name, 1, 0)


def test_a_50_ms_flap_storm_suppresses_no_healthy_rail_and_routes_settle(fabric_3x2):
    c = fabric_3x2
    fab.cut(c.name, 1, 0, "flap:50:200")  # 10 s: 25 ms down, 25 ms up
    suppressed = set()

    def storm_over():
        for i in range(3):
            for r in c.status(i)["rails"]:
                d = r.get("damping") or {}
                if d.get("suppressed"):
                    suppressed.add((i, r["id"]))
        return not any(f["mode"].startswith("flap:") for f in fab.load(c.name).get("faults", []))
    wait_for(storm_over, timeout=60, what="the flap storm's end")
    assert suppressed <= {(1, 0)}, suppressed  # only the flapping link itself may be damped
    fab.heal(c.name, 1, 0)

    def settled():
        # routes follow the rails usable at both ends: h1's rail 0 only once its damping and
        # hold-down let it back; between h0 and h2 both rails all along
        st = [c.status(i) for i in range(3)]
        usable = [{r["id"] for r in s["rails"] if r["usable"]} for s in st]
        want = {(i, j): sorted(usable[i] & usable[j]) for i in range(3) for j in range(3) if i != j}
        return all(c.route_rails(i, j) == w for (i, j), w in want.items()) and usable[0] == usable[2] == {0, 1}
    wait_for(settled, timeout=15, what="routes follow the usable rails after the storm")
    # and once the damping of the flapped rail has decayed, it is back everywhere
    wait_for(lambda: all(c.route_rails(i, j) == [0, 1] for i in range(3) for j in range(3) if i != j),
             timeout=90, what="the flapped rail back in use")


def test_a_daemon_restarted_onto_a_blackholed_rail_routes_around_it_and_peers_stay_calm(fabric_3x2):
    c = fabric_3x2
    fab.cut(c.name, 1, 0, "blackhole")
    wait_for(lambda: c.route_rails(0, 1) == [1] and c.route_rails(2, 1) == [1], timeout=10,
             what="h0 and h2 avoid h1's rail 0")
    c.stop(1)
    c.start(1)
    # h1 never hears anyone over rail 0 while they answer over rail 1: it leaves the rail
    wait_for(lambda: c.route_rails(1, 0) == [1] and c.route_rails(1, 2) == [1], timeout=10,
             what="restarted h1 avoids its blackholed rail 0")
    wait_for(lambda: c.route_rails(0, 1) == [1] and c.route_rails(2, 1) == [1], timeout=10,
             what="h0 and h2 still avoid h1's rail 0")
    before = _totals(c)
    _window(c, 600, timeout=30)  # a steady fault: nobody rewrites routes over and over
    after = _totals(c)
    for i in (0, 2):
        assert after[i]["route_changes"] - before[i]["route_changes"] <= 1, (before, after)
        assert c.route_rails(i, 1) == [1] and c.route_rails(i, 2 - i if i else 2) == [0, 1]
    fab.heal(c.name, 1, 0)
