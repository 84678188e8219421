"""topology.model and topology.affinity on hand-made topologies."""

from __future__ import annotations

from topology.affinity import analyse, path_type, to_json
from topology.model import Gpu, Nic, PciNode, Port, Topology, merge, norm_bus_id


def test_norm_bus_id_forms():
    assert norm_bus_id("1A:00.0") == "0000:1a:00.0"
    assert norm_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert norm_bus_id("0001:00:00.0") == "0001:00:00.0"
    assert norm_bus_id("mlx5_0") is None and norm_bus_id("") is None


def _tree() -> dict[str, PciNode]:
    # root complex A (NUMA 0): root port 0000:00:01.0 -> switch USP 01:00.0 -> DSPs 02:00.0, 02:01.0
    # GPU 03:00.0 under DSP 02:00.0, NIC 04:00.0 under DSP 02:01.0, NIC2 05:00.0 under root port 00:02.0
    # root complex B (NUMA 1): GPU 81:00.0 under root port 80:01.0
    n = {}
    def add(b, parent, numa, root, cls=None):
        n[b] = PciNode(b, parent, cls, numa, root=root)
    add("0000:00:01.0", None, 0, "A")
    add("0000:01:00.0", "0000:00:01.0", 0, "A")
    add("0000:02:00.0", "0000:01:00.0", 0, "A")
    add("0000:02:01.0", "0000:01:00.0", 0, "A")
    add("0000:03:00.0", "0000:02:00.0", 0, "A", "0x030200")
    add("0000:04:00.0", "0000:02:01.0", 0, "A", "0x020700")
    add("0000:00:02.0", None, 0, "A")
    add("0000:05:00.0", "0000:00:02.0", 0, "A", "0x020000")
    add("0000:00:03.0", None, 0, "A2")
    add("0000:06:00.0", "0000:00:03.0", 0, "A2", "0x020000")
    add("0000:80:01.0", None, 1, "B")
    add("0000:81:00.0", "0000:80:01.0", 1, "B", "0x030200")
    return n


def test_path_types_from_the_pci_tree():
    t = _tree()
    assert path_type(t, "0000:03:00.0", "0000:04:00.0") == "PIX"
    assert path_type(t, "0000:03:00.0", "0000:05:00.0") == "PHB"
    assert path_type(t, "0000:03:00.0", "0000:06:00.0") == "NODE"
    assert path_type(t, "0000:03:00.0", "0000:81:00.0") == "SYS"
    assert path_type(t, "0000:03:00.0", "0000:ff:00.0") is None


def test_two_switch_levels_are_pxb():
    t = _tree()
    t["0000:07:00.0"] = PciNode("0000:07:00.0", "0000:02:00.0", None, 0, root="A")   # second switch USP
    t["0000:08:00.0"] = PciNode("0000:08:00.0", "0000:07:00.0", None, 0, root="A")   # its DSP
    t["0000:09:00.0"] = PciNode("0000:09:00.0", "0000:08:00.0", "0x030200", 0, root="A")
    assert path_type(t, "0000:09:00.0", "0000:04:00.0") == "PXB"


def test_roles_and_rails():
    t = Topology(host="n1", pci=_tree())
    t.gpus = [Gpu(0, "0000:03:00.0", 0), Gpu(1, "0000:81:00.0", 1)]
    t.nics = [Nic("mlx5_0", "0000:04:00.0", 0, [Port(1, "ACTIVE", link_layer="InfiniBand")]),
              Nic("eth_fe", "0000:05:00.0", 0, [Port(1, "ACTIVE", link_layer="Ethernet")]),
              Nic("mlx5_9", "0000:06:00.0", 0, [Port(1, "ACTIVE", link_layer="InfiniBand")])]
    analyse(t)
    roles = {n.name: n.role for n in t.nics}
    assert roles == {"mlx5_0": "compute", "eth_fe": "front-end", "mlx5_9": "front-end"}
    assert t.gpus[0].nearest_nics == ["mlx5_0"] and t.gpus[0].nearest_path == "PIX"
    assert t.gpus[1].nearest_nics == [] and t.gpus[1].nearest_path is None
    doc = to_json(t)
    assert doc["schema"] == "linkpass.topology/v1" and doc["rails"] == [{"id": 0, "nics": ["mlx5_0"]}]
    assert analyse(t, {"mlx5_9": True}).nic("mlx5_9").role == "compute"


def test_merge_matches_rdma_name_to_bus_id():
    a = Topology(nics=[Nic("0000:04:00.0", "0000:04:00.0")], sources=["xml"])
    b = Topology(nics=[Nic("mlx5_0", "0000:04:00.0", ports=[Port(1, "ACTIVE", rate_gbps=400.0)])], sources=["ibstat"])
    m = merge([a, b])
    assert [n.name for n in m.nics] == ["mlx5_0"] and m.nics[0].ports[0].rate_gbps == 400.0
    assert m.sources == ["xml", "ibstat"]


def test_merge_keeps_two_rdma_devices_at_one_bus_id_apart():
    a = Topology(nics=[Nic("rdmaA", pci_bus_id="0000:14:00.0"), Nic("rdmaB", pci_bus_id="0000:14:00.0")])
    out = merge([a])
    assert [n.name for n in out.nics] == ["rdmaA", "rdmaB"]
    # a source that knows only the bus id still joins the device named in another
    b = Topology(nics=[Nic("0000:14:00.0", pci_bus_id="0000:14:00.0", numa_node=3)])
    out = merge([Topology(nics=[Nic("rdmaA", pci_bus_id="0000:14:00.0")]), b])
    assert [(n.name, n.numa_node) for n in out.nics] == [("rdmaA", 3)]
    out = merge([b, Topology(nics=[Nic("rdmaA", pci_bus_id="0000:14:00.0")])])
    assert [(n.name, n.numa_node) for n in out.nics] == [("rdmaA", 3)]
