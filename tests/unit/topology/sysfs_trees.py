"""Fake sysfs trees shaped like the kernel's, built from a compact Python spec.

A :class:`Machine` names PCI host bridges (each with its NUMA node and a nested dict of
PCI functions: bus id -> :class:`Dev`), RDMA devices (:class:`Rdma`, with :class:`IbPort`
ports) and netdevs (:class:`Net`).  :func:`build` writes real directories, files and
symlinks under a root, as the kernel lays them out::

    /sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/.../0000:18:00.0/{class,vendor,device,numa_node}
    /sys/bus/pci/devices/0000:18:00.0 -> ../../../devices/pci0000:15/.../0000:18:00.0
    /sys/devices/.../0000:18:00.0/infiniband/mlx5_0/{device -> ../../../0000:18:00.0, ports/1/...}
    /sys/class/infiniband/mlx5_0 -> ../../devices/.../0000:18:00.0/infiniband/mlx5_0
    /sys/devices/.../0000:18:00.0/net/ibp24s0/{device -> ../../../0000:18:00.0, dev_port, ...}
    /sys/devices/virtual/net/bond0/bonding/slaves
    /sys/class/net/ibp24s0 -> ../../devices/.../net/ibp24s0

The machines below are modelled on the corpus (``tests/fixtures/corpus/nvsmi_topo`` and
``nccl_topo``); each comes with what a correct reading gives (:class:`Expect`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# (class, vendor, device)
HOST_BRIDGE_FN = ("0x060000", "0x8086", "0x09a2")
ROOT_PORT = ("0x060400", "0x8086", "0x347a")
PEX_SWITCH = ("0x060400", "0x1000", "0xc010")   # Broadcom PEX89000 port (USP or DSP)
H100 = ("0x030200", "0x10de", "0x2330")
A100 = ("0x030200", "0x10de", "0x20b2")
A800 = ("0x030200", "0x10de", "0x20f3")
V100 = ("0x030200", "0x10de", "0x1db5")
CX7 = ("0x020700", "0x15b3", "0x1021")         # ConnectX-7, InfiniBand class
CX7_ETH = ("0x020000", "0x15b3", "0x1021")
CX6 = ("0x020700", "0x15b3", "0x101b")
CX6DX = ("0x020000", "0x15b3", "0x101d")
CX3 = ("0x028000", "0x15b3", "0x1007")         # ConnectX-3 Pro (mlx4), dual port VPI
I210 = ("0x020000", "0x8086", "0x1533")
X710 = ("0x020000", "0x8086", "0x1572")
NVME = ("0x010802", "0x144d", "0xa80a")
VIRTIO_NET = ("0x020000", "0x1af4", "0x1041")

IB_STATES = {"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN", "INIT": "2: INIT", "ARMED": "3: ARMED"}
PHYS = {"LinkUp": "5: LinkUp", "Polling": "2: Polling", "Disabled": "3: Disabled", "Sleep": "1: Sleep"}
ZERO_GID = ":".join(["0000"] * 8)


# ---------------------------------------------------------------------- the spec


@dataclass
class Dev:
    """A PCI function; ``kids`` (bus id -> Dev) make it a bridge."""

    ids: tuple[str, str, str]
    kids: dict[str, Dev] = field(default_factory=dict)


def bridge(kids: dict[str, Dev], ids: tuple[str, str, str] = PEX_SWITCH) -> Dev:
    return Dev(ids, kids)


@dataclass
class IbPort:
    state: str = "ACTIVE"           # key of IB_STATES, or the raw file text when it contains ':'
    phys: str = "LinkUp"            # key of PHYS, or raw text
    rate: str | None = "400 Gb/sec (4X NDR)"
    link_layer: str = "InfiniBand"
    #: GID table: index -> (gid, type, ndev or None); slots up to ``gid_slots`` are zero
    gids: dict[int, tuple[str, str, str | None]] = field(default_factory=dict)
    gid_slots: int = 4


@dataclass
class Rdma:
    pci: str | None
    ports: dict[int, IbPort] = field(default_factory=lambda: {1: IbPort()})


@dataclass
class Net:
    pci: str | None = None          # None: a virtual netdev (/sys/devices/virtual/net)
    dev_port: int = 0
    slaves: list[str] | None = None  # a bond master
    parent: str | None = None       # a child interface (iflink = the parent's ifindex)
    operstate: str = "up"


@dataclass
class Machine:
    #: host bridge ("pci0000:15") -> (NUMA node or None, {bus id: Dev})
    hosts: dict[str, tuple[int | None, dict[str, Dev]]]
    rdma: dict[str, Rdma] = field(default_factory=dict)
    net: dict[str, Net] = field(default_factory=dict)


@dataclass
class Expect:
    """What a correct read_sysfs + analyse gives."""

    gpus: list[str]                                  # bus ids, in order
    nearest: dict[str, list[str]]                    # GPU bus id -> nearest compute NICs
    nearest_path: dict[str, str | None]              # GPU bus id -> path type
    roles: dict[str, str]                            # NIC name -> role
    rails: dict[str, int]                            # NIC name -> rail
    ports: dict[str, dict] = field(default_factory=dict)   # "nic/port" -> subset of Port.to_json()
    netdevs: dict[str, list[str]] = field(default_factory=dict)
    bond_members: dict[str, list[str]] = field(default_factory=dict)
    numa: dict[str, int | None] = field(default_factory=dict)  # NIC name -> NUMA node


# ---------------------------------------------------------------------- the builder


class Tree:
    """A built tree: the root and where each thing went (in-tree paths)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.pci: dict[str, str] = {}
        self.rdma: dict[str, str] = {}
        self.net: dict[str, str] = {}

    def host(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def write(self, path: str, text: str | bytes) -> None:
        p = self.host(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text + "\n")

    def link(self, path: str, target_in_tree: str) -> None:
        """A symlink at ``path`` to ``target_in_tree``, relative, as the kernel makes them."""
        p = self.host(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target_in_tree, os.path.dirname(path)), p)

    def remove(self, path: str) -> None:
        p = self.host(path)
        if p.is_symlink() or p.is_file():
            p.unlink()
        else:
            shutil.rmtree(p)

    def to_dir(self, path: str) -> None:
        """Replace a file by a directory (an unreadable file, as far as a reader can tell:
        chmod 000 does not stop root)."""
        self.remove(path)
        self.host(path).mkdir()
        (self.host(path) / "junk").write_text("x\n")

    def dangle(self, path: str) -> None:
        """Replace whatever is at ``path`` by a symlink to nowhere."""
        self.remove(path)
        os.symlink("../../devices/pci0000:ee/0000:ee:00.0/gone", self.host(path))


