"""Read a host's GPUs, RDMA devices, netdevs and PCI tree from sysfs.

:func:`read_sysfs` reads files only (no ioctl, no netlink, no driver library) under an
injectable root, so a tree captured from another host (:mod:`topology.capture`) or built by a
test reads exactly like ``/``.  What it reads:

* ``/sys/bus/pci/devices/*``: every PCI function: ``class``, ``vendor``, ``device``,
  ``numa_node`` (-1: unknown).  Its place in the PCI tree comes from where the symlink points,
  e.g. ``../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0``:
  the parent is the nearest earlier path component that is a bus id (None at a root port),
  the root is the first ``pciDDDD:BB`` component (the host bridge).  NVIDIA functions of
  class 0x0300xx/0x0302xx are GPUs (index unknown: only NVML knows it).
* ``/sys/class/infiniband/*``: each RDMA device, its PCI function (``device`` link) and every
  port under ``ports/*``: ``state``, ``phys_state``, ``rate``, ``link_layer`` and the GID table
  (``gids/I``, ``gid_attrs/types/I``, ``gid_attrs/ndevs/I``; all-zero GIDs are empty slots).
  A port's netdev is the netdev of its first GID (RoCE), else the netdev on the same PCI
  function whose ``dev_port`` is the port number - 1 (IPoIB).
* ``/sys/class/net/*``: each netdev's PCI function (``device`` link; virtual netdevs have
  none), ``dev_port`` and, for a bond, ``bonding/slaves``.  A bond that is an RDMA port's netdev
  (``mlx5_bond_0`` over ``bond0``) lists its members in ``Nic.bond_members``.  A netdev on a
  PCI function that no RDMA device covers becomes a NIC of kind ``ethernet`` named by the
  function's bus id.

Nothing here raises on bad input: a missing, unreadable or garbled file, a broken symlink, a
port without a state file or two names for one thing becomes a warning ``"<path>: <what>"``
(the path as seen inside the root, so a captured tree warns like the host did) and the reader
goes on with what it could read.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from topology.model import (
    PORT_STATES,
    Gid,
    Gpu,
    Nic,
    PciNode,
    Port,
    Topology,
    norm_bus_id,
)

PCI_DEVICES = "/sys/bus/pci/devices"
IB_CLASS = "/sys/class/infiniband"
NET_CLASS = "/sys/class/net"

NVIDIA_VENDOR = "0x10de"
#: PCI class prefixes of a GPU: VGA controller, 3D controller.
GPU_CLASSES = ("0x0300", "0x0302")

_HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_CLASS_RE = re.compile(r"^0x[0-9a-f]{6}$")
_ID_RE = re.compile(r"^0x[0-9a-f]{4}$")
_STATE_RE = re.compile(r"^\s*(\d+)\s*:\s*(\S.*?)\s*$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")
_GID_RE = re.compile(r"^[0-9a-f]{4}(?::[0-9a-f]{4}){7}$")
_ZERO_GID = ":".join(["0000"] * 8)
_LINK_LAYERS = ("InfiniBand", "Ethernet")
_MAX_LINKS = 40
_MAX_FILE_BYTES = 1 << 16


class SysfsReader:
    """File access confined to ``root``, remembering everything it touched.

    Paths given to it are absolute paths *inside* the root (``/sys/...``).  Symlinks are
    followed by hand, component by component, so an absolute or ``..`` target stays inside the
    root, and so every symlink crossed, every directory listed and every file read (with the
    bytes read) is recorded under its *physical* in-tree path (no symlink in any parent):
    :mod:`topology.capture` replays these records into another directory.
    """

    def __init__(self, root: str | Path = "/") -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.warnings: list[str] = []
        self.files: dict[str, bytes] = {}
        self.links: dict[str, str] = {}
        self.dirs: set[str] = set()

    # ------------------------------------------------------------------ low level

    def host_path(self, path: str) -> str:
        """Where the in-tree absolute ``path`` lives on this machine."""
        return path if self.root == "/" else self.root + path

    def warn(self, path: str, what: str) -> None:
        self.warnings.append(f"{path}: {what}")

    def resolve(self, path: str) -> tuple[str | None, str]:
        """Follow ``path`` (symlinks included) inside the root.

        Returns ``(physical in-tree path, "")`` or ``(None, why)`` where why is ``"missing"``,
        ``"broken symlink ..."``, ``"symlink loop"`` or an OS error text.
        """
        # each pending component carries the symlink whose target it came from (None: from path)
        todo: list[tuple[str, tuple[str, str] | None]] = [(p, None) for p in path.split("/") if p]
        cur = "/"
        hops = 0
        while todo:
            name, via = todo.pop(0)
            if name == ".":
                continue
            if name == "..":
                cur = os.path.dirname(cur) if cur != "/" else "/"
                continue
            nxt = cur.rstrip("/") + "/" + name
            try:
                st = os.lstat(self.host_path(nxt))
            except (FileNotFoundError, NotADirectoryError):
                if via is not None:
                    return None, f"broken symlink ({via[0]} -> {via[1]})"
                return None, "missing"
            except OSError as e:
                return None, f"cannot read ({e.strerror})"
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_LINKS:
                    return None, "symlink loop"
                try:
                    target = os.readlink(self.host_path(nxt))
                except OSError as e:
                    return None, f"cannot read symlink ({e.strerror})"
                self.links[nxt] = target
                if target.startswith("/"):
                    cur = "/"
                todo = [(p, (nxt, target)) for p in target.split("/") if p] + todo
                continue
            if todo and not stat.S_ISDIR(st.st_mode):
                return None, f"{nxt} is not a directory"
            cur = nxt
        if cur != "/":
            try:
                if stat.S_ISDIR(os.stat(self.host_path(cur)).st_mode):
                    self.dirs.add(cur)
            except OSError:
                pass
        return cur, ""

    def read(self, path: str, *, quiet_missing: bool = False) -> str | None:
        """The stripped text of file ``path``, or None (with a warning) when it cannot be read.

        ``quiet_missing``: a file that does not exist gives None without a warning.
        """
        text, why = self.try_read(path)
        if text is None and why and not (quiet_missing and why == "missing"):
            self.warn(path, why)
        return text

    def try_read(self, path: str) -> tuple[str | None, str]:
        """Like :meth:`read` but returns ``(text, why)`` and warns about nothing."""
        phys, why = self.resolve(path)
        if phys is None:
            return None, why
        try:
            with open(self.host_path(phys), "rb") as f:
                data = f.read(_MAX_FILE_BYTES + 1)
        except IsADirectoryError:
            self.dirs.add(phys)
            return None, "is a directory where a file was expected"
        except OSError as e:
            return None, f"cannot read ({e.strerror or e})"
        self.files[phys] = data[:_MAX_FILE_BYTES]
        if len(data) > _MAX_FILE_BYTES:
            return None, f"larger than {_MAX_FILE_BYTES} bytes"
        try:
            return data.decode("utf-8").strip(), ""
        except UnicodeDecodeError:
            return None, "not text (undecodable bytes)"

    def listdir(self, path: str, *, quiet_missing: bool = False) -> list[str]:
        """Sorted entries of directory ``path``; [] (with a warning) when it cannot be listed."""
        phys, why = self.resolve(path)
        if phys is None:
            if not (quiet_missing and why == "missing"):
                self.warn(path, why)
            return []
        try:
            names = sorted(os.listdir(self.host_path(phys)))
        except NotADirectoryError:
            self.warn(path, "is a file where a directory was expected")
            return []
        except OSError as e:
            self.warn(path, f"cannot list ({e.strerror or e})")
            return []
        self.dirs.add(phys)
        return names

    def is_dir(self, path: str) -> bool:
        phys, _ = self.resolve(path)
        return phys is not None and phys in self.dirs

    def link_target(self, path: str, *, quiet_missing: bool = False) -> str | None:
        """Physical in-tree path that the symlink (or directory) ``path`` leads to; None with a
        warning when it is broken."""
        phys, why = self.resolve(path)
        if phys is None and not (quiet_missing and why == "missing"):
            self.warn(path, why)
        return phys


# ---------------------------------------------------------------------- parsing helpers


def _bus_components(phys: str) -> list[str]:
    """The bus ids among the components of a physical sysfs path, in order."""
    out = []
    for comp in phys.split("/"):
        b = norm_bus_id(comp)
        if b is not None and comp.count(":") == 2:
            out.append(b)
    return out


def _pci_of(phys: str | None) -> str | None:
    """The PCI function a device path belongs to: the last bus id component."""
    if not phys:
        return None
    comps = _bus_components(phys)
    return comps[-1] if comps else None


def _parse_state(text: str | None) -> str | None:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; ``"5: LinkUp"`` -> ``"LinkUp"``; None if not that shape."""
    if text is None:
        return None
    m = _STATE_RE.match(text)
    return m.group(2) if m else None


