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

The rules live in :mod:`linkpass.core.evidence`, one module per family of evidence (each
citing its sources): :mod:`~linkpass.core.evidence.gpu` (Xid, SXid),
:mod:`~linkpass.core.evidence.pcie` (AER, DPC, error recovery, pciehp),
:mod:`~linkpass.core.evidence.nic` (mlx5_core, netdev, bonding),
:mod:`~linkpass.core.evidence.rdma` (completion errors, async events),
:mod:`~linkpass.core.evidence.nccl` (NCCL / PyTorch symptoms), run by
:mod:`~linkpass.core.evidence.builder`.  This module is the public face.

Unreadable lines are skipped and counted (:func:`classify_report`), lines no family recognises
are ignored.  A failure of the classifier itself is never offered as "no incidents":
:func:`classify_report` returns it in ``error`` (one line, with the input line), and
:func:`classify` raises :class:`ClassifierError`.
"""

from __future__ import annotations

from linkpass.core.evidence.base import ACTIONS, DOMAINS, REMEDIES, Classification, Incident
from linkpass.core.evidence.builder import ClassifierError, classify, classify_report, classify_text
from linkpass.core.evidence.gpu import RECOVERY_ACTIONS, SXID_NAMES, XID_BUCKETS, XID_CATALOG, XID_LINKS, XID_OVERRIDES, xid_reading
from linkpass.core.evidence.nccl import NCCL_TIERS
from linkpass.core.evidence.rdma import ASYNC_EVENTS, WC_STATUS

__all__ = ["ACTIONS", "ASYNC_EVENTS", "DOMAINS", "NCCL_TIERS", "RECOVERY_ACTIONS", "REMEDIES", "SXID_NAMES", "WC_STATUS",
           "XID_BUCKETS", "XID_CATALOG", "XID_LINKS", "XID_OVERRIDES", "Classification", "ClassifierError", "Incident",
           "classify", "classify_report", "classify_text", "xid_reading"]
