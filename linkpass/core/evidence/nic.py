"""NIC evidence: mlx5_core and netdev lines (port and link state, cable/module events, PCI
error recovery, firmware health, firmware command failures and timeouts, driver probe/unload).

Link events are faults only on compute rails: with a topology (``topology.model.Topology``,
analysed, as ``linkpass topology --from`` reads it), a port of a NIC whose role is not
``compute`` is ``benign``.  Without one, a link-down or cable-unplugged event is benign when the
port was never seen up and the driver probed (boot) or unloaded the device shortly before;
an INIT->ACTIVE bring-up is benign.

Every pattern and table below is taken from what the Linux driver prints (torvalds/linux,
``drivers/net/ethernet/mellanox/mlx5/core``, read across the 4.x, 5.x and 6.x wordings):

* Prefixes (``mlx5_core.h``): ``mlx5_core_err/_warn/_err_rl`` and ``mlx5_log`` print
  ``"mlx5_core <bus>: %s:%d:(pid %d): " fmt`` (``__func__``, ``__LINE__``, pid); before 4.12
  ``"mlx5_core <bus>: <name>:%s:%d:(pid %d): "``; ``mlx5_core_info`` prints no function prefix;
  ``netdev_info`` prints ``"mlx5_core <bus> <netdev>: "`` (``(unnamed net_device)
  (uninitialized)`` before the netdev is registered); ``ibdev_info`` prints
  ``"mlx5_core <bus> <ibdev>: "``.  :data:`PFX` matches the optional function prefix.
* ``health.c``: ``poll_health`` ("device's health compromised - reached miss count", before
  5.x without the tail; "Fatal error %u detected" with the fatal sensor of
  ``mlx5_health_check_fatal_sensors``), ``print_health_info`` ("Health issue observed, %s,
  severity(%d) %s:", "synd 0x%x: %s" with ``hsynd_str``), ``mlx5_health_try_recover``
  ("health recovery succeeded" / "health recovery failed").
* ``cmd.c``: ``mlx5_cmd_out_err`` / ``cmd_status_print`` / ``mlx5_cmd_check``
  ("%s(0x%x) op_mod(0x%x) failed, status %s(0x%x), syndrome (0x%x)[, err(%d)]", status codes of
  ``include/linux/mlx5/device.h`` named by ``cmd_status_str``), ``wait_func`` /
  ``cb_timeout_handler`` / ``wait_func_handle_exec_timeout`` ("%s(0x%x) timeout. Will cause a
  leak of a command resource", "cmd[%d]: %s(0x%x) Async, timeout...", "cmd[%d]: %s(0x%x) No done
  completion", "%s(0x%x) canceled on out of queue timeout.", "%s(0x%x) timeout while waiting
  for command semaphore.", "cmd[%d]: %s(0x%x) [Async, ]recovered after timeout").
* ``events.c`` (``port.c`` in 4.11-4.19): ``port_module`` / ``mlx5_port_module_event``
  ("Port module event: module %u, %s", "Port module event[error]: module %u, %s, %s" with
  ``mlx5_pme_status_to_string`` and ``mlx5_pme_error_to_string``), ``temp_warn`` ("High
  temperature on sensors with bit set %llx %llx"), ``mlx5_pcie_event`` ("Detected insufficient
  power on the PCIe slot (%uW).").
* ``en_main.c``: ``mlx5e_update_carrier`` prints "Link up" / "Link down" on every carrier
  update (including the one on open), while ``mlx5e_close`` turns the carrier off without a
  line; ``net/8021q/vlan.c`` ``vlan_device_event`` prints "adding VLAN 0 to HW filter on device
  %s" on NETDEV_UP, i.e. when software opens the interface.
* ``main.c``: ``mlx5_pci_err_detected`` / ``mlx5_pci_slot_reset`` / ``mlx5_pci_resume`` ("%s was
  called" before 5.13; then "%s Device state = %d [health sensors: %d ]pci_status: %d. Enter /
  Exit, ..., %s" with ``result2str`` "need reset"/"disconnect"/"recovered", and "Done, err = %d,
  device recovered|Failed"), ``mlx5_error_sw_reset`` ("PCI channel offline, stop waiting for NIC
  IFC").
* ``drivers/infiniband/core/cache.c`` ``ib_cache_update``: "Port: %d Link %s" with
  ``ib_port_state_to_str`` (NOP, DOWN, INIT, ARMED, ACTIVE, ACTIVE_DEFER, else UNKNOWN).
* ``drivers/net/bonding/bond_main.c`` ("link status definitely up/down").
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import (BOOT_WINDOW_S, BUSPAT, COLLATERAL_WINDOW_S, FOLLOW_WINDOW_S, Ev, Inc, bus_id,
                                         close)

#: fixed NIC messages -> (code, domain, action, remedy)
FIXED: dict[str, tuple[str, str, str, str]] = {
    # mlx5_pcie_event: what the slot advertised, printed at probe on every function: platform noise
    "insufficient_power": ("mlx5:insufficient_power", "benign", "none", "none"),
    # poll_health: the firmware health counter stopped (MAX_MISSES polls)
    "health": ("mlx5:health_compromised", "nic-device", "reroute", "reboot-node"),
    # mlx5_error_sw_reset / mlx5_health_try_recover: PCI reads fail during error recovery
    "pci_offline": ("mlx5:pci_channel_offline", "nic-device", "reroute", "reboot-node"),
    # temp_warn: the ASIC's own sensors (not a module) passed their warning threshold
    "temp_warn": ("mlx5:temp_warning", "nic-device", "none", "observe"),
}

#: poll_health "Fatal error %u detected": the sensor ``mlx5_health_check_fatal_sensors`` returned
FATAL_SENSORS: dict[int, str] = {
    1: "pci_comm_err",   # MLX5_SENSOR_PCI_COMM_ERR: health buffer reads 0xffffffff
    2: "pci_err",        # MLX5_SENSOR_PCI_ERR: pci_channel_offline()
    3: "nic_disabled",   # MLX5_SENSOR_NIC_DISABLED
    4: "nic_sw_reset",   # MLX5_SENSOR_NIC_SW_RESET
    5: "fw_synd_rfr",    # MLX5_SENSOR_FW_SYND_RFR: firmware syndrome, reset requested
}

#: health.c ``hsynd_str``: health-buffer syndrome -> its text (lower-cased; 4.x spelled
#: "Invalid EQ refrenced", "High temprature")
HEALTH_SYNDROMES: dict[int, tuple[str, ...]] = {
    0x1: ("firmware internal error",),
    0x7: ("irisc not responding",),
    0x8: ("unrecoverable hardware error",),
    0x9: ("firmware crc error",),
    0xa: ("icm fetch pci error",),
    0xb: ("hw fatal error",),
    0xc: ("async eq buffer overrun",),
    0xd: ("eq error",),
    0xe: ("invalid eq referenced", "invalid eq refrenced"),
    0xf: ("ffser error",),
    0x10: ("high temperature", "high temprature"),
}
_SYND_OF_TEXT = {t: n for n, ts in HEALTH_SYNDROMES.items() for t in ts}

#: include/linux/mlx5/device.h MLX5_CMD_STAT_* (named by cmd.c ``cmd_status_str``) -> (name,
#: domain, action, remedy) of a firmware command that completed with that status.  Only a
#: firmware-side failure (internal error, bad system state) says the device is at fault; a
#: malformed or unsupported request, or a resource limit, is the caller's or the configuration's.
CMD_STATUS: dict[int, tuple[str, str, str, str]] = {
    0x1: ("internal_error", "nic-device", "reroute", "reboot-node"),
    0x2: ("bad_operation", "config", "none", "observe"),
    0x3: ("bad_parameter", "config", "none", "observe"),
    0x4: ("bad_system_state", "nic-device", "reroute", "reboot-node"),
    0x5: ("bad_resource", "config", "none", "observe"),
    0x6: ("resource_busy", "config", "none", "observe"),
    0x7: ("fw_not_ready", "nic-device", "none", "observe"),
    0x8: ("limits_exceeded", "config", "none", "observe"),
    0x9: ("bad_resource_state", "config", "none", "observe"),
    0xa: ("bad_index", "config", "none", "observe"),
    0xf: ("no_resources", "config", "none", "observe"),
    0x10: ("bad_qp_state", "config", "none", "observe"),
    0x30: ("bad_packet", "config", "none", "observe"),
    0x40: ("bad_size_outstanding_cqes", "config", "none", "observe"),
    0x50: ("bad_input_length", "config", "none", "observe"),
    0x51: ("bad_output_length", "config", "none", "observe"),
    # MLX5_DRIVER_STATUS_ABORTED: the driver's own answer while the device is in error state
    # (cmd.c mlx5_internal_err_ret_value, syndrome MLX5_DRIVER_SYND 0xbadd00de)
    0xfe: ("driver_aborted", "nic-device", "none", "observe"),
}
_CMD_STATUS_DEFAULT = ("unknown", "unattributed", "none", "observe")

#: port-module error types (events.c ``mlx5_pme_error_to_string``; port.c ``mlx5_pme_error``
#: in 4.11-4.19), matched on the text lower-cased without spaces -> name.  Every module error
#: reads nic-link / replace-part (the module, its cable or its power); a cable over-temperature
#: explains the link down of the same function that follows.
MODULE_ERRORS: dict[str, str] = {
    "powerbudgetexceeded": "power_budget_exceeded",
    "longrangefornonmlnxcable": "long_range_non_mlnx_cable",
    "busstuck(i2cordatashorted)": "bus_stuck",
    "noeeprom/retrytimeout": "no_eeprom",
    "enforcepartnumberlist": "enforce_part_number_list",
    "unknownidentifier": "unknown_identifier",
    "hightemperature": "high_temperature",
    "badorshortedcable/module": "bad_or_shorted_cable",
    "oneormorenetworkportshavebeenpowereddownduetoinsufficient/unadvertisedpoweronthepcieslot":
        "pcie_power_slot_exceeded",
}

#: module status (``mlx5_pme_status_to_string``) -> event kind; "Unknown status" is a cable
#: error whose cause the tables do not know
MODULE_STATUS = {"cable plugged": "plugged", "cable unplugged": "unplugged", "cable error": "error",
                 "cable disabled": "disabled", "unknown status": "error"}

#: ib_port_state_to_str
IB_PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")

#: the NIC faults whose evidence explains RDMA completion errors on the same HCA
NIC_FAULT_KINDS = ("link_down", "cable_unplugged", "cable_error", "cable_disabled", "nic_pci", "health", "fatal_sensor",
                   "fw_syndrome", "pci_offline", "cmd_timeout", "cmd_status")

#: the device faults of one function that explain its later command failures, link loss, ...
DEVICE_FAULT_KINDS = ("nic_pci", "health", "fatal_sensor", "fw_syndrome", "pci_offline")

_ST = re.compile
_HEX = r"[0-9a-fA-F]+"
#: mlx5_core_err/_warn/mlx5_log function prefix: ``func:line:(pid N): `` (4.x: ``name:func:...``;
#: a bare ``func: `` as some backports print it)
PFX = r"(?:[\w.:-]*?:)?\w+(?::\d+:\(pid \d+\))?: "
#: an mlx5_core function's line, with or without the function prefix; group 1 the bus
_MLX = r"mlx5_core (" + BUSPAT + r"): (?:" + PFX + r")?"
_CMD = r"(?:cmd\[\d+\]: )?(\w+)\(0x" + _HEX + r"\) "

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("nic_pci", _ST(r"mlx5_core (" + BUSPAT + r"): mlx5_pci_(err_detected|slot_reset|resume)\b(.*)$")),
    ("pci_offline", _ST(_MLX + r".*PCI channel offline")),
    ("fatal_sensor", _ST(_MLX + r"Fatal error (\d+) detected")),
    ("health", _ST(_MLX + r"device's health compromised")),
    ("health_issue", _ST(_MLX + r"Health issue observed, (.+?), severity\((\d+)\)")),
    ("fw_syndrome", _ST(_MLX + r"synd 0x(" + _HEX + r"): ?(.*?)\s*$")),
    ("health_recovery", _ST(_MLX + r"health recovery (succeeded|failed)")),
    ("cmd_recovered", _ST(_MLX + _CMD + r"(?:Async, )?recovered after timeout")),
    ("cmd_timeout", _ST(_MLX + _CMD + r"(?:Async, )?(?:timeout\. Will cause a leak|No done completion|"
                        r"canceled on out of queue timeout|timeout while waiting for command semaphore)")),
    ("cmd_status", _ST(_MLX + r"(\w+)\(0x" + _HEX + r"\) op_mod\(0x" + _HEX + r"\) (?:uid\(\d+\) )?failed, "
                       r"status (.*?)\(0x(" + _HEX + r")\)(?:, syndrome \(0x(" + _HEX + r")\))?")),
    ("temp_warn", _ST(_MLX + r"High temperature on sensors with bit set")),
    ("insufficient_power", _ST(_MLX + r".*insufficient power on the PCIe slot")),
    ("cable", _ST(_MLX + r"Port module event(?:\[error\])?: module (\d+), ([A-Za-z ]+?)(?:, (.*?))?\s*$")),
    ("port", _ST(r"mlx5_core (" + BUSPAT + r") (\S+): Port: (\d+) Link ([A-Z_]+)\b")),
    ("link", _ST(r"mlx5_core (" + BUSPAT + r") (\(unnamed net_device\) \(uninitialized\)|\S+): Link (up|down)\b")),
    ("link", _ST(r"^()(?:\S+ " + BUSPAT + r" )?(\S+): (?:NIC )?Link is (Up|Down)\b")),
    # bond_main.c bond_miimon_commit: slave_info(bond_dev, slave_dev, "link status definitely %s...")
    # prints "<bond>: (slave <dev>): ..."; before 4.15 "<bond>: link status definitely %s for interface %s"
    ("bond", _ST(r"^\S+: \(slave (\S+)\): link status definitely (up|down)")),
    ("bond", _ST(r"^\S+: link status definitely (up|down) for interface ([^\s,]+)")),
    ("if_open", _ST(r"adding VLAN 0 to HW filter on device (\S+)")),
    ("rename", _ST(r"mlx5_core (" + BUSPAT + r") (\S+): renamed from (\S+)")),
    ("probe", _ST(r"mlx5_core (" + BUSPAT + r"): (?:firmware version|.*available PCIe bandwidth|E-Switch: Total vports|"
                  r"Rate limit:|MLX5E: StrdRq)")),
    ("unload", _ST(r"mlx5_core (" + BUSPAT + r")[ :].*(?:remove_one|Shutdown was called|E-Switch: cleanup|"
                   r"E-Switch: Disable|mlx5_unload|teardown)")),
]


def _module_error(text: str | None) -> str | None:
    key = re.sub(r"\s+", "", (text or "").lower()).rstrip(".")
    for k, name in MODULE_ERRORS.items():
        if key.startswith(k):
            return name
    return None


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groups()
    if kind == "nic_pci":
        rest = g[2]
        failed = bool(re.search(r"\bFailed\b|disconnect|failed with error|timed out|wait vital failed", rest))
        return {"bus": bus_id(g[0]), "recovered": "recovered" in rest and not failed, "failed": failed}
    if kind in ("pci_offline", "health", "insufficient_power", "probe", "unload", "temp_warn"):
        return {"bus": bus_id(g[0])}
    if kind == "fatal_sensor":
        return {"bus": bus_id(g[0]), "sensor": int(g[1])}
    if kind == "health_issue":
        text = g[1].strip().lower()
        return {"bus": bus_id(g[0]), "synd": _SYND_OF_TEXT.get(text), "text": text, "severity": int(g[2])}
    if kind == "fw_syndrome":
        synd = int(g[1], 16)
        return {"bus": bus_id(g[0]), "synd": synd, "text": g[2].strip().lower(), "severity": None}
    if kind == "health_recovery":
        return {"bus": bus_id(g[0]), "ok": g[1] == "succeeded"}
    if kind in ("cmd_timeout", "cmd_recovered"):
        return {"bus": bus_id(g[0]), "op": g[1]}
    if kind == "cmd_status":
        return {"bus": bus_id(g[0]), "op": g[1], "status": int(g[3], 16), "status_text": g[2]}
    if kind == "cable":
        text = g[2].strip().lower()
        if text not in MODULE_STATUS and any(k.startswith(text) for k in MODULE_STATUS):
            return {"bus": bus_id(g[0]), "what": None}  # cut off: "Cable unpl..." says nothing yet
        status = MODULE_STATUS.get(text, "error")
        known = text in MODULE_STATUS and text != "unknown status"
        err = _module_error(g[3]) if status == "error" else None
        if status == "error" and err is None:
            known = False
        return {"bus": bus_id(g[0]), "module": int(g[1]), "what": status, "error": err, "known": known}
    if kind == "port":
        return {"bus": bus_id(g[0]), "ibdev": g[1], "port": int(g[2]), "state": g[3]}
    if kind == "link":
        netdev = None if g[1].startswith("(unnamed") else g[1]
        return {"bus": bus_id(g[0]) if g[0] else None, "netdev": netdev, "up": g[2].lower() == "up"}
    if kind == "if_open":
        return {"netdev": g[0]}
    if kind == "rename":
        return {"bus": bus_id(g[0]), "netdev": g[1], "old": g[2]}
    if kind == "bond":
        if "(slave " not in msg:  # the pre-4.15 wording: state first, then the slave
            return {"netdev": g[1], "up": g[0] == "up"}
        return {"netdev": g[0], "up": g[1] == "up"}
    return {}


class Rules:
    """The NIC family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin)."""

    def before_events(self) -> None:
        """The NIC names the input itself gives: netdev and RDMA device -> PCI function."""
        self.probes: dict[str, list[tuple[int, tuple]]] = {}
        self.unloads: dict[str, list[tuple[int, tuple]]] = {}
        self.opens: dict[str, list[tuple[int, tuple]]] = {}
        self.fstate: dict[str, str] = {}
        self.last_cable: dict[str, Inc] = {}
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

    def _nic_fixed(self, what: str, ev: Ev) -> Inc:
        b = ev.f["bus"]
        return self.fixed(what, ev, fkey=self.fkey(bus=b), device=b)

    def _device(self, code: str, kind: str, reading: tuple[str, str, str], ev: Ev, known: bool = True) -> Inc:
        b = ev.f["bus"]
        fk = self.fkey(bus=b)
        inc = self.new(code, (code, fk), kind, reading, ev, fkey=fk, device=b)
        inc.known = inc.known and known
        return inc

    # -- firmware health (health.c)

    def ev_health(self, ev: Ev) -> None:
        self._nic_fixed("health", ev)

    def ev_temp_warn(self, ev: Ev) -> None:
        self._nic_fixed("temp_warn", ev)

    def ev_fatal_sensor(self, ev: Ev) -> None:
        n = ev.f["sensor"]
        name = FATAL_SENSORS.get(n)
        self._device(f"mlx5:fatal_error:{name or n}", "fatal_sensor", ("nic-device", "reroute", "reboot-node"), ev,
                     known=name is not None)

    def ev_fw_syndrome(self, ev: Ev) -> None:
        """One print_health_info dump (its "Health issue observed" line and its "synd" line) is
        one incident per function; its code names the syndrome number once a line gives it."""
        f = ev.f
        fk = self.fkey(bus=f["bus"])
        key = ("mlx5:fw_syndrome", fk)
        inc = self.index.get(key)
        issue_line = f["severity"] is not None
        if inc is None:
            inc = self.new("mlx5:fw_syndrome", key, "fw_syndrome", ("nic-device", "reroute", "reboot-node"), ev,
                           fkey=fk, device=f["bus"])
            inc.x.update(issue_lines=0, severity=None)
        elif issue_line or not inc.x["issue_lines"]:
            inc.again(ev)  # a new dump
        else:
            inc.add(ev)  # the "synd" line of the dump already counted
        if issue_line:
            inc.x["issue_lines"] += 1
            sev = inc.x["severity"]
            inc.x["severity"] = f["severity"] if sev is None else min(sev, f["severity"])
        synd = f["synd"]
        if synd is not None and inc.code == "mlx5:fw_syndrome":
            inc.code = f"mlx5:fw_syndrome:0x{synd:x}"
        known = synd in HEALTH_SYNDROMES if synd is not None else False
        inc.x["known"] = inc.x.get("known", True) and known

    ev_health_issue = ev_fw_syndrome

    def ev_health_recovery(self, ev: Ev) -> None:
        fk = self.fkey(bus=ev.f["bus"])
        cands = [i for i in self.incs if i.fkey == fk and i.kind in DEVICE_FAULT_KINDS and not i.dropped]
        if cands:
            root = max(cands, key=lambda i: max(i.lines))
            root.add(ev)
            root.x["recovered"] = ev.f["ok"]

    # -- PCI error recovery (main.c)

    def ev_pci_offline(self, ev: Ev) -> None:
        fk = self.fkey(bus=ev.f["bus"])
        pci = self.index.get(("mlx5:pci_slot_reset", fk))
        if pci is not None:
            pci.add(ev)  # mlx5_error_sw_reset inside mlx5_pci_err_detected: part of that recovery
            return
        self._nic_fixed("pci_offline", ev)

    def ev_nic_pci(self, ev: Ev) -> None:
        b = ev.f["bus"]
        inc = self.new("mlx5:pci_slot_reset", ("mlx5:pci_slot_reset", b), "nic_pci", ("nic-device", "reroute", "reboot-node"),
                       ev, fkey=self.fkey(bus=b), device=b)
        if ev.f["failed"]:
            inc.x["failed"] = True
        inc.x["recovered"] = (inc.x.get("recovered", False) or ev.f["recovered"]) and not inc.x.get("failed")

    # -- firmware commands (cmd.c)

    def ev_cmd_timeout(self, ev: Ev) -> None:
        inc = self._device("mlx5:cmd_timeout", "cmd_timeout", ("nic-device", "reroute", "reboot-node"), ev)
        inc.x.setdefault("ops", set()).add(ev.f["op"])
        if "No done completion" not in ev.rec.msg:
            inc.x["final"] = True  # the command was given up (resource leaked / canceled)

    def ev_cmd_recovered(self, ev: Ev) -> None:
        fk = self.fkey(bus=ev.f["bus"])
        inc = self.index.get(("mlx5:cmd_timeout", fk))
        if inc is not None:
            inc.add(ev)
            inc.x["recovered"] = True
            return
        inc = self._device("mlx5:cmd_timeout", "cmd_timeout", ("nic-device", "reroute", "reboot-node"), ev)
        inc.x.update(ops={ev.f["op"]}, recovered=True)

    def ev_cmd_status(self, ev: Ev) -> None:
        st = ev.f["status"]
        name, dom, act, rem = CMD_STATUS.get(st, _CMD_STATUS_DEFAULT)
        code = f"mlx5:cmd_status:{name}" if st in CMD_STATUS else f"mlx5:cmd_status:0x{st:x}"
        inc = self._device(code, "cmd_status", (dom, act, rem), ev, known=st in CMD_STATUS)
        inc.x.setdefault("ops", set()).add(ev.f["op"])
        inc.x["status"] = st

    # -- driver probe / unload / interface open

    def ev_probe(self, ev: Ev) -> None:
        self.probes.setdefault(self.fkey(bus=ev.f["bus"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    ev_rename = ev_probe

    def ev_unload(self, ev: Ev) -> None:
        self.unloads.setdefault(self.fkey(bus=ev.f["bus"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    def ev_if_open(self, ev: Ev) -> None:
        self.opens.setdefault(self.fkey(netdev=ev.f["netdev"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    # -- port modules (events.c)

    def ev_cable(self, ev: Ev) -> None:
        fk = self.fkey(bus=ev.f["bus"])
        what = ev.f["what"]
        if what is None:
            return
        if what == "plugged":
            for open_ in (self.last_cable.get(fk or ""), self.index.get(("mlx5:link_down", fk))):
                if open_ is not None and not open_.x.get("recovered"):
                    open_.add(ev)
                    open_.x["recovered"] = True
                    return
            self.new("mlx5:cable_plugged", ("mlx5:cable_plugged", fk), "cable_plugged", ("benign", "none", "none"), ev,
                     fkey=fk, device=ev.f["bus"])
            return
        if what == "error":
            err = ev.f.get("error")
            code = f"mlx5:cable_error:{err}" if err else "mlx5:cable_error"
        else:
            code = f"mlx5:cable_{what}"
        inc = self.new(code, (code, fk), f"cable_{what}", ("nic-link", "reroute", "replace-part"), ev, fkey=fk,
                       device=ev.f["bus"])
        inc.known = inc.known and ev.f.get("known", True)
        inc.x["in_use"] = inc.x.get("in_use", False) or self.fstate.get(fk or "") == "up"
        inc.x["recovered"] = False
        self.last_cable[fk or ""] = inc

    # -- port and link state

    def ev_port(self, ev: Ev) -> None:
        f = ev.f
        fk = self.fkey(bus=f["bus"], ibdev=f["ibdev"])
        st = f["state"]
        kw = {"ibdev": f["ibdev"], "port": f["port"]}
        if st not in IB_PORT_STATES:  # ib_port_state_to_str's "UNKNOWN", or a state of a later kernel
            inc = self.new("mlx5:port_state_unknown", ("mlx5:port_state_unknown", fk), "port_state",
                           ("unattributed", "none", "observe"), ev, fkey=fk)
            inc.x.update(kw)
            inc.known = False
        elif st == "ACTIVE":
            self.up(ev, fk, False, kw)
        elif st == "DOWN" or (st == "INIT" and self.fstate.get(fk or "") == "up"):
            self.down(ev, fk, False, kw)
        elif st == "INIT":
            inc = self.new("mlx5:port_init", ("mlx5:port_init", fk), "port_init", ("benign", "none", "none"), ev, fkey=fk)
            inc.x.update(kw)
        else:  # ARMED, ACTIVE_DEFER, NOP: on the way up
            inc = self.index.get(("mlx5:port_init", fk))
            if inc is not None:
                inc.add(ev)

    def ev_link(self, ev: Ev) -> None:
        f = ev.f
        fk = self.fkey(bus=f["bus"], netdev=f["netdev"])
        kw = {"netdev": f["netdev"]} if f["netdev"] else {}
        (self.up if f["up"] else self.down)(ev, fk, False, kw)

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
        was_up = self.fstate.get(fk or "") == "up"
        self.fstate[fk or ""] = "up"
        inc = self.index.get(("mlx5:link_down", fk))
        if inc is not None:
            inc.add(ev)
            if inc.x["cur"] == "down":
                inc.x["cur"] = "up"
                inc.x["recovered"] = True
            return
        inc = self.index.get(("mlx5:port_init", fk))
        if inc is not None:
            inc.add(ev)
            return
        inc = self.index.get(("mlx5:link_up", fk))
        if inc is not None:
            if was_up and not bond:  # "Link up" again with no "Link down" between: a repeat
                inc.again(ev)
                inc.x["ups"].append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))
            else:
                inc.add(ev)
            return
        if bond:
            return
        inc = self.new("mlx5:link_up", ("mlx5:link_up", fk), "link_up", ("benign", "none", "none"), ev, fkey=fk)
        inc.x.update(kw)
        inc.x["ups"] = [(ev.rec.first_line, (ev.rec.ts, ev.rec.clock))]

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
            inc.domain, inc.action = "nic-link", "reroute"
            inc.remedy = "observe" if single else "check-config" if inc.kind == "cable_disabled" else "replace-part"
        else:
            inc.domain, inc.action, inc.remedy = "benign", "none", "none"
        if inc.kind == "link_down":
            inc.device = self.port_label(inc)

    read_link_down = read_cable_unplugged = read_cable_error = read_cable_disabled = read_link_fault

    def read_port_state(self, inc: Inc) -> None:
        inc.device = self.port_label(inc)

    read_port_init = read_port_state

    def read_link_up(self, inc: Inc) -> None:
        """"Link up" printed again and again with no "Link down" between, each time right at an
        interface open (NETDEV_UP's VLAN-0 filter line): software cycles the interface
        (mlx5e_close turns the carrier off silently; mlx5e_open prints the carrier), the link
        itself is not lost."""
        inc.device = self.port_label(inc)
        opens = self.opens.get(inc.fkey or "", [])
        at_open = sum(1 for _, st in inc.x.get("ups", [])
                      if any(close(st, o, 5.0) or close(o, st, 5.0) for _, o in opens))
        if at_open >= 2 and self.role(inc) in (None, "compute"):
            inc.x["reopened"] = True
            inc.domain, inc.action, inc.remedy = "config", "none", "check-config"

    def read_nic_device(self, inc: Inc) -> None:
        if inc.kind == "fw_syndrome":
            inc.known = inc.known and inc.x.get("known", True)
            sev = inc.x.get("severity")
            if sev is not None and sev > 3:  # the firmware's own severity: below LOGLEVEL_ERR
                inc.action, inc.remedy = "none", "observe"
        if inc.kind == "cmd_timeout" and inc.x.get("recovered") and not inc.x.get("final"):
            inc.action, inc.remedy = "none", "observe"  # wait_func_handle_exec_timeout recovered the EQE
        if inc.kind in ("nic_pci",) + DEVICE_FAULT_KINDS and inc.x.get("recovered"):
            inc.action, inc.remedy = "none", "observe"
        role = self.role(inc)
        if role is not None and role != "compute":
            inc.action = "none"

    read_nic_pci = read_health = read_pci_offline = read_cmd_timeout = read_fatal_sensor = read_nic_device
    read_fw_syndrome = read_cmd_status = read_temp_warn = read_nic_device

    # -- follow-on events -> their roots

    def link_nic_pci(self, x: Inc) -> None:
        gpus = self.roots_like(lambda i: i.domain == "gpu" and i.gpu is not None and i.parent is None)
        root = self.nearest_earlier(x, gpus, COLLATERAL_WINDOW_S)
        if root is not None:
            self.secondary(x, root, False, keep_reading=True)

    def _device_root(self, x: Inc, kinds: tuple[str, ...]) -> Inc | None:
        cands = self.roots_like(lambda i: i.kind in kinds and i.fkey == x.fkey and i.parent is None
                                and i.domain == "nic-device")
        return self.nearest_earlier(x, cands, FOLLOW_WINDOW_S)

    def link_device_follow(self, x: Inc) -> None:
        """A function's later device evidence follows its first device fault: the health dump
        after the miss count, the fatal sensor after PCI error detection, commands that time
        out or are aborted once the device is in error."""
        kinds = {"fw_syndrome": ("health", "fatal_sensor", "nic_pci", "pci_offline"),
                 "fatal_sensor": ("nic_pci", "pci_offline", "health"),
                 "health": ("nic_pci", "pci_offline"),
                 "pci_offline": ("nic_pci", "health", "fatal_sensor")}.get(x.kind, DEVICE_FAULT_KINDS)
        if x.kind in ("cmd_timeout", "cmd_status") and x.domain not in ("nic-device", "unattributed"):
            return
        root = self._device_root(x, kinds)
        if root is not None:
            self.secondary(x, root, True)

    link_fw_syndrome = link_fatal_sensor = link_health = link_pci_offline = link_device_follow
    link_cmd_timeout = link_cmd_status = link_device_follow

    def link_port_event(self, x: Inc) -> None:
        kind = x.kind
        if kind == "cable_plugged":
            if any(line < x.first and close(st, x.stamps[0], BOOT_WINDOW_S) for line, st in self.probes.get(x.fkey or "", [])):
                x.dropped = True  # the probe-time report of a cable that is simply there
            return
        codes = ("cable_unplugged", "cable_error", "cable_disabled") + (("cable_plugged",) if kind == "link_up" else ())
        cables = self.roots_like(lambda i: i.kind in codes and i.fkey == x.fkey)
        root = self.nearest_earlier(x, cables, float("inf"))
        if root is None and kind == "link_down":
            root = self._device_root(x, DEVICE_FAULT_KINDS)  # the function's own device fault took the link
        if root is not None:
            self.secondary(x, root, True)
        elif kind == "link_up" and not x.x.get("reopened"):
            x.dropped = True  # a port coming up with nothing before it: normal bring-up

    link_link_down = link_link_up = link_cable_plugged = link_port_event