def _parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------- the reader


def read_sysfs(root: str | Path = "/") -> Topology:
    """Read the GPUs, NICs (RDMA devices and plain netdevs' PCI functions), their ports and
    the PCI tree from sysfs under ``root``.  Never raises on what it finds; see the module
    docstring."""
    return read_with(SysfsReader(root))


def read_with(fs: SysfsReader) -> Topology:
    """:func:`read_sysfs` with a given :class:`SysfsReader` (whose records capture uses)."""
    topo = Topology(sources=[f"sysfs:{fs.root}"])
    netdevs: dict[str, _Netdev] = {}
    steps = (("PCI devices", lambda: _read_pci(fs, topo)),
             ("netdevs", lambda: netdevs.update(_read_netdevs(fs))),
             ("RDMA devices", lambda: _read_rdma(fs, topo, netdevs)),
             ("plain NICs", lambda: _plain_nics(fs, topo, netdevs)))
    for what, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001  a reader bug must cost one part, not the whole reading
            fs.warn(fs.root, f"reading {what} failed: {type(e).__name__}: {e}")
    topo.warnings = fs.warnings
    return topo


def _read_pci(fs: SysfsReader, topo: Topology) -> None:
    seen: dict[str, str] = {}
    gpus: list[Gpu] = []
    for name in fs.listdir(PCI_DEVICES):
        path = f"{PCI_DEVICES}/{name}"
        bus = norm_bus_id(name)
        if bus is None or name.count(":") != 2:
            fs.warn(path, "not a PCI bus id")
            continue
        if bus in seen:
            fs.warn(path, f"duplicate PCI device: {seen[bus]} is the same bus id {bus}")
            continue
        seen[bus] = path
        phys = fs.link_target(path)
        if phys is None:
            continue
        comps = _bus_components(phys)
        if not comps or comps[-1] != bus:
            fs.warn(path, f"points to {phys}, which is not device {bus}")
            continue
        parent = comps[-2] if len(comps) > 1 else None
        root = next((c for c in phys.split("/") if _HOST_BRIDGE_RE.match(c)), None)
        pci_class = _checked(fs, f"{path}/class", _CLASS_RE, "PCI class")
        vendor = _checked(fs, f"{path}/vendor", _ID_RE, "vendor id")
        device = _checked(fs, f"{path}/device", _ID_RE, "device id")
        numa = None
        raw, why = fs.try_read(f"{path}/numa_node")
        if raw is not None:
            numa = _parse_int(raw)
            if numa is None:
                fs.warn(f"{path}/numa_node", f"not a number: {raw[:40]!r}")
            elif numa < 0:
                numa = None
        elif why != "missing":  # no numa_node file at all: a kernel without NUMA
            fs.warn(f"{path}/numa_node", why)
        topo.pci[bus] = PciNode(bus, parent, pci_class, numa, vendor, device, root)
        if pci_class is None:
            topo.unclassified.append(bus)
        if vendor == NVIDIA_VENDOR and pci_class is not None and pci_class.startswith(GPU_CLASSES):
            gpus.append(Gpu(index=None, pci_bus_id=bus, numa_node=numa))
    topo.gpus = sorted(gpus, key=lambda g: g.pci_bus_id or "")


