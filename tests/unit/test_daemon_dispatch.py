"""linkpass/daemon.py: the dispatch table (action type -> owning adapter's handler), with one
failing handler logged and counted (``dispatch_errors``) while the others still run; the
device-fault outcome fed back through Engine.handle; hook peers reaching the prober only as
an engine action."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import pytest

from linkpass.adapters.fakes import FakeHistoryReader, FakePublisher
from linkpass.config import load_config
from linkpass.core.model import (
    ApplyRoutes,
    DeviceIncident,
    HookPeersChanged,
    NotifyDeviceFault,
    NotifyHooks,
    PublishHistory,
    SendNotice,
    SetProbePriority,
    WriteNcclEnv,
)
from linkpass.daemon import Daemon

from unit_helpers import decided, history_of, snapshot


@pytest.fixture
def d():
    tmp = Path(tempfile.mkdtemp(prefix="lpd", dir="/tmp"))
    cfg_path = tmp / "lp.toml"
    cfg_path.write_text(f'[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\ncontrol_socket = "{tmp}/c.sock"\n'
                        'reroute = "notify-only"\n'
                        '[[rails]]\nid = 0\nnetdev = "rail0"\n[[rails]]\nid = 1\nnetdev = "rail1"\n'
                        '[[peers]]\nname = "h1"\nhost_ip = "198.19.0.2"\nrail_ips = { 0 = "198.18.0.2", 1 = "198.18.1.2" }\n'
                        f'[probe]\nenabled = false\n[nccl]\nenv_file = "{tmp}/nccl.env"\n[hooks]\nenabled = true\n')
    yield Daemon(str(cfg_path), load_config(cfg_path))
    shutil.rmtree(tmp, ignore_errors=True)


def test_every_action_type_the_engine_returns_has_an_owner(d):
    acts = d.engine.handle(snapshot(d.cfg, 0), 0)
    kinds = {type(a) for a in acts}
    assert {ApplyRoutes, WriteNcclEnv, NotifyHooks} <= kinds
    assert SendNotice in kinds and SendNotice not in d.handlers  # no notice key: the notice adapter is off, owns nothing
    assert kinds - {SendNotice} <= set(d.handlers)


def test_a_failing_handler_is_logged_and_counted_and_the_others_still_run(d, caplog):
    acts = d.engine.handle(snapshot(d.cfg, 0), 0)
    ran = []

    def broken(a):
        raise RuntimeError("adapter bug")

    d.handlers[ApplyRoutes] = broken
    d.handlers[NotifyHooks] = ran.append
    d.handlers[WriteNcclEnv] = ran.append
    with caplog.at_level(logging.ERROR, logger="linkpass.daemon"):
        d._dispatch(acts)
        d._dispatch(acts)
    assert [type(a) for a in ran] == [WriteNcclEnv, NotifyHooks] * 2  # the loop went on
    (rec, _) = [r for r in caplog.records if "handler for ApplyRoutes failed" in r.getMessage()]
    assert rec.exc_info is not None
    st = d.status()
    assert st["dispatch_errors"] == {"ApplyRoutes": 2}
    assert st["counters"]["dispatch_errors"] == 2


def test_no_failure_no_dispatch_errors(d):
    d.handlers[ApplyRoutes] = lambda a: None
    d._dispatch(d.engine.handle(snapshot(d.cfg, 0), 0))
    assert d.status()["dispatch_errors"] == {} and d.status()["counters"]["dispatch_errors"] == 0


def test_device_fault_outcome_goes_back_through_the_engine_before_history_leaves(d):
    d.engine.handle(snapshot(d.cfg, 0), 0)
    reader = FakeHistoryReader()
    d.history_readers[:] = [reader.on_events]
    inc = DeviceIncident("kmsg", "gpu", "0000:1c:00.0", "xid:79", "migrate-rank", "reboot-node", 5, gpu=None)
    acts = d.engine.handle(inc, 5)
    assert decided(acts) == [NotifyDeviceFault(inc)]
    assert isinstance(acts[-1], PublishHistory)  # history leaves last, after the outcome came back
    d._dispatch(acts)
    (entry,) = [h for h in reader.entries if h.kind == "incident"]
    assert entry.data["notified"] is False and entry.data["gpu_unknown"] is True


def test_history_goes_to_every_reader_and_a_failing_one_is_isolated(d, caplog):
    first, last = FakeHistoryReader(), FakeHistoryReader()

    def broken(entries):
        raise RuntimeError("reader bug")

    d.history_readers[:] = [first.on_events, broken, last.on_events]
    acts = d.engine.handle(snapshot(d.cfg, 0), 0)
    published = history_of(acts)
    assert [h.kind for h in published][-1] == "plan"
    with caplog.at_level(logging.ERROR, logger="linkpass.daemon"):
        d._dispatch(acts)
    assert first.entries == last.entries == published
    assert "history reader" in caplog.text and d.dispatch_errors == {}
    assert list(d.engine.history)[-len(published):] == published  # the engine keeps them for `history`


def test_hook_peers_reach_the_prober_only_as_an_engine_action(d):
    d._hook_peers_changed(["h1", "stranger"])  # what the hook server calls
    ev = d.queue.get_nowait()
    assert ev == HookPeersChanged(("h1", "stranger"), ev.t_ns)
    told = []
    d.handlers[SetProbePriority] = told.append
    d._dispatch(d.engine.handle(ev, 1))
    assert told == [SetProbePriority(("h1",))]  # only configured peers
    assert d.engine.handle(ev, 2) == []  # unchanged: nothing to tell



def test_hook_reports_reach_the_operators_adapter_through_the_engine(d):
    from linkpass.core.model import HookReport, PublishHookReport

    rec = {"event": "rebuilt", "job": "j", "rank": 1}
    d.hooks.on_report(rec)  # what the hook server calls for a kept report
    ev = d.queue.get_nowait()
    assert ev == HookReport(rec, ev.t_ns)
    acts = d.engine.handle(ev, 1)
    assert acts == [PublishHookReport(rec)]
    assert PublishHookReport not in d.handlers  # MQTT is off here: nobody owns it
    d.mqtt = FakePublisher()  # the MQTT publisher's stand-in
    d.handlers = d._handlers()
    d._dispatch(acts)
    assert d.mqtt.reports == [rec] and d.dispatch_errors == {}
