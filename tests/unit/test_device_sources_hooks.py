"""The hook server's device_fault message: to the rank on the faulty GPU (to nobody when the GPU
index is unknown); the real torch_hooks client takes it without complaint."""

from __future__ import annotations

import asyncio
import json

from linkpass.adapters.hook_server import HookServer
from torch_hooks import protocol as proto


def _reg(rank, gpu):
    return proto.encode(proto.Registration(job="j", rank=rank, world_size=4, gpu=gpu).to_msg())


async def _read_type(r, t, timeout=2.0):
    while True:
        msg = json.loads(await asyncio.wait_for(r.readline(), timeout))
        if msg["type"] == t:
            return msg


def test_device_fault_goes_to_the_rank_on_that_gpu(tmp_path):
    path = str(tmp_path / "hooks.sock")
    incident = {"domain": "gpu", "device": "0000:91:00.0", "code": "xid:79", "action": "migrate-rank",
                "remedy": "reboot-node", "source": "kmsg", "summary": "fallen off the bus", "seq": 5}

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        conns = []
        for rank, gpu in ((0, 0), (1, 1)):
            r, w = await asyncio.open_unix_connection(path)
            w.write(_reg(rank, gpu))
            await w.drain()
            await _read_type(r, "registered")
            conns.append((r, w))
        assert srv.publish_device_fault(incident, 1, 123) == 1
        msg = await _read_type(conns[1][0], "device_fault")
        assert msg["gpu"] == 1 and msg["host"] == "h0" and msg["incident"]["code"] == "xid:79" and msg["t_ns"] == 123
        assert "seq" not in msg["incident"]
        assert proto.decode(json.dumps(msg).encode(), proto.SERVER_TYPES)["type"] == "device_fault"
        # index unknown: sent to nobody (every rank would move; the daemon logs a node-level fault)
        assert srv.publish_device_fault(incident, None, 124) == 0
        for r, _ in conns:
            try:
                line = await asyncio.wait_for(r.readline(), 0.2)
            except asyncio.TimeoutError:
                line = b""
            assert b"device_fault" not in line
        assert srv.counters["device_faults_sent"] == 1 and srv.counters["device_faults_unattributed"] == 1
        for _, w in conns:
            w.close()
        await srv.close()

    asyncio.run(main())


def test_existing_client_ignores_device_fault():
    from torch_hooks.client import DaemonClient

    c = DaemonClient.__new__(DaemonClient)
    from collections import Counter
    c.counters = Counter()
    msg = proto.build_device_fault(instance="i", host="h0", incident={"code": "xid:79"}, gpu=0, t_ns=1)
    c._on_line(proto.encode(msg), 0)
    assert c.counters["bad_messages"] == 0


def test_gpu_at_risk_goes_to_the_rank_on_that_gpu_and_the_notifier_says_when_nobody_is_there(tmp_path, caplog):
    import logging

    from linkpass.daemon import AtRiskNotifier
    from linkpass.core.model import NotifyAtRisk

    path = str(tmp_path / "hooks.sock")
    verdict = {"rule": "gpu.row_remap_pending", "counter": "row_remap_pending", "rate": 1.0, "unit": "flag",
               "window_s": 0.0, "threshold": ">= 1 for 2 polls", "summary": "gpu 1 at risk: row_remap_pending 1",
               "citation": "NVIDIA GPU Memory Error Management", "counters": {"row_remap_pending": 1}}

    async def main():
        srv = HookServer(path, "h0")
        await srv.start()
        conns = []
        for rank, gpu in ((0, 0), (1, 1)):
            r, w = await asyncio.open_unix_connection(path)
            w.write(_reg(rank, gpu))
            await w.drain()
            await _read_type(r, "registered")
            conns.append((r, w))
        n = AtRiskNotifier(srv)
        n(NotifyAtRisk(1, verdict, 77))
        msg = await _read_type(conns[1][0], "gpu_at_risk")
        assert msg["gpu"] == 1 and msg["verdict"]["rule"] == "gpu.row_remap_pending" and msg["t_ns"] == 77
        assert "citation" not in msg["verdict"] and proto.decode(json.dumps(msg).encode(), proto.SERVER_TYPES)
        caplog.set_level(logging.WARNING, logger="linkpass")
        n(NotifyAtRisk(5, verdict, 78))  # nobody on GPU 5: the remedy for operators
        assert n.sent == 1 and n.unmoved == 1 and srv.counters["at_risk_sent"] == 1
        assert any("GPU 5 AT RISK" in r.getMessage() and "drain the node" in r.getMessage() for r in caplog.records)
        for _, w in conns:
            w.close()
        await srv.close()

    asyncio.run(main())
