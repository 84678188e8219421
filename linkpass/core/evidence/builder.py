"""The classifier's engine: records -> events (each family's :data:`PATTERNS`, first match
wins) -> incidents (the families' ``ev_<kind>`` rules, repeats collapsed) -> readings that
need the whole input (``read_<kind>``) -> follow-on events linked to their roots
(``link_<kind>``) -> :class:`Incident` list, roots first.

A family is a module with ``PATTERNS``, ``fields(kind, match, msg)``, optionally ``FIXED``
(code tables for :meth:`Builder.fixed`) and a ``Rules`` mixin whose methods the builder calls
by name: ``ev_<event kind>(ev)``, ``read_<incident kind>(inc)``, ``link_<incident kind>(x)``,
and the hooks ``before_events()``, ``after_events()``, ``after_links()``.  Adding a family is
one module plus its entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from linkpass.core.evidence import gpu, nccl, nic, pcie, rdma
from linkpass.core.evidence.base import (FOLLOW_WINDOW_S, Classification, Ev, Inc, Incident, Topo, bus_id, close)
from linkpass.core.logparse import Record, parse_lines

#: the families, in the order their patterns are tried (RDMA completions and async events
#: first: their lines carry words other families look for; NCCL's generic symptoms last)
FAMILIES = (rdma, gpu, pcie, nic, nccl)

#: (kind, pattern, family) tried in order on each record's message; the first that matches wins
PATTERNS: list[tuple[str, re.Pattern, Any]] = [(k, p, fam) for fam in FAMILIES for k, p in fam.PATTERNS]

#: fixed messages of every family -> (code, domain, action, remedy)
FIXED: dict[str, tuple[str, str, str, str]] = {k: v for fam in FAMILIES for k, v in getattr(fam, "FIXED", {}).items()}


class ClassifierError(Exception):
    """The classifier itself failed (a bug, never the input's fault); the message names the
    input line it was reading."""


def events(records: list[Record]) -> list[Ev]:
    """The records some family recognises, as events (in input order)."""
    out: list[Ev] = []
    for r in records:
        for kind, pat, fam in PATTERNS:
            m = pat.search(r.msg)
            if m and kind == "xid" and m.group(3) is None and r.cut:
                continue  # "...Xid (PCI:0000:91:00): 7" cut off: the code may be the start of 79
            if m:
                try:
                    f = fam.fields(kind, m, r.msg)
                except Exception as e:  # noqa: BLE001 - said with the line, never silence
                    raise ClassifierError(f"line {r.first_line}: {fam.__name__.rsplit('.', 1)[-1]} rule {kind!r} failed: "
                                          f"{type(e).__name__}: {e}") from e
                out.append(Ev(kind, r, f))
                break
    return out


def classify(lines: Iterable, topology: Any = None) -> list[Incident]:
    """Incidents in ``lines`` (str or bytes, one log line each); see :mod:`linkpass.core.classify`.

    ``topology``: an analysed ``topology.model.Topology`` (NIC roles), or None.

    Raises:
        ClassifierError: the classifier itself failed (the message names the input line).
    """
    rep = classify_report(lines, topology)
    if rep.error:
        raise ClassifierError(rep.error)
    return rep.incidents


def classify_text(text: str | bytes, topology: Any = None) -> list[Incident]:
    """:func:`classify` of a whole text (split into lines here, line ends kept: a last line
    without one is cut off, see :attr:`linkpass.core.logparse.Record.cut`)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    return classify(str(text).splitlines(keepends=True), topology)


def classify_report(lines: Iterable, topology: Any = None) -> Classification:
    """Like :func:`classify`, with the counts: input lines, skipped (unreadable) line numbers,
    records recognised as evidence.  Never raises: when the classifier itself fails, the
    result's ``error`` says so in one line with the input line it was at (and the incidents
    are empty: an incomplete reading is not offered as the reading)."""
    try:
        parsed = parse_lines(lines)
    except Exception as e:  # noqa: BLE001 - an iterable that fails while being read
        return Classification([], 0, [], 0, error=f"reading the input failed: {type(e).__name__}: {e}"[:300])
    evs: list[Ev] = []
    try:
        evs = events(parsed.records)
        incidents = Builder(evs, topology).run()
    except ClassifierError as e:
        return Classification([], parsed.lines, parsed.skipped, len(evs), error=str(e)[:300])
    except Exception as e:  # noqa: BLE001 - a classifier bug must not take the caller down, nor hide
        line = getattr(e, "linkpass_line", None)
        where = f"line {line}: " if line else ""
        return Classification([], parsed.lines, parsed.skipped, len(evs),
                              error=f"{where}internal error: {type(e).__name__}: {e}"[:300])
    return Classification(incidents, parsed.lines, parsed.skipped, len(evs))


class Builder(*(fam.Rules for fam in FAMILIES)):
    """Events -> incidents (see the module docstring)."""

    def __init__(self, events: list[Ev], topology: Any) -> None:
        self.events = events
        self.topo = Topo(topology) if topology is not None else None
        self.incs: list[Inc] = []
        self.index: dict[tuple, Inc] = {}
        self.pos = 0  # index in ``events`` of the event being handled
        # registry of NIC names seen in the input (the NIC family fills it)
        self.bus_of_netdev: dict[str, str] = {}
        self.bus_of_ibdev: dict[str, str] = {}
        self.ibdev_of_bus: dict[str, str] = {}
        self.port_of_bus: dict[str, int] = {}

    def _hooks(self, name: str) -> None:
        for fam in FAMILIES:
            fn = fam.Rules.__dict__.get(name)
            if fn is not None:
                fn(self)

    # -- names ---------------------------------------------------------------------------------

    def fkey(self, bus: str | None = None, netdev: str | None = None, ibdev: str | None = None) -> str | None:
        b = bus or (self.bus_of_netdev.get(netdev) if netdev else None) or (self.bus_of_ibdev.get(ibdev) if ibdev else None)
        if not b and self.topo:
            nic, _ = self.topo.nic(netdev=netdev, ibdev=ibdev)
            if nic is not None:
                b = bus_id(getattr(nic, "pci_bus_id", None)) or f"nic:{nic.name}"
        return b or (f"netdev:{netdev}" if netdev else f"ibdev:{ibdev}" if ibdev else None)

    def nic_of(self, inc: Inc) -> Any:
        if not self.topo:
            return None
        fk = inc.fkey or ""
        bus = fk if bus_id(fk) == fk else None
        nic, _ = self.topo.nic(bus=bus, netdev=inc.x.get("netdev"), ibdev=inc.x.get("ibdev") or self.ibdev_of_bus.get(fk))
        if nic is None and fk.startswith("nic:"):
            nic = self.topo.by_name.get(fk[4:])
        return nic

    def role(self, inc: Inc) -> str | None:
        nic = self.nic_of(inc)
        return getattr(nic, "role", None) if nic is not None else None

    def port_label(self, inc: Inc) -> str | None:
        fk = inc.fkey or ""
        ibdev = inc.x.get("ibdev") or self.ibdev_of_bus.get(fk)
        port = inc.x.get("port") or self.port_of_bus.get(fk)
        if ibdev:
            return f"{ibdev}/{port}" if port else ibdev
        nic = self.nic_of(inc)
        if nic is not None and not bus_id(nic.name):
            tport = self.topo.by_netdev.get(inc.x.get("netdev") or "", (None, None))[1] if self.topo else None
            p = tport or port or (nic.ports[0].port if len(getattr(nic, "ports", []) or []) == 1 else None)
            return f"{nic.name}/{p}" if p else nic.name
        if inc.x.get("netdev"):
            return inc.x["netdev"]
        if fk.startswith(("netdev:", "ibdev:", "nic:")):
            return fk.split(":", 1)[1]
        return fk or None

    # -- phase 1: events -> incidents (collapsing repeats) --------------------------------------

    def new(self, code: str, key: tuple, kind: str, reading: tuple[str, str, str], ev: Ev, **kw) -> Inc:
        inc = self.index.get(key)
        if inc is not None:
            inc.again(ev)
            return inc
        inc = Inc(code, key, kind, reading[0], reading[1], reading[2], [ev.rec.first_line], ev.rec.last_line,
                   [(ev.rec.ts, ev.rec.clock)], ev.rec.msg[:200], **kw)
        inc.occ.append(ev.rec.first_line)
        self.incs.append(inc)
        self.index[key] = inc
        return inc

    def fixed(self, what: str, ev: Ev, **kw) -> Inc:
        code, dom, act, rem = FIXED[what]
        dev = kw.get("device")
        return self.new(code, (code, dev), what, (dom, act, rem), ev, **kw)

    def run(self) -> list[Incident]:
        self._hooks("before_events")
        for i, ev in enumerate(self.events):
            self.pos = i
            handler = getattr(self, "ev_" + ev.kind, None)
            if handler is not None:
                try:
                    handler(ev)
                except Exception as e:
                    e.linkpass_line = ev.rec.first_line
                    raise
        self._hooks("after_events")
        for inc in self.incs:
            reader = getattr(self, "read_" + inc.kind, None)
            if reader is not None:
                self._at(reader, inc)
        for x in sorted(self.incs, key=lambda i: i.first):
            if not x.dropped:
                linker = getattr(self, "link_" + x.kind, None)
                if linker is not None:
                    self._at(linker, x)
        self._hooks("after_links")
        return self.output()

    @staticmethod
    def _at(fn, inc: Inc) -> None:
        try:
            fn(inc)
        except Exception as e:
            e.linkpass_line = inc.first
            raise

    # -- follow-on events -> their roots: what the families' link_<kind> rules use ---------------

    @staticmethod
    def latest_before(inc: Inc, line: int) -> int:
        return max((x for x in inc.lines if x < line), default=-1)

    def nearest_earlier(self, x: Inc, cands: list[Inc], window: float = FOLLOW_WINDOW_S) -> Inc | None:
        best, best_line = None, -1
        for c in cands:
            if c is x or c.dropped or c.first >= x.first:
                continue
            line = self.latest_before(c, x.first)
            st = c.stamps[c.lines.index(line)] if line in c.lines else c.stamps[0]
            if close(st, x.stamps[0], window) and line > best_line:
                best, best_line = c, line
        return best


    def secondary(self, x: Inc, root: Inc, inherit: bool, keep_reading: bool = False) -> None:
        x.parent = root
        if inherit:
            x.domain = root.domain
        if not keep_reading:
            x.action, x.remedy = "none", "none"

    def roots_like(self, pred) -> list[Inc]:
        return [i for i in self.incs if not i.dropped and pred(i)]


    # -- output ----------------------------------------------------------------------------------

    def output(self) -> list[Incident]:
        live = [i for i in self.incs if not i.dropped]
        for i in live:
            seen = set()
            while i.parent is not None and i.parent.parent is not None and id(i.parent) not in seen:
                seen.add(id(i.parent))
                i.parent = i.parent.parent
            if i.parent is not None and (i.parent.dropped or i.parent.parent is not None):
                i.parent = None
        roots = sorted((i for i in live if i.parent is None), key=lambda i: (i.first, i.last))
        secs = sorted((i for i in live if i.parent is not None), key=lambda i: (i.first, i.last))
        pos = {id(r): n for n, r in enumerate(roots)}
        out = []
        for i in roots + secs:
            out.append(Incident(i.domain, i.device, i.code, i.action, i.remedy,
                                pos[id(i.parent)] if i.parent is not None else None,
                                i.first, max(i.last, max(i.lines)), len(i.lines), i.summary, tuple(sorted(i.occ or i.lines)),
                                i.known))
        return out
