"""linkpass.core.nccl_env: the NCCL environment from topology + rail health, on the sysfs trees
modelled on the corpus machines (tests/unit/topology/sysfs_trees.py) and on corpus files.

Expected strings were checked by hand against the machines' specs: rail k is the k-th GPU's
NIC in GPU (bus) order; NCCL_IB_HCA is the exact ``=hca:port`` form (NCCL env.rst)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "topology"))

import sysfs_trees as st

from linkpass.core.nccl_env import (
    ASSUMED_NCCL_VERSION,
    Health,
    NcclEnv,
    NcclEnvError,
    NcclOptions,
    RailHealth,
    compute,
    gpu_for_local_rank,
    health_from_status,
    parse_nccl_version,
    roce_v2_gid_index,
)
from topology.affinity import analyse
from topology.importers import parse_file
from topology.model import Gid, Gpu, Nic, Port, Topology
from topology.sysfs import read_sysfs

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
HGX_NICS = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_8", "mlx5_9", "mlx5_10"]
HGX_DEVS = ["ibp24s0", "ibp64s0", "ibp79s0", "ibp94s0", "ibp154s0", "ibp192s0", "ibp206s0", "ibp220s0"]


def machine_topo(tmp_path: Path, machine: st.Machine) -> Topology:
    st.build(tmp_path, machine)
    return analyse(read_sysfs(tmp_path))


@pytest.fixture
def hgx(tmp_path) -> Topology:
    return machine_topo(tmp_path, st.hgx_h100_ib()[0])


def healthy_rails(devs: list[str], down: tuple[str, ...] = (), addrs: dict[str, list[str]] | None = None,
                  generation: int = 7) -> Health:
    """The daemon's view: rails on ``devs`` (addresses 10.i.0.1/24 unless given), ``down`` not usable."""
    addrs = addrs or {d: [f"10.{i}.0.1/24"] for i, d in enumerate(devs)}
    return Health(tuple(RailHealth(i, d, d not in down, "DOWN" if d in down else "UP", tuple(addrs.get(d, [])))
                        for i, d in enumerate(devs)), generation)


# ---------------------------------------------------------------------- HGX 8 GPU / 8 NIC (InfiniBand)


def test_hgx_host_wide_exact_env(hgx):
    env = compute(hgx, options=NcclOptions(nccl_version=(2, 30, 1)))
    assert env.env == {
        "NCCL_IB_HCA": "=" + ",".join(f"{n}:1" for n in HGX_NICS),
        "NCCL_SOCKET_IFNAME": "=" + ",".join(HGX_DEVS),
        "NCCL_CROSS_NIC": "0",
    }
    assert list(env.env) == ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_CROSS_NIC"]
    # the front-end ConnectX-7 in Ethernet mode (mlx5_7) and the onboard i210 are not compute rails
    assert "mlx5_7" not in env.env["NCCL_IB_HCA"] and "enp170s0np0" not in env.env["NCCL_SOCKET_IFNAME"]
    assert env.errors == [] and env.warnings == [] and env.lost_rails == []
    assert not env.health_known and env.generation is None and not env.nccl_version_assumed
    # single-port NICs, one per GPU: NCCL's port failover cannot act, the result says so, and the
    # failover variables are left out (the torch guard would otherwise skip its abort + exit 75)
    assert any("fused NIC" in n and "nccl#2192" in n for n in env.notes)
    assert not any(k.startswith("NCCL_IB_RESILIENCY") for k in env.env)


def test_hgx_gpu_nearest_nic_first(hgx):
    env = compute(hgx, gpu=3)  # no NVML: GPU 3 is the 4th in PCI bus order (0000:61:00.0, behind mlx5_5)
    assert env.env["NCCL_IB_HCA"] == "=mlx5_5:1,mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_6:1,mlx5_8:1,mlx5_9:1,mlx5_10:1"
    assert env.env["NCCL_SOCKET_IFNAME"].startswith("=ibp94s0,ibp24s0,")
    assert any("PCI bus order" in n for n in env.notes)


def test_gpu_index_from_nvml_wins_over_bus_order(hgx):
    for k, g in enumerate(hgx.gpus):
        g.index = 7 - k  # NVML numbers them backwards here
    env = compute(hgx, gpu=0)
    assert env.hcas[0] == "mlx5_10:1"
    assert not any("PCI bus order" in n for n in env.notes)


@pytest.mark.parametrize("gpu", [8, 99])
def test_gpu_not_on_host_is_an_error(hgx, gpu):
    with pytest.raises(NcclEnvError, match=f"GPU {gpu}: this host has 8 GPU"):
        compute(hgx, gpu=gpu)


