"""Composition root: builds the adapters, one event queue, supervised named tasks.

``linkpass run --config FILE`` ends up in :func:`run`.  Flow (DESIGN.md rule 1)::

    NetlinkMonitor ─┐
    NoticeService  ─┼─> asyncio.Queue ─> Engine.handle(event, now) ─> actions ─> dispatch table
    RouteActuator  ─┤                                             ApplyRoutes      -> RouteActuator.submit
    timer (Tick)   ─┤                                             SendNotice       -> NoticeService.submit
    KmsgFollower,  ─┤  (DeviceIncident)                           NotifyDeviceFault-> HookServer (device_fault)
    NVML, RDMA     ─┤                                             NotifyHooks      -> HookServer.publish
    HookServer     ─┘  (HookPeersChanged, HookReport,             SetProbePriority -> Prober
                        DeviceFaultDelivered)                     PublishHookReport-> MqttPublisher
                                                                  WriteNcclEnv     -> NcclEnvFile.write
                                                                  PublishHistory   -> MqttPublisher,
                                                                                      systemd STATUS=,
                                                                                      DaemonMetrics
                                                                  SetTimer, RefreshNeighbors

Every action type has one handler (:meth:`Daemon._handlers`); a handler that raises is logged
and counted (``dispatch_errors`` in ``linkpass status --json``) and the other actions still run.
A handler may answer with events (the device-fault outcome): they go through
``Engine.handle`` at once, in the same loop turn.  History leaves the engine as an action
too: each ``handle()`` that recorded entries ends its actions with one :class:`PublishHistory`,
handed to every history reader (each isolated: one that raises is logged, the others still get
the entries).  Adapters that report the daemon's state (metrics, the systemd STATUS= line, the
control socket's ``status``) read a :class:`~linkpass.core.status.DaemonSnapshot` that
:meth:`Daemon.snapshot` builds on the loop, never the daemon itself.
Signals: SIGTERM/SIGINT stop the daemon and leave routes as they are (traffic must not drop
because the daemon stops); SIGHUP reloads the config (an invalid new config is logged and
the old one kept).  The control socket answers ``{"cmd": "status"}`` with a JSON status, and
``{"cmd": "drain", "rail": ID}`` / ``undrain`` (``linkpass drain`` / ``undrain``) with a
:class:`Drain` event for the engine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import time
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from linkpass import __version__
from linkpass.adapters.hook_server import HookServer, default_socket_path
from linkpass.adapters.kmsg import KmsgFollower
from linkpass.adapters.metrics import DaemonMetrics, MetricsError
from linkpass.adapters.nccl_file import NcclEnvFile
from linkpass.adapters.netlink import NetlinkMonitor
from linkpass.adapters.notices import NoticeService
from linkpass.adapters.prober import Prober, datapath_problem
from linkpass.adapters.ports import HookNotifier
from linkpass.adapters import sched
from linkpass.adapters.routes import RouteActuator, RouteSettings
from linkpass.adapters.sdnotify import SdNotifier, ServiceNotifier
from linkpass.config import Config, ConfigError, load_config, notice_key, policy_from_config, probe_policy
from linkpass.core.engine import Engine
from linkpass.core.model import (
    ApplyRoutes,
    ConfigReloaded,
    DeviceIncident,
    DeviceFaultDelivered,
    Drain,
    Event,
    HookPeersChanged,
    HookReport,
    LinkChanged,
    NotifyAtRisk,
    NotifyDeviceFault,
    NotifyHooks,
    PublishHistory,
    PublishHookReport,
    RefreshNeighbors,
    RoutesApplied,
    SendNotice,
    SetProbePriority,
    SetTimer,
    Tick,
    WriteNcclEnv,
)
from linkpass.core.probe_filter import ProbeFilter
from linkpass.core.status import (  # STATUS_SCHEMA: kept importable from here
    STATUS_SCHEMA,  # noqa: F401
    DaemonSnapshot,
    HooksSnapshot,
    MqttSnapshot,
    PathSnapshot,
    ProberSnapshot,
    RailSnapshot,
    SystemdSnapshot,
    status_json,
)

log = logging.getLogger("linkpass.daemon")
RUNTIME_DIR = Path("/run/linkpass")


class StartError(Exception):
    """The daemon cannot start here (socket or port in use, bad path); one line, exit 2."""
QUERY_LIMIT = 16 * 1024 * 1024  # a full history is ~300 KB; asyncio's default line limit is 64 KiB

#: The longest control request line the daemon reads, in bytes (a request is ``{"cmd": "history"}``).
MAX_REQUEST_BYTES = 64 * 1024
#: Connections the kernel queues on the control socket before the daemon accepts them (the
#: listen(2) backlog; Linux caps it at net.core.somaxconn, 4096 by default since 5.4).  Up to
#: this many clients connecting at once (a node's ranks all polling status) are all answered.
CONTROL_BACKLOG = 1024
#: Seconds a control client has to send its request line, and again to take the reply.
CONTROL_TIMEOUT_S = 5.0
#: Nanoseconds between two warnings about bad control requests (the others are counted).
BAD_REQUEST_WARN_INTERVAL_NS = 10 * 1_000_000_000

def parse_request(line: bytes) -> tuple[dict | None, str | None]:
    """One control request line -> ``(request, None)``, or ``(None, why)`` when it is not one.

    An empty line (the client closed without writing) is ``{"cmd": "status"}``.  A request is a
    UTF-8 JSON object whose ``cmd``, when present, is a string.  Never raises: bytes that are not
    UTF-8, text that is not JSON, JSON nested past the parser's recursion limit, and any other
    value each give a one-line ``why`` (no part of the input is echoed).
    """
    if not line:
        return {"cmd": "status"}, None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"request is not UTF-8 text (bad byte at offset {e.start})"
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"request is not JSON ({e.msg} at offset {e.pos})"
    except RecursionError:
        return None, "request is JSON nested too deeply"
    except ValueError as e:  # e.g. an integer past Python's 4300-digit conversion limit
        from linkpass.config import huge_number_text

        return None, f"request is JSON we cannot read ({huge_number_text(e)})"
    if not isinstance(req, dict):
        return None, 'request must be a JSON object such as {"cmd": "status"}'
    if not isinstance(req.get("cmd", "status"), str):
        return None, 'request "cmd" must be a string such as "status"'
    return req, None


class _Throttle:
    """At most one ``True`` per ``interval_ns``; counts the calls it said ``False`` to.

    Args:
        interval_ns: nanoseconds between two allowed calls.
        clock: monotonic nanoseconds (tests pass a fake).
    """

    def __init__(self, interval_ns: int, clock=time.monotonic_ns):
        self.interval_ns, self.clock = interval_ns, clock
        self._last: int | None = None
        self.suppressed = 0  # calls refused since the last allowed one

    def allow(self) -> tuple[bool, int]:
        """``(allowed, refused since the last allowed call)``; the count restarts when allowed."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_ns:
            self.suppressed += 1
            return False, self.suppressed
        self._last, n, self.suppressed = now, self.suppressed, 0
        return True, n


