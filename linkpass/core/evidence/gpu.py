"""GPU evidence: NVIDIA Xid and SXid lines (NVRM, NVSwitch, fabric manager), a GPU fallen off
the bus, nvidia-smi losing a GPU, amdgpu resets, nvidia-peermem noise.

Sources:

- NVIDIA, *Analyzing Xid Errors with the Xid Catalog*
  https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (sheets "Xids", "XID 144-150
  Decode", "Guidance Classes"): :data:`XID_CATALOG`, :data:`XID_CATALOG_LATER`, :data:`XID_BUCKETS`;
  codes and mnemonics 1-162 as NVIDIA/NVSentinel's machine-readable copy has them
  (``xiderrorsmapping.csv``, commit 6f8b0fcf, in tests/fixtures/corpus/xid_catalog/).
- NVIDIA open-gpu-kernel-modules 595.45.04 (OGKM): the Xid numbers (src/common/sdk/nvidia/inc/
  nverror.h: :data:`XID_DRIVER_ONLY`), the NVRM Xid line (src/nvidia/src/kernel/gpu/rc/kernel_rc.c
  ``krcReportXid_IMPL``), Xid 94/95 ``RST:``/``D-RST:`` (gpu/arch/ampere/kern_gpu_error_cont_ga100.c),
  Xid 154's recovery action (gpu/gpu.c, ctrl2080gpu.h: :data:`RECOVERY_ACTIONS`), "fallen off the
  bus" (arch/nvalloc/unix/src/osinit.c, osapi.c), SXid lines and numbers (src/common/nvswitch:
  :data:`SXID_UNITS`).
- NVIDIA Dynamic Page Retirement doc and the corpus notes ``tests/fixtures/corpus/xid_catalog/XID_NOTES.md``.

An Xid or SXid number the tables lack still gives an incident, with ``known=False``: a GPU (SXid:
NVLink) event to observe, or to act on when the line itself says fatal.
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import BUSPAT, SERIOUS, Ev, Inc, bus_id

#: NVIDIA's Xid catalog, *Analyzing Xid Errors with the Xid Catalog* (Ampere and newer,
#: https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, sheet "Xids"), one row per
#: Xid: code | mnemonic | Resolution Bucket (Immediate Action) | Resolution Bucket (Investigatory
#: Action).  The codes and mnemonics are those of NVIDIA/NVSentinel's machine-readable copy
#: (``xiderrorsmapping.csv``, commit 6f8b0fcf, in tests/fixtures/corpus/xid_catalog/), which names
#: 108 and 137 by their older mnemonics (the page: NVLINK_REMOTE_TRANSLATION_ERROR, NVLINK_PRIV_ERR)
#: and leaves 162 unnamed (the page: PSHC_REENGAGED).  The buckets are the page's: it says
#: CONTACT_SUPPORT where the copy says UNEXPECTED_ERR_REPORT_ISSUE (the "Unused" Xids), XID_154 for
#: 154, IGNORE for 108 and 160 (the copy: REPORT, RESTART_BM) and no bucket for 162 (the copy:
#: RESET_GPU).  "N/A" is the page's "N/A; Unused"; SOLO_RESTART_FM its "Solo: RESTART_FM Not Solo:
#: IGNORE (follow other Xid)"; IGNORE_SYMPATHETIC its "IGNORE (sympathetic)"; INFO_OTHER_XID its
#: "N/A Informational only regarding another Xid"; an empty cell is a bucket the page leaves empty.
_CATALOG_ROWS = """
      1 | ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD              | CONTACT_SUPPORT      | N/A
      2 | ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD                | CONTACT_SUPPORT      | N/A
      3 | ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD               | CONTACT_SUPPORT      | N/A
      4 | ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY             | CONTACT_SUPPORT      | N/A
      5 | ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW          | CONTACT_SUPPORT      | N/A
      6 | ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR                | CONTACT_SUPPORT      | N/A
      7 | ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR                  | CONTACT_SUPPORT      | N/A
      8 | ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT             | RESTART_APP          | CONTACT_SUPPORT
      9 | ROBUST_CHANNEL_GR_ERROR_INSTANCE                   | CONTACT_SUPPORT      | N/A
     10 | ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP                | CONTACT_SUPPORT      | N/A
     11 | ROBUST_CHANNEL_GR_ERROR_MISSING_HW                 | RESTART_APP          | CHECK_APP/CUDA
     12 | ROBUST_CHANNEL_GR_ERROR_SW_METHOD                  | CONTACT_SUPPORT      | N/A
     13 | ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY | RESTART_APP          | WORKFLOW_XID_13
     14 | ROBUST_CHANNEL_FAKE_ERROR                          | IGNORE               | CONTACT_SUPPORT
     15 | ROBUST_CHANNEL_SCANLINE_TIMEOUT                    | CONTACT_SUPPORT      | N/A
     16 | ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT             | CONTACT_SUPPORT      | CONTACT_SUPPORT
     17 | ROBUST_CHANNEL_PARAMETER_ERROR                     | CONTACT_SUPPORT      | N/A
     18 | ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR            | CONTACT_SUPPORT      | N/A
     19 | ROBUST_CHANNEL_DISP_MISSED_NOTIFIER                | CONTACT_SUPPORT      | N/A
     20 | ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD                | CONTACT_SUPPORT      | N/A
     21 | ROBUST_CHANNEL_ME_ERROR_SW_METHOD                  | CONTACT_SUPPORT      | N/A
     22 | ROBUST_CHANNEL_VP_ERROR_SW_METHOD                  | CONTACT_SUPPORT      | N/A
     23 | ROBUST_CHANNEL_RC_LOGGING_ENABLED                  | CONTACT_SUPPORT      | N/A
     24 | ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT                | CONTACT_SUPPORT      | N/A
     25 | ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY                   | RESTART_APP          | CHECK_APP/CUDA
     26 | ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT         | CONTACT_SUPPORT      | N/A
     27 | ROBUST_CHANNEL_VP_ERROR                            | CONTACT_SUPPORT      | N/A
     28 | ROBUST_CHANNEL_VP2_ERROR                           | CONTACT_SUPPORT      | N/A
     29 | ROBUST_CHANNEL_BSP_ERROR                           | CONTACT_SUPPORT      | N/A
     30 | ROBUST_CHANNEL_BAD_ADDR_ACCESS                     | CONTACT_SUPPORT      | N/A
     31 | ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT              | RESTART_APP          | WORKFLOW_XID_31
     32 | ROBUST_CHANNEL_PBDMA_ERROR                         | RESTART_APP          | CHECK_APP/CUDA
     33 | ROBUST_CHANNEL_SEC_ERROR                           | CONTACT_SUPPORT      | N/A
     34 | ROBUST_CHANNEL_MSVLD_ERROR                         | CONTACT_SUPPORT      | N/A
     35 | ROBUST_CHANNEL_MSPDEC_ERROR                        | CONTACT_SUPPORT      | N/A
     36 | ROBUST_CHANNEL_MSPPP_ERROR                         | CONTACT_SUPPORT      | N/A
     37 | ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD      | IGNORE               | CHECK_APP/CUDA
     38 | ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT           | IGNORE               | CONTACT_SUPPORT
     39 | ROBUST_CHANNEL_CE0_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     40 | ROBUST_CHANNEL_CE1_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     41 | ROBUST_CHANNEL_CE2_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     42 | ROBUST_CHANNEL_VIC_ERROR                           | CONTACT_SUPPORT      | N/A
     43 | ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR            | IGNORE               | CONTACT_SUPPORT
     44 | ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW               | IGNORE               | CONTACT_SUPPORT
     45 | ROBUST_CHANNEL_PREEMPTIVE_REMOVAL                  | WORKFLOW_XID_45      | SOLO_RESTART_FM
     46 | ROBUST_CHANNEL_GPU_TIMEOUT_ERROR                   | RESET_GPU            | CONTACT_SUPPORT
     47 | ROBUST_CHANNEL_NVENC0_ERROR                        | CONTACT_SUPPORT      | N/A
     48 | ROBUST_CHANNEL_GPU_ECC_DBE                         | WORKFLOW_XID_48      | WORKFLOW_XID_48
     49 | SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY      | CONTACT_SUPPORT      | N/A
     50 | SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR    | CONTACT_SUPPORT      | N/A
     51 | SILENT_RUNNING_STRESS_TEST_FAILURE                 | CONTACT_SUPPORT      | N/A
     52 | SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE        | CONTACT_SUPPORT      | N/A
     53 | SILENT_RUNNING_TEMP_REDUCED_CLOCKING               | CONTACT_SUPPORT      | N/A
     54 | SILENT_RUNNING_PWR_REDUCED_CLOCKING                | CHECK_MECHANICALS    | CONTACT_SUPPORT
     55 | SILENT_RUNNING_TEMPERATURE_READ_ERROR              | CONTACT_SUPPORT      | N/A
     56 | DISPLAY_CHANNEL_EXCEPTION                          | CONTACT_SUPPORT      | N/A
     57 | FB_LINK_TRAINING_FAILURE_ERROR                     | CONTACT_SUPPORT      | N/A
     58 | FB_MEMORY_ERROR                                    | CONTACT_SUPPORT      | N/A
     59 | PMU_ERROR                                          | CONTACT_SUPPORT      | N/A
     60 | ROBUST_CHANNEL_SEC2_ERROR                          | RESTART_APP          | INVESTIGATE_SW
     61 | PMU_BREAKPOINT                                     | CONTACT_SUPPORT      | N/A
     62 | PMU_HALT_ERROR                                     | RESET_GPU            | CONTACT_SUPPORT
     63 | INFOROM_DRAM_RETIREMENT_EVENT                      | IGNORE               | IGNORE
     64 | INFOROM_DRAM_RETIREMENT_FAILURE                    | RESET_GPU            | CONTACT_SUPPORT
     65 | ROBUST_CHANNEL_NVENC1_ERROR                        | CONTACT_SUPPORT      | N/A
     66 | ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION       | IGNORE               | INVESTIGATE_SW
     67 | ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION            | IGNORE               | CONTACT_SUPPORT
     68 | ROBUST_CHANNEL_NVDEC0_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     69 | ROBUST_CHANNEL_GR_CLASS_ERROR                      | RESTART_APP          | CHECK_APP/CUDA
     70 | ROBUST_CHANNEL_CE3_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     71 | ROBUST_CHANNEL_CE4_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     72 | ROBUST_CHANNEL_CE5_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     73 | ROBUST_CHANNEL_NVENC2_ERROR                        | CONTACT_SUPPORT      | N/A
     74 | NVLINK_ERROR                                       | WORKFLOW_NVLINK_ERR  | CONTACT_SUPPORT
     75 | ROBUST_CHANNEL_CE6_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     76 | ROBUST_CHANNEL_CE7_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     77 | ROBUST_CHANNEL_CE8_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     78 | VGPU_START_ERROR                                   | UPDATE_SWFW          | UPDATE_SWFW
     79 | ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS          | RESTART_BM           | CONTACT_SUPPORT
     80 | PBDMA_PUSHBUFFER_CRC_MISMATCH                      | RESTART_APP          | CHECK_APP/CUDA
     81 | ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR                 | CONTACT_SUPPORT      | N/A
     82 | ROBUST_CHANNEL_NVJPG0_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     83 | ROBUST_CHANNEL_NVDEC1_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     84 | ROBUST_CHANNEL_NVDEC2_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     85 | ROBUST_CHANNEL_CE9_ERROR                           | RESTART_APP          | CONTACT_SUPPORT
     86 | ROBUST_CHANNEL_OFA0_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
     87 | NVTELEMETRY_DRIVER_REPORT                          | CONTACT_SUPPORT      | N/A
     88 | ROBUST_CHANNEL_NVDEC3_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     89 | ROBUST_CHANNEL_NVDEC4_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     90 | LTC_ERROR                                          | CONTACT_SUPPORT      | N/A
     91 | RESERVED_XID                                       | CONTACT_SUPPORT      | N/A
     92 | EXCESSIVE_SBE_INTERRUPTS                           | IGNORE               | CONTACT_SUPPORT
     93 | INFOROM_ERASE_LIMIT_EXCEEDED                       | IGNORE               | CONTACT_SUPPORT
     94 | ROBUST_CHANNEL_CONTAINED_ERROR                     | RESTART_APP          | IGNORE_SYMPATHETIC
     95 | ROBUST_CHANNEL_UNCONTAINED_ERROR                   | RESET_GPU            | IGNORE_SYMPATHETIC
     96 | ROBUST_CHANNEL_NVDEC5_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     97 | ROBUST_CHANNEL_NVDEC6_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     98 | ROBUST_CHANNEL_NVDEC7_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
     99 | ROBUST_CHANNEL_NVJPG1_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    100 | ROBUST_CHANNEL_NVJPG2_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    101 | ROBUST_CHANNEL_NVJPG3_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    102 | ROBUST_CHANNEL_NVJPG4_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    103 | ROBUST_CHANNEL_NVJPG5_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    104 | ROBUST_CHANNEL_NVJPG6_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    105 | ROBUST_CHANNEL_NVJPG7_ERROR                        | RESTART_APP          | CONTACT_SUPPORT
    106 | SMBPBI_TEST_MESSAGE                                | IGNORE               | IGNORE
    107 | SMBPBI_TEST_MESSAGE_SILENT                         | IGNORE               | IGNORE
    108 | DESTINATION_FLA_TRANSLATION_ERROR                  | IGNORE               | XID_137_FLOW
    109 | ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR                 | RESET_GPU            | CONTACT_SUPPORT
    110 | SEC_FAULT_ERROR                                    | RESET_GPU            | INVESTIGATE_SW
    111 | BUNDLE_ERROR_EVENT                                 | CONTACT_SUPPORT      | N/A
    112 | DISP_SUPERVISOR_ERROR                              | CONTACT_SUPPORT      | N/A
    113 | DP_LT_FAILURE                                      | CONTACT_SUPPORT      | N/A
    114 | HEAD_RG_UNDERFLOW                                  | CONTACT_SUPPORT      | N/A
    115 | CORE_CHANNEL_REGS                                  | CONTACT_SUPPORT      | N/A
    116 | WINDOW_CHANNEL_REGS                                | CONTACT_SUPPORT      | N/A
    117 | CURSOR_CHANNEL_REGS                                | CONTACT_SUPPORT      | N/A
    118 | HEAD_REGS                                          | CONTACT_SUPPORT      | N/A
    119 | GSP_RPC_TIMEOUT                                    | RESET_GPU            | INVESTIGATE_SW
    120 | GSP_ERROR                                          | RESET_GPU            | INVESTIGATE_SW
    121 | C2C_ERROR                                          | IGNORE               | CONTACT_SUPPORT
    122 | SPI_PMU_RPC_READ_FAIL                              | CONTACT_SUPPORT      | N/A
    123 | SPI_PMU_RPC_WRITE_FAIL                             | CONTACT_SUPPORT      | N/A
    124 | SPI_PMU_RPC_ERASE_FAIL                             | CONTACT_SUPPORT      | N/A
    125 | INFOROM_FS_ERROR                                   | CONTACT_SUPPORT      | N/A
    126 | ROBUST_CHANNEL_CE10_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    127 | ROBUST_CHANNEL_CE11_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    128 | ROBUST_CHANNEL_CE12_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    129 | ROBUST_CHANNEL_CE13_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    130 | ROBUST_CHANNEL_CE14_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    131 | ROBUST_CHANNEL_CE15_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    132 | ROBUST_CHANNEL_CE16_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    133 | ROBUST_CHANNEL_CE17_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    134 | ROBUST_CHANNEL_CE18_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    135 | ROBUST_CHANNEL_CE19_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    136 | ALI_TRAINING_FAIL                                  | RESET_GPU            | INVESTIGATE_LINK_SI
    137 | NVLINK_FLA_PRIV_ERR                                | IGNORE               | XID_137_FLOW
    138 | ROBUST_CHANNEL_DLA_ERROR                           | CONTACT_SUPPORT      | N/A
    139 | ROBUST_CHANNEL_OFA1_ERROR                          | RESTART_APP          | CONTACT_SUPPORT
    140 | UNRECOVERABLE_ECC_ERROR_ESCAPE                     | RESET_GPU            | CONTACT_SUPPORT
    141 | ROBUST_CHANNEL_FAST_PATH_ERROR                     | IGNORE               | CONTACT_SUPPORT
    142 | ROBUST_CHANNEL_NVENC3_ERROR                        | CONTACT_SUPPORT      | 
    143 | GPU_INIT_ERROR                                     | RESET_GPU            | CONTACT_SUPPORT
    144 | NVLINK_SAW_ERROR                                   | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    145 | NVLINK_RLW_ERROR                                   | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    146 | NVLINK_TLW_ERROR                                   | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    147 | NVLINK_TREX_ERROR                                  | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    148 | NVLINK_NVLPW_CTRL_ERROR                            | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    149 | NVLINK_NETIR_ERROR                                 | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    150 | NVLINK_MSE_ERROR                                   | WORKFLOW_NVLINK5_ERR | WORKFLOW_NVLINK5_ERR
    151 | ROBUST_CHANNEL_KEY_ROTATION_ERROR                  | RESTART_VM           | CONTACT_SUPPORT
    152 | ROBUST_CHANNEL_DLA_SMMU_ERROR                      | IGNORE               | CONTACT_SUPPORT
    153 | ROBUST_CHANNEL_DLA_TIMEOUT                         | IGNORE               | CONTACT_SUPPORT
    154 | GPU_RECOVERY_ACTION_CHANGED                        | XID_154              | INFO_OTHER_XID
    155 | NVLINK_SW_DEFINED_ERROR                            | RESET_GPU            | INVESTIGATE_SW_USER
    156 | RESOURCE_RETIREMENT_EVENT                          | RESET_GPU            | IGNORE
    157 | RESOURCE_RETIREMENT_FAILURE                        | IGNORE               | CONTACT_SUPPORT
    158 | GPU_FATAL_TIMEOUT                                  | RESET_GPU            | CONTACT_SUPPORT
    159 | ROBUST_CHANNEL_CHI_NON_DATA_ERROR                  | CHECK_UVM            | SYMPATHETIC_REPORT_SOLO
    160 | CHANNEL_RETIREMENT_EVENT                           | IGNORE               | INVESTIGATE_SW
    161 | CHANNEL_RETIREMENT_FAILURE                         | IGNORE               | INVESTIGATE_SW
    162 | (unnamed)                                          |                      | 