def test_host_that_lost_a_rail_drops_it_everywhere(hgx):
    health = healthy_rails(HGX_DEVS, down=("ibp64s0",), generation=12)
    env = compute(hgx, health, gpu=None)
    assert env.env["NCCL_IB_HCA"] == "=" + ",".join(f"{n}:1" for n in HGX_NICS if n != "mlx5_3")
    assert env.env["NCCL_SOCKET_IFNAME"] == "=" + ",".join(d for d in HGX_DEVS if d != "ibp64s0")
    assert env.generation == 12 and env.health_known
    assert len(env.lost_rails) == 1 and env.lost_rails[0].startswith("rail 1 (mlx5_3")
    # rails not joined: cross-NIC stays 0 and the operator is told the peers on rail 1 are cut off
    assert env.env["NCCL_CROSS_NIC"] == "0"
    assert any("not joined by a spine" in w and "nccl#2013" in w for w in env.warnings)


def test_lost_rail_with_a_spine_allows_cross_nic(hgx):
    spine = NcclOptions(rails_joined_by_spine=True)
    assert compute(hgx, healthy_rails(HGX_DEVS), options=spine).env["NCCL_CROSS_NIC"] == "2"
    lost = compute(hgx, healthy_rails(HGX_DEVS, down=("ibp64s0",)), options=spine)
    assert lost.env["NCCL_CROSS_NIC"] == "1"
    assert not any("spine" in w for w in lost.warnings)


def test_gpu_whose_own_nic_died_is_warned(hgx):
    env = compute(hgx, healthy_rails(HGX_DEVS, down=("ibp64s0",)), gpu=1)
    assert "mlx5_3:1" not in env.hcas
    assert any("own NIC(s) mlx5_3 have no healthy port" in w for w in env.warnings)


def test_no_healthy_compute_port_is_an_error_not_an_empty_list(hgx):
    env = compute(hgx, healthy_rails(HGX_DEVS, down=tuple(HGX_DEVS)))
    assert "NCCL_IB_HCA" not in env.env  # unset, with an error: never "=" (empty means all devices)
    assert "NCCL_SOCKET_IFNAME" not in env.env
    assert env.errors and "no healthy compute port" in env.errors[0] and "every RDMA device" in env.errors[0]
    assert "ERROR: no healthy compute port" in env.render("env-file")
    assert "NCCL_IB_RESILIENCY_PORT_FAILOVER" not in env.env


def test_port_down_in_topology_without_daemon(tmp_path):
    m, _ = st.hgx_h100_ib()
    m.rdma["mlx5_4"].ports[1] = dataclasses.replace(m.rdma["mlx5_4"].ports[1], state="DOWN", phys="Polling", rate=None)
    env = compute(machine_topo(tmp_path, m))
    assert "mlx5_4" not in env.env["NCCL_IB_HCA"] and "ibp79s0" not in env.env["NCCL_SOCKET_IFNAME"]
    assert env.lost_rails and "mlx5_4" in env.lost_rails[0]


def test_link_facts_from_netlink_count_when_no_daemon(hgx):
    hgx.links = {d: {"operstate": "UP", "carrier": True, "addresses": [f"10.{k}.0.1/24"]} for k, d in enumerate(HGX_DEVS)}
    hgx.links["ibp24s0"] = {"operstate": "DOWN", "carrier": False, "addresses": ["10.0.0.1/24"]}
    hgx.links["ibp220s0"]["addresses"] = []  # no address: NCCL's socket transport cannot use it
    env = compute(hgx)
    assert not env.hcas[0].startswith("mlx5_0") and "ibp24s0" not in env.netdevs
    assert "mlx5_10:1" in env.hcas and "ibp220s0" not in env.netdevs
    assert any("ibp220s0 left out" in n and "no address" in n for n in env.notes)


# ---------------------------------------------------------------------- RoCE with GID tables


def test_roce_bonds_gid_index_from_the_netdev_address(tmp_path):
    topo = machine_topo(tmp_path, st.roce_bonds()[0])
    bonds = [f"bond{i}" for i in range(8)]
    health = healthy_rails(bonds, addrs={b: [f"10.{i}.0.1/24"] for i, b in enumerate(bonds)})
    env = compute(topo, health, gpu=2)
    # GPUs 2 and 3 share a switch with mlx5_bond_2 and mlx5_bond_3; GID 3 is RoCE v2 ::ffff:10.i.0.1
    assert env.env["NCCL_IB_HCA"] == "=mlx5_bond_2:1,mlx5_bond_3:1,mlx5_bond_0:1,mlx5_bond_1:1,mlx5_bond_4:1,mlx5_bond_5:1,mlx5_bond_6:1,mlx5_bond_7:1"
    assert env.env["NCCL_IB_GID_INDEX"] == "3"
    assert env.env["NCCL_SOCKET_IFNAME"] == "=bond2,bond3,bond0,bond1,bond4,bond5,bond6,bond7"
    assert env.warnings == []