def gpu_index(bus: str, nvml=None, topology=None, overrides: dict[str, int] | None = None) -> int | None:
    """NVML index of the GPU at PCI bus id ``bus``: from NVML when it runs (``nvml.gpu_index``),
    else from the discovered topology's GPUs, else from the config's ``[device] gpus``
    override; None when none of them knows it."""
    if nvml is not None:
        i = nvml.gpu_index(bus)
        if i is not None:
            return i
    for g in getattr(topology, "gpus", None) or ():
        if g.pci_bus_id == bus and g.index is not None:
            return g.index
    # the override compared without the domain's width ("0000:18:00.0" as lspci prints it,
    # "00000000:18:00.0" as NVML does)
    want = _bus_key(bus)
    for b, idx in (overrides or {}).items():
        if _bus_key(b) == want:
            return idx
    return None


def _bus_key(bus: str) -> tuple[int, str] | None:
    """``"0000:18:00.0"`` -> ``(0, "18:00.0")``: a PCI bus id with its domain as a number."""
    dom, _, rest = bus.lower().partition(":")
    try:
        return int(dom, 16), rest
    except ValueError:
        return None


class DeviceFaultNotifier:
    """The owner of :class:`NotifyDeviceFault`: tells the hooks on the fault's GPU (through a
    :class:`~linkpass.adapters.ports.HookNotifier`) and the operators (log), and answers with
    what became of it.

    Args:
        hooks: the hook server, None when hooks are off (the fault then reaches nobody).
        post: puts an event on the daemon's queue (a late delivery arrives through it).
        clock: monotonic ns (tests pass a fake).
    """

    def __init__(self, hooks: HookNotifier | None, post: Callable[[Event], None], clock: Callable[[], int] = time.monotonic_ns):
        self.hooks, self.post, self.clock = hooks, post, clock

    def __call__(self, a: NotifyDeviceFault) -> list[DeviceFaultDelivered]:
        """A device fault that needs its rank moved.  Returns the outcome as one
        :class:`DeviceFaultDelivered` for the engine (``notified`` in status; the dispatcher
        feeds it back in the same loop turn); a late delivery is posted as another one
        (``late=True``).  A fault with no GPU index (an NVSwitch, a bus id missing from the GPU
        map) is told to no hook client: every rank of the host would move; it is logged as a
        node-level fault.  Nobody on the GPU now: the hook server keeps it a while."""
        inc = a.incident
        if inc.gpu is None:
            log.warning("DEVICE FAULT on %s: %s %s (%s): %s; could not be attributed to a GPU (no GPU index for %s), so no "
                        "rank was moved; this is a node-level fault: drain the node (move its jobs off), then %s",
                        inc.device or "unknown device", inc.domain, inc.code, inc.source, inc.summary or "-",
                        inc.device or "the device", inc.remedy if inc.remedy not in ("none", "observe", "drain-node") else "investigate")
            return [DeviceFaultDelivered(inc, 0, unattributed=True, t_ns=self.clock())]

        def late(n: int) -> None:
            self.post(DeviceFaultDelivered(inc, n, late=True, t_ns=self.clock()))

        hooks = self.hooks
        sent = hooks.publish_device_fault(inc.to_json(), inc.gpu, inc.t_ns, on_delivered=late) if hooks is not None else 0
        outcome = DeviceFaultDelivered(inc, sent, kept=hooks is not None and sent == 0, t_ns=self.clock())
        log.warning("DEVICE FAULT on %s (GPU %d): %s %s (%s): %s; remedy: %s; told %d hook client(s) to move the rank%s",
                    inc.device or "unknown device", inc.gpu, inc.domain, inc.code, inc.source, inc.summary or "-", inc.remedy,
                    sent, "" if sent or hooks is None else " (kept for a client that registers on that GPU)")
        return [outcome]


class AtRiskNotifier:
    """The owner of :class:`NotifyAtRisk`: tells the hooks on the GPU (``gpu_at_risk``) and the
    operators.  A GPU at risk with no hook client on it has no rank linkpass can move: the
    warning gives the remedy (drain the node at a quiet moment, then reset or replace the GPU).

    Args:
        hooks: the hook server, None when hooks are off.
    """

    def __init__(self, hooks: HookNotifier | None):
        self.hooks = hooks
        self.sent = 0
        self.unmoved = 0

    def __call__(self, a: NotifyAtRisk) -> None:
        n = self.hooks.publish_at_risk(a.verdict, a.gpu, a.t_ns) if self.hooks is not None else 0
        self.sent += n
        what = a.verdict.get("summary") or a.verdict.get("rule")
        if n:
            log.warning("GPU %d AT RISK (%s): told %d hook client(s) to move their rank to a spare at the next step "
                        "boundary", a.gpu, what, n)
        else:
            self.unmoved += 1
            log.warning("GPU %d AT RISK (%s): no protected training process on it to move; remedy: drain the node "
                        "(let its jobs finish or move them) before the GPU fails, then reset or replace the GPU", a.gpu, what)


