"""The MQTT publisher against a real Mosquitto broker on a loopback port (no namespaces needed):
QoS 1 events and retained messages, MQTT 5 properties, real payloads against
deploy/asyncapi.yaml, a broker outage, a publisher restart with a full outbox, the 3.1.1
fallback, wrong passwords and bad TLS files, TLS with a client certificate, `alerts tail`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from linkpass.adapters.mqtt import Alert, MqttPublisher
from linkpass.adapters.outbox import Outbox
from linkpass.config import MqttSection
from linkpass.core.model import HistoryEntry

from .mosquitto import HAVE_MOSQUITTO, Mosquitto, Subscriber, dedup, make_tls, wait_for

pytestmark = pytest.mark.skipif(not HAVE_MOSQUITTO, reason="needs mosquitto, mosquitto_sub, mosquitto_passwd (Debian: mosquitto, mosquitto-clients)")

ROOT = Path(__file__).resolve().parents[2]
RAILS = {0: "rail0", 1: "rail1"}
STATE = {"generation": 3, "applied_generation": 3, "mode": "host-ip",
         "rails": [{"id": 0, "netdev": "rail0", "state": "DOWN", "usable": False, "reason": "carrier lost", "degraded": False,
                    "probe_loss": None, "suppressed": False},
                   {"id": 1, "netdev": "rail1", "state": "UP", "usable": True, "reason": "rail1 up", "degraded": False,
                    "probe_loss": 0.0, "suppressed": False}],
         "peers": [{"name": "h1", "usable_rails": [0, 1]}], "incident_counts": {"gpu": 1}}
TOPO = {"mode": "host-ip", "host_ip": "198.19.0.1", "source": "config",
        "rails": [{"id": 0, "netdev": "rail0", "address": None}, {"id": 1, "netdev": "rail1", "address": None}],
        "peers": [{"name": "h1", "host_ip": "198.19.0.2", "rail_ips": {"0": "198.18.0.2", "1": "198.18.1.2"}}]}

#: one history entry of every kind that becomes an event (and some that do not)
ENTRIES = [
    HistoryEntry("link_dump", 1, {"reason": "start", "netdevs": 2}),
    HistoryEntry("rail", 2, {"rail": 0, "old": "UNKNOWN", "new": "UP", "reason": "rail0 up"}),
    HistoryEntry("plan", 3, {"generation": 1, "reason": "start", "usable": [0, 1], "routes": 1}),
    HistoryEntry("rail", 4, {"rail": 0, "old": "UP", "new": "DOWN", "reason": "rail0 carrier lost", "event_t_ns": 3}),
    HistoryEntry("plan", 5, {"generation": 2, "reason": "rail 0 down", "usable": [1], "routes": 1}),
    HistoryEntry("peer_rails", 6, {"peer": "h1", "usable": [1], "was": [0, 1], "peer_generation": 4}),
    HistoryEntry("plan", 7, {"generation": 3, "reason": "peer h1 rails changed", "usable": [1], "routes": 1}),
    HistoryEntry("rail", 8, {"rail": 0, "old": "DOWN", "new": "HOLD_DOWN", "reason": "rail0 up"}),
    HistoryEntry("rail", 9, {"rail": 0, "old": "HOLD_DOWN", "new": "UP", "reason": "hold-down over"}),
    HistoryEntry("plan", 10, {"generation": 4, "reason": "rail 0 up", "usable": [0, 1], "routes": 1}),
    HistoryEntry("degraded", 11, {"rail": 1, "loss": 0.25, "samples": 80}),
    HistoryEntry("recovered", 12, {"rail": 1, "loss": 0.01, "samples": 80}),
    HistoryEntry("damping", 13, {"rail": 0, "penalty": 2600.0, "suppressed": True, "release_at_ns": 99, "release_in_ms": 5.0,
                                 "downs": 3, "limits": {"penalty": 1000}}),
    HistoryEntry("rail", 14, {"rail": 1, "old": "UP", "new": "DRAINED", "reason": "drained"}),
    HistoryEntry("incident", 15, {"source": "kmsg", "domain": "gpu", "device": "0000:91:00.0", "code": "xid:79",
                                  "action": "migrate-rank", "remedy": "replace GPU", "follows": None, "backlog": False, "gpu": 0,
                                  "seq": 12, "summary": "GPU has fallen off the bus", "t_ns": 15, "notified": True}),
    HistoryEntry("routes_applied", 16, {"generation": 4, "replaced": 1, "deleted": 0, "errors": ["RTNETLINK: File exists"], "conflicts": []}),
    HistoryEntry("path", 17, {"rail": 0, "peer": "h1", "old": "UP", "new": "DOWN"}),
]
REPORTS = [
    {"event": "rebuilt", "t_ns": 20, "client_id": 1, "job": "j1", "rank": 1, "pid": 4242, "epoch": 2, "trigger": "notice", "rail_from": 0},
    {"event": "migrating", "t_ns": 21, "client_id": 2, "job": "j1", "rank": 0, "pid": 4243, "reason": "xid:79", "spare": 1, "epoch": 3},
]
EXPECTED = ["fault", "failover", "peer_rails", "reroute", "recovery", "recovery", "failback", "degraded", "recovery", "damping",
            "drain", "incident", "route_error", "rebuild", "migration"]


@pytest.fixture
def broker(tmp_path):
    b = Mosquitto(tmp_path / "broker").start()
    yield b
    b.close()


def _section(b: Mosquitto, tmp: Path, **kw) -> MqttSection:
    kw.setdefault("outbox_path", str(tmp / "outbox.sqlite"))
    return MqttSection(enabled=True, host=b.host, port=b.port, reconnect_min_s=0.1, reconnect_max_s=0.5, **kw)


def _publisher(mc: MqttSection) -> MqttPublisher:
    return MqttPublisher(mc, "h0", RAILS, state_fn=lambda: dict(STATE), topology_fn=lambda: dict(TOPO))


async def _until(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def _asyncapi_validators() -> dict:
    """Schema validators (jsonschema, Draft 7 as AsyncAPI 2.x schemas are) for every message of
    deploy/asyncapi.yaml, by the channel's last topic level."""
    import jsonschema
    import yaml
    from referencing import Registry
    from referencing.jsonschema import DRAFT7

    doc = yaml.safe_load((ROOT / "deploy" / "asyncapi.yaml").read_text())
    assert doc["asyncapi"].startswith("2.6")
    registry = Registry().with_resource("urn:linkpass:asyncapi", DRAFT7.create_resource(doc))
    out = {}
    for channel, item in doc["channels"].items():
        ref = item["subscribe"]["message"]["$ref"]
        msg = doc["components"]["messages"][ref.rsplit("/", 1)[1]]
        schema = {"$ref": "urn:linkpass:asyncapi" + msg["payload"]["$ref"]}
        v = jsonschema.Draft7Validator(schema, registry=registry, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
        out[channel.rsplit("/", 1)[1]] = v
    assert set(out) == {"status", "state", "topology", "events"}
    return out


def validate_against_asyncapi(messages: list[dict]) -> int:
    """Validate every captured message's payload against its channel's schema; returns how many."""
    vals = _asyncapi_validators()
    n = 0
    for m in messages:
        kind = m["topic"].rsplit("/", 1)[1]
        errors = sorted(vals[kind].iter_errors(m["payload"]), key=str)
        assert not errors, f"{m['topic']} payload {m['payload']} does not match deploy/asyncapi.yaml: {errors[0].message} at {list(errors[0].path)}"
        n += 1
    return n


def test_events_qos1_retained_state_properties_and_asyncapi(broker, tmp_path):
    sub = Subscriber(broker, ["linkpass/v1/h0/#"], client_id="t-live")
    sub.wait_connected()

    async def go():
        pub = _publisher(_section(broker, tmp_path))
        pub.start()
        await _until(lambda: pub.connected, what="connect")
        pub.on_entries(ENTRIES)
        for r in REPORTS:
            pub.on_hook_report(r)
        await _until(lambda: pub.depth() == 0, what="outbox drained")
        await _until(lambda: len(sub.on("events")) >= len(EXPECTED), what="events at the subscriber")
        await pub.close()
        return pub
    pub = asyncio.run(go())
    events = sub.on("events")
    assert [m["payload"]["event"] for m in events] == EXPECTED
    assert [m["payload"]["seq"] for m in events] == list(range(1, len(EXPECTED) + 1))
    assert [m["payload"]["ts"] for m in events] == sorted(m["payload"]["ts"] for m in events)  # ts follows seq
    assert all(m["qos"] == 1 and not m["retain"] for m in events)
    props = events[0]["properties"]
    assert props["user-properties"]["id"] == events[0]["payload"]["id"]
    assert props["user-properties"]["event"] == "fault" and props["user-properties"]["seq"] == "1"
    assert 0 < props["message-expiry-interval"] <= 86400
    assert props["content-type"] == "application/json"
    assert events[0]["payload"]["generation"] == 1 and events[1]["payload"]["lost"] == [0]
    statuses = [m["payload"]["status"] for m in sub.on("status")]
    assert statuses[0] == "online" and statuses[-1] == "offline"
    assert pub.counters["published"] == len(EXPECTED) and pub.protocol == "5"
    sub.close()
    # the retained messages a newcomer gets at once
    late = Subscriber(broker, ["linkpass/v1/h0/status", "linkpass/v1/h0/state", "linkpass/v1/h0/topology"], persistent=False)
    late.wait_connected()
    wait_for(lambda: len(late.messages()) >= 3, what="retained messages")
    got = {m["topic"].rsplit("/", 1)[1]: m for m in late.messages()}
    assert all(m["retain"] and m["qos"] == 1 for m in got.values())
    assert got["status"]["payload"]["status"] == "offline" and got["status"]["payload"]["reason"] == "daemon stopped"
    assert got["state"]["payload"]["generation"] == 3 and got["state"]["payload"]["rails"][0]["state"] == "DOWN"
    assert got["state"]["payload"]["outbox"] == {"depth": 0, "dropped_total": 0}
    assert got["topology"]["payload"]["peers"][0]["name"] == "h1"
    late.close()
    # every real payload (events of every type, status online and offline, state, topology)
    assert validate_against_asyncapi(sub.messages() + late.messages()) >= len(EXPECTED) + 5


def test_broker_outage_then_publisher_restart_sends_everything_once_in_order(broker, tmp_path):
    """Events queued while the broker is down arrive after it is back; events still queued when
    the publisher stops arrive from the next publisher on the same outbox; de-duplicated by id,
    the seq numbers are 1..N in order."""
    sub = Subscriber(broker, ["linkpass/v1/h0/events"], client_id="t-outage")
    sub.wait_connected()
    mc = _section(broker, tmp_path)

    async def first():
        pub = _publisher(mc)
        pub.start()
        await _until(lambda: pub.connected, what="connect")
        for i in range(5):
            pub.enqueue(Alert("fault", True, {"rail": 0, "i": i}, time.monotonic_ns()))
        await _until(lambda: pub.depth() == 0, what="first events acknowledged")
        broker.stop()
        await _until(lambda: not pub.connected, what="publisher to notice the outage")
        for i in range(5, 25):
            pub.enqueue(Alert("fault", True, {"rail": 0, "i": i}, time.monotonic_ns()))
        assert pub.depth() == 20
        broker.start()
        await _until(lambda: pub.depth() == 0, timeout=20, what="outbox drained after the outage")
        assert pub.counters["disconnects"] == 1 and pub.counters["connects"] == 2
        broker.stop()  # and down again: these wait in the outbox when the publisher stops
        await _until(lambda: not pub.connected, what="second outage noticed")
        for i in range(25, 40):
            pub.enqueue(Alert("fault", True, {"rail": 0, "i": i}, time.monotonic_ns()))
        await pub.close()

    async def second():
        pub = _publisher(mc)
        assert pub.depth() == 15
        pub.start()
        await _until(lambda: pub.depth() == 0, timeout=20, what="the restarted publisher to send the old events")
        assert pub.enqueue(Alert("recovery", False, {"rail": 0, "i": 40}, time.monotonic_ns())) == 41
        await _until(lambda: pub.depth() == 0, what="the new event")
        await pub.close()

    asyncio.run(first())
    broker.start()
    asyncio.run(second())
    wait_for(lambda: len(dedup(sub.on("events"))) >= 41, timeout=20, what="41 distinct events")
    got = dedup(sub.on("events"))
    assert [p["seq"] for p in got] == list(range(1, 42))
    assert [p["i"] for p in got] == list(range(41))
    sub.close()


def test_full_outbox_drops_oldest_non_critical_and_counts(broker, tmp_path):
    broker.stop()
    mc = _section(broker, tmp_path, outbox_max_events=10)

    async def go():
        pub = _publisher(mc)
        pub.start()
        for i in range(12):
            pub.enqueue(Alert("recovery" if i % 2 else "fault", i % 2 == 0, {"rail": 0, "i": i}, time.monotonic_ns()))
        assert pub.depth() == 10 and pub.dropped_total == 2 and pub.dropped == 2
        st = pub.status()
        assert st["outbox"]["dropped_total"] == 2 and not st["connected"]
        await pub.close()
        kept = Outbox(mc.outbox_path)
        assert [r.doc["i"] for r in kept.peek(20)] == [0, 2, 4, 5, 6, 7, 8, 9, 10, 11]  # recoveries 1 and 3 went first
        kept.close()
    asyncio.run(go())


class _V3OnlyProxy:
    """A TCP proxy in front of mosquitto that answers an MQTT 5 CONNECT like a 3.1.1-only broker
    (CONNACK return code 1, "unacceptable protocol version", MQTT 3.1.1 section 3.2.2.3) and
    passes every other connection through."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.levels: list[int] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self._stop = False
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def _serve(self):
        self.srv.settimeout(0.2)
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket):
        c.settimeout(5)
        first = c.recv(65536)
        # fixed header (1 byte + varint length), then protocol name (2-byte length + "MQTT"), then the level
        i = 1
        while first[i] & 0x80:
            i += 1
        i += 1
        name_len = int.from_bytes(first[i:i + 2], "big")
        level = first[i + 2 + name_len]
        self.levels.append(level)
        if level == 5:
            c.sendall(b"\x20\x02\x00\x01")
            c.close()
            return
        up = socket.create_connection(self.target)
        up.sendall(first)
        c.settimeout(None)
        socks = [c, up]
        try:
            while True:
                r, _, _ = select.select(socks, [], [], 0.5)
                if self._stop:
                    return
                for s in r:
                    data = s.recv(65536)
                    if not data:
                        return
                    (up if s is c else c).sendall(data)
        except OSError:
            return
        finally:
            c.close()
            up.close()

    def close(self):
        self._stop = True
        self.srv.close()


def test_falls_back_to_mqtt_311_when_the_broker_refuses_5(broker, tmp_path, caplog):
    proxy = _V3OnlyProxy((broker.host, broker.port))
    sub = Subscriber(broker, ["linkpass/v1/h0/events"], client_id="t-v3")
    sub.wait_connected()
    mc = MqttSection(enabled=True, host="127.0.0.1", port=proxy.port, outbox_path=str(tmp_path / "o.sqlite"),
                     reconnect_min_s=0.1, reconnect_max_s=0.5)

    async def go():
        pub = _publisher(mc)
        pub.start()
        await _until(lambda: pub.connected, what="connect over 3.1.1")
        pub.enqueue(Alert("fault", True, {"rail": 0}, time.monotonic_ns()))
        await _until(lambda: pub.depth() == 0, what="event acknowledged")
        await pub.close()
        return pub
    with caplog.at_level(logging.WARNING, "linkpass.mqtt"):
        pub = asyncio.run(go())
    proxy.close()
    assert pub.protocol == "3.1.1" and proxy.levels[:2] == [5, 4]
    assert any("refuses MQTT 5" in r.getMessage() for r in caplog.records)
    wait_for(lambda: sub.on("events"), what="the event through the 3.1.1 connection")
    ev = sub.on("events")[0]
    assert ev["payload"]["event"] == "fault" and ev["qos"] == 1 and "user-properties" not in (ev.get("properties") or {})
    sub.close()


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("linkpass.mqtt")]


def test_wrong_password_is_one_clear_error_and_events_wait(tmp_path, caplog):
    b = Mosquitto(tmp_path / "broker", users={"linkpass": "right-password"}).start()
    pw = tmp_path / "pw"
    pw.write_text("wrong-password\n")
    os.chmod(pw, 0o600)
    mc = _section(b, tmp_path, username="linkpass", password_file=str(pw))

    async def go():
        pub = _publisher(mc)
        pub.start()
        pub.enqueue(Alert("fault", True, {"rail": 0}, time.monotonic_ns()))
        await _until(lambda: pub.counters["connect_failures"] >= 3, what="several refused attempts")
        assert not pub.connected and pub.depth() == 1
        errs = _errors(caplog)
        assert len(errs) == 1, errs  # one clear error, not one per attempt
        assert "refused" in errs[0] and "password" in errs[0] and "\n" not in errs[0]
        # the operator fixes the file: picked up at the next attempt, the event goes out
        pw.write_text("right-password\n")
        await _until(lambda: pub.depth() == 0, what="event sent after the fix")
        assert pub.last_error is None
        await pub.close()
    try:
        asyncio.run(go())
    finally:
        b.close()


def test_world_readable_password_file_is_refused(broker, tmp_path, caplog):
    pw = tmp_path / "pw"
    pw.write_text("whatever\n")
    os.chmod(pw, 0o644)
    mc = _section(broker, tmp_path, username="u", password_file=str(pw))

    async def go():
        pub = _publisher(mc)
        pub.start()
        await _until(lambda: pub.counters["connect_failures"] + pub.counters["setup_errors"] >= 3, what="three failed attempts")
        assert not pub.connected and pub.counters["connects"] == 0
        await pub.close()
    asyncio.run(go())
    errs = _errors(caplog)
    assert len(errs) == 1 and f"mqtt.password_file {pw}" in errs[0] and "0644" in errs[0], errs


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    try:
        return make_tls(tmp_path_factory.mktemp("tls"))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"openssl cannot make test certificates: {e}")


def test_tls_with_client_certificate(tmp_path, tls_files):
    t = tls_files
    b = Mosquitto(tmp_path / "broker", tls={"cafile": t["ca"], "certfile": t["server_cert"], "keyfile": t["server_key"],
                                           "require_certificate": True}).start()
    mc = _section(b, tmp_path, ca_file=t["ca"], cert_file=t["client_cert"], key_file=t["client_key"])

    async def go():
        pub = _publisher(mc)
        pub.start()
        await _until(lambda: pub.connected, what="TLS connect")
        pub.enqueue(Alert("fault", True, {"rail": 0}, time.monotonic_ns()))
        await _until(lambda: pub.depth() == 0, what="event over TLS")
        await pub.close()
    try:
        asyncio.run(go())
    finally:
        b.close()


@pytest.mark.parametrize("bad", ["missing-ca", "wrong-ca", "world-readable-key"])
def test_bad_tls_files_are_one_clear_error(tmp_path, tls_files, caplog, bad):
    t = tls_files
    b = Mosquitto(tmp_path / "broker", tls={"cafile": t["ca"], "certfile": t["server_cert"], "keyfile": t["server_key"]}).start()
    kw = {"ca_file": t["ca"]}
    if bad == "missing-ca":
        kw["ca_file"] = str(tmp_path / "no-such-ca.pem")
        expect = "mqtt.ca_file"
    elif bad == "wrong-ca":
        other = make_tls(tmp_path / "other")
        kw["ca_file"] = other["ca"]
        expect = "certificate verify failed"
    else:
        key = tmp_path / "client.key"
        key.write_bytes(Path(t["client_key"]).read_bytes())
        os.chmod(key, 0o644)
        kw.update(cert_file=t["client_cert"], key_file=str(key))
        expect = "mqtt.key_file"
    mc = _section(b, tmp_path, **kw)

    async def go():
        pub = _publisher(mc)
        pub.start()
        pub.enqueue(Alert("fault", True, {"rail": 0}, time.monotonic_ns()))
        await _until(lambda: pub.counters["connect_failures"] + pub.counters["setup_errors"] >= 3,
                     what="three failed attempts (0.1-0.5 s backoff)")
        assert not pub.connected and pub.depth() == 1
        await pub.close()
    try:
        asyncio.run(go())
    finally:
        b.close()
    errs = _errors(caplog)
    assert len(errs) == 1, errs
    assert expect in errs[0] and "\n" not in errs[0], errs
    assert "Traceback" not in caplog.text


def test_alerts_tail_prints_events_once(broker, tmp_path):
    cfg = tmp_path / "lp.toml"
    cfg.write_text('[daemon]\nhost = "h9"\nhost_ip = "198.19.0.9"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
                   f'[mqtt]\nenabled = true\nhost = "127.0.0.1"\nport = {broker.port}\n')
    env = dict(os.environ, COLUMNS="200")
    json_tail = subprocess.Popen([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--config", str(cfg), "--host", "h0",
                                  "--json", "--count", "4", "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env)
    text_tail = subprocess.Popen([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", broker.address,
                                  "--count", "4", "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    broker.wait_subscribed("linkpass/v1/h0/events")
    broker.wait_subscribed("linkpass/v1/+/events")

    async def go():
        pub = _publisher(_section(broker, tmp_path))
        pub.start()
        await _until(lambda: pub.connected, what="connect")
        pub.on_entries(ENTRIES[:5])  # fault, failover
        await _until(lambda: pub.depth() == 0, what="sent")
        pub.on_hook_report(REPORTS[1])
        pub.enqueue(Alert("fault", True, {"rail": 1, "netdev": "rail1", "old": "UP", "new": "DOWN", "reason": "blackhole"}, time.monotonic_ns()))
        await _until(lambda: pub.depth() == 0, what="sent")
        await pub.close()
    asyncio.run(go())
    out_j, err_j = json_tail.communicate(timeout=30)
    out_t, err_t = text_tail.communicate(timeout=30)
    assert json_tail.returncode == 0, err_j
    docs = [json.loads(line) for line in out_j.splitlines()]
    assert [d["event"] for d in docs] == ["fault", "failover", "migration", "fault"]
    assert len({d["id"] for d in docs}) == 4
    assert text_tail.returncode == 0, err_t
    lines = out_t.splitlines()
    assert len(lines) == 4, out_t
    assert "FAULT" in lines[0] and "rail 0 (rail0) UP -> DOWN" in lines[0] and " h0 " in lines[0]
    assert "FAILOVER" in lines[1] and "lost [0]" in lines[1]
    assert "MIGRATION" in lines[2] and "job j1 rank 0: migrating" in lines[2]


def test_alerts_tail_dedups_and_errors(broker, tmp_path):
    tail = subprocess.Popen([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", broker.address, "--json",
                             "--timeout", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    broker.wait_subscribed("linkpass/v1/+/events")
    doc = {"schema": "linkpass.event/v1", "id": "6f1c2d4e-8a8b-4c1e-9d7e-2b1f0c3a4d5e", "host": "hx", "seq": 1,
           "ts": "2026-01-01T00:00:00.000000Z", "event": "fault"}
    for _ in range(2):
        subprocess.run(["mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-q", "1", "-t", "linkpass/v1/hx/events",
                        "-m", json.dumps(doc)], check=True)
    subprocess.run(["mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-q", "1", "-t", "linkpass/v1/hx/events",
                    "-m", "not json"], check=True)
    out, err = tail.communicate(timeout=20)
    assert tail.returncode == 0
    assert [json.loads(line)["id"] for line in out.splitlines()] == [doc["id"]]
    assert "not JSON; skipped" in err
    # nothing listens: one line, exit 3, no traceback
    dead = subprocess.run([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", "127.0.0.1:1", "--timeout", "2"],
                          capture_output=True, text=True, timeout=30)
    assert dead.returncode == 3 and dead.stderr.startswith("linkpass: alerts: cannot connect to broker 127.0.0.1:1")
    assert "Traceback" not in dead.stderr and dead.stderr.count("\n") == 1
    bad = subprocess.run([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", "127.0.0.1:notaport"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "port must be" in bad.stderr


def test_a_failing_state_builder_costs_no_events(broker, tmp_path, caplog):
    def broken():
        raise KeyError("rails")

    async def go():
        pub = MqttPublisher(_section(broker, tmp_path), "h0", RAILS, state_fn=broken, topology_fn=lambda: dict(TOPO))
        pub.start()
        await _until(lambda: pub.connected, what="connect")
        pub.on_entries(ENTRIES[:5])
        await _until(lambda: pub.depth() == 0, what="events sent despite the broken state")
        assert pub.connected and pub.counters["disconnects"] == 0
        await pub.close()
    asyncio.run(go())
    errs = _errors(caplog)
    assert len(errs) == 1 and "cannot build the state message" in errs[0]


# ---------------------------------------------------------------- alerts tail: sessions, the will, connect errors


def _tail(out: Path, *args: str) -> subprocess.Popen:
    """``linkpass alerts tail ARGS`` with stdout to ``out`` (read while it runs)."""
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "linkpass.cli", "alerts", "tail", *args], stdout=f,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, COLUMNS="250"))


def _json_lines(path: Path) -> list[dict]:
    """The complete JSON lines a ``--json`` tail wrote so far."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _stop(p: subprocess.Popen) -> tuple[int, str]:
    """Interrupt a tail (Ctrl-C) and return (exit status, stderr)."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=5)
    return p.returncode, err


def test_alerts_tail_session_gets_every_event_across_a_broker_restart(broker, tmp_path):
    """Events published while the broker restarts reach `alerts tail --session NAME`, also when
    the publisher drained its outbox before the tail was back: tail A runs through the outage
    (it reconnects), tail B is stopped before it and started again only after the publisher
    has sent everything.  A clean-session tail started then (no --session) gets none of it:
    that is what --session is for."""
    addr = broker.address
    a = _tail(tmp_path / "a.jsonl", "--broker", addr, "--json", "--session", "t-noc-a", "--timeout", "60")
    b1 = _tail(tmp_path / "b1.jsonl", "--broker", addr, "--json", "--session", "t-noc-b", "--timeout", "60")
    procs = [a, b1]
    try:
        broker.wait_subscribed("linkpass/v1/+/events", client_id="t-noc-a")
        broker.wait_subscribed("linkpass/v1/+/events", client_id="t-noc-b")

        async def go():
            pub = _publisher(_section(broker, tmp_path))
            pub.start()
            await _until(lambda: pub.connected, what="connect")
            for i in range(3):
                pub.enqueue(Alert("fault", True, {"rail": 0, "i": i}, time.monotonic_ns()))
            await _until(lambda: pub.depth() == 0, what="first events acknowledged")
            await _until(lambda: len(_json_lines(tmp_path / "b1.jsonl")) >= 3, what="tail B printed the first events")
            rc, err = await asyncio.to_thread(_stop, b1)  # B goes away before the outage
            assert rc == 0, err
            broker.stop()
            await _until(lambda: not pub.connected, what="publisher to notice the outage")
            for i in range(3, 10):  # events while the broker is down
                pub.enqueue(Alert("fault", True, {"rail": 0, "i": i}, time.monotonic_ns()))
            await asyncio.sleep(1.0)  # a short outage
            broker.start()
            await _until(lambda: pub.depth() == 0, timeout=20, what="outbox drained after the restart")
            await pub.close()
        asyncio.run(go())
        # only now, with everything already at the broker, B comes back, and a clean-session tail starts
        b2 = _tail(tmp_path / "b2.jsonl", "--broker", addr, "--json", "--session", "t-noc-b", "--timeout", "60")
        procs.append(b2)
        broker.wait_subscribed("linkpass/v1/+/events", count=2, client_id="t-noc-b", timeout=60)
        # the clean-session tail must really be subscribed before it is judged (under load its
        # start-up alone can take seconds): it ends by itself, --timeout after it started
        n0 = broker.subscriptions("linkpass/v1/+/events")
        c = _tail(tmp_path / "c.jsonl", "--broker", addr, "--json", "--timeout", "5")
        procs.append(c)
        broker.wait_subscribed("linkpass/v1/+/events", count=n0 + 1, timeout=60)
        want = list(range(1, 11))

        def b_seqs():
            return [d["seq"] for d in dedup([{"payload": d} for d in _json_lines(tmp_path / "b1.jsonl") + _json_lines(tmp_path / "b2.jsonl")])]
        wait_for(lambda: b_seqs() == want, timeout=20, what="tail B (restarted, same session) to have events 1..10")
        wait_for(lambda: len(_json_lines(tmp_path / "a.jsonl")) >= 10, timeout=20, what="tail A to have 10 events")
        try:
            _, err_c = c.communicate(timeout=60)
            rc_c = c.returncode
        except subprocess.TimeoutExpired:
            rc_c, err_c = _stop(c)
        rc_a, err_a = _stop(a)
        rc_b, err_b = _stop(b2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=5)
    got_a = _json_lines(tmp_path / "a.jsonl")
    assert [d["seq"] for d in got_a] == want, got_a  # once each, in order, nothing missed
    assert [d["i"] for d in got_a] == list(range(10))
    assert rc_a == 0 and "reconnected to" in err_a and "session t-noc-a" in err_a, err_a
    assert "Traceback" not in err_a + err_b
    assert b_seqs() == want and rc_b == 0
    assert [d["seq"] for d in _json_lines(tmp_path / "b2.jsonl")][-7:] == list(range(4, 11))
    # without a session nothing of it comes: the broker had delivered everything before this tail was there
    assert rc_c == 0 and _json_lines(tmp_path / "c.jsonl") == [], err_c


def test_alerts_tail_status_shows_the_last_will_as_such(broker, tmp_path):
    """A publisher killed with SIGKILL: the broker publishes its will, whose ts is its connect
    time (before the online message).  `alerts tail --status` does not show it as the time of
    the loss: live, at the time it arrived; retained, with no time."""
    sub = Subscriber(broker, ["linkpass/v1/h0/status"], client_id="t-will")
    sub.wait_connected()
    live = _tail(tmp_path / "live.txt", "--broker", broker.address, "--host", "h0", "--status", "--timeout", "30")
    try:
        broker.wait_subscribed("linkpass/v1/h0/status", count=2)
        script = (
            "import asyncio, os, signal\n"
            "from linkpass.adapters.mqtt import MqttPublisher\n"
            "from linkpass.config import MqttSection\n"
            "async def main():\n"
            f"    pub = MqttPublisher(MqttSection(enabled=True, host={broker.host!r}, port={broker.port}, "
            f"outbox_path={str(tmp_path / 'will.sqlite')!r}), 'h0', {{0: 'rail0'}})\n"
            "    pub.start()\n"
            "    while pub.counters['connects'] == 0:\n"
            "        await asyncio.sleep(0.02)\n"
            "    await asyncio.sleep(0.5)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "asyncio.run(main())\n")
        killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        wait_for(lambda: "OFFLINE" in (tmp_path / "live.txt").read_text(), what="the will at the tail")
        rc, err = _stop(live)
    finally:
        if live.poll() is None:
            live.kill()
            live.communicate(timeout=5)
    msgs = [m["payload"] for m in sub.on("/status")]
    assert [m["status"] for m in msgs] == ["online", "offline"] and msgs[1]["reason"] == "connection lost (last will)"
    online, will = msgs
    assert will["ts"] < online["ts"]  # the will was composed at connect: why the tail words it so
    lines = (tmp_path / "live.txt").read_text().splitlines()
    assert rc == 0 and len(lines) == 2, (lines, err)
    assert lines[0].startswith(online["ts"]) and "ONLINE" in lines[0]
    when = lines[1].split()[0]
    assert "OFFLINE" in lines[1] and when >= online["ts"], lines[1]  # shown when it arrived
    assert f"connection lost (last will, set at connect {will['ts']};" in lines[1]
    # a tail started later gets the retained will: no time for it
    late = subprocess.run([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", broker.address, "--host", "h0",
                           "--status", "--timeout", "1.5"], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, COLUMNS="250"))
    assert late.returncode == 0, late.stderr
    (line,) = late.stdout.splitlines()
    assert line.startswith("- ") and "OFFLINE" in line and f"set at connect {will['ts']}; retained" in line
    sub.close()


def test_alerts_tail_against_a_tls_port_is_one_clear_line(tmp_path, tls_files):
    t = tls_files
    b = Mosquitto(tmp_path / "broker", tls={"cafile": t["ca"], "certfile": t["server_cert"], "keyfile": t["server_key"]}).start()
    try:
        r = subprocess.run([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", b.address, "--timeout", "30"],
                           capture_output=True, text=True, timeout=60)
    finally:
        b.close()
    assert r.returncode == 3 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr  # no stray library log line
    assert r.stderr.startswith(f"linkpass: alerts: cannot connect to broker {b.address}: connection "), r.stderr
    assert "before the broker answered MQTT CONNECT (a TLS port? use --config with [mqtt] tls" in r.stderr
    assert "failed to receive" not in r.stderr and "timed out" not in r.stderr
    # an IPv6 broker is written [ADDRESS]:PORT
    v6 = subprocess.run([sys.executable, "-m", "linkpass.cli", "alerts", "tail", "--broker", "[::1]:1", "--timeout", "5"],
                        capture_output=True, text=True, timeout=60)
    assert v6.returncode == 3 and v6.stderr.startswith("linkpass: alerts: cannot connect to broker [::1]:1: "), v6.stderr
    assert v6.stderr.count("\n") == 1


def test_alerts_tail_gives_way_when_its_session_is_taken_over(broker, tmp_path):
    """Two tails with one --session NAME would throw each other off the broker forever (and
    each would see only some of the events): one of them stops with one line (exit 3), the
    other keeps the session."""
    tails = [_tail(tmp_path / "1.txt", "--broker", broker.address, "--session", "t-dup", "--timeout", "60")]
    try:
        broker.wait_subscribed("linkpass/v1/+/events", client_id="t-dup")
        tails.append(_tail(tmp_path / "2.txt", "--broker", broker.address, "--session", "t-dup", "--timeout", "60"))
        wait_for(lambda: any(t.poll() is not None for t in tails), timeout=30, what="one of the two tails to stop")
        gone = next(t for t in tails if t.poll() is not None)
        kept = next(t for t in tails if t is not gone)
        _, err = gone.communicate(timeout=10)
        assert gone.returncode == 3, err
        last = err.splitlines()[-1]
        assert last.startswith("linkpass: alerts: session t-dup: ") and "another client using client id t-dup?" in last, err
        assert "Traceback" not in err
        time.sleep(2.0)  # two more reconnect rounds of the stopped one would have thrown it off again
        assert kept.poll() is None
        assert broker.log_text().count("Client t-dup already connected") >= 3
    finally:
        for p in tails:
            if p.poll() is None:
                _stop(p)
