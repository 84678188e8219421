"""A snapshot report from the hook to the operators, end to end in one process: the hook's
Snapshotter reports through the real torch_hooks client over the daemon's real hook socket; the
daemon's HookServer posts it, the engine keeps it and passes it on; then ``status`` (the control
socket's JSON), a Prometheus scrape of the daemon's registry, and the MQTT ``snapshot`` event as
the real publisher stores it in its outbox (checked against deploy/asyncapi.yaml).  A hostile
client's report with bad fields is dropped, counted, and breaks none of them.  No broker, no
torch: the publisher's outbox holds the payload it would send."""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from linkpass.adapters.mqtt import MqttPublisher
from linkpass.adapters.outbox import Outbox
from linkpass.config import MqttSection, load_config
from linkpass.core.model import HookReport
from linkpass.daemon import Daemon
from tests.wait import async_wait_until
from torch_hooks import protocol as proto
from torch_hooks import snapshot
from torch_hooks.client import DaemonClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def daemon():
    tmp = Path(tempfile.mkdtemp(prefix="lpsr", dir="/tmp"))
    cfg_path = tmp / "lp.toml"
    cfg_path.write_text(f'[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\ncontrol_socket = "{tmp}/c.sock"\n'
                        'reroute = "notify-only"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
                        '[[peers]]\nname = "h1"\nhost_ip = "198.19.0.2"\nrail_ips = { 0 = "198.18.0.2" }\n')
    d = Daemon(str(cfg_path), load_config(str(cfg_path)))
    yield d
    if d.metrics:
        d.metrics.stop()


def _snapshotter(rank: int, client: DaemonClient) -> snapshot.Snapshotter:
    st = SimpleNamespace(rank=rank, world_size=2, job="llm7", master_addr=None, master_port=None, local_rank=rank,
                         host="h0", rebuild_timeout_s=60)
    tracker = SimpleNamespace(add_boundary_listener=lambda fn: None)
    return snapshot.Snapshotter(st, tracker, snapshot.SnapshotSettings({}), client_fn=lambda: client)


def _validator():
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    doc = yaml.safe_load((ROOT / "deploy" / "asyncapi.yaml").read_text())
    return jsonschema.Draft7Validator({"$ref": "#/components/schemas/Event", "components": doc["components"]})