def _tee(post: Callable[[Event], None], risk) -> Callable[[Event], None]:
    """``post`` that also hands each :class:`DeviceIncident` to the counter source."""
    def both(ev: Event) -> None:
        post(ev)
        if isinstance(ev, DeviceIncident):
            try:
                risk.on_incident(ev)
            except Exception:
                log.exception("counters: incident not counted")
    return both


def route_settings(cfg) -> RouteSettings:
    """What the route actuator owns, from the ``[daemon]`` table."""
    d = cfg.daemon
    return RouteSettings(d.route_protocol, d.route_table, d.nexthop_objects, d.nexthop_id_base)



def _rail_ids(cfg: Config) -> dict[str, int]:
    """netdev -> rail id of the configured rails."""
    return {r.netdev: r.id for r in cfg.rails}

class Daemon:
    """One linkpass daemon for the current network namespace.

    Args:
        config_path: path of the TOML config (re-read on SIGHUP).
        cfg: the already validated config.
    """

    def __init__(self, config_path: str, cfg: Config):
        self.config_path = config_path
        self.source_cfg = cfg
        self.autoconf_notes: list[str] = []
        self.autoconf_warnings: list[str] = []
        self.nccl_topology = None  # the analysed topology discovery gave (auto mode), for the NCCL env file
        if cfg.auto:
            cfg = self._resolve(cfg)
        self.cfg = cfg
        self.nccl_file = NcclEnvFile(cfg, self.nccl_topology)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine = Engine(policy_from_config(cfg), self.nccl_file.context)
        self.key = notice_key(cfg, config_path)  # the same check as `linkpass config check`
        if self.key is None:
            log.warning("no notice_key_file configured: peer notices are disabled")
        # the probe filter also reads the link events and peer notices on their way to the engine:
        # a probe lost while netlink or the peer says the rail is down is not loss (probe_filter.py)
        self.probe_filter = ProbeFilter(probe_policy(cfg.probe), self.queue.put_nowait, _rail_ids(cfg))
        self.monitor = NetlinkMonitor(self._post_observed, self._route_filter, cfg.daemon.netlink_rcvbuf_bytes)
        self.routes = RouteActuator(self.queue.put_nowait, route_settings(cfg))
        self.notices = NoticeService(cfg, self.key, self._post_observed) if self.key else None
        try:
            self.prober = Prober(cfg, self.key, self.probe_filter) if (self.key and cfg.probe.enabled) else None
        except RuntimeError as e:  # datapath "c" without the C module (linkpass config check says so too)
            raise StartError(f"{config_path}: probe.datapath: {datapath_problem(cfg) or e}") from None
        if cfg.probe.enabled and not self.key:
            log.warning("probing needs notice_key_file (probes are authenticated with it): probes are disabled")
        # torch hooks (torch_hooks.client): registrations in, a notice per plan generation out
        self.hooks = HookServer(cfg.hooks.socket or default_socket_path(cfg.daemon.control_socket), cfg.daemon.host,
                                [p.name for p in cfg.peers], self._hook_peers_changed,
                                cfg.hooks.max_clients, on_report=self._hook_report) if cfg.hooks.enabled else None
        self.device_faults = DeviceFaultNotifier(self.hooks, self.queue.put_nowait)
        self.at_risk = AtRiskNotifier(self.hooks)
        self.risk_gpus: set[int] = set()  # GPUs whose counters the counter poller reads
        self.device_sources: dict = {}  # name -> running live device source (kmsg, nvml, rdma)
        # the readers of PublishHistory: callables taking the entries (oldest first), in this order
        self.history_readers: list[Callable] = []
        # MQTT alerts (linkpass.adapters.mqtt): events through a durable outbox, retained state/topology/status
        self.mqtt = self._make_mqtt(cfg) if cfg.mqtt.enabled else None
        if self.mqtt:
            self.history_readers.append(self.mqtt.on_entries)
        # set once the first link dump and route reconciliation are done (systemd READY=1)
        self.ready = asyncio.Event()
        self.sd = ServiceNotifier(SdNotifier.from_env())  # no-op when not started by systemd
        self.history_readers.append(self._systemd_status)
        self.metrics = (DaemonMetrics(lambda now: self.snapshot(now, engine=False), [r.id for r in cfg.rails])
                        if cfg.metrics.enabled else None)
        if self.metrics:
            self.history_readers.append(self.metrics.on_events)
        self.routes_skipped = 0
        self._timer: asyncio.TimerHandle | None = None
        self._stop = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self.started_ns = time.monotonic_ns()
        self.events_handled = 0
        self.tasks: dict[str, asyncio.Task] = {}
        self._tuned: set[str] = set()
        self.reload_error: str | None = None
        self.scheduling: dict | None = None  # sched.apply's answer, from run() on
        self.control_bad_requests = 0  # control requests answered with {"error": ...}
        self._drain_asked: dict[int, bool] = {}  # rail -> the operator's last drain (True) / undrain request
        self.dispatch_errors: Counter[str] = Counter()  # action type name -> handler failures
        self.handlers = self._handlers()
        self._bad_request_warn = _Throttle(BAD_REQUEST_WARN_INTERVAL_NS)

    def _resolve(self, cfg: Config) -> Config:
        """``[topology] rails = "auto"``: discover this host and derive rails and peers.

        Raises:
            ConfigError: no usable rail was found, or the peers file cannot be read.
        """
        from linkpass.discovery import resolve_live

        live = resolve_live(cfg, self.config_path)  # the same as `linkpass config check`
        res = live.resolved
        self.nccl_topology = live.topology
        self.autoconf_notes = res.notes
        self.autoconf_warnings = live.warnings
        for n in res.notes:
            log.info("topology: %s", n)
        for w in self.autoconf_warnings:
            log.warning("topology: %s", w)
        return res.config

    def _make_mqtt(self, cfg: Config):
        """The MQTT publisher (not connected yet; :meth:`run` starts it).  Problems with the
        broker or its files are the publisher's to log; they never stop the daemon."""
        from linkpass.adapters.mqtt import MqttPublisher, compact_state, topology_of

        try:
            pub = MqttPublisher(cfg.mqtt, cfg.daemon.host, {r.id: r.netdev for r in cfg.rails},
                                state_fn=lambda: compact_state(self.engine.status(time.monotonic_ns())),
                                topology_fn=lambda: topology_of(self.cfg))
        except Exception:  # a bug: the network job goes on without alerts
            log.exception("mqtt: cannot set up the publisher; running without MQTT alerts")
            return None
        return pub  # rebuild / migration reports of the torch hooks reach it as PublishHookReport actions

    def _route_filter(self, dst: str, proto: int) -> bool:
        return proto == self.cfg.daemon.route_protocol or dst in self.engine.destinations

    # ------------------------------------------------------------------ actions

    def _handlers(self) -> dict:
        """The dispatch table: action type -> the handler of the adapter that owns it.  A handler
        returns None or events to feed back to the engine at once (see :meth:`_dispatch`)."""
        table = {
            ApplyRoutes: self._apply_routes,
            SendNotice: self.notices.submit if self.notices else None,
            SetTimer: lambda a: self._set_timer(a.at_ns),
            RefreshNeighbors: self._refresh_neighbors,
            WriteNcclEnv: self.nccl_file.write,
            NotifyHooks: self._notify_hooks if self.hooks else None,
            SetProbePriority: (lambda a: self.prober.set_priority_peers(list(a.peers))) if self.prober else None,
            NotifyDeviceFault: self.device_faults,
            NotifyAtRisk: self.at_risk,
            PublishHookReport: (lambda a: self.mqtt.on_hook_report(a.report)) if self.mqtt else None,
            PublishHistory: self._publish_history,
        }
        return {k: v for k, v in table.items() if v is not None}  # an adapter that is off takes nothing

    def _dispatch(self, actions) -> None:
        """Hand each action to its handler (:attr:`handlers`).  A handler that raises is logged
        and counted in ``dispatch_errors`` (per action type); the next action still runs.  The
        events a handler answers with go through the engine now (same loop turn)."""
        for a in actions:
            h = self.handlers.get(type(a))
            if h is None:
                continue
            try:
                follow = h(a)
            except Exception:
                name = type(a).__name__
                self.dispatch_errors[name] += 1
                log.exception("handler for %s failed (%d so far); the daemon goes on", name, self.dispatch_errors[name])
                continue
            for ev in follow or ():
                self._step(ev)

    def _step(self, ev) -> None:
        """One event through the engine, its actions dispatched (a failing engine drops the event)."""
        try:
            actions = self.engine.handle(ev, time.monotonic_ns())
        except Exception:
            log.exception("engine failed on %r; event dropped", type(ev).__name__)
            return
        self._dispatch(actions)

    def _post_observed(self, ev) -> None:
        """Post a link or notice event to the engine, letting the probe filter see it first."""
        self.probe_filter.observe(ev)
        self.queue.put_nowait(ev)

    def _apply_routes(self, a: ApplyRoutes) -> None:
        if self.cfg.daemon.reroute == "kernel":
            self.routes.submit(a, now=True)
        else:  # notify-only: planned and recorded, never put in the kernel
            self.routes_skipped += 1
            log.debug("reroute = notify-only: routes of generation %d not applied (%s)", a.generation, a.reason)
            self.queue.put_nowait(RoutesApplied(a.generation, time.monotonic_ns()))

    def _refresh_neighbors(self, a: RefreshNeighbors) -> None:
        asyncio.get_running_loop().create_task(self.routes.refresh_neighbors(a.netdev))

    def _notify_hooks(self, a: NotifyHooks) -> None:
        if a.plan.generation > self.hooks.generation:
            self.hooks.publish(a.plan)

    def _hook_report(self, rec: dict) -> None:
        """A torch hook's report (the hook server kept it): an event for the engine."""
        self.queue.put_nowait(HookReport(rec, time.monotonic_ns()))

    def _hook_peers_changed(self, names) -> None:
        """The hook server's peers of registered jobs changed: an event for the engine."""
        self.queue.put_nowait(HookPeersChanged(tuple(names), time.monotonic_ns()))

    def _publish_history(self, a: PublishHistory) -> None:
        """Hand the entries of one :class:`PublishHistory` (oldest first) to every history
        reader (MQTT alerts, the systemd STATUS= line, metrics).  A failing reader is logged;
        the others still get them, and the engine goes on."""
        for reader in self.history_readers:
            try:
                reader(a.entries)
            except Exception:
                log.exception("history reader %r failed; %d entries not passed to it", reader, len(a.entries))

    def _systemd_status(self, entries) -> None:
        """History changed the picture: a new STATUS= line when systemd listens (after READY=1)."""
        if self.sd.wants_updates:
            self.sd.update(self.snapshot(probes=False, engine=False))

    def _on_ready(self) -> None:
        """The first link dump and route reconciliation are done: tell systemd (READY=1)."""
        self.ready.set()
        self.sd.ready(self.snapshot(probes=False, engine=False))
        log.info("ready: first link dump and route reconciliation done (plan generation %d)", self.engine.applied_generation)

    # ------------------------------------------------------------------ live device sources

    def _gpu_index(self, bus: str) -> int | None:
        return gpu_index(bus, self.device_sources.get("nvml"), self.nccl_topology, self.cfg.device.gpus)

    def _start_device_sources(self) -> None:
        """Start the live device sources the config asks for and this host has (DESIGN.md:
        adapters kmsg/nvml/rdma); one that cannot run here is off, logged by the source."""
        d = self.cfg.device
        post = self.queue.put_nowait
        if d.nvml:
            from linkpass.adapters.nvml_events import NvmlXidSource
            nv = NvmlXidSource(post)
            if nv.open():
                self.device_sources["nvml"] = nv
        if d.kmsg:
            k = KmsgFollower(d.kmsg_path, post, d.state_dir, self.cfg.daemon.host, d.window_lines,
                             self.nccl_topology, self._gpu_index)
            if k.open():
                self.device_sources["kmsg"] = k
        if d.rdma:
            from linkpass.adapters.rdma_events import RdmaPortEvents
            topo = self.nccl_topology
            compute = None
            if topo is not None and getattr(topo, "nics", None):
                compute = [n.name for n in topo.nics if getattr(n, "role", None) == "compute"]
            r = RdmaPortEvents(post, compute_hcas=compute)
            if r.open():
                self.device_sources["rdma"] = r
        try:
            from linkpass.adapters import risk_source

            rs = risk_source.build(self.cfg, post, self.nccl_topology)
        except Exception:  # a bug: the daemon runs on without counter trends
            log.exception("counters: cannot set up the counter poller; running without at-risk verdicts")
            rs = None
        if rs is not None and rs.open():
            self.device_sources["counters"] = rs
            self.risk_gpus = set(rs.gpus)
            k = self.device_sources.get("kmsg")
            if k is not None:  # corrected-AER records count toward a GPU's (or NIC's) risk
                k.post = _tee(k.post, rs)
        for name, src in self.device_sources.items():
            self._supervise(f"device-{name}", src.run())

    def _set_timer(self, at_ns: int) -> None:
        if self._timer:
            self._timer.cancel()
        delay = max(0.0, (at_ns - time.monotonic_ns()) / 1e9)
        self._timer = asyncio.get_running_loop().call_later(delay, lambda: self.queue.put_nowait(Tick(time.monotonic_ns())))

    async def _engine_loop(self) -> None:
        while True:
            ev = await self.queue.get()
            try:
                actions = self.engine.handle(ev, time.monotonic_ns())
            except Exception:
                log.exception("engine failed on %r; event dropped", type(ev).__name__)
                continue
            self.events_handled += 1
            self._dispatch(actions)
            if not self.ready.is_set() and self.engine.applied_generation >= 1:
                self._on_ready()
            if isinstance(ev, LinkChanged) and ev.facts.present and ev.facts.netdev not in self._tuned:
                if any(r.netdev == ev.facts.netdev for r in self.cfg.rails):
                    self._tune_rails(ev.facts.netdev)
                    self._tuned.add(ev.facts.netdev)

    # ------------------------------------------------------------------ control socket

    def snapshot(self, now_ns: int | None = None, *, probes: bool = True, engine: bool = True) -> DaemonSnapshot:
        """The daemon's state now, frozen (:class:`~linkpass.core.status.DaemonSnapshot`): what
        metrics, the systemd STATUS= line and ``status`` render.  Call on the event loop.

        Args:
            now_ns: monotonic ns it is taken at (damping penalties decay to it); None: now.
            probes: include the prober's paths and the rails' probe RTT (O(paths)).
            engine: include the engine's JSON picture, the hook server's and MQTT publisher's
                JSON and the device sources' (what :func:`status_json` needs).
        """
        now = time.monotonic_ns() if now_ns is None else now_ns
        eng, cfg = self.engine, self.cfg
        prober = self.prober if probes else None
        path_stats = dict(prober.path_stats) if prober is not None else {}
        rails = []
        for r in cfg.rails:
            h = eng.rails[r.id]
            dm = eng.dampers.get(r.id)
            rtts = [st.ewma_rtt_ns for (rail, _), st in path_stats.items() if rail == r.id and st.ewma_rtt_ns is not None]
            rails.append(RailSnapshot(
                id=r.id, netdev=r.netdev, state=h.state.value, usable=h.usable, degraded=r.id in eng.degraded,
                at_risk=("rail", r.id) in eng.at_risk,
                suppressed=None if dm is None else dm.suppressed(now), damping_penalty=None if dm is None else dm.penalty_at(now),
                probe_loss=eng.rail_loss(r.id), probe_rtt_s=statistics.median(rtts) / 1e9 if rtts else None))
        prober_snap = None
        if prober is not None:
            sched = prober.schedule
            prober_snap = ProberSnapshot(
                paths=tuple(PathSnapshot(rail, peer, None if st.ewma_rtt_ns is None else st.ewma_rtt_ns / 1e9, st.loss,
                                         st.replies, st.lost)
                            for (rail, peer), st in sorted(path_stats.items()) if sched.is_fast(rail, peer)),
                counters=dict(prober.counters))
        hooks_snap = None
        if self.hooks is not None:
            clients = list(self.hooks.clients.values())
            hooks_snap = HooksSnapshot(clients=len(clients), registered=sum(1 for c in clients if getattr(c, "reg", None) is not None),
                                       connections=self.hooks.counters.get("connections", 0),
                                       refused=self.hooks.counters.get("refused", 0),
                                       status=self.hooks.status() if engine else None)
        mqtt_snap = None
        if self.mqtt is not None:
            connected = getattr(self.mqtt, "connected", None)
            mqtt_snap = MqttSnapshot(depth=_call_number(getattr(self.mqtt, "depth", None)),
                                     dropped_total=_number(getattr(self.mqtt, "dropped_total", None)),
                                     connected=connected if isinstance(connected, bool) else None,
                                     status=self.mqtt.status() if engine else None)
        addr = self.metrics.address if self.metrics else None
        counters = {
            "events_handled": self.events_handled,
            "routes_skipped_notify_only": self.routes_skipped,
            "netlink_resyncs": self.monitor.resyncs,
            "netlink_overruns": self.monitor.overruns,
            "netlink_bad_messages": self.monitor.bad_messages,
            "route_ops": self.routes.ops_total,
            "route_errors": self.routes.errors_total,
            "route_plans_applied_in_turn": self.routes.early_total,
            **({f"notices_{k}": v for k, v in self.notices.counters.items()} if self.notices else {}),
            **({f"probes_{k}": v for k, v in self.prober.counters.items()} if self.prober else {}),
            "probe_results_forwarded": self.probe_filter.forwarded,
            "probe_results_absorbed": self.probe_filter.absorbed,
            "probe_misses_explained": self.probe_filter.explained,
            "control_bad_requests": self.control_bad_requests,
            "dispatch_errors": sum(self.dispatch_errors.values()),
        }
        auto = self.source_cfg.auto
        return DaemonSnapshot(
            t_ns=now, pid=os.getpid(), uptime_s=round((now - self.started_ns) / 1e9, 3),
            host=cfg.daemon.host, mode=cfg.daemon.mode, reroute=cfg.daemon.reroute, version=__version__,
            ready=self.ready.is_set(), generation=eng.generation, applied_generation=eng.applied_generation,
            rails=tuple(rails), peers_configured=len(cfg.peers),
            peers_heard=sum(1 for p in cfg.peers if p.name in eng.peer_usable),
            route_errors=len(eng.apply_errors), reload_error=self.reload_error,
            counters=counters, dispatch_errors=dict(sorted(self.dispatch_errors.items())),
            prober=prober_snap, hooks=hooks_snap, mqtt=mqtt_snap,
            systemd=SystemdSnapshot(self.sd.notifier.enabled, self.ready.is_set(), self.sd.notifier.watchdog_interval_s,
                                    self.sd.watchdogs_sent),
            metrics_enabled=self.metrics is not None,
            metrics_listening=None if addr is None else f"{addr[0]}:{addr[1]}",
            topology={"rails": "auto", "sysfs_root": self.source_cfg.topology.sysfs_root, "notes": list(self.autoconf_notes)}
            if auto else None,
            topology_warnings=tuple(self.autoconf_warnings) if auto else (),
            engine=eng.status(now) if engine else None,
            device_sources={name: src.status() for name, src in self.device_sources.items()} if engine else None,
            snapshots=eng.snapshots.view() if self.hooks is not None else None,
            gpu_at_risk={**{g: False for g in self.risk_gpus}, **{k[1]: True for k in eng.at_risk if k[0] == "gpu"}},
            scheduling=self.scheduling,
        )

    def status(self) -> dict:
        """The control socket's ``status`` answer: :func:`~linkpass.core.status.status_json`
        of a full :meth:`snapshot`."""
        return status_json(self.snapshot())

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one control request with one JSON line, then close.

        Every request gets a reply: a bad one (not UTF-8, not a JSON object, nested too deeply,
        a line over :data:`MAX_REQUEST_BYTES`, no line within :data:`CONTROL_TIMEOUT_S`, an
        unknown ``cmd``) gets ``{"error": "<why>"}``, is counted (``control_bad_requests``) and
        logs at most one warning line per 10 s (:data:`BAD_REQUEST_WARN_INTERVAL_NS`), never a
        traceback.  A client that takes no reply within ``CONTROL_TIMEOUT_S`` is dropped.
        """
        req: dict | None = None
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), CONTROL_TIMEOUT_S)
            except asyncio.TimeoutError:
                req, why = None, f"no request line within {CONTROL_TIMEOUT_S:g} s"
            except ValueError:  # asyncio's LimitOverrunError: no newline within the stream's limit
                req, why = None, f"request line over {MAX_REQUEST_BYTES} bytes"
            else:
                req, why = parse_request(line)
            cmd = req.get("cmd", "status") if req is not None else None
            if why is not None:
                resp = {"error": why}
            elif cmd == "status":
                resp = self.status()
            elif cmd == "history":
                resp = {"schema": "linkpass.history/v1", "history": [h.to_json() for h in self.engine.history]}
            elif cmd in ("drain", "undrain"):
                resp = self._drain_request(req, cmd == "drain")
                why = resp.get("error")
            else:
                why = "unknown request"
                resp = {"error": "unknown request; send {\"cmd\": \"status\"}, {\"cmd\": \"history\"} or "
                                 "{\"cmd\": \"drain\" (or \"undrain\"), \"rail\": ID}"}
            if why is not None:
                self._bad_request(why)
            writer.write(json.dumps(resp).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), CONTROL_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except Exception:  # our bug answering a valid request, not the client's input
            log.exception("control socket: answering %r failed", req)
            try:
                writer.write(b'{"error": "internal error; see the daemon log"}\n')
            except Exception:
                pass
        finally:
            writer.close()

    def _drain_request(self, req: dict, drain: bool) -> dict:
        """``{"cmd": "drain" | "undrain", "rail": ID}``: an operator takes a configured rail out of
        use (DRAINED: routes and notices leave it) or gives it back (through hold-down).  Posted
        as a :class:`Drain` event; the reply says it was accepted, ``linkpass status`` shows the
        result.  ``was_drained``: whether the rail was drained (or its drain was asked for and not
        yet handled) when the request came, so ``linkpass undrain`` can say a rail was not
        drained.  A refusal is ``{"error", "bad_input": true}`` (a rail id the config lacks)."""
        from linkpass.core.health import RailState

        cmd = "drain" if drain else "undrain"
        rail = req.get("rail")
        ids = sorted(r.id for r in self.cfg.rails)
        if isinstance(rail, bool) or not isinstance(rail, int):
            return {"error": f"{cmd}: \"rail\" must be a rail id (one of {ids}), got {type(rail).__name__}",
                    "bad_input": True}
        if rail not in ids:
            return {"error": f"{cmd}: no rail {rail} in this daemon's config (rails: {ids})", "bad_input": True}
        h = self.engine.rails.get(rail)
        # the last request decides where the rail ends up, even while its event is still queued
        was = self._drain_asked.get(rail, h is not None and h.state == RailState.DRAINED)
        self._drain_asked[rail] = drain
        self.queue.put_nowait(Drain(rail, drain, time.monotonic_ns()))
        log.warning("control socket: operator %s rail %d", "drains" if drain else "undrains", rail)
        return {"ok": True, "cmd": cmd, "rail": rail, "was_drained": was}

    def _bad_request(self, why: str) -> None:
        """Count a bad control request; one warning line, rate limited (see :class:`_Throttle`)."""
        self.control_bad_requests += 1
        allowed, before = self._bad_request_warn.allow()
        if allowed:
            more = f" ({before} more since the last warning)" if before else ""
            log.warning("control socket: bad request answered with an error: %s%s", why, more)

    def _check_control_path(self) -> Path:
        """Make sure we may use the control socket path; remove a stale socket of ours.

        Raises:
            StartError: the path is not a socket, a live daemon answers there, or its
                directory does not exist (only /run/linkpass is created on demand).
        """
        path = Path(self.cfg.daemon.control_socket)
        if not path.parent.is_dir():
            if path.parent == RUNTIME_DIR or RUNTIME_DIR in path.parent.parents:
                path.parent.mkdir(parents=True, exist_ok=True)
            else:
                raise StartError(f"control_socket {path}: directory {path.parent} does not exist")
        if path.is_symlink() or (path.exists() and not path.is_socket()):
            raise StartError(f"control_socket {path}: exists and is not a socket; refusing to replace it")
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # stale: its daemon is gone
            except OSError as e:
                raise StartError(f"control_socket {path}: cannot check it: {e.strerror or e}") from None
            else:
                raise StartError(f"control_socket {path}: another linkpass daemon is running there (stop it first)")
            finally:
                probe.close()
        return path

    async def _start_control(self, path: Path) -> None:
        try:
            self._server = await asyncio.start_unix_server(self._client, path=str(path), backlog=CONTROL_BACKLOG,
                                                           limit=MAX_REQUEST_BYTES)
            os.chmod(path, 0o660)
        except OSError as e:
            raise StartError(f"control_socket {path}: cannot listen: {e.strerror or e}") from None

    def _tune_rails(self, only: str | None = None) -> None:
        """Set ignore_routes_with_linkdown on the rail netdevs (all, or just ``only``, a rail
        netdev that has just appeared)."""
        if not self.cfg.daemon.ignore_routes_with_linkdown:
            return
        devs = [r.netdev for r in self.cfg.rails if only is None or r.netdev == only]
        missing = self.routes.ignore_linkdown(devs)
        if missing and only is None:
            log.warning("could not set ignore_routes_with_linkdown on %s (netdev absent?); will retry when it appears", ", ".join(missing))

    # ------------------------------------------------------------------ signals

    def _on_sighup(self) -> None:
        """SIGHUP: reload, bracketed by RELOADING=1 and READY=1 for systemd (ExecReload)."""
        self.sd.reloading()
        try:
            self._reload()
        finally:
            self.sd.reloaded(self.snapshot(probes=False, engine=False))

    def _reload(self) -> None:
        """Re-read the config file and apply it.

        A config that cannot be used (any :class:`ConfigError`: unreadable, not TOML, nested too
        deeply, invalid; or an unexpected error while reading or resolving it) changes nothing:
        the running config is kept, ``reload_error`` says why (``linkpass status`` shows it among
        the warnings) and one ERROR line is logged.  A good reload clears ``reload_error``.
        """
        saved = (self.nccl_topology, self.autoconf_notes, self.autoconf_warnings)  # _resolve sets them
        try:
            source_cfg = cfg = load_config(self.config_path)
            if cfg.auto:
                cfg = self._resolve(cfg)
            key = notice_key(cfg, self.config_path)
        except Exception as e:
            self.nccl_topology, self.autoconf_notes, self.autoconf_warnings = saved
            why = str(e) if isinstance(e, ConfigError) else f"{self.config_path}: {type(e).__name__}: {e}"
            why = " ".join(why.split())  # one line
            log.error("reload refused, keeping the running config: %s", why)
            if not isinstance(e, ConfigError):
                log.debug("reload failure", exc_info=True)
            self.reload_error = f"last reload refused, running config kept: {why}"
            return
        self.source_cfg = source_cfg
        self.reload_error = None
        if cfg.daemon.host != self.cfg.daemon.host:
            log.warning("host renamed %s -> %s: peers know this host by name, update their configs too", self.cfg.daemon.host, cfg.daemon.host)
        if cfg.daemon.control_socket != self.cfg.daemon.control_socket or cfg.daemon.notice_port != self.cfg.daemon.notice_port:
            log.warning("control_socket and notice_port changes take effect only after a restart")
        if cfg.metrics != self.cfg.metrics:
            log.warning("[metrics] changes take effect only after a restart")
        if cfg.mqtt != self.cfg.mqtt:
            log.warning("[mqtt] changes take effect only after a restart")
        if self.mqtt:
            self.mqtt.mapper.reconfigure({r.id: r.netdev for r in cfg.rails})
            self.mqtt.topology_changed()
        new_hooks = (cfg.hooks.socket or default_socket_path(cfg.daemon.control_socket)) if cfg.hooks.enabled else None
        old_hooks = self.hooks.path if self.hooks else None
        if new_hooks != old_hooks:
            log.warning("[hooks] socket is now %s (was %s); the new hooks socket takes effect only after a restart, "
                        "until then hooks keep connecting to %s", new_hooks or "off", old_hooks or "off", old_hooks or "nothing")
        self.cfg = cfg
        if self.scheduling is not None:  # run() set it (a Daemon driven in-process by a test never does)
            self._schedule(cfg.daemon.realtime_priority)
        self.routes.reconfigure(route_settings(cfg))
        if self.notices and key:
            self.notices.reconfigure(cfg, key)
        if self.prober and key:
            self.prober.reconfigure(cfg, key)
        self.probe_filter.reconfigure(probe_policy(cfg.probe), _rail_ids(cfg))
        if self.hooks:
            self.hooks.reconfigure(cfg.daemon.host, [p.name for p in cfg.peers])
        logging.getLogger("linkpass").setLevel(cfg.daemon.log_level.upper())
        self._tune_rails()
        log.info("config reloaded from %s", self.config_path)
        self.nccl_file.reconfigure(cfg, self.nccl_topology if self.source_cfg.auto else None)
        now = time.monotonic_ns()
        self._step(ConfigReloaded(policy_from_config(cfg), self.nccl_file.context, now))

    # ------------------------------------------------------------------ run

    def _supervise(self, name: str, coro) -> None:
        task = asyncio.create_task(coro, name=name)

        def done(t: asyncio.Task) -> None:
            if t.cancelled() or self._stop.is_set():
                return
            exc = t.exception()
            log.error("task %s died (%s); stopping so the service manager restarts us", name, exc)
            self._stop.set()

        task.add_done_callback(done)
        self.tasks[name] = task

    def _schedule(self, priority: int) -> None:
        """Run the daemon's threads at ``[daemon] realtime_priority`` (linkpass/adapters/sched.py)."""
        if self.scheduling is not None and self.scheduling["asked"] == priority:
            return
        self.scheduling = sched.apply(priority)
        if self.scheduling["error"]:
            log.warning("%s", self.scheduling["error"])
        else:
            log.info("CPU scheduling: %s priority %d", self.scheduling["policy"], self.scheduling["priority"])

    async def run(self) -> int:
        self._schedule(self.cfg.daemon.realtime_priority)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        path = self._check_control_path()
        if self.notices:
            try:
                await self.notices.start()
            except OSError as e:
                raise StartError(f"notice_port {self.cfg.daemon.notice_port}: cannot listen: {e.strerror or e}"
                                 " (another linkpass daemon in this network namespace?)") from None
        if self.prober:
            try:
                await self.prober.start()
            except OSError as e:
                raise StartError(f"probe.port {self.cfg.probe.port}: cannot listen: {e.strerror or e}"
                                 " (another linkpass daemon in this network namespace?)") from None
        await self._start_control(path)
        if self.hooks:
            try:
                await self.hooks.start()
            except OSError as e:
                raise StartError(f"hooks socket {self.hooks.path}: cannot listen: {e.strerror or e}") from None
        if self.metrics:
            m = self.cfg.metrics
            try:
                self.metrics.start(m.address, m.port, loop)
            except MetricsError as e:  # the network job matters more: run on without metrics
                log.error("%s; running without metrics", e)
        self.sd.starting()
        if self.sd.notifier.watchdog_interval_s:
            self._supervise("systemd-watchdog", self.sd.watchdog_loop())
        self._tune_rails()
        if self.notices:
            self._supervise("notice-refresh", self.notices.refresh_loop())
        if self.prober:
            self._supervise("prober", self.prober.run())
        self._supervise("engine", self._engine_loop())
        self._supervise("routes", self.routes.run())
        self._supervise("netlink", self.monitor.run())
        self._start_device_sources()
        if self.mqtt:  # never raises and never ends on its own: MQTT trouble must not stop the daemon
            self.tasks["mqtt"] = self.mqtt.start()
        # Everything built so far lives as long as the daemon: move it out of the collector's
        # reach, so full collections stay short (they caused 20-35 ms pauses before; bench/).
        gc.collect()
        gc.freeze()
        log.info("linkpass daemon for host %s started (pid %d, %d rails, %d peers, control socket %s)",
                 self.cfg.daemon.host, os.getpid(), len(self.cfg.rails), len(self.cfg.peers), self.cfg.daemon.control_socket)
        await self._stop.wait()
        self.sd.stopping()
        log.info("stopping; routes are left in place")
        if self.mqtt:  # "offline" (retained) and a clean disconnect while the loop still runs; bounded
            await self.mqtt.close()
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        try:
            await asyncio.wait_for(self.routes.close(), 2.0)
        except (asyncio.TimeoutError, OSError) as e:
            log.warning("route actuator clean-up at stop: %s", e or "timed out")
        if self.notices:
            self.notices.close()
        if self.prober:
            await self.prober.close()
        if self._server:
            self._server.close()
        if self.hooks:
            await self.hooks.close()
        if self.metrics:
            self.metrics.stop()
        try:
            Path(self.cfg.daemon.control_socket).unlink()
        except OSError:
            pass
        return 0


