"""GPU-to-NIC path types, each GPU's nearest compute NICs, NIC roles and rail numbers.

Pure logic on a :class:`topology.model.Topology`.

Path types are nvidia-smi's (``nvidia-smi topo -m`` legend):

* ``PIX``  at most a single PCIe bridge (both under one PCIe switch);
* ``PXB``  multiple PCIe bridges, without traversing the PCIe host bridge;
* ``PHB``  traverses a PCIe host bridge (typically the CPU);
* ``NODE`` traverses PCIe and the interconnect between host bridges within a NUMA node;
* ``SYS``  traverses the SMP interconnect between NUMA nodes (QPI/UPI/xGMI).

Roles, with the reason kept for the operator:

* ``compute``: an RDMA-capable NIC that is one of a GPU's nearest NICs: among the candidate
  NICs, those at the GPU's best path type, when that is local (PIX/PXB/PHB); this is how NCCL
  picks a GPU's NIC, so a NIC at PHB to a GPU that has a PIX/PXB NIC is not that GPU's rail.
  Also a NIC whose GPU is not in the source: it sits alone in a PCIe switch of the same model
  (vendor:device) as the switches where GPUs share a switch with a compute NIC of the same
  model (a cut-off topology dump, or a GPU that fell off the bus).  With no GPU information,
  an RDMA NIC that is not excluded by the rules below;
* ``front-end``: a plain netdev (``kind == "ethernet"``: not an RDMA device, NCCL can only use
  it through sockets), an Ethernet port on a node whose rails are InfiniBand, a NIC that is
  NODE/SYS to every GPU while it is up, or a local NIC that no GPU has among its nearest;
* ``storage``: a NIC SYS to every GPU on a NUMA node that has no GPU;
* ``unused``: no port is ACTIVE and nothing marks the NIC as a rail (no GPU information, and a
  link layer other than InfiniBand), or the device vanished while being read;
* ``undecided``: GPU-to-NIC paths are known but no GPU has a local NIC (every path NODE or SYS,
  as ``nvidia-smi topo -m`` prints on GB200 trays, whose GPUs reach Grace over C2C and share no
  PCIe switch with a NIC), and neither the link layer nor a NUMA node without GPUs decides: the
  paths cannot say which NICs are rails, so none is guessed; a warning says why, and the config's
  compute override (or a source giving link layers) settles it.

State is not role.  A NIC's role comes from the device and its place (PCIe affinity to GPUs,
link layer, device type); a compute NIC whose port is DOWN, POLLING or INIT stays a compute rail
and its port state says it has a link fault.  NCCL itself drops non-ACTIVE ports only when it
starts (src/transport/net_ib.cc ``ncclIbInit``: ``if (portAttr.state != IBV_PORT_ACTIVE)
continue``), which is the fault linkpass reports, not a reason to forget the rail.  Without
GPU information an InfiniBand HCA is a rail (IB is the compute fabric on a GPU node); only an
Ethernet/unknown-link-layer RDMA NIC with no GPU information, no ACTIVE port while other NICs'
ports are ACTIVE, is taken as not cabled (``unused``): nothing but its state tells it apart.

Not an NCCL rail whatever its place: an iWARP device (``Nic.transport == "iWARP"``: ibv_devinfo
``transport: iWARP``, ibstat node type ``iWARP RNIC``).  NCCL's IB transport connects its RC
queue pairs itself, exchanging LID/GID out of band and moving them to RTR/RTS with
ibv_modify_qp (src/transport/net_ib.cc ``ncclIbConnect``/``ncclIbRtrQp``), which only IB and
RoCE allow; an iWARP QP is connected through the iWARP connection manager (rdma_cm/iw_cm) over
TCP, which NCCL does not use.  Such a NIC is ``front-end`` (NCCL can reach it only through
sockets).

Rails: compute NICs are numbered 0..N-1 in the order of the GPU they serve (lowest GPU index or
bus id first), then by name, so that rail k is "the k-th GPU's NIC" on every host of the same
model: NCCL's rail-optimized layouts assume exactly this.  When a compute NIC's GPU is missing
from the source, NICs are numbered in PCI bus order instead, which is the same on every host of
the same model.
"""

from __future__ import annotations

import re

from topology.model import (
    LOCAL_PATHS,
    PATH_TYPES,
    Gpu,
    Nic,
    PciNode,
    Topology,
    norm_bus_id,
)

_ETH_NETDEV = re.compile(r"^(en|eth)")
_IB_NETDEV = re.compile(r"^ib")


def _chain(pci: dict[str, PciNode], bus: str) -> list[PciNode]:
    out = []
    seen = set()
    cur = pci.get(bus)
    while cur is not None and cur.bus_id not in seen:
        out.append(cur)
        seen.add(cur.bus_id)
        cur = pci.get(cur.parent) if cur.parent else None
    return out


