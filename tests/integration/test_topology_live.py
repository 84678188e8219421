"""topology.live on the emulated fabric and on this machine: read_netlink inside a host
namespace (rail0/rail1, their addresses and carrier, a carrier-loss cut), and discover() here.

Needs root, network namespaces, `ip` and `nft`; skipped otherwise.  This machine has no GPU and
no RDMA device, so the NVML and pyverbs paths are only exercised with fake bindings
(tests/unit/topology/test_sysfs.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from linkpass.lab import fabric as fab
from linkpass.lab.fabric._ns import in_netns
from topology.affinity import analyse, to_json
from topology.live import discover, read_netlink

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]

REPO = Path(__file__).resolve().parents[2]

_IN_NS = (
    "import json, sys; from topology.live import {fn}; "
    "json.dump({expr}, sys.stdout)"
)


def in_ns(ns: str, fn: str, expr: str):
    """Run ``expr`` (after importing ``fn`` from topology.live) in a fresh Python inside ``ns``
    through ``ip netns exec``, which also mounts that namespace's /sys; return its JSON."""
    p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _IN_NS.format(fn=fn, expr=expr)],
                       check=False, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture
def fabric():
    name = "tp" + secrets.token_hex(4)
    try:
        yield fab.up(2, 2, name)
    finally:
        fab.down(name)


def test_read_netlink_sees_the_rails_and_a_carrier_loss(fabric):
    name = fabric["name"]
    for h in fabric["hosts"]:
        links = in_ns(h["netns"], "read_netlink", "read_netlink()")
        i = h["index"]
        for k in (0, 1):
            rail = links[f"rail{k}"]
            assert rail["carrier"] is True and rail["operstate"] == "UP", rail
            assert f"198.18.{k}.{i + 1}/24" in rail["addresses"]
        assert f"198.19.0.{i + 1}/32" in links[h["host_netdev"]]["addresses"]
        assert "eth0" not in links  # the root namespace's netdevs stay out

    ns0 = fabric["hosts"][0]["netns"]
    fab.cut(name, 0, 0, "carrier-loss")
    links = in_ns(ns0, "read_netlink", "read_netlink()")
    assert links["rail0"]["carrier"] is False and links["rail0"]["operstate"] != "UP"
    assert "198.18.0.1/24" in links["rail0"]["addresses"]  # the address stays; the carrier went
    assert links["rail1"]["carrier"] is True
    # the other host's view of its own rail 0 is untouched
    assert in_ns(fabric["hosts"][1]["netns"], "read_netlink", "read_netlink()")["rail0"]["carrier"] is True

    # the same from a thread that entered the namespace itself (how the daemon would do it)
    result: dict = {}

    def run() -> None:
        with in_netns(ns0):
            result.update(read_netlink())

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert result["rail0"]["carrier"] is False and result["rail1"]["carrier"] is True

    fab.heal(name, 0, 0)
    assert in_ns(ns0, "read_netlink", "read_netlink()")["rail0"]["carrier"] is True


def test_discover_inside_a_host_namespace(fabric):
    """Inside a fabric host the rails are veths (virtual: no PCI, no RDMA): no NIC, but
    netlink's view of them is in ``links``."""
    h = fabric["hosts"][0]
    d = in_ns(h["netns"], "discover",
              "(lambda t: {'links': t.links, 'nics': [n.name for n in t.nics], 'gpus': len(t.gpus)})(discover())")
    assert d["nics"] == [] and d["gpus"] == 0
    assert {"lo", "rail0", "rail1", h["host_netdev"]} <= set(d["links"])
    assert "198.18.1.1/24" in d["links"]["rail1"]["addresses"]


def test_discover_on_this_machine():
    topo = discover()
    doc = to_json(analyse(topo))
    json.dumps(doc)
    assert doc["gpus"] == []
    assert not any(n.kind == "rdma" for n in topo.nics)  # no RDMA device here
    assert all(n["rail"] is None for n in doc["nics"])
    assert doc["rails"] == []
    assert topo.host and topo.sources[0] == "sysfs:/" and "netlink" in topo.sources
    assert "lo" in topo.links and topo.links["lo"]["carrier"] is True
    # no NVIDIA driver: at most one informational NVML line, and nothing else to complain about
    assert [w for w in doc["warnings"] if not w.startswith("nvml: not used")] == []
    assert len([w for w in doc["warnings"] if w.startswith("nvml:")]) <= 1
    # every netdev on a PCI function is a front-end plain NIC named by its bus id
    for n in topo.nics:
        assert n.kind == "ethernet" and n.name == n.pci_bus_id and n.role == "front-end" and n.netdevs
