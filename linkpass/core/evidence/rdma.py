"""RDMA evidence as NCCL prints it: work-completion errors (``Got completion from peer ... with
error N``) and verbs async events (``NET/IB : Got async event : ...``).

A completion error that names its HCA follows only evidence naming that HCA; generic ones
(retry exceeded, flush) follow the nearest RDMA port or device event, else stay
``unattributed``.

Sources: ``ibv_poll_cq(3)`` work-completion status codes, ``ibv_get_async_event(3)`` event types,
NCCL src/transport/net_ib.cc (the WARN texts), NCCL maintainers in NVIDIA/nccl#905, #1353, #1664
(port-error flapping, flush after retry).
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import Ev, Inc
from linkpass.core.evidence.nic import NIC_FAULT_KINDS

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


_ST = re.compile

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("wc", _ST(r"Got completion from peer (\S+?) with (?:error |status=)\s*(\d+)(?:.*?vendor err (\d+))?(?:.*?\bhca (\S+))?")),
    ("async", _ST(r"NET/IB\s*:\s*(?:(\S+?):(\d+)\s+)?Got async event\s*:\s*([^\r\n]+?)\s*$")),
    ("async", _ST(r"(?:(mlx\w+|\w+_\d+):(\d+)\s+)?async (?:fatal )?event(?: on QP \S+)?\s*:\s*([a-z][a-z ]+?)\s*$")),
]


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groups()
    if kind == "wc":
        return {"status": int(g[1]), "vendor": int(g[2]) if g[2] else None, "hca": g[3]}
    if kind == "async":
        dev = f"{g[0]}/{g[1]}" if g[0] else None
        return {"text": g[2].strip().lower(), "device": dev, "ibdev": g[0]}
    return {}


class Rules:
    """The RDMA family's part of :class:`linkpass.core.evidence.builder.Builder` (a mixin)."""

    def ev_wc(self, ev: Ev) -> None:
        st = ev.f["status"]
        hca = ev.f.get("hca")
        dev = hca.replace(":", "/") if hca else None
        name, dom, act, rem = WC_STATUS.get(st, _WC_DEFAULT)
        inc = self.new(f"ibv_wc:{st}", (f"ibv_wc:{st}", dev), "wc", (dom, act, rem), ev, device=dev)
        inc.x["status"] = st
        inc.x["ibdev"] = hca.split(":")[0] if hca else None

    def ev_async(self, ev: Ev) -> None:
        text = ev.f["text"]
        reading = ASYNC_EVENTS.get(text) or next((v for k, v in ASYNC_EVENTS.items() if k in text),
                                                 ("other", "unattributed", "none", "observe"))
        code = f"ibv_event:{reading[0]}"
        dev = ev.f["device"]
        inc = self.new(code, (code, dev), "async", reading[1:], ev, device=dev)
        inc.x["ibdev"] = ev.f.get("ibdev")
        if dev:
            inc.fkey = self.fkey(ibdev=ev.f.get("ibdev"))


    def read_async(self, inc: Inc) -> None:
        role = self.role(inc) if inc.fkey else None
        if inc.code == "ibv_event:port_err":
            if role is not None and role != "compute":
                inc.domain, inc.action, inc.remedy = "benign", "none", "none"
            elif len(inc.lines) > 1:
                inc.remedy = "drain-node" if inc.device is None else "replace-part"
        elif role is not None and role != "compute" and inc.action == "reroute":
            inc.action = "none"

    def link_wc(self, x: Inc) -> None:
        rdma = self.roots_like(lambda i: i.parent is None and (
            (i.kind == "async" and i.domain != "benign")
            or (i.kind in NIC_FAULT_KINDS and i.domain in ("nic-link", "nic-device"))))
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
