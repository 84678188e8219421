"""The small Protocols the daemon drives its adapters through: each says what one action's
owner (or one state reader) must offer, and no more.

The daemon's dispatch table (:meth:`linkpass.daemon.Daemon._handlers`) hands each action to
the adapter that owns it; these are the shapes it relies on.  The real adapters satisfy them
structurally (no inheritance); :mod:`linkpass.adapters.fakes` ships in-memory stand-ins for
tests, as pyroute2 ships ``ipmock``.  Nothing here does I/O.

=====================  =============================================  ========================
Protocol               real adapter                                    takes
=====================  =============================================  ========================
RouteWriter            adapters.routes.RouteActuator                   ApplyRoutes, RefreshNeighbors
NoticeSender           adapters.notices.NoticeService                  SendNotice
HookNotifier           adapters.hook_server.HookServer                 NotifyHooks, NotifyDeviceFault
ProbePriority          adapters.prober.Prober                          SetProbePriority
NcclEnvWriter          adapters.nccl_file.NcclEnvFile                  WriteNcclEnv
Publisher              adapters.mqtt.MqttPublisher                     PublishHistory, PublishHookReport
HistoryReader          adapters.metrics.DaemonMetrics (on_events)      PublishHistory
=====================  =============================================  ========================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from linkpass.core.model import ApplyRoutes, HistoryEntry, HookPlan, SendNotice, WriteNcclEnv


@runtime_checkable
class RouteWriter(Protocol):
    """Puts a plan's routes in the kernel (asynchronously; it posts ``RoutesApplied``)."""

    ops_total: int  # kernel route operations done since start
    errors_total: int  # of those, the ones that failed
    early_total: int  # plans whose replacements went in at submit time (submit's ``now``)

    def submit(self, plan: ApplyRoutes, now: bool = False) -> None:
        """Queue ``plan``; with ``now`` put its replacements in before returning where the
        writer can (the reroute does not wait for the writer's task turn)."""
        ...

    async def refresh_neighbors(self, netdev: str) -> int: ...

    async def close(self) -> None:
        """At daemon stop: leave the routes in place, drop what of ours nothing uses."""
        ...


@runtime_checkable
class NoticeSender(Protocol):
    """Tells the peers which of our rails are usable (per plan generation)."""

    counters: Mapping[str, int]

    def submit(self, state: SendNotice) -> None: ...


@runtime_checkable
class HookNotifier(Protocol):
    """The torch hooks of this host: plan notices, device faults that move a rank."""

    @property
    def generation(self) -> int:
        """The newest plan generation sent to the hooks (0: none yet)."""
        ...

    def publish(self, plan: HookPlan) -> None: ...

    def publish_device_fault(self, incident: Mapping, gpu: int | None, t_ns: int,
                             on_delivered: Callable[[int], None] | None = None) -> int:
        """Tell the registered clients on GPU ``gpu``; returns how many got it now (0: kept for a
        client that registers on that GPU, and ``on_delivered(n)`` is called when one does)."""
        ...

    def publish_at_risk(self, verdict: Mapping, gpu: int, t_ns: int) -> int:
        """Tell the registered clients on GPU ``gpu`` that it is at risk; returns how many got it."""
        ...


@runtime_checkable
class ProbePriority(Protocol):
    """Probes these peers first (the peers of registered torch-hook jobs)."""

    def set_priority_peers(self, peers: list[str]) -> None: ...


@runtime_checkable
class NcclEnvWriter(Protocol):
    """Writes the NCCL environment file of a plan generation."""

    def write(self, a: WriteNcclEnv) -> None: ...


@runtime_checkable
class HistoryReader(Protocol):
    """Reads the engine's history as it is recorded (:class:`~linkpass.core.model.PublishHistory`)."""

    def on_events(self, entries: Iterable[HistoryEntry]) -> None: ...


@runtime_checkable
class Publisher(Protocol):
    """Alerts for the operators (MQTT): history entries and hook reports in; what the daemon's
    snapshot reads out (outbox depth and drops, connected, its JSON status)."""

    connected: bool

    def on_entries(self, entries: Iterable[HistoryEntry]) -> None: ...

    def on_hook_report(self, rec: Mapping) -> None: ...

    def depth(self) -> int: ...

    @property
    def dropped_total(self) -> int: ...

    def status(self) -> dict: ...