def _number(v) -> float | None:
    """``v`` when it is a number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def _call_number(f: Callable | None) -> float | None:
    """``f()`` when it answers a number; None when it is not callable, fails or answers
    something else (another adapter's bug must not break a snapshot)."""
    if not callable(f):
        return None
    try:
        return _number(f())
    except Exception as e:
        log.warning("snapshot: mqtt.depth() failed: %s", e)
        return None


def setup_logging(level: str) -> None:
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s", level=level.upper())


def run(config_path: str, log_level: str | None = None) -> int:
    """Load the config and run the daemon until SIGTERM.  Returns the exit code.

    Raises:
        ConfigError: the config or the notice key file is invalid (the CLI prints it).
        StartError: the control socket or notice port is in use, or a path is unusable.
    """
    cfg = load_config(config_path)
    setup_logging(log_level or cfg.daemon.log_level)
    daemon = Daemon(config_path, cfg)
    return asyncio.run(daemon.run())


async def query(socket_path: str, cmd: str = "status", timeout: float = 5.0, **fields) -> dict:
    """Ask a running daemon over its control socket (``fields``: more request members, such as
    ``rail`` for ``drain``).

    Raises:
        OSError: no daemon listens there.
        asyncio.TimeoutError: it did not answer in ``timeout`` seconds.
    """
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path, limit=QUERY_LIMIT), timeout)
    try:
        writer.write(json.dumps({"cmd": cmd, **fields}).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return json.loads(line)
    finally:
        writer.close()
