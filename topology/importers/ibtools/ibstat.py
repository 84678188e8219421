"""``ibstat`` (and the ``ibpanic``/``ibwarn`` lines it prints when it fails): its CA blocks.

``ibstat`` (rdma-core ``infiniband-diags/ibstat.c``, ``ca_dump``/``port_dump``)::

    CA 'mlx5_0'                          <- node type "CA", then the name in quotes
    \tCA type: MT4129
    \tNumber of ports: 1
    \tFirmware version: ... / Hardware version / Node GUID / System image GUID
    \tPort 1:
    \t\tState: Active                    <- ???|Down|Initializing|Armed|Active
    \t\tPhysical state: LinkUp           <- Sleep|Polling|Disabled|PortConfigurationTraining|
                                            LinkUp|LinkErrorRecovery|PhyTest
    \t\tRate: 400                        <- Gb/s; "2.5" for 1x SDR, "10 (FDR10)" for FDR10
    \t\tBase lid / LMC / SM lid / Capability mask / Port GUID
    \t\tLink layer: InfiniBand           <- always the last line of a port
    ibpanic: [pid] main: stat of IB device 'mlx5_8' failed: ...   <- on stderr; ibstat exits

  ``ibstat -s`` prints the CA lines without ports; ``ibstat mlx5_0 1`` prints
  ``CA: 'mlx5_0'`` and one port with no indentation (``port_dump(port, alone=1)``: no prefix).
  The node type is ``node_type_str[]``: ``CA``, ``Switch``, ``Router``, ``iWARP RNIC`` or ``???``
  (header ``iWARP RNIC 'name'``, then ``\tiWARP RNIC type: ...``); an iWARP RNIC gets
  ``Nic.transport = "iWARP"``.  A whole output whose indentation was lost (a paste) is read
  too: a line at the header's indentation that is one of ibstat's own fields stays in the block.
"""

from __future__ import annotations

import re

from topology.importers.ibtools._common import _DEV, _Block

#: ibstat.c ``node_type_str``: the node type ``ca_dump`` prints before the quoted name
_NODE_TYPES = r"(CA|Switch|Router|iWARP RNIC|\?\?\?)"
_IBSTAT_CA = re.compile(r"^" + _NODE_TYPES + r" '(" + _DEV + r")'$")
_IBSTAT_CA_ALONE = re.compile(r"^" + _NODE_TYPES + r": '(" + _DEV + r")'$")          # ibstat <ca> <port>
_IBSTAT_CA_PARTIAL = re.compile(r"^(?:CA|Switch|Router|iWARP RNIC):? '")
_IBSTAT_PORT = re.compile(r"^Port (\d+):$")
_IBSTAT_FIELD = re.compile(r"^([A-Za-z][A-Za-z ]*):(?:[ \t]+(.*))?$")
_IBPANIC = re.compile(r"^ib(panic|warn):\s*(?:\[\d+\]\s*)?(?:(\w+):\s*)?(.*)$")

_IBSTAT_CA_KEYS = {"CA type", "Switch type", "Router type", "iWARP RNIC type", "??? type", "Number of ports",
                   "Firmware version", "Hardware version", "Node GUID", "System image GUID"}
_IBSTAT_PORT_KEYS = {"State", "Physical state", "Rate", "Base lid", "LMC", "SM lid", "Capability mask",
                     "Port GUID", "Link layer"}
_IBSTAT_NEEDED = ("State", "Physical state", "Rate", "Link layer")


def looks_like_line(s: str) -> bool:
    """A CA header or an ibpanic line (``s`` stripped)."""
    return bool(_IBSTAT_CA.match(s) or _IBSTAT_CA_ALONE.match(s) or s.startswith("ibpanic:"))


