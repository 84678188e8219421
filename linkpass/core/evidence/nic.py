"""NIC evidence: mlx5_core and netdev lines (port and link state, cable/module events, PCI
error recovery, health and firmware command failures, driver probe/unload), bonding slaves.

Link events are faults only on compute rails: with a topology (``topology.model.Topology``,
analysed, as ``linkpass topology --from`` reads it), a port of a NIC whose role is not
``compute`` is ``benign``.  Without one, a link-down or cable-unplugged event is benign when the
port was never seen up and the driver probed (boot) or unloaded the device shortly before;
an INIT->ACTIVE bring-up is benign.

Sources: Linux drivers/net/ethernet/mellanox/mlx5/core (``mlx5_core_info``/``mlx5_core_warn``
prefixes ``mlx5_core <bus>: ``; port module events in events.c; ``mlx5_pci_err_detected`` in
main.c), drivers/net/bonding/bond_main.c ("link status definitely up/down").
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import BOOT_WINDOW_S, BUSPAT, COLLATERAL_WINDOW_S, Ev, Inc, bus_id, close

#: fixed NIC messages -> (code, domain, action, remedy)
FIXED: dict[str, tuple[str, str, str, str]] = {
    "insufficient_power": ("mlx5:insufficient_power", "benign", "none", "none"),
    "health": ("mlx5:health_compromised", "nic-device", "reroute", "reboot-node"),
    "pci_offline": ("mlx5:pci_channel_offline", "nic-device", "reroute", "reboot-node"),
    "cmd_timeout": ("mlx5:cmd_timeout", "nic-device", "reroute", "reboot-node"),
}

#: the NIC faults whose evidence explains RDMA completion errors on the same HCA
NIC_FAULT_KINDS = ("link_down", "cable_unplugged", "cable_error", "nic_pci", "health", "pci_offline", "cmd_timeout")

_ST = re.compile

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("nic_pci", _ST(r"mlx5_core (" + BUSPAT + r"): mlx5_pci_(?:err_detected|slot_reset|resume)\b(.*)$")),
    ("pci_offline", _ST(r"mlx5_core (" + BUSPAT + r"):.*PCI channel offline")),
    ("health", _ST(r"mlx5_core (" + BUSPAT + r"):.*(?:health compromised|unrecoverable|FW fatal)")),
    ("cmd_timeout", _ST(r"mlx5_core (" + BUSPAT + r"):.*cmd_work_handler.*timeout")),
    ("insufficient_power", _ST(r"mlx5_core (" + BUSPAT + r"):.*insufficient power on the PCIe slot")),
    ("cable", _ST(r"mlx5_core (" + BUSPAT + r"): Port module event(?:\[error\])?: module \d+, Cable (plugged|unplugged|error)")),
    ("port", _ST(r"mlx5_core (" + BUSPAT + r") (\S+): Port: (\d+) Link (ACTIVE|DOWN|INIT|ARMED|ACTIVE_DEFER)\b")),
    ("link", _ST(r"(?:mlx5_core (" + BUSPAT + r") )(\S+): Link (up|down)\b")),
    ("link", _ST(r"^()(?:\S+ " + BUSPAT + r" )?(\S+): (?:NIC )?Link is (Up|Down)\b")),
    ("rename", _ST(r"mlx5_core (" + BUSPAT + r") (\S+): renamed from (\S+)")),
    ("probe", _ST(r"mlx5_core (" + BUSPAT + r"): (?:firmware version|.*available PCIe bandwidth|E-Switch: Total vports|"
                  r"Rate limit:|MLX5E: StrdRq|Port module event)")),
    ("unload", _ST(r"mlx5_core (" + BUSPAT + r")[ :].*(?:remove_one|Shutdown was called|E-Switch: cleanup|"
                   r"E-Switch: Disable|mlx5_unload|teardown)")),
]


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groups()
    if kind == "nic_pci":
        return {"bus": bus_id(g[0]), "recovered": "recovered" in g[1] or "resume" in msg and "Exit" in g[1]}
    if kind in ("pci_offline", "health", "cmd_timeout", "insufficient_power", "probe", "unload"):
        return {"bus": bus_id(g[0])}
    if kind == "cable":
        return {"bus": bus_id(g[0]), "what": g[1]}
    if kind == "port":
        return {"bus": bus_id(g[0]), "ibdev": g[1], "port": int(g[2]), "state": g[3]}
    if kind == "link":
        return {"bus": bus_id(g[0]) if g[0] else None, "netdev": g[1], "up": g[2].lower() == "up"}
    if kind == "rename":
        return {"bus": bus_id(g[0]), "netdev": g[1], "old": g[2]}
    if kind == "bond":
        return {"netdev": g[0], "up": g[1] == "up"}
    return {}


class Rules:
    """The NIC family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin)."""

    def before_events(self) -> None:
        """The NIC names the input itself gives: netdev and RDMA device -> PCI function."""
        self.probes: dict[str, list[tuple[int, tuple]]] = {}
        self.unloads: dict[str, list[tuple[int, tuple]]] = {}
        self.fstate: dict[str, str] = {}
        for ev in self.events:
            f = ev.f
            if ev.kind in ("link", "rename") and f.get("bus") and f.get("netdev"):
                self.bus_of_netdev[f["netdev"]] = f["bus"]
            if ev.kind == "port" and f.get("bus"):
                self.bus_of_ibdev[f["ibdev"]] = f["bus"]
                self.ibdev_of_bus[f["bus"]] = f["ibdev"]
                self.port_of_bus[f["bus"]] = f["port"]

    def ev_insufficient_power(self, ev: Ev) -> None:
        self.fixed("insufficient_power", ev)  # platform noise on every function: one host-level item

    def _nic_fixed(self, what: str, ev: Ev) -> None:
        b = ev.f["bus"]
        self.fixed(what, ev, fkey=self.fkey(bus=b), device=b)

    def ev_health(self, ev: Ev) -> None:
        self._nic_fixed("health", ev)

    def ev_pci_offline(self, ev: Ev) -> None:
        self._nic_fixed("pci_offline", ev)

    def ev_cmd_timeout(self, ev: Ev) -> None:
        self._nic_fixed("cmd_timeout", ev)

    def ev_nic_pci(self, ev: Ev) -> None:
        b = ev.f["bus"]
        inc = self.new("mlx5:pci_slot_reset", ("mlx5:pci_slot_reset", b), "nic_pci", ("nic-device", "reroute", "reboot-node"),
                       ev, fkey=self.fkey(bus=b), device=b)
        inc.x["recovered"] = inc.x.get("recovered", False) or ev.f["recovered"]

    def ev_probe(self, ev: Ev) -> None:
        self.probes.setdefault(self.fkey(bus=ev.f["bus"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    ev_rename = ev_probe

    def ev_unload(self, ev: Ev) -> None:
        self.unloads.setdefault(self.fkey(bus=ev.f["bus"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    def ev_cable(self, ev: Ev) -> None:
        fk = self.fkey(bus=ev.f["bus"])
        what = ev.f["what"]
        if what == "plugged":
            for code in ("mlx5:cable_unplugged", "mlx5:cable_error", "mlx5:link_down"):
                open_ = self.index.get((code, fk))
                if open_ is not None and not open_.x.get("recovered"):
                    open_.add(ev)
                    open_.x["recovered"] = True
                    return
            self.new("mlx5:cable_plugged", ("mlx5:cable_plugged", fk), "cable_plugged", ("benign", "none", "none"), ev,
                     fkey=fk, device=ev.f["bus"])
            return
        code = f"mlx5:cable_{what}"
        inc = self.new(code, (code, fk), f"cable_{what}", ("nic-link", "reroute", "replace-part"), ev, fkey=fk, device=ev.f["bus"])
        inc.x["in_use"] = inc.x.get("in_use", False) or self.fstate.get(fk or "") == "up"

    def ev_port(self, ev: Ev) -> None:
        f = ev.f
        fk = self.fkey(bus=f["bus"], ibdev=f["ibdev"])
        st = f["state"]
        kw = {"ibdev": f["ibdev"], "port": f["port"]}
        if st == "ACTIVE":
            self.up(ev, fk, False, kw)
        elif st == "DOWN" or (st == "INIT" and self.fstate.get(fk or "") == "up"):
            self.down(ev, fk, False, kw)
        elif st == "INIT":
            inc = self.new("mlx5:port_init", ("mlx5:port_init", fk), "port_init", ("benign", "none", "none"), ev, fkey=fk)
            inc.x.update(kw)
        else:  # ARMED, ACTIVE_DEFER: on the way up
            inc = self.index.get(("mlx5:port_init", fk))
            if inc is not None:
                inc.add(ev)

    def ev_link(self, ev: Ev) -> None:
        f = ev.f
        fk = self.fkey(bus=f["bus"], netdev=f["netdev"])
        (self.up if f["up"] else self.down)(ev, fk, False, {"netdev": f["netdev"]})

    def ev_bond(self, ev: Ev) -> None:
        f = ev.f
        fk = self.fkey(netdev=f["netdev"])
        (self.up if f["up"] else self.down)(ev, fk, True, {"netdev": f["netdev"]})

    def down(self, ev: Ev, fk: str | None, bond: bool, kw: dict) -> None:
        was_up = self.fstate.get(fk or "") == "up"
        self.fstate[fk or ""] = "down"
        key = ("mlx5:link_down", fk)
        inc = self.index.get(key)
        if inc is None:
            inc = self.new("mlx5:link_down", key, "link_down", ("nic-link", "reroute", "replace-part"), ev, fkey=fk)
            inc.x.update(downs=1, cur="down", in_use=False, recovered=False)
        else:
            inc.add(ev)
            if inc.x["cur"] == "up":  # down again after it came back: the fault happening again
                inc.occ.append(ev.rec.first_line)
                inc.x["downs"] += 1
                inc.x["cur"] = "down"
        inc.x["in_use"] = inc.x["in_use"] or was_up or bond
        for k, v in kw.items():
            inc.x.setdefault(k, v)

    def up(self, ev: Ev, fk: str | None, bond: bool, kw: dict) -> None:
        self.fstate[fk or ""] = "up"
        inc = self.index.get(("mlx5:link_down", fk))
        if inc is not None:
            inc.add(ev)
            if inc.x["cur"] == "down":
                inc.x["cur"] = "up"
                inc.x["recovered"] = True
            return
        for code in ("mlx5:port_init", "mlx5:link_up"):
            inc = self.index.get((code, fk))
            if inc is not None:
                inc.add(ev)
                return
        if bond:
            return
        inc = self.new("mlx5:link_up", ("mlx5:link_up", fk), "link_up", ("benign", "none", "none"), ev, fkey=fk)
        inc.x.update(kw)

    # -- readings that need the whole input

    def boot_noise(self, inc: Inc) -> bool:
        """The driver probed the function shortly before (boot), or unloaded it around then."""
        fk = inc.fkey or ""
        first = (inc.first, inc.stamps[0])
        if any(line < first[0] and close(st, first[1], BOOT_WINDOW_S) for line, st in self.probes.get(fk, [])):
            return True
        return any(close(st, first[1], BOOT_WINDOW_S) or close(first[1], st, BOOT_WINDOW_S)
                   for _, st in self.unloads.get(fk, []))


    def read_link_fault(self, inc: Inc) -> None:
        role = self.role(inc)
        if role is not None:
            fault = role == "compute"
        elif inc.kind == "cable_error" or inc.x.get("in_use") or inc.x.get("downs", 1) >= 2:
            fault = True
        else:
            fault = not self.boot_noise(inc)
        if fault:
            single = inc.kind == "link_down" and inc.x.get("downs", 1) == 1 and inc.x.get("recovered")
            inc.domain, inc.action, inc.remedy = "nic-link", "reroute", "observe" if single else "replace-part"
        else:
            inc.domain, inc.action, inc.remedy = "benign", "none", "none"
        if inc.kind == "link_down":
            inc.device = self.port_label(inc)

    read_link_down = read_cable_unplugged = read_cable_error = read_link_fault

    def read_port_state(self, inc: Inc) -> None:
        inc.device = self.port_label(inc)

    read_port_init = read_link_up = read_port_state

    def read_nic_device(self, inc: Inc) -> None:
        if inc.kind == "nic_pci" and inc.x.get("recovered"):
            inc.action, inc.remedy = "none", "observe"
        role = self.role(inc)
        if role is not None and role != "compute":
            inc.action = "none"

    read_nic_pci = read_health = read_pci_offline = read_cmd_timeout = read_nic_device

    # -- follow-on events -> their roots

    def link_nic_pci(self, x: Inc) -> None:
        gpus = self.roots_like(lambda i: i.domain == "gpu" and i.gpu is not None and i.parent is None)
        root = self.nearest_earlier(x, gpus, COLLATERAL_WINDOW_S)
        if root is not None:
            self.secondary(x, root, False, keep_reading=True)

    def link_port_event(self, x: Inc) -> None:
        kind = x.kind
        if kind == "cable_plugged":
            if any(line < x.first and close(st, x.stamps[0], BOOT_WINDOW_S) for line, st in self.probes.get(x.fkey or "", [])):
                x.dropped = True  # the probe-time report of a cable that is simply there
            return
        codes = ("cable_unplugged", "cable_error") + (("cable_plugged",) if kind == "link_up" else ())
        cables = self.roots_like(lambda i: i.kind in codes and i.fkey == x.fkey)
        root = self.nearest_earlier(x, cables, float("inf"))
        if root is not None:
            self.secondary(x, root, True)
        elif kind == "link_up":
            x.dropped = True  # a port coming up with nothing before it: normal bring-up

    link_link_down = link_link_up = link_cable_plugged = link_port_event