def path_type(pci: dict[str, PciNode], a: str, b: str) -> str | None:
    """Path type between PCI functions ``a`` and ``b`` from the PCI tree, or None when
    either is not in the tree.

    The lowest common bridge decides: when both reach it within a single switch (at most two
    bridge levels each: downstream port, upstream port) it is PIX, otherwise PXB.  With no
    common bridge: same root complex PHB, same NUMA node NODE, otherwise SYS (also when a
    NUMA node is unknown and the roots differ).
    """
    ca, cb = _chain(pci, a), _chain(pci, b)
    if not ca or not cb:
        return None
    ids_b = {n.bus_id: i for i, n in enumerate(cb)}
    for ia, node in enumerate(ca[1:], start=1):
        if node.bus_id in ids_b:
            ib = ids_b[node.bus_id]
            da = sum(n.weight for n in ca[1:ia]) + node.weight
            db = sum(n.weight for n in cb[1:ib]) + node.weight
            return "PIX" if max(da, db) <= 2 else "PXB"
    ra, rb = ca[-1].root, cb[-1].root
    if ra is not None and ra == rb:
        return "PHB"
    na = next((n.numa_node for n in ca if n.numa_node is not None), None)
    nb = next((n.numa_node for n in cb if n.numa_node is not None), None)
    if na is not None and na == nb:
        return "NODE"
    return "SYS"


def gpu_nic_path(topo: Topology, gpu: Gpu, nic: Nic) -> str | None:
    """Path type between a GPU and a NIC: read from a tool if given, else computed."""
    p = topo.paths.get((gpu.key, nic.name))
    if p is None and gpu.index is not None:
        p = topo.paths.get((str(gpu.index), nic.name))
    if p is None and gpu.pci_bus_id and nic.pci_bus_id:
        p = path_type(topo.pci, gpu.pci_bus_id, nic.pci_bus_id)
    return p


def _rank(path: str | None) -> int:
    return PATH_TYPES.index(path) if path in PATH_TYPES else len(PATH_TYPES)


def _is_ethernet(nic: Nic) -> bool:
    if nic.link_layers:
        return nic.link_layers == {"Ethernet"}
    devs = [p.netdev for p in nic.ports if p.netdev] + nic.netdevs
    return bool(devs) and all(_ETH_NETDEV.match(d) for d in devs)


def _is_infiniband(nic: Nic) -> bool:
    if nic.link_layers:
        return "InfiniBand" in nic.link_layers
    devs = [p.netdev for p in nic.ports if p.netdev] + nic.netdevs
    return bool(devs) and any(_IB_NETDEV.match(d) for d in devs)


def _any_active(nic: Nic) -> bool:
    return any(p.state == "ACTIVE" for p in nic.ports)


