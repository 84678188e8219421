"""RDMA async port events through pyverbs -> :class:`~linkpass.core.model.DeviceIncident`.

API used (rdma-core's pyverbs, ``pyverbs/device.pyx``; ``Documentation/pyverbs.md``):
``pyverbs.device.get_device_list()`` (devices with ``.name`` as bytes),
``pyverbs.device.Context(name=...)``, ``ctx.query_device().phys_port_cnt``,
``ctx.query_port(p).state`` (``ibv_port_state``: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE) and
``ctx.get_async_event()`` -> ``AsyncEvent`` with ``event_type`` and ``ack()`` (the
``ibv_get_async_event(3)`` / ``ibv_ack_async_event`` pair).  pyverbs' ``AsyncEvent`` does not
expose the event's port number, so after a port event the ports are queried again and the one
whose state changed is named; when that is ambiguous the device is named alone.

``ibv_event_type`` values are libibverbs' ABI (``infiniband/verbs.h``): 8 DEVICE_FATAL,
9 PORT_ACTIVE, 10 PORT_ERR, 11 LID_CHANGE, 12 PKEY_CHANGE, 13 SM_CHANGE, 17 CLIENT_REREGISTER,
18 GID_CHANGE.  Each is read as the text ``ibv_event_type_str`` gives it (what NCCL prints),
through :data:`linkpass.core.classify.ASYNC_EVENTS`, so a live port error and a logged one
are the same incident (``ibv_event:port_err``, ``nic-link``, device ``mlx5_3/1``).  A port
event on an HCA that is not a compute rail (``compute_hcas`` given and not naming it) is benign.

``get_async_event`` blocks without a timeout, so each HCA has its own daemon thread (it cannot
hold up the daemon's exit); events come to the loop with ``call_soon_threadsafe``.  pyverbs not
importable, or no RDMA device (``get_device_list`` raises or is empty): the source is off.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

from linkpass.core.classify import ASYNC_EVENTS
from linkpass.core.model import DeviceIncident

log = logging.getLogger("linkpass.rdma")

#: ibv_event_type -> ibv_event_type_str() text, for the events that concern ports or the device
EVENT_TEXT = {8: "local catastrophic error", 9: "port active", 10: "port error", 11: "lid change", 12: "pkey change",
              13: "sm change", 17: "client reregistration", 18: "gid table change"}
PORT_EVENTS = frozenset({9, 10, 11, 12, 13, 17, 18})
#: ibv_port_state names
PORT_STATE = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


class RdmaPortEvents:
    """Reads async events of every RDMA device and posts incidents.

    Args:
        post: where incidents go (the engine queue's ``put_nowait``; called on the loop).
        device_module: ``pyverbs.device`` (tests pass a fake); None: import it.
        compute_hcas: names of the HCAs that serve compute rails, or None when unknown.

    Attributes:
        hcas: device name -> last known state per port.
        counters: ``events``, ``incidents``, ``ignored``, ``errors``.
    """

    def __init__(self, post: Callable[[DeviceIncident], Any], device_module: Any = None,
                 compute_hcas: Collection[str] | None = None):
        self.post = post
        self.dev = device_module
        self.compute_hcas = None if compute_hcas is None else frozenset(compute_hcas)
        self.hcas: dict[str, dict[int, int]] = {}
        self.counters: Counter[str] = Counter()
        self.active = False
        self._ctx: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def open(self) -> bool:
        """Open every RDMA device; False (one INFO line) when the source cannot run here."""
        d = self.dev
        if d is None:
            try:
                d = self.dev = importlib.import_module("pyverbs.device")
            except ImportError:
                log.info("RDMA async events off: pyverbs is not installed")
                return False
        try:
            devices = list(d.get_device_list())
        except Exception as e:
            log.info("RDMA async events off: no RDMA devices (%s)", e)
            return False
        if not devices:
            log.info("RDMA async events off: no RDMA devices")
            return False
        for dv in devices:
            name = dv.name.decode() if isinstance(dv.name, (bytes, bytearray)) else str(dv.name)
            try:
                ctx = d.Context(name=name)
                self._ctx[name] = ctx
                self.hcas[name] = self._ports(ctx)
            except Exception as e:
                log.warning("RDMA: cannot open %s (%s); its events are not read", name, e)
        if not self._ctx:
            log.info("RDMA async events off: no RDMA device could be opened")
            return False
        self.active = True
        log.info("RDMA async events on for %s", ", ".join(sorted(self._ctx)))
        return True

    @staticmethod
    def _ports(ctx: Any) -> dict[int, int]:
        n = int(ctx.query_device().phys_port_cnt)
        return {p: int(ctx.query_port(p).state) for p in range(1, n + 1)}

    def incident(self, hca: str, event_type: int, now_ns: int) -> DeviceIncident | None:
        """The incident for one event of ``hca`` (None: an event that concerns no port/device)."""
        text = EVENT_TEXT.get(int(event_type))
        if text is None:
            return None
        reading = ASYNC_EVENTS.get(text)
        if reading is None:
            return None
        code, domain, action, remedy = f"ibv_event:{reading[0]}", reading[1], reading[2], reading[3]
        device = hca
        ctx = self._ctx.get(hca)
        if event_type in PORT_EVENTS and ctx is not None:
            old = self.hcas.get(hca, {})
            try:
                new = self._ports(ctx)
            except Exception:
                new = old
            self.hcas[hca] = new
            changed = [p for p in new if new[p] != old.get(p)]
            if len(changed) == 1:
                device = f"{hca}/{changed[0]}"
            elif len(new) == 1:
                device = f"{hca}/{next(iter(new))}"
        if domain == "nic-link" and self.compute_hcas is not None and hca not in self.compute_hcas:
            domain, action, remedy = "benign", "none", "none"  # not a compute rail
        states = ", ".join(f"port {p} {PORT_STATE.get(s, s)}" for p, s in sorted(self.hcas.get(hca, {}).items()))
        return DeviceIncident("rdma", domain, device, code, action, remedy, now_ns,
                              summary=f"{hca}: async event: {text} ({states})")

    def _reader(self, hca: str, ctx: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Thread: block on the HCA's async events, hand each to the loop."""
        errors = 0
        while not self._stop.is_set():
            try:
                ev = ctx.get_async_event()
            except Exception as e:
                errors += 1
                self.counters["errors"] += 1
                if errors >= 5:
                    log.error("RDMA: %s: reading async events keeps failing (%s); its events are off", hca, e)
                    return
                time.sleep(1.0)
                continue
            errors = 0
            et = int(getattr(ev, "event_type", -1))
            try:
                ev.ack()
            except Exception:
                pass
            try:
                loop.call_soon_threadsafe(self._on_event, hca, et)
            except RuntimeError:  # the loop is closed: the daemon is stopping
                return

    def _on_event(self, hca: str, event_type: int) -> None:
        self.counters["events"] += 1
        try:
            inc = self.incident(hca, event_type, time.monotonic_ns())
        except Exception as e:
            log.warning("RDMA: %s: unreadable event %s (%s); ignored", hca, event_type, e)
            return
        if inc is None:
            self.counters["ignored"] += 1
            return
        self.counters["incidents"] += 1
        self.post(inc)

    async def run(self) -> None:
        """Start one reader thread per HCA and wait until cancelled (call :meth:`open` first)."""
        loop = asyncio.get_running_loop()
        for hca, ctx in self._ctx.items():
            t = threading.Thread(target=self._reader, args=(hca, ctx, loop), name=f"rdma-events-{hca}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()
            self.active = False

    def status(self) -> dict:
        return {"active": self.active, "hcas": sorted(self._ctx), **dict(self.counters)}
