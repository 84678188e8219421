"""[topology] rails = "auto": the daemon takes its rails from topology discovery and its peers
from a peers file, on the real emulated fabric (the RDMA side comes from a hand-built sysfs
tree whose RoCE devices name the fabric's rail netdevs; the addresses come from netlink)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "topology"))

import sysfs_trees as st  # noqa: E402

from .daemons import Cluster, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]


def two_rail_roce_node() -> st.Machine:
    """Two H100s, each sharing a PCIe switch with one RoCE ConnectX-7 whose netdev is railK."""
    kids = {}
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
    kids[st._b(0)] = st.Dev(st.HOST_BRIDGE_FN)
    return st.Machine({"pci0000:00": (0, kids)}, rdma, net)


@pytest.fixture
def auto_cluster(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        tree = tmp_path / "sysfs"
        st.build(tree, two_rail_roce_node())
        peers = tmp_path / "peers.txt"
        peers.write_text("# the job's hosts\n" + "".join(f"{h['name']} {h['host_ip']}\n" for h in c.desc["hosts"]))
        for h in c.desc["hosts"]:
            import tomllib

            cfg = tomllib.loads(Path(h["config"]).read_text())
            cfg.pop("rails")
            cfg.pop("peers")
            cfg["topology"] = {"rails": "auto", "sysfs_root": str(tree), "peers_file": str(peers)}
            Path(h["config"]).write_text(tomli_w.dumps(cfg))
        c.start_all()
        yield c
    finally:
        c.close()


def test_rails_and_peers_come_from_discovery(auto_cluster):
    c = auto_cluster
    s = c.status(0)
    assert [(r["id"], r["netdev"]) for r in s["rails"]] == [(0, "rail0"), (1, "rail1")]
    assert [p["name"] for p in s["peers"]] == ["h1"]
    assert s["topology"]["rails"] == "auto" and any("mlx5_0 via rail0" in n for n in s["topology"]["notes"])
    assert c.route_rails(0, 1) == [0, 1] and c.route_rails(1, 0) == [0, 1]
    # and failover works on the derived config
    from linkpass.lab import fabric as fab

    fab.cut(c.name, 1, 0, "carrier-loss")
    wait_for(lambda: c.route_rails(1, 0) == [1], what="local reroute")
    wait_for(lambda: c.route_rails(0, 1) == [1], what="peer reroute")


def test_auto_without_any_rail_is_a_clear_error(tmp_path):
    from linkpass.lab import fabric as fab  # noqa: F401
    import subprocess

    empty = tmp_path / "sysfs"
    st.build(empty, st.no_gpu_no_rdma())
    key = tmp_path / "key"
    key.write_text("k" * 32)
    key.chmod(0o600)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nhost = 'h0'\nhost_ip = '198.19.0.1'\nnotice_key_file = '{key}'\ncontrol_socket = '{tmp_path}/s'\n"
                   f"[topology]\nrails = 'auto'\nsysfs_root = '{empty}'\n")
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "run", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "found no compute NIC" in p.stderr and "Traceback" not in p.stderr
