"""Engine: live device incidents are recorded (history, totals, status) and a migrate-rank root
becomes NotifyDeviceFault; duplicates from two sources, backlog, secondaries and link incidents
are recorded only."""

from __future__ import annotations

from linkpass.config import policy_from_config
from linkpass.core.engine import INCIDENT_DEDUP_NS, INCIDENTS_KEPT, Engine
from linkpass.core.model import DeviceIncident, NotifyDeviceFault

from unit_helpers import S, decided, make_cfg, snapshot


def inc(code="xid:79", device="0000:91:00.0", domain="gpu", action="migrate-rank", remedy="reboot-node", source="kmsg", t_ns=0, **kw):
    return DeviceIncident(source, domain, device, code, action, remedy, t_ns, **kw)


def engine():
    cfg = make_cfg()
    e = Engine(policy_from_config(cfg))
    e.handle(snapshot(cfg), 0)
    return e


def test_migrate_rank_root_is_notified_and_recorded():
    e = engine()
    a = decided(e.handle(inc(gpu=2), 1 * S))
    assert a == [NotifyDeviceFault(inc(gpu=2))]
    st = e.status(2 * S)
    assert st["incident_counts"] == {"gpu": 1} and st["totals"]["incident"] == 1
    (d,) = st["incidents"]
    assert d["code"] == "xid:79" and d["device"] == "0000:91:00.0" and d["notified"] and d["sources"] == ["kmsg"] and d["gpu"] == 2
    h = [x for x in e.history if x.kind == "incident"]
    assert len(h) == 1 and h[0].to_json()["code"] == "xid:79"


def test_same_fault_from_nvml_and_kmsg_is_one_incident_until_the_window_passes():
    e = engine()
    assert e.handle(inc(source="kmsg"), 1 * S)
    assert decided(e.handle(inc(source="nvml"), 2 * S)) == []
    st = e.status(3 * S)
    assert st["incidents"][0]["sources"] == ["kmsg", "nvml"] and st["incidents"][0]["count"] == 2
    assert st["totals"]["incident_duplicates"] == 1 and st["incident_counts"] == {"gpu": 1}
    assert e.handle(inc(source="nvml"), 30 * S)  # long after: a new occurrence


def test_recorded_only_cases():
    e = engine()
    assert decided(e.handle(inc(backlog=True), 1 * S)) == []
    assert decided(e.handle(inc(code="xid:45", follows="xid:79@0000:91:00.0", device="0000:3b:00.0"), 1 * S)) == []
    assert decided(e.handle(inc(code="xid:13", domain="app", action="none", remedy="none"), 1 * S)) == []
    # a link incident on a compute rail netdev: netlink handles the rail, the engine records it
    gen = e.generation
    a = decided(e.handle(inc(code="mlx5:link_down", device="rail0", domain="nic-link", action="reroute", remedy="observe"), 1 * S))
    assert a == [] and e.generation == gen
    st = e.status(2 * S)
    link = st["incidents"][-1]
    assert link["rail"] == 0 and link["handled_by"] == "netlink" and not link["notified"]
    assert st["incident_counts"] == {"app": 1, "gpu": 2, "nic-link": 1}
    assert not any(d["notified"] for d in st["incidents"])


def test_incidents_in_status_are_bounded():
    e = engine()
    for i in range(INCIDENTS_KEPT * 3):
        e.handle(inc(code=f"xid:{i}", action="none"), i * S)
    st = e.status(10_000 * S)
    assert len(st["incidents"]) == INCIDENTS_KEPT and st["incident_counts"]["gpu"] == INCIDENTS_KEPT * 3
    assert len(e._incident_seen) <= 4 * INCIDENTS_KEPT


def test_one_dedup_window_each_sighting_restarts_it_and_backlog_starts_none():
    """The sources post every sighting (the kmsg follower too); the engine's window alone makes
    repeats one incident: 9 s apart forever is one incident, a quiet window makes a new one."""
    e = engine()
    t = 1 * S
    assert decided(e.handle(inc(t_ns=t), t))
    for _ in range(3):  # the driver repeating its line every 9 s: the window keeps restarting
        t += 9 * S
        assert decided(e.handle(inc(t_ns=t), t)) == []
    t += INCIDENT_DEDUP_NS
    assert decided(e.handle(inc(t_ns=t), t))  # quiet for a window: a new incident, acted on
    st = e.status(t)
    assert st["totals"]["incident_duplicates"] == 3 and [d["count"] for d in st["incidents"]] == [4, 1]
    # a backlog sighting is recorded but starts no window: the live one right after is acted on
    e = engine()
    assert decided(e.handle(inc(code="xid:48", backlog=True, t_ns=1 * S), 1 * S)) == []
    assert decided(e.handle(inc(code="xid:48", t_ns=2 * S), 2 * S))
