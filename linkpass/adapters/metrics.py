"""Prometheus metrics of one daemon: prometheus_client on a private CollectorRegistry.

Two feeds (DESIGN.md rule 1: the engine decides, adapters only watch):

* **history** — :meth:`DaemonMetrics.on_events` gets the entries of every
  :class:`~linkpass.core.model.PublishHistory` action the engine returns (the daemon's
  dispatch table hands them over, oldest first).  It drives the counters and histograms:
  failovers, failbacks, detection and reroute latency, incidents by domain, suppressions, one
  counter per history kind.
* **scrape time** — :func:`state_families` renders gauges from a
  :class:`~linkpass.core.status.DaemonSnapshot` when Prometheus scrapes: rail state, usable
  rails, plan generation, probe RTT and loss, hook connections, the jobs' snapshots, MQTT outbox
  depth, route and netlink counters.  prometheus_client serves HTTP from its own thread
  (``start_http_server``); the daemon's state belongs to the asyncio loop, so the collector
  asks the loop for the snapshot (``call_soon_threadsafe``) and waits for it (at most
  :data:`SNAPSHOT_TIMEOUT_S`): it never reads dicts the loop is changing.  A blocked loop gives
  a scrape without the state families (and ``linkpass_metrics_snapshot_timeouts_total`` goes
  up) instead of a torn picture.

Latency definitions (the same as ``bench/detect_reroute.py`` and ``linkpass demo``, measured
inside the daemon, monotonic clock):

* detection: the event that showed the fault (``event_t_ns`` of the ``rail`` history entry:
  when the netlink message or the probe verdict arrived) -> the engine's decision (``t_ns`` of
  that entry, the rail going DOWN);
* reroute: that decision -> the first ``routes_applied`` whose generation is at least that of the
  first plan recorded after the decision without the rail (``bench/detect_reroute.py``:
  ``reroute_ms``).

A *failover* is a rail leaving use because of a fault (UP -> DOWN; an operator's drain
is not one); a *failback* is a rail taken back into use after its hold-down (HOLD_DOWN -> UP).

Metric names are a contract with deploy/prometheus-rules.yml and the dashboards; see
:data:`METRIC_NAMES`.  Sources: prometheus_client 0.26.0 (``registry.py``, ``metrics_core.py``,
``exposition.py``); metric and label naming after https://prometheus.io/docs/practices/naming/
(base units: seconds, ratios 0..1, ``_total`` for counters).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from linkpass.core.snapshots import SnapshotsView
from linkpass.core.status import DaemonSnapshot

log = logging.getLogger("linkpass.metrics")

#: how long a scrape waits for the event loop to take the state snapshot (s)
SNAPSHOT_TIMEOUT_S = 2.0
#: rail states (linkpass.core.health.RailState values); every one gets a series, 1 for the current
RAIL_STATES = ("UNKNOWN", "UP", "SUSPECT", "DOWN", "HOLD_DOWN", "DRAINED")
USABLE_STATES = frozenset({"UP", "SUSPECT"})
#: detection is sub-millisecond for netlink faults, tens of ms for probe-detected ones
DETECT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: reroute is a few ms (one netlink round trip per route batch); seconds means trouble
REROUTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: every metric family this module exports (``_total`` counters by their sample name)
METRIC_NAMES = (
    # event-sink counters and histograms
    "linkpass_failovers_total", "linkpass_failbacks_total", "linkpass_rail_suppressed_flaps_total",
    "linkpass_detection_latency_seconds", "linkpass_reroute_latency_seconds",
    "linkpass_incidents_total", "linkpass_device_faults_total", "linkpass_engine_events_total",
    # scrape-time state
    "linkpass_info", "linkpass_ready", "linkpass_plan_generation", "linkpass_applied_generation",
    "linkpass_rails_configured", "linkpass_rails_usable", "linkpass_rail_state", "linkpass_rail_usable",
    "linkpass_rail_degraded", "linkpass_rail_suppressed", "linkpass_rail_damping_penalty",
    "linkpass_rail_probe_loss_ratio", "linkpass_rail_probe_rtt_seconds", "linkpass_rail_at_risk", "linkpass_gpu_at_risk",
    "linkpass_probe_rtt_seconds", "linkpass_probe_loss_ratio", "linkpass_probe_replies_total",
    "linkpass_probe_lost_total", "linkpass_prober_events_total",
    "linkpass_hook_clients", "linkpass_hook_clients_registered", "linkpass_hook_connections_total",
    "linkpass_hook_refused_total", "linkpass_mqtt_outbox_depth", "linkpass_mqtt_outbox_dropped_total",
    "linkpass_mqtt_connected", "linkpass_route_ops_total", "linkpass_route_errors_total",
    "linkpass_netlink_resyncs_total", "linkpass_netlink_overruns_total", "linkpass_events_handled_total",
    "linkpass_metrics_snapshot_timeouts_total",
    # torch hook snapshot reports (scrape time, from linkpass.core.snapshots)
    "linkpass_snapshots_total", "linkpass_snapshot_parts_total", "linkpass_snapshot_reports_rejected_total",
    "linkpass_snapshot_last_ok", "linkpass_snapshot_last_step", "linkpass_snapshot_last_bytes",
    "linkpass_snapshot_last_stall_seconds", "linkpass_snapshot_last_write_seconds",
)


class MetricsError(Exception):
    """The metrics endpoint cannot listen (address or port in use, bad address); one line."""


class LatencyTracker:
    """Turns engine history entries into failovers, failbacks and latency samples.

    Pure bookkeeping (no clock, no I/O): feed :meth:`feed` the entries in order; it returns
    what happened so the caller can count it.  Times are the entries' monotonic ns.

    Returns of :meth:`feed`: a list of ``(what, rail, value)`` with ``what`` one of
    ``"failover"``, ``"failback"`` (value None), ``"detect"``, ``"reroute"`` (value in seconds).
    """

    def __init__(self) -> None:
        self._t_dec: dict[int, int] = {}        # rail -> when its failover was decided, awaiting a plan without it
        self._want_gen: dict[int, tuple[int, int]] = {}  # rail -> (plan generation without it, t_dec)

    def feed(self, entries: Iterable) -> list[tuple[str, int, float | None]]:
        out: list[tuple[str, int, float | None]] = []
        for e in entries:
            d = e.data
            if e.kind == "rail":
                rail, old, new = d.get("rail"), d.get("old"), d.get("new")
                if not isinstance(rail, int):
                    continue
                if old in USABLE_STATES and new == "DOWN":
                    out.append(("failover", rail, None))
                    ev = d.get("event_t_ns")
                    if isinstance(ev, int) and e.t_ns >= ev:
                        out.append(("detect", rail, (e.t_ns - ev) / 1e9))
                    self._t_dec[rail] = e.t_ns
                    self._want_gen.pop(rail, None)
                elif old == "HOLD_DOWN" and new == "UP":
                    out.append(("failback", rail, None))
                    self._t_dec.pop(rail, None)  # back before its reroute was seen: no sample
                    self._want_gen.pop(rail, None)
            elif e.kind == "plan":
                usable = d.get("usable") or ()
                gen = d.get("generation")
                for rail, t_dec in list(self._t_dec.items()):
                    if rail not in usable and isinstance(gen, int) and e.t_ns >= t_dec:
                        self._want_gen[rail] = (gen, t_dec)
                        del self._t_dec[rail]
            elif e.kind == "routes_applied":
                gen = d.get("generation")
                if not isinstance(gen, int):
                    continue
                for rail, (want, t_dec) in list(self._want_gen.items()):
                    if gen >= want:
                        out.append(("reroute", rail, max(0, e.t_ns - t_dec) / 1e9))
                        del self._want_gen[rail]
        return out


class DaemonMetrics:
    """The Prometheus metrics of one daemon.

    Args:
        snapshot_fn: ``snapshot_fn(now_ns) -> DaemonSnapshot``: the daemon's state at monotonic
            ``now_ns`` (called on the daemon's loop, see :meth:`start`); the scrape-time gauges
            are rendered from it (:func:`state_families`).
        rail_ids: the configured rail ids (their failover/failback series exist from the start).
        clock: monotonic ns clock for the scrape-time figures that decay (damping penalty);
            tests driving the engine with a fake clock pass theirs.

    ``*_created`` series are not exported (``prometheus_client.disable_created_metrics()``,
    process-wide): they double the series count and no rule here uses them.

    Use: ``m.on_events(entries)`` for each :class:`~linkpass.core.model.PublishHistory`; ``m.start(address, port, loop)`` in the
    running loop (raises :class:`MetricsError`); ``m.stop()`` at the end.  ``m.registry`` is the
    private :class:`prometheus_client.CollectorRegistry` (``generate_latest(m.registry)``).
    """

    def __init__(self, snapshot_fn: Callable[[int], DaemonSnapshot], rail_ids: Iterable[int] = (),
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        disable_created_metrics()
        self.snapshot_fn = snapshot_fn
        self.clock = clock
        self.snapshot_timeout_s = SNAPSHOT_TIMEOUT_S
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_StateCollector(self))  # first: a snapshot timeout is counted in the same scrape
        self.failovers = Counter("linkpass_failovers", "Rails taken out of use by a fault (UP -> DOWN).",
                                 ["rail"], registry=r)
        self.failbacks = Counter("linkpass_failbacks", "Rails taken back into use after their hold-down (HOLD_DOWN -> UP).",
                                 ["rail"], registry=r)
        self.suppressed_flaps = Counter("linkpass_rail_suppressed_flaps", "Rail down events that left the rail suppressed by "
                                        "flap damping: the one that started a suppression and each one during it.",
                                        ["rail"], registry=r)
        self.detect = Histogram("linkpass_detection_latency_seconds",
                                "Fault event received (netlink message or probe verdict) -> rail declared DOWN.",
                                ["rail"], buckets=DETECT_BUCKETS, registry=r)
        self.reroute = Histogram("linkpass_reroute_latency_seconds",
                                 "Rail declared DOWN -> routes of the first plan without it applied (kernel ACK).",
                                 ["rail"], buckets=REROUTE_BUCKETS, registry=r)
        self.incidents = Counter("linkpass_incidents", "Device and link incidents recorded (kernel log, NVML, RDMA events), by domain.",
                                 ["domain"], registry=r)
        self.device_faults = Counter("linkpass_device_faults", "Device faults that need the rank moved to a spare "
                                     "(torch hook clients were told), by domain.", ["domain"], registry=r)
        self.engine_events = Counter("linkpass_engine_events", "Engine history entries recorded, by kind.", ["kind"], registry=r)
        self.snapshot_timeouts = Counter("linkpass_metrics_snapshot_timeouts",
                                         "Scrapes whose state snapshot the event loop did not take in time (loop blocked).",
                                         registry=r)
        for rail in rail_ids:  # every rail's series exist from the start (rate() needs a 0)
            for m in (self.failovers, self.failbacks, self.suppressed_flaps):
                m.labels(rail=str(rail))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        self.tracker = LatencyTracker()
        self.server = None
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.address: tuple[str, int] | None = None

    # ------------------------------------------------------------------ event sink

    def on_events(self, entries: Iterable) -> None:
        """Count new engine history entries, oldest first (a :class:`~linkpass.core.model.PublishHistory`'s, on the loop)."""
        for e in entries:
            self.engine_events.labels(kind=e.kind).inc()
            if e.kind == "incident":
                dom = str(e.data.get("domain") or "unknown")
                self.incidents.labels(domain=dom).inc()
                if e.data.get("notified"):
                    self.device_faults.labels(domain=dom).inc()
            elif e.kind == "damping" and e.data.get("suppressed"):
                self.suppressed_flaps.labels(rail=str(e.data.get("rail"))).inc()
        for what, rail, value in self.tracker.feed(entries):
            lab = str(rail)
            if what == "failover":
                self.failovers.labels(rail=lab).inc()
            elif what == "failback":
                self.failbacks.labels(rail=lab).inc()
            elif what == "detect":
                self.detect.labels(rail=lab).observe(value)
            elif what == "reroute":
                self.reroute.labels(rail=lab).observe(value)

    # ------------------------------------------------------------------ HTTP

    def start(self, address: str, port: int, loop: asyncio.AbstractEventLoop | None = None) -> tuple[str, int]:
        """Serve ``GET /metrics`` on ``address:port`` from a daemon thread.

        Args:
            address: IP literal to bind.
            port: TCP port (0 = any free port; the bound one is returned).
            loop: the loop that owns the daemon's state (scrape snapshots run on it); None: the
                snapshot is taken on the scraping thread (tests without a loop).

        Returns:
            The bound ``(address, port)``.

        Raises:
            MetricsError: cannot listen there (port in use, address not on this host).
        """
        self.loop = loop
        self._loop_thread = threading.get_ident() if loop is not None else None
        try:
            self.server, self.thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as e:
            raise MetricsError(f"metrics: cannot listen on {address} port {port}: {e.strerror or e}") from None
        self.address = self.server.server_address[:2]
        return self.address

    def stop(self) -> None:
        """Stop the HTTP server (idempotent; a scrape in flight may still finish)."""
        srv, self.server = self.server, None
        if srv is not None:
            srv.shutdown()
            srv.server_close()

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> list[Metric]:
        """The scrape-time families, rendered from the daemon's snapshot now (call on its loop)."""
        return state_families(self.snapshot_fn(self.clock()))

    def _snapshot_on_loop(self) -> list[Metric] | None:
        loop = self.loop
        if loop is None:
            return self.snapshot()
        if loop.is_closed():
            return None
        if threading.get_ident() == self._loop_thread:
            return self.snapshot()  # already on the loop (generate_latest called in the daemon)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self.snapshot())
                except BaseException as e:  # noqa: BLE001 - handed to the scraping thread
                    fut.set_exception(e)

        try:
            loop.call_soon_threadsafe(take)
        except RuntimeError:  # loop closed while stopping
            return None
        try:
            return fut.result(self.snapshot_timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self.snapshot_timeouts.inc()
            log.warning("metrics: the event loop did not answer a scrape in %.1f s; state metrics left out", self.snapshot_timeout_s)
            return None
        except Exception:
            log.exception("metrics: building the state metrics failed; left out of this scrape")
            return None


class _StateCollector:
    """Custom collector: the scrape-time gauges (prometheus_client ``Collector`` protocol)."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # names are dynamic; never collect at registration time

    def collect(self) -> Iterable[Metric]:
        return self.metrics._snapshot_on_loop() or []


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def state_families(snap: DaemonSnapshot) -> list[Metric]:
    """Every scrape-time family, rendered from one :class:`~linkpass.core.status.DaemonSnapshot`
    (see :class:`DaemonMetrics`); a part that is off (prober, hooks, MQTT) is left out."""
    out: list[Metric] = []
    info = _gauge("linkpass_info", "Constant 1, labelled with what this daemon is.", ["host", "mode", "reroute", "version"])
    info.add_metric([snap.host, snap.mode, snap.reroute, snap.version], 1)
    out.append(info)
    out.append(GaugeMetricFamily("linkpass_ready", "1 once the first link dump and route reconciliation are done.",
                                 value=1 if snap.ready else 0))
    out.append(GaugeMetricFamily("linkpass_plan_generation", "Current plan generation (bumps on every plan change).",
                                 value=snap.generation))
    out.append(GaugeMetricFamily("linkpass_applied_generation", "Newest plan generation whose routes were applied.",
                                 value=snap.applied_generation))

    state = _gauge("linkpass_rail_state", "1 for the rail's current health state, 0 for the others.", ["rail", "netdev", "state"])
    usable = _gauge("linkpass_rail_usable", "1 when the rail may carry traffic (UP).", ["rail", "netdev"])
    degraded = _gauge("linkpass_rail_degraded", "1 when the rail's probe loss marks it DEGRADED.", ["rail", "netdev"])
    suppressed = _gauge("linkpass_rail_suppressed", "1 while flap damping keeps the rail out of use.", ["rail", "netdev"])
    penalty = _gauge("linkpass_rail_damping_penalty", "Flap-damping penalty of the rail now (decays with its half-life).", ["rail", "netdev"])
    rloss = _gauge("linkpass_rail_probe_loss_ratio", "Probe loss of the rail over [probe] loss_window_ms (0..1; what DEGRADED is judged on).",
                   ["rail", "netdev"])
    rrtt = _gauge("linkpass_rail_probe_rtt_seconds", "Median over the rail's probed paths of their smoothed probe RTT.", ["rail", "netdev"])
    for r in snap.rails:
        lab = [str(r.id), r.netdev]
        for s in RAIL_STATES:
            state.add_metric(lab + [s], 1 if r.state == s else 0)
        usable.add_metric(lab, 1 if r.usable else 0)
        degraded.add_metric(lab, 1 if r.degraded else 0)
        if r.suppressed is not None:
            suppressed.add_metric(lab, 1 if r.suppressed else 0)
        if r.damping_penalty is not None:
            penalty.add_metric(lab, r.damping_penalty)
        if r.probe_loss is not None:
            rloss.add_metric(lab, r.probe_loss)
        if r.probe_rtt_s is not None:
            rrtt.add_metric(lab, r.probe_rtt_s)
    risk = _gauge("linkpass_rail_at_risk", "1 while the rail's counters say it is at risk (it is drained for it).",
                  ["rail", "netdev"])
    for r in snap.rails:
        risk.add_metric([str(r.id), r.netdev], 1 if r.at_risk else 0)
    gpu_risk = _gauge("linkpass_gpu_at_risk", "1 while the GPU's counters say it is at risk (its ranks move to spares).",
                      ["gpu"])
    for g, v in sorted((snap.gpu_at_risk or {}).items()):
        gpu_risk.add_metric([str(g)], 1 if v else 0)
    out += [state, usable, degraded, suppressed, penalty, rloss, rrtt, risk, gpu_risk]
    out.append(GaugeMetricFamily("linkpass_rails_configured", "Rails this daemon watches.", value=len(snap.rails)))
    out.append(GaugeMetricFamily("linkpass_rails_usable", "Rails that may carry traffic now.", value=len(snap.usable_rails)))

    prober = snap.prober
    if prober is not None:
        # per path only for the fast-probed peers (hook-registered and ring neighbours, a few per
        # rail): every peer on every rail would be rails x hosts series on each host
        rtt = _gauge("linkpass_probe_rtt_seconds", "Smoothed probe round-trip time of a fast-probed path (TCP SRTT style, gain 1/8).",
                     ["rail", "peer"])
        ploss = _gauge("linkpass_probe_loss_ratio", "Lost share of the last probes of a fast-probed path (0..1).", ["rail", "peer"])
        rep = _counter("linkpass_probe_replies", "Probe replies received in time on a fast-probed path.", ["rail", "peer"])
        lost = _counter("linkpass_probe_lost", "Probes lost (no reply in time) on a fast-probed path.", ["rail", "peer"])
        for p in prober.paths:
            lab = [str(p.rail), p.peer]
            if p.rtt_s is not None:
                rtt.add_metric(lab, p.rtt_s)
            if p.loss is not None:
                ploss.add_metric(lab, p.loss)
            rep.add_metric(lab, p.replies)
            lost.add_metric(lab, p.lost)
        ev = _counter("linkpass_prober_events", "Prober counters (sent, replies, timeouts, rejected_<kind>, ...).", ["event"])
        for k, v in sorted(prober.counters.items()):
            ev.add_metric([k], v)
        out += [rtt, ploss, rep, lost, ev]

    hooks = snap.hooks
    if hooks is not None:
        out.append(GaugeMetricFamily("linkpass_hook_clients", "Torch hook clients connected now.", value=hooks.clients))
        out.append(GaugeMetricFamily("linkpass_hook_clients_registered", "Connected torch hook clients that registered their rank.",
                                     value=hooks.registered))
        out.append(CounterMetricFamily("linkpass_hook_connections", "Torch hook connections accepted since start.",
                                       value=hooks.connections))
        out.append(CounterMetricFamily("linkpass_hook_refused", "Torch hook connections refused (max_clients reached).",
                                       value=hooks.refused))

    if snap.snapshots is not None:
        out += snapshot_families(snap.snapshots)

    mqtt = snap.mqtt
    if mqtt is not None:
        if mqtt.depth is not None:
            out.append(GaugeMetricFamily("linkpass_mqtt_outbox_depth", "Events in the durable MQTT outbox not yet acknowledged by the broker.",
                                         value=mqtt.depth))
        if mqtt.dropped_total is not None:
            out.append(CounterMetricFamily("linkpass_mqtt_outbox_dropped", "Events dropped because the MQTT outbox was full.",
                                           value=mqtt.dropped_total))
        if mqtt.connected is not None:
            out.append(GaugeMetricFamily("linkpass_mqtt_connected", "1 while connected to the MQTT broker.", value=int(mqtt.connected)))

    c = snap.counters
    if "route_ops" in c:
        out.append(CounterMetricFamily("linkpass_route_ops", "Kernel route operations done.", value=c["route_ops"]))
        out.append(CounterMetricFamily("linkpass_route_errors", "Kernel route operations that failed.", value=c["route_errors"]))
    if "netlink_resyncs" in c:
        out.append(CounterMetricFamily("linkpass_netlink_resyncs", "Netlink resyncs (fresh dumps after an overrun or reconnect).",
                                       value=c["netlink_resyncs"]))
        out.append(CounterMetricFamily("linkpass_netlink_overruns", "Netlink socket overruns (ENOBUFS: events lost).",
                                       value=c["netlink_overruns"]))
    out.append(CounterMetricFamily("linkpass_events_handled", "Events the engine handled.", value=c.get("events_handled", 0)))
    return out


def snapshot_families(view: SnapshotsView) -> list[Metric]:
    """The jobs' snapshot series (:mod:`linkpass.core.snapshots`; one series per job and label
    value, at most ``JOBS_KEPT`` jobs).  ``_last_*`` gauges are of the job's newest report on this
    host (a ``snapshot`` from its rank 0, or a rank's ``part``); a value the report did not carry
    leaves its series out."""
    total = _counter("linkpass_snapshots", "Snapshots of a job that completed (result=ok) or failed (result=failed), "
                     "as its rank 0 on this host reported them.", ["job", "result"])
    parts = _counter("linkpass_snapshot_parts", "Snapshot parts the job's other ranks on this host wrote (result=ok) or "
                     "failed to write (result=failed).", ["job", "result"])
    ok = _gauge("linkpass_snapshot_last_ok", "1 when the job's newest snapshot report on this host said ok.", ["job"])
    step = _gauge("linkpass_snapshot_last_step", "Optimizer step of the job's newest snapshot report on this host.", ["job"])
    size = _gauge("linkpass_snapshot_last_bytes", "Bytes on disk of the job's newest snapshot report on this host (the "
                  "whole snapshot from rank 0, or one rank's part).", ["job"])
    stall = _gauge("linkpass_snapshot_last_stall_seconds", "Training stall of the job's newest snapshot report on this host "
                   "(the slowest rank's for a whole snapshot).", ["job"])
    write = _gauge("linkpass_snapshot_last_write_seconds", "Step boundary to on disk, of the job's newest snapshot report on "
                   "this host (the slowest rank's for a whole snapshot).", ["job"])
    for j in view.jobs:
        total.add_metric([j.job, "ok"], j.ok)
        total.add_metric([j.job, "failed"], j.failed)
        parts.add_metric([j.job, "ok"], j.parts_ok)
        parts.add_metric([j.job, "failed"], j.parts_failed)
        r = j.last
        ok.add_metric([j.job], 1 if r.ok else 0)
        step.add_metric([j.job], r.step)
        if r.bytes is not None:
            size.add_metric([j.job], r.bytes)
        if r.stall_ms is not None:
            stall.add_metric([j.job], r.stall_ms / 1e3)
        if r.write_ms is not None:
            write.add_metric([j.job], r.write_ms / 1e3)
    rejected = CounterMetricFamily("linkpass_snapshot_reports_rejected", "Torch hook snapshot reports dropped for a field "
                                   "of the wrong type or range.", value=view.rejected)
    return [total, parts, rejected, ok, step, size, stall, write]
