"""bench/scale_sim.py at small sizes: the simulation's invariants (every affected host leaves the
faulted rail, the packets sent are what the schedule's rules give, one seed gives one run), its
input errors, the verdict-only shortcut against the real engine, and ring_order's linear rewrite."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from linkpass.adapters.prober import ring_order
from linkpass.lab.benchcmd import _load

sim_mod = _load("scale_sim")
MS = 1_000_000

# figures that depend on the machine, not on the simulation
_MACHINE = {"sim_cpu_s", "setup_cpu_s", "sim_wall_s", "engine_cpu_s"}


def _run(hosts: int, **kw) -> dict:
    return sim_mod.Sim(hosts, **kw).run()


def test_every_affected_host_leaves_the_blackholed_rail():
    r = _run(12, sample=100, seed=3)  # the sample covers every host: all 11 peers plus X
    assert r["tracked"] == 12 and r["peers_tracked"] == 11
    assert r["peers_detected"] == 11 and r["x_detect_ms"] is not None
    assert all(p["detect_ms"] is not None and p["detect_ms"] >= 0 for p in r["per_host"])
    # X tells its peers: the rail leaves the set it announces, once X fails it or, sooner, once
    # X's own traffic avoids it as DEGRADED; the run stops when every tracked host has left it
    assert r["x_announced"]
    assert r["x_rail_failed_ms"] is not None or r["x_detect_ms"] <= max(p["detect_ms"] for p in r["per_host"])


def test_ring_neighbours_of_the_faulted_host_leave_first():
    r = _run(24, sample=6, seed=5)
    nb = [p["detect_ms"] for p in r["per_host"] if p["role"] == "neighbour"]
    others = [p["detect_ms"] for p in r["per_host"] if p["role"] == "sample"]
    assert len(nb) == 2 and None not in nb and None not in others
    assert max(nb) < min(others)
    # the neighbours probe X fast: they leave within a few BFD detection times, long before a sweep
    assert max(nb) < r["sweep_s"] * 1000 / 4


def test_probe_counts_are_the_schedules_rules_under_the_cap():
    # 16 hosts: fast set 8 rails x 2 peers every 10 ms (1,600/s), slow paths 8 x 13 once a second
    # (104/s); 1,704/s is under max_pps 2,000, so nothing is capped.  2 s before the fault.
    r = _run(16, sample=3, seed=1, window_s=0.05)
    for p in r["per_host"]:
        assert p["fast_pps"] == 8 * 2 * 100
        assert abs(p["slow_pps"] - 8 * 13) <= 0.5
        assert p["pps_on_wire"] <= p["pps_schedule"]


def test_probe_counts_are_capped_by_max_pps():
    # 64 hosts: the slow paths want 8 x 61 = 488/s on top of 1,600/s fast; the bucket gives 2,000/s
    r = _run(64, sample=2, seed=1, window_s=0.05)
    for p in r["per_host"]:
        assert p["fast_pps"] == 1600
        assert abs(p["pps_schedule"] - 2000) <= 1  # the bucket starts with one tick's worth + 1
        assert p["slow_pps"] < 8 * 61


def test_same_seed_same_run_other_seed_other_run():
    a, b = _run(20, sample=4, seed=7), _run(20, sample=4, seed=7)
    strip = lambda r: {k: v for k, v in r.items() if k not in _MACHINE}
    assert json.dumps(strip(a), sort_keys=True) == json.dumps(strip(b), sort_keys=True)
    c = _run(20, sample=4, seed=8)
    assert (c["fault_host"], [p["host"] for p in c["per_host"]]) != (a["fault_host"], [p["host"] for p in a["per_host"]])


def test_verdict_only_x_agrees_with_the_real_engine():
    kw = dict(sample=4, seed=2, stop_when_left=False)  # the peers leave by X's DEGRADED notice before X fails the rail
    real = _run(24, **kw)
    short = _run(24, full_engine_max=10, **kw)
    assert real["verdict_mode"] == "engine" and short["verdict_mode"] == "verdict-only"
    assert real["x_rail_failed_ms"] is not None and short["x_rail_failed_ms"] is not None
    # the shortcut asks the verdict once per simulated second: at most that much later
    assert real["x_rail_failed_ms"] <= short["x_rail_failed_ms"] <= real["x_rail_failed_ms"] + 1000 + 50


def test_random_loss_on_one_rail_is_avoided_by_the_faulted_host():
    r = _run(16, sample=2, seed=4, fault="loss:30", window_s=5)
    assert r["x_detect_ms"] is not None and r["x_how"] == "degraded, avoided"


@pytest.mark.parametrize("text", ["", "blackhol", "loss", "loss:", "loss:abc", "loss:0", "loss:100", "loss:-5", "loss:3x"])
def test_bad_fault_text_is_one_clear_error(text):
    with pytest.raises(ValueError, match="--fault"):
        sim_mod.parse_fault(text)


def test_bad_arguments_exit_2_with_a_message(capsys):
    assert sim_mod.main(["--hosts", "8,x"]) == 2
    assert "--hosts" in capsys.readouterr().err
    assert sim_mod.main(["--hosts", "8", "--fault", "loss:"]) == 2
    assert "--fault" in capsys.readouterr().err
    assert sim_mod.main(["--hosts", "2"]) == 2
    assert "--hosts: 2: must be comma-separated whole numbers from 3 to" in capsys.readouterr().err
    assert sim_mod.main(["--hosts", "20000"]) == 2  # 8 x 20,000 addresses do not fit 198.18.0.0/15
    assert "198.18.0.0/15" in capsys.readouterr().err


def test_addresses_stay_in_the_benchmarking_range():
    assert sim_mod.rail_addr(0, 0, 16384) == "198.18.0.0"
    assert sim_mod.rail_addr(7, 16383, 16384) == "198.19.255.255"
    with pytest.raises(ValueError, match="198.18.0.0/15"):
        sim_mod.rail_addr(8, 0, 16384)


def test_cli_runs_and_writes_json(tmp_path):
    from linkpass.cli.app import main

    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--hosts", "8", "--sample", "2", "--window-s", "0.1", "--engine-calls", "2",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    size = d["sizes"][0]
    assert size["sim"]["hosts"] == 8 and size["notices"]["datagrams_per_refresh"] == 7  # one rail per refresh, 7 peers
    assert d["date"] and d["command"].startswith("linkpass bench scale")


def _ring_order_quadratic(me, peers):
    """ring_order as it was written with a list scan (kept here to check the rewrite)."""
    def pos(name):
        return hashlib.sha256(name.encode()).digest()

    ring = sorted(set(peers) | {me}, key=pos)
    i, n = ring.index(me), len(ring)
    out = []
    for d in range(1, n):
        for name in (ring[(i + d) % n], ring[(i - d) % n]):
            if name != me and name not in out:
                out.append(name)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 64, 301])
def test_ring_order_same_result_as_the_quadratic_version(n):
    rng = random.Random(n)
    names = [f"h{rng.randrange(10**6)}" for _ in range(n)]
    for me in names[:5] + ["not-in-list"]:
        peers = [x for x in names if x != me] + names[:2]  # duplicates and me itself are tolerated
        assert ring_order(me, peers) == _ring_order_quadratic(me, peers)
