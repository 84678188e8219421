"""Typed events (what adapters saw) and actions (what the engine wants done).

All times are ``int`` nanoseconds of the monotonic clock (``time.monotonic_ns()`` at the
edge that observed the thing); the core never reads a clock itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from collections.abc import Mapping
from typing import Any, Union

from linkpass.core.policy import EnginePolicy

# --------------------------------------------------------------------------- link facts


@dataclass(frozen=True)
class LinkFacts:
    """What the kernel says about one netdev.

    Attributes:
        netdev: interface name (``rail0``).
        present: False when the netdev does not exist (RTM_DELLINK or absent from a dump).
        admin_up: IFF_UP.
        carrier: IFF_LOWER_UP (the driver reports carrier).
        operstate: RFC 2863 operstate as the kernel names it (``UP``, ``DOWN``,
            ``LOWERLAYERDOWN``, ``UNKNOWN``, ``DORMANT``, ``NOTPRESENT``, ``TESTING``).
    """

    netdev: str
    present: bool = True
    admin_up: bool = True
    carrier: bool = True
    operstate: str = "UP"

    @property
    def healthy(self) -> bool:
        """True when the netdev can carry traffic: present, admin up, carrier, and an
        operstate of UP (or UNKNOWN, which drivers without operstate support report)."""
        return self.present and self.admin_up and self.carrier and self.operstate in ("UP", "UNKNOWN")

    def why_not(self) -> str:
        """Human reason the link is not healthy ('' when healthy)."""
        if not self.present:
            return f"netdev {self.netdev} not present"
        if not self.admin_up:
            return f"{self.netdev} admin down"
        if not self.carrier:
            return f"carrier lost on {self.netdev}"
        if self.operstate not in ("UP", "UNKNOWN"):
            return f"{self.netdev} operstate {self.operstate}"
        return ""


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class LinkChanged:
    """RTM_NEWLINK / RTM_DELLINK for one netdev, stamped when the daemon received it."""

    facts: LinkFacts
    t_ns: int


@dataclass(frozen=True)
class LinkSnapshot:
    """A full link dump (start-up or resync after a netlink overrun/reconnect).

    Netdevs absent from ``links`` are treated as not present.
    """

    links: tuple[LinkFacts, ...]
    t_ns: int
    reason: str = "start"


@dataclass(frozen=True)
class AddrChanged:
    """RTM_NEWADDR / RTM_DELADDR (IPv4) on a netdev."""

    netdev: str
    address: str
    prefixlen: int
    present: bool
    t_ns: int


@dataclass(frozen=True)
class RouteChanged:
    """RTM_NEWROUTE / RTM_DELROUTE that may concern our routes (ours, or anyone's route
    to one of our destinations)."""

    dst: str
    proto: int
    table: int
    deleted: bool
    t_ns: int


@dataclass(frozen=True)
class PeerRails:
    """An authenticated peer notice: which of the peer's rails it can use now.

    Attributes:
        peer: the sender's host name (already matched to a configured peer).
        usable: rail ids the peer currently uses.
        generation: the sender's plan generation.
        seq: the sender's sequence number (already checked against replay).
        via_rail: the local rail the notice arrived on, or None if unknown.
    """

    peer: str
    usable: frozenset[int]
    generation: int
    seq: int
    t_ns: int
    via_rail: int | None = None


@dataclass(frozen=True)
class RoutesApplied:
    """The route actuator finished reconciling the kernel to a plan generation."""

    generation: int
    t_ns: int
    replaced: int = 0
    deleted: int = 0
    errors: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one probe on one path (rail, peer), from the prober.

    Attributes:
        rail: local rail id the probe left on.
        peer: peer host name.
        ok: True when the authenticated reply came back in time; False when the probe's
            deadline (the probe interval) passed without a reply.
        rtt_ns: round-trip time (ok only).
        seq: the probe's sequence number.
        t_ns: when the reply arrived / the deadline passed.
        since_ok_ns: for a miss, time since the last reply on this path (None if unknown); lets
            the engine apply BFD's time-based rule without seeing every success.
        peer_elsewhere: for a miss, whether the peer answered on another of our rails while
            this probe was outstanding (by kernel arrival times): True means the peer is alive
            and the loss belongs to this path; False means the peer was silent on every rail
            (a stalled, overloaded or dead peer, not evidence against this rail); None when
            no other rail leads to the peer, so the two cannot be told apart.
    """

    rail: int
    peer: str
    ok: bool
    t_ns: int
    rtt_ns: int | None = None
    seq: int = 0
    since_ok_ns: int | None = None
    peer_elsewhere: bool | None = None


