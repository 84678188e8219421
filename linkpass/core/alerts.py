"""History entries and hook reports -> alert messages (pure: no I/O, no clock).

Which engine history entries (:class:`linkpass.core.model.HistoryEntry`) and torch hook
reports become alert events (:class:`AlertMapper`); :mod:`linkpass.adapters.mqtt` numbers
them, stores them in its outbox and publishes them on the ``events`` topic:

=================================  ================  ========  ==================================
source                             event             critical  fields
=================================  ================  ========  ==================================
rail -> DOWN / SUSPECT             ``fault``         yes       rail, netdev, old, new, reason
rail -> HOLD_DOWN / UP (not from   ``recovery``      no        rail, netdev, old, new, reason
UNKNOWN), DRAINED -> any
rail -> DRAINED                    ``drain``         no        rail, netdev, old, new, reason
degraded (probe loss)              ``degraded``      yes       rail, netdev, loss, samples
recovered (probe loss gone)        ``recovery``      no        rail, netdev, old=DEGRADED, loss
plan: our usable rails shrank      ``failover``      yes       generation, usable, lost, gained,
(first plan: fewer than all)                                   reason, routes
plan: usable rails grew            ``failback``      no        (same)
plan: same rails, other routes     ``reroute``       no        (same)
incident (classified device or     ``incident``      yes (no   domain, code, device, action,
link fault)                                          for       remedy, summary, source, gpu,
                                                     backlog)  rail, notified, follows, backlog
damping (flapping rail suppressed) ``damping``       no        rail, netdev, damping {...}
peer_rails (after the first)       ``peer_rails``    no        peer, usable, was, lost, gained
routes_applied with errors         ``route_error``   yes       generation, errors, conflicts
hook report rebuilt /              ``rebuild``       yes       report, job, rank, pid, detail
rebuild_failed
hook report migrating / joined /   ``migration``     yes       report, job, rank, pid, detail
no_spare / unmovable /
at_risk_moving / at_risk_unmovable
at_risk (a rail or GPU at risk by  ``at_risk``        yes (no   subject_kind, subject, rail, gpu,
its counters, or clear again)                        when      at_risk, rule, counter, rate, unit,
                                                     clear)    window_s, threshold, citation,
                                                               summary, action, counters
hook report snapshot (checked:     ``snapshot``      yes when  job, rank, pid, scope, snapshot_id,
:mod:`linkpass.core.snapshots`)                      not ok    step, ok, path, bytes, stall_ms,
                                                               write_ms, reason
=================================  ================  ========  ==================================

Not events (noise, or visible in ``state``): ``link_dump``, ``path``, ``routes_applied``
without errors, ``route_disturbed``, ``config_reloaded``, UNKNOWN -> UP at start, the first
``peer_rails`` of a peer, other hook reports, a ``snapshot`` report with a bad field (the
engine drops it).  Every event also carries ``event``,
``severity`` (``critical`` | ``info``), ``generation`` (the last plan generation seen) and
``t_mono_ns`` (the daemon's monotonic clock at the event; for latency measurements).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from linkpass.core.snapshots import ReportError, parse_report

#: every ``event`` value (deploy/asyncapi.yaml lists the same; a unit test checks it)
EVENT_TYPES = ("fault", "recovery", "drain", "degraded", "failover", "failback", "reroute", "incident", "damping",
               "peer_rails", "route_error", "rebuild", "migration", "snapshot", "at_risk")
#: a hook report's detail larger than this (JSON bytes) is replaced by {"truncated": true}
MAX_DETAIL_BYTES = 4096


def _json_size(doc: Mapping) -> int:
    """Bytes of ``doc`` as the publisher encodes it (compact JSON, UTF-8).

    Raises:
        TypeError, ValueError: not JSON-serialisable (NaN, infinity, a circular reference).
    """
    return len(json.dumps(doc, separators=(",", ":"), allow_nan=False, default=str).encode())


@dataclass(frozen=True)
class Alert:
    """One event before it is numbered: its type, whether the overflow policy keeps it
    longest, the type's own fields, and when it happened (monotonic ns)."""

    event: str
    critical: bool
    fields: dict
    t_mono_ns: int


_BAD = frozenset({"DOWN", "SUSPECT"})
_BACK = frozenset({"HOLD_DOWN", "UP"})
_REBUILD_REPORTS = frozenset({"rebuilt", "rebuild_failed"})
_MIGRATION_REPORTS = frozenset({"migrating", "joined", "no_spare", "unmovable", "at_risk_moving", "at_risk_unmovable"})


