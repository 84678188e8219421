"""PCIe error evidence: Linux AER reports (root port / RCEC and device lines), Downstream Port
Containment (DPC) events, the PCI error-recovery outcome, and pciehp surprise link-down.

Every pattern and table here comes from what the kernel prints (torvalds/linux):

- ``drivers/pci/pcie/aer.c`` (5.x and later; ``pr_fmt``/``dev_fmt`` add ``"AER: "``), and before
  it ``drivers/pci/pcie/aer/aerdrv_errprint.c`` / ``aerdrv_core.c`` (up to 4.x):

  - ``aer_print_port_info`` (the Root Port's header, printed on the port):
    ``"%s%s error received: id=%04x"`` (4.x), ``"%s%s error received: %04x:%02x:%02x.%d"`` (5.x-6.15),
    ``"%s%s error message received from %04x:%02x:%02x.%d%s"`` (6.16+, ``%s`` = ``" (no details
    found)"``); the first ``%s`` is ``"Multiple "`` or empty, the second
    ``aer_error_severity_string[]``: ``"Corrected"``, ``"Uncorrected (Non-Fatal)"``,
    ``"Uncorrected (Fatal)"`` (up to 6.x) or ``"Correctable"``, ``"Uncorrectable (Non-Fatal)"``,
    ``"Uncorrectable (Fatal)"`` (later).
  - ``aer_print_error`` (printed on each device that logged the error, which may be the port
    itself or the endpoint below it): ``"PCIe Bus Error: severity=%s, type=%s, id=%04x(%s)"``
    (4.x) / ``"PCIe Bus Error: severity=%s, type=%s, (%s)"`` (5.x+), type from ``aer_error_layer[]``
    (``Physical Layer``, ``Data Link Layer``, ``Transaction Layer``) or ``Unaccessible`` /
    ``Inaccessible`` (status unreadable: the device is gone); then
    ``"  device [%04x:%04x] error status/mask=%08x/%08x"``, and from ``__aer_print_error`` one
    ``"   [%2d] %-22s%s"`` line per status bit (name from ``aer_correctable_error_string[]`` /
    ``aer_uncorrectable_error_string[]``, ``"Unknown Error Bit"`` for a bit without a name,
    ``" (First)"`` on the first error pointer).
  - ``pci_print_aer`` (firmware-first / APEI GHES path): ``"aer_status: 0x%08x, aer_mask: 0x%08x"``,
    the bit lines, ``"aer_layer=%s, aer_agent=%s"``, ``"aer_uncor_severity: 0x%08x"``.
- ``drivers/pci/pcie/err.c`` ``pcie_do_recovery`` / ``report_error_detected`` (and 4.x
  ``aerdrv_core.c`` ``do_recovery``): ``"AER: Device recovery successful"`` /
  ``"AER: Device recovery failed"`` (lower-case "device" in 6.x), ``"AER: Can't recover (no
  error_detected callback)"`` / ``"can't recover ..."``, 4.x ``"device has no AER-aware driver"`` /
  ``"device has no driver"`` - printed on each device below the recovering port, so they name what
  is behind it.
- ``drivers/pci/pcie/dpc.c`` ``dpc_process_error`` (4.x ``pcie-dpc.c``):
  ``"DPC containment event, status:%#06x source:%#06x"`` and ``"DPC %s detected"`` (4.x),
  ``"DPC: containment event, status:%#06x source:%#06x"`` + ``"DPC: %s detected"`` (5.x-6.15),
  ``"DPC: containment event, status:%#06x: %s detected"`` /
  ``"DPC: containment event, status:%#06x, %s received from %04x:%02x:%02x.%d"`` (6.16+); reasons
  ``unmasked uncorrectable error``, ``ERR_NONFATAL``, ``ERR_FATAL``, ``RP PIO error``,
  ``software trigger``, ``reserved error``.  DPC disables the link in hardware (``dpc_reset_link``):
  everything below the port is cut off until recovery.
- ``drivers/pci/hotplug/pciehp_ctrl.c`` ``pciehp_handle_presence_or_link_change``:
  ``"Slot(%s): Link Down"`` / ``"Slot(%s): Card not present"`` (then ``SURPRISE_REMOVAL``),
  ``"Slot(%s): Link Up"`` / ``"Slot(%s): Card present"``; ``pciehp_hpc.c``
  ``pciehp_ignore_dpc_link_change``: ``"Slot(%s): Link Down/Up ignored (recovered by DPC)"``.

Readings (codes ``aer:corrected``, ``aer:uncorrectable`` (non-fatal and fatal: the kernel's two
classes; fatality is in the reading), ``aer:unknown`` (severity unreadable), ``dpc:containment``,
``pciehp:link_down``, ``aer:recovery_failed``; the error names go into the summary):

- corrected errors: a trend to observe (action none); a burst (:data:`BURST_COUNT` reports on one
  device within :data:`BURST_WINDOW_S`) is a warning: remedy replace-part (the link is marginal).
- uncorrectable non-fatal: a fault of the device named (GPU: migrate-rank / reset-gpu; NIC:
  reroute / reboot-node); when the kernel then says "device recovery successful": observe.
- fatal, DPC containment, surprise link-down, recovery failed, an inaccessible device: the device
  behind the port is lost (GPU: migrate-rank / reboot-node, replace-part when it happens again;
  NIC: reroute / reboot-node); recovered: observe.
- the domain is what is behind the port: ``gpu``, ``nic-device``, else ``unattributed``.  What is
  behind comes from the lines themselves: the device that logged the error, the requester /
  source id, the drivers the recovery broadcast reached; without those, a GPU or NIC that is lost
  within :data:`~linkpass.core.evidence.base.FOLLOW_WINDOW_S` after the port's event on a higher
  bus of the same PCI domain.

Causes and consequences (:meth:`Rules.after_links`): the port's loss event and the lost device's
own report (Xid 79, "fallen off the bus", mlx5 PCI channel offline ...) are one event; the
device's incident (it names what to migrate or route around) is the root and the port's view its
secondary.  Other incidents of the device behind after the port's event follow from it.  The AER
details DPC prints for its own port, and pciehp's link-down after a DPC/fatal AER on the same
port, are secondaries of that event.  Corrected errors stay their own roots (a precursor).
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import BUSPAT, FOLLOW_WINDOW_S, Ev, Inc, bus_id, close

#: correctable error status bits (PCIe r6 7.8.4.5) -> names the kernel prints: aerdrv_errprint.c
#: (up to 4.x; "RELAY_NUM" is the kernel's own spelling) and aer.c (short names, 4.20+)
CORRECTABLE_ERRORS: dict[int, tuple[str, ...]] = {
    0: ("Receiver Error", "RxErr"),
    6: ("Bad TLP", "BadTLP"),
    7: ("Bad DLLP", "BadDLLP"),
    8: ("RELAY_NUM Rollover", "Rollover"),
    12: ("Replay Timer Timeout", "Timeout"),
    13: ("Advisory Non-Fatal", "NonFatalErr"),
    14: ("Corrected Internal Error", "CorrIntErr"),
    15: ("Header Log Overflow", "HeaderOF"),
}

#: uncorrectable error status bits -> names, as above
UNCORRECTABLE_ERRORS: dict[int, tuple[str, ...]] = {
    0: ("Undefined",),
    4: ("Data Link Protocol", "DLP"),
    5: ("Surprise Down Error", "SDES"),
    12: ("Poisoned TLP", "TLP"),
    13: ("Flow Control Protocol", "FCP"),
    14: ("Completion Timeout", "CmpltTO"),
    15: ("Completer Abort", "CmpltAbrt"),
    16: ("Unexpected Completion", "UnxCmplt"),
    17: ("Receiver Overflow", "RxOF"),
    18: ("Malformed TLP", "MalfTLP"),
    19: ("ECRC",),
    20: ("Unsupported Request", "UnsupReq"),
    21: ("ACS Violation", "ACSViol"),
    22: ("Uncorrectable Internal Error", "UncorrIntErr"),
    23: ("MC Blocked TLP", "BlockedTLP"),
    24: ("AtomicOp Egress Blocked", "AtomicOpBlocked"),
    25: ("TLP Prefix Blocked Error", "TLPBlockedErr"),
    26: ("PoisonTLPBlocked",),
}

#: name -> "corrected" / "uncorrectable" (the two tables share no name)
AER_ERROR_CLASS: dict[str, str] = {
    **{n: "corrected" for names in CORRECTABLE_ERRORS.values() for n in names},
    **{n: "uncorrectable" for names in UNCORRECTABLE_ERRORS.values() for n in names},
}

#: what __aer_print_error prints for a set status bit that has no name in its table
UNKNOWN_BIT = "Unknown Error Bit"

#: uncorrectable errors that mean the link to the device below is gone
LINK_LOSS_ERRORS = frozenset(UNCORRECTABLE_ERRORS[5])

#: DPC trigger reasons dpc.c prints
DPC_REASONS = ("unmasked uncorrectable error", "ERR_NONFATAL", "ERR_FATAL", "RP PIO error", "software trigger",
               "reserved error")

#: the driver a kernel PCI line is prefixed with -> what the device is
GPU_DRIVERS = frozenset({"nvidia", "amdgpu", "nouveau", "radeon", "xe", "i915", "habanalabs"})
NIC_DRIVERS = frozenset({"mlx5_core", "mlx4_core", "mlx5_ib", "bnxt_en", "ice", "i40e", "ixgbe", "igb", "idpf",
                         "ena", "efa", "gve", "irdma", "cxgb4", "qede", "hns3", "ionic"})
PORT_DRIVERS = frozenset({"pcieport", "pciehp", "pci"})

#: corrected-error burst: so many reports on one device within so many seconds.  Newer kernels
#: ratelimit AER logs per device to DEFAULT_RATELIMIT_BURST (10) per 5 s (aer.c aer_ratelimit):
#: reaching that rate is more than a trend.
BURST_COUNT = 10
BURST_WINDOW_S = 60.0

#: seconds within which a header, its detail lines and the recovery messages belong together
BLOCK_WINDOW_S = 5.0

DOMAIN_OF_CLASS = {"gpu": "gpu", "nic": "nic-device"}

_ST = re.compile
#: the device prefix of dev_printk/pci_printk lines: "<driver> <bdf>: " (pciehp's old service
#: device names add ":pcie004")
_PFX = r"^(?P<drv>[\w.-]+) (?P<bdf>" + BUSPAT + r")(?::pcie\d+)?:\s+"
_SEV = r"(?P<sev>Corrected|Correctable|Uncorrected \(Non-Fatal\)|Uncorrectable \(Non-Fatal\)|Uncorrected \(Fatal\)|Uncorrectable \(Fatal\))"

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("aer_src", _ST(_PFX + r"(?:AER: )?(?P<multi>Multiple )?" + _SEV + r" error (?:received|message received from)"
                    r":?\s*(?:id=(?P<id>[0-9a-fA-F]{4})|(?P<src>" + BUSPAT + r"))?")),
    ("aer_err", _ST(_PFX + r"(?:AER: )?PCIe Bus Error: severity=(?P<sev>[^,]*)(?:, type=(?P<type>[^,]*))?")),
    ("aer_status", _ST(_PFX + r"(?:AER: )?\s*device \[[0-9a-fA-F]{4}:[0-9a-fA-F]{4}\] error status/mask="
                       r"(?P<status>[0-9a-fA-F]{8})/(?P<mask>[0-9a-fA-F]{8})")),
    ("aer_fw", _ST(_PFX + r"(?:AER: )?aer_status: 0x(?P<status>[0-9a-fA-F]{8}), aer_mask: 0x(?P<mask>[0-9a-fA-F]{8})")),
    ("aer_fw_sev", _ST(_PFX + r"(?:AER: )?aer_uncor_severity: 0x(?P<usev>[0-9a-fA-F]{8})")),
    ("aer_bit", _ST(_PFX + r"(?:AER: )?\s*\[\s*(?P<bit>\d{1,2})\]\s*(?P<name>.*?)\s*(?P<first>\(First\))?\s*$")),
    ("dpc", _ST(_PFX + r"(?:DPC:?\s)?containment event, status:(?P<status>0x[0-9a-fA-F]+)"
                r"(?: source:(?P<source>0x[0-9a-fA-F]+)|, (?P<msg>ERR_FATAL|ERR_NONFATAL) received from (?P<src>" + BUSPAT
                + r")|: (?P<reason>.+?) detected)?")),
    ("dpc_reason", _ST(_PFX + r"DPC:?\s(?P<reason>" + "|".join(DPC_REASONS) + r") detected")),
    ("pcie_recovery", _ST(_PFX + r"(?:AER: )?[Dd]evice recovery (?P<how>successful|failed)")),
    ("pcie_no_handler", _ST(_PFX + r"(?:AER: )?(?:[Cc]an't recover \(no error_detected callback\)|"
                            r"device has (?:no AER-aware driver|no driver))")),
    ("pciehp", _ST(_PFX + r"(?:pciehp: )?Slot\((?P<slot>[^)]*)\): (?P<what>Link Down/Up ignored|Link Down|Card not present|"
                   r"Link Up|Card present)")),
]


def pci_id(domain_of: str | None, rid: int) -> str | None:
    """A 16-bit requester / source id (bus << 8 | devfn) as a full bus id in ``domain_of``'s domain."""
    dom = (domain_of or "0000:").split(":")[0]
    return bus_id(f"{dom}:{rid >> 8:02x}:{(rid & 0xff) >> 3:02x}.{rid & 7}")