def test_roce_address_without_a_gid_leaves_gid_index_unset(tmp_path):
    topo = machine_topo(tmp_path, st.roce_bonds()[0])
    bonds = [f"bond{i}" for i in range(8)]
    health = healthy_rails(bonds, addrs={b: ["192.0.2.9/24"] for b in bonds})
    env = compute(topo, health, options=NcclOptions(nccl_version=(2, 18, 5)))
    assert "NCCL_IB_GID_INDEX" not in env.env
    assert any("no RoCE v2 GID holds its address 192.0.2.9" in w and "GID index 0" in w for w in env.warnings)


def test_roce_ports_disagreeing_on_the_index_leave_it_unset():
    def nic(name, rail, idx):
        p = Port(1, "ACTIVE", link_layer="Ethernet", netdev=f"eth{rail}",
                 gids=[Gid(idx, f"0000:0000:0000:0000:0000:ffff:0a00:0{rail}01", "RoCE v2", f"eth{rail}")])
        return Nic(name, ports=[p], kind="rdma", role="compute", rail=rail)

    topo = Topology(nics=[nic("mlx5_0", 0, 3), nic("mlx5_1", 1, 5)])
    env = compute(topo)
    assert env.env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    assert "NCCL_IB_GID_INDEX" not in env.env
    assert any("different indexes" in w and "3: mlx5_0:1" in w and "5: mlx5_1:1" in w for w in env.warnings)


@pytest.mark.parametrize("addresses, want", [
    (["10.1.0.1/24"], 3),
    ([], 3),                       # address unknown: the only RoCE v2 IPv4 GID
    (["fe80::1/64"], 3),           # no IPv4 address known: same
    (["10.9.9.9/24"], None),
])
def test_roce_v2_gid_index(addresses, want):
    gids = st.roce_gids(0x10, (10, 1, 0, 1), "bond1")
    port = Port(1, "ACTIVE", link_layer="Ethernet", gids=[Gid(i, g, t, d) for i, (g, t, d) in gids.items()])
    assert roce_v2_gid_index(port, addresses)[0] == want


# ---------------------------------------------------------------------- dual port, fused NICs, versions


def test_dual_port_disabled_ports_are_left_out_not_lost(tmp_path):
    env = compute(machine_topo(tmp_path, st.dual_port()[0]))
    assert env.env["NCCL_IB_HCA"] == "=mlx4_0:1,mlx4_1:1"
    assert env.env["NCCL_SOCKET_IFNAME"] == "=ib0,ib2"
    assert env.lost_rails == []
    assert any("mlx4_0:2 left out: port DISABLED" in n for n in env.notes)


def test_two_healthy_ports_of_one_nic_can_fail_over(tmp_path):
    m, _ = st.dual_port()
    m.rdma["mlx4_0"].ports[2] = st.IbPort(rate="56 Gb/sec (4X FDR)", gids=st.ib_gids(0x16))
    env = compute(machine_topo(tmp_path, m), gpu=0)
    assert env.env["NCCL_IB_HCA"] == "=mlx4_0:1,mlx4_0:2,mlx4_1:1"
    assert env.env["NCCL_IB_RESILIENCY_PORT_FAILOVER"] == "1"
    assert not any("fused NIC" in n for n in env.notes)


@pytest.mark.parametrize("version", [(2, 29, 7), (2, 30, 0), None])
def test_no_failover_variables_without_a_second_healthy_port(tmp_path, version):
    # dual-port NICs whose second ports are disabled: nothing to fail over to
    env = compute(machine_topo(tmp_path, st.dual_port()[0]), options=NcclOptions(nccl_version=version))
    assert env.hcas == ["mlx4_0:1", "mlx4_1:1"]
    assert not any(k.startswith("NCCL_IB_RESILIENCY") for k in env.env)
    assert any("no second healthy port" in n and "left out" in n for n in env.notes)
    # a GPU whose own NIC has a second healthy port gets them, another GPU's env does not
    m, _ = st.dual_port()
    m.rdma["mlx4_0"].ports[2] = st.IbPort(rate="56 Gb/sec (4X FDR)", gids=st.ib_gids(0x16))
    topo = machine_topo(tmp_path / "fused", m)
    assert compute(topo, gpu=0, options=NcclOptions(nccl_version=version)).env.get("NCCL_IB_RESILIENCY_PORT_FAILOVER") == "1"
    assert "NCCL_IB_RESILIENCY_PORT_FAILOVER" not in compute(topo, gpu=2, options=NcclOptions(nccl_version=version)).env


