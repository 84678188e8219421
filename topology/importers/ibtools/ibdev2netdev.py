"""``ibdev2netdev``: one line per port, with the netdev and its carrier.

``ibdev2netdev`` (MLNX_OFED shell script, mlnx-tools ``ofed_scripts/ibdev2netdev``; the link
state is ``get_link_state``: the netdev's ``/sys/class/net/<netdev>/carrier``, not the RDMA
port state)::

    mlx5_0 port 1 ==> ib0 (Up)           <- Up|Down|NA
    -v: 0000:17:00.0 mlx5_0 (MT4123 - MT0000000223) <desc> fw 20.28.1002 port 1 (ACTIVE) ==> ib0 (Up)
                                          <- print_verbose_info: "(ACTIVE)" is ports/<n>/state
    mlx5_0 port 1 <===> ib0              <- the old-style branch (print_line): no state

  Any run of blanks separates fields (``ibdev2netdev | column -t``); a ``# note`` after the
  last field is the capturer's and is dropped, other trailing text is named in a warning.  An
  IPoIB netdev's Down (``ib*``) leaves the port state unknown; see :meth:`Ibdev2netdevLines.ibdev2netdev`.
"""

from __future__ import annotations

import re

from topology.importers.ibtools._common import _DEV, _NETDEV, _WEAK
from topology.model import norm_bus_id

#: ibdev2netdev lines, with any run of blanks between fields (``| column -t`` pads them) and
#: whatever follows the last field kept apart (a ``# note`` someone appended)
_IBDEV2NETDEV = re.compile(r"^(" + _DEV + r")\s+port\s+(\d+)\s+==>\s+(" + _NETDEV + r")\s+\((Up|Down|NA)\)"
                           r"(?:\s+(?P<rest>.*))?$")
_IBDEV2NETDEV_V = re.compile(
    r"^(?:(?P<bus>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}\.[0-7])\s+)?(?P<dev>" + _DEV + r")\s+\(.*\)"
    r".*\sport\s+(?P<port>\d+)\s+\(\s*(?P<ibstate>[^)]*?)\s*\)\s+==>\s+(?P<netdev>" + _NETDEV + r")\s+\((?P<link>Up|Down|NA)\)"
    r"(?:\s+(?P<rest>.*))?$")
#: the old-style branch of the script (``print_line``): no state at all
_IBDEV2NETDEV_OLD = re.compile(r"^(" + _DEV + r")\s+port\s+(\d+)\s+<===>\s+(" + _NETDEV + r")(?:\s+(?P<rest>.*))?$")
#: IPoIB netdev names: the kernel's ipoib driver names them ``ib%d`` (drivers/infiniband/ulp/
#: ipoib/ipoib_main.c, ``ipoib_add_port``) and systemd's predictable names for ARPHRD_INFINIBAND
#: start with ``ib`` (src/udev/udev-builtin-net_id.c): ``ib0``, ``ibp26s0``, ``ibs3``
_IPOIB_NETDEV = re.compile(r"^ib")


def looks_like_line(s: str) -> bool:
    """An ibdev2netdev line, any of its three layouts (``s`` stripped)."""
    return bool(_IBDEV2NETDEV.match(s) or _IBDEV2NETDEV_V.match(s) or _IBDEV2NETDEV_OLD.match(s))


class Ibdev2netdevLines:
    """The ibdev2netdev part of :class:`~topology.importers.ibtools._reader._Reader`."""

    def ibdev2netdev_header(self, s: str) -> bool:
        """An ibdev2netdev line (stands alone); False when ``s`` is none."""
        m = _IBDEV2NETDEV.match(s)
        if m:
            self.close()
            self.trailing(m.group("rest"), "ibdev2netdev")
            self.ibdev2netdev(m.group(1), int(m.group(2)), m.group(3), m.group(4), None, None)
            return True
        m = _IBDEV2NETDEV_V.match(s)
        if m:
            self.close()
            self.trailing(m.group("rest"), "ibdev2netdev")
            self.ibdev2netdev(m.group("dev"), int(m.group("port")), m.group("netdev"), m.group("link"),
                              m.group("ibstate"), m.group("bus"))
            return True
        m = _IBDEV2NETDEV_OLD.match(s)
        if m:
            self.close()
            self.trailing(m.group("rest"), "ibdev2netdev")
            self.ibdev2netdev(m.group(1), int(m.group(2)), m.group(3), "NA", None, None)
            return True
        return False

    def ibdev2netdev_partial(self, s: str) -> bool:
        """Warn about an ibdev2netdev line that could not be read; False when ``s`` is not one."""
        if not ("==>" in s and " port " in s):
            return False
        self.warn(f"unreadable ibdev2netdev line {s!r}")
        return True

    def trailing(self, rest: str | None, tool: str) -> None:
        """Text after a one-line record's last field: a ``# note`` is the capturer's own and
        is dropped; anything else is named in a warning (it is not the tool's)."""
        if rest and not rest.lstrip().startswith("#"):
            self.warn(f"text after the {tool} fields ignored: {rest[:60]!r}")

    def ibdev2netdev(self, dev: str, port: int, netdev: str, link: str, ibstate: str | None, bus: str | None) -> None:
        """One ibdev2netdev line (MLNX_OFED mlnx-tools ``ofed_scripts/ibdev2netdev``).

        ``(Up)``/``(Down)`` is the *netdev's* carrier (``get_link_state``: ``/sys/class/net/
        <netdev>/carrier`` is 1, else Down, also when the file cannot be read, as for a netdev
        that is administratively down; ``NA`` without the file), not the RDMA port state; only
        ``-v`` prints the port state (``print_verbose_info``, from ``ports/<n>/state``).
        For a RoCE netdev the port follows the Ethernet carrier, so Up/Down is read as a weak
        ACTIVE/DOWN.  For an IPoIB netdev (``ib*``) only Up says something about the port
        (IPoIB has carrier only over an ACTIVE port); Down may be an IPoIB interface that is
        simply not configured, so the port state stays unknown.  The carrier itself goes to
        ``Topology.links[netdev]["carrier"]`` either way.
        """
        self.first(("ibdev2netdev", dev, port), f"ibdev2netdev {dev} port {port}")
        nic = self.nic(dev, pci_bus_id=norm_bus_id(bus) if bus else None)
        nic.port(port)
        if ibstate is not None and ibstate.upper() != "NA":
            st = self.state(ibstate, "ibdev2netdev port state")
            if st:
                self.put(nic, port, "state", st)
        if link != "NA":
            if not self.defer:
                self.topo.links.setdefault(netdev, {})["carrier"] = link == "Up"
            if link == "Up" or not _IPOIB_NETDEV.match(netdev):
                self.put(nic, port, "state", "ACTIVE" if link == "Up" else "DOWN", _WEAK)
        self.add_netdev(nic, port, netdev)
