"""A frozen picture of one daemon's state: what the adapters that report state read.

The daemon (:meth:`linkpass.daemon.Daemon.snapshot`) builds a :class:`DaemonSnapshot` on its
event loop, from the engine and its adapters, when a reader asks (a Prometheus scrape, a
``status`` control request) or after a loop turn that recorded history (the systemd STATUS=
line).  Three renderers read the same snapshot and nothing else:

* :func:`linkpass.adapters.metrics.state_families` — the scrape-time Prometheus families;
* :func:`linkpass.adapters.sdnotify.status_line` — systemd's one-line ``STATUS=``;
* :func:`status_json` (here) — the control socket's ``status`` answer (``linkpass status``).

Pure data: no clock, no I/O.  Times are monotonic ns; ``*_s`` fields are seconds.  The
snapshot is frozen; the mappings in it are copies the daemon made for it, never live state
(renderers must not change them either).  Parts a reader does not need are left out of the
snapshot it gets (None): building the engine's JSON on every loop turn would cost the
reroute path time for a line systemd shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from linkpass.core.snapshots import SnapshotsView, snapshots_json

#: the ``schema`` of the control socket's ``status`` answer
STATUS_SCHEMA = "linkpass.status/v1"


@dataclass(frozen=True)
class RailSnapshot:
    """One configured rail.

    Attributes:
        id, netdev: the rail as configured.
        state: its health state (``RailState`` value: ``UP``, ``DOWN``, ``HOLD_DOWN``, ...).
        usable: may carry traffic now.
        degraded: probe loss marks it DEGRADED.
        suppressed: flap damping keeps it out of use; None when damping is off.
        damping_penalty: flap-damping penalty now (decayed to ``DaemonSnapshot.t_ns``); None when off.
        probe_loss: probe loss ratio over the loss window (0..1), None when unknown.
        probe_rtt_s: median over the rail's probed paths of their smoothed RTT (s); None when no
            path has one or the snapshot was taken without probes.
        at_risk: its counters say it is at risk (drained for it: :mod:`linkpass.core.risk`).
    """

    id: int
    netdev: str
    state: str
    usable: bool
    degraded: bool
    suppressed: bool | None
    damping_penalty: float | None
    probe_loss: float | None
    probe_rtt_s: float | None
    at_risk: bool = False


@dataclass(frozen=True)
class PathSnapshot:
    """One fast-probed path (hook-registered peers and ring neighbours).

    Attributes:
        rail, peer: the path.
        rtt_s: smoothed RTT (s), None before the first reply.
        loss: lost share of the last probes (0..1), None before any.
        replies, lost: probe replies received in time, probes lost, since start.
    """

    rail: int
    peer: str
    rtt_s: float | None
    loss: float | None
    replies: int
    lost: int


@dataclass(frozen=True)
class ProberSnapshot:
    """The prober: its fast-probed paths (sorted by rail, peer) and counters (name -> count)."""

    paths: tuple[PathSnapshot, ...]
    counters: Mapping[str, int]


@dataclass(frozen=True)
class HooksSnapshot:
    """The torch hook server.

    Attributes:
        clients: connected now; registered: of those, the ones that registered their rank.
        connections, refused: accepted since start; refused (``max_clients`` reached).
        status: its JSON for ``linkpass status`` (None in a snapshot taken without it).
    """

    clients: int
    registered: int
    connections: int
    refused: int
    status: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class MqttSnapshot:
    """The MQTT publisher.

    Attributes:
        depth: events in the outbox not yet acknowledged (None when it could not be read).
        dropped_total: events dropped because the outbox was full (None when unknown).
        connected: connected to the broker now (None when unknown).
        status: its JSON for ``linkpass status`` (None in a snapshot taken without it).
    """

    depth: float | None
    dropped_total: float | None
    connected: bool | None
    status: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SystemdSnapshot:
    """The daemon's ``Type=notify`` side: notifications on, READY=1 sent, watchdog (s, or None), pings sent."""

    notify: bool
    ready: bool
    watchdog_interval_s: float | None
    watchdogs_sent: int