@dataclass(frozen=True)
class ProbeLoss:
    """Probe loss on one rail over the loss window, aggregated at the edge (the prober sends
    hundreds of results a second; the engine needs the ratio, not every result).

    Attributes:
        rail: local rail id.
        loss: lost / sent over the window, 0..1.
        samples: probes in the window (only paths that have answered at least once count).
    """

    rail: int
    loss: float
    samples: int
    t_ns: int


@dataclass(frozen=True)
class PathLossy:
    """The sequential loss test of one path (:mod:`linkpass.core.lossy`) changed its verdict,
    decided at the edge from every probe result (the engine sees only misses).

    Attributes:
        rail: local rail id.
        peer: peer host name.
        lossy: True: the path loses at least ``[probe] lossy_loss`` of its probes (by the test);
            False: it has shown enough evidence of health again.
        t_ns: time of the result that decided it (monotonic ns).
        probes: results the verdict took since the previous one.
        loss: the path's loss ratio over its loss window then (0..1; None when unknown).
        samples: probe results in that window (0 when unknown).
    """

    rail: int
    peer: str
    lossy: bool
    t_ns: int
    probes: int = 0
    loss: float | None = None
    samples: int = 0


@dataclass(frozen=True)
class Tick:
    """A timer the engine asked for has expired."""

    t_ns: int


@dataclass(frozen=True)
class Drain:
    """Operator request to take a rail out of use (drain=True) or return it (False)."""

    rail: int
    drain: bool
    t_ns: int


@dataclass(frozen=True)
class RiskChanged:
    """A rail or GPU became at risk, or its counters stayed clean long enough to be trusted
    again (issue 18): a verdict of :class:`linkpass.core.risk.RiskTracker`, which the daemon's
    counter poller feeds.

    Attributes:
        kind: ``"rail"`` or ``"gpu"``.
        subject: rail id, or NVML GPU index.
        at_risk: True when the subject became at risk, False when it is clear again.
        rule: the rule's id (e.g. ``"ib.symbol_error.rate"``).
        summary: one line for operators (counter, rate, window, threshold).
        verdict: the whole verdict, JSON-ready (:meth:`linkpass.core.risk.RiskVerdict.to_json`):
            counter, rate, unit, window_s, threshold, citation.
        t_ns: monotonic ns of the poll that decided it.
    """

    kind: str
    subject: int
    at_risk: bool
    rule: str
    summary: str
    verdict: Mapping
    t_ns: int


