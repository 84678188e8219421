"""RDMA evidence as NCCL prints it: work-completion errors (``Got completion from peer ... with
error N`` / ``status=N`` / ``status=IBV_WC_..(N)``), verbs async events (``NET/IB : ... async
event ...``) and failed verbs calls (``Call to ibv_modify_qp failed with ...``).

A completion error that names its HCA follows only evidence naming that HCA; generic ones
(retry exceeded, flush) follow the nearest RDMA port or device event, else stay
``unattributed``.  A status, an event or a verbs call none of the tables below knows still gives
an incident from the family's rules, with ``known`` False.

Sources (format strings read in NVIDIA/nccl, tags v2.4.8-1 .. v2.27.7-1 and master 5067397c):

- Completions: ``src/transport/net_ib.cc`` ``ncclIbTest``:
  ``"NET/IB : Got completion with error %d, opcode %d, len %d, vendor err %d"`` (<= 2.7),
  ``"NET/IB : Got completion from peer %s with error %d, opcode %d, len %d, vendor err %d"``
  (2.8 .. 2.14, then ``" (%s)%s%s%s%s"``: request type, ``localGid``, ``remoteGid`` up to 2.19),
  ``"NET/IB : Got completion from peer %s with status=%d opcode=%d len=%d vendor err %d (%s)..."``
  (2.20 .. 2.22), the same with ``NET/IB:`` and ``" hca %s"`` (2.23 .. 2.28), and master's
  ``src/transport/net_ib/p2p.cc`` ``ncclIbLogCompletionWithError``:
  ``"NET/IB: Got completion from peer %s with status=%s(%d) opcode=%s(%d) vendor_err=%u ... hca %s"``
  (``ibvWcStatusStr`` in ``src/misc/ibvwrap.cc``), and ``gin.cc``'s ``"NET/IB/GIN: Got completion ..."``.
- The status numbers: rdma-core ``libibverbs/verbs.h`` ``enum ibv_wc_status`` and
  ``libibverbs/enum_strs.c`` ``ibv_wc_status_str`` (linux-rdma/rdma-core 691953d8);
  NCCL's hints for them: ``src/transport/net_ib/common.h`` ``printIbWcStatusHint``.
- Async events: ``ncclIbAsyncThreadMain`` (``net_ib.cc`` up to 2.28, ``net_ib/common.cc`` on
  master): ``"NET/IB : Got async event : %s"`` (<= 2.20), ``"NET/IB : %s:%d Got async event : %s"``
  (2.21 .. 2.22), ``"NET/IB : %s:%d async fatal event[ on CQ|QP|SRQ ...]: %s"`` and
  ``"... Got async error event: %s"`` (2.23 .. 2.28), ``"... Got non-fatal async event: %s(%d)"``,
  ``"... GID table changed"`` and ``"... unknown event type (%d)"`` (master).  The text is
  rdma-core's ``ibv_event_type_str``; the numbers ``enum ibv_event_type``.
- Verbs calls: ``src/misc/ibvwrap.cc`` (``IBV_INT_CHECK_RET_ERRNO``: ``"Call to %s failed with
  error %s errno %d"``, ``IBV_PTR_CHECK_ERRNO``: ``"... failed with error %s"``, ``IBV_PTR_CHECK``:
  ``"... failed"``; ``wrap_ibv_modify_qp``: ``"Call to ibv_modify_qp failed with %d %s, on dev
  %s:%d, curr state %s, next state %s, ..."`` and ``printIbModifyQpHint``: ETIMEDOUT "NICs are
  not cross-rail connected" (NCCL_CROSS_NIC=0), EINVAL "incorrect GID index" (NCCL_IB_GID_INDEX)).
- NCCL maintainers in NVIDIA/nccl#905, #1353, #1664, #2013 (port-error flapping, flush after
  retry, modify_qp timeout on a rail-only fabric).
"""

from __future__ import annotations

import re
from typing import Any

from linkpass.core.evidence.base import Ev, Inc
from linkpass.core.evidence.nic import NIC_FAULT_KINDS

_APP = ("app", "none", "none")
_OBS = ("unattributed", "none", "observe")

