"""NVML Xid events (nvidia-ml-py) -> :class:`~linkpass.core.model.DeviceIncident`.

API used (nvidia-ml-py's ``pynvml`` module, the NVML C API of the same names; checked against
nvidia-ml-py 13.615's ``pynvml.py`` and NVML's reference, "Event Handling Methods"):

- ``nvmlInit()``, ``nvmlDeviceGetCount()``, ``nvmlDeviceGetHandleByIndex(i)``,
  ``nvmlDeviceGetPciInfo(handle).busId`` (``"00000000:91:00.0"``, bytes in older bindings);
- ``nvmlEventSetCreate()``; ``nvmlDeviceRegisterEvents(handle, nvmlEventTypeXidCriticalError,
  set)`` (raises ``NVMLError`` with ``NVML_ERROR_NOT_SUPPORTED`` on GPUs without events);
- ``nvmlEventSetWait_v2(set, timeout_ms)`` -> ``c_nvmlEventData_t`` with ``device``,
  ``eventType``, ``eventData`` (the Xid for ``nvmlEventTypeXidCriticalError``),
  ``gpuInstanceId``, ``computeInstanceId``; it raises ``NVMLError`` whose ``value`` is
  ``NVML_ERROR_TIMEOUT`` when nothing arrived in ``timeout_ms``.

The wait blocks, so it runs in a worker thread (``asyncio.to_thread``) with a 1 s timeout in a
loop: cancelling the task costs at most one timeout.  An Xid event becomes the incident the
kernel-log line for it would give (``code "xid:N"``, the GPU's PCI bus id as ``device``, the
reading of :func:`linkpass.core.classify.xid_reading`, NVIDIA's Xid catalog).  The engine
merges it with the kernel-log copy of the same Xid.

No nvidia-ml-py, no driver (``nvmlInit`` fails) or no GPU that takes Xid events: the source is
off with one INFO line.  Repeated wait failures turn it off with one ERROR line; the daemon runs on.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from linkpass.core.classify import XID_CATALOG, xid_reading
from linkpass.core.model import DeviceIncident
from topology.model import norm_bus_id

log = logging.getLogger("linkpass.nvml")

WAIT_MS = 1000
#: wait failures in a row (other than timeouts) after which the source gives up
MAX_FAILURES = 5


def _text(v: Any) -> str:
    return v.decode("ascii", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def _hkey(h: Any) -> Any:
    """A hashable identity of an NVML device handle (a ctypes pointer compares by address)."""
    if isinstance(h, ctypes._Pointer):
        return ctypes.cast(h, ctypes.c_void_p).value
    return h


class NvmlXidSource:
    """Waits for NVML Xid events and posts incidents.

    Args:
        post: where incidents go (the engine queue's ``put_nowait``; called on the loop).
        nvml: the ``pynvml`` module (tests pass a fake); None: import it.
        wait_ms: timeout of one ``nvmlEventSetWait_v2``.

    Attributes:
        gpus: NVML index -> PCI bus id of the GPUs registered for Xid events.
        counters: ``events``, ``incidents``, ``wait_errors``.
        active: True while the source runs.
    """

    def __init__(self, post: Callable[[DeviceIncident], Any], nvml: Any = None, wait_ms: int = WAIT_MS):
        self.post = post
        self.nvml = nvml
        self.wait_ms = wait_ms
        self.gpus: dict[int, str] = {}
        self.counters: Counter[str] = Counter()
        self.active = False
        self._set = None
        self._by_handle: dict[Any, tuple[int, str]] = {}

    def open(self) -> bool:
        """Initialise NVML and register every GPU for Xid events; False (one INFO line) when
        the source cannot run here."""
        nv = self.nvml
        if nv is None:
            try:
                nv = self.nvml = importlib.import_module("pynvml")
            except ImportError:
                log.info("NVML Xid events off: nvidia-ml-py (pynvml) is not installed")
                return False
        try:
            nv.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
            log.info("NVML Xid events off: no NVIDIA driver here (%s)", e)
            return False
        try:
            count = nv.nvmlDeviceGetCount()
            evset = nv.nvmlEventSetCreate()
        except Exception as e:
            log.info("NVML Xid events off: %s", e)
            return False
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                bus = norm_bus_id(_text(nv.nvmlDeviceGetPciInfo(h).busId)) or f"gpu{i}"
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, evset)
            except Exception as e:
                log.info("NVML: GPU %d takes no Xid events (%s)", i, e)
                continue
            self.gpus[i] = bus
            self._by_handle[_hkey(h)] = (i, bus)
        if not self.gpus:
            log.info("NVML Xid events off: no GPU takes Xid events (%d GPU(s))", count)
            return False
        self._set = evset
        self.active = True
        log.info("NVML Xid events on for %d GPU(s): %s", len(self.gpus), ", ".join(f"{i}={b}" for i, b in sorted(self.gpus.items())))
        return True

    def gpu_index(self, bus: str) -> int | None:
        """NVML index of the GPU at PCI bus id ``bus`` (any spelling), or None."""
        b = norm_bus_id(bus) if bus else None
        return next((i for i, g in self.gpus.items() if g == b), None)

    def _wait(self):
        """One blocking wait (worker thread): the event data, or None on timeout."""
        nv = self.nvml
        try:
            return nv.nvmlEventSetWait_v2(self._set, self.wait_ms)
        except nv.NVMLError as e:
            if getattr(e, "value", None) == nv.NVML_ERROR_TIMEOUT:
                return None
            raise

    def incident(self, data: Any, now_ns: int) -> DeviceIncident | None:
        """The incident for one event (None: not an Xid event)."""
        nv = self.nvml
        if not int(getattr(data, "eventType", 0)) & nv.nvmlEventTypeXidCriticalError:
            return None
        xid = int(data.eventData)
        idx, bus = self._by_handle.get(_hkey(data.device), (None, None))
        if bus is None:
            try:
                bus = norm_bus_id(_text(nv.nvmlDeviceGetPciInfo(data.device).busId))
                idx = self.gpu_index(bus) if bus else None
            except Exception:
                bus = None
        domain, action, remedy = xid_reading(xid)
        name = XID_CATALOG.get(xid, ("unknown Xid",))[0]
        gi = getattr(data, "gpuInstanceId", 0xFFFFFFFF)
        mig = f", GPU instance {gi}" if isinstance(gi, int) and gi != 0xFFFFFFFF else ""
        return DeviceIncident("nvml", domain, bus, f"xid:{xid}", action, remedy, now_ns,
                              summary=f"NVML: Xid {xid} ({name}) on GPU {idx if idx is not None else '?'} ({bus or '?'}){mig}",
                              gpu=idx)

    async def run(self) -> None:
        """Wait for events until cancelled (call :meth:`open` first; it must have succeeded)."""
        failures = 0
        while True:
            try:
                data = await asyncio.to_thread(self._wait)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                self.counters["wait_errors"] += 1
                if failures >= MAX_FAILURES:
                    log.error("NVML event wait keeps failing (%s); NVML Xid events are now off", e)
                    self.active = False
                    await asyncio.Event().wait()  # off for good; the daemon runs on
                log.warning("NVML event wait failed (%s); retrying", e)
                await asyncio.sleep(1.0)
                continue
            failures = 0
            if data is None:
                continue
            self.counters["events"] += 1
            try:
                ev = self.incident(data, time.monotonic_ns())
            except Exception as e:  # a malformed event must not stop the source
                log.warning("NVML: unreadable event (%s); ignored", e)
                continue
            if ev is not None:
                self.counters["incidents"] += 1
                self.post(ev)

    def status(self) -> dict:
        return {"active": self.active, "gpus": {str(i): b for i, b in sorted(self.gpus.items())}, **dict(self.counters)}
