"""The engine: ``Engine.handle(event, now_ns) -> list[Action]``, the only place state changes.

Inputs are the typed events of :mod:`linkpass.core.model`; outputs are actions as data
(routes to apply, notices to send, a timer to set).  The clock is a parameter: the engine
never reads it, so tests drive it with a fake clock, and the same events at the same times
give the same actions.

Generations: every change of the plan (our usable rails, or the routes wanted) bumps
``generation``; route and notice actions carry it so consumers act only on newer ones.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque

from linkpass.core.health import AT_RISK, RailHealth, RailState, Transition
from linkpass.core.model import (
    Action,
    AddrChanged,
    ApplyRoutes,
    ConfigReloaded,
    DeviceFaultDelivered,
    DeviceIncident,
    Drain,
    RiskChanged,
    Event,
    HistoryEntry,
    HookPeersChanged,
    HookPlan,
    HookReport,
    LinkChanged,
    LinkFacts,
    LinkSnapshot,
    NotifyAtRisk,
    NotifyDeviceFault,
    NotifyHooks,
    PathLossy,
    PeerRails,
    ProbeLoss,
    ProbeResult,
    PublishHistory,
    PublishHookReport,
    RefreshNeighbors,
    RouteChanged,
    RoutesApplied,
    SendNotice,
    SetProbePriority,
    SetTimer,
    Tick,
    WriteNcclEnv,
)
from linkpass.core.damping import FlapDamper
from linkpass.core.lossy import two_proportion_z
from linkpass.core.nccl_env import NcclContext
from linkpass.core.nccl_env import RailHealth as NcclRail
from linkpass.core.paths import PathHealth, PathState
from linkpass.core.planner import Plan, all_destinations, plan_routes
from linkpass.core.policy import EnginePolicy
from linkpass.core.snapshots import ReportError, SnapshotBook

log = logging.getLogger("linkpass.engine")

HISTORY_LEN = 2000
#: recent device incidents kept for ``status()["incidents"]``
INCIDENTS_KEPT = 50
#: the same code on the same device again within this time of its previous sighting (one Xid
#: seen both in the kernel log and through NVML, the driver repeating its lines, an NVML event
#: repeating) is the same incident: counted, not recorded or acted on twice.  Later, it is a new
#: incident.  The one dedup of device incidents: the sources post every sighting
INCIDENT_DEDUP_NS = 10 * 1_000_000_000
#: refused snapshot reports logged at WARNING; later ones at DEBUG (each is counted)
SNAPSHOT_REJECTS_LOUD = 5
#: a probe result re-judges every rail (not only those it touches) at most this often
FULL_REVERDICT_NS = 1_000_000_000
#: a path's part in its rail's probe verdict: (counted, counts against the rail, DOWN and silent
#: everywhere, lossy); see Engine._path_part
_NO_PART = (0, 0, 0, 0)
#: True (tests/conftest.py sets it for the whole suite): every probe verdict made from the
#: per-rail counts is checked against a scan of the rail's paths, and a difference raises
CHECK_COUNTS = False


class Engine:
    """Decides, from what adapters saw, which routes and notices the host needs.

    Args:
        policy: what the engine decides with (:class:`~linkpass.core.policy.EnginePolicy`,
            built from the validated config by :func:`linkpass.config.policy_from_config`).
        nccl: what the NCCL environment file is computed from (see
            :class:`~linkpass.core.nccl_env.NcclContext`); None: no file is written, and no
            :class:`WriteNcclEnv` is returned.

    Attributes:
        generation: current plan generation (starts at 0; the first plan is 1).
        rails: per rail id, its :class:`RailHealth`.
        peer_usable: per peer, the rails it last announced usable (absent = never heard).
        history: recent :class:`HistoryEntry` items, oldest first (path UP <-> SUSPECT changes
            are left out: under ordinary loss they would push everything else out).
        totals: running counts since start: ``rail_<state>`` and ``path_<state>`` per state
            entered, ``routes_applied``, ``route_changes`` (applies that replaced or deleted
            routes), and one per other history kind (``plan``, ``degraded``, ``recovered``, ...).
        snapshots: the jobs' snapshot reports (:class:`~linkpass.core.snapshots.SnapshotBook`;
            its ``rejected`` counts the refused ones).
    """

    def __init__(self, policy: EnginePolicy, nccl: NcclContext | None = None):
        self.policy = policy
        self.nccl = nccl
        self.hook_peers: tuple[str, ...] = ()  # peers of the registered torch-hook jobs (probed first)
        self.generation = 0
        self.rails: dict[int, RailHealth] = {}
        self.links: dict[str, LinkFacts] = {}
        self.addrs: dict[str, set[str]] = {}
        self.peer_usable: dict[str, frozenset[int]] = {}
        self.peer_last_ns: dict[str, int] = {}
        self.peer_generation: dict[str, int] = {}
        self.history: deque[HistoryEntry] = deque(maxlen=HISTORY_LEN)
        self.totals: Counter[str] = Counter()  # see _count
        self._turn: list[HistoryEntry] = []  # recorded during the handle() call now running (PublishHistory)
        self.warnings: list[str] = []
        self.plan: Plan | None = None
        self.applied_generation = 0
        self.applied_ns: int | None = None
        self.apply_errors: tuple[str, ...] = ()
        self.conflicts: tuple[str, ...] = ()
        self.synced = False
        self._timer_at: int | None = None
        self._plan_usable: frozenset[int] = frozenset()
        self._plan_announced: frozenset[int] = frozenset()  # the usable rails told to peers (less avoided DEGRADED ones)
        self._plan_path_down: frozenset[tuple[int, str]] = frozenset()  # paths the plan avoids
        self._resync_routes = False
        self._raw_ok: dict[int, bool] = {}       # rail -> last link+probe verdict (flaps while suppressed)
        self._link_healthy: dict[int, bool] = {}  # rail -> last link verdict alone
        self._link_up_ns: dict[int, int] = {}     # rail -> when its link last came back
        self.paths: dict[tuple[int, str], PathHealth] = {}
        # the same paths by rail and by peer, and the DOWN ones: the per-result work scans one
        # rail's or one peer's paths, never every path (8 x peers of them)
        self._rail_paths: dict[int, list[PathHealth]] = {}
        self._peer_paths: dict[str, list[PathHealth]] = {}
        self._down: dict[tuple[int, str], PathHealth] = {}
        # per rail, the sums of its paths' parts in the probe verdict (_path_part), kept at each
        # change of what a part depends on, so a verdict costs O(1) and not a scan of the rail's
        # paths (16,383 of them at 16,384 hosts); _stale: (when, path, its last result) for the
        # counted non-UP paths, whose part ends when their last result grows stale (_fresh)
        self._parts: dict[tuple[int, str], tuple[int, int, int, int]] = {}
        self._rail_sums: dict[int, list[int]] = {}
        self._stale: list[tuple[int, tuple[int, str], int]] = []
        self._last_full_reverdict_ns: int | None = None
        self.probe_failed: dict[int, str] = {}   # rail -> why its probes say it is failed
        self.loss: dict[int, tuple[float, int]] = {}  # rail -> (loss ratio, samples) from the edge
        self.degraded: set[int] = set()
        self.lossy: dict[tuple[int, str], str] = {}  # path -> why its loss test says it is lossy
        self._lossy_since: dict[tuple[int, str], int] = {}  # path -> when its loss test called it lossy (ns)
        self._lossy_window: dict[tuple[int, str], tuple[float, int]] = {}  # path -> (loss, samples) at that verdict
        self._avoided: frozenset[int] = frozenset()  # the DEGRADED rails traffic was last moved off
        self.incidents: deque[dict] = deque(maxlen=INCIDENTS_KEPT)  # recent device incidents, oldest first
        self.at_risk: dict[tuple[str, int], dict] = {}  # (kind, subject) -> the verdict entry while at risk
        self.incident_counts: Counter[str] = Counter()  # domain -> incidents recorded since start
        self._incident_seen: dict[tuple[str, str | None], int] = {}  # (code, device) -> last seen ns
        self._incident_seen_t: dict[tuple[str, str | None], int] = {}  # (code, device) -> its event's t_ns
        self._notify_entries: dict[tuple, tuple[dict, dict]] = {}  # NotifyDeviceFault's incident -> (entry, history data)
        self.snapshots = SnapshotBook()
        self._configure(policy)

    # ------------------------------------------------------------------ config

    def _configure(self, policy: EnginePolicy) -> None:
        self.policy = policy
        hold_ns = policy.host.hold_down_ms * 1_000_000
        new: dict[int, RailHealth] = {}
        for r in policy.rails:
            h = self.rails.get(r.id) or RailHealth(r.id, hold_ns)
            if h.hold_until_ns is not None and h.hold_down_ns != hold_ns:
                h.hold_until_ns = h.since_ns + hold_ns  # a rail in hold-down follows the new hold-down
                self._timer_at = None
            h.hold_down_ns = hold_ns
            new[r.id] = h
        self.rails = new
        dampers: dict[int, FlapDamper] = {}
        if policy.damping.enabled:
            for r in policy.rails:
                old = getattr(self, "dampers", {}).get(r.id)
                same = old is not None and old.to_json(0).get("limits") == FlapDamper.from_policy(policy.damping, rail=r.id).to_json(0).get("limits")
                dampers[r.id] = old if same else FlapDamper.from_policy(policy.damping, rail=r.id)
        self.dampers = dampers
        names = self._peer_names = frozenset(p.name for p in policy.peers)
        self.peer_usable = {k: v for k, v in self.peer_usable.items() if k in names}
        self.lossy = {k: v for k, v in self.lossy.items() if k[1] in names and k[0] in self.rails}
        self._lossy_since = {k: v for k, v in self._lossy_since.items() if k in self.lossy}
        self._lossy_window = {k: v for k, v in self._lossy_window.items() if k in self.lossy}
        self._netdev_rail = {r.netdev: r.id for r in policy.rails}
        self._rail_peers = {r.id: sum(1 for p in policy.peers if r.id in p.rail_ips) for r in policy.rails}
        self._dsts = all_destinations(policy)
        # peers, lossy paths and the freshness horizon may have changed: every part again
        self._parts, self._rail_sums, self._stale = {}, {}, []
        self._recount_all = bool(self.paths)

    def _on_config(self, ev: ConfigReloaded, now_ns: int) -> list[Action]:
        """Adopt a reloaded config (SIGHUP): rails, peers, hold-down, route settings, and the
        NCCL context.  Rails whose netdev changed are re-evaluated from the last link facts seen.
        """
        old_dev = {r.id: r.netdev for r in self.policy.rails}
        self.nccl = ev.nccl
        self._configure(ev.policy)
        self._record("config_reloaded", now_ns, {})
        for r in ev.policy.rails:
            if old_dev.get(r.id) != r.netdev and self.synced:
                self._eval_rail(r.id, now_ns, now_ns)
        return self._replan(now_ns, "config reloaded", force=True)

    # ------------------------------------------------------------------ main entry

    def handle(self, event: Event, now_ns: int) -> list[Action]:
        """Apply one event at monotonic time ``now_ns`` and return the actions it needs.

        History leaves the engine only here: the entries this call recorded come last, as one
        :class:`PublishHistory` (none when it recorded nothing); ``history`` keeps the recent
        ones for the ``history`` control command.

        Never raises on event content; an :class:`~linkpass.core.health.IllegalTransition`
        would be a bug in this module.
        """
        link_was = dict(self._link_healthy)
        actions = self._handle(event, now_ns)
        # a rail whose link came back needs its unresolved neighbours dropped, before the routes
        netdevs = {r.id: r.netdev for r in self.policy.rails}
        refresh = [RefreshNeighbors(netdevs[rid]) for rid, ok in sorted(self._link_healthy.items())
                   if ok and not link_was.get(rid, True) and rid in netdevs]
        if refresh:
            actions = refresh + actions
        if self._turn:
            actions = [*actions, PublishHistory(tuple(self._turn))]
            self._turn = []
        return actions

    def _handle(self, event: Event, now_ns: int) -> list[Action]:
        if isinstance(event, LinkSnapshot):
            return self._on_snapshot(event, now_ns)
        if isinstance(event, LinkChanged):
            return self._on_link(event, now_ns)
        if isinstance(event, ProbeResult):
            return self._on_probe(event, now_ns)
        if isinstance(event, ProbeLoss):
            return self._on_loss(event, now_ns)
        if isinstance(event, PathLossy):
            return self._on_lossy(event, now_ns)
        if isinstance(event, Tick):
            return self._on_tick(now_ns)
        if isinstance(event, PeerRails):
            return self._on_peer(event, now_ns)
        if isinstance(event, RoutesApplied):
            return self._on_applied(event)
        if isinstance(event, RouteChanged):
            return self._on_route_changed(event, now_ns)
        if isinstance(event, AddrChanged):
            s = self.addrs.setdefault(event.netdev, set())
            (s.add if event.present else s.discard)(f"{event.address}/{event.prefixlen}")
            return []
        if isinstance(event, Drain):
            return self._on_drain(event, now_ns)
        if isinstance(event, DeviceIncident):
            return self._on_incident(event, now_ns)
        if isinstance(event, RiskChanged):
            return self._on_risk(event, now_ns)
        if isinstance(event, DeviceFaultDelivered):
            self._on_fault_delivered(event)
            return []
        if isinstance(event, HookPeersChanged):
            return self._on_hook_peers(event)
        if isinstance(event, ConfigReloaded):
            return self._on_config(event, now_ns)
        if isinstance(event, HookReport):
            if event.report.get("event") == "snapshot":
                return self._on_snapshot_report(event)
            # not engine state (the hook server keeps the recent ones): passed on, so that the
            # one dispatch table routes it to the operators' adapter
            return [PublishHookReport(event.report)]
        log.warning("engine: ignoring unknown event %r", type(event).__name__)
        return []

    # ------------------------------------------------------------------ handlers

    def _on_snapshot(self, ev: LinkSnapshot, now_ns: int) -> list[Action]:
        self.links = {f.netdev: f for f in ev.links}
        first = not self.synced
        self.synced = True
        self._record("link_dump", now_ns, {"reason": ev.reason, "netdevs": len(ev.links)})
        if first:
            for r in self.policy.rails:
                if r.netdev not in self.links:
                    msg = f"rail {r.id}: netdev {r.netdev!r} not found on this host; rail stays DOWN until it appears"
                    self.warnings.append(msg)
                    log.warning(msg)
        for rid in sorted(self.rails):
            self._eval_rail(rid, ev.t_ns, now_ns)
        if first:
            return self._replan(now_ns, f"link dump ({ev.reason})", force=True)
        # a resync (overrun/reconnect): route events may have been lost too, so the actuator
        # must re-read the kernel even when the plan did not change
        self._resync_routes = True
        actions = self._replan(now_ns, f"link dump ({ev.reason})")
        if not any(isinstance(a, ApplyRoutes) for a in actions) and self.plan is not None:
            actions.insert(0, ApplyRoutes(self.generation, self.plan.routes, self.plan.keep_dsts, f"resync ({ev.reason})", resync=True))
            self._resync_routes = False
        return actions

    def _on_link(self, ev: LinkChanged, now_ns: int) -> list[Action]:
        self.links[ev.facts.netdev] = ev.facts
        rid = self._netdev_rail.get(ev.facts.netdev)
        if rid is None or not self.synced:
            return []
        self._eval_rail(rid, ev.t_ns, now_ns)
        return self._replan(now_ns, f"link change on {ev.facts.netdev}")

    def _on_tick(self, now_ns: int) -> list[Action]:
        self._timer_at = None
        for rid, d in sorted(self.dampers.items()):
            if d.on_tick(now_ns) is not None and self.synced:
                self._eval_rail(rid, now_ns, now_ns)  # released: the rail may start its hold-down
        for rid in sorted(self.rails):
            t = self.rails[rid].on_tick(now_ns)
            if t:
                self._record_transition(t, now_ns)
                self._resync_routes = True  # failback is not latency-critical: re-read the kernel
        return self._replan(now_ns, "hold-down expired")

    def _on_drain(self, ev: Drain, now_ns: int) -> list[Action]:
        h = self.rails.get(ev.rail)
        if h is None:
            return []
        t = h.on_drain(ev.drain, now_ns)
        if t:
            self._record_transition(t, now_ns)
        return self._replan(now_ns, "drain" if ev.drain else "undrain")

    def _on_risk(self, ev: RiskChanged, now_ns: int) -> list[Action]:
        """A rail or GPU at risk (or clear again) by its counters (:mod:`linkpass.core.risk`).

        * A rail at risk is drained (cause ``at-risk``, independent of an operator's drain):
          the plan moves its traffic off now, peers hear it in the next notice, and the NCCL
          environment for new processes leaves it out.  Clear again (its counters stayed clean
          for the risk tracker's hold time) lifts that drain: the rail's own hold-down follows,
          then failback.
        * A GPU at risk becomes a :class:`NotifyAtRisk` (the hooks on that GPU move its rank to a
          spare at the next step boundary); clear again is recorded only.

        Recorded as history ``at_risk`` (the MQTT ``at_risk`` event) and kept for status while it
        holds.  A repeated verdict for a subject already at risk only refreshes the entry; an
        unknown rail is recorded with ``unknown: true`` and nothing else."""
        key = (ev.kind, ev.subject)
        v = ev.verdict
        entry = {"subject_kind": ev.kind, "subject": ev.subject, "at_risk": ev.at_risk, "rule": ev.rule, "summary": ev.summary,
                 **{k: v.get(k) for k in ("counter", "rate", "unit", "window_s", "threshold", "citation")},
                 "counters": dict(v.get("counters") or {}), "since_ns": ev.t_ns}
        again = ev.at_risk and key in self.at_risk
        if not ev.at_risk and key not in self.at_risk:
            return []  # clear, and never at risk as far as this engine knows (a restart): nothing to lift
        actions: list[Action] = []
        if ev.kind == "rail":
            h = self.rails.get(ev.subject)
            entry["rail"] = ev.subject
            if h is None:
                entry["unknown"] = True
                self._record("at_risk", now_ns, entry)
                return []
            entry["action"] = "drain" if ev.at_risk else "undrain (hold-down, then failback)"
            if not again:
                t = h.on_drain(ev.at_risk, now_ns, AT_RISK, f"at risk: {ev.rule} (linkpass status: AT RISK)")
                if t:
                    self._record_transition(t, now_ns)
        elif ev.kind == "gpu":
            entry["gpu"] = ev.subject
            entry["action"] = "move the rank to a spare at the next step boundary" if ev.at_risk else "none"
            if ev.at_risk and not again:
                actions.append(NotifyAtRisk(ev.subject, dict(entry), ev.t_ns))
        else:
            log.warning("engine: at-risk verdict for unknown kind %r ignored", ev.kind)
            return []
        if again:
            self.at_risk[key].update(summary=ev.summary, rate=entry["rate"])
            return []
        if ev.at_risk:
            self.at_risk[key] = entry
        else:
            entry["was"] = self.at_risk.pop(key, {}).get("summary")
        self._record("at_risk", now_ns, entry)
        log.warning("%s %d %s: %s", ev.kind, ev.subject, "AT RISK" if ev.at_risk else "no longer at risk", ev.summary)
        if ev.kind == "rail":
            actions += self._replan(now_ns, f"rail {ev.subject} {'at risk' if ev.at_risk else 'clear of risk'}")
        return actions

    def _on_peer(self, ev: PeerRails, now_ns: int) -> list[Action]:
        if ev.peer not in self._peer_names:
            return []
        self.peer_last_ns[ev.peer] = now_ns
        self.peer_generation[ev.peer] = ev.generation
        old = self.peer_usable.get(ev.peer)
        if old == ev.usable:
            return []
        self.peer_usable[ev.peer] = ev.usable
        for q in self._peer_paths.get(ev.peer, ()):  # _peer_explains changed for them
            self._recount(q, now_ns)
        self._record("peer_rails", now_ns, {"peer": ev.peer, "usable": sorted(ev.usable), "was": None if old is None else sorted(old), "peer_generation": ev.generation})
        log.info("peer %s: usable rails %s -> %s", ev.peer, None if old is None else sorted(old), sorted(ev.usable))
        # the peer's own fault explains (or stops explaining) its paths' silence on that rail
        self._reverdict(ev.t_ns, now_ns)
        return self._replan(now_ns, f"peer {ev.peer} rails changed")

    def _on_applied(self, ev: RoutesApplied) -> list[Action]:
        if ev.generation >= self.applied_generation:
            self.applied_generation = ev.generation
            self.applied_ns = ev.t_ns
            self.apply_errors = ev.errors
            self.conflicts = ev.conflicts
        self._record("routes_applied", ev.t_ns, {"generation": ev.generation, "replaced": ev.replaced, "deleted": ev.deleted, "errors": list(ev.errors), "conflicts": list(ev.conflicts)})
        return []

    def _on_route_changed(self, ev: RouteChanged, now_ns: int) -> list[Action]:
        ours = ev.proto == self.policy.host.route_protocol
        if self.plan is None or ev.dst not in self._dsts:
            return []
        if ours and (not ev.deleted or ev.dst not in {r.dst for r in self.plan.routes}):
            return []  # our own change echoed back (a replacement, or our deletion of a stale route)
        # someone removed one of our routes, or put a route on one of our destinations
        self._record("route_disturbed", now_ns, {"dst": ev.dst, "proto": ev.proto, "deleted": ev.deleted})
        return [ApplyRoutes(self.generation, self.plan.routes, self.plan.keep_dsts, f"route to {ev.dst} changed outside linkpass", resync=True)]

    def _on_incident(self, ev: DeviceIncident, now_ns: int) -> list[Action]:
        """A live device/link incident: recorded (history ``incident``, totals, the recent list
        in status); a migrate-rank root that is not backlog becomes :class:`NotifyDeviceFault`.

        Link incidents (``nic-link``) are only recorded: netlink and the probes already handle
        the rail, and acting on them here would move traffic twice.  The same code on the same
        device again within :data:`INCIDENT_DEDUP_NS` (a kernel-log Xid and the NVML event for
        it, or the kernel log repeating it) counts as ``incident_duplicates`` and nothing else;
        each sighting restarts the window.  Both the handling times and the events' own
        ``t_ns`` (when the source saw them) must be that close, so a recurrence is never taken
        for a duplicate because the engine ran a little late.  A backlog incident (read at
        start, never acted on) does not start a window.

        ``notified`` in the recorded entry is the engine's intent (a :class:`NotifyDeviceFault`
        follows); the daemon replaces it with what happened, in the same loop turn, with a
        :class:`DeviceFaultDelivered` event (true only when at least one hook client got it).
        """
        key = (ev.code, ev.device)
        last = self._incident_seen.get(key)
        last_t = self._incident_seen_t.get(key)
        if not ev.backlog:  # a backlog sighting (old, never acted on) must not swallow a live one
            self._incident_seen[key] = now_ns
            self._incident_seen_t[key] = ev.t_ns
        if len(self._incident_seen) > 4 * INCIDENTS_KEPT:  # bounded: forget the oldest
            for k in sorted(self._incident_seen, key=self._incident_seen.__getitem__)[:INCIDENTS_KEPT]:
                del self._incident_seen[k]
                self._incident_seen_t.pop(k, None)
        if (last is not None and now_ns - last < INCIDENT_DEDUP_NS
                and (last_t is None or abs(ev.t_ns - last_t) < INCIDENT_DEDUP_NS)):
            self.totals["incident_duplicates"] += 1
            for d in reversed(self.incidents):
                if (d["code"], d["device"]) == key:
                    if ev.source not in d["sources"]:
                        d["sources"].append(ev.source)
                    d["count"] += 1
                    break
            return []
        entry = ev.to_json()
        rail = self._netdev_rail.get(ev.device) if ev.device else None
        if ev.domain == "nic-link" and rail is not None:
            entry["rail"] = rail
            entry["handled_by"] = "netlink"  # the rail's own state machine acts on the link
        act = ev.action == "migrate-rank" and ev.follows is None and not ev.backlog
        entry.update(sources=[ev.source], count=1, notified=act)
        self.incidents.append(entry)
        self.incident_counts[ev.domain] += 1
        hist = {k: v for k, v in entry.items() if k not in ("sources", "count")}
        self._record("incident", now_ns, hist)
        if act:
            self._notify_entries[(ev.source, ev.code, ev.device, ev.t_ns)] = (entry, hist)
            while len(self._notify_entries) > INCIDENTS_KEPT:
                del self._notify_entries[next(iter(self._notify_entries))]
        log.info("incident from %s: %s %s on %s, action %s, remedy %s%s%s", ev.source, ev.domain, ev.code,
                 ev.device or "?", ev.action, ev.remedy, f" (follows {ev.follows})" if ev.follows else "",
                 " (backlog: recorded only)" if ev.backlog else "")
        return [NotifyDeviceFault(ev)] if act else []

    def _on_fault_delivered(self, d: DeviceFaultDelivered) -> None:
        """What became of a :class:`NotifyDeviceFault` (the daemon's hook adapter says):
        ``clients`` hook clients got it (``notified`` = at least one did); ``kept``: nobody got it
        and it waits for a client that registers on its GPU; ``unattributed``: no GPU index for
        its device, so no client was told (a node-level fault); ``late``: a kept fault was
        delivered to a client that registered later.  Updates the status entry and, when not
        ``late`` (the daemon feeds the outcome back in the same loop turn, before it dispatches the
        :class:`PublishHistory` that carries the entry), the history entry.  Unknown incident (forgotten): nothing."""
        ev, clients, kept, unattributed, late = d.incident, d.clients, d.kept, d.unattributed, d.late
        ref = self._notify_entries.get((ev.source, ev.code, ev.device, ev.t_ns))
        if ref is None:
            return
        entry, hist = ref
        upd: dict = {"notified": clients > 0 or (late and entry.get("notified", False)), "hook_clients": clients}
        if late:
            upd["hook_clients"] = entry.get("hook_clients", 0) + clients
            upd["delivered_late"] = True
            upd["kept"] = False
        else:
            upd["kept"] = kept
        if unattributed:
            upd["gpu_unknown"] = True
            self.totals["device_faults_unattributed"] += 1
        entry.update(upd)
        if not late:
            hist.update(upd)

    def _on_snapshot_report(self, ev: HookReport) -> list[Action]:
        """A rank's ``snapshot`` report: kept per job (status, metrics) and passed on checked (the
        MQTT ``snapshot`` event); a report with a bad field is dropped whole, counted and logged."""
        rec = ev.report
        try:
            r = self.snapshots.record(rec)
        except ReportError as e:
            n = self.snapshots.rejected
            log.log(logging.WARNING if n <= SNAPSHOT_REJECTS_LOUD else logging.DEBUG,
                    "snapshot report of job %.80r rank %.20r (pid %.20r) dropped: %s (%d dropped so far)",
                    rec.get("job"), rec.get("rank"), rec.get("pid"), e, n)
            return []
        return [PublishHookReport(r.to_report())]

    def _on_hook_peers(self, ev: HookPeersChanged) -> list[Action]:
        """The peers of the registered torch-hook jobs changed: probe those (configured) first."""
        peers = tuple(sorted({p for p in ev.peers if p in self._peer_names}))
        if peers == self.hook_peers:
            return []
        self.hook_peers = peers
        return [SetProbePriority(peers)]

    def _nccl_action(self, now_ns: int) -> WriteNcclEnv | None:
        """The NCCL environment file of the current generation (None when none is written)."""
        if self.nccl is None:
            return None
        return WriteNcclEnv(self.generation, self.nccl_rails, self.nccl)  # computed when the adapter writes it

    def nccl_rails(self) -> tuple[NcclRail, ...]:
        """Our rails as the NCCL environment sees them: usable or not, state, addresses."""
        return tuple(NcclRail(r.id, r.netdev, self.rails[r.id].usable, self.rails[r.id].state.value,
                              tuple(sorted(self.addrs.get(r.netdev, ())))) for r in self.policy.rails)

    def _hook_plan(self, reason: str, now_ns: int) -> HookPlan:
        return HookPlan(self.generation, frozenset(r.id for r in self.policy.rails), self.local_usable(),
                        {p.name: self.peer_usable.get(p.name) for p in self.policy.peers}, reason, now_ns)

    # ------------------------------------------------------------------ helpers

    def _on_probe(self, ev: ProbeResult, now_ns: int) -> list[Action]:
        """A probe result: path state, the rail's probe verdict and loss window.  Replans only
        when one of them changes (results arrive hundreds of times a second)."""
        if ev.rail not in self.rails or ev.peer not in self._peer_names:
            return []
        pc = self.policy.probe
        if not ev.ok and ev.t_ns - pc.interval_ms * 1_000_000 < self._link_up_ns.get(ev.rail, -1):
            return []  # sent before the rail's link came back: its loss says nothing about the rail now
        new = (ev.rail, ev.peer) not in self.paths
        path, t = self.path_result(ev.rail, ev.peer, ev.ok, now_ns, ev.rtt_ns, ev.since_ok_ns, ev.peer_elsewhere)
        changed = False
        if t:
            changed = t[0] == PathState.DOWN or t[1] == PathState.DOWN
            entry = {"rail": ev.rail, "peer": ev.peer, "old": t[0].value, "new": t[1].value, "event_t_ns": ev.t_ns}
            if t[1] == PathState.DOWN:
                entry["peer_elsewhere"] = ev.peer_elsewhere
            if changed or t[0] == PathState.UNKNOWN:
                self._record("path", now_ns, entry)
            else:  # UP <-> SUSPECT: hundreds a minute under ordinary loss; counted, not kept
                self._count("path", entry)
        # the paths routes avoid change although no state did when a DOWN path's hold passes, or
        # when its peer falls silent everywhere (or answers elsewhere again); the rails' verdicts
        # are compared below
        if self._avoided_paths(now_ns) != self._plan_path_down:
            changed = True
        if self._reverdict(ev.t_ns, now_ns, self._touched_rails(path, new, now_ns)):
            changed = True
        if not changed or not self.synced:
            return []
        return self._replan(now_ns, f"probes on rail {ev.rail}")

    def path_result(self, rail: int, peer: str, ok: bool, now_ns: int, rtt_ns: int | None = None,
                    since_ok_ns: int | None = None, peer_elsewhere: bool | None = None
                    ) -> tuple[PathHealth, tuple[PathState, PathState] | None]:
        """One probe result into the path's :class:`PathHealth` (made and indexed on first use),
        nothing else (no verdict, no plan): what :meth:`_on_probe` starts with, and what a
        simulation that judges rails itself needs.  Returns the path and its transition."""
        key = (rail, peer)
        path = self.paths.get(key)
        made = path is None
        if made:
            pc = self.policy.probe
            path = self.paths[key] = PathHealth(rail, peer, pc.detect_multiplier, pc.interval_ms * 1_000_000)
            self._rail_paths.setdefault(rail, []).append(path)
            self._peer_paths.setdefault(peer, []).append(path)
        t = path.on_result(ok, now_ns, rtt_ns, since_ok_ns, peer_elsewhere)
        if path.state == PathState.DOWN:
            self._down[key] = path
        else:
            self._down.pop(key, None)
        if made or t is not None:
            # a new path or a new state changes what the peer's other DOWN paths count for
            # (_down_counts looks at the peer's other paths)
            for q in self._peer_paths[peer]:
                if q is path or q.state == PathState.DOWN:
                    self._recount(q, now_ns)
        elif path.state != PathState.UP:
            self._recount(path, now_ns)  # a fresher result, or a new peer_elsewhere word
        # (an answer on an UP path changes no part: UP is always fresh, peer_elsewhere stays None)
        return path, t

    def _path_part(self, p: PathHealth, now_ns: int) -> tuple[int, int, int, int]:
        """Path ``p``'s part in its rail's probe verdict (:meth:`_probe_verdict`) at ``now_ns``:
        (counted: known, fresh and not explained by its peer; counts against the rail; DOWN and
        not counting, its peer silent everywhere; lossy), each 0 or 1."""
        if p.state == PathState.UNKNOWN or not self._fresh(p, now_ns) or self._peer_explains(p):
            return _NO_PART
        counts = self._path_counts(p)
        return (1, int(counts), int(p.state == PathState.DOWN and not counts), int((p.rail, p.peer) in self.lossy))

    def _recount(self, p: PathHealth, now_ns: int) -> None:
        """Bring path ``p``'s part in its rail's sums up to date (after anything it depends on
        changed: its state, its last result, its lossy verdict, its peer's announced rails, the
        peer's other paths)."""
        key = (p.rail, p.peer)
        new = self._path_part(p, now_ns)
        old = self._parts.get(key, _NO_PART)
        if new != old:
            sums = self._rail_sums.setdefault(p.rail, [0, 0, 0, 0])
            for i in range(4):
                sums[i] += new[i] - old[i]
        self._parts[key] = new
        if new[0] and p.state != PathState.UP:  # counted until its last result goes stale
            heapq.heappush(self._stale, (p.last_result_ns + self._stale_ns(), key, p.last_result_ns))

    def _recount_stale(self, now_ns: int) -> None:
        """Take the parts of the paths whose last result has gone stale by ``now_ns`` out of
        their rails' sums (at most one heap entry per non-UP result); on the first call after a
        (re)configuration, every path's part is counted afresh."""
        if self._recount_all:
            self._recount_all = False
            for q in self.paths.values():
                self._recount(q, now_ns)
            return
        heap = self._stale
        while heap and heap[0][0] < now_ns:
            _, key, last = heapq.heappop(heap)
            p = self.paths.get(key)
            if p is not None and p.last_result_ns == last:  # else a newer result has its own entry
                self._recount(p, now_ns)

    def _touched_rails(self, p: PathHealth, new: bool, now_ns: int) -> set[int] | None:
        """The rails whose probe verdict one result of path ``p`` can change: its own, and
        those where a DOWN path of the same peer counts by the peer's other paths (no
        ``peer_elsewhere`` word, :meth:`_down_counts`).  None (every rail) at most once per
        :data:`FULL_REVERDICT_NS`: a verdict also changes as SUSPECT/DOWN paths go stale
        (:meth:`_fresh`), with no result of their own.  This keeps a result's cost to one
        rail's paths instead of every path (8 x peers)."""
        if new or self._last_full_reverdict_ns is None or now_ns - self._last_full_reverdict_ns >= FULL_REVERDICT_NS:
            return None
        rails = {p.rail}
        for q in self._peer_paths.get(p.peer, ()):
            if q.rail != p.rail and q.state == PathState.DOWN and q.peer_elsewhere is None:
                rails.add(q.rail)
        return rails

    def _reverdict(self, event_ns: int, now_ns: int, rails: set[int] | None = None) -> bool:
        """Re-judge every rail (or those in ``rails``) by its probes (:meth:`_probe_verdict`);
        True if one changed."""
        changed = False
        if rails is None:
            self._last_full_reverdict_ns = now_ns
        for rid in sorted(self.rails if rails is None else rails & self.rails.keys()):
            why = self._probe_verdict(rid, now_ns)
            if why == self.probe_failed.get(rid) or (why is not None and rid in self.probe_failed):
                continue
            if why is None:
                del self.probe_failed[rid]
            else:
                self.probe_failed[rid] = why
            self._eval_rail(rid, event_ns, now_ns)
            changed = True
        return changed

    def _peer_explains(self, p: PathHealth) -> bool:
        """The peer announced (``peer_rails``) that its own end of this path's rail is unusable:
        the path's silence is that fault, no evidence about our end of the rail."""
        pu = self.peer_usable.get(p.peer)
        return pu is not None and p.rail not in pu

    def _path_counts(self, p: PathHealth) -> bool:
        """A DOWN path is evidence against its rail only while the peer answers on another rail:
        a peer silent on every rail at once is a peer problem (stalled, overloaded, dead), and
        routing around one of its rails gains nothing.  The prober says which with each miss
        (``peer_elsewhere``); where it could not (None), the engine's own picture decides: the
        peer has another path UP, or no other path at all (then the ends cannot be told apart).
        A path its sequential loss test calls lossy counts whatever its state (:meth:`_on_lossy`)."""
        return (p.rail, p.peer) in self.lossy or self._down_counts(p)

    def _down_counts(self, p: PathHealth) -> bool:
        """The DOWN part of :meth:`_path_counts` (BFD's rule, whatever the loss test says)."""
        if p.state != PathState.DOWN:
            return False
        if p.peer_elsewhere is not None:
            return p.peer_elsewhere
        others = [q for q in self._peer_paths.get(p.peer, ()) if q.rail != p.rail]
        return not others or any(q.state == PathState.UP for q in others)

    def _avoided_paths(self, now_ns: int) -> frozenset[tuple[int, str]]:
        """The (rail, peer) paths that routes leave: DOWN paths that count against their rail
        (:meth:`_path_counts`) and have stayed DOWN for one more detection time.

        A path alone, its peer answering on the other rails, is either a fault between this
        pair only or a delay on that path alone: under CPU load the kernel's packet
        processing for one rail's traffic can stall for tens of ms (softirqs deferred to a
        starved ksoftirqd), and the reply then arrives just after BFD's detection time.  Both
        look the same at the detection time; the hold tells them apart at the cost of one more
        detection time for pair-only faults.  It does not slow down the common faults: a rail
        failed by its probes or its carrier is left at once by every route, and a peer whose own
        rail failed announces it (``peer_rails``), which the plan follows without waiting."""
        hold = self.policy.probe.detect_multiplier * self.policy.probe.interval_ms * 1_000_000
        lossy_hold = self._lossy_hold_ns()
        # only DOWN and lossy paths can be avoided: look at those, not at every path
        out = set()
        for k in {*self._down, *self.lossy}:
            p = self.paths.get(k)
            if p is not None and ((k in self.lossy and now_ns - self._lossy_since.get(k, now_ns) >= lossy_hold
                                   and self._lossier_than_elsewhere(k))
                                  or (self._down_counts(p) and now_ns - p.since_ns >= hold)):
                out.add(k)
        return frozenset(out)

    def _lossier_than_elsewhere(self, k: tuple[int, str]) -> bool:
        """Whether lossy path ``k`` loses clearly more than the rails its traffic would move to:
        its loss window at the verdict against the least lossy of the peer's other usable rails
        (rail-wide loss windows), by the two-proportion z-test the DEGRADED rails use (z >= 4 to
        leave the path, z >= 2 to stay off it).  True when either side is unknown (fewer than 20
        results), as before the test existed.

        Why: the sequential test asks "is this path at ``lossy_loss`` rather than
        ``healthy_loss``?", and on a fabric whose every rail loses more than ``healthy_loss``
        (2 % per port: 7.8 % of round trips, twice the default) it now and then says yes for
        one path by chance; moving that peer's traffic to a rail that loses as much gains
        nothing and changes routes (58-74 times in a 10-minute soak at that loss, bench/README.md).
        A path really lossy among clean rails (30 % against 1 %: z ~ 6 over 100 results) is
        still left."""
        mine = self._lossy_window.get(k)
        if mine is None or mine[1] < 20:
            return True
        rail, peer = k
        pu = self.peer_usable.get(peer)
        best: tuple[float, int] | None = None
        for r in self.local_usable():
            if r == rail or (pu is not None and r not in pu) or (r, peer) in self._down or (r, peer) in self.lossy:
                continue
            lr = self.loss.get(r)
            if lr is None or lr[1] < 20:
                return True  # an alternative of unknown loss: no evidence that it is as bad
            if best is None or lr[0] < best[0]:
                best = lr
        if best is None:
            return True  # nowhere else to go: what the plan does then is its business
        need = 2.0 if k in self._plan_path_down else 4.0
        return two_proportion_z(mine, best) >= need

    def _lossy_hold_ns(self) -> int:
        """How long a lossy path alone stays lossy before routes leave it: as long as the loss
        test takes to clear a path that answers every probe again (22 clean answers at the
        defaults, ln(1/lossy_clear_alpha) / -ln((1-healthy)/(1-lossy)); 25 fast intervals here).
        A peer whose daemon stalls for 60-70 ms on a loaded host misses 6-7 probes in a row,
        which the test reads as heavy loss; it then answers and the verdict clears within this
        time, so no route moves for it.  A path that stays lossy longer is lossy.  A rail failed
        by its probes (lossy paths count there at once) is left without waiting."""
        return 25 * self.policy.probe.interval_ms * 1_000_000

    def _lossy_deadlines(self, now_ns: int) -> list[int]:
        """When lossy paths still inside :meth:`_lossy_hold_ns` are left (timer deadlines)."""
        hold = self._lossy_hold_ns()
        return [t + hold for t in self._lossy_since.values() if t + hold > now_ns]

    def _fresh(self, p: PathHealth, now_ns: int) -> bool:
        """A SUSPECT or DOWN path's verdict is current when a result came within two slow
        sweeps plus BFD's detection time (every probed path gets one at least that often);
        an UP path is current by construction (its next miss would be forwarded)."""
        if p.state == PathState.UP:
            return True
        return now_ns - p.last_result_ns <= self._stale_ns()

    def _stale_ns(self) -> int:
        pc = self.policy.probe
        return (2 * pc.slow_interval_ms + pc.detect_multiplier * pc.interval_ms) * 1_000_000

    def _probe_verdict(self, rid: int, now_ns: int) -> str | None:
        """Why rail ``rid`` has failed by its probes, or None.

        The local end of a rail is at fault when most of the peers it reaches are unreachable
        over it while they still answer over other rails.  Counted, per peer with a fresh,
        known path on this rail: DOWN paths whose peer answers elsewhere (``down``) against
        every such path except DOWN ones whose peer is silent everywhere (``evidence``; UP and
        SUSPECT paths count here: one missed probe is no evidence either way).  Failed when
        ``down / evidence > rail_down_share`` *and* at least two peers are down, so one remote
        port's fault (one peer DOWN) never fails a healthy local rail on another host.  With a
        single peer on the rail the two ends cannot be told apart: then that one peer decides
        (and traffic to it leaves the rail either way, which is what that peer's fault needs).
        """
        pc = self.policy.probe
        self._recount_stale(now_ns)
        counted, down, silent, lossy = self._rail_sums.get(rid, _NO_PART)
        if CHECK_COUNTS:
            scan = self._scan_counts(rid, now_ns)
            if scan != (counted, down, silent, lossy):
                raise AssertionError(f"rail {rid} probe counts {counted, down, silent, lossy} != scan {scan}")
        evidence = counted - silent
        peers_here = self._rail_peers.get(rid, 0)
        need = min(2, peers_here) if peers_here else 1
        if evidence <= 0 or down < need or down / evidence <= pc.rail_down_share:
            return None
        if not lossy:
            return f"probes: {down}/{evidence} peers unreachable over rail {rid} while answering on other rails"
        return (f"probes: {down}/{evidence} peers unreachable or lossy ({lossy} lossy) over rail {rid} "
                f"while answering on other rails")

    def _scan_counts(self, rid: int, now_ns: int) -> tuple[int, int, int, int]:
        """What the per-rail sums must equal, from a scan of the rail's paths (the check)."""
        on_rail = [p for p in self._rail_paths.get(rid, ())
                   if p.state != PathState.UNKNOWN and self._fresh(p, now_ns) and not self._peer_explains(p)]
        down = sum(1 for p in on_rail if self._path_counts(p))
        silent = sum(1 for p in on_rail if p.state == PathState.DOWN and not self._path_counts(p))
        lossy = sum(1 for p in on_rail if (p.rail, p.peer) in self.lossy)
        return len(on_rail), down, silent, lossy

    def _on_lossy(self, ev: PathLossy, now_ns: int) -> list[Action]:
        """The sequential loss test of a path changed its verdict.  A lossy path counts against
        its rail like a DOWN path whose peer answers elsewhere (:meth:`_path_counts`; the test
        only sees misses while the peer was heard elsewhere or could not be); routes leave a lossy
        path alone after :meth:`_lossy_hold_ns` (a timer), a rail it fails at once."""
        key = (ev.rail, ev.peer)
        if ev.rail not in self.rails or ev.peer not in self._peer_names or (key in self.lossy) == ev.lossy:
            return []
        loss = None if ev.loss is None else round(ev.loss, 4)
        if ev.lossy:
            self._lossy_since[key] = now_ns
            if ev.loss is not None and ev.samples:
                self._lossy_window[key] = (ev.loss, ev.samples)
            self.lossy[key] = (f"{ev.probes} probes judged lossy (loss {loss if loss is not None else '?'}, "
                               f">= {self.policy.probe.lossy_loss} by the sequential test)")
        else:
            del self.lossy[key]
            self._lossy_since.pop(key, None)
            self._lossy_window.pop(key, None)
        p = self.paths.get(key)
        if p is not None:
            self._recount(p, now_ns)
        self._record("lossy" if ev.lossy else "lossy_cleared", now_ns,
                     {"rail": ev.rail, "peer": ev.peer, "probes": ev.probes, "loss": loss, "event_t_ns": ev.t_ns})
        log.warning("path rail %d -> %s: %s after %d probes (loss over the window %s)", ev.rail, ev.peer,
                    "LOSSY" if ev.lossy else "no longer lossy", ev.probes, "?" if loss is None else f"{100 * loss:.1f}%")
        changed = self._avoided_paths(now_ns) != self._plan_path_down
        if self._reverdict(ev.t_ns, now_ns):
            changed = True
        if not changed or not self.synced:
            return self._arm(now_ns) if ev.lossy and self.synced else []  # the lossy hold's end
        return self._replan(now_ns, f"probe loss test on rail {ev.rail}")

    def _on_loss(self, ev: ProbeLoss, now_ns: int) -> list[Action]:
        """Aggregated probe loss of a rail -> DEGRADED (traffic prefers clean rails)."""
        if ev.rail not in self.rails:
            return []
        self.loss[ev.rail] = (ev.loss, ev.samples)
        if ev.samples < 20:
            return []
        # hysteresis: DEGRADED above degraded_loss, clean again only below half of it, so a
        # rail hovering at the threshold does not move traffic back and forth
        was = ev.rail in self.degraded
        limit = self.policy.probe.degraded_loss
        deg = ev.loss > limit if not was else ev.loss >= limit / 2
        if deg != was:
            (self.degraded.add if deg else self.degraded.discard)(ev.rail)
            self._record("degraded" if deg else "recovered", now_ns, {"rail": ev.rail, "loss": round(ev.loss, 4), "samples": ev.samples})
            log.warning("rail %d: %s (probe loss %.1f%% over %d probes)", ev.rail, "DEGRADED" if deg else "no longer degraded", 100 * ev.loss, ev.samples)
        # traffic moves only when the set of avoided rails changes (a better rail appeared or went)
        avoided = self.avoided_degraded()
        if avoided == self._avoided:
            return []
        self._avoided = avoided
        return self._replan(now_ns, f"probe loss on rail {ev.rail}") if self.synced else []

    def rail_loss(self, rid: int) -> float | None:
        v = self.loss.get(rid)
        return None if v is None else round(v[0], 4)

    def _eval_rail(self, rid: int, event_ns: int, now_ns: int) -> None:
        netdev = next(r.netdev for r in self.policy.rails if r.id == rid)
        facts = self.links.get(netdev) or LinkFacts(netdev, present=False, admin_up=False, carrier=False, operstate="NOTPRESENT")
        if facts.healthy and not self._link_healthy.get(rid, True):
            self._link_up_ns[rid] = now_ns  # handle() returns a RefreshNeighbors for it
        self._link_healthy[rid] = facts.healthy
        ok = facts.healthy and rid not in self.probe_failed
        reason = facts.why_not() or self.probe_failed.get(rid) or f"{netdev} up"
        damper = self.dampers.get(rid)
        if damper is not None and damper.suppressed(now_ns):
            # a suppressed route that keeps flapping keeps earning penalty (RFC 2439)
            if self._raw_ok.get(rid) is True and not ok:
                damper.on_down(now_ns)
            self._raw_ok[rid] = ok
        elif damper is not None:
            self._raw_ok[rid] = ok
        if damper is not None and ok and damper.suppressed(now_ns):
            rel = damper.release_at(now_ns)
            ok = False
            reason = (f"flap damping: suppressed (penalty {damper.penalty_at(now_ns):.0f}) "
                      f"for {max(0, (rel or now_ns) - now_ns) / 1e9:.1f} s more")
        t = self.rails[rid].on_link(ok, reason, now_ns)
        if t:
            self._record_transition(t, now_ns, event_ns)
            # a flap is a withdrawal: traffic was on the rail and had to leave it (RFC 2439 counts
            # withdrawals); going back DOWN during hold-down moved no traffic and adds nothing
            if damper is not None and t.new == RailState.DOWN and t.old == RailState.UP:
                if damper.on_down(now_ns):
                    self._record("damping", now_ns, {"rail": rid, **damper.to_json(now_ns)})
        if not (facts.present and facts.admin_up):
            # IPv4 flushes routes through a netdev that goes down or away without telling
            # anyone (no RTM_DELROUTE): the actuator must re-read the kernel next time.
            self._resync_routes = True

    def _record_transition(self, t: Transition, now_ns: int, event_ns: int | None = None) -> None:
        self._record("rail", now_ns, {"rail": t.rail, "old": t.old.value, "new": t.new.value, "reason": t.reason, "event_t_ns": event_ns if event_ns is not None else now_ns})

    def _record(self, kind: str, t_ns: int, data: dict) -> None:
        entry = HistoryEntry(kind, t_ns, data)
        self.history.append(entry)
        self._turn.append(entry)
        self._count(kind, data)

    def _count(self, kind: str, data: dict) -> None:
        """Running totals since start (``status()["totals"]``): what operators and benchmarks
        count without reading (or overflowing) the history."""
        if kind in ("rail", "path"):
            self.totals[f"{kind}_{data['new'].lower()}"] += 1
        elif kind == "routes_applied":
            self.totals["routes_applied"] += 1
            if data["replaced"] or data["deleted"]:
                self.totals["route_changes"] += 1
        else:
            self.totals[kind] += 1

    @property
    def destinations(self) -> frozenset[str]:
        """Every prefix this config may route (to pick the route events that concern us)."""
        return self._dsts

    def avoided_degraded(self) -> frozenset[int]:
        """The DEGRADED rails that traffic moves off: those that lose clearly more than the
        rails their traffic would move to, the usable rails that are not DEGRADED, pooled
        (two-proportion z-test of the rail's loss window against the pool's summed windows:
        z >= 4 to start avoiding a rail, z >= 2 to keep avoiding it).  Rails that are about
        equally lossy (a lossy fabric, or one rail hovering at the threshold while the other is
        just under it) keep their traffic: moving it would change routes for no gain, back and
        forth with the window's noise.

        Against the pool, not the best single rail: with 8 rails at the same loss the worst
        window and the best one differ by z >= 4 now and then by chance (2 % loss on every
        port moved routes that way 9 times in 10 minutes at 5 hosts), while the traffic would go
        to all of them, not to the best.  With two rails the pool is the other rail."""
        out = set()
        usable = self.local_usable()
        for d in self.degraded:
            if self.loss.get(d, (0.0, 0))[1] < 20:  # too few samples to judge now: keep the decision
                if d in self._avoided:
                    out.add(d)
                continue
            need = 2.0 if d in self._avoided else 4.0
            lost, n = 0.0, 0  # the pool's lost results and results
            for b in usable:
                lb = self.loss.get(b)
                if b != d and b not in self.degraded and lb is not None and lb[1] >= 20:
                    lost += lb[0] * lb[1]
                    n += lb[1]
            if n and two_proportion_z(self.loss[d], (lost / n, n)) >= need:
                out.add(d)
        return frozenset(out)

    def local_usable(self) -> frozenset[int]:
        """Ids of our rails that may carry traffic now."""
        return frozenset(rid for rid, h in self.rails.items() if h.usable)

    def _replan(self, now_ns: int, reason: str, force: bool = False) -> list[Action]:
        if not self.synced:
            return []  # no plan (and no notice) before the first link dump: we know nothing yet
        actions: list[Action] = []
        path_down = self._avoided_paths(now_ns)
        self._plan_path_down = path_down
        avoid = self.avoided_degraded()
        plan = plan_routes(self.policy, self.local_usable(), self.peer_usable, path_down, avoid)
        prev_usable = None if self.plan is None else self._plan_usable
        usable = self.local_usable()
        # what peers are told: our usable rails less the DEGRADED ones our own traffic avoids.
        # A carrier-up fault that only this host sees clearly (its probes over the rail lose)
        # is then left by every peer at once, not after each peer's own slow sweep misses this
        # host (tens of seconds at 1,000 hosts; deploy/SCALING.md section 0)
        announce = usable - avoid
        prev_announce = None if self.plan is None else self._plan_announced
        changed = self.plan is None or plan != self.plan or usable != prev_usable or announce != prev_announce
        if changed or force:
            self.generation += 1
            self.plan = plan
            self._plan_usable = usable
            self._plan_announced = announce
            for n in plan.notes:
                log.warning("%s", n)
            self._record("plan", now_ns, {"generation": self.generation, "reason": reason, "usable": sorted(usable), "routes": len(plan.routes)})
            lost = sorted((prev_usable or frozenset()) - usable)
            netdevs = {r.id: r.netdev for r in self.policy.rails}
            purge = tuple(netdevs[r] for r in lost if r in netdevs)
            actions.append(ApplyRoutes(self.generation, plan.routes, plan.keep_dsts, reason, resync=self._resync_routes, purge_neighbors=purge))
            self._resync_routes = False
            nccl = self._nccl_action(now_ns)
            if nccl is not None:
                actions.append(nccl)
            actions.append(NotifyHooks(self._hook_plan(reason, now_ns)))
            if prev_usable is None or usable != prev_usable or announce != prev_announce or force:
                actions.append(SendNotice(self.generation, announce, urgent=True))
        return actions + self._arm(now_ns)

    def _arm(self, now_ns: int) -> list[Action]:
        """A :class:`SetTimer` for the earliest deadline (hold-downs, damping, lossy holds) when
        it differs from the one asked for last; [] otherwise."""
        deadlines = [d for h in self.rails.values() if (d := h.next_deadline()) is not None]
        deadlines += [d for dm in self.dampers.values() if (d := dm.next_deadline()) is not None]
        deadlines += self._lossy_deadlines(now_ns)
        deadline = min(deadlines, default=None)
        if deadline is not None and deadline != self._timer_at:
            self._timer_at = deadline
            return [SetTimer(deadline)]
        return []

    # ------------------------------------------------------------------ status

    def status(self, now_ns: int) -> dict:
        """A JSON-ready picture for `linkpass status` (see :func:`linkpass.cli` for fields)."""
        rails = []
        for r in self.policy.rails:
            h = self.rails[r.id]
            f = self.links.get(r.netdev)
            rails.append({
                "id": r.id,
                "netdev": r.netdev,
                "state": h.state.value,
                "usable": h.usable,
                "reason": h.reason,
                "since_ns": h.since_ns,
                "last_change_ago_ms": round((now_ns - h.since_ns) / 1e6, 3) if h.state != RailState.UNKNOWN else None,
                "hold_down_left_ms": round(max(0, h.hold_until_ns - now_ns) / 1e6, 3) if h.hold_until_ns else None,
                "link": None if f is None else {"present": f.present, "admin_up": f.admin_up, "carrier": f.carrier, "operstate": f.operstate},
                "addresses": sorted(self.addrs.get(r.netdev, ())),
                "degraded": r.id in self.degraded,
                "probe_loss": self.rail_loss(r.id),
                "probe_verdict": self.probe_failed.get(r.id),
                "damping": self.dampers[r.id].to_json(now_ns) if r.id in self.dampers else None,
                "drains": sorted(h.drains),
                "at_risk": self.at_risk.get(("rail", r.id)),
            })
        peers = []
        for p in self.policy.peers:
            last = self.peer_last_ns.get(p.name)
            peers.append({
                "name": p.name,
                "host_ip": None if p.host_ip is None else str(p.host_ip),
                "usable_rails": None if p.name not in self.peer_usable else sorted(self.peer_usable[p.name]),
                "peer_generation": self.peer_generation.get(p.name),
                "last_notice_ago_ms": None if last is None else round((now_ns - last) / 1e6, 3),
            })
        return {
            "host": self.policy.host.name,
            "mode": self.policy.host.mode,
            "generation": self.generation,
            "applied_generation": self.applied_generation,
            "hold_down_ms": self.policy.host.hold_down_ms,
            "now_ns": now_ns,
            "rails": rails,
            "peers": peers,
            "routes": [] if self.plan is None else [r.to_json() for r in self.plan.routes],
            "kept_destinations": [] if self.plan is None else sorted(self.plan.keep_dsts),
            "route_errors": list(self.apply_errors),
            "route_conflicts": list(self.conflicts),
            "warnings": list(self.warnings),
            "totals": dict(sorted(self.totals.items())),
            "paths": [{"rail": r, "peer": p, "state": h.state.value, "misses": h.misses,
                       "peer_elsewhere": h.peer_elsewhere, "counts_against_rail": self._path_counts(h),
                       "lossy": (r, p) in self.lossy,
                       "avoided": (r, p) in self._plan_path_down,
                       "rtt_ms": None if h.last_rtt_ns is None else round(h.last_rtt_ns / 1e6, 3)}
                      for (r, p), h in sorted(self.paths.items())],
            "incidents": [dict(d, sources=list(d["sources"])) for d in self.incidents],
            "incident_counts": dict(sorted(self.incident_counts.items())),
            "at_risk": [dict(e) for _, e in sorted(self.at_risk.items())],
        }
