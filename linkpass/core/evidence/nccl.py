"""NCCL and PyTorch symptoms: socket errors, ncclRemoteError / ncclSystemError /
ncclInternalError / unhandled CUDA errors, the ProcessGroupNCCL watchdog.

Generic symptoms are ``unattributed`` with action none unless kernel or port evidence in the
same input names a faulty NIC or GPU; then they are its secondaries.  Of the generic symptoms
nothing explains, only the most specific kind present is kept (:data:`NCCL_TIERS`).

Sources: NCCL src/misc/socket.cc, src/include/checks.h, src/init.cc (the WARN texts);
PyTorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (the watchdog texts).
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import Ev, Inc

#: NCCL generic symptoms, most specific first; only the most specific tier present is kept
#: when nothing else explains them.
NCCL_TIERS = {"nccl:socket_error": 1, "nccl:remote_error": 2, "nccl:system_error": 2, "nccl:internal_error": 2,
              "nccl:cuda_error": 2, "nccl:watchdog_timeout": 3}

_ST = re.compile

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("watchdog", _ST(r"Watchdog caught collective operation timeout|watchdog thread terminated|"
                     r"ProcessGroupNCCL's watchdog got stuck")),
    ("socket", _ST(r"Call to (?:recv|send|connect|accept)\b.*failed\s*:|Connection closed by remote peer|"
                   r"Connection reset by peer|Broken pipe|NET/Socket\s*:.*(?:failed|error)")),
    ("generic", _ST(r"ncclRemoteError|remote process exited or there was a network error|ncclSystemError|"
                    r"unhandled system error|ncclInternalError|internal error - please report|"
                    r"unhandled cuda error|ncclUnhandledCudaError")),
]


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
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


class Rules:
    """The NCCL family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin)."""

    def ev_nccl(self, ev: Ev) -> None:
        code = ev.f["code"]
        self.new(code, (code, None), "nccl", ("unattributed", "none", "observe"), ev)

    ev_socket = ev_generic = ev_watchdog = ev_nccl

    def link_nccl(self, x: Inc) -> None:
        faults = self.roots_like(lambda i: i.parent is None and i.kind != "nccl" and i.action != "none"
                                 and i.domain in ("gpu", "nvlink", "nic-link", "nic-device"))
        root = self.nearest_earlier(x, faults, float("inf")) or min(faults, key=lambda i: i.first, default=None)
        if root is not None:
            self.secondary(x, root, True)

    def after_links(self) -> None:
        """NCCL symptoms nothing explains: keep only the most specific kind present."""
        loose = [i for i in self.incs if i.kind == "nccl" and i.parent is None and not i.dropped]
        if loose:
            rdma = any(i.kind in ("wc", "async") and not i.dropped for i in self.incs)
            best = min(NCCL_TIERS.get(i.code, 9) for i in loose)
            for i in loose:
                if rdma or NCCL_TIERS.get(i.code, 9) > best:
                    i.dropped = True
