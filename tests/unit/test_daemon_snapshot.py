"""linkpass/core/status.py: one frozen DaemonSnapshot, three renderers (Prometheus families,
systemd STATUS=, the control socket's status JSON) that agree with each other."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.core import Metric

from linkpass.adapters.fakes import FakePublisher
from linkpass.adapters.metrics import state_families
from linkpass.adapters.sdnotify import status_line
from linkpass.config import parse_config
from linkpass.core.model import LinkChanged, PublishHistory, RoutesApplied
from linkpass.core.status import STATUS_SCHEMA, DaemonSnapshot, status_json
from linkpass.daemon import Daemon

from unit_helpers import MS, S, carrier_lost, make_toml, snapshot

#: the control socket's status fields, in order, for a daemon with hooks and metrics, no MQTT
STATUS_FIELDS = ["schema", "pid", "uptime_s", "host", "mode", "generation", "applied_generation", "hold_down_ms", "now_ns",
                 "rails", "peers", "routes", "kept_destinations", "route_errors", "route_conflicts", "warnings", "totals",
                 "paths", "incidents", "incident_counts", "at_risk", "reroute", "hooks", "snapshots", "metrics", "systemd", "counters", "dispatch_errors",
                 "device_sources"]


@pytest.fixture
def d(tmp_path):
    text = make_toml(rails=(0, 1), n_peers=1, hold_down_ms=2000)
    text = text.replace("[daemon]\n", f'[daemon]\ncontrol_socket = "{tmp_path}/lp.sock"\n', 1)
    dm = Daemon(str(tmp_path / "lp.toml"), parse_config(text, "lp.toml"))
    for ev, t in ((snapshot(dm.cfg, 0), 0), (RoutesApplied(1, MS), MS), (LinkChanged(carrier_lost("rail0"), S), S)):
        dm._dispatch([a for a in dm.engine.handle(ev, t) if isinstance(a, PublishHistory)])
    yield dm
    if dm.metrics:
        dm.metrics.stop()


def _samples(fams: list[Metric]) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_the_three_renderers_read_one_snapshot_and_agree(d):
    snap = d.snapshot(2 * S)
    st = status_json(snap)
    m = _samples(state_families(snap))
    line = status_line(snap)
    assert line == "1/2 rails up, plan generation 2, 0/1 peers heard"
    assert m[("linkpass_rails_usable", ())] == sum(r["usable"] for r in st["rails"]) == len(snap.usable_rails) == 1
    assert m[("linkpass_plan_generation", ())] == st["generation"] == snap.generation == 2
    assert m[("linkpass_rail_state", (("netdev", "rail0"), ("rail", "0"), ("state", "DOWN")))] == 1
    assert [r["state"] for r in st["rails"]] == [r.state for r in snap.rails] == ["DOWN", "UP"]
    assert m[("linkpass_events_handled_total", ())] == st["counters"]["events_handled"]
    assert st["schema"] == STATUS_SCHEMA and st["now_ns"] == snap.t_ns == 2 * S


def test_status_fields_are_the_contract(d):
    assert list(d.status()) == STATUS_FIELDS
    d.reload_error = "last reload refused, running config kept: bad"
    assert d.status()["warnings"][-1] == d.reload_error
    assert status_line(d.snapshot(probes=False, engine=False)).endswith("last reload refused (old config kept)")


def test_snapshot_is_frozen_and_a_light_one_has_no_status(d):
    snap = d.snapshot(probes=False, engine=False)
    assert isinstance(snap, DaemonSnapshot) and snap.engine is None and snap.prober is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.generation = 9  # type: ignore[misc]
    with pytest.raises(ValueError):
        status_json(snap)


def test_mqtt_read_outs_come_through_the_snapshot(d):
    d.mqtt = FakePublisher(connected=False, depth=3, dropped_total=1)
    snap = d.snapshot()
    assert (snap.mqtt.depth, snap.mqtt.dropped_total, snap.mqtt.connected) == (3, 1, False)
    m = _samples(state_families(snap))
    assert m[("linkpass_mqtt_outbox_depth", ())] == 3 and m[("linkpass_mqtt_connected", ())] == 0
    assert status_json(snap)["mqtt"] == d.mqtt.status()


def test_a_broken_mqtt_depth_leaves_the_depth_out(d, caplog):
    class Broken(FakePublisher):
        def depth(self) -> int:
            raise RuntimeError("outbox bug")

    d.mqtt = Broken()
    snap = d.snapshot(engine=False)
    assert snap.mqtt.depth is None and "mqtt.depth() failed" in caplog.text
    assert ("linkpass_mqtt_outbox_depth", ()) not in _samples(state_families(snap))
