"""Live discovery: sysfs plus what only the running system knows.

* :func:`read_netlink`: each netdev's operstate, carrier and addresses (pyroute2, this
  thread's network namespace);
* :func:`read_nvml`: GPU index, UUID, name and NUMA node (nvidia-ml-py, ``import pynvml``);
* :func:`read_pyverbs`: RDMA device and port attributes (pyverbs, from rdma-core);
* :func:`discover`: sysfs (:func:`topology.sysfs.read_sysfs`) combined with the above.

Each optional library is imported only when its reader runs.  A missing library, a host
without an NVIDIA driver or without RDMA devices is not an error: that reader contributes
nothing (NVML: with one informational warning), and discovery goes on with sysfs alone.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from topology.model import Gpu, Nic, Port, Topology, merge, norm_bus_id
from topology.sysfs import read_sysfs

IFF_LOWER_UP = 0x10000

#: ibv_port_state values (verbs.h) -> the kernel's sysfs names
_VERBS_PORT_STATES = {0: "UNKNOWN", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
#: ibv_port_attr.phys_state values -> sysfs phys_state names
_VERBS_PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
                      6: "LinkErrorRecovery", 7: "Phy Test"}
_VERBS_LINK_LAYERS = {1: "InfiniBand", 2: "Ethernet"}
#: ibv_port_attr.active_width -> lanes
_VERBS_WIDTHS = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
#: ibv_port_attr.active_speed -> Gb/s per lane, as the kernel's sysfs ``rate`` counts them
_VERBS_SPEEDS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0, 256: 200.0}


def read_netlink() -> dict[str, dict]:
    """``{netdev: {"operstate": "UP", "carrier": True, "addresses": ["198.18.0.1/24", ...]}}``
    for every netdev of the calling thread's network namespace.

    ``operstate`` is the kernel's RFC 2863 name (UP, DOWN, LOWERLAYERDOWN, UNKNOWN, ...);
    ``carrier`` is IFF_LOWER_UP (an administratively down netdev has no carrier), as the
    daemon's netlink adapter reads it.  Addresses are IPv4 then IPv6, each ``addr/prefixlen``.

    Raises:
        ImportError: no pyroute2; OSError or pyroute2's NetlinkError: netlink could not be asked.
    """
    from pyroute2 import IPRoute

    out: dict[str, dict] = {}
    by_index: dict[int, str] = {}
    with IPRoute() as ipr:
        for msg in ipr.get_links():
            name = msg.get("ifname")
            if not name:
                continue
            by_index[msg.get("index")] = name
            flags = int(msg.get("flags") or 0)
            out[name] = {"operstate": str(msg.get("operstate") or "UNKNOWN"),
                         "carrier": bool(flags & IFF_LOWER_UP),
                         "addresses": []}
        addrs = sorted(ipr.get_addr(), key=lambda m: (m.get("family") != socket.AF_INET, m.get("index") or 0))
        for msg in addrs:
            name = by_index.get(msg.get("index"))
            addr = msg.get("address")
            if name is None or not addr:
                continue
            out[name]["addresses"].append(f"{addr}/{msg.get('prefixlen')}")
    return out


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def read_nvml() -> tuple[list[Gpu], list[str]]:
    """GPUs as NVML numbers them: ``(gpus, warnings)``.

    Without nvidia-ml-py, or when NVML cannot start (no driver, no library), there are no GPUs
    and one informational warning; a GPU NVML lists but cannot describe gives a warning and
    is kept with what could be read.
    """
    try:
        import pynvml
    except ImportError:
        return [], ["nvml: not used (nvidia-ml-py is not installed); GPU indexes and UUIDs are unknown"]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [], [f"nvml: not used ({e}: no NVIDIA driver here?); GPU indexes and UUIDs are unknown"]
    except OSError as e:
        return [], [f"nvml: not used ({e}); GPU indexes and UUIDs are unknown"]
    gpus: list[Gpu] = []
    warnings: list[str] = []
    try:
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            gpu = Gpu(index=i)
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                gpu.pci_bus_id = norm_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(h).busId))
                if gpu.pci_bus_id is None:
                    warnings.append(f"nvml: GPU {i}: PCI bus id {pynvml.nvmlDeviceGetPciInfo(h).busId!r} not understood")
                gpu.uuid = _text(pynvml.nvmlDeviceGetUUID(h))
                gpu.name = _text(pynvml.nvmlDeviceGetName(h))
            except pynvml.NVMLError as e:
                warnings.append(f"nvml: GPU {i}: {e}")
                gpus.append(gpu)
                continue
            try:
                gpu.numa_node = int(pynvml.nvmlDeviceGetNumaNodeId(h))
                if gpu.numa_node < 0:
                    gpu.numa_node = None
            except (pynvml.NVMLError, AttributeError):  # not supported, or an older binding
                gpu.numa_node = None
            gpus.append(gpu)
    except pynvml.NVMLError as e:
        warnings.append(f"nvml: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return gpus, warnings


def read_pyverbs() -> tuple[list[Nic], list[str]]:
    """RDMA devices and their ports as verbs reports them: ``(nics, warnings)``.

    Without pyverbs, or with no RDMA device (``get_device_list`` raises or returns ``[]``),
    the result is empty and not an error.  A device that cannot be opened or queried gives a
    warning and is kept by name.
    """
    try:
        from pyverbs.device import Context, get_device_list
    except ImportError:
        return [], []
    try:
        devices = get_device_list()
    except Exception:  # noqa: BLE001  PyverbsRDMAError with no devices / no rdma-core provider
        return [], []
    nics: list[Nic] = []
    warnings: list[str] = []
    for d in devices or []:
        name = _text(d.name)
        nic = Nic(name, kind="rdma")
        nics.append(nic)
        try:
            with Context(name=name) as ctx:
                attr = ctx.query_device()
                for num in range(1, int(attr.phys_port_cnt) + 1):
                    pa = ctx.query_port(num)
                    port = Port(num)
                    port.state = _VERBS_PORT_STATES.get(int(pa.state), "UNKNOWN")
                    port.phys_state = _VERBS_PHYS_STATES.get(int(pa.phys_state))
                    if port.state == "DOWN" and port.phys_state in ("Polling", "Disabled"):
                        port.state = port.phys_state.upper()
                    port.link_layer = _VERBS_LINK_LAYERS.get(int(pa.link_layer))
                    lanes = _VERBS_WIDTHS.get(int(pa.active_width))
                    speed = _VERBS_SPEEDS.get(int(pa.active_speed))
                    if port.state == "ACTIVE" and lanes and speed:
                        port.rate_gbps = lanes * speed
                    nic.ports.append(port)
        except Exception as e:  # noqa: BLE001  pyverbs raises its own error types for every verbs failure
            warnings.append(f"pyverbs: {name}: {type(e).__name__}: {e}")
    return nics, warnings


def discover(sysfs_root: str | Path = "/", use_netlink: bool = True, use_nvml: bool = True,
             use_pyverbs: bool | None = None) -> Topology:
    """This host's topology: sysfs under ``sysfs_root`` combined with the live readers.

    NVML GPUs are matched to sysfs GPUs by PCI bus id and give them their index, UUID and
    name (a GPU sysfs shows but NVML does not list gets a warning: a GPU fallen off the bus
    or without a driver); GPUs are then ordered by index.  Netlink fills
    :attr:`Topology.links`.  pyverbs (``use_pyverbs``; by default only when reading the live
    ``/`` with netlink or NVML on) fills port facts sysfs could not give.  NVML, pyverbs and
    netlink describe the running host: a caller reading a captured tree should turn them off.
    Nothing here raises: a reader that fails adds a warning.
    """
    topo = read_sysfs(sysfs_root)
    live_root = os.path.realpath(os.fspath(sysfs_root)) == "/"
    if use_pyverbs is None:
        use_pyverbs = live_root and (use_netlink or use_nvml)
    if live_root:
        topo.host = socket.gethostname()
    parts = [topo]
    if use_nvml:
        try:
            gpus, warnings = read_nvml()
        except Exception as e:  # noqa: BLE001  a binding that breaks its own contract
            gpus, warnings = [], [f"nvml: failed: {type(e).__name__}: {e}"]
        topo.warnings += warnings
        if gpus:
            seen = {g.pci_bus_id for g in topo.gpus}
            nvml_buses = {g.pci_bus_id for g in gpus if g.pci_bus_id}
            for g in topo.gpus:
                if g.pci_bus_id not in nvml_buses:
                    topo.warnings.append(f"nvml: GPU {g.pci_bus_id} is in sysfs but NVML does not list it "
                                         "(no driver bound, or fallen off the bus?)")
            for g in gpus:
                if g.pci_bus_id and g.pci_bus_id not in seen:
                    topo.warnings.append(f"nvml: GPU {g.index} ({g.pci_bus_id}) is not in sysfs")
            parts.append(Topology(gpus=gpus, sources=["nvml"]))
    if use_pyverbs:
        try:
            nics, warnings = read_pyverbs()
        except Exception as e:  # noqa: BLE001
            nics, warnings = [], [f"pyverbs: failed: {type(e).__name__}: {e}"]
        topo.warnings += warnings
        if nics:
            parts.append(Topology(nics=nics, sources=["pyverbs"]))
    out = merge(parts, host=topo.host) if len(parts) > 1 else topo
    if use_netlink:
        try:
            out.links = read_netlink()
            out.sources.append("netlink")
        except ImportError as e:
            out.warnings.append(f"netlink: not used ({e})")
        except Exception as e:  # noqa: BLE001  OSError, NetlinkError: discovery goes on without it
            out.warnings.append(f"netlink: cannot read links and addresses ({type(e).__name__}: {e})")
    out.gpus.sort(key=lambda g: (g.index is None, g.index if g.index is not None else 0, g.pci_bus_id or ""))
    return out