#: ``enum ibv_wc_status`` (rdma-core verbs.h) -> (name, domain, action, remedy) when nothing
#: else explains it.  Local/remote request and protection errors are the software path (a bad
#: work request, memory key or registration); retry/timeout ones are the fabric or the peer and
#: are pinned only by other evidence.
WC_STATUS: dict[int, tuple[str, str, str, str]] = {
    0: ("SUCCESS", "benign", "none", "none"),
    1: ("LOC_LEN_ERR", *_APP),
    2: ("LOC_QP_OP_ERR", *_APP),
    3: ("LOC_EEC_OP_ERR", *_APP),
    # printIbWcStatusHint: "occurs when ACS is enabled which would break GPU Direct RDMA"
    4: ("LOC_PROT_ERR", "config", "none", "check-config"),
    # first error of its kind: "NIC on the same instance cannot talk to each other" (nccl#1353)
    5: ("WR_FLUSH_ERR", "config", "none", "check-config"),
    6: ("MW_BIND_ERR", *_APP),
    7: ("BAD_RESP_ERR", *_OBS),
    8: ("LOC_ACCESS_ERR", *_APP),
    9: ("REM_INV_REQ_ERR", *_APP),
    10: ("REM_ACCESS_ERR", *_APP),
    11: ("REM_OP_ERR", *_APP),
    # "NCCL_IB_TIMEOUT ... ~30 seconds before error": a dead link or peer, or a timeout too short
    12: ("RETRY_EXC_ERR", *_OBS),
    13: ("RNR_RETRY_EXC_ERR", *_OBS),
    14: ("LOC_RDD_VIOL_ERR", *_APP),
    15: ("REM_INV_RD_REQ_ERR", *_APP),
    16: ("REM_ABORT_ERR", *_APP),
    17: ("INV_EECN_ERR", *_APP),
    18: ("INV_EEC_STATE_ERR", *_APP),
    19: ("FATAL_ERR", *_OBS),
    20: ("RESP_TIMEOUT_ERR", *_OBS),
    21: ("GENERAL_ERR", *_OBS),
    22: ("TM_ERR", *_APP),
    23: ("TM_RNDV_INCOMPLETE", *_APP),
}
_WC_DEFAULT = ("OTHER", *_OBS)
#: the statuses that only follow from an earlier error or a dead path (NCCL's resiliency code
#: fails over on exactly 5 and 12: ``p2p_resiliency.cc``); 13 is the same for receiver-not-ready
_WC_GENERIC = (5, 12, 13)

#: ``ibv_event_type_str`` text (lower case) -> (code name, domain, action, remedy).  NCCL counts
#: DEVICE_FATAL, CQ_ERR, QP_FATAL, QP_REQ_ERR and QP_ACCESS_ERR as fatal (it stops the
#: communicator); PORT_ERR is logged as non-fatal and only the following completion error fails.
ASYNC_EVENTS: dict[str, tuple[str, str, str, str]] = {
    "cq error": ("cq_err", *_APP),
    "local work queue catastrophic error": ("qp_fatal", *_APP),
    "invalid request local work queue error": ("qp_req_err", *_APP),
    "local access violation work queue error": ("qp_access_err", "app", "none", "check-config"),
    "communication established": ("comm_est", "benign", "none", "none"),
    "send queue drained": ("sq_drained", "benign", "none", "none"),
    "path migrated": ("path_mig", "benign", "none", "none"),
    "path migration request error": ("path_mig_err", *_OBS),
    "local catastrophic error": ("device_fatal", "nic-device", "reroute", "reboot-node"),
    "port active": ("port_active", "benign", "none", "none"),
    "port error": ("port_err", "nic-link", "reroute", "observe"),
    "lid change": ("lid_change", "benign", "none", "none"),
    "p_key change": ("pkey_change", "benign", "none", "none"),
    "sm change": ("sm_change", "benign", "none", "none"),
    "srq catastrophic error": ("srq_err", *_APP),
    "srq limit reached": ("srq_limit", *_APP),
    "last wqe reached": ("last_wqe", "benign", "none", "none"),
    "client reregistration": ("client_reregister", "benign", "none", "none"),
    "gid table change": ("gid_change", "benign", "none", "none"),
    "wq fatal": ("wq_fatal", *_APP),
    # a port that came back at a lower speed carries traffic; watch it
    "device link speed change": ("speed_change", "nic-link", "none", "observe"),
}
#: ``enum ibv_event_type`` number -> its ``ibv_event_type_str`` text (lower case)
ASYNC_EVENT_NUMBERS: dict[int, str] = dict(enumerate(ASYNC_EVENTS))
_ALIASES = {"pkey change": "p_key change", "gid table changed": "gid table change"}

