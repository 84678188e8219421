"""`linkpass demo --scenario guard-device-fault` (the explicit LinkPassGuard API) as a test: real namespaces, real daemons following
their kernel-log files, real gloo: an Xid 79 injected on h1's GPU 0 moves rank 1 to h1's spare."""

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


@pytest.mark.parametrize("fault_host", [1, 0])  # rank 0 too: the job's store runs in a process of its own
def test_device_fault_scenario_moves_the_rank_to_a_spare(tmp_path, fault_host):
    out = tmp_path / "demo.json"
    name = "tdf" + secrets.token_hex(3)
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--scenario", "guard-device-fault", "--hosts", "2", "--rails", "2",
                        "--steps", "100", "--name", name, "--fault-host", str(fault_host), "--json", str(out)],
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["scenario"] == "device-fault" and r["steps"] == 100  # the guard demo reports its own name
    assert r["steps_lost"] == 0 and r["weights_match_reference"] is True and r["errors"] == []
    assert r["faulty_exit"] in (74, -9)  # exited by itself (fenced) or killed by the spare's fence
    m = r["migration"]
    assert m["spare"] is not None and m["epoch"] == 1 and m["state_bytes"] > 0
    assert isinstance(r["migration_ms"], float) and r["migration_ms"] > 0  # reported; how fast: bench/, not here
    assert r["fault"]["host"] == fault_host
    healthy = str(1 - fault_host)
    assert r["peer_events"][healthy][0]["migrated_rank"] == fault_host
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
