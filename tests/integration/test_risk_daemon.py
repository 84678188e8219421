"""Real daemons on the emulated fabric poll their hosts' counter trees ([risk] sysfs_root, built
by `fabric up`): a rail whose port_rcv_errors climb (`linkpass inject counters`) is found at
risk by rule and drained (the kernel route to the peer leaves it; the peer hears it); a GPU whose AER corrected count climbs
is at risk (no hook client on it: the alert's remedy); status and metrics say so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
import tomli_w

from linkpass.lab.inject import inject_counters

from .daemons import Cluster, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]

LINKPASS = str(Path(sys.executable).with_name("linkpass"))


def _status(config: str) -> dict:
    p = subprocess.run([LINKPASS, "status", "--json", "--config", config], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _climb(c, host: int, kind: str, subject: int, counter: str, until) -> dict:
    """Raise the counter at 200/s (for up to 30 s) until ``until()`` holds; returns inject's result."""
    out: dict = {}
    done = threading.Event()

    def run():
        out.update(inject_counters(c.name, host, kind, subject, counter, rate=200.0, duration_s=30.0, stop=done.is_set))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        got = wait_for(until, timeout=30, what=f"{kind} {subject} at risk")
    finally:
        done.set()
        t.join(5)
    return {**out, "got": got}


def test_a_rail_at_risk_is_drained_and_left_by_its_peer_and_a_gpu_at_risk_is_told(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        cfg = tmp_path / "h1-risk.toml"
        data = tomllib.loads(Path(c.host(1)["config"]).read_text())
        data["risk"] = {**data.get("risk", {}), "poll_interval_s": 0.2}
        data["metrics"] = {"enabled": False}
        cfg.write_text(tomli_w.dumps(data))
        c.start(0, wait=False)
        c.start(1, config=str(cfg), wait=False)
        c.wait_ready(0)
        c.wait_ready(1)
        st = _status(str(cfg))
        src = st["device_sources"]["counters"]
        assert src["rails"] == [0, 1] and src["gpus"] and st["at_risk"] == []
        assert c.route_rails(1, 0) == [0, 1]

        def rail0_at_risk():
            s = _status(str(cfg))
            return s if s["at_risk"] and s["rails"][0]["state"] == "DRAINED" else None

        st = _climb(c, 1, "rail", 0, "port_rcv_errors", rail0_at_risk)["got"]
        (v,) = st["at_risk"]
        assert (v["subject_kind"], v["subject"], v["rule"], v["counter"]) == ("rail", 0, "ib.port_rcv_errors.rate", "port_rcv_errors")
        assert v["counters"]["port_rcv_errors"] > 0 and v["window_s"] > 0 and v["citation"]
        assert st["rails"][0]["drains"] == ["at-risk"] and st["rails"][0]["reason"].startswith("at risk: ")
        wait_for(lambda: c.route_rails(1, 0) == [1], timeout=5, what="h1's route to h0 off rail 0")
        # the peer hears it in h1's notice and stops sending to h1 over rail 0
        wait_for(lambda: c.route_rails(0, 1) == [1], timeout=5, what="h0's route to h1 off rail 0")
        # failback after the clean hold (rates over their windows back under the thresholds, then
        # clean_hold_s) is the tracker's and the engine's: tests/unit/test_risk.py, test_engine_risk.py
        hist = [e for e in c.history(1) if e["kind"] == "at_risk"]
        assert [e["at_risk"] for e in hist] == [True] and hist[0]["subject_kind"] == "rail"

        def gpu0_at_risk():
            s = _status(str(cfg))
            return s if any(x["subject_kind"] == "gpu" for x in s["at_risk"]) else None

        st = _climb(c, 1, "gpu", 0, "aer_correctable", gpu0_at_risk)["got"]
        (g,) = [x for x in st["at_risk"] if x["subject_kind"] == "gpu"]
        assert g["subject"] == 0 and g["rule"] == "gpu.aer_correctable.burst" and g["counters"]["aer_correctable"] > 0
        assert c.route_rails(1, 0) == [1]  # a GPU at risk moves no traffic (rail 0 is still drained)
        wait_for(lambda: "drain the node" in c.logs[1].read_text(errors="replace"), timeout=5,
                 what="the GPU-at-risk warning with its remedy (no hook client on GPU 0)")
    finally:
        c.close()
