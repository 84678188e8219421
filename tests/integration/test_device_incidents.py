"""A real daemon on the emulated fabric follows a kernel-log file ([device] kmsg_path): a
kmsg-style Xid 79 record appended to it shows up as an incident in `linkpass status --json`
(not notified: no GPU index for its bus id), and a restarted daemon resumes after the last
sequence number instead of reading it again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_kmsg_record_becomes_an_incident_in_status(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        kmsg = tmp_path / "kmsg.log"
        kmsg.write_text("6,1,1000,-;Linux version 6.8.0 (boot)\n")
        cfg = tmp_path / "h0-device.toml"
        import tomllib

        import tomli_w

        data = tomllib.loads(Path(c.host(0)["config"]).read_text())
        data["device"] = {"kmsg_path": str(kmsg), "state_dir": str(tmp_path / "state"), "nvml": False, "rdma": False}
        cfg.write_text(tomli_w.dumps(data))
        c.start(0, config=str(cfg), wait=False)
        c.start(1, wait=False)
        c.wait_ready(0)
        c.wait_ready(1)
        st = _status(str(cfg))
        assert st["device_sources"]["kmsg"]["active"] and st["incident_counts"] == {}
        with kmsg.open("a") as fh:
            fh.write("3,2,5000000,-;NVRM: Xid (PCI:0000:91:00): 79, pid=4242, GPU has fallen off the bus.\n")
        st = wait_for(lambda: (s := _status(str(cfg)))["incidents"] and s, timeout=5, what="the Xid 79 incident")
        (inc,) = st["incidents"]
        assert (inc["code"], inc["device"], inc["domain"], inc["action"], inc["source"], inc["seq"]) == \
            ("xid:79", "0000:91:00.0", "gpu", "migrate-rank", "kmsg", 2)
        # no GPU index for 0000:91:00.0 here (no GPU map beside the log, no NVML): told to no hook
        # client (every rank would move), recorded as a node-level fault
        assert not inc["backlog"] and not inc["notified"] and inc["gpu_unknown"] and inc["gpu"] is None
        assert st["incident_counts"] == {"gpu": 1} and st["device_sources"]["kmsg"]["last_seq"] == 2
        plain = subprocess.run([LINKPASS, "status", "--config", str(cfg)], capture_output=True, text=True, timeout=10).stdout
        assert "device incidents: 1 (gpu 1)" in plain
        # a restart resumes after seq 2: the Xid is not read again
        assert c.stop(0) == 0
        assert json.loads((tmp_path / "state" / "kmsg-h0.state").read_text())["seq"] == 2
        c.start(0, config=str(cfg), wait=False)
        c.wait_ready(0)
        st = _status(str(cfg))
        assert st["incidents"] == [] and st["device_sources"]["kmsg"]["skipped_resume"] == 2
    finally:
        c.close()