def test_a_snapshot_report_reaches_status_metrics_and_the_mqtt_event(daemon):
    d = daemon
    assert d.hooks is not None and d.metrics is not None

    async def main():
        d.mqtt = MqttPublisher(MqttSection(enabled=True), "h0", {0: "rail0"}, outbox=Outbox(":memory:"))
        d.handlers = d._handlers()
        await d.hooks.start()
        clients = [DaemonClient(proto.Registration(job="llm7", rank=r, world_size=2, peers=("h1",), rail=0), d.hooks.path,
                                reconnect_s=(0.02, 0.1)).start() for r in (0, 1)]
        try:
            for c in clients:
                assert await asyncio.to_thread(c.wait_connected, 5)
            rank0, rank1 = (_snapshotter(r, c) for r, c in enumerate(clients))
            # what the hook's rank 1 reports when its part is on disk, then rank 0 for the whole snapshot
            rank1._done({"sid": "g1", "step": 12, "stall_ms": 11.5, "write_ms": 170.0, "bytes": 228839},
                        {"ok": True, "bytes": 228839, "stall_ms": 11.5, "write_ms": 170.0, "error": None})
            rank0._done({"sid": "g1", "step": 12, "stall_ms": 12.5, "write_ms": 180.25},
                        {"ok": True, "step": 12, "path": "/snaps/step-000000012", "id": "g1", "bytes": 457678,
                         "stall_ms": 12.5, "write_ms": 180.25})
            # a hostile client: a report with fields of the wrong type
            assert clients[1].report("snapshot", id=["x"], step="twelve", ok="yes", bytes=-1, stall_ms="slow")
            events: list = []
            while len(events) < 3:
                ev = await asyncio.wait_for(d.queue.get(), 5)
                if isinstance(ev, HookReport):
                    events.append(ev)
                    d._step(ev)
            # a failed one after the good ones: rank 0 says why
            rank0._done({"sid": "p24", "step": 24, "stall_ms": 9.0, "write_ms": 3.0},
                        {"ok": False, "step": 24, "path": None, "id": "p24",
                         "reason": "rank 1: not enough space in /snaps: the part needs about 1300000 bytes (230000 bytes "
                                   "of state), 4096 bytes free"})
            ev = await asyncio.wait_for(d.queue.get(), 5)
            while not isinstance(ev, HookReport):
                ev = await asyncio.wait_for(d.queue.get(), 5)
            d._step(ev)
            return d.status(), generate_latest(d.metrics.registry).decode(), [r.doc for r in d.mqtt.outbox.peek(10)]
        finally:
            for c in clients:
                c.close()
            await d.hooks.close()

    st, scrape, docs = asyncio.run(main())

    # status: the job's newest report and its counts; the bad report counted, nothing of it kept
    snaps = st["snapshots"]
    assert snaps["reports_rejected"] == 1 and snaps["jobs_forgotten"] == 0 and list(snaps["jobs"]) == ["llm7"]
    job = snaps["jobs"]["llm7"]
    assert (job["ok"], job["failed"], job["parts_ok"], job["parts_failed"]) == (1, 1, 1, 0)
    last = job["last"]
    assert {k: last[k] for k in ("rank", "scope", "snapshot_id", "step", "ok", "path", "stall_ms", "write_ms")} == {
        "rank": 0, "scope": "snapshot", "snapshot_id": "p24", "step": 24, "ok": False, "path": None, "stall_ms": 9.0,
        "write_ms": 3.0}
    assert last["reason"].startswith("rank 1: not enough space in /snaps") and last["age_s"] >= 0
    json.dumps(st, allow_nan=False)

    # metrics, as Prometheus scrapes them (seconds)
    lines = set(scrape.splitlines())
    for want in ('linkpass_snapshots_total{job="llm7",result="ok"} 1.0',
                 'linkpass_snapshots_total{job="llm7",result="failed"} 1.0',
                 'linkpass_snapshot_parts_total{job="llm7",result="ok"} 1.0',
                 'linkpass_snapshot_reports_rejected_total 1.0',
                 'linkpass_snapshot_last_ok{job="llm7"} 0.0',
                 'linkpass_snapshot_last_step{job="llm7"} 24.0',
                 'linkpass_snapshot_last_stall_seconds{job="llm7"} 0.009',
                 'linkpass_snapshot_last_write_seconds{job="llm7"} 0.003'):
        assert want in lines, want
    assert not any(ln.startswith("linkpass_snapshot_last_bytes") for ln in lines)  # the failed one had no size

    # the MQTT events the publisher stored: rank 1's part, the complete snapshot, the failed one
    snap_docs = [x for x in docs if x["event"] == "snapshot"]  # the two ranks' connections: in either order
    assert sorted((x["step"], x["scope"], x["rank"], x["ok"], x["severity"]) for x in snap_docs) == [
        (12, "part", 1, True, "info"), (12, "snapshot", 0, True, "info"), (24, "snapshot", 0, False, "critical")]
    assert [x["seq"] for x in snap_docs] == [1, 2, 3]
    done = next(x for x in snap_docs if x["step"] == 12 and x["scope"] == "snapshot")
    assert (done["job"], done["snapshot_id"], done["path"], done["bytes"], done["stall_ms"], done["write_ms"], done["reason"]) == (
        "llm7", "g1", "/snaps/step-000000012", 457678, 12.5, 180.25, None)
    assert done["host"] == "h0" and done["schema"] == "linkpass.event/v1" and done["id"] != "g1"
    v = _validator()
    for x in snap_docs:
        errs = list(v.iter_errors(x))
        assert not errs, f"{x} does not match deploy/asyncapi.yaml: {errs[0].message}"


def test_the_hook_socket_survives_a_flood_of_garbage_snapshot_reports(daemon):
    """Many bad reports from one client: each counted and dropped; the good one after them is kept."""
    d = daemon

    async def main():
        await d.hooks.start()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.hooks.path)
        s.sendall(proto.encode(proto.Registration(job="j", rank=3, world_size=4, peers=("h1",), rail=0).to_msg()))
        junk = [{"step": v} for v in ("1", None, [1], {"a": 1}, -3, 1.5, True)] + [{"ok": v} for v in (0, "no", None)]
        for j in junk:
            s.sendall(proto.encode({"type": "report", "event": "snapshot", "step": 1, "ok": True, **j}))
        s.sendall(proto.encode({"type": "report", "event": "snapshot", "id": "p8", "step": 8, "ok": True, "bytes": 10}))
        await async_wait_until(lambda: d.hooks.counters["reports"] >= len(junk) + 1, 5, "the reports to arrive")
        while not d.queue.empty():
            d._step(d.queue.get_nowait())
        s.close()
        await d.hooks.close()
        return d.status()

    st = asyncio.run(main())
    assert st["snapshots"]["reports_rejected"] == 10
    last = st["snapshots"]["jobs"]["j"]["last"]
    assert (last["rank"], last["scope"], last["step"], last["bytes"]) == (3, "part", 8, 10)
    assert st["dispatch_errors"] == {}
