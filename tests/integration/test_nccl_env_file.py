"""The daemon rewrites its NCCL env file on every plan change, on the real emulated fabric.

Host 0 runs in config mode with a hand-built sysfs tree whose RoCE HCAs name the fabric's rail
netdevs (so the daemon matches rail -> HCA port by netdev and writes NCCL_IB_HCA and the GID
index); host 1 reads the namespace's own sysfs, where the rails are veths with no HCA (so
NCCL_IB_HCA is left out with a comment).  A carrier-loss cut of rail 0 must give a file with a
newer generation without rail0 / its HCA."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "topology"))

import sysfs_trees as st

from .daemons import Cluster, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]


def roce_node_on_fabric_rails() -> st.Machine:
    """Two GPUs, each sharing a PCIe switch with one RoCE NIC mlx5_k whose netdev is railK;
    the RoCE v2 GID at index 3 holds host 0's rail address 198.18.k.1."""
    kids = {st._b(0): st.Dev(st.HOST_BRIDGE_FN)}
    rdma, net = {}, {"lo": st.Net(operstate="unknown")}
    for k, b in enumerate((0x10, 0x30)):
        gpu, nic = b + 3, b + 4
        kids[st._b(b, 1)] = st.bridge({st._b(b + 1): st.bridge({
            st._b(b + 2, 0): st.bridge({st._b(gpu): st.Dev(st.H100)}),
            st._b(b + 2, 1): st.bridge({st._b(nic): st.Dev(st.CX7_ETH)}),
        })}, st.ROOT_PORT)
        net[f"rail{k}"] = st.Net(st._b(nic))
        rdma[f"mlx5_{k}"] = st.Rdma(st._b(nic), {1: st.IbPort(rate="400 Gb/sec (4X NDR)", link_layer="Ethernet",
                                                                gids=st.roce_gids(nic << 8, (198, 18, k, 1), f"rail{k}"))})
    return st.Machine({"pci0000:00": (0, kids)}, rdma, net)


def read_env(path: Path) -> tuple[int, dict[str, str], list[str]] | None:
    """(generation, variables, comment lines) of an env file, None while it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    m = re.search(r"generation=(\d+)", text.splitlines()[0])
    env = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return int(m.group(1)), env, [line for line in text.splitlines() if line.startswith("#")]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        tree = tmp_path / "sysfs"
        st.build(tree, roce_node_on_fabric_rails())
        for h in c.desc["hosts"]:
            cfg = tomllib.loads(Path(h["config"]).read_text())
            cfg["nccl"] = {"env_file": str(tmp_path / f"{h['name']}-nccl.env"), "version": "2.30.1"}
            if h["index"] == 0:
                cfg["topology"] = {"sysfs_root": str(tree)}
            Path(h["config"]).write_text(tomli_w.dumps(cfg))
        c.start_all()
        yield c
    finally:
        c.close()


def test_env_file_follows_plan_generation_and_drops_the_cut_rail(cluster, tmp_path):
    from linkpass.lab import fabric as fab

    c = cluster
    f0, f1 = tmp_path / "h0-nccl.env", tmp_path / "h1-nccl.env"
    first0 = wait_for(lambda: read_env(f0), what="h0's env file")
    first1 = wait_for(lambda: read_env(f1), what="h1's env file")
    g0, env0, _ = first0
    assert env0["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    assert env0["NCCL_IB_GID_INDEX"] == "3"  # RoCE v2 GID of 198.18.k.1 (host 0's rail addresses)
    assert env0["NCCL_SOCKET_IFNAME"] == "=rail0,rail1"
    assert env0["NCCL_CROSS_NIC"] == "0"
    g1, env1, comments1 = first1
    assert "NCCL_IB_HCA" not in env1 and any("NCCL_IB_HCA not set" in line for line in comments1)
    assert env1["NCCL_SOCKET_IFNAME"] == "=rail0,rail1"

    fab.cut(c.name, 0, 0, "carrier-loss")
    g, env, comments = wait_for(lambda: (r := read_env(f0)) and r[0] > g0 and "rail0" not in r[1].get("NCCL_SOCKET_IFNAME", "rail0") and r,
                                timeout=10, what="h0's env file without rail0")
    assert env["NCCL_IB_HCA"] == "=mlx5_1:1" and env["NCCL_SOCKET_IFNAME"] == "=rail1"
    assert any("lost rail 0 (mlx5_0" in line and "not joined by a spine" in line for line in comments)
    assert g <= c.status(0)["generation"]

    fab.cut(c.name, 1, 0, "carrier-loss")
    wait_for(lambda: (r := read_env(f1)) and r[0] > g1 and r[1].get("NCCL_SOCKET_IFNAME") == "=rail1",
             timeout=10, what="h1's env file without rail0")
    assert [p.name for p in tmp_path.glob(".*nccl.env*")] == []  # no temporary file left behind
