"""`linkpass demo` as a test: a real gloo training job keeps training through a rail cut."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]
torch = pytest.importorskip("torch")


def test_demo_trains_through_a_carrier_loss_cut(tmp_path):
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--hosts", "2", "--rails", "2", "--steps", "200",
                        "--name", "tdemo", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("steps", "steps_lost", "max_step_stall_ms", "weights_match_reference", "fault", "rail_bytes_before_cut",
                "rail_bytes_after_cut", "detect_ms", "reroute_ms", "peer_reroute_ms", "failback_ms"):
        assert key in r, key
    assert r["steps"] == 200 and r["steps_lost"] == 0
    assert r["weights_match_reference"] is True
    assert r["fault"]["mode"] == "carrier-loss" and r["fault"]["host"] == 1
    cut = str(r["fault"]["rail"])
    other = next(k for k in r["rail_bytes_after_cut"] if k != cut)
    # the cut rail carried the job before the cut; after it, the traffic is on another rail
    assert r["rail_bytes_before_cut"][cut] > 10 * max(1, sum(v for k, v in r["rail_bytes_before_cut"].items() if k != cut))
    assert r["rail_bytes_after_cut"][cut] < 0.01 * r["rail_bytes_after_cut"][other]
    for k in ("detect_ms", "reroute_ms", "peer_reroute_ms", "failback_ms"):
        assert isinstance(r[k], float) and r[k] >= 0, (k, r[k])
    assert r["failback_ms"] >= 2000  # never before the default hold-down
    # everything it built is gone
    assert "tdemo-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_demo_refuses_bad_arguments():
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--rails", "1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--rails must be 2..16" in p.stderr and "Traceback" not in p.stderr


def test_demo_never_touches_an_existing_fabric():
    from linkpass.lab import fabric as fab

    fab.up(2, 2, "tdemox")
    try:
        p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--name", "tdemox"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "name in use" in p.stderr
        assert fab.load("tdemox")["name"] == "tdemox"  # still there
    finally:
        fab.down("tdemox")