def _checked(fs: SysfsReader, path: str, pattern: re.Pattern, what: str) -> str | None:
    text = fs.read(path)
    if text is None:
        return None
    value = text.lower()
    if not pattern.match(value):
        fs.warn(path, f"not a {what}: {text[:40]!r}")
        return None
    return value


class _Netdev:
    __slots__ = ("dev_port", "name", "path", "pci", "slaves")

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        self.pci: str | None = None
        self.dev_port: int | None = 0  # no dev_port file (kernels before 3.15): port 1
        self.slaves: list[str] = []


def _read_netdevs(fs: SysfsReader) -> dict[str, _Netdev]:
    out: dict[str, _Netdev] = {}
    for name in fs.listdir(NET_CLASS):
        path = f"{NET_CLASS}/{name}"
        if fs.link_target(path) is None:
            continue
        nd = _Netdev(name, path)
        dev = fs.link_target(f"{path}/device", quiet_missing=True)
        if dev is not None:
            nd.pci = _pci_of(dev)
            raw, why = fs.try_read(f"{path}/dev_port")
            if raw is None and why != "missing":
                fs.warn(f"{path}/dev_port", why)
                nd.dev_port = None
            elif raw is not None:
                port = _parse_int(raw)
                if port is None or port < 0:
                    fs.warn(f"{path}/dev_port", f"not a port number: {raw[:40]!r}")
                    nd.dev_port = None  # matches no RDMA port
                else:
                    nd.dev_port = port
        if fs.is_dir(f"{path}/bonding"):
            raw = fs.read(f"{path}/bonding/slaves")
            nd.slaves = raw.split() if raw else []
        out[name] = nd
    return out