@pytest.mark.parametrize("version, failover, recovery", [
    ((2, 27, 3), False, False),
    ((2, 29, 6), False, False),
    ((2, 29, 7), True, False),
    ((2, 30, 0), True, True),
    (None, True, True),  # unknown: assume 2.30.0
])
def test_resiliency_variables_follow_the_version(tmp_path, version, failover, recovery):
    m, _ = st.dual_port()
    m.rdma["mlx4_0"].ports[2] = st.IbPort(rate="56 Gb/sec (4X FDR)", gids=st.ib_gids(0x16))
    fused = machine_topo(tmp_path, m)
    env = compute(fused, options=NcclOptions(nccl_version=version))
    assert ("NCCL_IB_RESILIENCY_PORT_FAILOVER" in env.env) == failover
    assert ("NCCL_IB_RESILIENCY_PORT_RECOVERY" in env.env) == recovery
    assert env.nccl_version_assumed == (version is None)
    if version is None:
        assert env.nccl_version == ".".join(map(str, ASSUMED_NCCL_VERSION))
    off = compute(fused, options=NcclOptions(ib_resiliency=False, nccl_version=version))
    assert not any(k.startswith("NCCL_IB_RESILIENCY") for k in off.env)


@pytest.mark.parametrize("text, want", [("2.29.7", (2, 29, 7)), ("2.29.7-1", (2, 29, 7)), ("v2.30", (2, 30, 0)),
                                        ("2.21.5+cuda12.4", (2, 21, 5))])
def test_parse_nccl_version(text, want):
    assert parse_nccl_version(text) == want


@pytest.mark.parametrize("text", ["", "two", "2", "2.x.1", "2.29.7 beta"])
def test_parse_nccl_version_rejects(text):
    with pytest.raises(NcclEnvError, match="MAJOR.MINOR"):
        parse_nccl_version(text)


# ---------------------------------------------------------------------- GPU without a NIC, empty inputs


def test_gpu_without_a_local_nic_gets_a_warning():
    nics = [Nic(f"mlx5_{k}", pci_bus_id=f"0000:{0x10 + k:02x}:00.0", ports=[Port(1, "ACTIVE", link_layer="InfiniBand", netdev=f"ib{k}")],
                kind="rdma") for k in range(2)]
    gpus = [Gpu(0, "0000:0a:00.0"), Gpu(1, "0000:0b:00.0"), Gpu(2, "0000:0c:00.0")]
    paths = {("0000:0a:00.0", "mlx5_0"): "PIX", ("0000:0a:00.0", "mlx5_1"): "SYS",
             ("0000:0b:00.0", "mlx5_0"): "SYS", ("0000:0b:00.0", "mlx5_1"): "PIX",
             ("0000:0c:00.0", "mlx5_0"): "SYS", ("0000:0c:00.0", "mlx5_1"): "SYS"}
    topo = analyse(Topology(gpus=gpus, nics=nics, paths=paths))
    env = compute(topo, gpu=2)
    assert env.env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"  # rail order
    assert any("GPU 2 (0000:0c:00.0) has no local compute NIC" in w for w in env.warnings)


@pytest.mark.parametrize("topo", [None, Topology()])
def test_empty_topology_gives_notes_not_errors(topo):
    env = compute(topo)
    assert env.env == {"NCCL_CROSS_NIC": "0"}
    assert env.errors == []
    assert any("NCCL_IB_HCA not set: no RDMA compute NIC" in n for n in env.notes)


def test_emulated_fabric_rails_without_hcas():
    health = healthy_rails(["rail0", "rail1"], down=("rail0",), addrs={"rail0": ["198.18.0.1/24"], "rail1": ["198.18.1.1/24"]})
    env = compute(Topology(), health, gpu=0)
    assert env.env == {"NCCL_SOCKET_IFNAME": "=rail1", "NCCL_CROSS_NIC": "0"}
    assert env.lost_rails == ["rail 0 (rail0: DOWN)"]
    assert any("GPU 0 asked for, but no GPU is known" in w for w in env.warnings)
    text = env.render("env-file")
    assert text.splitlines()[0].startswith("# linkpass NCCL environment: host=- generation=7 gpu=0")
    assert "NCCL_SOCKET_IFNAME==rail1" in text.splitlines()


