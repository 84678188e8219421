"""topology.sysfs / topology.capture (and topology.live's NVML and pyverbs logic, with fake
bindings) on fake sysfs trees shaped like the kernel's (see sysfs_trees.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sysfs_trees as st

from topology import live
from topology.affinity import analyse, path_type, to_json
from topology.capture import capture
from topology.sysfs import read_sysfs


def doc(root) -> dict:
    """to_json of the analysed reading, checked to be JSON, without ``sources`` (which names
    the root)."""
    d = to_json(analyse(read_sysfs(root)))
    json.dumps(d)
    d.pop("sources")
    return d


@pytest.fixture(params=sorted(st.MACHINES))
def machine(request, tmp_path):
    m, exp = st.MACHINES[request.param]()
    tree = st.build(tmp_path / "root", m)
    return request.param, tree, exp


# --------------------------------------------------------------------------- the four machines


def test_machine_reads_as_expected(machine):
    _, tree, exp = machine
    topo = analyse(read_sysfs(tree.root))
    assert topo.warnings == []
    assert topo.unclassified == []
    assert [g.pci_bus_id for g in topo.gpus] == exp.gpus
    assert all(g.index is None and g.uuid is None for g in topo.gpus)  # only NVML knows them
    assert {g.pci_bus_id: g.nearest_nics for g in topo.gpus} == exp.nearest
    assert {g.pci_bus_id: g.nearest_path for g in topo.gpus} == exp.nearest_path
    assert {n.name: n.role for n in topo.nics} == exp.roles
    assert {n.name: n.rail for n in topo.nics if n.rail is not None} == exp.rails
    for key, want in exp.ports.items():
        nic, port = key.split("/")
        got = topo.nic(nic).port(int(port)).to_json()
        assert {k: got[k] for k in want} == want, key
    for nic, netdevs in exp.netdevs.items():
        assert topo.nic(nic).netdevs == netdevs, nic
    for nic, members in exp.bond_members.items():
        assert topo.nic(nic).bond_members == members, nic
    for nic, numa in exp.numa.items():
        assert topo.nic(nic).numa_node == numa, nic
    assert len({n.name for n in topo.nics}) == len(topo.nics)
    json.dumps(to_json(topo))


def test_pci_tree_from_the_symlinks(tmp_path):
    m, _ = st.hgx_h100_ib()
    tree = st.build(tmp_path, m)
    pci = read_sysfs(tmp_path).pci
    gpu = pci["0000:1b:00.0"]
    assert (gpu.parent, gpu.root, gpu.pci_class, gpu.vendor, gpu.device, gpu.numa_node) == (
        "0000:17:01.0", "pci0000:15", "0x030200", "0x10de", "0x2330", 0)
    assert pci["0000:17:01.0"].parent == "0000:16:00.0"
    assert pci["0000:16:00.0"].parent == "0000:15:01.0"
    assert pci["0000:15:01.0"].parent is None and pci["0000:15:01.0"].root == "pci0000:15"
    assert pci["0000:00:00.0"].parent is None and pci["0000:00:00.0"].root == "pci0000:00"
    assert all(n.weight == 1 for n in pci.values())
    assert len(pci) == len(tree.pci)
    # the path types nvidia-smi prints for this machine
    assert path_type(pci, "0000:1b:00.0", "0000:18:00.0") == "PIX"
    assert path_type(pci, "0000:1b:00.0", "0000:40:00.0") == "NODE"
    assert path_type(pci, "0000:1b:00.0", "0000:9a:00.0") == "SYS"
    assert path_type(pci, "0000:1b:00.0", "0000:19:00.0") == "PIX"  # the NVMe drive in the same switch


def test_unknown_numa_node_is_none(tmp_path):
    st.build(tmp_path, st.no_gpu_no_rdma())
    assert all(n.numa_node is None for n in read_sysfs(tmp_path).pci.values())


def test_gid_table_of_a_roce_bond(tmp_path):
    m, _ = st.roce_bonds()
    st.build(tmp_path, m)
    topo = read_sysfs(tmp_path)
    gids = topo.nic("mlx5_bond_0").port(1).gids
    assert [(g.index, g.type, g.netdev) for g in gids] == [
        (0, "IB/RoCE v1", "bond0"), (1, "RoCE v2", "bond0"), (2, "IB/RoCE v1", "bond0"), (3, "RoCE v2", "bond0")]
    assert gids[3].gid == "0000:0000:0000:0000:0000:ffff:0a00:0001"  # ::ffff:10.0.0.1
    # the bond's second function has a netdev but no RDMA device: covered by the bond
    assert topo.nic("0000:15:00.1") is None
    assert {n.kind for n in topo.nics} == {"rdma", "ethernet"}


def test_infiniband_gids_have_no_netdev(tmp_path):
    m, _ = st.hgx_h100_ib()
    st.build(tmp_path, m)
    gids = read_sysfs(tmp_path).nic("mlx5_0").port(1).gids
    assert len(gids) == 1 and gids[0].type == "IB/RoCE v1" and gids[0].netdev is None
    assert gids[0].gid.startswith("fe80:")


def test_no_gpu_no_rdma_is_empty_but_valid(tmp_path):
    st.build(tmp_path, st.no_gpu_no_rdma())
    topo = analyse(read_sysfs(tmp_path))
    d = to_json(topo)
    json.dumps(d)
    assert (d["gpus"], d["nics"], d["rails"], d["warnings"]) == ([], [], [], [])
    assert set(topo.pci) == {"0000:00:00.0", "0000:00:01.0", "0000:01:00.0"}


def test_plain_ethernet_nic_is_named_by_bus_id(tmp_path):
    st.build(tmp_path, st.plain_ethernet())
    topo = analyse(read_sysfs(tmp_path))
    assert [(n.name, n.pci_bus_id, n.kind, n.netdevs, n.ports) for n in topo.nics] == [
        ("0000:00:03.0", "0000:00:03.0", "ethernet", ["eth0"], [])]
    assert topo.nics[0].role == "front-end" and topo.nics[0].rail is None
    assert topo.warnings == []


def test_a_root_without_sysfs_warns(tmp_path):
    d = doc(tmp_path)
    assert (d["gpus"], d["nics"]) == ([], [])
    assert d["warnings"] == ["/sys/bus/pci/devices: missing", "/sys/class/net: missing"]
    assert doc(tmp_path / "nonexistent")["warnings"] == ["/sys/bus/pci/devices: missing", "/sys/class/net: missing"]


# --------------------------------------------------------------------------- malformed trees


@pytest.fixture
def hgx(tmp_path):
    m, _ = st.hgx_h100_ib()
    return st.build(tmp_path / "root", m)


def read(tree):
    topo = analyse(read_sysfs(tree.root))
    json.dumps(to_json(topo))
    return topo


def test_port_without_state_file(hgx):
    hgx.remove(f"{hgx.rdma['mlx5_0']}/ports/1/state")
    topo = read(hgx)
    assert topo.warnings == ["/sys/class/infiniband/mlx5_0/ports/1/state: missing"]
    p = topo.nic("mlx5_0").port(1)
    assert (p.state, p.phys_state, p.rate_gbps) == ("UNKNOWN", "LinkUp", 400.0)
    assert topo.nic("mlx5_0").role == "compute" and topo.nic("mlx5_0").rail == 0


def test_empty_port_directory(hgx):
    for f in ("state", "phys_state", "rate", "link_layer", "gids"):
        hgx.remove(f"{hgx.rdma['mlx5_3']}/ports/1/{f}")
    topo = read(hgx)
    base = "/sys/class/infiniband/mlx5_3/ports/1"
    assert topo.warnings == [f"{base}/state: missing", f"{base}/phys_state: missing", f"{base}/link_layer: missing"]
    p = topo.nic("mlx5_3").port(1)
    assert (p.state, p.link_layer, p.rate_gbps, p.gids, p.netdev) == ("UNKNOWN", None, None, [], "ibp64s0")


def test_garbage_values(hgx):
    r = hgx.rdma["mlx5_0"]
    hgx.write(f"{r}/ports/1/rate", "fast")
    hgx.write(f"{r}/ports/1/state", "9: BOGUS")
    hgx.write(f"{r}/ports/1/phys_state", "LinkUp")
    hgx.write(f"{r}/ports/1/link_layer", "Token Ring")
    hgx.write(f"{r}/ports/1/gids/1", "not-a-gid")
    hgx.write(f"{hgx.pci['0000:18:00.0']}/numa_node", "abc")
    hgx.write(f"{hgx.pci['0000:1b:00.0']}/class", "zzz")
    hgx.write(f"{hgx.pci['0000:43:00.0']}/vendor", b"\xff\xfe\x00garbage")
    topo = read(hgx)
    port = "/sys/class/infiniband/mlx5_0/ports/1"
    assert topo.warnings == [
        "/sys/bus/pci/devices/0000:18:00.0/numa_node: not a number: 'abc'",
        "/sys/bus/pci/devices/0000:1b:00.0/class: not a PCI class: 'zzz'",
        "/sys/bus/pci/devices/0000:43:00.0/vendor: not text (undecodable bytes)",
        f"{port}/state: not a port state: '9: BOGUS'",
        f"{port}/phys_state: not a physical state: 'LinkUp'",
        f"{port}/link_layer: not a link layer: 'Token Ring'",
        f"{port}/rate: not a rate: 'fast'",
        f"{port}/gids/1: not a GID: 'not-a-gid'",
    ]
    p = topo.nic("mlx5_0").port(1)
    assert (p.state, p.phys_state, p.link_layer, p.rate_gbps, len(p.gids)) == ("UNKNOWN", None, None, None, 1)
    assert topo.pci["0000:18:00.0"].numa_node is None
    # the GPU whose class is garbage is not recognised; the one with a garbled vendor neither
    assert topo.unclassified == ["0000:1b:00.0"]
    assert "0000:1b:00.0" not in [g.pci_bus_id for g in topo.gpus]
    assert "0000:43:00.0" not in [g.pci_bus_id for g in topo.gpus]
    assert len(topo.gpus) == 6


def test_directory_where_a_file_is_expected(hgx):
    hgx.to_dir(f"{hgx.rdma['mlx5_4']}/ports/1/rate")
    hgx.to_dir(f"{hgx.pci['0000:52:00.0']}/class")
    topo = read(hgx)
    assert topo.warnings == [
        "/sys/bus/pci/devices/0000:52:00.0/class: is a directory where a file was expected",
        "/sys/class/infiniband/mlx5_4/ports/1/rate: is a directory where a file was expected",
    ]
    assert topo.unclassified == ["0000:52:00.0"]
    assert topo.nic("mlx5_4").port(1).rate_gbps is None
    # its GPU is unreadable, but mlx5_4 sits in a switch slot like the other rails': it keeps
    # its rail number, so this host still lines up with its peers
    assert topo.nic("mlx5_4").role == "compute" and topo.nic("mlx5_4").rail == 2


def test_dangling_symlinks(hgx):
    hgx.dangle("/sys/class/infiniband/mlx5_9")
    hgx.dangle("/sys/bus/pci/devices/0000:ce:00.0")
    hgx.dangle(f"{hgx.net['ibp24s0']}/device")
    topo = read(hgx)
    gone = "../../devices/pci0000:ee/0000:ee:00.0/gone"
    assert topo.warnings == [
        f"/sys/bus/pci/devices/0000:ce:00.0: broken symlink (/sys/bus/pci/devices/0000:ce:00.0 -> {gone})",
        f"/sys/class/net/ibp24s0/device: broken symlink ({hgx.net['ibp24s0']}/device -> {gone})",
        f"/sys/class/infiniband/mlx5_9: broken symlink (/sys/class/infiniband/mlx5_9 -> {gone})",
    ]
    assert "0000:ce:00.0" not in topo.pci
    gone = topo.nic("mlx5_9")
    assert gone.vanished and gone.role == "unused" and gone.rail is None
    # ibp24s0 lost its PCI link, so mlx5_0's port has no netdev, but the NIC is intact
    assert topo.nic("mlx5_0").port(1).netdev is None and topo.nic("mlx5_0").rail == 0


def test_symlink_loop(hgx):
    os.symlink("loop", hgx.host("/sys/class/net/loop"))
    topo = read(hgx)
    assert topo.warnings == ["/sys/class/net/loop: symlink loop"]


def test_duplicate_names(hgx):
    # a second spelling of a PCI bus id
    os.symlink(os.readlink(hgx.host("/sys/bus/pci/devices/0000:1b:00.0")), hgx.host("/sys/bus/pci/devices/0000:1B:00.0"))
    # two netdevs on one port (neither a child of the other)
    path = hgx.net["ibp24s0"].replace("ibp24s0", "ibp24s0x")
    hgx.write(f"{path}/ifindex", "99")
    hgx.write(f"{path}/iflink", "99")
    hgx.write(f"{path}/dev_port", "0")
    hgx.link(f"{path}/device", hgx.pci["0000:18:00.0"])
    hgx.link("/sys/class/net/ibp24s0x", path)
    # a second RDMA device on mlx5_3's PCI function
    r3 = hgx.rdma["mlx5_3"]
    shutil.copytree(hgx.host(r3), hgx.host(r3.replace("mlx5_3", "mlx5_99")), symlinks=True)
    hgx.link("/sys/class/infiniband/mlx5_99", r3.replace("mlx5_3", "mlx5_99"))
    # a non-bus-id entry
    hgx.host("/sys/bus/pci/devices/slot7").mkdir()
    topo = read(hgx)
    assert topo.warnings == [
        ("/sys/bus/pci/devices/0000:1b:00.0: duplicate PCI device: /sys/bus/pci/devices/0000:1B:00.0 is the same "
         "bus id 0000:1b:00.0"),
        "/sys/bus/pci/devices/slot7: not a PCI bus id",
        ("/sys/class/infiniband/mlx5_0/ports/1: netdevs ibp24s0, ibp24s0x all claim this port (same PCI function "
         "0000:18:00.0 and dev_port 0); using ibp24s0"),
        "/sys/class/infiniband/mlx5_99: same PCI function 0000:40:00.0 as RDMA device mlx5_3",
    ]
    assert [g.pci_bus_id for g in topo.gpus].count("0000:1b:00.0") == 1
    assert topo.nic("mlx5_0").port(1).netdev == "ibp24s0"
    assert topo.nic("0000:18:00.0") is None  # ibp24s0x is on an RDMA device's function


def test_class_directories_of_the_wrong_type(hgx):
    hgx.remove("/sys/class/infiniband")
    hgx.write("/sys/class/infiniband", "oops")
    topo = read(hgx)
    assert topo.warnings == ["/sys/class/infiniband: is a file where a directory was expected"]
    # with no RDMA device left, every netdev on PCI is a plain NIC, named by its bus id
    assert {n.name for n in topo.nics} == {f"0000:{b}:00.0" for b in ("03", "aa", "18", "40", "4f", "5e", "9a", "c0", "ce", "dc")}
    assert all(n.kind == "ethernet" and n.role == "front-end" for n in topo.nics)


def test_every_single_corruption_reads_without_an_exception(tmp_path):
    """Each file, directory and symlink of a tree, broken one at a time in each way a file can
    be broken: never a traceback, always a JSON-able result."""
    m, _ = st.dual_port()
    root = tmp_path / "root"
    st.build(root, m)
    base = doc(root)
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        entries += [Path(dirpath) / n for n in dirnames + filenames]
    aside = tmp_path / "aside"
    changed = 0
    for target in sorted(entries):
        for mode in ("delete", "garbage", "dir", "dangle"):
            os.rename(target, aside)
            if mode == "garbage":
                target.write_bytes(b"\x00\xffgarbage: 12 Gb/sec\n")
            elif mode == "dir":
                target.mkdir()
            elif mode == "dangle":
                os.symlink("../nowhere/at/all", target)
            try:
                changed += doc(root) != base
            finally:
                if target.is_symlink() or target.is_file():
                    target.unlink()
                elif target.exists():
                    target.rmdir()
                os.rename(aside, target)
    assert doc(root) == base
    # a change nobody reads (enable, operstate, bonding/mode, ...) is silent; most are not
    assert changed > 2 * len(entries)


# --------------------------------------------------------------------------- capture


def test_capture_round_trips(machine, tmp_path):
    _, tree, _ = machine
    out = tmp_path / "captured"
    files = capture(out, tree.root)
    assert doc(out) == doc(tree.root)
    assert files == sorted(files)
    # symlinks stay symlinks, with their relative targets
    some = next(f for f in files if f.startswith("/sys/bus/pci/devices/"))
    assert os.path.islink(out / some.lstrip("/"))
    assert os.readlink(out / some.lstrip("/")) == os.readlink(tree.host(some))
    assert not os.readlink(out / some.lstrip("/")).startswith("/")
    # exactly what the reader reads: nothing it never opens
    # (node_type is read since issue 14: it tells an iWARP RNIC from a CA)
    assert not any(f.endswith(("/enable", "/operstate", "/bonding/mode")) for f in files)
    assert any(f.endswith("/node_type") for f in files)


def test_capture_round_trips_a_malformed_tree(hgx, tmp_path):
    hgx.dangle("/sys/class/infiniband/mlx5_9")
    hgx.to_dir(f"{hgx.rdma['mlx5_4']}/ports/1/rate")
    hgx.remove(f"{hgx.rdma['mlx5_0']}/ports/1/state")
    hgx.write(f"{hgx.pci['0000:1b:00.0']}/class", "zzz")
    out = tmp_path / "captured"
    capture(out, hgx.root)
    want = doc(hgx.root)
    assert len(want["warnings"]) == 4
    assert doc(out) == want


def test_capture_of_this_host_round_trips(tmp_path):
    if not os.path.isdir("/sys/bus/pci/devices"):
        pytest.skip("no sysfs here")
    out = tmp_path / "captured"
    files = capture(out)
    assert files
    assert doc(out) == doc("/")


def test_capture_refuses_a_non_empty_directory(tmp_path, hgx):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(OSError):
        capture(out, hgx.root)
    assert (out / "x").read_text() == "keep me"


# --------------------------------------------------------------------------- NVML / pyverbs logic (fake bindings)


class _NVMLError(Exception):
    pass


def fake_pynvml(buses: list[str] | None, *, lost: int | None = None) -> types.ModuleType:
    """A stand-in for nvidia-ml-py: ``buses`` None = NVML cannot start (no driver)."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError

    def init():
        if buses is None:
            raise _NVMLError("NVML Shared Library Not Found")

    def handle(i):
        if i == lost:
            raise _NVMLError("GPU is lost")
        return i

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(buses)
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=("0000" + buses[h].upper()).encode())
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"

    def numa(h):
        raise _NVMLError("Not Supported")

    m.nvmlDeviceGetNumaNodeId = numa
    return m