class AlertMapper:
    """Turns engine history entries and hook reports into :class:`Alert` items (pure: no I/O).

    Args:
        rails: rail id -> netdev, of this host (for ``netdev`` fields and the first plan).

    The table of what maps to what is in the module docstring.
    """

    def __init__(self, rails: Mapping[int, str]):
        self.rails = dict(rails)
        self.generation = 0
        self._usable: frozenset[int] | None = None

    def reconfigure(self, rails: Mapping[int, str]) -> None:
        """New rails after a config reload."""
        self.rails = dict(rails)

    def from_entry(self, kind: str, t_ns: int, d: Mapping) -> Alert | None:
        """The alert for one history entry (``HistoryEntry.kind``, ``.t_ns``, ``.data``), or None."""
        if kind == "rail":
            old, new, rail = d.get("old"), d.get("new"), d.get("rail")
            base = {"rail": rail, "netdev": self.rails.get(rail), "old": old, "new": new, "reason": d.get("reason", "")}
            t = d.get("event_t_ns") if isinstance(d.get("event_t_ns"), int) else t_ns
            if new == "DRAINED":
                return Alert("drain", False, base, t)
            if new in _BAD:
                return Alert("fault", True, base, t)
            if old == "UNKNOWN":
                return None  # a rail seen for the first time (start-up): state, not news
            if new in _BACK or old == "DRAINED":
                return Alert("recovery", False, base, t)
            return None
        if kind == "degraded":
            return Alert("degraded", True, {"rail": d.get("rail"), "netdev": self.rails.get(d.get("rail")),
                                            "loss": d.get("loss"), "samples": d.get("samples")}, t_ns)
        if kind == "recovered":
            loss = d.get("loss")
            shown = f"{100 * loss:.1f}%" if isinstance(loss, (int, float)) else str(loss)
            return Alert("recovery", False, {"rail": d.get("rail"), "netdev": self.rails.get(d.get("rail")), "old": "DEGRADED",
                                             "new": None, "reason": f"probe loss down to {shown} over {d.get('samples')} probes",
                                             "loss": d.get("loss"), "samples": d.get("samples")}, t_ns)
        if kind == "plan":
            gen = d.get("generation")
            if isinstance(gen, int):
                self.generation = gen
            usable = frozenset(d.get("usable") or ())
            prev = self._usable if self._usable is not None else frozenset(self.rails)
            first = self._usable is None
            self._usable = usable
            lost, gained = sorted(prev - usable), sorted(usable - prev)
            fields = {"generation": gen, "usable": sorted(usable), "lost": lost, "gained": gained,
                      "reason": d.get("reason", ""), "routes": d.get("routes")}
            if lost:
                return Alert("failover", True, fields, t_ns)
            if first:
                return None  # the first plan with every rail: the normal start
            if gained:
                return Alert("failback", False, fields, t_ns)
            return Alert("reroute", False, fields, t_ns)
        if kind == "incident":
            fields = {k: d.get(k) for k in ("domain", "code", "device", "action", "remedy", "summary", "source", "gpu",
                                            "rail", "notified", "follows", "backlog")}
            return Alert("incident", not d.get("backlog"), fields, t_ns)
        if kind == "damping":
            rail = d.get("rail")
            return Alert("damping", False, {"rail": rail, "netdev": self.rails.get(rail),
                                            "damping": {k: v for k, v in d.items() if k != "rail"}}, t_ns)
        if kind == "peer_rails":
            was = d.get("was")
            if was is None:
                return None  # first word from the peer
            usable = d.get("usable") or []
            return Alert("peer_rails", False, {"peer": d.get("peer"), "usable": usable, "was": was,
                                               "lost": sorted(set(was) - set(usable)), "gained": sorted(set(usable) - set(was)),
                                               "peer_generation": d.get("peer_generation")}, t_ns)
        if kind == "at_risk":
            rail = d.get("rail")
            fields = {k: d.get(k) for k in ("subject_kind", "subject", "rail", "gpu", "at_risk", "rule", "counter", "rate", "unit",
                                            "window_s", "threshold", "citation", "summary", "action")}
            fields["netdev"] = self.rails.get(rail) if rail is not None else None
            fields["counters"] = dict(d.get("counters") or {})
            return Alert("at_risk", bool(d.get("at_risk")), fields, t_ns)
        if kind == "routes_applied" and (d.get("errors") or d.get("conflicts")):
            return Alert("route_error", True, {"generation": d.get("generation"), "errors": list(d.get("errors") or []),
                                               "conflicts": list(d.get("conflicts") or [])}, t_ns)
        return None

    def from_report(self, rec: Mapping, now_ns: int) -> Alert | None:
        """The alert for one torch hook report (:class:`linkpass.adapters.hook_server.HookServer`
        keeps them as ``{"event", "t_ns", "client_id", "job", "rank", "pid", ...}``), or None.
        ``now_ns`` (monotonic ns) is the alert's time when the report carries no integer ``t_ns``."""
        ev = rec.get("event")
        if ev == "snapshot":
            try:
                r = parse_report(dict(rec))
            except ReportError:
                return None  # the engine passes on only checked ones; never an event with a bad field
            return Alert("snapshot", not r.ok, {"job": r.job, "rank": r.rank, "pid": r.pid, **r.fields()}, r.t_ns)
        if ev in _REBUILD_REPORTS:
            kind = "rebuild"
        elif ev in _MIGRATION_REPORTS:
            kind = "migration"
        else:
            return None
        detail = {k: v for k, v in rec.items() if k not in ("event", "t_ns", "client_id", "job", "rank", "pid")}
        try:
            if _json_size(detail) > MAX_DETAIL_BYTES:
                detail = {"truncated": True}
        except (TypeError, ValueError):
            detail = {"unserialisable": True}
        t = rec.get("t_ns") if isinstance(rec.get("t_ns"), int) else now_ns
        return Alert(kind, True, {"report": ev, "job": rec.get("job"), "rank": rec.get("rank"), "pid": rec.get("pid"),
                                  "detail": detail}, t)
