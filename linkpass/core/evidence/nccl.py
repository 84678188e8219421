"""NCCL, PyTorch and CUDA symptoms: socket errors, NCCL result codes (ncclRemoteError,
ncclSystemError, ...), the IB plugin's "communicator encountered a fatal error", CUDA errors
(NCCL's ``Cuda failure``, PyTorch's ``CUDA error:`` / ``CUDA out of memory``) and the
ProcessGroupNCCL watchdog and heartbeat monitor.

Readings:

- Generic NCCL symptoms are ``unattributed`` with action none unless kernel or port evidence in
  the same input names a faulty NIC or GPU; then they are its secondaries.  Of the generic
  symptoms nothing explains, only the most specific kind present is kept (:data:`NCCL_TIERS`).
- CUDA errors are application faults (domain ``app``) unless the CUDA documentation of the
  error says the hardware failed (:data:`CUDA_READINGS`).  After a GPU-family incident (an Xid,
  a GPU fallen off the bus) in the same input they are its secondaries: CUDA's "unspecified
  launch failure" after Xid 79 is the lost GPU, not the application.
- A CUDA error on a host explains the socket errors / ncclRemoteError / watchdog timeouts of
  the same host (a rank that died of out-of-memory closes its connections): they are its
  secondaries.  The host comes from NCCL's line prefix ``host:pid:tid [cudaDev]``.

Sources:

- NVIDIA/nccl (master 5067397c and tags back to v2.4.8-1): ``src/misc/socket.cc`` and
  ``src/os/linux.cc`` (``"socketProgress: Connection closed by remote peer %s"``,
  ``"Call to %s %s failed : %s"`` with ``recv from``/``send to``, ``"%s: connect to %s failed :
  %s"``, ``"... returned %s, exceeded error retry count after %d attempts"``; 2.18's
  ``"socketStartConnect: Connect to %s failed : %s"``, ``"exceeded retries (%d)"``,
  ``"exceeded timeouts (%d)"``, ``"socketTryAccept: Accept failed: %s"``);
  ``src/include/checks.h`` (``"Cuda failure '%s'"``, ``NCCLCHECK``/``SYSCHECK``
  ``"Call to %s failed: %s"``) and ``src/include/cudawrap.h`` (``"Cuda failure %d '%s'"``);
  ``src/init.cc`` ``ncclGetErrorString`` (the result texts in :data:`NCCL_RESULTS`);
  ``src/proxy.cc`` (``"[Proxy Service %d] Failed to execute operation %s from rank %d, retcode
  %d"``, ``"[Service thread] Error encountered progressing operation=%s, res=%d, ..."``: the
  numbers are ``ncclResult_t``);
  ``src/transport/net_ib/common.cc`` ``ncclIbStatsCheckFatalCount``
  (``"communicator encountered a fatal error (detected in %s)"``, after a fatal async event).
- pytorch/pytorch ``torch/csrc/distributed/c10d/NCCLUtils.{hpp,cpp}`` (``C10D_NCCL_CHECK``:
  ``"NCCL error in: %s:%d, <ncclGetErrorString>, NCCL version %s"``, ``getNcclErrorDetailStr``:
  ``"ncclRemoteError: A call failed possibly due to a network error or a remote process exiting
  prematurely."`` etc.) and ``ProcessGroupNCCL.cpp`` (``"Watchdog caught collective operation
  timeout: WorkNCCL(SeqNum=.., OpType=.., ...) ran for %d milliseconds before timing out."``,
  ``"Process group watchdog thread terminated with exception: %s"`` (older: ``"NCCL watchdog
  thread terminated with exception"``), ``"Heartbeat monitor timed out! ..."``,
  ``"ProcessGroupNCCL's watchdog got stuck for %d seconds ..."``); c10/cuda
  ``C10_CUDA_CHECK`` (``"CUDA error: %s"``) and the caching allocator's ``"CUDA out of memory.
  Tried to allocate ..."``.
- CUDA 13.0 runtime: ``driver_types.h`` ``enum cudaError`` (numbers, names, documentation) and
  ``cudaGetErrorString`` of libcudart (the texts in :data:`CUDA_ERRORS`).
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import Ev, Inc

#: NCCL generic symptoms, most specific first; only the most specific tier present is kept
#: when nothing else explains them.
NCCL_TIERS = {"nccl:socket_error": 1, "nccl:remote_error": 2, "nccl:system_error": 2, "nccl:internal_error": 2,
              "nccl:cuda_error": 2, "nccl:comm_fatal": 2, "nccl:timeout": 2, "nccl:unknown_result": 2,
              "nccl:watchdog_timeout": 3, "nccl:heartbeat_timeout": 3}

_OBS = ("unattributed", "none", "observe")
_APP = ("app", "none", "none")
_CFG = ("config", "none", "check-config")

#: ``ncclResult_t`` (nccl.h) -> (enum name, ``ncclGetErrorString`` text start, code, reading).
#: Invalid argument / usage are the caller's errors (``getNcclErrorDetailStr``: "usually
#: reflects invalid usage of NCCL library"); the others are generic symptoms.
NCCL_RESULTS: dict[int, tuple[str, str, str, tuple[str, str, str]]] = {
    1: ("ncclUnhandledCudaError", "unhandled cuda error", "nccl:cuda_error", _OBS),
    2: ("ncclSystemError", "unhandled system error", "nccl:system_error", _OBS),
    3: ("ncclInternalError", "internal error - please report", "nccl:internal_error", _OBS),
    4: ("ncclInvalidArgument", "invalid argument (run with NCCL_DEBUG", "nccl:invalid_argument", _APP),
    5: ("ncclInvalidUsage", "invalid usage (run with NCCL_DEBUG", "nccl:invalid_usage", _APP),
    6: ("ncclRemoteError", "remote process exited or there was a network error", "nccl:remote_error", _OBS),
    8: ("ncclTimeout", "", "nccl:timeout", _OBS),
}

#: ``enum cudaError`` (CUDA 13.0 driver_types.h) -> (name without ``cudaError``, text of
#: ``cudaGetErrorString``).  The code of an error is ``cuda:<name in snake case>``.
CUDA_ERRORS: dict[int, tuple[str, str]] = {
    1: ("InvalidValue", "invalid argument"),
    2: ("MemoryAllocation", "out of memory"),
    3: ("InitializationError", "initialization error"),
    4: ("CudartUnloading", "driver shutting down"),
    9: ("InvalidConfiguration", "invalid configuration argument"),
    12: ("InvalidPitchValue", "invalid pitch argument"),
    13: ("InvalidSymbol", "invalid device symbol"),
    16: ("InvalidHostPointer", "invalid host pointer"),
    17: ("InvalidDevicePointer", "invalid device pointer"),
    21: ("InvalidMemcpyDirection", "invalid copy direction for memcpy"),
    34: ("StubLibrary", "CUDA driver is a stub library"),
    35: ("InsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"),
    36: ("CallRequiresNewerDriver", "API call is not supported in the installed CUDA driver"),
    46: ("DevicesUnavailable", "CUDA-capable device(s) is/are busy or unavailable"),
    49: ("IncompatibleDriverContext", "incompatible driver context"),
    52: ("MissingConfiguration", "__global__ function call is not configured"),
    53: ("PriorLaunchFailure", "unspecified launch failure in prior launch"),
    98: ("InvalidDeviceFunction", "invalid device function"),
    100: ("NoDevice", "no CUDA-capable device is detected"),
    101: ("InvalidDevice", "invalid device ordinal"),
    127: ("StartupFailure", "startup failure in cuda runtime"),
    200: ("InvalidKernelImage", "device kernel image is invalid"),
    201: ("DeviceUninitialized", "invalid device context"),
    209: ("NoKernelImageForDevice", "no kernel image is available for execution on the device"),
    214: ("ECCUncorrectable", "uncorrectable ECC error encountered"),
    215: ("UnsupportedLimit", "limit is not supported on this architecture"),
    216: ("DeviceAlreadyInUse", "exclusive-thread device already in use by a different thread"),
    217: ("PeerAccessUnsupported", "peer access is not supported between these two devices"),
    218: ("InvalidPtx", "a PTX JIT compilation failed"),
    220: ("NvlinkUncorrectable", "uncorrectable NVLink error detected during the execution"),
    222: ("UnsupportedPtxVersion", "the provided PTX was compiled with an unsupported toolchain."),
    226: ("Contained", "Invalid access of peer GPU memory over nvlink or a hardware error"),
    304: ("OperatingSystem", "OS call failed or operation not supported on this OS"),
    400: ("InvalidResourceHandle", "invalid resource handle"),
    401: ("IllegalState", "the operation cannot be performed in the present state"),
    500: ("SymbolNotFound", "named symbol not found"),
    600: ("NotReady", "device not ready"),
    700: ("IllegalAddress", "an illegal memory access was encountered"),
    701: ("LaunchOutOfResources", "too many resources requested for launch"),
    702: ("LaunchTimeout", "the launch timed out and was terminated"),
    704: ("PeerAccessAlreadyEnabled", "peer access is already enabled"),
    705: ("PeerAccessNotEnabled", "peer access has not been enabled"),
    708: ("SetOnActiveProcess", "cannot set while device is active in this process"),
    709: ("ContextIsDestroyed", "context is destroyed"),
    710: ("Assert", "device-side assert triggered"),
    711: ("TooManyPeers", "peer mapping resources exhausted"),
    712: ("HostMemoryAlreadyRegistered", "part or all of the requested memory range is already mapped"),
    713: ("HostMemoryNotRegistered", "pointer does not correspond to a registered memory region"),
    714: ("HardwareStackError", "hardware stack error"),
    715: ("IllegalInstruction", "an illegal instruction was encountered"),
    716: ("MisalignedAddress", "misaligned address"),
    717: ("InvalidAddressSpace", "operation not supported on global/shared address space"),
    718: ("InvalidPc", "invalid program counter"),
    719: ("LaunchFailure", "unspecified launch failure"),
    720: ("CooperativeLaunchTooLarge", "too many blocks in cooperative launch"),
    800: ("NotPermitted", "operation not permitted"),
    801: ("NotSupported", "operation not supported"),
    802: ("SystemNotReady", "system not yet initialized"),
    803: ("SystemDriverMismatch", "system has unsupported display driver / cuda driver combination"),
    804: ("CompatNotSupportedOnDevice", "forward compatibility was attempted on non supported HW"),
    805: ("MpsConnectionFailed", "MPS client failed to connect to the MPS control daemon or the MPS server"),
    900: ("StreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    901: ("StreamCaptureInvalidated", "operation failed due to a previous error during capture"),
    909: ("Timeout", "wait operation timed out"),
    999: ("Unknown", "unknown error"),
}

#: CUDA errors whose reading is not "the application's fault" (domain app, action none),
#: from the errors' documentation in driver_types.h:
#: 214/220 "an uncorrectable ECC / NVLink error was detected during execution" (hardware: move
#: the rank, reset the GPU); 226 "certain classes of hardware errors" or invalid peer access,
#: contained to the process (like Xid 94: watch); 46 "busy/unavailable due to ... compute mode
#: ... or memory constraints", 100 "no CUDA-capable devices were detected by the installed
#: driver", 3/34/35/36/802/803/804 driver/runtime set-up (configuration: neither says by
#: itself that a GPU was lost; after an Xid they are its secondaries); 999 "an unknown internal
#: error" (what CUDA calls return once a GPU fell off the bus: watch the GPU); 4 "driver
#: shutting down" is process teardown.
CUDA_READINGS: dict[int, tuple[str, str, str]] = {
    214: ("gpu-memory", "migrate-rank", "reset-gpu"),
    220: ("nvlink", "migrate-rank", "reset-gpu"),
    226: ("app", "none", "observe"),
    46: _CFG, 100: _CFG, 3: _CFG, 34: _CFG, 35: _CFG, 36: _CFG, 802: _CFG, 803: _CFG, 804: _CFG,
    999: ("gpu", "none", "observe"),
    4: ("benign", "none", "none"),
}
_CUDA_BY_TEXT = {t.lower(): n for n, (_, t) in CUDA_ERRORS.items()}
_CUDA_BY_PREFIX = sorted(_CUDA_BY_TEXT.items(), key=lambda tn: -len(tn[0]))


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def cuda_code(num: int | None) -> str:
    """``cuda:<snake case of the cudaError name>`` (2 is ``cuda:out_of_memory``, its text)."""
    if num == 2:
        return "cuda:out_of_memory"
    if num in CUDA_ERRORS:
        return "cuda:" + _snake(CUDA_ERRORS[num][0])
    return f"cuda:{num}" if num is not None else "cuda:other"


_ST = re.compile
#: NCCL's line prefix ``host:pid:tid [cudaDev]`` (``ncclDebugLog``)
_HOST = _ST(r"(?:^|[\s\]>])([^\s:\[\]]+):(\d+):(\d+) \[(\d+)\]")
_CUDA_TEXT = r"'?([^'\r\n]*?)'?\s*$"

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`).
#: CUDA errors first: the watchdog's "terminated with exception: CUDA error: ..." is the CUDA
#: error; then the watchdog's own timeout; then NCCL's result codes.
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("cuda", _ST(r"Cuda failure (-?\d+)\s+" + _CUDA_TEXT)),             # cudawrap.h: "Cuda failure %d '%s'"
    ("cuda", _ST(r"Cuda failure ()'([^'\r\n]*)'?")),                      # checks.h: "Cuda failure '%s'"
    ("cuda_oom", _ST(r"CUDA out of memory\. Tried to allocate|OutOfMemoryError: CUDA out of memory")),
    ("cuda", _ST(r"CUDA (?:driver )?error: ()([^\r\n]*?)\s*(?:\(\d+\))?\s*(?:CUDA kernel errors|$)")),
    ("watchdog", _ST(r"Watchdog caught collective operation timeout")),
    ("heartbeat", _ST(r"Heartbeat monitor timed out|ProcessGroupNCCL's watchdog got stuck")),
    ("comm_fatal", _ST(r"communicator encountered a fatal error")),
    ("socket", _ST(r"Call to (?:recv from|send to|recv|send|connect|accept)\b.*failed\s*:|"
                   r"Connection closed by remote peer|[Cc]onnect to \S+ (?:failed\s*:|returned .*exceeded error retry)|"
                   r"socket(?:Start|Poll)Connect: exceeded (?:retries|timeouts)|Accept failed: |"
                   r"Connection reset by peer|Broken pipe|NET/Socket\s*:.*(?:failed|error)")),
    ("generic", _ST(r"\b(ncclUnhandledCudaError|ncclSystemError|ncclInternalError|ncclInvalidArgument|"
                    r"ncclInvalidUsage|ncclRemoteError|ncclTimeout)\b|"
                    r"(unhandled cuda error|unhandled system error|internal error - please report|"
                    r"invalid argument \(run with NCCL_DEBUG|invalid usage \(run with NCCL_DEBUG|"
                    r"remote process exited or there was a network error|unknown result code|Unknown NCCL error)|"
                    r"\b(nccl[A-Z]\w*Error)\b")),
    # proxy.cc: "[Proxy Service %d] Failed to execute operation %s from rank %d, retcode %d" (2.12 ..),
    # "[Service thread] Error encountered progressing operation=%s, res=%d, closing connection"
    ("proxy", _ST(r"(?:Failed to execute operation \w+ from rank \d+, retcode|"
                  r"Error encountered progressing operation=\w+, res=)\s*(-?\d+)")),
    ("watchdog", _ST(r"watchdog thread terminated with exception")),
]


def _host(msg: str) -> str | None:
    m = _HOST.search(msg)
    return m.group(1) if m else None


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    f: dict[str, Any] = {"host": _host(msg)}
    if kind == "cuda":
        num = int(m.group(1)) if m.group(1) else None
        text = (m.group(2) or "").strip().strip("'").strip()
        if num is None:  # the text alone; a caller may have run on past it ("... Compile with ...")
            low = text.lower()
            num = _CUDA_BY_TEXT.get(low)
            if num is None:
                num = next((n for t, n in _CUDA_BY_PREFIX if low.startswith(t)), None)
        known = num in CUDA_ERRORS
        f.update(num=num, text=text, known=known)
    elif kind == "cuda_oom":
        f.update(num=2, text="out of memory", known=True)
    elif kind == "watchdog":
        f["code"] = "nccl:watchdog_timeout"
    elif kind == "heartbeat":
        f["code"] = "nccl:heartbeat_timeout"
    elif kind == "comm_fatal":
        f["code"] = "nccl:comm_fatal"
    elif kind == "socket":
        f["code"] = "nccl:socket_error"
    elif kind == "proxy":  # the retcode is an ncclResult_t
        hit = NCCL_RESULTS.get(int(m.group(1)))
        if hit is not None:
            f.update(code=hit[2], reading=hit[3])
        else:
            f.update(code="nccl:unknown_result", reading=_OBS, known=False)
    elif kind == "generic":
        name, text, other = m.groups()
        hit = next((v for v in NCCL_RESULTS.values() if (name and v[0] == name) or (text and v[1] and
                    text.lower().startswith(v[1].lower()))), None)
        if hit is not None:
            f.update(code=hit[2], reading=hit[3])
        else:  # "unknown result code", "Unknown NCCL error!", an ncclXxxError this table lacks
            f.update(code="nccl:unknown_result", reading=_OBS, known=False)
    return f


class Rules:
    """The NCCL family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin)."""

    def ev_nccl(self, ev: Ev) -> None:
        code = ev.f["code"]
        inc = self.new(code, (code, None), "nccl", ev.f.get("reading", _OBS), ev)
        inc.x.setdefault("hosts", set()).add(ev.f.get("host"))
        if ev.f.get("known") is False:
            inc.known = False

    ev_socket = ev_generic = ev_proxy = ev_watchdog = ev_heartbeat = ev_comm_fatal = ev_nccl

    def ev_cuda(self, ev: Ev) -> None:
        num = ev.f.get("num")
        code = cuda_code(num)
        inc = self.new(code, (code, None), "cuda", CUDA_READINGS.get(num, _APP), ev)
        inc.x.setdefault("hosts", set()).add(ev.f.get("host"))
        inc.known = bool(ev.f.get("known"))

    ev_cuda_oom = ev_cuda

    def link_cuda(self, x: Inc) -> None:
        """After a GPU-family incident (Xid, fallen off the bus, SXid) the CUDA error is its
        consequence (the nearest earlier one, else the first in the input)."""
        gpu = self.roots_like(lambda i: i.parent is None and i.kind in ("xid", "fallen", "sxid")
                              and i.domain in ("gpu", "nvlink", "gpu-memory", "app"))
        root = self.nearest_earlier(x, gpu, float("inf")) or min(gpu, key=lambda i: i.first, default=None)
        if root is not None:
            self.secondary(x, root, True)

    def link_nccl(self, x: Inc) -> None:
        faults = self.roots_like(lambda i: i.parent is None and i.kind not in ("nccl", "cuda") and i.action != "none"
                                 and i.domain in ("gpu", "nvlink", "nic-link", "nic-device"))
        root = self.nearest_earlier(x, faults, float("inf")) or min(faults, key=lambda i: i.first, default=None)
        if root is None and x.code == "nccl:comm_fatal":
            # ncclIbStatsCheckFatalCount: set by a fatal async event (or completion error) of the
            # IB plugin, which may be printed after it by another thread
            rdma = self.roots_like(lambda i: i.parent is None and i.kind in ("async", "wc") and i.domain != "benign")
            root = min(rdma, key=lambda i: (i.kind != "async", abs(i.first - x.first)), default=None)
        if root is not None:
            self.secondary(x, root, True)

    def after_links(self) -> None:
        """A CUDA error explains the NCCL symptoms of its own host; of the NCCL symptoms
        nothing explains, keep only the most specific kind present."""
        cuda = [i for i in self.incs if i.kind == "cuda" and not i.dropped and i.domain != "benign"]
        for x in self.incs:
            if x.kind != "nccl" or x.parent is not None or x.dropped or x.code not in NCCL_TIERS:
                continue
            hosts = x.x.get("hosts", set()) - {None}
            same = [c for c in cuda if not hosts or not (c.x.get("hosts", set()) - {None})
                    or hosts & c.x.get("hosts", set())]
            root = min(same, key=lambda c: c.first, default=None)
            if root is not None:
                self.secondary(x, root.parent or root, True)
        loose = [i for i in self.incs if i.kind == "nccl" and i.parent is None and not i.dropped and i.code in NCCL_TIERS]
        if loose:
            rdma = any(i.kind in ("wc", "async") and not i.dropped for i in self.incs)
            best = min(NCCL_TIERS.get(i.code, 9) for i in loose)
            for i in loose:
                if rdma or NCCL_TIERS.get(i.code, 9) > best:
                    i.dropped = True
