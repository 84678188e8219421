"""The benchmarks still run end to end (tiny sizes; no figure is judged here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]
BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_detect_reroute_smoke(tmp_path):
    out = tmp_path / "dr.json"
    p = subprocess.run([sys.executable, str(BENCH / "detect_reroute.py"), "--cuts", "2", "--name", "bnsmk", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["schema"] == "linkpass.bench.detect_reroute/v1"
    for mode in ("admin-down", "carrier-loss"):
        m = r["modes"][mode]
        assert m["misses"] == 0 and m["detect_ms"]["p50"] is not None and m["reroute_ms"]["p50"] is not None


def test_daemon_footprint_smoke(tmp_path):
    out = tmp_path / "fp.json"
    p = subprocess.run([sys.executable, str(BENCH / "daemon_footprint.py"), "--idle-s", "1", "--settle-s", "0", "--name", "bnsmf", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert all(d["vmrss_mb"] > 0 for d in r["daemons"])


def test_topology_speed_smoke(tmp_path):
    out = tmp_path / "ts.json"
    p = subprocess.run([sys.executable, str(BENCH / "topology_speed.py"), "--runs", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [t["gpus"] for t in r["trees"]] == [8, 8] and all(t["rails"] == 8 for t in r["trees"])


def test_bench_detect_no_bfd_smoke(tmp_path):
    out = tmp_path / "db.json"
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "bench", "detect", "--mode", "carrier-loss", "--trials", "2",
                        "--no-bfd", "--settle-ms", "50", "--name", "bnsmb", "--json", str(out)],
                       check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["schema"] == "linkpass.bench.detect_bfd/v1" and r["bfdd"] is None and not r["bfdd_available"]
    lp = r["linkpass"]
    assert lp["misses"] == 0 and lp["detect_ms"]["n"] == 2 and lp["false_failovers"] == 0
    assert all(d["vmhwm_mb"] > 0 for d in lp["daemons"])


def test_kernel_reroute_smoke(tmp_path):
    out = tmp_path / "kr.json"
    p = subprocess.run([sys.executable, str(BENCH / "kernel_reroute.py"), "--plans", "6", "--cuts", "1", "--name", "bnsmn", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["schema"] == "linkpass.bench.kernel_reroute/v1"
    for mode in ("nexthop_objects", "inline"):
        m = r["modes"][mode]
        assert m["errors"] == 0 and m["reroute_apply_ms"]["n"] == 3
        assert m["stall"]["daemon"]["cuts"][0]["reroute_ms"] is not None
        assert len(m["stall"]["kernel_only"]["cuts"]) == 1