def analyse(topo: Topology, compute_override: dict[str, bool] | None = None) -> Topology:
    """Fill ``role``, ``role_reason``, ``rail`` of every NIC and ``nearest_nics``/``nearest_path``
    of every GPU, in place; returns ``topo``.

    Args:
        compute_override: NIC name -> True/False from the config ("this NIC is / is not a
            compute rail"), which beats every rule.
    """
    override = compute_override or {}
    ib_node = any(_is_infiniband(n) for n in topo.nics)
    gpu_numas = {g.numa_node for g in topo.gpus if g.numa_node is not None}
    has_paths = bool(topo.gpus) and any(gpu_nic_path(topo, g, n) for g in topo.gpus for n in topo.nics)

    for n in topo.nics:
        n.role, n.role_reason, n.rail = None, "", None
        if n.name in override:
            n.role = "compute" if override[n.name] else "unused"
            n.role_reason = "set by the config"
            continue
        if n.vanished:
            n.role, n.role_reason = "unused", "the device vanished while it was being read"
            continue
        if n.transport == "iWARP":
            n.role, n.role_reason = "front-end", ("an iWARP device: NCCL's IB transport connects only IB/RoCE queue "
                                                  "pairs, so it is no NCCL rail (NCCL can use it only through sockets)")
            continue
        if n.kind == "ethernet":
            n.role, n.role_reason = "front-end", "a plain netdev, not an RDMA device (NCCL can use it only through sockets)"
            continue
        if ib_node and _is_ethernet(n):
            n.role, n.role_reason = "front-end", "Ethernet port on a node whose rails are InfiniBand"
            continue

    # each GPU's nearest candidates: the NICs (not yet given a role) at its best path, if local
    candidates = [n for n in topo.nics if n.role is None]
    nearest_of: dict[str, list[str]] = {}
    if has_paths:
        for g in topo.gpus:
            paths = [(gpu_nic_path(topo, g, n), n) for n in candidates]
            best = min((p for p, _ in paths), key=_rank, default=None)
            if best in LOCAL_PATHS:
                for p, n in paths:
                    if p == best:
                        nearest_of.setdefault(n.name, []).append(g.key)

    # paths known, but no GPU has a local NIC: the paths cannot tell rails from the rest
    no_local = has_paths and bool(candidates) and not nearest_of
    undecided: list[str] = []
    for n in candidates:
        if has_paths and no_local:
            paths = {g.key: gpu_nic_path(topo, g, n) for g in topo.gpus}
            best = min(paths.values(), key=_rank)
            if best == "SYS" and n.numa_node is not None and gpu_numas and n.numa_node not in gpu_numas:
                n.role, n.role_reason = "storage", f"SYS to every GPU, on NUMA node {n.numa_node} which has no GPU"
            elif _is_infiniband(n):
                n.role, n.role_reason = "compute", (f"InfiniBand HCA; no GPU has a local NIC (best path {best}), so the "
                                                    "link layer decides")
            else:
                n.role, n.role_reason = "undecided", (f"no GPU has a local NIC (best path {best or 'unknown'}): the paths "
                                                      "cannot tell a rail from a front-end NIC")
                undecided.append(n.name)
            continue
        if has_paths:
            paths = {g.key: gpu_nic_path(topo, g, n) for g in topo.gpus}
            best = min(paths.values(), key=_rank)
            if n.name in nearest_of:
                n.role, n.role_reason = "compute", f"{best} to GPU(s) {', '.join(k for k, p in paths.items() if p == best)}"
            elif best in LOCAL_PATHS:
                n.role, n.role_reason = "front-end", (f"{best} to GPU(s) {', '.join(k for k, p in paths.items() if p == best)}, "
                                                      "each of which has a nearer NIC")
            elif (twin := _rail_slot(topo, n, nearest_of)) is not None:
                n.role, n.role_reason = "compute", (f"no GPU in the source is local to it, but it sits in a PCIe switch of the "
                                                    f"same model as {twin}'s, which holds {twin}'s GPU: its own GPU is missing "
                                                    "from the source")
            elif best == "SYS" and n.numa_node is not None and gpu_numas and n.numa_node not in gpu_numas:
                n.role, n.role_reason = "storage", f"SYS to every GPU, on NUMA node {n.numa_node} which has no GPU"
            elif best in ("NODE", "SYS"):
                n.role, n.role_reason = "front-end", f"no GPU is local to it (best path {best})"
            else:
                n.role, n.role_reason = "unused", "no path to any GPU is known"
            continue
        if n.numa_node is not None and gpu_numas and n.numa_node not in gpu_numas:
            n.role, n.role_reason = "storage", f"on NUMA node {n.numa_node} which has no GPU"
            continue
        if _is_infiniband(n):
            n.role, n.role_reason = "compute", ("InfiniBand HCA; no GPU-to-NIC information to say otherwise"
                                                + _state_note(n))
            continue
        if n.ports and not _any_active(n) and any(_any_active(m) for m in topo.nics if m is not n):
            n.role, n.role_reason = "unused", ("no GPU-to-NIC information and no InfiniBand link layer, and no port is "
                                               "ACTIVE while other NICs' ports are (not cabled or disabled)")
            continue
        n.role, n.role_reason = "compute", "RDMA NIC; no GPU-to-NIC information to say otherwise" + _state_note(n)

    if undecided:
        src = ", ".join(topo.sources) or "topology"
        cells = sorted({gpu_nic_path(topo, g, m) or "unknown" for g in topo.gpus for m in topo.nics
                        if m.name in undecided})
        w = (f"{src}: no GPU has a NIC at PIX, PXB or PHB (every GPU-to-NIC path is {'/'.join(cells)}, as on GB200 "
             f"trays whose GPUs reach the CPU over C2C): which NICs are compute rails cannot be read from these paths, "
             f"so {', '.join(sorted(undecided, key=_natural))} {'is' if len(undecided) == 1 else 'are'} left "
             "undecided (no rail); name the compute NICs in the config, or add a source giving link layers "
             "(ibstat, ibv_devinfo)")
        if w not in topo.warnings:
            topo.warnings.append(w)

    compute = [n for n in topo.nics if n.role == "compute"]
    for g in topo.gpus:
        paths = [(gpu_nic_path(topo, g, n), n) for n in compute]
        best = min((p for p, _ in paths), key=_rank, default=None)
        near = [n for p, n in paths if best in LOCAL_PATHS and p == best]
        g.nearest_nics = [n.name for n in sorted(near, key=lambda n: _natural(n.name))]
        g.nearest_path = best if near else None

    def first_gpu(n: Nic) -> tuple:
        served = [g for g in topo.gpus if n.name in g.nearest_nics]
        if not served:
            return (1, ())
        g = min(served, key=lambda g: (g.index if g.index is not None else 1 << 30, g.pci_bus_id or ""))
        return (0, (g.index if g.index is not None else 1 << 30, g.pci_bus_id or ""))

    if compute and all(n.pci_bus_id for n in compute) and any(not any(n.name in g.nearest_nics for g in topo.gpus) for n in compute):
        # a compute NIC whose GPU is missing from the source (fell off the bus, cut-off dump):
        # GPU order cannot place it, PCI order can, and PCI order is the same on every host of
        # the same model, so rail k stays "the k-th NIC slot" across hosts
        order = sorted(compute, key=lambda n: n.pci_bus_id)
    else:
        order = sorted(compute, key=lambda n: (first_gpu(n), _natural(n.name)))
    for rail, n in enumerate(order):
        n.rail = rail
    return topo