def build(root: str | Path, m: Machine) -> Tree:
    t = Tree(Path(root))
    t.host("/sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
    t.host("/sys/class/net").mkdir(parents=True, exist_ok=True)

    def add(parent_path: str, bus: str, d: Dev, numa: int | None) -> None:
        path = f"{parent_path}/{bus}"
        t.pci[bus] = path
        cls, vendor, device = d.ids
        t.write(f"{path}/class", cls)
        t.write(f"{path}/vendor", vendor)
        t.write(f"{path}/device", device)
        t.write(f"{path}/numa_node", str(-1 if numa is None else numa))
        t.write(f"{path}/enable", "1")
        t.link(f"/sys/bus/pci/devices/{bus}", path)
        for kb, kd in d.kids.items():
            add(path, kb, kd, numa)

    for hb, (numa, kids) in m.hosts.items():
        t.host(f"/sys/devices/{hb}").mkdir(parents=True, exist_ok=True)
        for bus, d in kids.items():
            add(f"/sys/devices/{hb}", bus, d, numa)

    ifindex: dict[str, int] = {}
    for i, name in enumerate(m.net, start=2):
        ifindex[name] = i
    for name, n in m.net.items():
        base = t.pci[n.pci] if n.pci else "/sys/devices/virtual"
        path = f"{base}/net/{name}"
        t.net[name] = path
        t.write(f"{path}/ifindex", str(ifindex[name]))
        t.write(f"{path}/iflink", str(ifindex[n.parent] if n.parent else ifindex[name]))
        t.write(f"{path}/dev_port", str(n.dev_port))
        t.write(f"{path}/operstate", n.operstate)
        t.write(f"{path}/type", "32" if name.startswith("ib") else "1")
        if n.pci:
            t.link(f"{path}/device", t.pci[n.pci])
        if n.slaves is not None:
            t.write(f"{path}/bonding/slaves", " ".join(n.slaves))
            t.write(f"{path}/bonding/mode", "802.3ad 4")
        t.link(f"/sys/class/net/{name}", path)

    for name, r in m.rdma.items():
        base = t.pci[r.pci] if r.pci else "/sys/devices/virtual"
        path = f"{base}/infiniband/{name}"
        t.rdma[name] = path
        t.write(f"{path}/node_type", "1: CA")
        if r.pci:
            t.link(f"{path}/device", t.pci[r.pci])
        for num, p in r.ports.items():
            pp = f"{path}/ports/{num}"
            t.write(f"{pp}/state", p.state if ":" in p.state else IB_STATES[p.state])
            t.write(f"{pp}/phys_state", p.phys if ":" in p.phys else PHYS[p.phys])
            if p.rate is not None:
                t.write(f"{pp}/rate", p.rate)
            t.write(f"{pp}/link_layer", p.link_layer)
            for i in range(max([p.gid_slots, *[k + 1 for k in p.gids]])):
                gid, typ, ndev = p.gids.get(i, (ZERO_GID, None, None))
                t.write(f"{pp}/gids/{i}", gid)
                if typ is not None:
                    t.write(f"{pp}/gid_attrs/types/{i}", typ)
                if ndev is not None:
                    t.write(f"{pp}/gid_attrs/ndevs/{i}", ndev)
        t.link(f"/sys/class/infiniband/{name}", path)
    return t


# ---------------------------------------------------------------------- GIDs


def ib_gids(guid_tail: int) -> dict[int, tuple[str, str, None]]:
    """An InfiniBand port's GID table: the link-local GID from the port GUID, no netdev."""
    return {0: (f"fe80:0000:0000:0000:a088:c203:00{guid_tail >> 8 & 0xff:02x}:{guid_tail & 0xffff:04x}", "IB/RoCE v1", None)}


def roce_gids(mac_tail: int, ipv4: tuple[int, int, int, int] | None, ndev: str) -> dict[int, tuple[str, str, str]]:
    """A RoCE port's GID table: link-local (v1, v2), then the IPv4-mapped address (v1, v2)."""
    ll = f"fe80:0000:0000:0000:0e42:a1ff:fe{mac_tail >> 16 & 0xff:02x}:{mac_tail & 0xffff:04x}"
    out = {0: (ll, "IB/RoCE v1", ndev), 1: (ll, "RoCE v2", ndev)}
    if ipv4:
        a, b, c, d = ipv4
        v4 = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
        out.update({2: (v4, "IB/RoCE v1", ndev), 3: (v4, "RoCE v2", ndev)})
    return out


def _b(bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"0000:{bus:02x}:{dev:02x}.{fn}"


# ---------------------------------------------------------------------- the machines


def hgx_h100_ib() -> tuple[Machine, Expect]:
    """(a) 8x H100 HGX, one 400G InfiniBand NIC per GPU, each pair under its own PCIe switch
    (PIX), each switch under its own host bridge (NODE within a socket, SYS across), as in
    ``nvsmi_topo/hgx_h100_8gpu_8nic_1to1_pix`` with the RDMA names and netdevs of
    ``ib_tools/dgxh100_like_ibdev2netdev_8ib_3eth``; plus a ConnectX-7 in Ethernet mode
    (mlx5_7, enp170s0np0) and an onboard i210 (eno1) as front-end NICs."""
    pairs = [(0x18, 0x1b, "mlx5_0", 0), (0x40, 0x43, "mlx5_3", 0), (0x4f, 0x52, "mlx5_4", 0), (0x5e, 0x61, "mlx5_5", 0),
             (0x9a, 0x9d, "mlx5_6", 1), (0xc0, 0xc3, "mlx5_8", 1), (0xce, 0xd1, "mlx5_9", 1), (0xdc, 0xdf, "mlx5_10", 1)]
    hosts: dict[str, tuple[int | None, dict[str, Dev]]] = {
        "pci0000:00": (0, {_b(0): Dev(HOST_BRIDGE_FN), _b(0, 0x1c): bridge({_b(3): Dev(I210)}, ROOT_PORT)}),
        "pci0000:a7": (1, {_b(0xa7, 1): bridge({_b(0xaa): Dev(CX7_ETH)}, ROOT_PORT)}),
    }
    rdma: dict[str, Rdma] = {}
    net: dict[str, Net] = {"lo": Net(operstate="unknown"), "eno1": Net(_b(3))}
    for k, (n, g, name, numa) in enumerate(pairs):
        b = n - 3
        hosts[f"pci0000:{b:02x}"] = (numa, {_b(b, 1): bridge({_b(b + 1): bridge({
            _b(b + 2, 0): bridge({_b(n): Dev(CX7)}),
            _b(b + 2, 1): bridge({_b(g): Dev(H100)}),
            _b(b + 2, 2): bridge({_b(n + 1): Dev(NVME)}),
        })}, ROOT_PORT)})
        rdma[name] = Rdma(_b(n), {1: IbPort(gids=ib_gids(0x100 + k))})
        net[f"ibp{n}s0"] = Net(_b(n))
    rdma["mlx5_7"] = Rdma(_b(0xaa), {1: IbPort(rate="100 Gb/sec (2X HDR)", link_layer="Ethernet", gid_slots=8,
                                             gids=roce_gids(0x0a0001, (192, 0, 2, 10), "enp170s0np0"))})
    net["enp170s0np0"] = Net(_b(0xaa))

    gpus = [_b(g) for _, g, _, _ in pairs]
    names = [name for _, _, name, _ in pairs]
    exp = Expect(
        gpus=gpus,
        nearest={gb: [nm] for gb, nm in zip(gpus, names)},
        nearest_path={gb: "PIX" for gb in gpus},
        roles={**{nm: "compute" for nm in names}, "mlx5_7": "front-end", "0000:03:00.0": "front-end"},
        rails={nm: k for k, nm in enumerate(names)},
        ports={
            "mlx5_0/1": {"state": "ACTIVE", "phys_state": "LinkUp", "link_layer": "InfiniBand", "rate_gbps": 400.0,
                         "netdev": "ibp24s0"},
            "mlx5_10/1": {"state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 400.0, "netdev": "ibp220s0"},
            "mlx5_7/1": {"state": "ACTIVE", "link_layer": "Ethernet", "rate_gbps": 100.0, "netdev": "enp170s0np0"},
        },
        netdevs={"mlx5_0": ["ibp24s0"], "mlx5_7": ["enp170s0np0"], "0000:03:00.0": ["eno1"]},
        numa={"mlx5_0": 0, "mlx5_6": 1, "mlx5_7": 1, "0000:03:00.0": 0},
    )
    return Machine(hosts, rdma, net), exp


def dgx_a100_pxb_storage() -> tuple[Machine, Expect]:
    """(b) 8x A100 in four groups, as ``nvsmi_topo/dgxa100_style_8xA100_10nic_amd_8numa``: two
    GPUs behind a second-level switch and two HDR NICs on the first-level switch (PXB to both
    GPUs), one group per NUMA node (3, 1, 7, 5); two storage NICs (mlx5_8, mlx5_9: the two
    functions of one card) straight under a root port on NUMA node 2, which has no GPU, so SYS
    to every GPU."""
    groups = [(0x00, 3), (0x40, 1), (0x80, 7), (0xb0, 5)]
    hosts: dict[str, tuple[int | None, dict[str, Dev]]] = {}
    rdma: dict[str, Rdma] = {}
    net: dict[str, Net] = {"lo": Net(operstate="unknown")}
    gpus: list[str] = []
    nearest: dict[str, list[str]] = {}
    for k, (b, numa) in enumerate(groups):
        ga, gb, na, nb = b + 5, b + 6, b + 7, b + 8
        kids = {_b(b, 1, 1): bridge({_b(b + 1): bridge({
            _b(b + 2, 0): bridge({_b(b + 3): bridge({
                _b(b + 4, 0): bridge({_b(ga): Dev(A100)}),
                _b(b + 4, 8): bridge({_b(gb): Dev(A100)}),
            })}),
            _b(b + 2, 8): bridge({_b(na): Dev(CX6)}),
            _b(b + 2, 0x10): bridge({_b(nb): Dev(CX6)}),
        })}, ROOT_PORT)}
        if b == 0:
            kids[_b(0)] = Dev(HOST_BRIDGE_FN)
        hosts[f"pci0000:{b:02x}"] = (numa, kids)
        pair = [f"mlx5_{2 * k}", f"mlx5_{2 * k + 1}"]
        for bus, name in zip((na, nb), pair):
            rdma[name] = Rdma(_b(bus), {1: IbPort(rate="200 Gb/sec (4X HDR)", gids=ib_gids(bus))})
            net[f"ibp{bus}s0"] = Net(_b(bus))
        gpus += [_b(ga), _b(gb)]
        nearest[_b(ga)] = nearest[_b(gb)] = pair
    hosts["pci0000:e0"] = (2, {_b(0xe0, 3, 1): bridge({_b(0xe1, 0, 0): Dev(CX6), _b(0xe1, 0, 1): Dev(CX6)}, ROOT_PORT)})
    for fn, name in ((0, "mlx5_8"), (1, "mlx5_9")):
        rdma[name] = Rdma(_b(0xe1, 0, fn), {1: IbPort(rate="200 Gb/sec (4X HDR)", gids=ib_gids(0xe100 + fn))})
        net[f"ibp225s0f{fn}"] = Net(_b(0xe1, 0, fn))
    compute = [f"mlx5_{i}" for i in range(8)]
    exp = Expect(
        gpus=gpus,
        nearest=nearest,
        nearest_path={g: "PXB" for g in gpus},
        roles={**{n: "compute" for n in compute}, "mlx5_8": "storage", "mlx5_9": "storage"},
        rails={n: i for i, n in enumerate(compute)},
        ports={"mlx5_8/1": {"state": "ACTIVE", "link_layer": "InfiniBand", "rate_gbps": 200.0, "netdev": "ibp225s0f0"},
               "mlx5_9/1": {"netdev": "ibp225s0f1"}},
        numa={"mlx5_0": 3, "mlx5_2": 1, "mlx5_8": 2, "mlx5_9": 2},
    )
    return Machine(hosts, rdma, net), exp


def roce_bonds() -> tuple[Machine, Expect]:
    """(c) 8x A800 RoCE node as ``nvsmi_topo/a800_8gpu_8bond_2per_gpu_pair_pix`` (and the
    mlx5_bond devices of ``nccl_topo/alibaba_8xA100_mlx5bond_topo.xml``): four switches, each
    with two GPUs and two dual-port ConnectX-6 Dx cards; each card's two ports are bonded
    (bondN over enpXs0f0np0 + enpXs0f1np1) and RDMA sees the bond as mlx5_bond_N (Ethernet
    link layer, RoCE v1 and v2 GIDs on bondN).  An Intel X710 (eno1) is the front-end NIC."""
    switches = [(0x10, 0), (0x30, 0), (0x90, 1), (0xb0, 1)]
    hosts: dict[str, tuple[int | None, dict[str, Dev]]] = {
        "pci0000:00": (0, {_b(0): Dev(HOST_BRIDGE_FN), _b(0, 0x1c): bridge({_b(5): Dev(X710)}, ROOT_PORT)})}
    rdma: dict[str, Rdma] = {}
    net: dict[str, Net] = {"lo": Net(operstate="unknown"), "eno1": Net(_b(5))}
    gpus: list[str] = []
    nearest: dict[str, list[str]] = {}
    members: dict[str, list[str]] = {}
    for k, (b, numa) in enumerate(switches):
        g0, g1, c0, c1 = b + 3, b + 4, b + 5, b + 6
        hosts[f"pci0000:{b:02x}"] = (numa, {_b(b, 1): bridge({_b(b + 1): bridge({
            _b(b + 2, 0): bridge({_b(g0): Dev(A800)}),
            _b(b + 2, 1): bridge({_b(g1): Dev(A800)}),
            _b(b + 2, 2): bridge({_b(c0, 0, 0): Dev(CX6DX), _b(c0, 0, 1): Dev(CX6DX)}),
            _b(b + 2, 3): bridge({_b(c1, 0, 0): Dev(CX6DX), _b(c1, 0, 1): Dev(CX6DX)}),
        })}, ROOT_PORT)})
        pair = []
        for j, card in enumerate((c0, c1)):
            i = 2 * k + j
            bond, name = f"bond{i}", f"mlx5_bond_{i}"
            m0, m1 = f"enp{card}s0f0np0", f"enp{card}s0f1np1"
            net[m0] = Net(_b(card, 0, 0))
            net[m1] = Net(_b(card, 0, 1), dev_port=0)
            net[bond] = Net(None, slaves=[m0, m1])
            rdma[name] = Rdma(_b(card, 0, 0), {1: IbPort(rate="200 Gb/sec (4X HDR)", link_layer="Ethernet", gid_slots=6,
                                                         gids=roce_gids(card << 8, (10, i, 0, 1), bond))})
            members[name] = [m0, m1]
            pair.append(name)
        gpus += [_b(g0), _b(g1)]
        nearest[_b(g0)] = nearest[_b(g1)] = pair
    names = [f"mlx5_bond_{i}" for i in range(8)]
    exp = Expect(
        gpus=gpus,
        nearest=nearest,
        nearest_path={g: "PIX" for g in gpus},
        roles={**{n: "compute" for n in names}, "0000:05:00.0": "front-end"},
        rails={n: i for i, n in enumerate(names)},
        ports={"mlx5_bond_0/1": {"state": "ACTIVE", "phys_state": "LinkUp", "link_layer": "Ethernet", "rate_gbps": 200.0,
                                 "netdev": "bond0"},
               "mlx5_bond_7/1": {"netdev": "bond7"}},
        netdevs={**{n: [f"bond{i}"] for i, n in enumerate(names)}, "0000:05:00.0": ["eno1"]},
        bond_members=members,
        numa={"mlx5_bond_0": 0, "mlx5_bond_5": 1, "0000:05:00.0": 0},
    )
    return Machine(hosts, rdma, net), exp


def dual_port() -> tuple[Machine, Expect]:
    """(d) 4x V100 and two dual-port ConnectX-3 Pro (mlx4) HCAs, one per PCIe switch: port 1
    ACTIVE on InfiniBand, port 2 DOWN with physical state Disabled (mlx4_0: InfiniBand, netdev
    ib1 by dev_port; mlx4_1: VPI port in Ethernet mode, netdev ens5d1 from its GIDs, no rate:
    a port without width has none).  ib0 has an IPoIB P_Key child ib0.8001 on the same port."""
    hosts: dict[str, tuple[int | None, dict[str, Dev]]] = {}
    for b, numa in ((0x10, 0), (0x90, 1)):
        hosts[f"pci0000:{b:02x}"] = (numa, {_b(b, 1): bridge({_b(b + 1): bridge({
            _b(b + 2, 0): bridge({_b(b + 3): Dev(V100)}),
            _b(b + 2, 1): bridge({_b(b + 4): Dev(V100)}),
            _b(b + 2, 2): bridge({_b(b + 5): Dev(CX3)}),
        })}, ROOT_PORT)})
    rdma = {
        "mlx4_0": Rdma(_b(0x15), {1: IbPort(rate="56 Gb/sec (4X FDR)", gids=ib_gids(0x15)),
                                  2: IbPort(state="DOWN", phys="Disabled", rate="10 Gb/sec (4X SDR)", gids=ib_gids(0x16))}),
        "mlx4_1": Rdma(_b(0x95), {1: IbPort(rate="56 Gb/sec (4X FDR)", gids=ib_gids(0x95)),
                                  2: IbPort(state="DOWN", phys="Disabled", rate=None, link_layer="Ethernet",
                                            gids=roce_gids(0x950002, None, "ens5d1"))}),
    }
    net = {
        "lo": Net(operstate="unknown"),
        "ib0": Net(_b(0x15), dev_port=0),
        "ib0.8001": Net(_b(0x15), dev_port=0, parent="ib0"),
        "ib1": Net(_b(0x15), dev_port=1, operstate="down"),
        "ib2": Net(_b(0x95), dev_port=0),
        "ens5d1": Net(_b(0x95), dev_port=1, operstate="down"),
    }
    gpus = [_b(0x13), _b(0x14), _b(0x93), _b(0x94)]
    exp = Expect(
        gpus=gpus,
        nearest={_b(0x13): ["mlx4_0"], _b(0x14): ["mlx4_0"], _b(0x93): ["mlx4_1"], _b(0x94): ["mlx4_1"]},
        nearest_path={g: "PIX" for g in gpus},
        roles={"mlx4_0": "compute", "mlx4_1": "compute"},
        rails={"mlx4_0": 0, "mlx4_1": 1},
        ports={
            "mlx4_0/1": {"state": "ACTIVE", "phys_state": "LinkUp", "link_layer": "InfiniBand", "rate_gbps": 56.0,
                         "netdev": "ib0"},
            "mlx4_0/2": {"state": "DISABLED", "phys_state": "Disabled", "link_layer": "InfiniBand", "rate_gbps": 10.0,
                         "netdev": "ib1"},
            "mlx4_1/1": {"state": "ACTIVE", "link_layer": "InfiniBand", "netdev": "ib2"},
            "mlx4_1/2": {"state": "DISABLED", "phys_state": "Disabled", "link_layer": "Ethernet", "rate_gbps": None,
                         "netdev": "ens5d1"},
        },
        netdevs={"mlx4_0": ["ib0", "ib1"], "mlx4_1": ["ib2", "ens5d1"]},
        numa={"mlx4_0": 0, "mlx4_1": 1},
    )
    return Machine(hosts, rdma, net), exp


def no_gpu_no_rdma() -> Machine:
    """A host with an NVMe drive, loopback and a veth pair: no GPU, no RDMA, no PCI NIC."""
    return Machine(
        {"pci0000:00": (None, {_b(0): Dev(HOST_BRIDGE_FN), _b(0, 1): bridge({_b(1): Dev(NVME)}, ROOT_PORT)})},
        net={"lo": Net(operstate="unknown"), "veth0": Net(), "veth1": Net()},
    )


def plain_ethernet() -> Machine:
    """A VM like this test host: a virtio NIC (eth0) on PCI, no GPU, no RDMA."""
    return Machine({"pci0000:00": (None, {_b(0): Dev(HOST_BRIDGE_FN), _b(0, 3): Dev(VIRTIO_NET)})},
                   net={"lo": Net(operstate="unknown"), "eth0": Net(_b(0, 3))})


MACHINES = {
    "hgx_h100_ib": hgx_h100_ib,
    "dgx_a100_pxb_storage": dgx_a100_pxb_storage,
    "roce_bonds": roce_bonds,
    "dual_port": dual_port,
}
