"""The MQTT adapter's pure parts: what becomes an event, payload shapes, secret-file and TLS
checks, backoff.  (With a real broker: tests/integration/test_mqtt_publisher.py.)"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from linkpass.config import MqttSection, parse_config, policy_from_config
from linkpass.adapters import mqtt
from linkpass.adapters.mqtt import AlertMapper, MqttPublisher, MqttSetupError, compact_state, topic_prefix
from linkpass.adapters.outbox import Outbox
from linkpass.core.model import HistoryEntry

RAILS = {0: "rail0", 1: "rail1"}


def _m():
    return AlertMapper(RAILS)


def _rail(old, new, reason="r"):
    return ("rail", 5, {"rail": 0, "old": old, "new": new, "reason": reason, "event_t_ns": 4})


@pytest.mark.parametrize("old,new,event,critical", [
    ("UP", "DOWN", "fault", True),
    ("UP", "SUSPECT", "fault", True),
    ("UNKNOWN", "DOWN", "fault", True),
    ("DOWN", "HOLD_DOWN", "recovery", False),
    ("HOLD_DOWN", "UP", "recovery", False),
    ("UP", "DRAINED", "drain", False),
    ("DRAINED", "UP", "recovery", False),
])
def test_rail_transitions(old, new, event, critical):
    a = _m().from_entry(*_rail(old, new))
    assert (a.event, a.critical) == (event, critical)
    assert a.fields == {"rail": 0, "netdev": "rail0", "old": old, "new": new, "reason": "r"}
    assert a.t_mono_ns == 4  # when the event happened, not when the engine recorded it


def test_start_up_is_not_news():
    m = _m()
    assert m.from_entry(*_rail("UNKNOWN", "UP")) is None
    assert m.from_entry("plan", 1, {"generation": 1, "reason": "start", "usable": [0, 1], "routes": 1}) is None
    assert m.generation == 1
    for kind in ("link_dump", "path", "route_disturbed", "config_reloaded"):
        assert m.from_entry(kind, 1, {"rail": 0, "old": "UP", "new": "DOWN"}) is None
    assert m.from_entry("routes_applied", 1, {"generation": 1, "replaced": 1, "deleted": 0, "errors": [], "conflicts": []}) is None
    assert m.from_entry("peer_rails", 1, {"peer": "h1", "usable": [0, 1], "was": None, "peer_generation": 1}) is None


def test_plans_become_failover_failback_reroute():
    m = _m()
    a = m.from_entry("plan", 1, {"generation": 1, "reason": "start", "usable": [1], "routes": 1})
    assert a.event == "failover" and a.fields["lost"] == [0]  # first plan without every rail
    a = m.from_entry("plan", 2, {"generation": 2, "reason": "peer h1 rails changed", "usable": [1], "routes": 1})
    assert a.event == "reroute" and not a.critical
    a = m.from_entry("plan", 3, {"generation": 3, "reason": "rail 0 up", "usable": [0, 1], "routes": 1})
    assert (a.event, a.fields["gained"], a.critical) == ("failback", [0], False)
    a = m.from_entry("plan", 4, {"generation": 4, "reason": "rail 1 down", "usable": [0], "routes": 1})
    assert (a.event, a.fields["lost"], a.fields["gained"], a.critical) == ("failover", [1], [], True)
    assert m.generation == 4


def test_other_kinds():
    m = _m()
    a = m.from_entry("incident", 1, {"source": "kmsg", "domain": "gpu", "device": "0000:91:00.0", "code": "xid:79", "action": "migrate-rank",
                                     "remedy": "drain", "follows": None, "backlog": False, "gpu": 0, "seq": 7, "summary": "fell off",
                                     "t_ns": 1, "notified": True})
    assert a.event == "incident" and a.critical and a.fields["code"] == "xid:79" and a.fields["rail"] is None
    assert "seq" not in a.fields and "t_ns" not in a.fields  # the envelope's own names are not overwritten
    back = m.from_entry("incident", 1, {"domain": "gpu", "code": "xid:48", "backlog": True})
    assert not back.critical
    assert m.from_entry("degraded", 1, {"rail": 1, "loss": 0.2, "samples": 50}).event == "degraded"
    r = m.from_entry("recovered", 1, {"rail": 1, "loss": 0.01, "samples": 50})
    assert (r.event, r.fields["old"], r.fields["netdev"]) == ("recovery", "DEGRADED", "rail1")
    d = m.from_entry("damping", 1, {"rail": 0, "penalty": 3000, "suppressed": True})
    assert d.event == "damping" and d.fields["damping"] == {"penalty": 3000, "suppressed": True}
    p = m.from_entry("peer_rails", 1, {"peer": "h1", "usable": [1], "was": [0, 1], "peer_generation": 3})
    assert (p.event, p.fields["lost"], p.fields["gained"]) == ("peer_rails", [0], [])
    e = m.from_entry("routes_applied", 1, {"generation": 2, "errors": ["EEXIST"], "conflicts": []})
    assert e.event == "route_error" and e.critical


def test_hook_reports():
    m = _m()
    a = m.from_report({"event": "rebuilt", "t_ns": 9, "client_id": 1, "job": "j", "rank": 3, "pid": 77, "epoch": 2, "rail_from": 0}, 50)
    assert (a.event, a.fields["report"], a.fields["rank"], a.fields["detail"]) == ("rebuild", "rebuilt", 3, {"epoch": 2, "rail_from": 0})
    assert a.t_mono_ns == 9  # the report's own time
    mig = m.from_report({"event": "migrating", "job": "j", "rank": 0, "spare": 1}, 50)
    assert mig.event == "migration" and mig.t_mono_ns == 50  # no t_ns in the report: now
    assert m.from_report({"event": "ignored", "job": "j", "rank": 0}, 50) is None
    big = m.from_report({"event": "unmovable", "job": "j", "rank": 0, "reason": "x" * 10000}, 50)
    assert big.fields["detail"] == {"truncated": True}


def test_topic_prefix():
    assert topic_prefix("linkpass/v1/{host}/", "h0") == "linkpass/v1/h0/"
    assert topic_prefix("site/a", "h0") == "site/a/"


def test_compact_state_from_engine_status():
    from linkpass.core.engine import Engine
    cfg = parse_config('[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
                       '[[peers]]\nname = "h1"\nhost_ip = "198.19.0.2"\nrail_ips = { "0" = "198.18.0.2" }\n')
    st = compact_state(Engine(policy_from_config(cfg)).status(0))
    assert st["generation"] == 0 and st["rails"][0]["id"] == 0 and st["rails"][0]["suppressed"] is False
    assert st["peers"] == [{"name": "h1", "usable_rails": None}]
    assert set(st) == {"generation", "applied_generation", "mode", "rails", "peers", "incident_counts"}
    assert mqtt.topology_of(cfg)["peers"][0]["rail_ips"] == {"0": "198.18.0.2"}


def test_events_are_numbered_and_well_formed(tmp_path):
    async def go():
        pub = MqttPublisher(MqttSection(enabled=True), "h0", RAILS, outbox=Outbox(tmp_path / "o.sqlite"))
        pub.on_entries([HistoryEntry("rail", 10, {"rail": 0, "old": "UP", "new": "DOWN", "reason": "rail0 carrier lost"}),
                        HistoryEntry("link_dump", 11, {"reason": "start", "netdevs": 2}),
                        HistoryEntry("plan", 12, {"generation": 2, "reason": "rail 0 down", "usable": [1], "routes": 1})])
        rows = pub.outbox.peek(10)
        assert [r.doc["event"] for r in rows] == ["fault", "failover"]
        assert [r.seq for r in rows] == [1, 2] and [r.doc["seq"] for r in rows] == [1, 2]
        d = rows[0].doc
        assert d["schema"] == "linkpass.event/v1" and d["host"] == "h0" and d["severity"] == "critical"
        assert d["ts"].endswith("Z") and len(d["id"]) == 36 and d["id"] != rows[1].doc["id"]
        assert rows[1].doc["generation"] == 2 and pub.depth() == 2 and pub.dropped_total == 0
        assert json.loads(pub.status_payload("online", "connected"))["status"] == "online"
        pub.outbox.close()
    asyncio.run(go())


def test_unwritable_outbox_falls_back_to_memory(tmp_path, caplog):
    f = tmp_path / "file"
    f.write_text("x")

    async def go():
        pub = MqttPublisher(MqttSection(enabled=True, outbox_path=str(f / "o.sqlite")), "h0", RAILS)
        assert pub.outbox.path == ":memory:"
        assert pub.enqueue(mqtt.Alert("fault", True, {"rail": 0}, 1)) == 1
    asyncio.run(go())
    assert any("in memory only" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- files


def test_password_file_rules(tmp_path):
    p = tmp_path / "pw"
    p.write_text("s3cret\nignored second line\n")
    os.chmod(p, 0o600)
    assert mqtt.read_password_file(str(p)) == "s3cret"
    os.chmod(p, 0o640)  # group-readable (e.g. a linkpass group) is fine
    assert mqtt.read_password_file(str(p)) == "s3cret"
    os.chmod(p, 0o644)
    with pytest.raises(MqttSetupError) as e:
        mqtt.read_password_file(str(p))
    msg = str(e.value)
    assert "mqtt.password_file" in msg and str(p) in msg and "0644" in msg and "\n" not in msg
    with pytest.raises(MqttSetupError, match="no such file"):
        mqtt.read_password_file(str(tmp_path / "nope"))
    e2 = tmp_path / "empty"
    e2.write_text("\n")
    os.chmod(e2, 0o600)
    with pytest.raises(MqttSetupError, match="empty"):
        mqtt.read_password_file(str(e2))
    with pytest.raises(MqttSetupError, match="not a regular file"):
        mqtt.read_password_file(str(tmp_path))


def test_password_file_over_the_limit_is_refused_not_cut(tmp_path):
    p = tmp_path / "pw"
    p.write_bytes(b"x" * (mqtt.MAX_PASSWORD_FILE_BYTES + 1))  # no newline: one huge "first line"
    os.chmod(p, 0o600)
    with pytest.raises(MqttSetupError) as e:
        mqtt.read_password_file(str(p))
    msg = str(e.value)
    assert msg == f"mqtt.password_file {p}: too large ({mqtt.MAX_PASSWORD_FILE_BYTES + 1} bytes; at most {mqtt.MAX_PASSWORD_FILE_BYTES})"
    p.write_bytes(b"s3cret\n\xff\xfe binary after the first line is not read as text\n")
    assert mqtt.read_password_file(str(p)) == "s3cret"


def test_tls_file_errors(tmp_path):
    assert mqtt.build_tls_context(MqttSection()) is None
    assert mqtt.build_tls_context(MqttSection(tls=True)) is not None  # the system's CAs
    with pytest.raises(MqttSetupError, match=r"mqtt.ca_file .*no such file"):
        mqtt.build_tls_context(MqttSection(ca_file=str(tmp_path / "missing.pem")))
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    with pytest.raises(MqttSetupError, match=r"mqtt.ca_file .*not usable"):
        mqtt.build_tls_context(MqttSection(ca_file=str(junk)))
    key = tmp_path / "k.pem"
    key.write_text("junk")
    os.chmod(key, 0o604)
    with pytest.raises(MqttSetupError, match=r"mqtt.key_file .*every user"):
        mqtt.build_tls_context(MqttSection(cert_file=str(junk), key_file=str(key)))
    os.chmod(key, 0o600)
    with pytest.raises(MqttSetupError, match=r"mqtt.cert_file .* not a usable client certificate"):
        mqtt.build_tls_context(MqttSection(cert_file=str(junk), key_file=str(key)))


def test_backoff_is_capped_with_jitter():
    pub = object.__new__(MqttPublisher)
    pub.mc = MqttSection(reconnect_min_s=0.5, reconnect_max_s=4)
    for attempt in range(40):
        for _ in range(20):
            d = pub._backoff(attempt)
            assert 0.5 <= d <= 4
    assert len({round(pub._backoff(10), 6) for _ in range(50)}) > 10  # jitter


def test_config_section():
    cfg = parse_config('[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
                       '[mqtt]\nenabled = true\nprefix = "site/{host}"\n')
    assert cfg.mqtt.enabled and cfg.mqtt.prefix == "site/{host}/" and cfg.mqtt.port == 1883 and cfg.mqtt.qos == 1
    assert MqttSection().outbox_path == "/var/lib/linkpass/outbox.sqlite" and MqttSection().host == "127.0.0.1"
    for name, f in MqttSection.model_fields.items():
        assert f.description, f"[mqtt] {name} has no description"


def test_asyncapi_lists_every_event_type_and_topic():
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "asyncapi.yaml").read_text())
    assert doc["asyncapi"] == "2.6.0"
    assert set(doc["components"]["schemas"]["Event"]["properties"]["event"]["enum"]) == set(mqtt.EVENT_TYPES)
    assert {c.rsplit("/", 1)[1] for c in doc["channels"]} == {"status", "state", "topology", "events"}
    for c in doc["channels"]:
        assert c.startswith("linkpass/v1/{host}/") and c.replace("{host}", "h0").startswith(topic_prefix(MqttSection().prefix, "h0"))
    # every event the mapper can make is a known type
    m = _m()
    made = {m.from_entry(*_rail("UP", "DOWN")).event, m.from_entry(*_rail("DOWN", "UP")).event, m.from_entry(*_rail("UP", "DRAINED")).event}
    assert made <= set(mqtt.EVENT_TYPES)


def test_state_is_marked_only_by_kinds_it_shows(tmp_path):
    async def go():
        pub = MqttPublisher(MqttSection(enabled=True), "h0", RAILS, outbox=Outbox(":memory:"))
        pub._state_dirty = False
        pub.on_entries([HistoryEntry("path", 1, {"rail": 0, "peer": "h1", "old": "UP", "new": "DOWN"}),
                        HistoryEntry("link_dump", 2, {"reason": "start", "netdevs": 2})])
        assert not pub._state_dirty and pub.depth() == 0
        pub.on_entries([HistoryEntry("rail", 3, {"rail": 0, "old": "DOWN", "new": "HOLD_DOWN", "reason": "up"})])
        assert pub._state_dirty and pub.depth() == 1
    asyncio.run(go())


class _Clock:
    """Stands in for the ``time`` module in linkpass.adapters.mqtt: a wall clock we move."""

    def __init__(self, wall_ns: int):
        self.wall_ns = wall_ns
        self.mono_ns = 10**12  # events happen "now": their age is 0

    def time_ns(self) -> int:
        return self.wall_ns

    def time(self) -> float:
        return self.wall_ns / 1e9

    def monotonic_ns(self) -> int:
        return self.mono_ns

    def monotonic(self) -> float:
        return self.mono_ns / 1e9


def test_event_ts_never_decreases_with_seq(tmp_path, monkeypatch, caplog):
    """The wall clock going back (1 µs of jitter, then a 5 s step) never makes an event's ts
    earlier than the one before it, also after a restart on the same outbox."""
    clock = _Clock(1_800_000_000_000_000_000)
    monkeypatch.setattr(mqtt, "time", clock)
    path = tmp_path / "o.sqlite"

    def docs(pub):
        return [r.doc for r in pub.outbox.peek(100)]

    async def go():
        pub = MqttPublisher(MqttSection(enabled=True), "h0", RAILS, outbox=Outbox(path))
        for step_ns in (0, 1000, -1000, 2000, -5_000_000_000, 1000, 7_000_000_000):
            clock.wall_ns += step_ns
            pub.enqueue(mqtt.Alert("fault", True, {"rail": 0}, clock.monotonic_ns()))
        got = docs(pub)
        pub.outbox.close()
        return got
    first = asyncio.run(go())
    ts = [d["ts"] for d in first]
    assert [d["seq"] for d in first] == list(range(1, 8))
    assert ts == sorted(ts), ts
    assert ts[2] == ts[1] and ts[4] == ts[3] == ts[5]  # clamped, not invented
    assert ts[0] == "2027-01-15T08:00:00.000000Z" and ts[1] == "2027-01-15T08:00:00.000001Z"
    assert ts[6] > ts[5]  # back to the real time once the clock is past the last ts
    warned = [r.getMessage() for r in caplog.records if "wall clock" in r.getMessage()]
    assert len(warned) == 1 and "5.0 s behind" in warned[0], warned  # the step, not the 1 µs jitter

    async def again():  # restarted daemon, clock set back: still no earlier ts than the last one
        clock.wall_ns -= 60_000_000_000
        pub = MqttPublisher(MqttSection(enabled=True), "h0", RAILS, outbox=Outbox(path))
        pub.enqueue(mqtt.Alert("recovery", False, {"rail": 0}, clock.monotonic_ns()))
        got = docs(pub)
        pub.outbox.close()
        return got
    after = asyncio.run(again())
    assert after[-1]["seq"] == 8 and after[-1]["ts"] == ts[-1]


def test_event_ts_is_when_it_happened():
    """ts = wall clock now minus the event's monotonic age, exact to the microsecond."""
    import time

    async def go():
        pub = MqttPublisher(MqttSection(enabled=True), "h0", RAILS, outbox=Outbox(":memory:"))
        before = time.time_ns()
        pub.enqueue(mqtt.Alert("fault", True, {"rail": 0}, time.monotonic_ns() - 3_000_000_000))  # 3 s ago
        after = time.time_ns()
        return pub.outbox.peek(1)[0].doc["ts"], before, after
    ts, before, after = asyncio.run(go())
    assert mqtt.utc_ts_us((before - 3_000_000_000) // 1000 - 1000) <= ts <= mqtt.utc_ts_us((after - 3_000_000_000) // 1000 + 1000)


def test_utc_ts_us_and_broker_address():
    assert mqtt.utc_ts_us(0) == "1970-01-01T00:00:00.000000Z"
    assert mqtt.utc_ts_us(1_800_000_000_123_456) == "2027-01-15T08:00:00.123456Z"
    assert mqtt.utc_ts_us(1_800_000_000_123_456) == mqtt.utc_ts(1_800_000_000.123456)
    assert mqtt.broker_address("::1", 1883) == "[::1]:1883"
    assert mqtt.broker_address("fd00::5", 8883) == "[fd00::5]:8883"
    assert mqtt.broker_address("127.0.0.1", 1883) == "127.0.0.1:1883"
    assert mqtt.broker_address("mqtt.example.net", 8883) == "mqtt.example.net:8883"


def test_status_shows_ipv6_broker_in_brackets():
    async def go():
        pub = MqttPublisher(MqttSection(enabled=True, host="::1"), "h0", RAILS, outbox=Outbox(":memory:"))
        return pub.status()["broker"]
    assert asyncio.run(go()) == "[::1]:1883"


def test_last_will_payload_says_it_is_the_will():
    async def go():
        pub = MqttPublisher(MqttSection(enabled=True), "h0", RAILS, outbox=Outbox(":memory:"))
        return json.loads(pub._will().payload)
    will = asyncio.run(go())
    assert will["status"] == "offline" and will["reason"] == mqtt.WILL_REASON == "connection lost (last will)"
