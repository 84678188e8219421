"""Kernel-log and NCCL/PyTorch error lines -> incidents: what broke, what linkpass does about it
(``action``) and what the operator should do (``remedy``).  Pure: no I/O, no clock.

Input: lines in any format :mod:`linkpass.core.logparse` reads (dmesg raw / ``-T`` / iso,
journal, syslog, /dev/kmsg, multi-line NVRM messages, NCCL and PyTorch logs).  Output: a list of
:class:`Incident`; ``Incident.to_json()`` is exactly::

    {"domain": "gpu|nvlink|gpu-memory|nic-link|nic-device|app|config|benign|unattributed",
     "device": "0000:91:00.0" | "mlx5_3/1" | "mlx5_3" | netdev | None,
     "code": "xid:79" | "sxid:20034" | "ibv_wc:12" | "ibv_event:port_err" | "mlx5:link_down" | "nccl:socket_error" | ...,
     "action": "none|reroute|migrate-rank",
     "remedy": "none|observe|reset-gpu|reboot-node|drain-node|replace-part|check-config",
     "secondary_of": index of the root incident in the same list | None,
     "first_line": int, "last_line": int}   # 1-based input line numbers

Roots come first (in input order), then secondaries (in input order).  Repeated lines of one
code on one device are one incident.  Follow-on events are linked to their root: Xid 45
("caused by previous Xid N"), Xid 154 recovery-action changes (whose value also sets the
remedy), other Xids after a GPU-level fault on the same GPU, Xid 43 after an application Xid,
NVSwitch SXids after a lost GPU, flush completions after a retry-exceeded one, NCCL completion
errors after an RDMA port/device event, link-down after a cable event of the same function,
NIC PCI error recovery right after a GPU reset.

Link events are faults only on compute rails: with a topology (``topology.model.Topology``,
analysed, as ``linkpass topology --from`` reads it), a port of a NIC whose role is not
``compute`` is ``benign``.  Without one, a link-down or cable-unplugged event is benign when the
port was never seen up and the driver probed (boot) or unloaded the device shortly before;
an INIT->ACTIVE bring-up is benign.  Generic NCCL symptoms (retry-exceeded completions, socket
errors, ncclRemoteError, watchdog timeouts) are ``unattributed`` with action none unless kernel
or port evidence in the same input names a faulty NIC or GPU; then they are its secondaries.

Sources:

- NVIDIA, *Analyzing Xid Errors with the Xid Catalog*
  https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, through NVIDIA/NVSentinel's
  machine-readable copy (``xiderrorsmapping.csv``, commit 6f8b0fcf): :data:`XID_CATALOG`.
- NVML ``nvmlDeviceGpuRecoveryAction_t`` (values printed by Xid 154): :data:`RECOVERY_ACTIONS`.
- NVIDIA open-gpu-kernel-modules (Xid 94/95 ``RST:``/``D-RST:`` containment lines).
- ``ibv_poll_cq(3)`` work-completion status codes and ``ibv_get_async_event(3)`` event types.
- NCCL maintainers in NVIDIA/nccl#905, #1353, #1664 (port-error flapping, flush after retry).
- The corpus notes in ``tests/fixtures/corpus/xid_catalog/XID_NOTES.md``.

:func:`classify` never raises on any input: unreadable lines are skipped and counted
(:func:`classify_report`), lines it does not recognise are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from linkpass.core.logparse import Record, parse_lines

DOMAINS = ("gpu", "nvlink", "gpu-memory", "nic-link", "nic-device", "app", "config", "benign", "unattributed")
ACTIONS = ("none", "reroute", "migrate-rank")
REMEDIES = ("none", "observe", "reset-gpu", "reboot-node", "drain-node", "replace-part", "check-config")

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

#: ibv_wc_status -> (name, domain, action, remedy) when nothing else explains it.
WC_STATUS: dict[int, tuple[str, str, str, str]] = {
    1: ("LOC_LEN_ERR", "app", "none", "none"),
    2: ("LOC_QP_OP_ERR", "app", "none", "none"),
    4: ("LOC_PROT_ERR", "config", "none", "check-config"),   # MR / GPUDirect RDMA / ACS setup
    5: ("WR_FLUSH_ERR", "config", "none", "check-config"),   # first error: ACS / firmware (nccl#1353)
    9: ("REM_INV_REQ_ERR", "app", "none", "none"),
    10: ("REM_ACCESS_ERR", "app", "none", "none"),
    11: ("REM_OP_ERR", "app", "none", "none"),
    12: ("RETRY_EXC_ERR", "unattributed", "none", "observe"),
    13: ("RNR_RETRY_EXC_ERR", "unattributed", "none", "observe"),
}
_WC_DEFAULT = ("OTHER", "unattributed", "none", "observe")

#: ibv async event text (as NCCL prints it) -> (code name, domain, action, remedy).
ASYNC_EVENTS: dict[str, tuple[str, str, str, str]] = {
    "port error": ("port_err", "nic-link", "reroute", "observe"),
    "local catastrophic error": ("device_fatal", "nic-device", "reroute", "reboot-node"),
    "local access violation work queue error": ("qp_access_err", "app", "none", "check-config"),
    "invalid request local work queue error": ("qp_req_err", "app", "none", "none"),
    "local work queue catastrophic error": ("qp_fatal", "app", "none", "none"),
    "cq error": ("cq_err", "app", "none", "none"),
    "port active": ("port_active", "benign", "none", "none"),
    "lid change": ("lid_change", "benign", "none", "none"),
    "pkey change": ("pkey_change", "benign", "none", "none"),
    "sm change": ("sm_change", "benign", "none", "none"),
    "gid table change": ("gid_change", "benign", "none", "none"),
    "client reregistration": ("client_reregister", "benign", "none", "none"),
    "srq limit reached": ("srq_limit", "app", "none", "none"),
}

#: fixed kernel messages -> (code, domain, action, remedy)
KERNEL_FIXED: dict[str, tuple[str, str, str, str]] = {
    "insufficient_power": ("mlx5:insufficient_power", "benign", "none", "none"),
    "peermem": ("peermem:invalid_context", "benign", "none", "none"),
    "amdgpu_reset": ("amdgpu:gpu_reset", "gpu", "none", "observe"),
    "fallen": ("nvrm:fallen_off_bus", "gpu", "migrate-rank", "reboot-node"),
    "health": ("mlx5:health_compromised", "nic-device", "reroute", "reboot-node"),
    "pci_offline": ("mlx5:pci_channel_offline", "nic-device", "reroute", "reboot-node"),
    "cmd_timeout": ("mlx5:cmd_timeout", "nic-device", "reroute", "reboot-node"),
}

#: NCCL generic symptoms, most specific first; only the most specific tier present is kept
#: when nothing else explains them.
NCCL_TIERS = {"nccl:socket_error": 1, "nccl:remote_error": 2, "nccl:system_error": 2, "nccl:internal_error": 2,
              "nccl:cuda_error": 2, "nccl:watchdog_timeout": 3}

#: seconds within which a follow-on is linked to an earlier root (when the stamps compare)
FOLLOW_WINDOW_S = 120.0
#: seconds after a GPU reset within which a NIC's PCI error recovery is collateral
COLLATERAL_WINDOW_S = 5.0
#: seconds after a driver probe (or around an unload) within which a port event is boot/unload noise
BOOT_WINDOW_S = 300.0

_SERIOUS = ("reset-gpu", "drain-node", "reboot-node", "replace-part")
_DEVICE_DOMAINS = ("gpu", "nvlink", "gpu-memory")


def _bus(text: str | None) -> str | None:
    """Full lower-case PCI bus id from ``0000:a1:00``, ``00000000:08:00.0``, ``A1:00.0``; None if not one."""
    if not text:
        return None
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?", text.strip())
    if not m:
        return None
    return f"{int(m.group(1) or '0', 16):04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4) or '0'}"


def xid_reading(xid: int) -> tuple[str, str, str]:
    """(domain, action, remedy) of an Xid on its own, from :data:`XID_CATALOG`; an Xid the
    catalog lacks is a GPU event to observe."""
    if xid in XID_OVERRIDES:
        return XID_OVERRIDES[xid]
    entry = XID_CATALOG.get(xid)
    return XID_BUCKETS.get(entry[1], ("gpu", "none", "observe")) if entry else ("gpu", "none", "observe")


# ---------------------------------------------------------------------------------------------
# events: one recognised record each

@dataclass
class _Ev:
    kind: str
    rec: Record
    f: dict[str, Any]


_BUSPAT = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_ST = re.compile  # short alias

#: (kind, pattern) tried in order on each record's message; the first that matches wins.
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("wc", _ST(r"Got completion from peer (\S+?) with (?:error |status=)\s*(\d+)(?:.*?vendor err (\d+))?(?:.*?\bhca (\S+))?")),
    ("async", _ST(r"NET/IB\s*:\s*(?:(\S+?):(\d+)\s+)?Got async event\s*:\s*([^\r\n]+?)\s*$")),
    ("async", _ST(r"(?:(mlx\w+|\w+_\d+):(\d+)\s+)?async (?:fatal )?event(?: on QP \S+)?\s*:\s*([a-z][a-z ]+?)\s*$")),
    # NVRM's format: "Xid (PCI:0000:91:00): 79, pid=..., text"; old drivers: "Xid (0000:03:00): 79, text".
    # The code ends at a comma or at the end of a complete line (never at the end of a cut one).
    ("xid", _ST(r"NVRM: Xid \((?:PCI:)?(" + _BUSPAT + r")(?: GPU-I:\w+)?\): (\d+)(?:\s*,\s*(.*)|\s*)$")),
    ("xid_banner", _ST(r"NVRM: _kgspLogXid(\d+):")),
    ("gpu_at", _ST(r"NVRM: GPU at PCI:(" + _BUSPAT + r")")),
    ("fallen", _ST(r"NVRM: (?:The NVIDIA )?GPU (" + _BUSPAT + r")\b.*?fallen off the bus")),
    ("smi", _ST(r"Unable to determine the device handle for GPU ?(" + _BUSPAT + r")")),
    ("sxid", _ST(r"SXid \(PCI:(" + _BUSPAT + r")\): (\d+),?\s*(.*)$")),
    ("fm_sxid", _ST(r"detected NVSwitch (non-fatal|fatal) error (\d+) .*?pci bus id (" + _BUSPAT + r")")),
    ("amdgpu_reset", _ST(r"amdgpu (" + _BUSPAT + r"): amdgpu: GPU reset")),
    ("nic_pci", _ST(r"mlx5_core (" + _BUSPAT + r"): mlx5_pci_(?:err_detected|slot_reset|resume)\b(.*)$")),
    ("pci_offline", _ST(r"mlx5_core (" + _BUSPAT + r"):.*PCI channel offline")),
    ("health", _ST(r"mlx5_core (" + _BUSPAT + r"):.*(?:health compromised|unrecoverable|FW fatal)")),
    ("cmd_timeout", _ST(r"mlx5_core (" + _BUSPAT + r"):.*cmd_work_handler.*timeout")),
    ("insufficient_power", _ST(r"mlx5_core (" + _BUSPAT + r"):.*insufficient power on the PCIe slot")),
    ("cable", _ST(r"mlx5_core (" + _BUSPAT + r"): Port module event(?:\[error\])?: module \d+, Cable (plugged|unplugged|error)")),
    ("port", _ST(r"mlx5_core (" + _BUSPAT + r") (\S+): Port: (\d+) Link (ACTIVE|DOWN|INIT|ARMED|ACTIVE_DEFER)\b")),
    ("link", _ST(r"(?:mlx5_core (" + _BUSPAT + r") )(\S+): Link (up|down)\b")),
    ("link", _ST(r"^()(?:\S+ " + _BUSPAT + r" )?(\S+): (?:NIC )?Link is (Up|Down)\b")),
    ("rename", _ST(r"mlx5_core (" + _BUSPAT + r") (\S+): renamed from (\S+)")),
    ("probe", _ST(r"mlx5_core (" + _BUSPAT + r"): (?:firmware version|.*available PCIe bandwidth|E-Switch: Total vports|"
                  r"Rate limit:|MLX5E: StrdRq|Port module event)")),
    ("unload", _ST(r"mlx5_core (" + _BUSPAT + r")[ :].*(?:remove_one|Shutdown was called|E-Switch: cleanup|"
                   r"E-Switch: Disable|mlx5_unload|teardown)")),
    ("bond", _ST(r"^\S+: \(slave (\S+)\): link status definitely (up|down)")),
    ("peermem", _ST(r"nvidia-peermem .*invalid context")),
    ("watchdog", _ST(r"Watchdog caught collective operation timeout|watchdog thread terminated|"
                     r"ProcessGroupNCCL's watchdog got stuck")),
    ("socket", _ST(r"Call to (?:recv|send|connect|accept)\b.*failed\s*:|Connection closed by remote peer|"
                   r"Connection reset by peer|Broken pipe|NET/Socket\s*:.*(?:failed|error)")),
    ("generic", _ST(r"ncclRemoteError|remote process exited or there was a network error|ncclSystemError|"
                    r"unhandled system error|ncclInternalError|internal error - please report|"
                    r"unhandled cuda error|ncclUnhandledCudaError")),
]


def _events(records: list[Record]) -> list[_Ev]:
    out: list[_Ev] = []
    for r in records:
        for kind, pat in PATTERNS:
            m = pat.search(r.msg)
            if m and kind == "xid" and m.group(3) is None and r.cut:
                continue  # "...Xid (PCI:0000:91:00): 7" cut off: the code may be the start of 79
            if m:
                out.append(_Ev(kind, r, _fields(kind, m, r.msg)))
                break
    return out


def _fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    g = m.groups()
    if kind == "wc":
        return {"status": int(g[1]), "vendor": int(g[2]) if g[2] else None, "hca": g[3]}
    if kind == "async":
        dev = f"{g[0]}/{g[1]}" if g[0] else None
        return {"text": g[2].strip().lower(), "device": dev, "ibdev": g[0]}
    if kind == "xid":
        return {"gpu": _bus(g[0]), "xid": int(g[1]), "text": g[2] or ""}
    if kind == "xid_banner":
        return {"xid": int(g[0])}
    if kind in ("gpu_at", "fallen", "smi", "amdgpu_reset"):
        return {"gpu": _bus(g[0])}
    if kind == "sxid":
        text = g[2]
        fatal = (True if re.search(r"\bFatal\b|Severity [1-9]", text) else
                 False if re.search(r"Non-fatal|Severity 0", text) else None)
        return {"switch": _bus(g[0]), "sxid": int(g[1]), "fatal": fatal}
    if kind == "fm_sxid":
        return {"switch": _bus(g[2]), "sxid": int(g[1]), "fatal": g[0] == "fatal"}
    if kind == "nic_pci":
        return {"bus": _bus(g[0]), "recovered": "recovered" in g[1] or "resume" in msg and "Exit" in g[1]}
    if kind in ("pci_offline", "health", "cmd_timeout", "insufficient_power", "probe", "unload"):
        return {"bus": _bus(g[0])}
    if kind == "cable":
        return {"bus": _bus(g[0]), "what": g[1]}
    if kind == "port":
        return {"bus": _bus(g[0]), "ibdev": g[1], "port": int(g[2]), "state": g[3]}
    if kind == "link":
        return {"bus": _bus(g[0]) if g[0] else None, "netdev": g[1], "up": g[2].lower() == "up"}
    if kind == "rename":
        return {"bus": _bus(g[0]), "netdev": g[1], "old": g[2]}
    if kind == "bond":
        return {"netdev": g[0], "up": g[1] == "up"}
    if kind == "watchdog":
        return {"code": "nccl:watchdog_timeout"}
    if kind == "socket":
        return {"code": "nccl:socket_error"}
    if kind == "generic":
        t = m.group(0).lower()
        code = ("nccl:system_error" if "system" in t else "nccl:internal_error" if "internal" in t else
                "nccl:cuda_error" if "cuda" in t else "nccl:remote_error")
        return {"code": code}
    return {}


# ---------------------------------------------------------------------------------------------
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

    def to_json(self) -> dict:
        """Exactly the issue's fields."""
        return {"domain": self.domain, "device": self.device, "code": self.code, "action": self.action,
                "remedy": self.remedy, "secondary_of": self.secondary_of, "first_line": self.first_line,
                "last_line": self.last_line}