#: ``node_type`` as the kernel prints it (drivers/infiniband/core/sysfs.c ``node_type_show``:
#: ``"%d: CA"``, ``"%d: RNIC"``, ...) -> the transport it implies (RDMA_NODE_RNIC is iWARP)
_NODE_TRANSPORT = {"CA": "InfiniBand", "switch": "InfiniBand", "router": "InfiniBand", "RNIC": "iWARP",
                   "usNIC": "usNIC", "usNIC UDP": "usNIC UDP", "unspecified": None}


def _transport(fs: SysfsReader, path: str) -> str | None:
    """The device's transport from ``<dev>/node_type`` (None when absent or unknown)."""
    raw = fs.read(f"{path}/node_type", quiet_missing=True)
    if raw is None:
        return None
    m = re.fullmatch(r"\d+:\s*(.+)", raw.strip())
    if not m or m.group(1) not in _NODE_TRANSPORT:
        fs.warn(f"{path}/node_type", f"not a node type: {raw[:40]!r}")
        return None
    return _NODE_TRANSPORT[m.group(1)]


def _read_rdma(fs: SysfsReader, topo: Topology, netdevs: dict[str, _Netdev]) -> None:
    by_pci: dict[str, str] = {}
    for name in fs.listdir(IB_CLASS, quiet_missing=True):
        path = f"{IB_CLASS}/{name}"
        if fs.link_target(path) is None:
            topo.nics.append(Nic(name, kind="rdma", vanished=True))
            continue
        pci = _pci_of(fs.link_target(f"{path}/device", quiet_missing=True))
        if pci is not None and pci in by_pci:
            fs.warn(path, f"same PCI function {pci} as RDMA device {by_pci[pci]}")
        elif pci is not None:
            by_pci[pci] = name
        node = topo.pci.get(pci) if pci else None
        nic = Nic(name, pci_bus_id=pci, numa_node=node.numa_node if node else None, kind="rdma")
        nic.transport = _transport(fs, path)
        ports_dir = f"{path}/ports"
        names = fs.listdir(ports_dir)
        if not names:
            fs.warn(ports_dir, "no ports")
        for pname in names:
            num = int(pname) if pname.isdigit() else None
            if num is None or num < 1:
                fs.warn(f"{ports_dir}/{pname}", "not a port number")
                continue
            nic.ports.append(_read_port(fs, f"{ports_dir}/{pname}", num, pci, netdevs))
        nic.ports.sort(key=lambda p: p.port)
        for p in nic.ports:
            if p.netdev and p.netdev not in nic.netdevs:
                nic.netdevs.append(p.netdev)
            nd = netdevs.get(p.netdev or "")
            if nd is not None:
                nic.bond_members += [s for s in nd.slaves if s not in nic.bond_members]
        topo.nics.append(nic)


