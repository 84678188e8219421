"""In-memory stand-ins for the adapters the daemon drives (the Protocols of
:mod:`linkpass.adapters.ports`), shipped beside them for tests, as pyroute2 ships ``ipmock``.

Each fake records what it was asked (``calls`` or a named list) and answers like the real
adapter would in the simplest case; a test sets the answer it needs.  No I/O, no clock, no
event loop needed (except :meth:`FakeRouteWriter.refresh_neighbors`, a coroutine like the
real one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from linkpass.core.model import ApplyRoutes, HistoryEntry, HookPlan, SendNotice, WriteNcclEnv


class FakeRouteWriter:
    """:class:`~linkpass.adapters.ports.RouteWriter`: keeps the submitted plans.

    ``fail``: an exception :meth:`submit` raises (a broken adapter), None for none.
    """

    def __init__(self) -> None:
        self.submitted: list[ApplyRoutes] = []
        self.refreshed: list[str] = []
        self.ops_total = 0
        self.errors_total = 0
        self.early_total = 0
        self.fail: BaseException | None = None

    async def close(self) -> None:
        self.closed = True

    def submit(self, plan: ApplyRoutes, now: bool = False) -> None:
        if self.fail is not None:
            raise self.fail
        self.submitted.append(plan)

    async def refresh_neighbors(self, netdev: str) -> int:
        self.refreshed.append(netdev)
        return 0


class FakeNoticeSender:
    """:class:`~linkpass.adapters.ports.NoticeSender`: keeps the notices asked for."""

    def __init__(self) -> None:
        self.sent: list[SendNotice] = []
        self.counters: Counter[str] = Counter()

    def submit(self, state: SendNotice) -> None:
        self.sent.append(state)
        self.counters["sent"] += 1


class FakeHookNotifier:
    """:class:`~linkpass.adapters.ports.HookNotifier`: the torch hooks of a host, in memory.

    Attributes:
        plans: every plan published, oldest first.
        faults: ``(incident, gpu, t_ns)`` of every device fault published.
        clients_on_gpu: GPU index -> hook clients registered on it (what
            :meth:`publish_device_fault` answers; 0 for a GPU not in it).
        kept: the ``on_delivered`` callbacks of faults that reached nobody, per GPU; call
            :meth:`register` to deliver them as the real server does when a client comes.
        unattributed: faults published with no GPU index.
        at_risk: ``(verdict, gpu, t_ns)`` of every GPU-at-risk message published.
    """

    def __init__(self, clients_on_gpu: Mapping[int, int] | None = None) -> None:
        self.plans: list[HookPlan] = []
        self.faults: list[tuple[Mapping, int | None, int]] = []
        self.clients_on_gpu: dict[int, int] = dict(clients_on_gpu or {})
        self.kept: dict[int, list[Callable[[int], None] | None]] = {}
        self.unattributed = 0
        self.at_risk: list[tuple[Mapping, int, int]] = []

    @property
    def generation(self) -> int:
        return self.plans[-1].generation if self.plans else 0

    def publish(self, plan: HookPlan) -> None:
        self.plans.append(plan)

    def publish_device_fault(self, incident: Mapping, gpu: int | None, t_ns: int,
                             on_delivered: Callable[[int], None] | None = None) -> int:
        self.faults.append((dict(incident), gpu, t_ns))
        if gpu is None:
            self.unattributed += 1
            return 0
        sent = self.clients_on_gpu.get(gpu, 0)
        if sent == 0:
            self.kept.setdefault(gpu, []).append(on_delivered)
        return sent

    def publish_at_risk(self, verdict: Mapping, gpu: int, t_ns: int) -> int:
        self.at_risk.append((dict(verdict), gpu, t_ns))
        return self.clients_on_gpu.get(gpu, 0)

    def register(self, gpu: int) -> int:
        """A hook client registers on ``gpu``: the faults kept for it are delivered (each kept
        fault's ``on_delivered(1)`` is called).  Returns how many were delivered."""
        self.clients_on_gpu[gpu] = self.clients_on_gpu.get(gpu, 0) + 1
        kept = self.kept.pop(gpu, [])
        for cb in kept:
            if cb is not None:
                cb(1)
        return len(kept)


class FakeProbePriority:
    """:class:`~linkpass.adapters.ports.ProbePriority`: keeps every priority list set."""

    def __init__(self) -> None:
        self.priorities: list[list[str]] = []

    def set_priority_peers(self, peers: list[str]) -> None:
        self.priorities.append(list(peers))


class FakeNcclEnvWriter:
    """:class:`~linkpass.adapters.ports.NcclEnvWriter`: keeps the write requests."""

    def __init__(self) -> None:
        self.written: list[WriteNcclEnv] = []

    def write(self, a: WriteNcclEnv) -> None:
        self.written.append(a)


class FakeHistoryReader:
    """:class:`~linkpass.adapters.ports.HistoryReader`: keeps every entry it is handed, in order."""

    def __init__(self) -> None:
        self.entries: list[HistoryEntry] = []

    def on_events(self, entries: Iterable[HistoryEntry]) -> None:
        self.entries.extend(entries)


class FakePublisher:
    """:class:`~linkpass.adapters.ports.Publisher`: the MQTT publisher without a broker.

    Attributes:
        entries, reports: history entries and hook reports handed to it, oldest first.
        connected, dropped_total, outbox_depth: what the daemon's snapshot reads out.
    """

    def __init__(self, *, connected: bool = True, depth: int = 0, dropped_total: int = 0) -> None:
        self.entries: list[HistoryEntry] = []
        self.reports: list[Mapping] = []
        self.connected = connected
        self.outbox_depth = depth
        self.dropped_total = dropped_total

    def on_entries(self, entries: Iterable[HistoryEntry]) -> None:
        self.entries.extend(entries)

    def on_hook_report(self, rec: Mapping) -> None:
        self.reports.append(rec)

    def depth(self) -> int:
        return self.outbox_depth

    def status(self) -> dict:
        return {"connected": self.connected, "outbox": {"depth": self.outbox_depth, "dropped_total": self.dropped_total}}
