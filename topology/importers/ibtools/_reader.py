"""The reader behind :func:`topology.importers.ibtools.parse`: one pass over the text, line by
line, that hands each line to the tool whose format it is (the ``*Lines`` classes of the tool
modules), keeps the open block, and merges every reading into one Topology (first reading
wins, a port state beats a netdev carrier, each conflict a warning).  Pure."""

from __future__ import annotations

import re

from topology.importers._bounds import WarningCap, cap_text
from topology.importers.ibtools._common import (
    _BINARY,
    _LABEL,
    _LINK_LAYERS,
    _NO_PHYS,
    _NO_STATE,
    _PHYS,
    _STATES,
    _STRONG,
    _Block,
)
from topology.importers.ibtools.ibdev2netdev import Ibdev2netdevLines
from topology.importers.ibtools.ibstat import IbstatLines
from topology.importers.ibtools.ibstatus import IbstatusLines
from topology.importers.ibtools.ibv_devices import IbvDevicesLines
from topology.importers.ibtools.ibv_devinfo import DevinfoLines
from topology.importers.ibtools.rdma_link import RdmaLinkLines
from topology.model import Nic, Topology


class _Reader(IbstatLines, IbstatusLines, DevinfoLines, Ibdev2netdevLines, RdmaLinkLines, IbvDevicesLines):
    """Reads one text; :meth:`run` returns its Topology.  The tool parts it is made of read their
    own lines through the shared methods here (``warn``, ``nic``, ``first``, ``put``, the value
    readers, ``close``) and keep the open block in ``self.block``."""

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
        self.ibstat_partial(s) or self.ibstatus_partial(s) or self.devinfo_partial(s) or self.ibdev2netdev_partial(s)

    def header(self, s: str, indent: int) -> bool:
        """Handle a line that starts a block or stands alone; False when it is neither.  The
        order matters: an ``ibwarn:`` line would also read as an ibdev2netdev one."""
        return (self.ibstat_header(s, indent) or self.ibstatus_header(s, indent) or self.devinfo_header(s, indent)
                or self.ibv_devices_header(s, indent) or self.ibpanic_header(s) or self.ibdev2netdev_header(s)
                or self.rdma_link_header(s))

    # -- block fields --

    def flat_field(self, b: _Block, s: str) -> bool:
        """True when ``s``, not indented deeper than its block's header, still belongs to the
        block: the layout ``ibstat <ca> <port>`` prints (ibstat.c ``port_dump`` with
        ``alone``: no prefix at all), or any output whose indentation was lost on the way (a
        paste, a web page, ``sed 's/^\\s*//'``).  Only a line that is one of the tool's own
        fields counts, so foreign text after a block still ends it."""
        if b.tool == "ibstat":
            return self.ibstat_flat_field(b, s)
        if b.tool == "ibstatus":
            return self.ibstatus_flat_field(b, s)
        if b.tool == "ibv_devinfo":
            return self.devinfo_flat_field(b, s)
        return False

    def set_transport(self, nic: Nic, transport: str | None) -> None:
        if transport is None:
            return
        if nic.transport is None:
            nic.transport = transport
        elif nic.transport != transport:
            self.warn(f"{nic.name}: transport {transport} here, {nic.transport} before; keeping {nic.transport}")

    # -- closing --

    def close(self) -> None:
        """End the open block: check it is whole, then apply or drop values queued from a
        last line that may have been cut."""
        b, self.block = self.block, None
        if b is None or b.tool == "ibv_devices":
            return
        ports = sorted(p for p in b.seen if p >= 0)
        check = {"ibstat": self.ibstat_check, "ibstatus": self.ibstatus_check, "ibv_devinfo": self.devinfo_check}[b.tool]
        whole, needed, what = check(b, ports)
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
