"""NVML Xid events and RDMA async port events with fake pynvml / pyverbs modules (no GPU or
RDMA device here), and the off cases with the real (absent or driverless) modules."""

from __future__ import annotations

import asyncio
import queue
import types

from linkpass.adapters.nvml_events import NvmlXidSource
from linkpass.adapters.rdma_events import RdmaPortEvents
from tests.wait import async_wait_until


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(events: list, supported=(True, True), init_fails=False):
    m = types.SimpleNamespace(NVMLError=FakeNVMLError, NVML_ERROR_TIMEOUT=10, nvmlEventTypeXidCriticalError=8)
    handles = [object() for _ in supported]
    buses = [b"00000000:91:00.0", "00000000:3B:00.0"]
    m.registered = []

    def init():
        if init_fails:
            raise FakeNVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED
    m.nvmlInit = init
    m.nvmlDeviceGetCount = lambda: len(handles)
    m.nvmlDeviceGetHandleByIndex = lambda i: handles[i]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=buses[handles.index(h)])
    m.nvmlEventSetCreate = lambda: "set"

    def register(h, mask, s):
        assert mask == 8 and s == "set"
        if not supported[handles.index(h)]:
            raise FakeNVMLError(3)  # NOT_SUPPORTED
        m.registered.append(h)
    m.nvmlDeviceRegisterEvents = register

    def wait(s, timeout_ms):
        assert s == "set" and timeout_ms > 0
        if not events:
            raise FakeNVMLError(10)
        e = events.pop(0)
        if isinstance(e, Exception):
            raise e
        gpu, xid = e
        return types.SimpleNamespace(device=handles[gpu], eventType=8, eventData=xid, gpuInstanceId=0xFFFFFFFF,
                                     computeInstanceId=0xFFFFFFFF)
    m.nvmlEventSetWait_v2 = wait
    return m


def test_nvml_xid_events_become_incidents():
    got = []
    nv = fake_nvml([(0, 79), FakeNVMLError(10), (1, 13), (1, 48)])
    src = NvmlXidSource(got.append, nvml=nv, wait_ms=5)
    assert src.open() and src.gpus == {0: "0000:91:00.0", 1: "0000:3b:00.0"}
    assert src.gpu_index("0000:3B:00.0") == 1 and src.gpu_index("0000:01:00.0") is None

    async def main():
        t = asyncio.create_task(src.run())
        await async_wait_until(lambda: len(got) == 3, 5, "three Xid incidents")
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    asyncio.run(main())
    assert [(i.source, i.code, i.device, i.gpu, i.domain, i.action) for i in got] == [
        ("nvml", "xid:79", "0000:91:00.0", 0, "gpu", "migrate-rank"),
        ("nvml", "xid:13", "0000:3b:00.0", 1, "app", "none"),
        ("nvml", "xid:48", "0000:3b:00.0", 1, "gpu", "migrate-rank")]
    assert "Xid 79" in got[0].summary and src.counters["events"] == 3


def test_nvml_off_cases(caplog):
    with caplog.at_level("INFO", logger="linkpass.nvml"):
        assert not NvmlXidSource(print, nvml=fake_nvml([], init_fails=True)).open()
        assert not NvmlXidSource(print, nvml=fake_nvml([], supported=(False, False))).open()
        # the real nvidia-ml-py without a driver (this machine), or without the package
        assert not NvmlXidSource(print).open()
    assert any("Xid events off" in r.getMessage() for r in caplog.records)
    one = fake_nvml([], supported=(False, True))
    src = NvmlXidSource(print, nvml=one)
    assert src.open() and src.gpus == {1: "0000:3b:00.0"}


def test_nvml_wait_failures_turn_the_source_off_not_the_daemon(monkeypatch):
    import linkpass.adapters.nvml_events as ne
    monkeypatch.setattr(ne, "MAX_FAILURES", 2)
    nv = fake_nvml([FakeNVMLError(999), FakeNVMLError(999)])
    src = NvmlXidSource(print, nvml=nv, wait_ms=5)
    assert src.open()
    real_sleep = asyncio.sleep
    monkeypatch.setattr(ne.asyncio, "sleep", lambda s: real_sleep(0))

    async def main():
        t = asyncio.create_task(src.run())
        await async_wait_until(lambda: not src.active, 5, "the source to turn itself off")
        assert not t.done()  # off, but the task lives (the daemon supervises it)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    asyncio.run(main())
    assert not src.active and src.counters["wait_errors"] == 2


class FakeEvent:
    def __init__(self, et):
        self.event_type = et
        self.acked = False

    def ack(self):
        self.acked = True


def fake_verbs(devices=("mlx5_0", "mlx5_1"), ports=1, fail_list=False):
    q: dict[str, queue.Queue] = {d: queue.Queue() for d in devices}
    state: dict[str, dict[int, int]] = {d: {p: 4 for p in range(1, ports + 1)} for d in devices}

    class Context:
        def __init__(self, name):
            self.name = name

        def query_device(self):
            return types.SimpleNamespace(phys_port_cnt=ports)

        def query_port(self, p):
            return types.SimpleNamespace(state=state[self.name][p])

        def get_async_event(self):
            return q[self.name].get()

    def get_device_list():
        if fail_list:
            raise OSError("Failed to get devices list")
        return [types.SimpleNamespace(name=d.encode()) for d in devices]

    return types.SimpleNamespace(Context=Context, get_device_list=get_device_list, q=q, state=state)


def test_rdma_port_events_become_incidents():
    got = []
    v = fake_verbs(ports=2)
    src = RdmaPortEvents(got.append, device_module=v, compute_hcas=["mlx5_0"])
    assert src.open() and src.hcas == {"mlx5_0": {1: 4, 2: 4}, "mlx5_1": {1: 4, 2: 4}}

    async def main():
        t = asyncio.create_task(src.run())
        # no wait for the reader threads: the fake HCA queues hold the events until they read them
        v.state["mlx5_0"][2] = 1
        v.q["mlx5_0"].put(FakeEvent(10))   # PORT_ERR on port 2
        v.state["mlx5_1"][1] = 1
        v.q["mlx5_1"].put(FakeEvent(10))   # PORT_ERR on a non-compute HCA
        await async_wait_until(lambda: len(got) == 2, 5, "two port-error incidents")
        v.state["mlx5_0"][2] = 4
        v.q["mlx5_0"].put(FakeEvent(9))    # PORT_ACTIVE
        v.q["mlx5_0"].put(FakeEvent(4))    # COMM_EST: no port, ignored
        await async_wait_until(lambda: len(got) == 3 and src.counters["ignored"], 5, "the port-active incident and the ignored event")
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    asyncio.run(main())
    got.sort(key=lambda i: (i.code, i.device))
    assert [(i.source, i.code, i.device, i.domain, i.action) for i in got] == [
        ("rdma", "ibv_event:port_active", "mlx5_0/2", "benign", "none"),
        ("rdma", "ibv_event:port_err", "mlx5_0/2", "nic-link", "reroute"),
        ("rdma", "ibv_event:port_err", "mlx5_1/1", "benign", "none")]
    assert src.counters["ignored"] == 1


def test_rdma_off_cases():
    assert not RdmaPortEvents(print).open()  # pyverbs is not installed here
    assert not RdmaPortEvents(print, device_module=fake_verbs(devices=())).open()
    assert not RdmaPortEvents(print, device_module=fake_verbs(fail_list=True)).open()