def severity(text: str | None) -> str | None:
    """aer_error_severity_string (either era) -> corrected / nonfatal / fatal; None if unreadable."""
    t = (text or "").strip().lower()
    if t.startswith("correct"):
        return "corrected"
    if "non-fatal" in t or "nonfatal" in t:
        return "nonfatal"
    if "fatal" in t:
        return "fatal"
    return None


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groupdict()
    f: dict[str, Any] = {"drv": g["drv"], "bdf": bus_id(g["bdf"])}
    if kind == "aer_src":
        f["sev"] = severity(g["sev"])
        f["multi"] = bool(g["multi"])
        f["src"] = bus_id(g["src"]) if g["src"] else pci_id(f["bdf"], int(g["id"], 16)) if g["id"] else None
    elif kind == "aer_err":
        f["sev"] = severity(g["sev"])
        f["type"] = (g["type"] or "").strip()
    elif kind in ("aer_status", "aer_fw"):
        f["status"], f["mask"] = int(g["status"], 16), int(g["mask"], 16)
    elif kind == "aer_fw_sev":
        f["usev"] = int(g["usev"], 16)
    elif kind == "aer_bit":
        f["bit"], f["name"], f["first"] = int(g["bit"]), g["name"], bool(g["first"])
    elif kind == "dpc":
        src = None
        if g["src"]:
            src = bus_id(g["src"])
        elif g["source"] and int(g["source"], 16):
            src = pci_id(f["bdf"], int(g["source"], 16))
        f["src"], f["reason"] = src, g["reason"] or g["msg"]
    elif kind == "dpc_reason":
        f["reason"] = g["reason"]
    elif kind == "pcie_recovery":
        f["ok"] = g["how"] == "successful"
    elif kind == "pciehp":
        f["slot"], f["what"] = g["slot"], g["what"]
    return f


