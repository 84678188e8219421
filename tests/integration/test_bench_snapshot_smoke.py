"""bench/snapshot.py still runs end to end (tiny sizes; no figure is judged here).  No root: the
device-fault demo, the one part that needs network namespaces, is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_snapshot_bench_smoke(tmp_path):
    """bench/snapshot.py at tiny sizes (no root; the device-fault demo off): every part runs end
    to end and the JSON has its shape.  No timing value is judged."""
    pytest.importorskip("torch")
    out = tmp_path / "snap.json"
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "bench", "snapshot", "--epochs", "1", "--samples", "2048",
                        "--every", "4", "--memory-every", "2,4", "--widths", "32", "--size-steps", "5", "--size-every", "2",
                        "--device-fault-demo", "off", "--restart-retries", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=480, env=dict(os.environ, PYTHONPATH=str(BENCH.parent)))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["schema"] == "linkpass.bench.snapshot/v1" and r["parts"] == ["a", "b", "c"]
    modes = r["overhead"]["modes"]
    assert {"none", "async_dcp", "sync_torch_save"} <= set(modes)
    assert ("in_memory" in modes) == r["in_memory_available"]
    for f in modes.values():
        assert f["steps"] == 32 and f["step_ms"]["n"] > 0 and set(f["ratio_to_none"]) == {"p50", "p99", "mean"}
    assert modes["async_dcp"]["snapshots"]["ok"] > 0 and modes["sync_torch_save"]["saves"]["count"] > 0
    if r["in_memory_available"]:
        # in-memory only (no disk snapshot) at --every, and the interval knob at 2
        assert modes["in_memory"]["memory_every"] == 4 and modes["in_memory_every_2"]["memory_every"] == 2
        assert modes["in_memory"]["snapshots"]["ok"] > 0 and modes["in_memory"]["snapshots"]["bytes"] > 0
        assert modes["in_memory_every_2"]["snapshots"]["count"] > modes["in_memory"]["snapshots"]["count"]
        assert [m["memory_every"] for m in r["overhead"]["memory_intervals"]] == [2, 4]
    (row,) = r["sizes"]["sizes"]
    assert row["width"] == 32 and row["async_dcp"]["ok"] > 0 and row["async_dcp"]["bytes"] > 0
    assert row["sync_torch_save"]["count"] > 0 and row["restore"]["step"] == 4
    assert isinstance(row["restore"]["restore_ms"], (int, float))
    if r["in_memory_available"]:
        assert row["in_memory"]["ok"] > 0 and row["in_memory"]["bytes"] > 0
    c = r["device_fault"]
    t = c["torchrun_restart"]
    assert t["available"] and t["weights_match_fault_free"] and t["steps_redone"] >= 0
    assert t["steps_final"] == [32, 32] and isinstance(t["kill_to_first_step_s"], (int, float))
    assert c["linkpass_spare"] == {"available": False, "reason": "--device-fault-demo off"}
    assert c["linkpass_spare_by_interval"] == [c["linkpass_spare"]]
