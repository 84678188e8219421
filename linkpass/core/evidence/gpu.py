"""GPU evidence: NVIDIA Xid and SXid lines (NVRM, NVSwitch, fabric manager), a GPU fallen off
the bus, nvidia-smi losing a GPU, amdgpu resets, nvidia-peermem noise.

Sources:

- NVIDIA, *Analyzing Xid Errors with the Xid Catalog*
  https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, through NVIDIA/NVSentinel's
  machine-readable copy (``xiderrorsmapping.csv``, commit 6f8b0fcf): :data:`XID_CATALOG`.
- NVML ``nvmlDeviceGpuRecoveryAction_t`` (values printed by Xid 154): :data:`RECOVERY_ACTIONS`.
- NVIDIA open-gpu-kernel-modules (Xid 94/95 ``RST:``/``D-RST:`` containment lines; the NVRM Xid
  format ``NVRM: Xid (PCI:%04x:%02x:%02x): %d, ...``).
- The corpus notes in ``tests/fixtures/corpus/xid_catalog/XID_NOTES.md``.
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import BUSPAT, SERIOUS, Ev, Inc, bus_id

#: NVIDIA's Xid catalog (Ampere and newer) as NVSentinel's copy gives it:
#: Xid -> (mnemonic, Resolution Bucket (Immediate Action)).  REPORT stands for
#: UNEXPECTED_ERR_REPORT_ISSUE, FOLLOW_OTHER for "Follow guidance as it applies to another Xid".
XID_CATALOG: dict[int, tuple[str, str]] = {
    1: ("ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD", "REPORT"),
    2: ("ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD", "REPORT"),
    3: ("ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD", "REPORT"),
    4: ("ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY", "REPORT"),
    5: ("ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW", "REPORT"),
    6: ("ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR", "REPORT"),
    7: ("ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR", "REPORT"),
    8: ("ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "RESTART_APP"),
    9: ("ROBUST_CHANNEL_GR_ERROR_INSTANCE", "REPORT"),
    10: ("ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP", "REPORT"),
    11: ("ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "RESTART_APP"),
    12: ("ROBUST_CHANNEL_GR_ERROR_SW_METHOD", "REPORT"),
    13: ("ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY", "RESTART_APP"),
    14: ("ROBUST_CHANNEL_FAKE_ERROR", "IGNORE"),
    15: ("ROBUST_CHANNEL_SCANLINE_TIMEOUT", "REPORT"),
    16: ("ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT", "REPORT"),
    17: ("ROBUST_CHANNEL_PARAMETER_ERROR", "REPORT"),
    18: ("ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR", "REPORT"),
    19: ("ROBUST_CHANNEL_DISP_MISSED_NOTIFIER", "REPORT"),
    20: ("ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD", "REPORT"),
    21: ("ROBUST_CHANNEL_ME_ERROR_SW_METHOD", "REPORT"),
    22: ("ROBUST_CHANNEL_VP_ERROR_SW_METHOD", "REPORT"),
    23: ("ROBUST_CHANNEL_RC_LOGGING_ENABLED", "REPORT"),
    24: ("ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT", "REPORT"),
    25: ("ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "RESTART_APP"),
    26: ("ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT", "REPORT"),
    27: ("ROBUST_CHANNEL_VP_ERROR", "REPORT"),
    28: ("ROBUST_CHANNEL_VP2_ERROR", "REPORT"),
    29: ("ROBUST_CHANNEL_BSP_ERROR", "REPORT"),
    30: ("ROBUST_CHANNEL_BAD_ADDR_ACCESS", "REPORT"),
    31: ("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP"),
    32: ("ROBUST_CHANNEL_PBDMA_ERROR", "RESTART_APP"),
    33: ("ROBUST_CHANNEL_SEC_ERROR", "REPORT"),
    34: ("ROBUST_CHANNEL_MSVLD_ERROR", "REPORT"),
    35: ("ROBUST_CHANNEL_MSPDEC_ERROR", "REPORT"),
    36: ("ROBUST_CHANNEL_MSPPP_ERROR", "REPORT"),
    37: ("ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD", "IGNORE"),
    38: ("ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "IGNORE"),
    39: ("ROBUST_CHANNEL_CE0_ERROR", "RESTART_APP"),
    40: ("ROBUST_CHANNEL_CE1_ERROR", "RESTART_APP"),
    41: ("ROBUST_CHANNEL_CE2_ERROR", "RESTART_APP"),
    42: ("ROBUST_CHANNEL_VIC_ERROR", "REPORT"),
    43: ("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE"),
    44: ("ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "IGNORE"),
    45: ("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45"),
    46: ("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "RESET_GPU"),
    47: ("ROBUST_CHANNEL_NVENC0_ERROR", "REPORT"),
    48: ("ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48"),
    49: ("SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY", "REPORT"),
    50: ("SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR", "REPORT"),
    51: ("SILENT_RUNNING_STRESS_TEST_FAILURE", "REPORT"),
    52: ("SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE", "REPORT"),
    53: ("SILENT_RUNNING_TEMP_REDUCED_CLOCKING", "REPORT"),
    54: ("SILENT_RUNNING_PWR_REDUCED_CLOCKING", "CHECK_MECHANICALS"),
    55: ("SILENT_RUNNING_TEMPERATURE_READ_ERROR", "REPORT"),
    56: ("DISPLAY_CHANNEL_EXCEPTION", "REPORT"),
    57: ("FB_LINK_TRAINING_FAILURE_ERROR", "REPORT"),
    58: ("FB_MEMORY_ERROR", "REPORT"),
    59: ("PMU_ERROR", "REPORT"),
    60: ("ROBUST_CHANNEL_SEC2_ERROR", "RESTART_APP"),
    61: ("PMU_BREAKPOINT", "REPORT"),
    62: ("PMU_HALT_ERROR", "RESET_GPU"),
    63: ("INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE"),
    64: ("INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU"),
    65: ("ROBUST_CHANNEL_NVENC1_ERROR", "REPORT"),
    66: ("ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION", "IGNORE"),
    67: ("ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION", "IGNORE"),
    68: ("ROBUST_CHANNEL_NVDEC0_ERROR", "RESTART_APP"),
    69: ("ROBUST_CHANNEL_GR_CLASS_ERROR", "RESTART_APP"),
    70: ("ROBUST_CHANNEL_CE3_ERROR", "RESTART_APP"),
    71: ("ROBUST_CHANNEL_CE4_ERROR", "RESTART_APP"),
    72: ("ROBUST_CHANNEL_CE5_ERROR", "RESTART_APP"),
    73: ("ROBUST_CHANNEL_NVENC2_ERROR", "REPORT"),
    74: ("NVLINK_ERROR", "WORKFLOW_NVLINK_ERR"),
    75: ("ROBUST_CHANNEL_CE6_ERROR", "RESTART_APP"),
    76: ("ROBUST_CHANNEL_CE7_ERROR", "RESTART_APP"),
    77: ("ROBUST_CHANNEL_CE8_ERROR", "RESTART_APP"),
    78: ("VGPU_START_ERROR", "UPDATE_SWFW"),
    79: ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM"),
    80: ("PBDMA_PUSHBUFFER_CRC_MISMATCH", "RESTART_APP"),
    81: ("ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR", "REPORT"),
    82: ("ROBUST_CHANNEL_NVJPG0_ERROR", "RESTART_APP"),
    83: ("ROBUST_CHANNEL_NVDEC1_ERROR", "RESTART_APP"),
    84: ("ROBUST_CHANNEL_NVDEC2_ERROR", "RESTART_APP"),
    85: ("ROBUST_CHANNEL_CE9_ERROR", "RESTART_APP"),
    86: ("ROBUST_CHANNEL_OFA0_ERROR", "RESTART_APP"),
    87: ("NVTELEMETRY_DRIVER_REPORT", "REPORT"),
    88: ("ROBUST_CHANNEL_NVDEC3_ERROR", "RESTART_APP"),
    89: ("ROBUST_CHANNEL_NVDEC4_ERROR", "RESTART_APP"),
    90: ("LTC_ERROR", "REPORT"),
    91: ("RESERVED_XID", "REPORT"),
    92: ("EXCESSIVE_SBE_INTERRUPTS", "IGNORE"),
    93: ("INFOROM_ERASE_LIMIT_EXCEEDED", "IGNORE"),
    94: ("ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP"),
    95: ("ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU"),
    96: ("ROBUST_CHANNEL_NVDEC5_ERROR", "RESTART_APP"),
    97: ("ROBUST_CHANNEL_NVDEC6_ERROR", "RESTART_APP"),
    98: ("ROBUST_CHANNEL_NVDEC7_ERROR", "RESTART_APP"),
    99: ("ROBUST_CHANNEL_NVJPG1_ERROR", "RESTART_APP"),
    100: ("ROBUST_CHANNEL_NVJPG2_ERROR", "RESTART_APP"),
    101: ("ROBUST_CHANNEL_NVJPG3_ERROR", "RESTART_APP"),
    102: ("ROBUST_CHANNEL_NVJPG4_ERROR", "RESTART_APP"),
    103: ("ROBUST_CHANNEL_NVJPG5_ERROR", "RESTART_APP"),
    104: ("ROBUST_CHANNEL_NVJPG6_ERROR", "RESTART_APP"),
    105: ("ROBUST_CHANNEL_NVJPG7_ERROR", "RESTART_APP"),
    106: ("SMBPBI_TEST_MESSAGE", "IGNORE"),
    107: ("SMBPBI_TEST_MESSAGE_SILENT", "IGNORE"),
    108: ("DESTINATION_FLA_TRANSLATION_ERROR", "REPORT"),
    109: ("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "RESET_GPU"),
    110: ("SEC_FAULT_ERROR", "RESET_GPU"),
    111: ("BUNDLE_ERROR_EVENT", "REPORT"),
    112: ("DISP_SUPERVISOR_ERROR", "REPORT"),
    113: ("DP_LT_FAILURE", "REPORT"),
    114: ("HEAD_RG_UNDERFLOW", "REPORT"),
    115: ("CORE_CHANNEL_REGS", "REPORT"),
    116: ("WINDOW_CHANNEL_REGS", "REPORT"),
    117: ("CURSOR_CHANNEL_REGS", "REPORT"),
    118: ("HEAD_REGS", "REPORT"),
    119: ("GSP_RPC_TIMEOUT", "RESET_GPU"),
    120: ("GSP_ERROR", "RESET_GPU"),
    121: ("C2C_ERROR", "IGNORE"),
    122: ("SPI_PMU_RPC_READ_FAIL", "REPORT"),
    123: ("SPI_PMU_RPC_WRITE_FAIL", "REPORT"),
    124: ("SPI_PMU_RPC_ERASE_FAIL", "REPORT"),
    125: ("INFOROM_FS_ERROR", "REPORT"),
    126: ("ROBUST_CHANNEL_CE10_ERROR", "RESTART_APP"),
    127: ("ROBUST_CHANNEL_CE11_ERROR", "RESTART_APP"),
    128: ("ROBUST_CHANNEL_CE12_ERROR", "RESTART_APP"),
    129: ("ROBUST_CHANNEL_CE13_ERROR", "RESTART_APP"),
    130: ("ROBUST_CHANNEL_CE14_ERROR", "RESTART_APP"),
    131: ("ROBUST_CHANNEL_CE15_ERROR", "RESTART_APP"),
    132: ("ROBUST_CHANNEL_CE16_ERROR", "RESTART_APP"),
    133: ("ROBUST_CHANNEL_CE17_ERROR", "RESTART_APP"),
    134: ("ROBUST_CHANNEL_CE18_ERROR", "RESTART_APP"),
    135: ("ROBUST_CHANNEL_CE19_ERROR", "RESTART_APP"),
    136: ("ALI_TRAINING_FAIL", "RESET_GPU"),
    137: ("NVLINK_FLA_PRIV_ERR", "IGNORE"),
    138: ("ROBUST_CHANNEL_DLA_ERROR", "REPORT"),
    139: ("ROBUST_CHANNEL_OFA1_ERROR", "RESTART_APP"),
    140: ("UNRECOVERABLE_ECC_ERROR_ESCAPE", "RESET_GPU"),
    141: ("ROBUST_CHANNEL_FAST_PATH_ERROR", "IGNORE"),
    142: ("ROBUST_CHANNEL_NVENC3_ERROR", "REPORT"),
    143: ("GPU_INIT_ERROR", "RESET_GPU"),
    144: ("NVLINK_SAW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    145: ("NVLINK_RLW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    146: ("NVLINK_TLW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    147: ("NVLINK_TREX_ERROR", "WORKFLOW_NVLINK5_ERR"),
    148: ("NVLINK_NVLPW_CTRL_ERROR", "WORKFLOW_NVLINK5_ERR"),
    149: ("NVLINK_NETIR_ERROR", "WORKFLOW_NVLINK5_ERR"),
    150: ("NVLINK_MSE_ERROR", "WORKFLOW_NVLINK5_ERR"),
    151: ("ROBUST_CHANNEL_KEY_ROTATION_ERROR", "RESTART_VM"),
    152: ("ROBUST_CHANNEL_DLA_SMMU_ERROR", "IGNORE"),
    153: ("ROBUST_CHANNEL_DLA_TIMEOUT", "IGNORE"),
    154: ("GPU_RECOVERY_ACTION_CHANGED", "FOLLOW_OTHER"),
    155: ("NVLINK_SW_DEFINED_ERROR", "RESET_GPU"),
    156: ("RESOURCE_RETIREMENT_EVENT", "RESET_GPU"),
    157: ("RESOURCE_RETIREMENT_FAILURE", "IGNORE"),
    158: ("GPU_FATAL_TIMEOUT", "RESET_GPU"),
    159: ("ROBUST_CHANNEL_CHI_NON_DATA_ERROR", "CHECK_UVM"),
    160: ("CHANNEL_RETIREMENT_EVENT", "RESTART_BM"),
    161: ("CHANNEL_RETIREMENT_FAILURE", "IGNORE"),
    162: ("(unnamed)", "RESET_GPU"),
}

#: Immediate-action bucket -> (domain, action, remedy) for an Xid that no override names.
XID_BUCKETS: dict[str, tuple[str, str, str]] = {
    "RESTART_APP": ("app", "none", "none"),
    "IGNORE": ("app", "none", "none"),
    "RESET_GPU": ("gpu", "migrate-rank", "reset-gpu"),
    "RESTART_BM": ("gpu", "migrate-rank", "reboot-node"),
    "RESTART_VM": ("gpu", "migrate-rank", "reboot-node"),
    "REPORT": ("gpu", "none", "observe"),
    "CHECK_MECHANICALS": ("gpu", "none", "observe"),
    "CHECK_UVM": ("app", "none", "none"),
    "UPDATE_SWFW": ("config", "none", "check-config"),
    "WORKFLOW_NVLINK_ERR": ("nvlink", "migrate-rank", "reset-gpu"),
    "WORKFLOW_NVLINK5_ERR": ("nvlink", "migrate-rank", "reset-gpu"),
    "WORKFLOW_XID_48": ("gpu", "migrate-rank", "reset-gpu"),
    "WORKFLOW_XID_45": ("app", "none", "none"),
    "FOLLOW_OTHER": ("gpu", "none", "none"),
}

#: Xids whose reading differs from their bucket (XID_NOTES.md / [DPR] / [OGKM]):
#: Xid -> (domain, action, remedy).
XID_OVERRIDES: dict[int, tuple[str, str, str]] = {
    63: ("gpu-memory", "none", "reset-gpu"),     # row remap pending: "reset gpu to activate"
    64: ("gpu", "migrate-rank", "replace-part"),  # row remap failed: the bad row cannot be fenced
    92: ("gpu-memory", "none", "observe"),       # excessive single-bit errors: watch
    94: ("app", "none", "observe"),              # contained error: only the process dies; watch
}

#: How an Xid relates to others: "follow" = a follow-on of another event (45, 154);
#: "after-app" = the channel reset that follows an application fault (43).
XID_LINKS: dict[int, str] = {45: "follow", 154: "follow", 43: "after-app"}

#: NVML nvmlDeviceGpuRecoveryAction_t, as Xid 154 prints it -> remedy.
RECOVERY_ACTIONS: dict[int, str] = {0: "none", 1: "reset-gpu", 2: "reboot-node", 3: "drain-node", 4: "drain-node",
                                    5: "reset-gpu", 6: "reset-gpu", 7: "reboot-node"}

#: NVSwitch SXids seen in the field -> name; the fatality comes from the line
#: ("Fatal"/"Non-fatal", "Severity 1"/"Severity 0"), else from here.
SXID_NAMES: dict[int, tuple[str, bool]] = {
    20034: ("LTSSM fault", True),
    22013: ("Minion link DLREQ interrupt", False),
    24007: ("NVLink fatal (severity 1)", True),
}


#: fixed GPU-side messages -> (code, domain, action, remedy)
FIXED: dict[str, tuple[str, str, str, str]] = {
    "peermem": ("peermem:invalid_context", "benign", "none", "none"),
    "amdgpu_reset": ("amdgpu:gpu_reset", "gpu", "none", "observe"),
    "fallen": ("nvrm:fallen_off_bus", "gpu", "migrate-rank", "reboot-node"),
}


def xid_reading(xid: int) -> tuple[str, str, str]:
    """(domain, action, remedy) of an Xid on its own, from :data:`XID_CATALOG`; an Xid the
    catalog lacks is a GPU event to observe."""
    if xid in XID_OVERRIDES:
        return XID_OVERRIDES[xid]
    entry = XID_CATALOG.get(xid)
    return XID_BUCKETS.get(entry[1], ("gpu", "none", "observe")) if entry else ("gpu", "none", "observe")


_ST = re.compile

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    # NVRM's format: "Xid (PCI:0000:91:00): 79, pid=..., text"; old drivers: "Xid (0000:03:00): 79, text".
    # The code ends at a comma or at the end of a complete line (never at the end of a cut one).
    ("xid", _ST(r"NVRM: Xid \((?:PCI:)?(" + BUSPAT + r")(?: GPU-I:\w+)?\): (\d+)(?:\s*,\s*(.*)|\s*)$")),
    ("xid_banner", _ST(r"NVRM: _kgspLogXid(\d+):")),
    ("gpu_at", _ST(r"NVRM: GPU at PCI:(" + BUSPAT + r")")),
    ("fallen", _ST(r"NVRM: (?:The NVIDIA )?GPU (" + BUSPAT + r")\b.*?fallen off the bus")),
    ("smi", _ST(r"Unable to determine the device handle for GPU ?(" + BUSPAT + r")")),
    ("sxid", _ST(r"SXid \(PCI:(" + BUSPAT + r")\): (\d+),?\s*(.*)$")),
    ("fm_sxid", _ST(r"detected NVSwitch (non-fatal|fatal) error (\d+) .*?pci bus id (" + BUSPAT + r")")),
    ("amdgpu_reset", _ST(r"amdgpu (" + BUSPAT + r"): amdgpu: GPU reset")),
    ("peermem", _ST(r"nvidia-peermem .*invalid context")),
]


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groups()
    if kind == "xid":
        return {"gpu": bus_id(g[0]), "xid": int(g[1]), "text": g[2] or ""}
    if kind == "xid_banner":
        return {"xid": int(g[0])}
    if kind in ("gpu_at", "fallen", "smi", "amdgpu_reset"):
        return {"gpu": bus_id(g[0])}
    if kind == "sxid":
        text = g[2]
        fatal = (True if re.search(r"\bFatal\b|Severity [1-9]", text) else
                 False if re.search(r"Non-fatal|Severity 0", text) else None)
        return {"switch": bus_id(g[0]), "sxid": int(g[1]), "fatal": fatal}
    if kind == "fm_sxid":
        return {"switch": bus_id(g[2]), "sxid": int(g[1]), "fatal": g[0] == "fatal"}
    return {}


class Rules:
    """The GPU family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin: it
    uses the builder's ``new``, ``fixed``, ``index``, ``incs``, ``roots_like``,
    ``nearest_earlier`` and ``secondary``)."""

    def ev_xid(self, ev: Ev) -> None:
        g, n, text = ev.f["gpu"], ev.f["xid"], ev.f.get("text", "")
        code = f"xid:{n}"
        key = (code, g)
        if n == 79 and key not in self.index and ("nvrm:fallen_off_bus", g) in self.index:
            inc = self.index.pop(("nvrm:fallen_off_bus", g))
            inc.code, inc.key, inc.kind = code, key, "xid"
            inc.x["xid"] = n
            self.index[key] = inc
            inc.again(ev)
            return
        reading = xid_reading(n)
        if n == 95 and re.search(r"D-RST:\s*Yes", text):
            reading = ("gpu", "migrate-rank", "drain-node")
        inc = self.new(code, key, "xid", reading, ev, gpu=g, device=g)
        inc.x["xid"] = n
        m = re.search(r"caused by previous Xid (\d+)", text)
        if m:
            inc.x["cause"] = int(m.group(1))
        m = re.search(r"recovery action changed from .*?to 0x([0-9a-fA-F]+)", text)
        if m:
            inc.x["to"] = int(m.group(1), 16)

    def ev_xid_banner(self, ev: Ev) -> None:
        """The GSP banner names no GPU: take the nearest "GPU at PCI" line."""
        evs, i = self.events, self.pos
        after = [e for e in evs[i + 1:i + 6] if e.kind == "gpu_at"]
        before = [e for e in evs[max(0, i - 5):i] if e.kind == "gpu_at"]
        gpu = after[0].f["gpu"] if after else before[-1].f["gpu"] if before else None
        self.ev_xid(Ev("xid", ev.rec, {"gpu": gpu, "xid": ev.f["xid"], "text": ""}))

    def ev_fallen(self, ev: Ev) -> None:
        g = ev.f["gpu"]
        if ("xid:79", g) in self.index:
            self.index[("xid:79", g)].again(ev)
            return
        self.fixed("fallen", ev, gpu=g, device=g)

    def ev_amdgpu_reset(self, ev: Ev) -> None:
        self.fixed("amdgpu_reset", ev, gpu=ev.f["gpu"], device=ev.f["gpu"])

    def ev_peermem(self, ev: Ev) -> None:
        self.fixed("peermem", ev)

    def ev_sxid(self, ev: Ev) -> None:
        sw, n = ev.f["switch"], ev.f["sxid"]
        inc = self.new(f"sxid:{n}", (f"sxid:{n}", sw), "sxid", ("nvlink", "none", "observe"), ev, device=sw)
        inc.x["sxid"] = n
        if ev.f["fatal"] is not None:
            inc.x["fatal"] = inc.x.get("fatal", False) or ev.f["fatal"]

    ev_fm_sxid = ev_sxid

    def after_events(self) -> None:
        for ev in self.events:
            if ev.kind == "smi":  # a tool's error about a GPU: part of that GPU's incident, if any
                inc = next((x for x in self.incs if x.gpu == ev.f["gpu"] and x.kind == "xid"
                            and XID_LINKS.get(x.x.get("xid")) != "follow"), None)
                if inc is not None:
                    inc.add(ev)

    # -- readings that need the whole input

    def read_sxid(self, inc: Inc) -> None:
        fatal = inc.x.get("fatal")
        if fatal is None:
            fatal = SXID_NAMES.get(inc.x["sxid"], ("", False))[1]
        inc.domain, inc.action, inc.remedy = ("nvlink", "migrate-rank", "drain-node") if fatal else ("nvlink", "none", "observe")

    def read_xid(self, inc: Inc) -> None:
        if inc.x.get("xid") == 154:
            rem = RECOVERY_ACTIONS.get(inc.x.get("to", 0), "observe")
            inc.x["recovery"] = rem
            inc.domain, inc.action, inc.remedy = "gpu", "migrate-rank" if rem in SERIOUS else "none", rem

    # -- follow-on events -> their roots

    def link_xid(self, x: Inc) -> None:
        n = x.x["xid"]
        role = XID_LINKS.get(n)
        same = self.roots_like(lambda i: i is not x and i.gpu == x.gpu and i.kind in ("xid", "fallen")
                               and XID_LINKS.get(i.x.get("xid")) != "follow")
        if role == "follow":
            cause = x.x.get("cause")
            pool = [i for i in same if cause is not None and i.x.get("xid") == cause] or same
            if n == 45:
                root = min(pool, key=lambda i: min(abs(ln - x.first) for ln in i.lines), default=None)
                if root is not None:
                    self.secondary(x, root, True)
                return
            root = self.nearest_earlier(x, pool) or (min(pool, key=lambda i: i.first) if pool else None)
            rem = x.x.get("recovery", "observe")
            if root is not None:
                self.secondary(x, root, True)
                x.remedy = rem
                if rem != "none":
                    root.remedy = rem
                return
            others = self.roots_like(lambda i: i.kind in ("xid", "fallen", "sxid") and i.domain in ("gpu", "nvlink")
                                     and i.action == "migrate-rank" and i.parent is None and i.gpu != x.gpu)
            root = self.nearest_earlier(x, others)
            if root is not None:
                self.secondary(x, root, True, keep_reading=True)
            return
        if role == "after-app":
            root = self.nearest_earlier(x, [i for i in same if i.domain == "app"], float("inf"))
            if root is not None:
                self.secondary(x, root, True)
                return
        root = self.nearest_earlier(x, [i for i in same if i.action == "migrate-rank" and i.domain in ("gpu", "nvlink")])
        if root is not None:
            self.secondary(x, root, False)

    def link_sxid(self, x: Inc) -> None:
        lost = self.roots_like(lambda i: i.code in ("xid:79", "nvrm:fallen_off_bus"))
        root = self.nearest_earlier(x, lost)
        if root is not None:
            self.secondary(x, root, False)