@pytest.mark.parametrize("status, match", [
    ([], "expected a JSON object"),
    ({}, "no 'rails' list"),
    ({"rails": "x"}, "no 'rails' list"),
    ({"rails": [1]}, r"rails\[0\] is not an object"),
    ({"rails": [{"netdev": "r0", "usable": True}]}, r"rails\[0\].id"),
    ({"rails": [{"id": 0, "usable": True}]}, r"rails\[0\].netdev"),
    ({"rails": [{"id": 0, "netdev": "r0", "usable": "yes"}]}, r"rails\[0\].usable"),
    ({"rails": [{"id": 0, "netdev": "r0", "usable": True, "addresses": "10.0.0.1"}]}, r"rails\[0\].addresses"),
    ({"rails": [], "generation": "7"}, "generation"),
])
def test_malformed_daemon_status_is_refused(status, match):
    with pytest.raises(NcclEnvError, match=match):
        health_from_status(status)


def test_status_state_stands_in_for_usable():
    h = health_from_status({"generation": 3, "rails": [{"id": 0, "netdev": "r0", "state": "SUSPECT"},
                                                       {"id": 1, "netdev": "r1", "state": "HOLD_DOWN"}]})
    assert [r.usable for r in h.rails] == [True, False] and h.generation == 3


# ---------------------------------------------------------------------- local rank -> GPU, rendering


def test_gpu_for_local_rank():
    topo = Topology(gpus=[Gpu(0, uuid="GPU-aaaa-1111"), Gpu(1, uuid="GPU-bbbb-2222")])
    assert gpu_for_local_rank(1, None, topo) == 1
    assert gpu_for_local_rank(1, "3,2", topo) == 2
    assert gpu_for_local_rank(0, "GPU-bbbb", topo) == 1
    with pytest.raises(NcclEnvError, match="makes only 2 GPU"):
        gpu_for_local_rank(2, "3,2", topo)
    with pytest.raises(NcclEnvError, match="matches no known GPU UUID"):
        gpu_for_local_rank(0, "GPU-cccc", topo)
    with pytest.raises(NcclEnvError, match="makes only 0 GPU"):
        gpu_for_local_rank(0, "", topo)
    with pytest.raises(NcclEnvError, match="must be 0 or more"):
        gpu_for_local_rank(-1, None, topo)


def test_render_formats():
    env = NcclEnv(env={"NCCL_IB_HCA": "=mlx5_0:1", "NCCL_CROSS_NIC": "0"}, generation=4, host="h0", warnings=["w1"])
    shell = env.render("shell").splitlines()
    assert "export NCCL_IB_HCA='=mlx5_0:1'" in shell and "# warning: w1" in shell
    assert env.render("env-file").splitlines()[-2:] == ["NCCL_IB_HCA==mlx5_0:1", "NCCL_CROSS_NIC=0"]
    import json

    doc = json.loads(env.render("json"))
    assert doc["schema"] == "linkpass.nccl-env/v1" and doc["generation"] == 4 and doc["env"]["NCCL_CROSS_NIC"] == "0"
    with pytest.raises(ValueError, match="unknown format"):
        env.render("yaml")
    bad = NcclEnv(env={"NCCL_SOCKET_IFNAME": "=a b\nX=1"})
    with pytest.raises(ValueError, match="cannot carry"):
        bad.render("env-file")
    assert "export NCCL_SOCKET_IFNAME='=a b\nX=1'" in bad.render("shell")


# ---------------------------------------------------------------------- corpus files


@pytest.mark.parametrize("rel, hca", [
    ("ib_tools/dgxh100_like_ibdev2netdev_8ib_3eth.txt", "=" + ",".join(f"{n}:1" for n in HGX_NICS)),
    ("ib_tools/dgx_spark_gb10_cx7_ibdev2netdev_ibv_devinfo_2of4_down.txt", "=rocep1s0f1:1,roceP2p1s0f1:1"),
    ("nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix.nvsmi_topo.txt", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7"),
])
def test_corpus_files(rel, hca):
    env = compute(analyse(parse_file(CORPUS / rel)))
    assert env.env["NCCL_IB_HCA"] == hca
    assert env.errors == []


@pytest.mark.parametrize("rel", sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.is_file() and p.suffix != ".json"))
def test_every_corpus_file_gives_an_environment(rel):
    topo = analyse(parse_file(CORPUS / rel))
    for gpu in (None, *[g.index for g in topo.gpus[:1] if g.index is not None]):
        env = compute(topo, gpu=gpu)
        env.render("env-file")
        assert "NCCL_CROSS_NIC" in env.env
        assert env.env.get("NCCL_IB_HCA", "=x") not in ("", "=")
