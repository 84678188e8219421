"""A scripted stand-in for the ``pynvml`` functions :class:`linkpass.adapters.counters.NvmlCounters`
calls, beside the adapter it stands in for.  Each GPU has a list of steps; :meth:`FakeNvml.step`
moves every GPU to its next step (the last repeats).  A step is a dict of readings::

    {"ecc_corrected": 12, "ecc_uncorrected": 0, "remap": (corr, unc, pending, failure),
     "retired_pending": 0 | 1, "nvlink": {"crc_flit": [per link], "replay": [...], "recovery": [...]},
     "pcie_replay": 3, "temp": 61, "slowdown": 87}

A reading left out raises NVML_ERROR_NOT_SUPPORTED (that GPU lacks it); a reading that is an
exception instance is raised; ``"hang"`` blocks until :meth:`FakeNvml.release` (a hung driver
call).  Constants and ``NVMLError`` mirror nvidia-ml-py 13.615's ``pynvml``.
"""

from __future__ import annotations

import threading
from typing import Any

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_MAX_LINKS = 18
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """``steps``: GPU index -> list of step dicts (see the module docstring)."""

    NVMLError = NVMLError
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_MEMORY_ERROR_TYPE_CORRECTED = NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC
    NVML_FEATURE_ENABLED = NVML_FEATURE_ENABLED
    NVML_NVLINK_ERROR_DL_REPLAY = NVML_NVLINK_ERROR_DL_REPLAY
    NVML_NVLINK_ERROR_DL_RECOVERY = NVML_NVLINK_ERROR_DL_RECOVERY
    NVML_NVLINK_ERROR_DL_CRC_FLIT = NVML_NVLINK_ERROR_DL_CRC_FLIT
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = NVML_TEMPERATURE_THRESHOLD_SLOWDOWN

    def __init__(self, steps: dict[int, list[dict]]):
        self.steps = steps
        self.n = 0
        self.calls = 0
        self._release = threading.Event()

    def step(self) -> None:
        self.n += 1

    def release(self) -> None:
        self._release.set()

    def _cur(self, h: int) -> dict:
        seq = self.steps.get(h)
        if not seq:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return seq[min(self.n, len(seq) - 1)]

    def _get(self, h: int, name: str) -> Any:
        self.calls += 1
        st = self._cur(h)
        if name not in st:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        v = st[name]
        if isinstance(v, BaseException):
            raise v
        if isinstance(v, str) and v == "hang":
            self._release.wait()
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return v

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.steps)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i not in self.steps:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return i

    def nvmlDeviceGetTotalEccErrors(self, h: int, etype: int, counter: int) -> int:
        return self._get(h, "ecc_corrected" if etype == NVML_MEMORY_ERROR_TYPE_CORRECTED else "ecc_uncorrected")

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._get(h, "remap")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return self._get(h, "retired_pending")

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        nl = self._get(h, "nvlink")
        name = {NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", NVML_NVLINK_ERROR_DL_REPLAY: "replay",
                NVML_NVLINK_ERROR_DL_RECOVERY: "recovery"}[counter]
        per = nl.get(name, [])
        if link >= len(per):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return per[link]

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._get(h, "pcie_replay")

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._get(h, "temp")

    def nvmlDeviceGetTemperatureThreshold(self, h: int, which: int) -> int:
        return self._get(h, "slowdown")
