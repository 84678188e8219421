"""``ibstatus``: one block per port.

``ibstatus`` (rdma-core ``infiniband-diags/scripts/ibstatus``, a shell script printing sysfs
files ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer}``)::

    Infiniband device 'mlx5_0' port 1 status:
    \tdefault gid:\t fe80:...
    \tbase lid: / sm lid:
    \tstate:\t\t 4: ACTIVE               <- "N: NOP|DOWN|INIT|ARMED|ACTIVE|ACTIVE_DEFER"
    \tphys state:\t 5: LinkUp            <- "N: Sleep|Polling|Disabled|...|LinkUp|..."
    \trate:\t\t 200 Gb/sec (4X HDR)     <- kernel rate_show(): "%d[.5] Gb/sec (%dX%s)"
    \tlink_layer:\t InfiniBand           <- InfiniBand|Ethernet
"""

from __future__ import annotations

import re

from topology.importers.ibtools._common import _Block

_IBSTATUS_HDR = re.compile(r"^Infiniband device '([^'\s]+)' port (\d+) status:$")
_IBSTATUS_PARTIAL = re.compile(r"^Infiniband device '")

#: ibstatus's port fields (scripts/ibstatus ``port_status``)
_IBSTATUS_KEYS = {"default gid", "base lid", "sm lid", "state", "phys state", "rate", "link_layer"}
_IBSTATUS_NEEDED = ("state", "phys state", "rate", "link_layer")


def looks_like_line(s: str) -> bool:
    """A port header (``s`` stripped)."""
    return bool(_IBSTATUS_HDR.match(s))


class IbstatusLines:
    """The ibstatus part of :class:`~topology.importers.ibtools._reader._Reader`."""

    def ibstatus_header(self, s: str, indent: int) -> bool:
        """A port header opens a block; False when ``s`` is none."""
        m = _IBSTATUS_HDR.match(s)
        if not m:
            return False
        self.close()
        name, port = m.group(1), int(m.group(2))
        self.first(("ibstatus", name, port), f"ibstatus device '{name}' port {port}")
        nic = self.nic(name)
        nic.port(port)
        self.block = _Block("ibstatus", self.lineno, indent, nic, port=port)
        self.block.seen[port] = set()
        return True

    def ibstatus_partial(self, s: str) -> bool:
        """Warn about a port header cut short; False when ``s`` is not one."""
        if not _IBSTATUS_PARTIAL.match(s):
            return False
        self.warn(f"unreadable ibstatus header {s!r}")
        return True

    def ibstatus_flat_field(self, b: _Block, s: str) -> bool:
        """One of ibstatus's own fields (see ``_Reader.flat_field``)."""
        return s.partition(":")[0].strip() in _IBSTATUS_KEYS and ":" in s

    def ibstatus_field(self, s: str) -> None:
        b = self.block
        key, _, val = s.partition(":")
        key, val = key.strip(), val.strip()
        if not _:
            self.warn(f"unreadable line in ibstatus block of {b.nic.name} port {b.port}: {s[:60]!r}")
            return
        b.seen[b.port].add(key)
        if key == "state":
            m = re.fullmatch(r"(\d+):\s*(\S+)", val)
            st = self.state(m.group(2), "ibstatus state") if m else self.state(val, "ibstatus state")
            if st:
                self.put(b.nic, b.port, "state", st)
        elif key == "phys state":
            m = re.fullmatch(r"(\d+):\s*(.+)", val)
            ph = self.phys(m.group(2) if m else val, "ibstatus phys state")
            if ph:
                self.put(b.nic, b.port, "phys_state", ph)
        elif key == "rate":
            r = self.number(val, r"(\d+(?:\.\d+)?) Gb/sec(?: \([^)]*\))?", "ibstatus rate")
            if r is not None:
                self.put(b.nic, b.port, "rate_gbps", r)
        elif key == "link_layer":
            ll = self.link_layer(val, "ibstatus link_layer")
            if ll:
                self.put(b.nic, b.port, "link_layer", ll)
        if self.defer:
            b.pending_text = s

    def ibstatus_check(self, b: _Block, ports: list[int]) -> tuple[bool, tuple[str, ...], str]:
        """Whether a closed port block is whole (nothing to check but its fields), the fields
        its port needs, and what to call it."""
        return True, _IBSTATUS_NEEDED, f"ibstatus {b.nic.name} port {b.port}"