@dataclass(frozen=True)
class DeviceIncident:
    """A device or link incident seen live on this host (issue 6, part 3): a kernel-log record
    classified by :mod:`linkpass.core.classify`, an NVML Xid event, or an RDMA async port event.

    Attributes:
        source: ``"kmsg"``, ``"nvml"`` or ``"rdma"`` (the adapter that saw it).
        domain, device, code, action, remedy: as in :class:`linkpass.core.classify.Incident`
            (``code`` e.g. ``"xid:79"``; ``device`` a PCI bus id ``0000:91:00.0``, ``mlx5_3/1``,
            a netdev, or None).
        t_ns: monotonic ns when the adapter saw it.
        summary: the log message (or a description of the event), for operators.
        follows: ``"code@device"`` of the root incident this one follows (a secondary), or None.
        backlog: read from the kernel log before linkpass followed it (a fresh start or a
            reboot): recorded, never acted on, since nobody knows whether it was handled.
        gpu: NVML index of the GPU ``device`` names, when the edge knows it.
        seq: the kmsg sequence number of the record that raised it (kmsg only).
    """

    source: str
    domain: str
    device: str | None
    code: str
    action: str
    remedy: str
    t_ns: int
    summary: str = ""
    follows: str | None = None
    backlog: bool = False
    gpu: int | None = None
    seq: int | None = None

    def to_json(self) -> dict:
        return {"source": self.source, "domain": self.domain, "device": self.device, "code": self.code,
                "action": self.action, "remedy": self.remedy, "follows": self.follows, "backlog": self.backlog,
                "gpu": self.gpu, "seq": self.seq, "summary": self.summary[:300], "t_ns": self.t_ns}


@dataclass(frozen=True)
class ConfigReloaded:
    """A reloaded config was accepted (SIGHUP): rails, peers, hold-down, route settings.

    Attributes:
        policy: the engine's view (:class:`linkpass.core.policy.EnginePolicy`) of the validated
            (and, in auto mode, resolved) config.
        nccl: what the NCCL environment is computed from now
            (:class:`linkpass.core.nccl_env.NcclContext`), or None when no env file is written.
        t_ns: monotonic ns of the reload.
    """

    policy: EnginePolicy
    nccl: Any = None
    t_ns: int = 0


@dataclass(frozen=True)
class DeviceFaultDelivered:
    """What became of a :class:`NotifyDeviceFault` (the hook adapter's answer).

    Attributes:
        incident: the incident of the :class:`NotifyDeviceFault`.
        clients: how many hook clients got it.
        kept: nobody got it; it waits for a client that registers on its GPU.
        unattributed: no GPU index for its device, so no client was told (a node-level fault).
        late: a kept fault reached a client that registered later.
        t_ns: monotonic ns of the delivery.
    """

    incident: DeviceIncident
    clients: int
    kept: bool = False
    unattributed: bool = False
    late: bool = False
    t_ns: int = 0


@dataclass(frozen=True)
class HookPeersChanged:
    """The union of the peers the registered torch-hook clients talk to changed."""

    peers: tuple[str, ...]
    t_ns: int = 0


@dataclass(frozen=True)
class HookReport:
    """A torch hook's report (rebuild, migration, ...) as the hook server kept it."""

    report: Mapping
    t_ns: int = 0


Event = Union[LinkChanged, LinkSnapshot, AddrChanged, RouteChanged, PeerRails, RoutesApplied, ProbeResult, ProbeLoss, PathLossy, Tick, Drain,
              DeviceIncident, ConfigReloaded, DeviceFaultDelivered, HookPeersChanged, HookReport, RiskChanged]

# --------------------------------------------------------------------------- routes


@dataclass(frozen=True, order=True)
class Nexthop:
    """One nexthop: the gateway address reached over a netdev (and the rail it serves)."""

    gateway: str
    netdev: str
    rail: int | None = None