"""

#: The rows the catalog page publishes after NVSentinel's copy ends (same columns; the page gives
#: these no resolution bucket yet, only descriptions, quoted in :data:`XID_OVERRIDES`).
_CATALOG_LATER_ROWS = """
    163 | PSHC_DISENGAGED                                    |                      |
    164 | PSHC_LOW_LIFETIME                                  |                      |
    165 | PSHC_ZERO_LIFETIME                                 |                      |
    166 | NVLINK_SECURE_CRYPTO_ERR                           |                      |
    167 | PCIE_FATAL_TIMEOUT                                 |                      |
    168 | REDUCED_GPU_MEMORY_CAPACITY                        |                      |
    169 | SEC2_HALT_ERROR                                    |                      |
    170 | NVLINK_SECURE_OTHER                                |                      |
    171 | UNCORRECTABLE_DRAM_ERROR                           |                      |
    172 | UNCORRECTABLE_SRAM_ERROR                           |                      |
"""


def _rows(text: str) -> dict[int, tuple[str, str, str]]:
    out: dict[int, tuple[str, str, str]] = {}
    for line in text.strip("\n").splitlines():
        code, mnemonic, immediate, investigatory = (c.strip() for c in line.split("|"))
        out[int(code)] = (mnemonic, immediate, investigatory)
    return out


#: Xid -> (mnemonic, immediate-action bucket, investigatory bucket): the catalog's Xids 1-162.
XID_CATALOG: dict[int, tuple[str, str, str]] = _rows(_CATALOG_ROWS)
#: Xid -> (mnemonic, immediate-action bucket, investigatory bucket): the catalog's Xids 163-172.
XID_CATALOG_LATER: dict[int, tuple[str, str, str]] = _rows(_CATALOG_LATER_ROWS)

#: Xids the driver defines but the catalog does not list yet (open-gpu-kernel-modules 595.45.04,
#: src/common/sdk/nvidia/inc/nverror.h, up to ROBUST_CHANNEL_LAST_ERROR): Xid -> mnemonic.  Only
#: 175 has a reading (see :data:`XID_OVERRIDES`); a line with another of these is ``known=False``.
XID_DRIVER_ONLY: dict[int, str] = {
    173: "C2C_FATAL_LINK_FAILURE",
    174: "ROBUST_CHANNEL_RESETCHANNEL_KILL_PROCESS_SILENT",
    175: "MEMORY_SUBSYSTEM_ERROR",
    176: "PCIE_CORRECTABLE_ERROR_FAULT",
}

#: Immediate-action bucket -> (domain, action, remedy), from the page's "Guidance Class" sheet
#: (e.g. RESTART_APP "The application should be restarted; RESET_GPU or RESTART_BM is not deemed
#: necessary", IGNORE "No Action required", RESTART_BM "Restart bare metal").  IGNORE is refined by
#: the investigatory bucket (:func:`xid_reading`).
XID_BUCKETS: dict[str, tuple[str, str, str]] = {
    "RESTART_APP": ("app", "none", "none"),
    "IGNORE": ("gpu", "none", "observe"),
    "RESET_GPU": ("gpu", "migrate-rank", "reset-gpu"),
    "RESTART_BM": ("gpu", "migrate-rank", "reboot-node"),
    "RESTART_VM": ("gpu", "migrate-rank", "reboot-node"),
    "CONTACT_SUPPORT": ("gpu", "none", "observe"),
    "CHECK_MECHANICALS": ("gpu", "none", "observe"),   # "check device seating and connections"
    "CHECK_UVM": ("gpu", "none", "observe"),           # "if UVM/vGPU is being utilized, RESET_GPU; otherwise IGNORE"
    "UPDATE_SWFW": ("config", "none", "check-config"),
    "WORKFLOW_NVLINK_ERR": ("nvlink", "migrate-rank", "reset-gpu"),   # "A GPU reset or node reboot is needed"
    "WORKFLOW_NVLINK5_ERR": ("nvlink", "migrate-rank", "reset-gpu"),  # fatal rows; the line's severity decides
    "WORKFLOW_XID_48": ("gpu", "migrate-rank", "reset-gpu"),          # "Solo: RESET_GPU w/ 63 or 64: DRAIN_AND_RESET"
    "WORKFLOW_XID_45": ("app", "none", "none"),                       # "Not Solo: IGNORE (follow guidance in other Xid)"
    "XID_154": ("gpu", "none", "none"),                               # "Follow XID 154 reported guidance": its value
    "": ("gpu", "none", "observe"),                                   # no bucket published
}

#: Investigatory buckets that put the cause in the application (IGNORE rows): CHECK_APP/CUDA
#: "an application passing bad data", WORKFLOW_XID_13/31, XID_137_FLOW "typically application-level
#: bugs".  An IGNORE row whose investigatory bucket is IGNORE too needs nothing at all.
APP_INVESTIGATIONS = frozenset({"CHECK_APP/CUDA", "WORKFLOW_XID_13", "WORKFLOW_XID_31", "XID_137_FLOW"})

#: Xids whose reading is not their bucket's: Xid -> (domain, action, remedy), with the reason.
XID_OVERRIDES: dict[int, tuple[str, str, str]] = {
    14: ("benign", "none", "none"),               # catalog: "Fake or injected error from userspace"
    43: ("app", "none", "none"),                  # catalog: "a user application hits a software induced fault ... The GPU remains in a healthy state"
    63: ("gpu-memory", "none", "reset-gpu"),      # row remap recorded; the driver says "reset gpu to activate" ([DPR], XID_NOTES.md)
    64: ("gpu", "migrate-rank", "replace-part"),  # row remap / page retirement failed: the bad memory cannot be fenced ([DPR], XID_NOTES.md)
    92: ("gpu-memory", "none", "observe"),        # catalog: "High single-bit ECC error rate"
    94: ("app", "none", "observe"),               # catalog: "contained to one application ... reset the GPU when convenient"
    162: ("gpu", "none", "none"),                 # catalog: "Power Smoothing HW Circuitry capability reengaged"
    165: ("gpu", "none", "observe"),              # catalog: "Replace GPUs if power swings are not acceptable" (a choice, not a fault)
    167: ("gpu", "migrate-rank", "reset-gpu"),    # no bucket yet; read like 158 GPU_FATAL_TIMEOUT (RESET_GPU)
    168: ("gpu-memory", "none", "check-config"),  # catalog: "Should only be seen when ECC is disabled. Either ECC should be enabled ..."
    169: ("gpu", "migrate-rank", "reset-gpu"),    # catalog: "Internal micro-controller halt", as 62 PMU_HALT_ERROR (RESET_GPU)
    171: ("gpu", "migrate-rank", "reset-gpu"),    # catalog: "Additional to Xid 48": WORKFLOW_XID_48
    172: ("gpu", "migrate-rank", "reset-gpu"),    # likewise; OGKM kernel_gsp_ecc_gb100.c logs it after marking the GPU for reset
    175: ("gpu", "migrate-rank", "reset-gpu"),    # OGKM kernel_gsp.c _kgspClassifyGspTimeout: a GSP RPC timeout (119) classified as a memory-subsystem error
}

#: How an Xid relates to others: "follow" = a follow-on of another event (45: "caused by previous
#: Xid N", 154: the recovery action of the GPU's other Xids); "after-app" = the channel teardown
#: after an application fault (43).
XID_LINKS: dict[int, str] = {45: "follow", 154: "follow", 43: "after-app"}

#: The GPU recovery action Xid 154 prints (OGKM src/nvidia/src/kernel/gpu/gpu.c,
#: ``"GPU recovery action changed from 0x%x (%s) to 0x%x (%s)"``; values: ctrl2080gpu.h
#: ``NV2080_CTRL_GPU_RECOVERY_ACTION``, names: ``_gpuRecoveryActionName``) -> remedy.  6 and 7 are
#: newer NVML bindings' BUS_RESET and SYSTEM_REBOOT (XID_NOTES.md [NVML]).  5, RECOVER_IMEX_DOMAIN,
#: is set when fabric memory allocation is disabled: the GPU takes no fabric-memory work until the
#: IMEX domain is recovered, so the node is drained.
RECOVERY_ACTIONS: dict[int, str] = {0: "none", 1: "reset-gpu", 2: "reboot-node", 3: "drain-node", 4: "drain-node",
                                    5: "drain-node", 6: "reset-gpu", 7: "reboot-node"}
#: ``_gpuRecoveryActionName``'s texts -> value (a line whose hex value was cut off)
RECOVERY_ACTION_NAMES: dict[str, int] = {"none": 0, "gpu reset required": 1, "node reboot required": 2, "drain p2p": 3,
                                         "drain and reset": 4, "recover imex domain": 5}

#: NVSwitch SXids: the driver's ``NVSWITCH_ERR_HW`` enum (OGKM
#: src/common/nvswitch/interface/ctrl_dev_nvswitch.h) numbers them in contiguous blocks of one unit
#: each: block start -> (unit, last defined SXid).  An SXid in no block is ``known=False``.
SXID_UNITS: dict[int, tuple[str, int]] = {
    10000: ("HOST", 10010), 11000: ("NPORT_INGRESS", 11047), 12000: ("NPORT_EGRESS", 12051),
    13000: ("NPORT_FSTATE", 13008), 14000: ("NPORT_TSTATE", 14018), 15000: ("NPORT_ROUTE", 15020),
    16000: ("NPORT", 16003), 17000: ("NVLCTRL", 17008), 18000: ("NVLIPT", 18020), 19000: ("NVLTLC", 19084),
    20000: ("DLPL", 20038), 21000: ("AFS", 21010), 22000: ("MINION", 22013), 23000: ("NXBAR", 23017),
    24000: ("NPORT_SOURCETRACK", 24010), 25000: ("NVLIPT_LNK", 25010), 26000: ("SOE", 26008),
    27000: ("CCI", 27007), 28000: ("OSFP_THERM", 28005), 29000: ("NPORT_MULTICASTTSTATE", 29006),
    30000: ("NPORT_REDUCTIONTSTATE", 30006),
}

#: SXids seen in the corpus -> (the enum's name, fatal when the line does not say).  The fatality
#: comes from the line: the driver's NVSWITCH_REPORT_FATAL/NONFATAL/CORRECTABLE print "Fatal, Link
#: %02d", "Non-fatal, Link %02d", "Correctable, Link %02d" (intr_nvswitch.h), error_nvswitch.c
#: prints "Severity %d" (NVSWITCH_ERROR_SEVERITY: 0 non-fatal, 1 fatal).
SXID_NAMES: dict[int, tuple[str, bool]] = {
    20034: ("DLPL_LTSSM_FAULT_UP", True),
    22013: ("MINION_NONFATAL", False),
    24007: ("NPORT_SOURCETRACK_SOURCETRACK_TIME_OUT_ERR", True),
}


def sxid_known(n: int) -> bool:
    """Whether the driver's enum defines SXid ``n`` (:data:`SXID_UNITS`)."""
    unit = SXID_UNITS.get(n // 1000 * 1000)
    return unit is not None and n <= unit[1]


#: fixed GPU-side messages -> (code, domain, action, remedy)
FIXED: dict[str, tuple[str, str, str, str]] = {
    "peermem": ("peermem:invalid_context", "benign", "none", "none"),
    "amdgpu_reset": ("amdgpu:gpu_reset", "gpu", "none", "observe"),
    "fallen": ("nvrm:fallen_off_bus", "gpu", "migrate-rank", "reboot-node"),  # as Xid 79 (RESTART_BM)
}


def xid_entry(xid: int) -> tuple[str, str, str] | None:
    """The catalog's row for ``xid`` (:data:`XID_CATALOG`, :data:`XID_CATALOG_LATER`), or None."""
    return XID_CATALOG.get(xid) or XID_CATALOG_LATER.get(xid)


def xid_name(xid: int) -> str | None:
    """The mnemonic of ``xid`` (catalog, else the driver's nverror.h), or None."""
    e = xid_entry(xid)
    return e[0] if e else XID_DRIVER_ONLY.get(xid)


def xid_known(xid: int) -> bool:
    """Whether the tables give ``xid`` a reading (the catalog's, or an override)."""
    return xid_entry(xid) is not None or xid in XID_OVERRIDES


def xid_reading(xid: int) -> tuple[str, str, str]:
    """(domain, action, remedy) of an Xid on its own, from the catalog's buckets (an override
    first); an Xid the tables lack is a GPU event to observe."""
    if xid in XID_OVERRIDES:
        return XID_OVERRIDES[xid]
    entry = xid_entry(xid)
    if entry is None:
        return ("gpu", "none", "observe")
    _, immediate, investigatory = entry
    if immediate == "IGNORE":
        if investigatory in APP_INVESTIGATIONS:
            return ("app", "none", "none")
        if investigatory == "IGNORE":
            return ("gpu", "none", "none")
    return XID_BUCKETS.get(immediate, ("gpu", "none", "observe"))


_NONFATAL = re.compile(r"\bnon-?fatal\b", re.I)
_FATAL = re.compile(r"(?<![A-Za-z-])fatal\b", re.I)
#: Xid 94/95 containment (OGKM kern_gpu_error_cont_ga100.c ``_gpuGenerateErrorLog``:
#: "... RST: %s, D-RST: %s", bGpuResetReqd / bGpuDrainAndResetReqd)
_RST = re.compile(r"(?<![-\w])RST:\s*(Yes|No)\b.*?\bD-RST:\s*(Yes|No)\b", re.I)
_CAUSE = re.compile(r"caused by previous Xid (\d+)")
_RECOVERY = re.compile(r"recovery action changed from\s*(?:0x([0-9a-fA-F]+))?\s*(?:\(([^)]*)\))?\s*to\s*"
                       r"(?:0x([0-9a-fA-F]+))?\s*(?:\(([^)]*)\)?)?", re.I)


def says_fatal(text: str) -> bool:
    """The line calls the error fatal ("Fatal", "Link Fatal"), not only non-fatal."""
    return bool(_FATAL.search(_NONFATAL.sub("", text or "")))


def xid_line_reading(xid: int, text: str) -> tuple[tuple[str, str, str], bool]:
    """((domain, action, remedy), known) of one Xid line: :func:`xid_reading`, refined by what
    the driver prints after the code."""
    known = xid_known(xid)
    reading = xid_reading(xid)
    if xid in (94, 95):
        m = _RST.search(text or "")
        if m:
            rst, drst = (g.lower() == "yes" for g in m.groups())
            if drst:
                reading = ("gpu", "migrate-rank", "drain-node")
            elif rst:
                reading = ("gpu", "migrate-rank", "reset-gpu")
            elif xid == 95:  # uncontained, yet neither reset needed (e.g. E06 LTC unsupported client poison)
                reading = ("gpu", "none", "observe")
    elif (xid_entry(xid) or ("", "", ""))[1] == "WORKFLOW_NVLINK5_ERR":
        # catalog: "Xid (PCI:0000:BB:DF): <Xid Number> <sub component> <fatal vs nonfatal> ..."; the
        # "XID 144-150 Decode" sheet gives IGNORE to the non-fatal rows
        if _NONFATAL.search(text or "") and not says_fatal(text):
            reading = ("nvlink", "none", "observe")
    elif not known and says_fatal(text):
        reading = ("gpu", "migrate-rank", "reset-gpu")
    return reading, known


_ST = re.compile

#: a bus id as printed, or what a paste left of it ("...", "<bus>", "XXXX:XX:XX"): read by bus_id()
_BUS_OR_ELIDED = r"([^()\s]*)"

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`).  Groups
#: 1-3 of "xid" are bus, code, text: the builder reads group 3 (a cut line without text may be a
#: cut code).
PATTERNS: list[tuple[str, re.Pattern]] = [
    # OGKM src/nvidia/src/kernel/gpu/rc/kernel_rc.c krcReportXid_IMPL (XID_PRINT_WITH_ATTR):
    #   "NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[ GPU-CI:%02u]]): %d, pid=%s, name=%s, %s%s"
    #   "NVRM: Xid (PCI:%04x:%02x:%02x): %d, %s%s"   (no process; the last %s: " caused by previous Xid %d")
    # old drivers: "NVRM: Xid (0000:03:00): 14, Channel 00000001" (the catalog's own example);
    # kernel-open/nvidia/nv-tracepoint.h nvidia_dev_xid: "Xid (PCI:%s): %u, %s" (pci_name, with function).
    # The code ends at a comma or at the end of a complete line (never at the end of a cut one).
    ("xid", _ST(r"(?:NVRM: |nvidia_dev_xid: )Xid \((?:PCI:)?" + _BUS_OR_ELIDED
                + r"(?: GPU-I:\w+)?(?: GPU-CI:\w+)?\): (\d+)(?:\s*,\s*(.*)|\s*)$")),
    # the same line pasted with the parenthesised bus id cut out ("NVRM: Xid 79, GPU has fallen
    # off the bus."): the GPU is unknown, the code still reads (groups as above, bus None)
    ("xid", _ST(r"NVRM: Xid ()(\d+)(?:\s*,\s*(.*)|\s*)$")),
    ("xid_banner", _ST(r"NVRM: _kgspLogXid(\d+):")),
    # kernel_rc.c _krcLogUuidOnce: "NVRM: GPU at PCI:%04x:%02x:%02x: %s" (the GPU's UUID)
    ("gpu_at", _ST(r"NVRM: GPU at PCI:(" + BUSPAT + r")")),
    # osinit.c osHandleGpuLost: NV_DEV_PRINTF "NVRM: GPU %04x:%02x:%02x.%x: GPU has fallen off the bus.";
    # osapi.c (probe): "NVRM: The NVIDIA GPU %04x:%02x:%02x.%x\nNVRM: (PCI ID: %04x:%04x) installed in
    # this system has\nNVRM: fallen off the bus and is not responding to commands." (joined by logparse)
    ("fallen", _ST(r"NVRM: (?:The NVIDIA )?GPU (" + BUSPAT + r")\b.*?fallen off the bus")),
    ("gpu_head", _ST(r"NVRM: The NVIDIA GPU (" + BUSPAT + r")\s*$")),   # that message's first line, alone
    ("fallen_nobus", _ST(r"NVRM: (?:\(PCI ID: [0-9a-fA-F:]+\) installed in this system has )?fallen off the bus and is not responding")),
    ("smi", _ST(r"Unable to determine the device handle for GPU ?(" + BUSPAT + r")")),
    # OGKM src/common/nvswitch/kernel/inc/common_nvswitch.h NVSWITCH_PRINT_SXID:
    #   "nvidia-%s: SXid (PCI:%04x:%02x:%02x.%x): %05d, " + "Fatal, Link %02d %s%s" / "Non-fatal, ..." /
    #   "Correctable, ..." (intr_nvswitch.h) / "Severity %d Engine instance %02d ..." (error_nvswitch.c)
    ("sxid", _ST(r"SXid \((?:PCI:)?" + _BUS_OR_ELIDED + r"\): (\d+),?\s*(.*)$")),
    # NVIDIA Fabric Manager (closed source; its journal text as in the corpus):
    #   "detected NVSwitch non-fatal error 22013 on NodeId 0 on NVSwitch pci bus id 00000000:08:00.0 ..."
    ("fm_sxid", _ST(r"detected NVSwitch (non-fatal|fatal) error (\d+) .*?pci bus id (" + BUSPAT + r")", re.I)),
    ("amdgpu_reset", _ST(r"amdgpu (" + BUSPAT + r"): amdgpu: GPU reset")),
    ("peermem", _ST(r"nvidia-peermem .*invalid context")),
]


def _sxid_fatal(text: str) -> bool | None:
    """The line's own severity: the leading "Fatal," / "Non-fatal," / "Correctable," of
    intr_nvswitch.h's NVSWITCH_REPORT_*, or error_nvswitch.c's "Severity %d" (0 non-fatal, 1 fatal);
    else the word fatal anywhere; None when the line does not say (the "Data {...}" line)."""
    m = re.match(r"\s*(Fatal|Non-fatal|Nonfatal|Correctable)\b", text, re.I)
    if m:
        return m.group(1).lower() == "fatal"
    m = re.search(r"\bSeverity (\d+)", text)
    if m:
        return int(m.group(1)) > 0
    return True if says_fatal(text) else None


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groups()
    if kind == "xid":
        mig = re.search(r"GPU-I:(\w+)(?: GPU-CI:(\w+))?\)", msg)
        return {"gpu": bus_id(g[0]), "xid": int(g[1]), "text": g[2] or "",
                "gi": mig.group(1) if mig else None, "ci": mig.group(2) if mig else None}
    if kind == "xid_banner":
        return {"xid": int(g[0])}
    if kind in ("gpu_at", "fallen", "gpu_head", "smi", "amdgpu_reset"):
        return {"gpu": bus_id(g[0])}
    if kind == "sxid":
        return {"switch": bus_id(g[0]), "sxid": int(g[1]), "fatal": _sxid_fatal(g[2] or "")}
    if kind == "fm_sxid":
        return {"switch": bus_id(g[2]), "sxid": int(g[1]), "fatal": g[0].lower() == "fatal"}
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
        reading, known = xid_line_reading(n, text)
        inc = self.index.get(key)
        if inc is not None and reading[1] == "migrate-rank" and inc.action != "migrate-rank" and n not in XID_LINKS:
            # a repeat whose own words ask more (95 "RST: Yes" after "RST: No"): the worse reading wins
            inc.domain, inc.action, inc.remedy = reading
        inc = self.new(code, key, "xid", reading, ev, gpu=g, device=g)
        inc.known = inc.known and known
        inc.x["xid"] = n
        if ev.f.get("gi") is not None:
            inc.x.setdefault("gi", ev.f["gi"])
        m = _CAUSE.search(text)
        if m:
            inc.x["cause"] = int(m.group(1))
        m = _RECOVERY.search(text) if n == 154 else None
        if m:
            to = int(m.group(3), 16) if m.group(3) else RECOVERY_ACTION_NAMES.get((m.group(4) or "").strip().lower())
            if to is not None:
                inc.x["to"] = to
            if to not in RECOVERY_ACTIONS:
                inc.known = False

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

    def ev_fallen_nobus(self, ev: Ev) -> None:
        """The probe message's last line on its own: its GPU is the "The NVIDIA GPU <bus>" line
        just before (the lines of one printk), else nothing."""
        head = next((e for e in reversed(self.events[max(0, self.pos - 3):self.pos]) if e.kind == "gpu_head"), None)
        if head is not None:  # without it the line names no GPU: nothing to act on
            self.ev_fallen(Ev("fallen", ev.rec, {"gpu": head.f["gpu"]}))

    def ev_amdgpu_reset(self, ev: Ev) -> None:
        self.fixed("amdgpu_reset", ev, gpu=ev.f["gpu"], device=ev.f["gpu"])

    def ev_peermem(self, ev: Ev) -> None:
        self.fixed("peermem", ev)

    def ev_sxid(self, ev: Ev) -> None:
        sw, n = ev.f["switch"], ev.f["sxid"]
        inc = self.new(f"sxid:{n}", (f"sxid:{n}", sw), "sxid", ("nvlink", "none", "observe"), ev, device=sw)
        inc.x["sxid"] = n
        inc.known = sxid_known(n)
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
        n = inc.x.get("xid")
        if n == 154:
            rem = RECOVERY_ACTIONS.get(inc.x.get("to", 0), "observe")
            inc.x["recovery"] = rem
            inc.domain, inc.action, inc.remedy = "gpu", "migrate-rank" if rem in SERIOUS else "none", rem
        elif n == 48 and inc.remedy == "reset-gpu" and self.roots_like(
                lambda i: i.kind == "xid" and i.gpu == inc.gpu and i.x.get("xid") in (63, 64)):
            inc.remedy = "drain-node"  # catalog WORKFLOW_XID_48: "Solo: RESET_GPU w/ 63 or 64: DRAIN_AND_RESET"

    # -- follow-on events -> their roots

    def link_xid(self, x: Inc) -> None:
        n = x.x["xid"]
        role = XID_LINKS.get(n)
        # the same GPU: two lines whose bus id was cut out may be of two GPUs, so no GPU is the same
        same = self.roots_like(lambda i: i is not x and x.gpu is not None and i.gpu == x.gpu
                               and i.kind in ("xid", "fallen") and XID_LINKS.get(i.x.get("xid")) != "follow")
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