def _bus(b: str | None) -> tuple[str, int] | None:
    if not b:
        return None
    return b[:4], int(b[5:7], 16)


class Rules:
    """The PCIe family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin)."""

    # -- phase 1: the events are only collected; a report spans several lines (header, details,
    #    bit names, recovery), so incidents are made in after_events, in input order

    def _pc_collect(self, ev: Ev) -> None:
        if not hasattr(self, "_pc_evs"):
            self._pc_evs = []
        self._pc_evs.append(ev)

    ev_aer_src = ev_aer_err = ev_aer_status = ev_aer_fw = ev_aer_fw_sev = ev_aer_bit = _pc_collect
    ev_dpc = ev_dpc_reason = ev_pcie_recovery = ev_pcie_no_handler = ev_pciehp = _pc_collect

    def _pc_class(self, bdf: str | None) -> str | None:
        """gpu / nic / port / other for a bus id the input names, None if it names no driver for it."""
        if not bdf:
            return None
        drv = self._pc_drv.get(bdf)
        if drv == "gpu" or drv in GPU_DRIVERS:
            return "gpu"
        if drv == "nic" or drv in NIC_DRIVERS:
            return "nic"
        if drv in PORT_DRIVERS:
            return "port"
        return "other" if drv else None

    def after_events(self) -> None:
        evs = getattr(self, "_pc_evs", [])
        self._pc_evs = []
        # what each bus id is: the drivers of this family's lines, and the other families' devices
        self._pc_drv: dict[str, str] = {}
        for ev in self.events:
            f = ev.f
            if f.get("gpu"):
                self._pc_drv.setdefault(f["gpu"], "gpu")
            elif ev.kind in ("nic_pci", "pci_offline", "health", "cmd_timeout", "probe", "unload", "port", "cable") and f.get("bus"):
                self._pc_drv.setdefault(f["bus"], "nic")
        for ev in evs:
            if ev.f.get("bdf") and ev.f.get("drv"):
                if ev.f["drv"] not in PORT_DRIVERS or ev.f["bdf"] not in self._pc_drv:
                    self._pc_drv[ev.f["bdf"]] = ev.f["drv"]
        self._pc_incs: list[Inc] = []
        self._pc_behind: dict[str, set[str]] = {}
        hdr: dict | None = None  # the last Root Port header
        blocks: dict[str, dict] = {}  # device -> the report being read for it
        for ev in evs:
            f, k = ev.f, ev.kind
            st = (ev.rec.ts, ev.rec.clock)
            if k == "aer_src":
                if hdr is not None and not hdr["used"]:
                    self._pc_block({"dev": hdr["f"]["src"] or hdr["f"]["bdf"], "port": hdr["f"]["bdf"],
                                    "sev": hdr["f"]["sev"], "evs": [hdr["ev"]], "names": [], "src": hdr["f"]["src"]})
                hdr = {"ev": ev, "f": f, "used": False, "st": st}
            elif k in ("aer_err", "aer_fw"):
                b = {"dev": f["bdf"], "port": None, "sev": f.get("sev"), "evs": [ev], "names": [], "src": None,
                     "fw": k == "aer_fw", "inaccessible": "ccessible" in f.get("type", ""), "layer": f.get("type")}
                if k == "aer_fw":
                    b["status"], b["mask"] = f["status"], f["mask"]
                if hdr is not None and hdr["f"]["sev"] == f.get("sev") and close(hdr["st"], st, BLOCK_WINDOW_S):
                    b["port"], b["src"] = hdr["f"]["bdf"], hdr["f"]["src"]
                    if not hdr["used"]:
                        b["evs"].insert(0, hdr["ev"])
                    hdr["used"] = True
                if f["bdf"] in blocks:
                    self._pc_block(blocks.pop(f["bdf"]))
                blocks[f["bdf"]] = b
            elif k in ("aer_status", "aer_bit", "aer_fw_sev"):
                b = blocks.get(f["bdf"])
                if b is None:  # details without their first line (cut off): read what is there
                    b = blocks[f["bdf"]] = {"dev": f["bdf"], "port": None, "sev": None, "evs": [], "names": [],
                                            "src": None, "orphan": True}
                b["evs"].append(ev)
                if k == "aer_status":
                    b["status"], b["mask"] = f["status"], f["mask"]
                elif k == "aer_fw_sev":
                    b["usev"] = f["usev"]
                elif f["name"]:
                    b["names"].append((f["bit"], f["name"], f["first"]))
            else:
                for d in list(blocks):
                    self._pc_block(blocks.pop(d))
                if hdr is not None and not hdr["used"]:
                    self._pc_block({"dev": hdr["f"]["src"] or hdr["f"]["bdf"], "port": hdr["f"]["bdf"],
                                    "sev": hdr["f"]["sev"], "evs": [hdr["ev"]], "names": [], "src": hdr["f"]["src"]})
                    hdr["used"] = True
                self._pc_other(ev)
        for d in list(blocks):
            self._pc_block(blocks.pop(d))
        if hdr is not None and not hdr["used"]:
            self._pc_block({"dev": hdr["f"]["src"] or hdr["f"]["bdf"], "port": hdr["f"]["bdf"], "sev": hdr["f"]["sev"],
                            "evs": [hdr["ev"]], "names": [], "src": hdr["f"]["src"]})

    def _pc_block(self, b: dict) -> None:
        """One AER report (a header, and/or one device's details) -> an incident (or a repeat)."""
        if not b["evs"]:
            return
        names = [n for _, n, _ in b["names"]]
        if (b.get("orphan") and "status" not in b and "usev" not in b and not any(n in AER_ERROR_CLASS or n == UNKNOWN_BIT for n in names)
                and not any("AER:" in e.rec.msg for e in b["evs"])):
            return  # a lone "[N] text" line of some driver, nothing says it is AER's
        sev = b["sev"]
        known = all(n in AER_ERROR_CLASS for n in names)
        if sev is None:  # firmware-first or cut off: the names (and aer_uncor_severity) say which class
            classes = {AER_ERROR_CLASS.get(n) for n in names} - {None}
            if "usev" in b or classes == {"uncorrectable"}:
                fatal = bool(b.get("status", 0) & ~b.get("mask", 0) & b.get("usev", 0))
                sev = "fatal" if fatal else "nonfatal"
            elif classes == {"corrected"}:
                sev = "corrected"
        if sev is None:
            known = False
        code = "aer:unknown" if sev is None else "aer:corrected" if sev == "corrected" else "aer:uncorrectable"
        dev = b["dev"]
        first = b["evs"][0]
        inc = self.new(code, (code, dev), "pcie", ("unattributed", "none", "observe"), first, device=dev)
        for ev in b["evs"][1:]:
            inc.add(ev)
        x = inc.x
        x.setdefault("what", "aer")
        x.setdefault("occ_st", []).append((first.rec.ts, first.rec.clock))
        rank = {None: 0, "corrected": 0, "nonfatal": 1, "fatal": 2}
        if rank.get(sev, 0) >= rank.get(x.get("sev"), 0):
            x["sev"] = sev
        x["lost"] = x.get("lost", False) or sev == "fatal" or (sev in ("nonfatal", "fatal") and (
            b.get("inaccessible") or any(n in LINK_LOSS_ERRORS for n in names)))
        x.setdefault("names", [])
        for n in names:
            if n not in x["names"]:
                x["names"].append(n)
        port = b.get("port") or (dev if self._pc_class(dev) == "port" else None)
        x["port"] = x.get("port") or port
        behind = x.setdefault("behind", set())
        for e in (dev, b.get("src")):
            if e and e != port and self._pc_class(e) != "port":
                behind.add(e)
        if port:
            self._pc_behind.setdefault(port, set()).update(behind)
        x["recovered"] = None if sev != "corrected" else x.get("recovered")
        if not known:
            inc.known = False
        firsts = [n for _, n, fst in b["names"] if fst]
        label = {"corrected": "corrected", "nonfatal": "uncorrectable non-fatal", "fatal": "uncorrectable fatal"}.get(sev, "unknown severity")
        inc.summary = (f"AER {label} error on {dev}" + (f" (port {port})" if port and port != dev else "")
                       + (": " + ", ".join(x["names"]) if x["names"] else "")
                       + (f" [first: {firsts[0]}]" if firsts else "") + f" | {first.rec.msg[:120]}")
        if inc not in self._pc_incs:
            self._pc_incs.append(inc)
        self._pc_last = inc

    def _pc_recent(self, ev: Ev, bdf: str | None, pred) -> Inc | None:
        """The latest incident of this family before ``ev`` on ``bdf`` (as device or port), else the
        latest one at all, within :data:`BLOCK_WINDOW_S`, that ``pred`` accepts."""
        st = (ev.rec.ts, ev.rec.clock)
        cands = [i for i in self._pc_incs if pred(i) and i.first < ev.rec.first_line
                 and close(i.stamps[-1], st, BLOCK_WINDOW_S)]
        mine = [i for i in cands if bdf in (i.device, i.x.get("port"))]
        pool = mine or cands
        return max(pool, key=lambda i: max(i.lines), default=None)

    def _pc_other(self, ev: Ev) -> None:
        f, k = ev.f, ev.kind
        bdf = f["bdf"]
        uncorr = lambda i: i.x.get("what") in ("dpc", "hp") or i.x.get("sev") in ("nonfatal", "fatal", None)  # noqa: E731
        if k == "dpc":
            inc = self.new("dpc:containment", ("dpc:containment", bdf), "pcie", ("unattributed", "none", "reboot-node"),
                           ev, device=bdf)
            x = inc.x
            x.update(what="dpc", lost=True, port=bdf, recovered=None)
            x.setdefault("occ_st", []).append((ev.rec.ts, ev.rec.clock))
            x.setdefault("behind", set())
            if f["src"] and f["src"] != bdf:
                x["behind"].add(f["src"])
                self._pc_behind.setdefault(bdf, set()).add(f["src"])
            if f["reason"]:
                x["reason"] = f["reason"]
                if f["reason"] not in DPC_REASONS:
                    inc.known = False
            inc.summary = f"DPC containment on port {bdf}" + (f" ({x['reason']})" if x.get("reason") else "") + f" | {ev.rec.msg[:120]}"
            if inc not in self._pc_incs:
                self._pc_incs.append(inc)
        elif k == "dpc_reason":
            inc = self._pc_recent(ev, bdf, lambda i: i.x.get("what") == "dpc")
            if inc is not None:
                inc.add(ev)
                inc.x["reason"] = f["reason"]
        elif k == "pcie_no_handler":
            inc = self._pc_recent(ev, bdf, uncorr)
            if inc is not None:
                inc.add(ev)
                if bdf != inc.x.get("port") and self._pc_class(bdf) != "port":
                    inc.x.setdefault("behind", set()).add(bdf)
                    if inc.x.get("port"):
                        self._pc_behind.setdefault(inc.x["port"], set()).add(bdf)
                inc.x["no_handler"] = True
        elif k == "pcie_recovery":
            inc = self._pc_recent(ev, bdf, uncorr)
            if inc is not None:
                inc.add(ev)
                # the outcome is the port's: every open report of this event at the port shares it
                st = (ev.rec.ts, ev.rec.clock)
                at = {bdf, inc.device, inc.x.get("port")} - {None}
                for i in self._pc_incs:
                    if i is inc or not (uncorr(i) and i.x.get("recovered") is None and i.first < ev.rec.first_line
                                        and close(i.stamps[-1], st, BLOCK_WINDOW_S) and {i.device, i.x.get("port")} & at):
                        continue
                    i.x["recovered"] = f["ok"]
                    i.x["lost"] = i.x.get("lost", False) or not f["ok"]
                inc.x["recovered"] = f["ok"] and inc.x.get("recovered") is not False
                if not f["ok"]:
                    inc.x["lost"] = True
            elif not f["ok"]:
                inc = self.new("aer:recovery_failed", ("aer:recovery_failed", bdf), "pcie",
                               ("unattributed", "none", "reboot-node"), ev, device=bdf)
                inc.x.update(what="failed", lost=True, port=bdf if self._pc_class(bdf) == "port" else None,
                             recovered=False)
                inc.x.setdefault("behind", set())
                inc.x.setdefault("occ_st", []).append((ev.rec.ts, ev.rec.clock))
                if self._pc_class(bdf) not in ("port", None):
                    inc.x["behind"].add(bdf)
                if inc not in self._pc_incs:
                    self._pc_incs.append(inc)
        elif k == "pciehp":
            what = f["what"]
            if what in ("Link Down", "Card not present"):
                code = "pciehp:link_down"
                key = (code, bdf)
                inc = self.index.get(key)
                if inc is not None and inc.x.get("up") is False:
                    inc.add(ev)  # "Card not present" with its "Link Down": one removal
                    return
                inc = self.new(code, key, "pcie", ("unattributed", "none", "reboot-node"), ev, device=bdf)
                inc.x.update(what="hp", lost=True, port=bdf, up=False, recovered=None, slot=f["slot"])
                inc.x.setdefault("behind", set())
                inc.x.setdefault("occ_st", []).append((ev.rec.ts, ev.rec.clock))
                inc.summary = f"pciehp surprise removal on port {bdf} slot {f['slot']} | {ev.rec.msg[:120]}"
                if inc not in self._pc_incs:
                    self._pc_incs.append(inc)
            else:
                inc = self.index.get(("pciehp:link_down", bdf))
                if what == "Link Down/Up ignored":  # DPC recovered the link: part of the DPC event
                    inc = self._pc_recent(ev, bdf, lambda i: i.x.get("what") == "dpc") or inc
                    if inc is not None:
                        inc.add(ev)
                    return
                if inc is not None:
                    inc.add(ev)
                    inc.x["up"] = True

    # -- readings

    def _pc_endpoints(self, inc: Inc) -> set[str]:
        ends = set(inc.x.get("behind", set()))
        port = inc.x.get("port")
        if port:
            ends |= self._pc_behind.get(port, set())
        return {e for e in ends if e and e != port}

    def _pc_lost_devices(self) -> list[Inc]:
        """Other families' incidents that report a device lost or failed (the device's own view)."""
        return [i for i in self.incs if i.kind != "pcie" and not i.dropped and (i.gpu or i.fkey or i.device)
                and i.domain in ("gpu", "nvlink", "gpu-memory", "nic-device", "nic-link")]

    @staticmethod
    def _pc_dev_of(i: Inc) -> str | None:
        for v in (i.gpu, i.fkey, i.device):
            if v and bus_id(v) == v:
                return v
        return None

    def read_pcie(self, inc: Inc) -> None:
        x = inc.x
        ends = self._pc_endpoints(inc)
        if not ends and x.get("lost") and x.get("port"):
            # no line names what is behind: a GPU / NIC lost soon after, below the port's bus
            pb = _bus(x["port"])
            for o in sorted(self._pc_lost_devices(), key=lambda i: i.first):
                d = self._pc_dev_of(o)
                ob = _bus(d)
                if (ob and pb and ob[0] == pb[0] and ob[1] > pb[1] and o.first > inc.first
                        and close(inc.stamps[0], o.stamps[0], FOLLOW_WINDOW_S) and o.action != "none"):
                    ends = {d}
                    x["weak"] = True
                    break
        x["ends"] = ends
        classes = {self._pc_class(e) for e in ends}
        if self._pc_class(inc.device) in ("gpu", "nic"):
            classes.add(self._pc_class(inc.device))
        cls = "gpu" if "gpu" in classes else "nic" if "nic" in classes else None
        x["cls"] = cls
        dom = DOMAIN_OF_CLASS.get(cls, "unattributed")
        occ = len(x.get("occ_st", [])) or 1
        if x.get("what") == "aer" and x.get("sev") == "corrected":
            reading = (dom, "none", "replace-part" if self._pc_burst(x.get("occ_st", [])) else "observe")
        elif x.get("what") == "aer" and x.get("sev") is None:
            reading = (dom, "none", "observe")
        elif x.get("recovered") or (x.get("what") == "hp" and x.get("up")):
            reading = (dom, "none", "observe")
        elif x.get("lost"):
            again = occ >= 2
            if cls == "gpu":
                reading = (dom, "migrate-rank", "replace-part" if again else "reboot-node")
            elif cls == "nic":
                reading = (dom, "reroute", "replace-part" if again else "reboot-node")
            else:
                reading = (dom, "none", "reboot-node")
        else:  # uncorrectable non-fatal: a fault of the device named
            reading = {"gpu": (dom, "migrate-rank", "reset-gpu"), "nic": (dom, "reroute", "reboot-node")}.get(
                cls, (dom, "none", "observe"))
        if cls == "nic" and reading[1] == "reroute" and self.topo is not None:
            roles = {getattr(self.topo.nic(bus=e)[0], "role", None) for e in ends}
            if roles and None not in roles and "compute" not in roles:
                reading = (dom, "none", reading[2])
        inc.domain, inc.action, inc.remedy = reading

    @staticmethod
    def _pc_burst(stamps: list) -> bool:
        if len(stamps) < BURST_COUNT:
            return False
        for n in range(len(stamps) - BURST_COUNT + 1):
            a, b = stamps[n], stamps[n + BURST_COUNT - 1]
            if a[0] is None or b[0] is None or a[1] != b[1] or b[0] - a[0] <= BURST_WINDOW_S:
                return True
        return False

    # -- causes and consequences

    def after_links(self) -> None:
        mine = sorted((i for i in self.incs if i.kind == "pcie" and not i.dropped), key=lambda i: i.first)
        # within the family: DPC prints its port's AER details; pciehp then sees the link go
        for x in mine:
            if x.parent is not None or x.x.get("sev") == "corrected":
                continue
            if x.x.get("what") in ("aer", "hp"):
                roots = [r for r in mine if r is not x and r.x.get("what") == "dpc" and x.x.get("what") != "dpc"
                         and x.x.get("port") in (r.device, None) and x.device in (r.device, *r.x.get("ends", ()))
                         and r.first <= x.first and close(r.stamps[0], x.stamps[0], BLOCK_WINDOW_S)]
                if not roots and x.x.get("what") == "hp":
                    roots = [r for r in mine if r is not x and r.x.get("what") == "aer" and r.x.get("lost")
                             and x.device in (r.device, r.x.get("port")) and r.first < x.first
                             and close(r.stamps[0], x.stamps[0], FOLLOW_WINDOW_S)]
                if roots:
                    self.secondary(x, roots[-1], True)
        # the lost device's own report is the root; the port's view of it, its secondary; other
        # incidents of the device behind that come after the port's event follow from it
        others = self._pc_lost_devices()
        for x in mine:
            if x.parent is not None or x.x.get("sev") == "corrected" or not x.x.get("ends"):
                continue
            ends = x.x["ends"]
            near = [o for o in others if o.parent is None and not o.dropped and self._pc_dev_of(o) in ends
                    and (close(x.stamps[0], o.stamps[0], FOLLOW_WINDOW_S) if o.first > x.first
                         else close(o.stamps[0], x.stamps[0], BLOCK_WINDOW_S))]
            serious = [o for o in near if o.action != "none"]
            if serious:
                root = min(serious, key=lambda o: o.first)
                self.secondary(x, root, False)
                for s in self.incs:  # what followed the port's view follows the device's report
                    if s.parent is x:
                        s.parent = root
                continue
            for o in near:
                if o.first > x.first:
                    self.secondary(o, x, False, keep_reading=True)