@dataclass(frozen=True)
class RouteSpec:
    """A route we want in the kernel (or one we saw there).

    ``dst`` is a prefix in CIDR form (``198.19.0.2/32``); ``nexthops`` are sorted; one
    nexthop means a plain route, several mean an ECMP multipath route.  ``nhid`` is the
    nexthop object the kernel route points at (RTA_NH_ID; None: nexthops inline); for such a
    route ``nexthops`` are what the kernel resolved the object to.
    """

    dst: str
    nexthops: tuple[Nexthop, ...]
    prefsrc: str | None = None
    table: int = 254
    metric: int = 0
    proto: int = 0
    nhid: int | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        """Identity of a route in the kernel's FIB: (dst, table, metric)."""
        return (self.dst, self.table, self.metric)

    def same_forwarding(self, other: "RouteSpec") -> bool:
        """True when both send traffic the same way (nexthop gateways and netdevs, source) and
        through the same kind of nexthops (inline, or the same nexthop object)."""
        strip = lambda nhs: tuple(sorted((n.gateway, n.netdev) for n in nhs))  # noqa: E731
        return (strip(self.nexthops) == strip(other.nexthops) and self.prefsrc == other.prefsrc and self.proto == other.proto
                and self.nhid == other.nhid)

    def describe(self) -> str:
        """``ip route``-like one-line text."""
        via = " ".join(f"nexthop via {n.gateway} dev {n.netdev}" for n in self.nexthops)
        src = f" src {self.prefsrc}" if self.prefsrc else ""
        return f"{self.dst}{src} proto {self.proto} table {self.table} metric {self.metric} {via}"

    def to_json(self) -> dict:
        return {
            "dst": self.dst,
            "prefsrc": self.prefsrc,
            "table": self.table,
            "metric": self.metric,
            "proto": self.proto,
            "nexthops": [{"gateway": n.gateway, "netdev": n.netdev, "rail": n.rail} for n in self.nexthops],
        }


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class ApplyRoutes:
    """Make the kernel hold exactly these routes of ours (plus the kept ones).

    Attributes:
        generation: plan generation; the actuator ignores anything older than what it applied.
        routes: desired routes.
        keep_dsts: destinations whose existing route must be left as it is (no usable rail:
            better a stale route than traffic leaking to a default route).
        reason: why this plan exists (for logs).
        resync: re-read the kernel's routes before diffing (something outside linkpass
            changed them).
        purge_neighbors: netdevs of rails that just became unusable: after the new routes are
            in, their neighbour entries are deleted.  A packet sent between the carrier loss and
            our route change sits in an INCOMPLETE neighbour's queue on the dead rail, where
            ARP can never resolve (3 s with default ``mcast_solicit``/``retrans_time``); while
            it sits there TCP will not retransmit it (the skb is "still in a host queue"), so
            the connection stalls 3 s.  Deleting the entry frees the packet and TCP resends it
            over the new route at its next timeout.
    """

    generation: int
    routes: tuple[RouteSpec, ...]
    keep_dsts: frozenset[str] = frozenset()
    reason: str = ""
    resync: bool = False
    purge_neighbors: tuple[str, ...] = ()


@dataclass(frozen=True)
class SendNotice:
    """Tell every peer which of our rails are usable now (over our usable rails).

    ``urgent`` asks the notice adapter to send at once and repeat a few times.
    """

    generation: int
    usable: frozenset[int]
    urgent: bool = True


@dataclass(frozen=True)
class SetTimer:
    """Deliver a :class:`Tick` at monotonic time ``at_ns`` (replaces any earlier request)."""

    at_ns: int


@dataclass(frozen=True)
class RefreshNeighbors:
    """A rail's link came back: drop its unresolved (INCOMPLETE/FAILED) neighbour entries.

    ARP requests sent while the link was down were lost; an INCOMPLETE entry only retries on its
    own timer (``retrans_time``, 1 s by default), so the first packets after the link returns
    wait up to that long.  Deleting the entry makes the next packet resolve at once.
    """

    netdev: str


@dataclass(frozen=True)
class NotifyDeviceFault:
    """A device fault that needs the affected rank moved (``action == "migrate-rank"``): the
    daemon tells the torch hooks (``device_fault`` message, :mod:`torch_hooks.protocol`) and
    logs a WARNING for operators."""

    incident: DeviceIncident


@dataclass(frozen=True)
class NotifyAtRisk:
    """A GPU is at risk (its counters say it may fail soon): the daemon tells the torch hooks
    on that GPU (``gpu_at_risk`` message, :mod:`torch_hooks.protocol`), which move the rank to a
    spare at the next step boundary, and alerts operators when nobody can be moved."""

    gpu: int
    verdict: Mapping
    t_ns: int