#: verbs calls NCCL wraps (``src/misc/ibvwrap.cc``) whose failure it WARNs
IBV_CALLS = frozenset((
    "ibv_get_device_list", "ibv_free_device_list", "ibv_get_device_name", "ibv_open_device", "ibv_close_device",
    "ibv_get_async_event", "ibv_ack_async_event", "ibv_query_device", "ibv_query_port", "ibv_query_gid",
    "ibv_query_qp", "ibv_alloc_pd", "ibv_dealloc_pd", "ibv_reg_mr", "ibv_reg_mr_iova2", "ibv_reg_dmabuf_mr",
    "ibv_dereg_mr", "ibv_create_comp_channel", "ibv_destroy_comp_channel", "ibv_create_cq", "ibv_destroy_cq",
    "ibv_create_qp", "ibv_modify_qp", "ibv_destroy_qp", "ibv_query_ece", "ibv_set_ece", "ibv_fork_init",
    "ibv_query_port_speed", "ibv_create_srq", "ibv_destroy_srq", "ibv_event_type_str"))
#: the async thread's own calls: they fail once the device they wait on is gone
_ASYNC_THREAD_CALLS = ("ibv_get_async_event", "ibv_ack_async_event", "ibv_event_type_str")
#: memory registration: GPUDirect RDMA (nvidia-peermem / dma-buf) or locked-memory limits
_REG_CALLS = ("ibv_reg_mr", "ibv_reg_mr_iova2", "ibv_reg_dmabuf_mr")
ETIMEDOUT, EINVAL = 110, 22


_ST = re.compile
_DEV = r"([A-Za-z][\w.-]*?):(\d+)"

#: (kind, pattern), tried in order (see :data:`linkpass.core.evidence.builder.PATTERNS`)
PATTERNS: list[tuple[str, re.Pattern]] = [
    ("wc", _ST(r"Got completion (?:from peer (\S+?) )?with (?:error |status=)\s*(?:([A-Z][A-Z0-9_]*)\()?(\d+)(?=[,\s)])"
               r"(?:.*?vendor[ _]err[ =]\s*(\d+))?(?:.*?\bhca (\S+))?")),
    # master: "mlx5_0:1 Got non-fatal async event: port error(10)"; 2.23: "Got async error event: ..."
    ("async", _ST(r"NET/IB\s*:\s*(?:" + _DEV + r"\s+)?Got (?:non-fatal |fatal )?async (?:error )?event\s*:\s*"
                  r"([^\r\n]*?)\s*(?:\((\d+)\))?\s*$")),
    ("async", _ST(r"NET/IB\s*:\s*(?:" + _DEV + r"\s+)?async fatal event(?: on (?:CQ|QP|SRQ)\b[^:]*)?\s*:\s*([^\r\n]*?)\s*()$")),
    ("async", _ST(r"NET/IB\s*:\s*" + _DEV + r"\s+(GID table changed)()\s*$")),
    ("async", _ST(r"NET/IB\s*:\s*(?:" + _DEV + r"\s+)?unknown event type\s*\(()(-?\d+)\)")),
    # other producers' wording of the same events (kept from the corpus): "mlx5_0:1 async event: port error"
    ("async", _ST(r"(?:\b(mlx\w+|\w+_\d+):(\d+)\s+)?\basync (?:fatal )?event(?: on QP \S+)?\s*:\s*([a-z][a-z_ ]+?)()\s*$")),
    ("ibv_call", _ST(r"Call to (ibv_\w+) failed(?: with (?:error )?(.*))?$")),
]


def _int(s: str | None) -> int | None:
    return int(s) if s and s.lstrip("-").isdigit() else None


