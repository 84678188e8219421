"""Device faults to hook clients (HookServer on a real unix socket, or the fake beside it; the
daemon's NotifyDeviceFault handler, DeviceFaultNotifier, with a real Engine): a fault that reached no client is kept per GPU and delivered to the client
that registers on that GPU; `notified` says whether a client got it; a fault with no GPU index
goes to nobody and is logged as a node-level fault."""

from __future__ import annotations

import asyncio
import json
import logging

from linkpass.config import policy_from_config
from linkpass.adapters import hook_server as hs
from linkpass.adapters.fakes import FakeHistoryReader, FakeHookNotifier
from linkpass.adapters.hook_server import HookServer
from linkpass.core.engine import Engine
from linkpass.core.model import DeviceFaultDelivered, DeviceIncident, NotifyDeviceFault, PublishHistory
from linkpass.daemon import DeviceFaultNotifier

from unit_helpers import S, decided, make_cfg, snapshot

INC = {"domain": "gpu", "device": "0000:1c:00.0", "code": "xid:79", "action": "migrate-rank", "remedy": "reboot-node",
       "source": "kmsg", "summary": "GPU has fallen off the bus"}


async def _readline(reader, timeout=2.0) -> dict:
    return json.loads(await asyncio.wait_for(reader.readline(), timeout))


async def _register(path: str, gpu: int | None, rank: int = 0):
    r, w = await asyncio.open_unix_connection(path)
    m = {"type": "register", "v": 1, "job": "j", "rank": rank, "world_size": 4, "peers": [], "rail": 0, "backend": "gloo"}
    if gpu is not None:
        m["gpu"] = gpu
    w.write(json.dumps(m).encode() + b"\n")
    await w.drain()
    assert (await _readline(r))["type"] == "registered"
    return r, w


async def _nothing(reader, timeout=0.2) -> bool:
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except TimeoutError:
        return True
    return not line


def test_fault_with_no_client_is_kept_and_delivered_to_the_client_that_registers_on_its_gpu(tmp_path):
    path = str(tmp_path / "hooks.sock")
    delivered: list[int] = []

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        r2, w2 = await _register(path, gpu=2, rank=1)  # a client on another GPU: not for it
        assert srv.publish_device_fault(INC, 4, 123, on_delivered=delivered.append) == 0
        st = srv.status()
        assert [(p["gpu"], p["code"]) for p in st["pending_device_faults"]] == [(4, "xid:79")]
        assert st["counters"]["device_faults_kept"] == 1
        assert await _nothing(r2)
        # the trainer's client on GPU 4 reconnects: it gets the fault right after registering
        r4, w4 = await _register(path, gpu=4)
        msg = await _readline(r4)
        assert (msg["type"], msg["gpu"], msg["incident"]["code"], msg["t_ns"]) == ("device_fault", 4, "xid:79", 123)
        assert delivered == [1] and srv.status()["pending_device_faults"] == []
        assert srv.counters["device_faults_delivered_late"] == 1
        # delivered once: a second client on GPU 4 gets nothing
        r4b, w4b = await _register(path, gpu=4, rank=2)
        assert await _nothing(r4b)
        # a fault that reached a client is not kept
        assert srv.publish_device_fault(INC, 4, 124) == 2
        assert (await _readline(r4))["t_ns"] == 124 and srv.pending_faults == {}
        for w in (w2, w4, w4b):
            w.close()
        await srv.close()

    asyncio.run(main())


def test_kept_faults_expire_and_are_bounded(tmp_path, monkeypatch):
    path = str(tmp_path / "hooks.sock")
    clock = [1_000 * S]
    monkeypatch.setattr(hs.time, "monotonic_ns", lambda: clock[0])

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        for i in range(hs.PENDING_FAULTS_PER_GPU + 3):
            srv.publish_device_fault(INC, 1, i)
        assert [p.msg["t_ns"] for p in srv.pending_faults[1]] == list(range(3, hs.PENDING_FAULTS_PER_GPU + 3))
        clock[0] += hs.PENDING_FAULT_TTL_NS  # too old now: a client on GPU 1 gets none of them
        r, w = await _register(path, gpu=1)
        assert await _nothing(r)
        assert srv.pending_faults == {} and srv.counters["device_faults_expired"] == hs.PENDING_FAULTS_PER_GPU + 3
        w.close()
        await srv.close()

    asyncio.run(main())


def test_fault_without_gpu_goes_to_no_client(tmp_path):
    path = str(tmp_path / "hooks.sock")

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        r1, w1 = await _register(path, gpu=1)
        r0, w0 = await _register(path, gpu=None, rank=1)
        assert srv.publish_device_fault(INC, None, 5) == 0
        assert await _nothing(r1) and await _nothing(r0)
        assert srv.pending_faults == {} and srv.counters["device_faults_unattributed"] == 1
        for w in (w1, w0):
            w.close()
        await srv.close()

    asyncio.run(main())


# -- the daemon's side: notified, late delivery, unattributed -----------------------------------