def test_nvml_fills_index_and_uuid_by_bus_id(hgx, monkeypatch):
    buses = ["0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0",
             "0000:9d:00.0", "0000:c3:00.0", "0000:d1:00.0"]  # 0000:df:00.0 fell off the bus
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(buses))
    gpus, warnings = live.read_nvml()
    assert warnings == [] and [g.pci_bus_id for g in gpus] == buses and gpus[0].name == "NVIDIA H100 80GB HBM3"
    topo = analyse(live.discover(hgx.root, use_netlink=False, use_nvml=True, use_pyverbs=False))
    assert [(g.index, g.pci_bus_id) for g in topo.gpus] == [*enumerate(buses), (None, "0000:df:00.0")]
    assert topo.gpus[0].uuid == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    assert topo.gpus[0].numa_node == 0  # from sysfs; this NVML does not know it
    assert topo.warnings == [("nvml: GPU 0000:df:00.0 is in sysfs but NVML does not list it "
                              "(no driver bound, or fallen off the bus?)")]
    assert topo.sources[1:] == ["nvml"]
    assert {n.name: n.rail for n in topo.nics if n.rail is not None}["mlx5_10"] == 7


def test_nvml_without_driver_or_module_is_one_info_warning(hgx, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    assert live.read_nvml() == ([], [("nvml: not used (NVML Shared Library Not Found: no NVIDIA driver here?); "
                                      "GPU indexes and UUIDs are unknown")])
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    gpus, warnings = live.read_nvml()
    assert gpus == [] and len(warnings) == 1 and "not installed" in warnings[0]
    topo = live.discover(hgx.root, use_netlink=False, use_nvml=True, use_pyverbs=False)
    assert len(topo.gpus) == 8 and topo.warnings == warnings


def test_nvml_lost_gpu_is_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(["0000:1b:00.0", "0000:43:00.0"], lost=1))
    gpus, warnings = live.read_nvml()
    assert [(g.index, g.pci_bus_id) for g in gpus] == [(0, "0000:1b:00.0"), (1, None)]
    assert warnings == ["nvml: GPU 1: GPU is lost"]


