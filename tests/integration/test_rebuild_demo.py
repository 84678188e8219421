"""`linkpass demo --scenario rebuild` as a test: no route changes (reroute = notify-only), the
torch hook rebuilds the job's gloo process group on the other rail after a carrier-loss cut."""

from __future__ import annotations

import json
import os
import secrets
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


def test_rebuild_scenario_trains_through_the_cut_on_a_rebuilt_process_group(tmp_path):
    out = tmp_path / "demo.json"
    name = "trb" + secrets.token_hex(3)
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--scenario", "rebuild", "--hosts", "2", "--rails", "2",
                        "--steps", "150", "--name", name, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["scenario"] == "rebuild" and r["steps"] == 150
    assert r["steps_lost"] == 0 and r["weights_match_reference"] is True
    assert r["errors"] == []
    # every rank rebuilt once, from rail 0 to rail 1, replaying the interrupted step
    assert sorted(r["rebuilds"]) == ["0", "1"]
    for evs in r["rebuilds"].values():
        assert [(e["rail_from"], e["rail_to"], e["epoch"]) for e in evs] == [(0, 1, 1)]
    assert any(e["trigger"] == "notice" for evs in r["rebuilds"].values() for e in evs)
    # the figures are reported (how fast: bench/, not here)
    assert isinstance(r["rebuild_ms"], float) and r["rebuild_ms"] > 0
    assert isinstance(r["cut_to_resume_ms"], float) and r["cut_to_resume_ms"] > 0
    # the kernel did not move anything: no linkpass route anywhere; the traffic moved with the group
    assert r["kernel_routes"] == {"h0": 0, "h1": 0}
    after = r["rail_bytes_after_cut"]
    assert after["1"] > 10 * max(1, after["0"])  # rail 0 only carries what was in flight when the cut came
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