class _Loop:
    """What the daemon's loop does for these actions: NotifyDeviceFault to the daemon's real
    handler (:class:`DeviceFaultNotifier`), its outcome fed back through Engine.handle in the
    same turn, PublishHistory to a history reader; ``posted`` is the event queue."""

    def __init__(self, hooks):
        self.cfg = make_cfg()
        self.engine = Engine(policy_from_config(self.cfg))
        self.engine.handle(snapshot(self.cfg), 0)
        self.posted: list = []
        self.notify = DeviceFaultNotifier(hooks, self.posted.append)
        self.history = FakeHistoryReader()

    def step(self, ev, now_ns) -> list:
        """One event through the engine and its actions dispatched; returns the decisions."""
        acts = self.engine.handle(ev, now_ns)
        for a in acts:
            if isinstance(a, NotifyDeviceFault):
                outcome = self.notify(a)
                assert [type(o) for o in outcome] == [DeviceFaultDelivered]
                for o in outcome:
                    assert decided(self.engine.handle(o, now_ns)) == []
            elif isinstance(a, PublishHistory):
                self.history.on_events(a.entries)
        return decided(acts)

    def handle_posted(self, now_ns):
        events, self.posted[:] = list(self.posted), []
        for ev in events:
            self.step(ev, now_ns)
        return events


def _incident(gpu, code="xid:79", device="0000:1c:00.0", t_ns=7):
    return DeviceIncident("kmsg", "gpu", device, code, "migrate-rank", "reboot-node", t_ns, summary="GPU has fallen off the bus", gpu=gpu)


def test_notified_only_when_a_client_got_it_and_late_delivery_is_recorded(tmp_path, caplog):
    path = str(tmp_path / "hooks.sock")

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        me = _Loop(srv)
        with caplog.at_level(logging.WARNING, logger="linkpass.daemon"):
            assert me.step(_incident(4), 1 * S) == [NotifyDeviceFault(_incident(4))]
        assert "told 0 hook client(s)" in caplog.text and "kept for a client that registers on that GPU" in caplog.text
        (d,) = me.engine.status(2 * S)["incidents"]
        assert (d["notified"], d["hook_clients"], d["kept"]) == (False, 0, True)
        (h,) = [x for x in me.history.entries if x.kind == "incident"]
        assert h.data["notified"] is False  # what MQTT and the metrics get
        r, w = await _register(path, gpu=4)
        assert (await _readline(r))["type"] == "device_fault"
        (late,) = me.handle_posted(3 * S)
        assert isinstance(late, DeviceFaultDelivered) and late.late and late.clients == 1
        (d,) = me.engine.status(3 * S)["incidents"]
        assert (d["notified"], d["hook_clients"], d["kept"], d["delivered_late"]) == (True, 1, False, True)
        # a client on the GPU now: told at once
        me.step(_incident(4, code="xid:48", t_ns=8), 4 * S)
        assert (await _readline(r))["incident"]["code"] == "xid:48"
        d = me.engine.status(5 * S)["incidents"][-1]
        assert (d["notified"], d["hook_clients"], d["kept"]) == (True, 1, False)
        assert me.history.entries[-1].data["notified"] is True
        w.close()
        await srv.close()

    asyncio.run(main())


def test_fault_that_cannot_be_attributed_to_a_gpu_is_a_node_level_warning(tmp_path, caplog):
    path = str(tmp_path / "hooks.sock")

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        r, w = await _register(path, gpu=None)
        me = _Loop(srv)
        ev = DeviceIncident("kmsg", "nvlink", "0000:06:00.0", "sxid:20034", "migrate-rank", "drain-node", 9,
                            summary="SXid 20034 Fatal LTSSM", gpu=None)
        with caplog.at_level(logging.WARNING, logger="linkpass.daemon"):
            me.step(ev, 1 * S)
        assert await _nothing(r)
        (rec,) = [x for x in caplog.records if "DEVICE FAULT" in x.getMessage()]
        text = rec.getMessage()
        assert rec.levelno == logging.WARNING and "could not be attributed to a GPU" in text and "drain the node" in text
        st = me.engine.status(2 * S)
        (d,) = st["incidents"]
        assert (d["notified"], d["gpu_unknown"], d["hook_clients"]) == (False, True, 0)
        assert st["totals"]["device_faults_unattributed"] == 1 and srv.pending_faults == {}
        w.close()
        await srv.close()

    asyncio.run(main())


# -- the same through the fake hook server (no socket) ---------------------------------------

def test_kept_then_late_delivery_through_the_fake_hooks():
    hooks = FakeHookNotifier()
    me = _Loop(hooks)
    me.step(_incident(4), 1 * S)
    assert [(f[1], f[0]["code"]) for f in hooks.faults] == [(4, "xid:79")]
    (d,) = me.engine.status(2 * S)["incidents"]
    assert (d["notified"], d["hook_clients"], d["kept"]) == (False, 0, True)
    assert hooks.register(4) == 1  # a client registers on GPU 4: the kept fault reaches it
    (late,) = me.handle_posted(3 * S)
    assert late.late and late.clients == 1
    (d,) = me.engine.status(3 * S)["incidents"]
    assert (d["notified"], d["hook_clients"], d["kept"], d["delivered_late"]) == (True, 1, False, True)
    (h,) = [x for x in me.history.entries if x.kind == "incident"]
    assert h.data["notified"] is False  # published before the late delivery; only status follows it


def test_hooks_off_nobody_is_told_and_nothing_is_kept():
    me = _Loop(None)
    me.step(_incident(4), 1 * S)
    (d,) = me.engine.status(2 * S)["incidents"]
    assert (d["notified"], d["hook_clients"], d["kept"]) == (False, 0, False)


def test_unattributed_fault_reaches_no_fake_client():
    hooks = FakeHookNotifier({0: 1, 1: 1})
    me = _Loop(hooks)
    me.step(_incident(None), 1 * S)
    assert hooks.faults == [] and hooks.unattributed == 0  # not even asked: the daemon knows no GPU
    (d,) = me.engine.status(2 * S)["incidents"]
    assert d["gpu_unknown"] is True and d["notified"] is False