@dataclass(frozen=True)
class HookPlan:
    """What a torch-hook notice is built from: the plan at one generation.

    Attributes:
        generation: plan generation.
        rails: every rail id of this host.
        usable: rails usable here.
        peer_usable: per configured peer, the rails it announced usable (None: not heard yet).
        reason: why the plan changed.
        t_ns: monotonic ns of the change.
    """

    generation: int
    rails: frozenset[int]
    usable: frozenset[int]
    peer_usable: Mapping[str, frozenset[int] | None]
    reason: str = ""
    t_ns: int = 0


@dataclass(frozen=True)
class NotifyHooks:
    """A new plan generation for the torch hooks (the hook adapter sends a notice to each client)."""

    plan: HookPlan


@dataclass(frozen=True)
class WriteNcclEnv:
    """Write the NCCL environment file for plan ``generation``; the adapter writes :attr:`text`.

    The environment is computed by pure core code (:func:`linkpass.core.nccl_env.plan_env_file`)
    from the rails' health and the NCCL context, on first use of :attr:`text` (about 0.2 ms
    for an 8-NIC host): the adapter asks once the events queued with this plan are handled
    (the route actuator has started; the addresses the netlink dump brings right after the
    first plan are known), and of several plans in a row only the newest is computed.

    Attributes:
        generation: plan generation; only a newer one than the file's is written.
        rails: the rails' health (:class:`linkpass.core.nccl_env.RailHealth` items), or a
            callable giving them as of the call (the engine's :meth:`nccl_rails`).
        context: :class:`linkpass.core.nccl_env.NcclContext` (topology, options, host).
    """

    generation: int
    rails: Any = ()
    context: Any = None

    @cached_property
    def _result(self) -> tuple:
        from linkpass.core.nccl_env import plan_env_file

        rails = self.rails() if callable(self.rails) else self.rails
        return plan_env_file(self.context, tuple(rails), self.generation)

    @property
    def env(self):
        """The :class:`~linkpass.core.nccl_env.NcclEnv`, or None when it could not be computed."""
        return self._result[0]

    @property
    def text(self) -> str | None:
        """The file's contents (``env.render("env-file")``), or None (see :attr:`error`)."""
        return self._result[1]

    @property
    def error(self) -> str | None:
        """Why no environment could be computed, or None."""
        return self._result[2]

    @property
    def errors(self) -> tuple[str, ...]:
        """Problems the computation reported (no healthy compute port, ...)."""
        return tuple(self.env.errors) if self.env is not None else ()


@dataclass(frozen=True)
class SetProbePriority:
    """Probe these peers first (the peers of registered torch-hook jobs)."""

    peers: tuple[str, ...]


@dataclass(frozen=True)
class PublishHookReport:
    """Pass a torch hook's report on to the operators (the MQTT adapter makes it an alert)."""

    report: Mapping


@dataclass
class HistoryEntry:
    """One line of the engine's history (kept for `linkpass status` and the demo)."""

    kind: str
    t_ns: int
    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "t_ns": self.t_ns, **self.data}


@dataclass(frozen=True)
class PublishHistory:
    """The history entries one :meth:`Engine.handle` call recorded, oldest first: for the
    adapters that read history (MQTT alerts, Prometheus counters, the systemd STATUS= line).

    The engine puts it last in the call's actions, so an outcome that a handler before it feeds
    back through the engine in the same loop turn (:class:`DeviceFaultDelivered` filling in an
    ``incident`` entry's ``notified``) is in the entries when they are published.  The entries
    are the same objects as in ``Engine.history``; readers must not change them.
    """

    entries: tuple[HistoryEntry, ...]


Action = Union[ApplyRoutes, SendNotice, SetTimer, RefreshNeighbors, NotifyDeviceFault, NotifyAtRisk, NotifyHooks, WriteNcclEnv, SetProbePriority,
               PublishHookReport, PublishHistory]