@dataclass
class Classification:
    """:func:`classify_report`'s result: incidents, the number of input lines, the numbers of
    the lines skipped as unreadable, and how many records were recognised as evidence."""

    incidents: list[Incident]
    lines: int
    skipped: list[int]
    recognised: int


@dataclass
class _Inc:
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
    parent: "_Inc | None" = None
    dropped: bool = False
    own: bool = True  # keeps its own domain when made a secondary
    occ: list[int] = field(default_factory=list)  # lines of the events that are this incident happening (again)

    @property
    def first(self) -> int:
        return min(self.lines)

    def again(self, ev: _Ev) -> None:
        """``ev`` is this incident happening again (a repeat), not a related event (a recovery)."""
        self.add(ev)
        self.occ.append(ev.rec.first_line)

    def add(self, ev: _Ev) -> None:
        self.lines.append(ev.rec.first_line)
        self.last = max(self.last, ev.rec.last_line)
        self.stamps.append((ev.rec.ts, ev.rec.clock))


def _close(a: tuple[float | None, str | None], b: tuple[float | None, str | None], window: float) -> bool:
    """b happened at most ``window`` s after a (or stamps do not compare: then order decides)."""
    if a[0] is None or b[0] is None or a[1] != b[1]:
        return True
    return -1.0 <= b[0] - a[0] <= window