def _read_port(fs: SysfsReader, path: str, num: int, pci: str | None, netdevs: dict[str, _Netdev]) -> Port:
    port = Port(num)
    raw = fs.read(f"{path}/state")
    state = _parse_state(raw)
    if raw is not None and (state is None or state.upper() not in PORT_STATES):
        fs.warn(f"{path}/state", f"not a port state: {raw[:40]!r}")
        state = None
    port.state = state.upper() if state else "UNKNOWN"
    raw = fs.read(f"{path}/phys_state")
    port.phys_state = _parse_state(raw)
    if raw is not None and port.phys_state is None:
        fs.warn(f"{path}/phys_state", f"not a physical state: {raw[:40]!r}")
    if port.state == "DOWN" and port.phys_state in ("Polling", "Disabled"):
        port.state = port.phys_state.upper()

    ll = fs.read(f"{path}/link_layer")
    if ll is not None and ll not in _LINK_LAYERS:
        fs.warn(f"{path}/link_layer", f"not a link layer: {ll[:40]!r}")
        ll = None
    port.link_layer = ll

    # A port that is not up has no width: the kernel answers EINVAL to a rate read.
    raw, why = fs.try_read(f"{path}/rate")
    if raw is not None:
        m = _RATE_RE.match(raw)
        if m:
            port.rate_gbps = float(m.group(1))
        else:
            fs.warn(f"{path}/rate", f"not a rate: {raw[:40]!r}")
    elif port.state == "ACTIVE" or (why != "missing" and not why.startswith("cannot read")):
        fs.warn(f"{path}/rate", why)

    for idx_name in fs.listdir(f"{path}/gids", quiet_missing=True):
        if not idx_name.isdigit():
            fs.warn(f"{path}/gids/{idx_name}", "not a GID index")
            continue
        gpath = f"{path}/gids/{idx_name}"
        raw = fs.read(gpath)
        if raw is None:
            continue
        gid = raw.lower()
        if not _GID_RE.match(gid):
            fs.warn(gpath, f"not a GID: {raw[:60]!r}")
            continue
        if gid == _ZERO_GID:
            continue
        entry = Gid(int(idx_name), gid)
        entry.type = fs.read(f"{path}/gid_attrs/types/{idx_name}") or None
        if ll == "Ethernet":
            entry.netdev = fs.read(f"{path}/gid_attrs/ndevs/{idx_name}") or None
        elif ll is None:  # link layer unknown: an ndev if there is one, no warning if not
            entry.netdev = fs.try_read(f"{path}/gid_attrs/ndevs/{idx_name}")[0] or None
        port.gids.append(entry)
    port.gids.sort(key=lambda g: g.index)

    port.netdev = next((g.netdev for g in port.gids if g.netdev), None)
    if port.netdev is None and pci is not None:
        port.netdev = _netdev_for_port(fs, path, pci, num, netdevs)
    return port


def _netdev_for_port(fs: SysfsReader, path: str, pci: str, num: int, netdevs: dict[str, _Netdev]) -> str | None:
    """The netdev on PCI function ``pci`` whose dev_port is ``num - 1`` (IPoIB, or a RoCE
    port without GIDs), skipping child interfaces (IPoIB P_Key children: iflink != ifindex)."""
    cands = [n for n in netdevs.values() if n.pci == pci and n.dev_port == num - 1]
    if len(cands) > 1:
        parents = []
        for n in cands:
            ifindex = _parse_int(fs.read(f"{n.path}/ifindex", quiet_missing=True))
            iflink = _parse_int(fs.read(f"{n.path}/iflink", quiet_missing=True))
            if ifindex is None or iflink is None or ifindex == iflink:
                parents.append(n)
        cands = parents or cands
    if len(cands) > 1:
        fs.warn(path, f"netdevs {', '.join(n.name for n in cands)} all claim this port (same PCI function "
                      f"{pci} and dev_port {num - 1}); using {cands[0].name}")
    return cands[0].name if cands else None


def _plain_nics(fs: SysfsReader, topo: Topology, netdevs: dict[str, _Netdev]) -> None:
    """Netdevs on PCI functions no RDMA device covers -> NICs of kind ethernet, by bus id."""
    covered_pci = {n.pci_bus_id for n in topo.nics if n.pci_bus_id}
    covered = {d for n in topo.nics for d in n.netdevs + n.bond_members}
    plain: dict[str, list[str]] = {}
    for nd in netdevs.values():
        if nd.pci is None or nd.pci in covered_pci or nd.name in covered:
            continue
        plain.setdefault(nd.pci, []).append(nd.name)
    for bus, names in sorted(plain.items()):
        clash = topo.nic(bus)
        if clash is not None:
            fs.warn(f"{NET_CLASS}/{names[0]}", f"NIC name {bus} is already an RDMA device's name")
            continue
        node = topo.pci.get(bus)
        topo.nics.append(Nic(bus, pci_bus_id=bus, numa_node=node.numa_node if node else None,
                             netdevs=sorted(names), kind="ethernet"))
