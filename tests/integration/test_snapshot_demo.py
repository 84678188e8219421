"""`linkpass demo --scenario snapshot --script FILE`: an unmodified FSDP2 script on the emulated
fabric (real namespaces, daemons, torchrun, gloo): a snapshot of the running job by `linkpass
snapshot --wait` from host 0's namespace, then a fresh run resumed from it; bitwise checks."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]
torch = pytest.importorskip("torch")

FSDP2 = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_train.py"


def test_a_snapshot_of_a_running_fsdp2_job_restores_bitwise_in_a_fresh_run(tmp_path, reference_cache):
    out = tmp_path / "demo.json"
    name = "tsn" + secrets.token_hex(3)
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--scenario", "snapshot", "--script", str(FSDP2),
                        "--script-args", "--epochs 3 --samples 16384", "--name", name, "--json", str(out),
                        "--reference-cache", str(reference_cache)],
                       capture_output=True, text=True, timeout=900)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["scenario"] == "snapshot" and r["steps"] == 768
    assert 0 < r["snapshot_step"] < r["steps"] and r["snapshot_bytes"] > 0 and r["snapshot_stall_ms"] >= 0
    assert r["snapshot_consistent"] is True and r["restored_weights_match"] is True
    assert r["snapshotted_run_matches_reference"] is True
    assert r["weights_match_reference"] is True and r["steps_lost"] == 0, json.dumps(r["per_rank"])[:3000]
    assert r["script_sha256"] == hashlib.sha256(FSDP2.read_bytes()).hexdigest()
    assert r["protected_modules"][0]["kind"] == "fsdp2" and r["recovery_ms"] >= 0
    for rank in ("0", "1"):
        assert r["per_rank"][rank]["resume"]["step"] == r["snapshot_step"]