def fake_pyverbs(devices: list[str] | Exception, ports: dict[str, list[dict]] | None = None) -> dict:
    pkg = types.ModuleType("pyverbs")
    dev = types.ModuleType("pyverbs.device")

    def get_device_list():
        if isinstance(devices, Exception):
            raise devices
        return [types.SimpleNamespace(name=d.encode()) for d in devices]

    class Context:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            if self.name not in (ports or {}):
                raise RuntimeError("Failed to open device")
            return self

        def __exit__(self, *a):
            return False

        def query_device(self):
            return types.SimpleNamespace(phys_port_cnt=len(ports[self.name]))

        def query_port(self, n):
            return types.SimpleNamespace(**ports[self.name][n - 1])

    dev.get_device_list, dev.Context = get_device_list, Context
    pkg.device = dev
    return {"pyverbs": pkg, "pyverbs.device": dev}


def test_pyverbs_ports(monkeypatch, tmp_path):
    up = {"state": 4, "phys_state": 5, "link_layer": 1, "active_width": 2, "active_speed": 128}
    disabled = {"state": 1, "phys_state": 3, "link_layer": 2, "active_width": 0, "active_speed": 0}
    for k, v in fake_pyverbs(["mlx5_0", "mlx5_1"], {"mlx5_0": [up, disabled]}).items():
        monkeypatch.setitem(sys.modules, k, v)
    nics, warnings = live.read_pyverbs()
    assert [n.name for n in nics] == ["mlx5_0", "mlx5_1"]
    assert [p.to_json() for p in nics[0].ports] == [
        {"port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "link_layer": "InfiniBand", "rate_gbps": 400.0, "netdev": None},
        {"port": 2, "state": "DISABLED", "phys_state": "Disabled", "link_layer": "Ethernet", "rate_gbps": None,
         "netdev": None}]
    assert warnings == ["pyverbs: mlx5_1: RuntimeError: Failed to open device"]
    # sysfs knows better where it could read; pyverbs fills in a port whose state file is missing
    m, _ = st.hgx_h100_ib()
    tree = st.build(tmp_path / "r", m)
    tree.remove(f"{tree.rdma['mlx5_0']}/ports/1/state")
    topo = live.discover(tree.root, use_netlink=False, use_nvml=False, use_pyverbs=True)
    assert topo.nic("mlx5_0").port(1).state == "ACTIVE" and topo.nic("mlx5_0").pci_bus_id == "0000:18:00.0"


def test_pyverbs_without_devices_is_empty(monkeypatch):
    for devices in (RuntimeError("no RDMA devices"), []):
        for k, v in fake_pyverbs(devices).items():
            monkeypatch.setitem(sys.modules, k, v)
        assert live.read_pyverbs() == ([], [])
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    assert live.read_pyverbs() == ([], [])


def test_discover_of_a_tree_without_live_readers_is_read_sysfs(machine):
    _, tree, _ = machine
    a = to_json(analyse(live.discover(tree.root, use_netlink=False, use_nvml=False)))
    b = to_json(analyse(read_sysfs(tree.root)))
    assert a == b


def test_a_reader_bug_costs_one_part_not_the_reading(hgx, monkeypatch):
    import topology.sysfs as sysfs_mod

    def boom(*a):
        raise KeyError("bug")

    monkeypatch.setattr(sysfs_mod, "_read_rdma", boom)
    topo = read_sysfs(hgx.root)
    assert len(topo.gpus) == 8 and topo.pci
    assert topo.warnings == [f"{Path(hgx.root).resolve()}: reading RDMA devices failed: KeyError: 'bug'"]


def test_discover_survives_failing_live_readers(hgx, monkeypatch):
    def boom():
        raise RuntimeError("netlink socket refused")

    monkeypatch.setattr(live, "read_netlink", boom)
    monkeypatch.setattr(live, "read_nvml", boom)
    topo = live.discover(hgx.root, use_netlink=True, use_nvml=True, use_pyverbs=False)
    assert len(topo.gpus) == 8 and topo.links == {}
    assert topo.warnings == ["nvml: failed: RuntimeError: netlink socket refused",
                             "netlink: cannot read links and addresses (RuntimeError: netlink socket refused)"]


def test_a_gpu_missing_from_sysfs_keeps_its_nics_rail(hgx):
    hgx.remove("/sys/bus/pci/devices/0000:52:00.0")  # GPU 2 fell off the bus: gone from sysfs
    hgx.remove(hgx.pci["0000:52:00.0"])
    topo = read(hgx)
    assert topo.nic("mlx5_4").role == "compute"
    assert {n.name: n.rail for n in topo.nics if n.rail is not None} == {
        "mlx5_0": 0, "mlx5_3": 1, "mlx5_4": 2, "mlx5_5": 3, "mlx5_6": 4, "mlx5_8": 5, "mlx5_9": 6, "mlx5_10": 7}


def test_node_type_gives_the_transport_and_an_rnic_is_no_rail(tmp_path):
    # drivers/infiniband/core/sysfs.c node_type_show: "1: CA", "4: RNIC" (iWARP), ...
    m, _ = st.hgx_h100_ib()
    t = st.build(tmp_path, m)
    names = sorted(t.rdma)
    t.write(f"{t.rdma[names[0]]}/node_type", "4: RNIC")
    t.write(f"{t.rdma[names[1]]}/node_type", "9: sideways")
    topo = analyse(read_sysfs(tmp_path))
    iw, odd, ca = topo.nic(names[0]), topo.nic(names[1]), topo.nic(names[2])
    assert (iw.transport, iw.role, iw.rail) == ("iWARP", "front-end", None)
    assert odd.transport is None and any("node_type: not a node type" in w for w in topo.warnings)
    assert ca.transport == "InfiniBand" and ca.role == "compute"