class _Topo:
    """What the classifier needs from an analysed ``topology.model.Topology`` (duck-typed)."""

    def __init__(self, topo: Any) -> None:
        self.by_bus: dict[str, Any] = {}
        self.by_name: dict[str, Any] = {}
        self.by_netdev: dict[str, tuple[Any, int | None]] = {}
        for n in getattr(topo, "nics", None) or []:
            name = getattr(n, "name", None)
            if name:
                self.by_name[name] = n
            bus = _bus(getattr(n, "pci_bus_id", None))
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


def classify(lines: Iterable, topology: Any = None) -> list[Incident]:
    """Incidents in ``lines`` (str or bytes, one log line each); see the module docstring.

    ``topology``: an analysed ``topology.model.Topology`` (NIC roles), or None.  Never raises.
    """
    return classify_report(lines, topology).incidents


def classify_text(text: str | bytes, topology: Any = None) -> list[Incident]:
    """:func:`classify` of a whole text (split into lines here, line ends kept: a last line
    without one is cut off, see :attr:`linkpass.core.logparse.Record.cut`)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    return classify(str(text).splitlines(keepends=True), topology)


def classify_report(lines: Iterable, topology: Any = None) -> Classification:
    """Like :func:`classify`, with the counts: input lines, skipped (unreadable) line numbers,
    records recognised as evidence.  Never raises: an internal error on some odd input is
    reported as no incidents rather than an exception (the input is what it is)."""
    try:
        parsed = parse_lines(lines)
    except Exception:  # an iterable that fails while being read: what was read is lost
        return Classification([], 0, [], 0)
    try:
        events = _events(parsed.records)
        incidents = _Builder(events, topology).run()
    except Exception:  # pragma: no cover - a classifier bug must not take the caller down
        events, incidents = [], []
    return Classification(incidents, parsed.lines, parsed.skipped, len(events))


class _Builder:
    def __init__(self, events: list[_Ev], topology: Any) -> None:
        self.events = events
        self.topo = _Topo(topology) if topology is not None else None
        self.incs: list[_Inc] = []
        self.index: dict[tuple, _Inc] = {}
        self.fstate: dict[str, str] = {}
        self.probes: dict[str, list[tuple[int, tuple]]] = {}
        self.unloads: dict[str, list[tuple[int, tuple]]] = {}
        # registry of NIC names seen in the input
        self.bus_of_netdev: dict[str, str] = {}
        self.bus_of_ibdev: dict[str, str] = {}
        self.ibdev_of_bus: dict[str, str] = {}
        self.port_of_bus: dict[str, int] = {}
        for ev in events:
            f = ev.f
            if ev.kind in ("link", "rename") and f.get("bus") and f.get("netdev"):
                self.bus_of_netdev[f["netdev"]] = f["bus"]
            if ev.kind == "port" and f.get("bus"):
                self.bus_of_ibdev[f["ibdev"]] = f["bus"]
                self.ibdev_of_bus[f["bus"]] = f["ibdev"]
                self.port_of_bus[f["bus"]] = f["port"]

    # -- names ---------------------------------------------------------------------------------

    def fkey(self, bus: str | None = None, netdev: str | None = None, ibdev: str | None = None) -> str | None:
        b = bus or (self.bus_of_netdev.get(netdev) if netdev else None) or (self.bus_of_ibdev.get(ibdev) if ibdev else None)
        if not b and self.topo:
            nic, _ = self.topo.nic(netdev=netdev, ibdev=ibdev)
            if nic is not None:
                b = _bus(getattr(nic, "pci_bus_id", None)) or f"nic:{nic.name}"
        return b or (f"netdev:{netdev}" if netdev else f"ibdev:{ibdev}" if ibdev else None)

    def nic_of(self, inc: _Inc) -> Any:
        if not self.topo:
            return None
        fk = inc.fkey or ""
        bus = fk if _bus(fk) == fk else None
        nic, _ = self.topo.nic(bus=bus, netdev=inc.x.get("netdev"), ibdev=inc.x.get("ibdev") or self.ibdev_of_bus.get(fk))
        if nic is None and fk.startswith("nic:"):
            nic = self.topo.by_name.get(fk[4:])
        return nic

    def role(self, inc: _Inc) -> str | None:
        nic = self.nic_of(inc)
        return getattr(nic, "role", None) if nic is not None else None

    def port_label(self, inc: _Inc) -> str | None:
        fk = inc.fkey or ""
        ibdev = inc.x.get("ibdev") or self.ibdev_of_bus.get(fk)
        port = inc.x.get("port") or self.port_of_bus.get(fk)
        if ibdev:
            return f"{ibdev}/{port}" if port else ibdev
        nic = self.nic_of(inc)
        if nic is not None and not _bus(nic.name):
            tport = self.topo.by_netdev.get(inc.x.get("netdev") or "", (None, None))[1] if self.topo else None
            p = tport or port or (nic.ports[0].port if len(getattr(nic, "ports", []) or []) == 1 else None)
            return f"{nic.name}/{p}" if p else nic.name
        if inc.x.get("netdev"):
            return inc.x["netdev"]
        if fk.startswith(("netdev:", "ibdev:", "nic:")):
            return fk.split(":", 1)[1]
        return fk or None

    # -- phase 1: events -> incidents (collapsing repeats) --------------------------------------

    def new(self, code: str, key: tuple, kind: str, reading: tuple[str, str, str], ev: _Ev, **kw) -> _Inc:
        inc = self.index.get(key)
        if inc is not None:
            inc.again(ev)
            return inc
        inc = _Inc(code, key, kind, reading[0], reading[1], reading[2], [ev.rec.first_line], ev.rec.last_line,
                   [(ev.rec.ts, ev.rec.clock)], ev.rec.msg[:200], **kw)
        inc.occ.append(ev.rec.first_line)
        self.incs.append(inc)
        self.index[key] = inc
        return inc

    def run(self) -> list[Incident]:
        evs = self.events
        for i, ev in enumerate(evs):
            if ev.kind == "xid_banner":  # the GSP banner names no GPU: take the nearest "GPU at PCI" line
                after = [e for e in evs[i + 1:i + 6] if e.kind == "gpu_at"]
                before = [e for e in evs[max(0, i - 5):i] if e.kind == "gpu_at"]
                gpu = after[0].f["gpu"] if after else before[-1].f["gpu"] if before else None
                self.xid(_Ev("xid", ev.rec, {"gpu": gpu, "xid": ev.f["xid"], "text": ""}))
            else:
                getattr(self, "ev_" + ev.kind, self.ev_other)(ev)
        for ev in evs:
            if ev.kind == "smi":  # a tool's error about a GPU: part of that GPU's incident, if any
                inc = next((x for x in self.incs if x.gpu == ev.f["gpu"] and x.kind == "xid"
                            and XID_LINKS.get(x.x.get("xid")) != "follow"), None)
                if inc is not None:
                    inc.add(ev)
        self.readings()
        self.link_all()
        return self.output()

    def ev_other(self, ev: _Ev) -> None:
        pass

    def ev_xid(self, ev: _Ev) -> None:
        self.xid(ev)

    def xid(self, ev: _Ev) -> None:
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

    def ev_fallen(self, ev: _Ev) -> None:
        g = ev.f["gpu"]
        if ("xid:79", g) in self.index:
            self.index[("xid:79", g)].again(ev)
            return
        self.fixed("fallen", ev, gpu=g, device=g)

    def fixed(self, what: str, ev: _Ev, **kw) -> _Inc:
        code, dom, act, rem = KERNEL_FIXED[what]
        dev = kw.get("device")
        return self.new(code, (code, dev), what, (dom, act, rem), ev, **kw)

    def ev_amdgpu_reset(self, ev: _Ev) -> None:
        self.fixed("amdgpu_reset", ev, gpu=ev.f["gpu"], device=ev.f["gpu"])

    def ev_peermem(self, ev: _Ev) -> None:
        self.fixed("peermem", ev)

    def ev_insufficient_power(self, ev: _Ev) -> None:
        self.fixed("insufficient_power", ev)  # platform noise on every function: one host-level item

    def _nic_fixed(self, what: str, ev: _Ev) -> None:
        b = ev.f["bus"]
        self.fixed(what, ev, fkey=self.fkey(bus=b), device=b)

    def ev_health(self, ev: _Ev) -> None:
        self._nic_fixed("health", ev)

    def ev_pci_offline(self, ev: _Ev) -> None:
        self._nic_fixed("pci_offline", ev)

    def ev_cmd_timeout(self, ev: _Ev) -> None:
        self._nic_fixed("cmd_timeout", ev)

    def ev_sxid(self, ev: _Ev) -> None:
        sw, n = ev.f["switch"], ev.f["sxid"]
        inc = self.new(f"sxid:{n}", (f"sxid:{n}", sw), "sxid", ("nvlink", "none", "observe"), ev, device=sw)
        inc.x["sxid"] = n
        if ev.f["fatal"] is not None:
            inc.x["fatal"] = inc.x.get("fatal", False) or ev.f["fatal"]

    ev_fm_sxid = ev_sxid

    def ev_nic_pci(self, ev: _Ev) -> None:
        b = ev.f["bus"]
        inc = self.new("mlx5:pci_slot_reset", ("mlx5:pci_slot_reset", b), "nic_pci", ("nic-device", "reroute", "reboot-node"),
                       ev, fkey=self.fkey(bus=b), device=b)
        inc.x["recovered"] = inc.x.get("recovered", False) or ev.f["recovered"]

    def ev_probe(self, ev: _Ev) -> None:
        self.probes.setdefault(self.fkey(bus=ev.f["bus"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    ev_rename = ev_probe

    def ev_unload(self, ev: _Ev) -> None:
        self.unloads.setdefault(self.fkey(bus=ev.f["bus"]) or "", []).append((ev.rec.first_line, (ev.rec.ts, ev.rec.clock)))

    def ev_cable(self, ev: _Ev) -> None:
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

    def ev_port(self, ev: _Ev) -> None:
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

    def ev_link(self, ev: _Ev) -> None:
        f = ev.f
        fk = self.fkey(bus=f["bus"], netdev=f["netdev"])
        (self.up if f["up"] else self.down)(ev, fk, False, {"netdev": f["netdev"]})

    def ev_bond(self, ev: _Ev) -> None:
        f = ev.f
        fk = self.fkey(netdev=f["netdev"])
        (self.up if f["up"] else self.down)(ev, fk, True, {"netdev": f["netdev"]})

    def down(self, ev: _Ev, fk: str | None, bond: bool, kw: dict) -> None:
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

    def up(self, ev: _Ev, fk: str | None, bond: bool, kw: dict) -> None:
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

    def ev_wc(self, ev: _Ev) -> None:
        st = ev.f["status"]
        hca = ev.f.get("hca")
        dev = hca.replace(":", "/") if hca else None
        name, dom, act, rem = WC_STATUS.get(st, _WC_DEFAULT)
        inc = self.new(f"ibv_wc:{st}", (f"ibv_wc:{st}", dev), "wc", (dom, act, rem), ev, device=dev)
        inc.x["status"] = st
        inc.x["ibdev"] = hca.split(":")[0] if hca else None

    def ev_async(self, ev: _Ev) -> None:
        text = ev.f["text"]
        reading = ASYNC_EVENTS.get(text) or next((v for k, v in ASYNC_EVENTS.items() if k in text),
                                                 ("other", "unattributed", "none", "observe"))
        code = f"ibv_event:{reading[0]}"
        dev = ev.f["device"]
        inc = self.new(code, (code, dev), "async", reading[1:], ev, device=dev)
        inc.x["ibdev"] = ev.f.get("ibdev")
        if dev:
            inc.fkey = self.fkey(ibdev=ev.f.get("ibdev"))

    def _nccl(self, ev: _Ev) -> None:
        code = ev.f["code"]
        self.new(code, (code, None), "nccl", ("unattributed", "none", "observe"), ev)

    ev_socket = ev_generic = ev_watchdog = _nccl

    # -- phase 2: readings that need the whole input ---------------------------------------------

    def boot_noise(self, inc: _Inc) -> bool:
        """The driver probed the function shortly before (boot), or unloaded it around then."""
        fk = inc.fkey or ""
        first = (inc.first, inc.stamps[0])
        if any(line < first[0] and _close(st, first[1], BOOT_WINDOW_S) for line, st in self.probes.get(fk, [])):
            return True
        return any(_close(st, first[1], BOOT_WINDOW_S) or _close(first[1], st, BOOT_WINDOW_S)
                   for _, st in self.unloads.get(fk, []))

    def readings(self) -> None:
        for inc in self.incs:
            if inc.kind in ("link_down", "cable_unplugged", "cable_error"):
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
            elif inc.kind in ("port_init", "link_up"):
                inc.device = self.port_label(inc)
            elif inc.kind == "sxid":
                fatal = inc.x.get("fatal")
                if fatal is None:
                    fatal = SXID_NAMES.get(inc.x["sxid"], ("", False))[1]
                inc.domain, inc.action, inc.remedy = ("nvlink", "migrate-rank", "drain-node") if fatal else ("nvlink", "none", "observe")
            elif inc.kind == "nic_pci" and inc.x.get("recovered"):
                inc.action, inc.remedy = "none", "observe"
            elif inc.kind == "async":
                role = self.role(inc) if inc.fkey else None
                if inc.code == "ibv_event:port_err":
                    if role is not None and role != "compute":
                        inc.domain, inc.action, inc.remedy = "benign", "none", "none"
                    elif len(inc.lines) > 1:
                        inc.remedy = "drain-node" if inc.device is None else "replace-part"
                elif role is not None and role != "compute" and inc.action == "reroute":
                    inc.action = "none"
            elif inc.kind == "xid" and inc.x.get("xid") == 154:
                rem = RECOVERY_ACTIONS.get(inc.x.get("to", 0), "observe")
                inc.x["recovery"] = rem
                inc.domain, inc.action, inc.remedy = "gpu", "migrate-rank" if rem in _SERIOUS else "none", rem
            if inc.kind in ("nic_pci", "health", "pci_offline", "cmd_timeout"):
                role = self.role(inc)
                if role is not None and role != "compute":
                    inc.action = "none"

    # -- phase 2: follow-on events -> their roots ------------------------------------------------

    @staticmethod
    def latest_before(inc: _Inc, line: int) -> int:
        return max((x for x in inc.lines if x < line), default=-1)

    def nearest_earlier(self, x: _Inc, cands: list[_Inc], window: float = FOLLOW_WINDOW_S) -> _Inc | None:
        best, best_line = None, -1
        for c in cands:
            if c is x or c.dropped or c.first >= x.first:
                continue
            line = self.latest_before(c, x.first)
            st = c.stamps[c.lines.index(line)] if line in c.lines else c.stamps[0]
            if _close(st, x.stamps[0], window) and line > best_line:
                best, best_line = c, line
        return best

    def link_all(self) -> None:
        for x in sorted(self.incs, key=lambda i: i.first):
            if x.dropped:
                continue
            self.link_one(x)
        # NCCL symptoms nothing explains: keep only the most specific kind present
        loose = [i for i in self.incs if i.kind == "nccl" and i.parent is None and not i.dropped]
        if loose:
            rdma = any(i.kind in ("wc", "async") and not i.dropped for i in self.incs)
            best = min(NCCL_TIERS.get(i.code, 9) for i in loose)
            for i in loose:
                if rdma or NCCL_TIERS.get(i.code, 9) > best:
                    i.dropped = True

    def secondary(self, x: _Inc, root: _Inc, inherit: bool, keep_reading: bool = False) -> None:
        x.parent = root
        if inherit:
            x.domain = root.domain
        if not keep_reading:
            x.action, x.remedy = "none", "none"

    def roots_like(self, pred) -> list[_Inc]:
        return [i for i in self.incs if not i.dropped and pred(i)]

    def link_one(self, x: _Inc) -> None:
        kind = x.kind
        if kind == "xid":
            n = x.x["xid"]
            role = XID_LINKS.get(n)
            same = self.roots_like(lambda i: i is not x and i.gpu == x.gpu and i.kind in ("xid", "fallen")
                                   and XID_LINKS.get(i.x.get("xid")) != "follow")
            if role == "follow":
                cause = x.x.get("cause")
                pool = [i for i in same if cause is not None and i.x.get("xid") == cause] or same
                if n == 45:
                    root = min(pool, key=lambda i: min(abs(l - x.first) for l in i.lines), default=None)
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
        elif kind == "sxid":
            lost = self.roots_like(lambda i: i.code in ("xid:79", "nvrm:fallen_off_bus"))
            root = self.nearest_earlier(x, lost)
            if root is not None:
                self.secondary(x, root, False)
        elif kind == "nic_pci":
            gpus = self.roots_like(lambda i: i.domain == "gpu" and i.gpu is not None and i.parent is None)
            root = self.nearest_earlier(x, gpus, COLLATERAL_WINDOW_S)
            if root is not None:
                self.secondary(x, root, False, keep_reading=True)
        elif kind in ("link_down", "link_up", "cable_plugged"):
            if kind == "cable_plugged":
                if any(line < x.first and _close(st, x.stamps[0], BOOT_WINDOW_S) for line, st in self.probes.get(x.fkey or "", [])):
                    x.dropped = True  # the probe-time report of a cable that is simply there
                return
            codes = ("cable_unplugged", "cable_error") + (("cable_plugged",) if kind == "link_up" else ())
            cables = self.roots_like(lambda i: i.kind in codes and i.fkey == x.fkey)
            root = self.nearest_earlier(x, cables, float("inf"))
            if root is not None:
                self.secondary(x, root, True)
            elif kind == "link_up":
                x.dropped = True  # a port coming up with nothing before it: normal bring-up
        elif kind == "wc":
            rdma = self.roots_like(lambda i: i.parent is None and (
                (i.kind == "async" and i.domain != "benign")
                or (i.kind in ("link_down", "cable_unplugged", "cable_error", "nic_pci", "health", "pci_offline", "cmd_timeout")
                    and i.domain in ("nic-link", "nic-device"))))
            hca = x.x.get("ibdev")
            # a completion error that names its HCA follows only evidence naming that HCA (an event
            # on another NIC explains nothing about it); one that names none may follow any
            pool = [i for i in rdma if hca in (i.x.get("ibdev"), self.ibdev_of_bus.get(i.fkey or ""),
                                               getattr(self.nic_of(i), "name", None))] if hca else rdma
            root = self.nearest_earlier(x, pool, float("inf"))
            if root is None and x.x["status"] in (5, 12, 13):
                later = [i for i in pool if i.first > x.first and i.domain in ("nic-link", "nic-device")]
                root = min(later, key=lambda i: i.first, default=None)
            if root is None and x.x["status"] == 5:  # a flush only follows from an earlier error
                root = self.nearest_earlier(x, self.roots_like(lambda i: i.kind == "wc" and i.parent is None), float("inf"))
            if root is not None:
                self.secondary(x, root, True)
        elif kind == "nccl":
            faults = self.roots_like(lambda i: i.parent is None and i.kind != "nccl" and i.action != "none"
                                     and i.domain in ("gpu", "nvlink", "nic-link", "nic-device"))
            root = self.nearest_earlier(x, faults, float("inf")) or min(faults, key=lambda i: i.first, default=None)
            if root is not None:
                self.secondary(x, root, True)

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
                                i.first, max(i.last, max(i.lines)), len(i.lines), i.summary, tuple(sorted(i.occ or i.lines))))
        return out
