"""Importer for captured InfiniBand / RDMA tool outputs: ``ibstat``, ``ibstatus``,
``ibv_devinfo``, ``ibdev2netdev``, ``rdma link`` and ``ibv_devices``.

Pure: no I/O, no subprocess; stdlib and :mod:`topology.model` only.

:func:`looks_like` says whether a text holds any of these outputs; :func:`parse` reads all of
them from one text (a capture or a paste that mixes several tools with shell prompts,
comments, config files, ...) into one :class:`~topology.model.Topology`: one
:class:`~topology.model.Nic` per RDMA device (named by its RDMA device name, in the order the
text first names it, ``kind="rdma"``), with its :class:`~topology.model.Port` s.  Lines that
belong to none of the formats are ignored.  Nothing raises on bad input: what could be read
is kept, and each problem becomes a warning ``"<source>: line N: <what was wrong>"`` (or
``"<source>: <what>"`` for the input as a whole).

Formats, as their programs print them
-------------------------------------

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

``ibstatus`` (rdma-core ``infiniband-diags/scripts/ibstatus``, a shell script printing sysfs
files ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer}``)::

    Infiniband device 'mlx5_0' port 1 status:
    \tdefault gid:\t fe80:...
    \tbase lid: / sm lid:
    \tstate:\t\t 4: ACTIVE               <- "N: NOP|DOWN|INIT|ARMED|ACTIVE|ACTIVE_DEFER"
    \tphys state:\t 5: LinkUp            <- "N: Sleep|Polling|Disabled|...|LinkUp|..."
    \trate:\t\t 200 Gb/sec (4X HDR)     <- kernel rate_show(): "%d[.5] Gb/sec (%dX%s)"
    \tlink_layer:\t InfiniBand           <- InfiniBand|Ethernet

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

``ibdev2netdev`` (MLNX_OFED shell script, mlnx-tools ``ofed_scripts/ibdev2netdev``; the link
state is ``get_link_state``: the netdev's ``/sys/class/net/<netdev>/carrier``, not the RDMA
port state)::

    mlx5_0 port 1 ==> ib0 (Up)           <- Up|Down|NA
    -v: 0000:17:00.0 mlx5_0 (MT4123 - MT0000000223) <desc> fw 20.28.1002 port 1 (ACTIVE) ==> ib0 (Up)
                                          <- print_verbose_info: "(ACTIVE)" is ports/<n>/state
    mlx5_0 port 1 <===> ib0              <- the old-style branch (print_line): no state

  Any run of blanks separates fields (``ibdev2netdev | column -t``); a ``# note`` after the
  last field is the capturer's and is dropped, other trailing text is named in a warning.  An
  IPoIB netdev's Down (``ib*``) leaves the port state unknown; see :meth:`_Reader.ibdev2netdev`.

``rdma link`` (iproute2 ``rdma/link.c``, ``link_parse_cb``)::

    link mlx5_0/1 subnet_prefix fe80:... lid 5 sm_lid 1 lmc 0 state ACTIVE physical_state LINK_UP netdev ib0
    1/1: mlx5_0/1: state ACTIVE physical_state LINK_UP netdev ib0        <- older iproute2

  state NOP|DOWN|INIT|ARMED|ACTIVE|ACTIVE_DEFER; physical_state NOP|SLEEP|POLLING|DISABLED|
  ARMED|LINK_UP|LINK_ERROR_RECOVER|PHY_TEST (iproute2's table prints value 4,
  PortConfigurationTraining, as "ARMED").

``ibv_devices`` (rdma-core ``libibverbs/examples/device_list.c``): only names and node GUIDs::

        device                 node GUID
        ------              ----------------
        mlx5_0              0c42a10300000001

Readings
--------

* ``Port.state``: one of ``ACTIVE DOWN INIT ARMED ACTIVE_DEFER POLLING DISABLED UNKNOWN``; a
  DOWN port whose physical state is Polling or Disabled gets that physical state as its state
  (tests/fixtures/corpus/README.md).  ibdev2netdev's ``Up``/``Down`` (netdev carrier) become
  ACTIVE/DOWN but give way to a port state printed by another tool for the same port.
* ``Port.phys_state``: ibstat's spelling (``LinkUp``, ``Polling``, ``Disabled``, ...) whatever
  tool printed it.
* ``Port.rate_gbps``: a float, None when not printed.  ``Port.link_layer``: ``InfiniBand``,
  ``Ethernet`` or None.  ``Port.netdev`` and ``Nic.netdevs`` from ibdev2netdev / rdma link.
* A device seen twice by the same tool (a duplicated block) is merged, with a warning; when
  two readings of one value differ, the first wins (a real port state beats a netdev
  carrier), with a warning naming both lines.
* A block that ends before its last line (a cut capture) gives a warning; when the text ends
  without a newline inside such a block, the values on that last, cut line are not used.
* Bounds (``_bounds``): at most 16 Mi characters are read and 200 warnings kept; a device name
  longer than 64 characters or a netdev name longer than 15 is no record (a warning).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from topology.importers._bounds import WarningCap, cap_text
from topology.model import Nic, Topology, norm_bus_id

__all__ = ["looks_like", "parse"]

# --- line patterns -------------------------------------------------------------------------

#: ibstat.c ``node_type_str``: the node type ``ca_dump`` prints before the quoted name
_NODE_TYPES = r"(CA|Switch|Router|iWARP RNIC|\?\?\?)"
#: an RDMA device name: at most IB_DEVICE_NAME_MAX - 1 = 63 characters (include/rdma/ib_verbs.h),
#: 64 allowed here; a netdev name: at most IFNAMSIZ - 1 = 15 (include/uapi/linux/if.h)
_DEV = r"[^'\s]{1,64}"
_NETDEV = r"[^\s()]{1,15}"
_IBSTAT_CA = re.compile(r"^" + _NODE_TYPES + r" '(" + _DEV + r")'$")
_IBSTAT_CA_ALONE = re.compile(r"^" + _NODE_TYPES + r": '(" + _DEV + r")'$")          # ibstat <ca> <port>
_IBSTAT_CA_PARTIAL = re.compile(r"^(?:CA|Switch|Router|iWARP RNIC):? '")
_IBSTAT_PORT = re.compile(r"^Port (\d+):$")
_IBSTAT_FIELD = re.compile(r"^([A-Za-z][A-Za-z ]*):(?:[ \t]+(.*))?$")
_IBPANIC = re.compile(r"^ib(panic|warn):\s*(?:\[\d+\]\s*)?(?:(\w+):\s*)?(.*)$")

_IBSTATUS_HDR = re.compile(r"^Infiniband device '([^'\s]+)' port (\d+) status:$")
_IBSTATUS_PARTIAL = re.compile(r"^Infiniband device '")

_DEVINFO_HDR = re.compile(r"^hca_id:\s+(" + _DEV + r")$")
_DEVINFO_PARTIAL = re.compile(r"^hca_id:")

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

_RDMA_LINK = re.compile(r"^(?:link\s+|\d+/\d+:\s+)([^\s/:]{1,64})/(\d+):?(?:\s+(.*))?$")
_RDMA_KEYS = ("subnet_prefix", "lid", "sm_lid", "lmc", "state", "physical_state", "netdev", "netdev_index")

_IBV_DEVICES_HDR = re.compile(r"^device\s+node GUID$")
_IBV_DEVICES_RULE = re.compile(r"^-+\s+-+$")
_IBV_DEVICES_ROW = re.compile(r"^(\S+)\s+([0-9A-Fa-f]{16})$")

#: control characters other than tab / CR / LF / FF, and U+FFFD (what a lenient decode of
#: bad bytes leaves): a sign of binary data
_BINARY = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")

# --- value vocabularies --------------------------------------------------------------------

_STATES = {"ACTIVE": "ACTIVE", "DOWN": "DOWN", "INIT": "INIT", "INITIALIZING": "INIT", "ARMED": "ARMED",
           "ACTIVE_DEFER": "ACTIVE_DEFER"}
#: printed values that mean "no state" (ibstat "???", verbs NOP, devinfo "invalid state")
_NO_STATE = {"???", "NOP", "UNKNOWN", "INVALID STATE", "NA"}

#: physical state, lower-cased with non-letters removed -> ibstat's spelling
_PHYS = {"sleep": "Sleep", "polling": "Polling", "disabled": "Disabled",
         "portconfigurationtraining": "PortConfigurationTraining",
         "portconfigurationtrainning": "PortConfigurationTraining",   # ibv_devinfo's spelling
         "armed": "PortConfigurationTraining",                         # iproute2's table (value 4)
         "linkup": "LinkUp", "linkerrorrecovery": "LinkErrorRecovery",
         "linkerrorrecover": "LinkErrorRecovery", "phytest": "PhyTest",
         "opaoffline": "OPA_OFFLINE", "opatest": "OPA_TEST"}
_NO_PHYS = {"nostatechange", "nop", "unknown", "invalidphysicalstate"}

_LINK_LAYERS = {"infiniband": "InfiniBand", "ethernet": "Ethernet"}

_IBSTAT_CA_KEYS = {"CA type", "Switch type", "Router type", "iWARP RNIC type", "??? type", "Number of ports",
                   "Firmware version", "Hardware version", "Node GUID", "System image GUID"}
#: ibstatus's port fields (scripts/ibstatus ``port_status``)
_IBSTATUS_KEYS = {"default gid", "base lid", "sm lid", "state", "phys state", "rate", "link_layer"}
#: an ibv_devinfo field (devinfo.c ``print_hca_cap``/``print_all_port_gids``): a lower-case
#: identifier, a colon, a value
_DEVINFO_FIELD = re.compile(r"^[a-z][a-z0-9_]*:(?:\s|$)")
#: devinfo.c ``transport_str``
_TRANSPORTS = {"infiniband": "InfiniBand", "iwarp": "iWARP", "usnic": "usNIC", "usnic udp": "usNIC UDP",
               "unspecified": None, "invalid transport": None}
_IBSTAT_PORT_KEYS = {"State", "Physical state", "Rate", "Base lid", "LMC", "SM lid", "Capability mask",
                     "Port GUID", "Link layer"}
_IBSTAT_NEEDED = ("State", "Physical state", "Rate", "Link layer")
_IBSTATUS_NEEDED = ("state", "phys state", "rate", "link_layer")
_DEVINFO_NEEDED = ("state", "link_layer")

# how much a reading of a port's state is worth: a netdev carrier (ibdev2netdev) is weaker
# than the RDMA port state itself
_WEAK, _STRONG = 1, 2

_LABEL = {"state": "state", "phys_state": "physical state", "link_layer": "link layer", "rate_gbps": "rate",
          "netdev": "netdev"}


def looks_like(text: str) -> bool:
    """True when ``text`` holds at least one line that only these tools print: an ibstat CA
    header or ibpanic line, an ibstatus port header, an ``hca_id:`` line, an ibdev2netdev
    line, an ``rdma link`` line with a state, or the ibv_devices table header."""
    if not isinstance(text, str):
        return False
    for raw in text.split("\n"):
        s = raw.strip()
        if not s:
            continue
        if (_IBSTAT_CA.match(s) or _IBSTAT_CA_ALONE.match(s) or _IBSTATUS_HDR.match(s) or _DEVINFO_HDR.match(s)
                or _IBDEV2NETDEV.match(s) or _IBDEV2NETDEV_V.match(s) or _IBDEV2NETDEV_OLD.match(s)
                or _IBV_DEVICES_HDR.match(s)
                or s.startswith("ibpanic:")):
            return True
        m = _RDMA_LINK.match(s)
        if m and m.group(3) and "state" in m.group(3).split():
            return True
    return False


def parse(text: str, source: str) -> Topology:
    """Read every ibstat / ibstatus / ibv_devinfo / ibdev2netdev / rdma link / ibv_devices
    output in ``text`` into a Topology (``sources == [source]``, NICs in order of first
    mention, warnings for what was wrong).  Never raises on bad input."""
    return _Reader(text if isinstance(text, str) else "", source).run()


# --- the reader ----------------------------------------------------------------------------


@dataclass
class _Block:
    """An open multi-line block: one ibstat CA, ibstatus port, ibv_devinfo HCA or ibv_devices
    table.  ``seen`` maps port number -> field names read (completeness check at the end)."""

    tool: str
    line: int
    indent: int
    nic: Nic | None = None
    alone: bool = False
    port: int | None = None
    declared_ports: int | None = None
    seen: dict[int, set[str]] = field(default_factory=dict)
    width: int | None = None
    speed: float | None = None
    rates: dict[int, tuple[int | None, float | None]] = field(default_factory=dict)
    pending: list[tuple] = field(default_factory=list)
    pending_text: str = ""


class _Reader:
    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.topo = Topology(sources=[source])
        self.cap = WarningCap(self.topo.warnings, source)
        self.block: _Block | None = None
        self.origin: dict[tuple[str, int, str], tuple[int, int]] = {}   # (nic, port, attr) -> (strength, line)
        self.firsts: dict[tuple, int] = {}   # (tool, device[, port]) -> first line
        self.recognised = False
        self.lineno = 0
        self.defer = False   # the current line is the text's last and has no newline

    # -- warnings and values --

    def warn(self, msg: str, line: int | None = None) -> None:
        line = self.lineno if line is None else line
        self.cap.add(f"{self.source}: line {line}: {msg}")

    def nic(self, name: str, **kw) -> Nic:
        n = self.topo.add_nic(name, kind="rdma", **kw)
        return n

    def first(self, key: tuple, what: str) -> None:
        """Note that ``key`` was seen now; warn when the same tool named it before."""
        if key in self.firsts:
            self.warn(f"{what} appears again (first at line {self.firsts[key]}); the two are merged")
        else:
            self.firsts[key] = self.lineno

    def put(self, nic: Nic, port: int, attr: str, value, strength: int = _STRONG) -> None:
        """Set one port value, or queue it when the current line may be cut (see ``defer``)."""
        if self.defer and self.block is not None:
            self.block.pending.append((nic, port, attr, value, strength, self.lineno))
            return
        self._apply(nic, port, attr, value, strength, self.lineno)

    def _apply(self, nic: Nic, port: int, attr: str, value, strength: int, line: int) -> None:
        p = nic.port(port)
        key = (nic.name, port, attr)
        prev = self.origin.get(key)
        if prev is None:
            setattr(p, attr, value)
            self.origin[key] = (strength, line)
            return
        cur = getattr(p, attr)
        if cur == value:
            if strength > prev[0]:
                self.origin[key] = (strength, line)
            return
        label = _LABEL.get(attr, attr)
        if strength > prev[0]:
            self.warn(f"{nic.name} port {port}: {label} {value} here, {cur} at line {prev[1]} (from a netdev's "
                      f"carrier); using {value}", line)
            setattr(p, attr, value)
            self.origin[key] = (strength, line)
        else:
            self.warn(f"{nic.name} port {port}: {label} {value} here but {cur} at line {prev[1]}; keeping {cur}", line)

    def add_netdev(self, nic: Nic, port: int, netdev: str) -> None:
        """The port's netdev; :meth:`finish` copies port netdevs into ``Nic.netdevs``."""
        self.put(nic, port, "netdev", netdev)

    # -- value readers (None + warning when unreadable) --

    def state(self, text: str, what: str) -> str | None:
        s = text.strip().upper()
        if s.startswith("PORT_"):
            s = s[5:]
        if s in _STATES:
            return _STATES[s]
        if s in _NO_STATE:
            return None
        self.warn(f"unreadable {what} {text.strip()!r}")
        return None

    def phys(self, text: str, what: str) -> str | None:
        k = re.sub(r"[^a-z]", "", text.lower())
        if k in _PHYS:
            return _PHYS[k]
        if k in _NO_PHYS:
            return None
        self.warn(f"unreadable {what} {text.strip()!r}")
        return None

    def link_layer(self, text: str, what: str) -> str | None:
        s = text.strip()
        if s.lower() in _LINK_LAYERS:
            return _LINK_LAYERS[s.lower()]
        if s.lower() != "unknown":
            self.warn(f"unreadable {what} {s!r}")
        return None

    def number(self, text: str, pattern: str, what: str) -> float | None:
        m = re.fullmatch(pattern, text.strip())
        if not m:
            self.warn(f"unreadable {what} {text.strip()!r}")
            return None
        return float(m.group(1))

    # -- main loop --

    def run(self) -> Topology:
        try:
            return self._run()
        finally:
            self.cap.close()

    def _run(self) -> Topology:
        text, too_big = cap_text(self.text, self.source)
        if too_big:
            self.topo.warnings.append(too_big)
        if not text.strip():
            self.topo.warnings.append(f"{self.source}: empty input")
            return self.topo
        m = _BINARY.search(text)
        if m:
            self.warn("control characters or undecodable bytes (binary data?)", text.count("\n", 0, m.start()) + 1)
        lines = text.split("\n")
        unterminated = not text.endswith("\n")
        if not unterminated:
            lines.pop()   # the empty string after the final newline
        for i, raw in enumerate(lines, start=1):
            self.lineno = i
            self.defer = unterminated and i == len(lines)
            try:
                self.line(raw.rstrip("\r"))
            except Exception as e:   # safety net: a bug here must not stop the daemon
                self.warn(f"internal error reading this line ({type(e).__name__}: {e})")
                self.block = None
        self.lineno = len(lines)
        self.defer = False
        self.close()
        self.finish()
        if not self.recognised:
            self.topo.warnings.append(f"{self.source}: no ibstat, ibstatus, ibv_devinfo, ibdev2netdev, rdma link "
                                      f"or ibv_devices output recognised")
        return self.topo

    def line(self, raw: str) -> None:
        s = raw.strip()
        if not s:
            if self.block is not None and self.block.tool == "ibv_devices":
                self.close()
            return
        indent = len(raw.expandtabs(8)) - len(raw.expandtabs(8).lstrip())
        if self.header(s, indent):
            self.recognised = True
            return
        b = self.block
        if b is not None:
            if b.tool == "ibv_devices":
                if self.ibv_devices_row(s):
                    return
            elif indent > b.indent or self.flat_field(b, s):
                {"ibstat": self.ibstat_field, "ibstatus": self.ibstatus_field, "ibv_devinfo": self.devinfo_field}[b.tool](s)
                return
            self.close()
        # a header cut short: say so, rather than skip it as foreign text
        if _IBSTAT_CA_PARTIAL.match(s):
            self.warn(f"unreadable ibstat CA header {s!r}")
        elif _IBSTATUS_PARTIAL.match(s):
            self.warn(f"unreadable ibstatus header {s!r}")
        elif _DEVINFO_PARTIAL.match(s):
            self.warn(f"unreadable ibv_devinfo header {s!r}")
        elif "==>" in s and " port " in s:
            self.warn(f"unreadable ibdev2netdev line {s!r}")

    def header(self, s: str, indent: int) -> bool:
        """Handle a line that starts a block or stands alone; False when it is neither."""
        m = _IBSTAT_CA.match(s) or _IBSTAT_CA_ALONE.match(s)
        if m:
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
        m = _IBSTATUS_HDR.match(s)
        if m:
            self.close()
            name, port = m.group(1), int(m.group(2))
            self.first(("ibstatus", name, port), f"ibstatus device '{name}' port {port}")
            nic = self.nic(name)
            nic.port(port)
            self.block = _Block("ibstatus", self.lineno, indent, nic, port=port)
            self.block.seen[port] = set()
            return True
        m = _DEVINFO_HDR.match(s)
        if m:
            self.close()
            name = m.group(1)
            self.first(("ibv_devinfo", name), f"hca_id {name}")
            self.block = _Block("ibv_devinfo", self.lineno, indent, self.nic(name))
            return True
        if _IBV_DEVICES_HDR.match(s):
            self.close()
            self.block = _Block("ibv_devices", self.lineno, indent)
            return True
        m = _IBPANIC.match(s)
        if m:
            self.close()
            self.ibpanic(m.group(1), m.group(3).strip())
            return True
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
        m = _RDMA_LINK.match(s)
        if m and m.group(3) and any(k in m.group(3).split() for k in ("state", "physical_state", "netdev")):
            self.close()
            self.rdma_link(m.group(1), int(m.group(2)), m.group(3))
            return True
        return False

    # -- single-line formats --

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

    # -- block fields --

    def ibstat_alone_field(self, s: str) -> bool:
        m = _IBSTAT_FIELD.match(s)
        return bool(_IBSTAT_PORT.match(s) or (m and m.group(1) in _IBSTAT_PORT_KEYS))

    def flat_field(self, b: _Block, s: str) -> bool:
        """True when ``s``, not indented deeper than its block's header, still belongs to the
        block: the layout ``ibstat <ca> <port>`` prints (ibstat.c ``port_dump`` with
        ``alone``: no prefix at all), or any output whose indentation was lost on the way (a
        paste, a web page, ``sed 's/^\\s*//'``).  Only a line that is one of the tool's own
        fields counts, so foreign text after a block still ends it."""
        if b.tool == "ibstat":
            m = _IBSTAT_FIELD.match(s)
            return bool(_IBSTAT_PORT.match(s) or (m and (m.group(1) in _IBSTAT_PORT_KEYS
                                                         or (not b.alone and m.group(1) in _IBSTAT_CA_KEYS))))
        if b.tool == "ibstatus":
            return s.partition(":")[0].strip() in _IBSTATUS_KEYS and ":" in s
        if b.tool == "ibv_devinfo":
            return bool(_DEVINFO_FIELD.match(s))
        return False

    def set_transport(self, nic: Nic, transport: str | None) -> None:
        if transport is None:
            return
        if nic.transport is None:
            nic.transport = transport
        elif nic.transport != transport:
            self.warn(f"{nic.name}: transport {transport} here, {nic.transport} before; keeping {nic.transport}")

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

    def ibv_devices_row(self, s: str) -> bool:
        """One line under the ibv_devices header; False when it is not a row (the table
        ended).  A row cut at the end of the text is reported, not used."""
        if _IBV_DEVICES_RULE.match(s):
            return True
        m = _IBV_DEVICES_ROW.match(s)
        if not m:
            if self.defer and re.fullmatch(r"\S+(\s+[0-9A-Fa-f]{0,15})?", s):
                self.warn(f"the text ends in the middle of this ibv_devices row ({s[:60]!r}); not used")
                return True
            return False
        self.first(("ibv_devices", m.group(1)), f"ibv_devices {m.group(1)}")
        self.nic(m.group(1))
        return True

    # -- closing --

    def close(self) -> None:
        """End the open block: check it is whole, then apply or drop values queued from a
        last line that may have been cut."""
        b, self.block = self.block, None
        if b is None or b.tool == "ibv_devices":
            return
        whole = True
        name = b.nic.name
        ports = sorted(p for p in b.seen if p >= 0)
        if b.tool == "ibstat":
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
            needed = _IBSTAT_NEEDED
            what = f"CA '{name}'"
        elif b.tool == "ibstatus":
            needed = _IBSTATUS_NEEDED
            what = f"ibstatus {name} port {b.port}"
        else:
            if b.declared_ports is None:
                self.warn(f"hca_id {name}: no readable phys_port_cnt line (output cut short?)", b.line)
                whole = False
            elif len(ports) < b.declared_ports:
                self.warn(f"hca_id {name}: {len(ports)} of {b.declared_ports} port(s) printed "
                          f"(output cut short?)", b.line)
                whole = False
            needed = _DEVINFO_NEEDED
            what = f"hca_id {name}"
        for p in ports:
            missing = [k for k in needed if k not in b.seen[p]]
            if missing:
                whole = False
                self.warn(f"{what}: port {p} has no {', '.join(missing)} line (output cut short?)", b.line)
        if b.pending:
            if whole:
                for args in b.pending:
                    self._apply(*args)
            else:
                self.warn(f"the text ends in the middle of this line ({b.pending_text[:60]!r}); its value is not "
                          f"used", b.pending[0][5])
        for p, (w, sp) in b.rates.items():
            if w is not None and sp is not None:
                self._apply(b.nic, p, "rate_gbps", w * sp, _STRONG, b.line)

    def finish(self) -> None:
        """Whole-topology readings: a DOWN port whose physical state is Polling or Disabled
        is reported by that physical state."""
        for n in self.topo.nics:
            for p in n.ports:
                if p.state == "DOWN" and p.phys_state in ("Polling", "Disabled"):
                    p.state = p.phys_state.upper()
                if p.netdev and p.netdev not in n.netdevs:
                    n.netdevs.append(p.netdev)