def fields(kind: str, m: re.Match, msg: str) -> dict[str, Any]:
    """The fields of a record this family's :data:`PATTERNS` matched."""
    g = m.groups()
    if kind == "wc":
        return {"status": int(g[2]), "vendor": _int(g[3]), "hca": g[4]}
    if kind == "async":
        dev = f"{g[0]}/{g[1]}" if g[0] else None
        text = (g[2] or "").strip().lower()
        return {"text": _ALIASES.get(text, text), "number": _int(g[3]), "device": dev, "ibdev": g[0]}
    if kind == "ibv_call":
        rest = g[1] or ""
        # "with 110 Connection timed out, on dev ..." (modify_qp) / "with error %s errno %d"
        num = re.match(r"\s*(\d+)\b", rest) or re.search(r"\berrno (\d+)", rest)
        dev = re.search(r"on dev " + _DEV, rest)
        return {"call": g[0], "errno": int(num.group(1)) if num else None,
                "ibdev": dev.group(1) if dev else None, "port": int(dev.group(2)) if dev else None}
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
        inc.known = st in WC_STATUS

    def ev_async(self, ev: Ev) -> None:
        text, num = ev.f["text"], ev.f.get("number")
        if not text and num is not None:  # "unknown event type (N)": only the number is printed
            text = ASYNC_EVENT_NUMBERS.get(num, "")
        reading = ASYNC_EVENTS.get(text)
        known = reading is not None
        if reading is None:
            reading = (f"unknown_{num}" if num is not None and not text else "other", *_OBS)
        code = f"ibv_event:{reading[0]}"
        dev = ev.f["device"]
        inc = self.new(code, (code, dev), "async", reading[1:], ev, device=dev)
        inc.x["ibdev"] = ev.f.get("ibdev")
        inc.known = known
        if dev:
            inc.fkey = self.fkey(ibdev=ev.f.get("ibdev"))

    def ev_ibv_call(self, ev: Ev) -> None:
        call, err = ev.f["call"], ev.f.get("errno")
        if call in _ASYNC_THREAD_CALLS:
            # the async thread's own wait failing: part of the async event it last reported
            last = next((i for i in reversed(self.incs) if i.kind == "async" and not i.dropped), None)
            if last is not None:
                last.add(ev)
                return
        if call == "ibv_modify_qp" and err == ETIMEDOUT:
            code, reading = "nccl:modify_qp_timeout", ("config", "none", "check-config")
        elif call == "ibv_modify_qp" and err == EINVAL:
            code, reading = "nccl:modify_qp_invalid", ("config", "none", "check-config")
        elif call in _REG_CALLS:
            code, reading = "nccl:reg_mr_failed", ("config", "none", "check-config")
        else:
            code, reading = f"nccl:{call}_failed", _OBS
        # a connection-setup (configuration) reading is about the fabric, not one port: no device
        inc = self.new(code, (code, None), "ibv_call", reading, ev)
        inc.x.update(ibdev=ev.f.get("ibdev"), port=ev.f.get("port"), errno=err)
        inc.known = call in IBV_CALLS

    def read_async(self, inc: Inc) -> None:
        role = self.role(inc) if inc.fkey else None
        if inc.code == "ibv_event:port_err":
            if role is not None and role != "compute":
                inc.domain, inc.action, inc.remedy = "benign", "none", "none"
            elif len(inc.occ) > 1:
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
        if root is None and x.x["status"] in _WC_GENERIC:
            later = [i for i in pool if i.first > x.first and i.domain in ("nic-link", "nic-device")]
            root = min(later, key=lambda i: i.first, default=None)
        if root is None and x.x["status"] == 5:  # a flush only follows from an earlier error
            root = self.nearest_earlier(x, self.roots_like(lambda i: i.kind == "wc" and i.parent is None), float("inf"))
        if root is not None:
            self.secondary(x, root, True)

    def link_ibv_call(self, x: Inc) -> None:
        """A verbs call failing after a fatal device event is that event's consequence."""
        if x.domain == "config":
            return
        dead = self.roots_like(lambda i: i.parent is None and i.kind == "async" and i.code == "ibv_event:device_fatal")
        root = self.nearest_earlier(x, dead, float("inf"))
        if root is not None:
            self.secondary(x, root, True)