def _state_note(n: Nic) -> str:
    """``"; port 1 DOWN (a link fault)"`` for a rail whose ports are not all ACTIVE, else ``""``."""
    bad = [f"port {p.port} {p.state}" for p in n.ports if p.state not in ("ACTIVE", "UNKNOWN")]
    return f"; {', '.join(bad)} (a link fault, kept as port state)" if bad else ""


def _natural(name: str) -> tuple:
    """Sort key putting mlx5_2 before mlx5_10 (and rocep1s0f1 before roceP2p1s0f1: case does
    not count); PCI bus ids (fixed-width hex) sort as text, so 0000:1a:00.0 comes after
    0000:10:00.0."""
    if norm_bus_id(name) == name:
        return (name,)
    return tuple(int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", name))


def _model(node: PciNode | None) -> tuple[str, str] | None:
    """(vendor, device) of a PCI node when both are known and real (not 0xffff placeholders)."""
    if node is None or not node.vendor or not node.device or node.vendor.lower() in ("0xffff", "0x0000"):
        return None
    return node.vendor.lower(), node.device.lower()


def _switch_of(pci: dict[str, PciNode], node: PciNode | None) -> PciNode | None:
    """The PCIe switch a device sits in: the ancestor reached after two bridge levels
    (sysfs: downstream port, then upstream port; NCCL XML: one switch element of weight 2)."""
    if node is None:
        return None
    levels = 0
    cur = pci.get(node.parent) if node.parent else None
    while cur is not None:
        levels += cur.weight
        if levels >= 2:
            return cur
        cur = pci.get(cur.parent) if cur.parent else None
    return None


def _rail_slot(topo: Topology, n: Nic, nearest_of: dict[str, list[str]]) -> str | None:
    """The compute NIC whose slot ``n`` repeats, or None: ``n`` sits in a PCIe switch of the same
    model as a switch that holds a compute NIC of ``n``'s model together with that NIC's GPU."""
    node = topo.pci.get(n.pci_bus_id) if n.pci_bus_id else None
    switch = _switch_of(topo.pci, node)
    if _model(node) is None or _model(switch) is None:
        return None
    gpu_bridges = {c.bus_id for g in topo.gpus if g.pci_bus_id for c in _chain(topo.pci, g.pci_bus_id)[1:]}
    for m in topo.nics:
        if m is n or m.name not in nearest_of or not m.pci_bus_id:
            continue
        m_node = topo.pci.get(m.pci_bus_id)
        m_switch = _switch_of(topo.pci, m_node)
        if (m_switch is not None and m_switch.bus_id in gpu_bridges and _model(m_node) == _model(node)
                and _model(m_switch) == _model(switch)):
            return m.name
    return None


def rails(topo: Topology) -> list[dict]:
    """``[{"id": rail, "nics": [name]}]`` for the analysed topology."""
    out: dict[int, list[str]] = {}
    for n in topo.nics:
        if n.rail is not None:
            out.setdefault(n.rail, []).append(n.name)
    return [{"id": k, "nics": v} for k, v in sorted(out.items())]


def to_json(topo: Topology) -> dict:
    """The ``linkpass.topology/v1`` document (after :func:`analyse`)."""
    return {
        "schema": "linkpass.topology/v1",
        "host": topo.host,
        "gpus": [{"index": g.index, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node, "uuid": g.uuid,
                  "nearest_nics": g.nearest_nics, "path": g.nearest_path or "none"} for g in topo.gpus],
        "nics": [{"name": n.name, "pci_bus_id": n.pci_bus_id, "numa_node": n.numa_node, "role": n.role,
                  "role_reason": n.role_reason, "rail": n.rail, "transport": n.transport, "netdevs": n.netdevs,
                  "bond_members": n.bond_members,
                  "ports": [p.to_json() for p in n.ports]} for n in sorted(topo.nics, key=lambda n: _natural(n.name))],
        "rails": rails(topo),
        "unclassified_devices": topo.unclassified,
        "warnings": topo.warnings,
        "sources": topo.sources,
    }
