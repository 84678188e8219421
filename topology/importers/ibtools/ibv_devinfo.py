"""``ibv_devinfo``: one block per HCA, its ports inside.

``ibv_devinfo`` (rdma-core ``libibverbs/examples/devinfo.c``)::

    hca_id:\tmlx5_0
    \ttransport:\t\t\tInfiniBand (0)      <- transport_str: InfiniBand|iWARP|usNIC|usNIC UDP|unspecified
    \tfw_ver / node_guid / ...
    \tphys_port_cnt:\t\t\t1
    \t\tport:\t1
    \t\t\tstate:\t\t\tPORT_ACTIVE (4)       <- PORT_DOWN|PORT_INIT|PORT_ARMED|PORT_ACTIVE
    \t\t\tmax_mtu / active_mtu / sm_lid / port_lid / port_lmc
    \t\t\tlink_layer:\t\tEthernet            <- InfiniBand|Ethernet|Unknown
    (-v only) active_width:\t\t4X (2) / active_speed:\t\t50.0 Gbps (64) /
              phys_state:\t\tLINK_UP (5)      <- SLEEP|POLLING|DISABLED|...|LINK_UP|...

  the rate is active_width x active_speed when both are printed.  ``transport`` fills
  ``Nic.transport``.  With the indentation flattened, any ``key: value`` line with a lower-case
  identifier key stays in the block.
"""

from __future__ import annotations

import re

from topology.importers.ibtools._common import _DEV, _Block

_DEVINFO_HDR = re.compile(r"^hca_id:\s+(" + _DEV + r")$")
_DEVINFO_PARTIAL = re.compile(r"^hca_id:")

#: an ibv_devinfo field (devinfo.c ``print_hca_cap``/``print_all_port_gids``): a lower-case
#: identifier, a colon, a value
_DEVINFO_FIELD = re.compile(r"^[a-z][a-z0-9_]*:(?:\s|$)")
#: devinfo.c ``transport_str``
_TRANSPORTS = {"infiniband": "InfiniBand", "iwarp": "iWARP", "usnic": "usNIC", "usnic udp": "usNIC UDP",
               "unspecified": None, "invalid transport": None}
_DEVINFO_NEEDED = ("state", "link_layer")


def looks_like_line(s: str) -> bool:
    """An ``hca_id:`` line (``s`` stripped)."""
    return bool(_DEVINFO_HDR.match(s))


class DevinfoLines:
    """The ibv_devinfo part of :class:`~topology.importers.ibtools._reader._Reader`."""

    def devinfo_header(self, s: str, indent: int) -> bool:
        """An ``hca_id:`` line opens a block; False when ``s`` is none."""
        m = _DEVINFO_HDR.match(s)
        if not m:
            return False
        self.close()
        name = m.group(1)
        self.first(("ibv_devinfo", name), f"hca_id {name}")
        self.block = _Block("ibv_devinfo", self.lineno, indent, self.nic(name))
        return True

    def devinfo_partial(self, s: str) -> bool:
        """Warn about an ``hca_id:`` line cut short; False when ``s`` is not one."""
        if not _DEVINFO_PARTIAL.match(s):
            return False
        self.warn(f"unreadable ibv_devinfo header {s!r}")
        return True

    def devinfo_flat_field(self, b: _Block, s: str) -> bool:
        """One of ibv_devinfo's own fields (see ``_Reader.flat_field``)."""
        return bool(_DEVINFO_FIELD.match(s))

    def devinfo_field(self, s: str) -> None:
        b = self.block
        key, sep, val = s.partition(":")
        if not sep:
            return   # -v prints capability flag names alone on their lines
        key, val = key.strip(), val.strip()
        if key == "transport" and b.port is None:
            t = re.sub(r"\s*\(\d+\)$", "", val).strip().lower()
            if t in _TRANSPORTS:
                self.set_transport(b.nic, _TRANSPORTS[t])
            else:
                self.warn(f"unreadable ibv_devinfo transport {val!r}")
            return
        if key == "phys_port_cnt":
            n = self.number(val, r"(\d+)", "ibv_devinfo phys_port_cnt")
            if n is not None and not self.defer:
                b.declared_ports = int(n)
            b.seen.setdefault(-1, set()).add(key)
            return
        if key == "port":
            n = self.number(val, r"(\d+)", "ibv_devinfo port")
            if n is None:
                b.port = None
                return
            b.port = int(n)
            if b.port in b.seen:
                self.warn(f"hca_id {b.nic.name}: port {b.port} appears twice in one block")
            b.seen.setdefault(b.port, set())
            if not self.defer:
                b.nic.port(b.port)
            return
        if b.port is None:
            return   # a device-wide field
        b.seen[b.port].add(key)
        if key == "state":
            st = self.state(re.sub(r"\s*\(\d+\)$", "", val), "ibv_devinfo state")
            if st:
                self.put(b.nic, b.port, "state", st)
        elif key == "phys_state":
            ph = self.phys(re.sub(r"\s*\(\d+\)$", "", val), "ibv_devinfo phys_state")
            if ph:
                self.put(b.nic, b.port, "phys_state", ph)
        elif key == "link_layer":
            ll = self.link_layer(val, "ibv_devinfo link_layer")
            if ll:
                self.put(b.nic, b.port, "link_layer", ll)
        elif key in ("active_width", "active_speed") and not self.defer:
            w, sp = b.rates.get(b.port, (None, None))
            if key == "active_width":
                m = re.fullmatch(r"(\d+)X?\s*\(\d+\)", val)
                w = int(m.group(1)) if m else None
            else:
                m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*Gbps\s*\(\d+\)", val)
                sp = float(m.group(1)) if m else None
            if m is None:
                self.warn(f"unreadable ibv_devinfo {key} {val!r}")
            b.rates[b.port] = (w, sp)
        if self.defer:
            b.pending_text = s

    def devinfo_check(self, b: _Block, ports: list[int]) -> tuple[bool, tuple[str, ...], str]:
        """Whether a closed HCA block is whole (warnings for what is missing), the fields each
        of its ports needs, and what to call it."""
        whole = True
        name = b.nic.name
        if b.declared_ports is None:
            self.warn(f"hca_id {name}: no readable phys_port_cnt line (output cut short?)", b.line)
            whole = False
        elif len(ports) < b.declared_ports:
            self.warn(f"hca_id {name}: {len(ports)} of {b.declared_ports} port(s) printed "
                      f"(output cut short?)", b.line)
            whole = False
        return whole, _DEVINFO_NEEDED, f"hca_id {name}"
