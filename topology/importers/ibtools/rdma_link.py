"""``rdma link``: one line per port.

``rdma link`` (iproute2 ``rdma/link.c``, ``link_parse_cb``)::

    link mlx5_0/1 subnet_prefix fe80:... lid 5 sm_lid 1 lmc 0 state ACTIVE physical_state LINK_UP netdev ib0
    1/1: mlx5_0/1: state ACTIVE physical_state LINK_UP netdev ib0        <- older iproute2

  state NOP|DOWN|INIT|ARMED|ACTIVE|ACTIVE_DEFER; physical_state NOP|SLEEP|POLLING|DISABLED|
  ARMED|LINK_UP|LINK_ERROR_RECOVER|PHY_TEST (iproute2's table prints value 4,
  PortConfigurationTraining, as "ARMED").
"""

from __future__ import annotations

import re

_RDMA_LINK = re.compile(r"^(?:link\s+|\d+/\d+:\s+)([^\s/:]{1,64})/(\d+):?(?:\s+(.*))?$")
_RDMA_KEYS = ("subnet_prefix", "lid", "sm_lid", "lmc", "state", "physical_state", "netdev", "netdev_index")


def looks_like_line(s: str) -> bool:
    """An ``rdma link`` line with a state (``s`` stripped)."""
    m = _RDMA_LINK.match(s)
    return bool(m and m.group(3) and "state" in m.group(3).split())


class RdmaLinkLines:
    """The rdma link part of :class:`~topology.importers.ibtools._reader._Reader`."""

    def rdma_link_header(self, s: str) -> bool:
        """An ``rdma link`` line with a state, physical state or netdev (stands alone); False
        when ``s`` is none."""
        m = _RDMA_LINK.match(s)
        if m and m.group(3) and any(k in m.group(3).split() for k in ("state", "physical_state", "netdev")):
            self.close()
            self.rdma_link(m.group(1), int(m.group(2)), m.group(3))
            return True
        return False

    def rdma_link(self, dev: str, port: int, rest: str) -> None:
        self.first(("rdma link", dev, port), f"rdma link {dev}/{port}")
        nic = self.nic(dev)
        nic.port(port)
        tok = rest.split()
        vals: dict[str, str] = {}
        i = 0
        while i < len(tok):
            if tok[i] in _RDMA_KEYS and i + 1 < len(tok):
                vals.setdefault(tok[i], tok[i + 1])
                i += 2
            else:
                i += 1
        if "state" in vals:
            st = self.state(vals["state"], "rdma link state")
            if st:
                self.put(nic, port, "state", st)
        if "physical_state" in vals:
            ph = self.phys(vals["physical_state"], "rdma link physical_state")
            if ph:
                self.put(nic, port, "phys_state", ph)
        if "netdev" in vals:
            self.add_netdev(nic, port, vals["netdev"])