class IbstatLines:
    """The ibstat part of :class:`~topology.importers.ibtools._reader._Reader`."""

    def ibstat_header(self, s: str, indent: int) -> bool:
        """A CA header opens a block; False when ``s`` is none."""
        m = _IBSTAT_CA.match(s) or _IBSTAT_CA_ALONE.match(s)
        if not m:
            return False
        self.close()
        node_type, name = m.group(1), m.group(2)
        alone = s.startswith(node_type + ":")
        if not alone:
            self.first(("ibstat", name), f"CA '{name}'")
        nic = self.nic(name)
        if node_type == "iWARP RNIC":
            self.set_transport(nic, "iWARP")
        self.block = _Block("ibstat", self.lineno, indent, nic, alone=alone)
        return True

    def ibpanic_header(self, s: str) -> bool:
        """An ``ibpanic:``/``ibwarn:`` line (stands alone); False when ``s`` is none."""
        m = _IBPANIC.match(s)
        if not m:
            return False
        self.close()
        self.ibpanic(m.group(1), m.group(3).strip())
        return True

    def ibstat_partial(self, s: str) -> bool:
        """Warn about a CA header cut short; False when ``s`` is not one."""
        if not _IBSTAT_CA_PARTIAL.match(s):
            return False
        self.warn(f"unreadable ibstat CA header {s!r}")
        return True

    def ibpanic(self, kind: str, msg: str) -> None:
        if kind == "warn":
            self.warn(f"ibstat warned: {msg}")
            return
        m = re.search(r"'([^'\s]+)'", msg)
        if m:
            nic = self.nic(m.group(1))
            nic.vanished = True
            self.warn(f"ibstat could not read device '{nic.name}' (ibpanic: {msg}); marked vanished, "
                      f"and the devices after it were not listed")
        else:
            self.warn(f"ibstat stopped with an error (ibpanic: {msg})")

    def ibstat_flat_field(self, b: _Block, s: str) -> bool:
        """One of ibstat's own fields (see ``_Reader.flat_field``)."""
        m = _IBSTAT_FIELD.match(s)
        return bool(_IBSTAT_PORT.match(s) or (m and (m.group(1) in _IBSTAT_PORT_KEYS
                                                     or (not b.alone and m.group(1) in _IBSTAT_CA_KEYS))))

    def ibstat_field(self, s: str) -> None:
        b = self.block
        m = _IBSTAT_PORT.match(s)
        if m:
            b.port = int(m.group(1))
            if b.port in b.seen:
                self.warn(f"CA '{b.nic.name}': Port {b.port} appears twice in one block")
            b.seen.setdefault(b.port, set())
            if not self.defer:
                b.nic.port(b.port)
            return
        m = _IBSTAT_FIELD.match(s)
        if not m:
            self.warn(f"unreadable line in CA '{b.nic.name}': {s[:60]!r}")
            return
        key, val = m.group(1), (m.group(2) or "")
        if key == "Number of ports":
            n = self.number(val, r"(\d+)", "Number of ports")
            if n is not None and not self.defer:
                b.declared_ports = int(n)
            b.seen.setdefault(-1, set()).add(key)
            return
        if key in _IBSTAT_CA_KEYS:
            return
        if key not in _IBSTAT_PORT_KEYS:
            return   # a field this parser does not know: nothing to take from it
        if b.port is None:
            self.warn(f"CA '{b.nic.name}': {key} before any 'Port N:' line")
            return
        b.seen[b.port].add(key)
        if key == "State":
            st = self.state(val, "ibstat State")
            if st:
                self.put(b.nic, b.port, "state", st)
        elif key == "Physical state":
            ph = self.phys(val, "ibstat Physical state")
            if ph:
                self.put(b.nic, b.port, "phys_state", ph)
        elif key == "Rate":
            r = self.number(val, r"(\d+(?:\.\d+)?)(?:\s*\(FDR10\))?", "ibstat Rate")
            if r is not None:
                self.put(b.nic, b.port, "rate_gbps", r)
        elif key == "Link layer":
            ll = self.link_layer(val, "ibstat Link layer")
            if ll:
                self.put(b.nic, b.port, "link_layer", ll)
        if self.defer:
            b.pending_text = s

    def ibstat_check(self, b: _Block, ports: list[int]) -> tuple[bool, tuple[str, ...], str]:
        """Whether a closed CA block is whole (warnings for what is missing), the fields each
        of its ports needs, and what to call it."""
        whole = True
        name = b.nic.name
        if not b.alone:
            if b.declared_ports is None:
                self.warn(f"CA '{name}': no readable 'Number of ports' line (output cut short?)", b.line)
                whole = False
            elif len(ports) < b.declared_ports:
                self.warn(f"CA '{name}': {len(ports)} of {b.declared_ports} port(s) printed "
                          f"(output cut short, or ibstat -s)", b.line)
                whole = False
        elif not ports:
            self.warn(f"CA: '{name}': no port printed (output cut short?)", b.line)
            whole = False
        return whole, _IBSTAT_NEEDED, f"CA '{name}'"
