"""What every evidence family shares: the output vocabulary, the record-level event, the
incident being built, PCI bus ids, time windows, and the topology view.  Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from linkpass.core.logparse import Record

DOMAINS = ("gpu", "nvlink", "gpu-memory", "nic-link", "nic-device", "app", "config", "benign", "unattributed")
ACTIONS = ("none", "reroute", "migrate-rank")
REMEDIES = ("none", "observe", "reset-gpu", "reboot-node", "drain-node", "replace-part", "check-config")

#: seconds within which a follow-on is linked to an earlier root (when the stamps compare)
FOLLOW_WINDOW_S = 120.0
#: seconds after a GPU reset within which a NIC's PCI error recovery is collateral
COLLATERAL_WINDOW_S = 5.0
#: seconds after a driver probe (or around an unload) within which a port event is boot/unload noise
BOOT_WINDOW_S = 300.0

SERIOUS = ("reset-gpu", "drain-node", "reboot-node", "replace-part")
DEVICE_DOMAINS = ("gpu", "nvlink", "gpu-memory")


def bus_id(text: str | None) -> str | None:
    """Full lower-case PCI bus id from ``0000:a1:00``, ``00000000:08:00.0``, ``A1:00.0``; None if not one."""
    if not text:
        return None
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?", text.strip())
    if not m:
        return None
    return f"{int(m.group(1) or '0', 16):04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4) or '0'}"


#: a PCI bus id as drivers print it (``0000:91:00.0``, NVRM's ``00000000:08:00``)
BUSPAT = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"


@dataclass
class Ev:
    """One recognised record: ``kind`` (the family's name for it), the record, its fields."""

    kind: str
    rec: Record
    f: dict[str, Any]


# incidents


@dataclass
class Incident:
    """One incident (see the module docstring for the fields' meanings).

    ``count`` (events collapsed into it), ``summary`` (the first message) and ``lines`` (the
    sorted 1-based lines at which the incident happened: its first event and each repeat of
    it, not the related events collapsed into it such as a link coming back up, so a live
    follower can tell a recurrence from the first sighting) are not part of :meth:`to_json`.
    """

    domain: str
    device: str | None
    code: str
    action: str
    remedy: str
    secondary_of: int | None
    first_line: int
    last_line: int
    count: int = 1
    summary: str = ""
    lines: tuple[int, ...] = ()
    known: bool = True

    def to_json(self) -> dict:
        """The issue's fields, then ``known``: False when the line is of a known family but its
        code is in none of the family's tables (an unknown Xid number, an unknown AER error
        name): the reading then comes from the family's rules alone."""
        return {"domain": self.domain, "device": self.device, "code": self.code, "action": self.action,
                "remedy": self.remedy, "secondary_of": self.secondary_of, "first_line": self.first_line,
                "last_line": self.last_line, "known": self.known}


@dataclass
class Classification:
    """:func:`classify_report`'s result: incidents, the number of input lines, the numbers of
    the lines skipped as unreadable, how many records were recognised as evidence, and
    ``error``: None, or one line saying that the classifier itself failed and at which input
    line (then ``incidents`` is incomplete and must not be read as "nothing found")."""

    incidents: list[Incident]
    lines: int
    skipped: list[int]
    recognised: int
    error: str | None = None


@dataclass
class Inc:
    """An incident while it is being built (:class:`Incident` is what leaves): ``key`` collapses
    repeats, ``kind`` names the family's rule set, ``fkey`` the NIC function, ``x`` the family's
    own facts, ``parent`` the root it follows from."""

    code: str
    key: tuple
    kind: str
    domain: str
    action: str
    remedy: str
    lines: list[int]
    last: int
    stamps: list[tuple[float | None, str | None]]
    summary: str
    gpu: str | None = None
    fkey: str | None = None
    device: str | None = None
    x: dict[str, Any] = field(default_factory=dict)
    parent: "Inc | None" = None
    dropped: bool = False
    own: bool = True  # keeps its own domain when made a secondary
    known: bool = True  # the code is in the family's tables (see Incident.known)
    occ: list[int] = field(default_factory=list)  # lines of the events that are this incident happening (again)

    @property
    def first(self) -> int:
        return min(self.lines)

    def again(self, ev: Ev) -> None:
        """``ev`` is this incident happening again (a repeat), not a related event (a recovery)."""
        self.add(ev)
        self.occ.append(ev.rec.first_line)

    def add(self, ev: Ev) -> None:
        self.lines.append(ev.rec.first_line)
        self.last = max(self.last, ev.rec.last_line)
        self.stamps.append((ev.rec.ts, ev.rec.clock))


def close(a: tuple[float | None, str | None], b: tuple[float | None, str | None], window: float) -> bool:
    """b happened at most ``window`` s after a (or stamps do not compare: then order decides)."""
    if a[0] is None or b[0] is None or a[1] != b[1]:
        return True
    return -1.0 <= b[0] - a[0] <= window


class Topo:
    """What the classifier needs from an analysed ``topology.model.Topology`` (duck-typed)."""

    def __init__(self, topo: Any) -> None:
        self.by_bus: dict[str, Any] = {}
        self.by_name: dict[str, Any] = {}
        self.by_netdev: dict[str, tuple[Any, int | None]] = {}
        for n in getattr(topo, "nics", None) or []:
            name = getattr(n, "name", None)
            if name:
                self.by_name[name] = n
            bus = bus_id(getattr(n, "pci_bus_id", None))
            if bus:
                self.by_bus[bus] = n
            for d in getattr(n, "netdevs", None) or []:
                self.by_netdev.setdefault(d, (n, None))
            for p in getattr(n, "ports", None) or []:
                if getattr(p, "netdev", None):
                    self.by_netdev[p.netdev] = (n, getattr(p, "port", None))

    def nic(self, bus: str | None = None, netdev: str | None = None, ibdev: str | None = None) -> tuple[Any, int | None]:
        if ibdev and ibdev in self.by_name:
            return self.by_name[ibdev], None
        if netdev and netdev in self.by_netdev:
            return self.by_netdev[netdev]
        if bus and bus in self.by_bus:
            return self.by_bus[bus], None
        return None, None


