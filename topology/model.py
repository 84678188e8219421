"""Data model of a host's fabric: GPUs, NICs (HCAs) and their ports, the PCI tree between them.

Pure data, no I/O.  Readers (sysfs, netlink, NVML) and importers (NCCL topology XML,
``nvidia-smi topo -m``, ``ibstat``, ...) each fill a :class:`Topology`; :func:`merge`
combines several for one host; :mod:`topology.affinity` derives path types, roles and rails.

Names follow the field: a NIC is named by its RDMA device (``mlx5_0``, ``mlx5_bond_1``,
``rocep1s0f1``) where known, else by its full PCI bus id (``0000:10:1b.0``).  PCI bus ids are
always in full, lower-case form ``dddd:bb:dd.f``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: nvidia-smi's path types between two PCI devices, nearest first
#: (``nvidia-smi topo -m`` legend).
PATH_TYPES = ("PIX", "PXB", "PHB", "NODE", "SYS")
#: Path types that count as "local" to a GPU (do not cross a NUMA interconnect or the CPU's
#: internal fabric): what NCCL treats as a GPU's own NICs.
LOCAL_PATHS = ("PIX", "PXB", "PHB")

#: Port states as the kernel names them (/sys/class/infiniband/*/ports/*/state), upper case.
PORT_STATES = ("ACTIVE", "DOWN", "INIT", "ARMED", "ACTIVE_DEFER", "POLLING", "DISABLED", "UNKNOWN")

_BUS_RE = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def norm_bus_id(text: str) -> str | None:
    """Full lower-case PCI bus id (``0000:1a:00.0``) from the forms tools print
    (``1A:00.0``, ``00000000:1A:00.0``, ``0000:1a:00.0``); None if it is not one."""
    m = _BUS_RE.match(text.strip())
    if not m:
        return None
    dom = int(m.group(1), 16) if m.group(1) else 0
    return f"{dom:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


@dataclass
class Gid:
    """One GID table entry of a port: index, the GID, its type (``RoCE v2``, ``IB/RoCE v1``)
    and the netdev it belongs to (RoCE)."""

    index: int
    gid: str
    type: str | None = None
    netdev: str | None = None


@dataclass
class Port:
    """One port of an HCA.

    Attributes:
        port: port number (1-based, as verbs numbers them).
        state: logical state, one of :data:`PORT_STATES`.  A DOWN port whose physical state
            is Polling or Disabled is reported with that physical state (POLLING/DISABLED).
        phys_state: physical state as printed (``LinkUp``, ``Polling``, ``Disabled``), or None.
        link_layer: ``InfiniBand`` or ``Ethernet``, or None when the source does not say.
        rate_gbps: link rate in Gb/s, or None.
        netdev: the netdev of this port (RoCE / IPoIB), or None.
    """

    port: int
    state: str = "UNKNOWN"
    phys_state: str | None = None
    link_layer: str | None = None
    rate_gbps: float | None = None
    netdev: str | None = None
    gids: list[Gid] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"port": self.port, "state": self.state, "phys_state": self.phys_state, "link_layer": self.link_layer,
                "rate_gbps": self.rate_gbps, "netdev": self.netdev}


@dataclass
class Nic:
    """A network adapter (an RDMA device, or a plain netdev's PCI function).

    ``role``/``role_reason``/``rail`` are filled by :func:`topology.affinity.analyse`.
    ``vanished`` marks a device a tool named but could not read (e.g. ibstat's ibpanic).
    """

    name: str
    pci_bus_id: str | None = None
    numa_node: int | None = None
    ports: list[Port] = field(default_factory=list)
    netdevs: list[str] = field(default_factory=list)
    bond_members: list[str] = field(default_factory=list)
    kind: str | None = None  # "rdma", "ethernet", "efa", ...
    #: the RDMA transport where a source names it: ``InfiniBand`` (IB and RoCE: verbs'
    #: IBV_TRANSPORT_IB), ``iWARP`` (ibv_devinfo ``transport: iWARP (1)``, ibstat node type
    #: ``iWARP RNIC``), ``usNIC``...; None when unknown
    transport: str | None = None
    vanished: bool = False
    role: str | None = None
    role_reason: str = ""
    rail: int | None = None

    def port(self, n: int) -> Port:
        """The port numbered ``n``, created if absent."""
        for p in self.ports:
            if p.port == n:
                return p
        p = Port(n)
        self.ports.append(p)
        self.ports.sort(key=lambda q: q.port)
        return p

    @property
    def link_layers(self) -> set[str]:
        return {p.link_layer for p in self.ports if p.link_layer}


@dataclass
class Gpu:
    """A GPU.  ``index`` is nvidia-smi's / NVML's index where known."""

    index: int | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    uuid: str | None = None
    name: str | None = None
    nearest_nics: list[str] = field(default_factory=list)
    nearest_path: str | None = None

    @property
    def key(self) -> str:
        """How expected.json and the matrix name this GPU: the bus id, else the index."""
        return self.pci_bus_id or (str(self.index) if self.index is not None else "?")


@dataclass
class PciNode:
    """One PCI function or bridge: its parent (bus id of the upstream bridge, or None at a root
    port / host bridge), its class code (``0x030200``) and NUMA node (None if unknown)."""

    bus_id: str
    parent: str | None = None
    pci_class: str | None = None
    numa_node: int | None = None
    vendor: str | None = None
    device: str | None = None
    root: str | None = None  # identifier of the root complex / host bridge it hangs off
    #: bridge levels this node stands for: 1 for a sysfs bridge or port, 2 for an NCCL
    #: topology XML <pci> switch element (upstream + downstream port in one element)
    weight: int = 1


@dataclass
class Topology:
    """Everything known about one host.

    Attributes:
        paths: explicit path types read from a tool, keyed ``(gpu key, nic name)``
            (``nvidia-smi topo -m`` gives these directly); others are computed from ``pci``.
        pci: the PCI tree, by bus id.
        unclassified: bus ids of PCI leaves whose class is unknown (e.g. skeleton XML files).
        warnings: problems met while reading, each naming the source and what was wrong.
        sources: files / readers that contributed.
    """

    host: str = ""
    gpus: list[Gpu] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    paths: dict[tuple[str, str], str] = field(default_factory=dict)
    pci: dict[str, PciNode] = field(default_factory=dict)
    unclassified: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    #: netdev name -> {"operstate", "carrier", "addresses"} as netlink reported them (live only)
    links: dict[str, dict] = field(default_factory=dict)

    def nic(self, name: str) -> Nic | None:
        return next((n for n in self.nics if n.name == name), None)

    def nic_by_bus(self, bus_id: str) -> Nic | None:
        return next((n for n in self.nics if n.pci_bus_id == bus_id), None)

    def add_nic(self, name: str, **kw) -> Nic:
        """Get or create the NIC ``name`` and set the given attributes where still unknown."""
        n = self.nic(name)
        if n is None:
            n = Nic(name)
            self.nics.append(n)
        for k, v in kw.items():
            if v is not None and getattr(n, k) in (None, [], ""):
                setattr(n, k, v)
        return n


def merge(parts: list[Topology], host: str = "") -> Topology:
    """Combine topologies read from several files or readers of ONE host.

    NICs are matched by name, then by PCI bus id when one of the two is named by that bus id
    only (a file that knows the bus id and one that knows the RDMA name describe the same
    device).  Two different RDMA names at one bus id stay two devices: NCCL topology XML lists
    each port of a dual-port NIC as its own ``<net>`` (``mlx5_18`` port 1, ``mlx5_19`` port 2
    under one ``<pci>``), and each is an RDMA device of its own, whatever NCCL_IB_MERGE_NICS
    would fuse (NCCL src/graph/xml.cc ``ncclTopoFillNet`` finds or adds one ``<net>`` per
    network device, keyed by its ``name``).  Port facts fill in
    what is unknown, the first source that knows a value wins.  GPUs are matched by bus id,
    then by index.  Warnings and sources are concatenated.
    """
    out = Topology(host=host or next((p.host for p in parts if p.host), ""))
    _warn_disjoint_gpus(parts, out)
    for t in parts:
        out.sources += t.sources
        out.warnings += t.warnings
        for bus, node in t.pci.items():
            out.pci.setdefault(bus, node)
        out.unclassified += [u for u in t.unclassified if u not in out.unclassified]
        for k, v in t.paths.items():
            out.paths.setdefault(k, v)
        for k, v in t.links.items():
            out.links.setdefault(k, v)
        for g in t.gpus:
            same = next((x for x in out.gpus if (g.pci_bus_id and x.pci_bus_id == g.pci_bus_id)
                         or (g.pci_bus_id is None and g.index is not None and x.index == g.index)), None)
            if same is None:
                out.gpus.append(Gpu(g.index, g.pci_bus_id, g.numa_node, g.uuid, g.name))
            else:
                for attr in ("index", "pci_bus_id", "numa_node", "uuid", "name"):
                    if getattr(same, attr) is None:
                        setattr(same, attr, getattr(g, attr))
        for n in t.nics:
            same = out.nic(n.name) or _same_device_by_bus(out, n)
            if same is None:
                same = Nic(n.name)
                out.nics.append(same)
            elif same.name != n.name and _is_bus_name(same.name) and not _is_bus_name(n.name):
                same.name = n.name  # an RDMA name beats a bus-id name
            for attr in ("pci_bus_id", "numa_node", "kind", "transport"):
                if getattr(same, attr) is None:
                    setattr(same, attr, getattr(n, attr))
            same.vanished = same.vanished or n.vanished
            same.netdevs += [d for d in n.netdevs if d not in same.netdevs]
            same.bond_members += [d for d in n.bond_members if d not in same.bond_members]
            for p in n.ports:
                q = same.port(p.port)
                src = ", ".join(t.sources) or "another source"
                if q.state == "UNKNOWN":
                    q.state = p.state
                elif p.state not in ("UNKNOWN", q.state):
                    out.warnings.append(f"{same.name}/{p.port}: state {q.state} from an earlier source, {p.state} in {src}; "
                                        f"keeping {q.state} (sources disagree: captured at different times?)")
                for attr in ("phys_state", "link_layer", "rate_gbps", "netdev"):
                    mine, theirs = getattr(q, attr), getattr(p, attr)
                    if mine is None:
                        setattr(q, attr, theirs)
                    elif theirs is not None and theirs != mine:
                        out.warnings.append(f"{same.name}/{p.port}: {attr} {mine} from an earlier source, {theirs} in {src}; keeping {mine}")
                if not q.gids:
                    q.gids = list(p.gids)
    return out


def _warn_disjoint_gpus(parts: list[Topology], out: Topology) -> None:
    """Warn when two sources both list GPUs and none of them match: they may describe
    different hosts (or one names GPUs by index, the other by bus id only)."""
    with_gpus = [t for t in parts if t.gpus]
    for i, a in enumerate(with_gpus):
        for b in with_gpus[i + 1:]:
            bus_a = {g.pci_bus_id for g in a.gpus if g.pci_bus_id}
            bus_b = {g.pci_bus_id for g in b.gpus if g.pci_bus_id}
            idx_a = {g.index for g in a.gpus if g.index is not None}
            idx_b = {g.index for g in b.gpus if g.index is not None}
            if not (bus_a & bus_b) and not (idx_a & idx_b and not (bus_a and bus_b)):
                out.warnings.append(f"{', '.join(a.sources) or 'a source'} and {', '.join(b.sources) or 'another source'}: "
                                    "no GPU in common (different hosts, or one names GPUs only by index and the other "
                                    "only by bus id); their GPUs are listed separately")


def _same_device_by_bus(out: Topology, n: Nic) -> Nic | None:
    """The NIC of ``out`` at ``n``'s bus id that is ``n`` under another name: only when one of
    the two is named by the bus id itself (the source did not know the RDMA name)."""
    if not n.pci_bus_id:
        return None
    for m in out.nics:
        if m.pci_bus_id == n.pci_bus_id and (_is_bus_name(m.name) or _is_bus_name(n.name)):
            return m
    return None


def _is_bus_name(name: str) -> bool:
    return norm_bus_id(name) == name