@dataclass(frozen=True)
class DaemonSnapshot:
    """The daemon's state at one moment (see the module docstring).

    Attributes:
        t_ns: when it was taken (monotonic ns; damping penalties are decayed to it).
        pid, uptime_s: the daemon process and how long it has run (s).
        host, mode, reroute, version: what this daemon is (config ``[daemon]``, linkpass version).
        ready: the first link dump and route reconciliation are done.
        generation, applied_generation: current plan generation; newest one whose routes were applied.
        rails: every configured rail, in config order.
        peers_configured, peers_heard: configured peers; those whose notices were heard.
        route_errors: how many route operations of the last apply failed.
        reload_error: why the last reload was refused (None when it was not).
        counters: the daemon's counters (``linkpass status`` ``counters``: ``events_handled``,
            ``route_ops``, ``netlink_resyncs``, ``probes_<k>``, ``dispatch_errors``, ...), in order.
        dispatch_errors: action type name -> handler failures.
        prober, hooks, mqtt: those adapters, None when off (``prober`` also None in a snapshot
            taken without probes).
        systemd: the ``Type=notify`` side.
        metrics_listening: ``"address:port"`` of the metrics endpoint, None when not
            listening; ``metrics_enabled`` says whether metrics are configured at all.
        topology: ``rails = "auto"``: what discovery found (``rails``, ``sysfs_root``, ``notes``);
            None otherwise.  ``topology_warnings``: discovery's warnings.
        engine: the engine's JSON picture (:meth:`linkpass.core.engine.Engine.status`); None
            in a snapshot taken without it.
        device_sources: live device source name -> its JSON status (None without ``engine``).
        snapshots: the torch hooks' snapshot reports per job (:mod:`linkpass.core.snapshots`);
            None when hooks are off.
        gpu_at_risk: NVML GPU index -> at risk now, for every GPU the counter poller watches
            and every GPU with a verdict.
        scheduling: the daemon's CPU scheduling (:func:`linkpass.adapters.sched.apply`:
            ``policy``, ``priority``, ``asked``, ``error``); None when not set.
    """

    t_ns: int
    pid: int
    uptime_s: float
    host: str
    mode: str
    reroute: str
    version: str
    ready: bool
    generation: int
    applied_generation: int
    rails: tuple[RailSnapshot, ...]
    peers_configured: int
    peers_heard: int
    route_errors: int
    reload_error: str | None
    counters: Mapping[str, int]
    dispatch_errors: Mapping[str, int]
    prober: ProberSnapshot | None
    hooks: HooksSnapshot | None
    mqtt: MqttSnapshot | None
    systemd: SystemdSnapshot
    metrics_enabled: bool
    metrics_listening: str | None
    topology: Mapping[str, Any] | None
    topology_warnings: tuple[str, ...]
    engine: Mapping[str, Any] | None = None
    device_sources: Mapping[str, Any] | None = None
    snapshots: SnapshotsView | None = None
    gpu_at_risk: Mapping[int, bool] | None = None
    scheduling: Mapping[str, Any] | None = None

    @property
    def usable_rails(self) -> tuple[int, ...]:
        """Ids of the rails that may carry traffic now, in config order."""
        return tuple(r.id for r in self.rails if r.usable)


def status_json(snap: DaemonSnapshot) -> dict:
    """The control socket's ``status`` answer (``linkpass status --json``): a JSON-ready dict.

    Fields: ``schema`` (:data:`STATUS_SCHEMA`), ``pid``, ``uptime_s``, the engine's fields
    (``host``, ``rails``, ``peers``, ``routes``, ``warnings``, ``totals``, ...), then
    ``topology`` (auto mode only), ``reroute``, ``mqtt`` and ``hooks`` (when on), ``snapshots``
    (with hooks: :func:`linkpass.core.snapshots.snapshots_json`), ``metrics`` (when configured),
    ``systemd``, ``counters``, ``dispatch_errors``, ``device_sources``.

    Raises:
        ValueError: the snapshot was taken without the engine's picture.
    """
    if snap.engine is None:
        raise ValueError("status_json needs a snapshot taken with the engine's status")
    st = {"schema": STATUS_SCHEMA, "pid": snap.pid, "uptime_s": snap.uptime_s, **snap.engine}
    if snap.reload_error:
        st["warnings"] = st["warnings"] + [snap.reload_error]
    if snap.scheduling is not None:
        st["scheduling"] = dict(snap.scheduling)
        if snap.scheduling.get("error"):
            st["warnings"] = st["warnings"] + [str(snap.scheduling["error"])]
    if snap.topology is not None:
        st["topology"] = dict(snap.topology)
        st["warnings"] = st["warnings"] + list(snap.topology_warnings)
    st["reroute"] = snap.reroute
    if snap.mqtt is not None:
        st["mqtt"] = snap.mqtt.status
    if snap.hooks is not None:
        st["hooks"] = snap.hooks.status
    if snap.snapshots is not None:
        st["snapshots"] = snapshots_json(snap.snapshots, snap.t_ns)
    if snap.metrics_enabled:
        st["metrics"] = {"listening": snap.metrics_listening}
    sd = snap.systemd
    st["systemd"] = {"notify": sd.notify, "ready": sd.ready, "watchdog_interval_s": sd.watchdog_interval_s,
                     "watchdogs_sent": sd.watchdogs_sent}
    st["counters"] = dict(snap.counters)
    st["dispatch_errors"] = dict(snap.dispatch_errors)
    st["device_sources"] = dict(snap.device_sources or {})
    return st
