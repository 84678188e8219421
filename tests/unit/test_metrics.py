"""Prometheus metrics (linkpass.adapters.metrics): real engine history entries in, a real HTTP
scrape out (prometheus_client's own server on a free loopback port, its own text parser)."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from unit_helpers import MS, S, carrier_lost, make_toml, snapshot, up

from linkpass.adapters.metrics import METRIC_NAMES, DaemonMetrics, LatencyTracker, MetricsError
from linkpass.config import ConfigError, parse_config
from linkpass.adapters.fakes import FakePublisher
from linkpass.core.model import DeviceIncident, HistoryEntry, LinkChanged, PublishHistory, RoutesApplied, Tick
from linkpass.daemon import Daemon


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics; returns {(sample name, sorted label items): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))


def make_daemon(tmp_path, extra: str = "") -> Daemon:
    text = make_toml(rails=(0, 1), n_peers=1, hold_down_ms=2000) + "\n" + extra
    text = text.replace('[daemon]\n', f'[daemon]\ncontrol_socket = "{tmp_path}/lp.sock"\n', 1)
    return Daemon(str(tmp_path / "lp.toml"), parse_config(text, "lp.toml"))


def step(d: Daemon, ev, now_ns: int) -> list:
    """What the daemon's engine loop does with one event's history (without the asyncio queue
    and the other adapters): its PublishHistory through the dispatch table."""
    acts = d.engine.handle(ev, now_ns)
    d._dispatch([a for a in acts if isinstance(a, PublishHistory)])
    return acts


@pytest.fixture
def daemon(tmp_path):
    d = make_daemon(tmp_path)
    yield d
    if d.metrics:
        d.metrics.stop()


def test_a_cut_and_failback_show_up_in_a_real_scrape(daemon):
    d = daemon
    port = d.metrics.start("127.0.0.1", 0)[1]
    now = [0]
    d.metrics.clock = lambda: now[0]  # the engine runs on a fake clock here
    cfg = d.cfg
    step(d, snapshot(cfg, 0), 0)
    step(d, RoutesApplied(1, 1 * MS), 1 * MS)
    # rail 0 loses carrier at 10 s; the engine decides 0.3 ms after the netlink message came
    step(d, LinkChanged(carrier_lost("rail0"), 10 * S), 10 * S + 300_000)
    step(d, RoutesApplied(2, 10 * S + 2_300_000), 10 * S + 2_300_000)
    before_back = scrape(port)
    # the link comes back at 20 s; hold-down (2 s) expires at 22 s: failback
    step(d, LinkChanged(up("rail0"), 20 * S), 20 * S)
    step(d, Tick(22 * S), 22 * S)
    step(d, DeviceIncident("kmsg", "gpu", "0000:91:00.0", "xid:79", "migrate-rank", "move the rank", 23 * S), 23 * S)
    step(d, DeviceIncident("kmsg", "nic-link", "rail1", "link_down", "none", "-", 24 * S), 24 * S)
    now[0] = 24 * S
    m = scrape(port)

    assert value(before_back, "linkpass_rail_state", rail=0, netdev="rail0", state="DOWN") == 1
    assert value(before_back, "linkpass_rail_state", rail=0, netdev="rail0", state="UP") == 0
    assert value(before_back, "linkpass_rail_usable", rail=0, netdev="rail0") == 0
    assert value(before_back, "linkpass_rails_usable") == 1
    assert value(before_back, "linkpass_failbacks_total", rail=0) == 0

    assert value(m, "linkpass_failovers_total", rail=0) == 1
    assert value(m, "linkpass_failovers_total", rail=1) == 0
    assert value(m, "linkpass_failbacks_total", rail=0) == 1
    assert value(m, "linkpass_detection_latency_seconds_count", rail=0) == 1
    assert value(m, "linkpass_detection_latency_seconds_sum", rail=0) == pytest.approx(0.0003)
    assert value(m, "linkpass_detection_latency_seconds_bucket", rail=0, le="0.0005") == 1
    assert value(m, "linkpass_detection_latency_seconds_bucket", rail=0, le="0.00025") == 0
    assert value(m, "linkpass_reroute_latency_seconds_count", rail=0) == 1
    assert value(m, "linkpass_reroute_latency_seconds_sum", rail=0) == pytest.approx(0.002)
    assert value(m, "linkpass_rail_state", rail=0, netdev="rail0", state="UP") == 1
    assert value(m, "linkpass_rails_usable") == 2 and value(m, "linkpass_rails_configured") == 2
    assert value(m, "linkpass_plan_generation") == d.engine.generation >= 3
    assert value(m, "linkpass_applied_generation") == 2
    assert value(m, "linkpass_incidents_total", domain="gpu") == 1
    assert value(m, "linkpass_incidents_total", domain="nic-link") == 1
    assert value(m, "linkpass_device_faults_total", domain="gpu") == 1
    assert value(m, "linkpass_device_faults_total", domain="nic-link") is None
    assert value(m, "linkpass_engine_events_total", kind="routes_applied") == 2
    assert value(m, "linkpass_info", host="h0", mode="host-ip", reroute="kernel", version="0.1.0") == 1
    assert value(m, "linkpass_ready") == 0  # the daemon's loop never ran: not ready
    assert value(m, "linkpass_hook_clients") == 0
    assert value(m, "linkpass_rail_suppressed", rail=0, netdev="rail0") == 0
    assert value(m, "linkpass_rail_damping_penalty", rail=0, netdev="rail0") > 0  # one flap earned a penalty
    assert value(m, "process_resident_memory_bytes") > 0
    assert value(m, "linkpass_mqtt_outbox_depth") is None  # no MQTT adapter


def test_every_exported_name_is_documented(daemon):
    """Names in a scrape are all in METRIC_NAMES (the contract with the alert rules)."""
    d = daemon
    port = d.metrics.start("127.0.0.1", 0)[1]
    step(d, snapshot(d.cfg, 0), 0)
    step(d, LinkChanged(carrier_lost("rail0"), 1 * S), 1 * S)
    names = {n for n, _ in scrape(port)}
    fams = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_created") for n in names}
    ours = {n for n in fams if n.startswith("linkpass_")}
    assert ours - set(METRIC_NAMES) == set()
    assert {"linkpass_rail_state", "linkpass_failovers_total", "linkpass_detection_latency_seconds"} <= ours


def test_outbox_depth_read_from_daemon_mqtt(daemon):
    d = daemon
    port = d.metrics.start("127.0.0.1", 0)[1]
    d.mqtt = None
    assert value(scrape(port), "linkpass_mqtt_outbox_depth") is None
    d.mqtt = FakePublisher(connected=True, depth=42, dropped_total=7)
    m = scrape(port)
    assert value(m, "linkpass_mqtt_outbox_depth") == 42
    assert value(m, "linkpass_mqtt_outbox_dropped_total") == 7
    assert value(m, "linkpass_mqtt_connected") == 1


def test_port_in_use_is_one_clear_error(daemon):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with pytest.raises(MetricsError) as ei:
            daemon.metrics.start("127.0.0.1", port)
    finally:
        busy.close()
    msg = str(ei.value)
    assert "\n" not in msg and f"127.0.0.1 port {port}" in msg and "in use" in msg


def test_a_blocked_loop_leaves_state_out_instead_of_tearing_it(daemon):
    """Scrapes take the state snapshot on the daemon's loop; a blocked loop times out cleanly."""
    d = daemon
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        fut = asyncio.run_coroutine_threadsafe(_start_on_loop(d), loop)
        port = fut.result(5)
        d.metrics.snapshot_timeout_s = 0.3
        m = scrape(port)
        assert value(m, "linkpass_rails_configured") == 2  # taken on the loop thread
        release = threading.Event()
        loop.call_soon_threadsafe(release.wait, 10)  # the loop is stuck in a blocking call
        m = scrape(port)
        release.set()
        assert value(m, "linkpass_rails_configured") is None
        assert value(m, "linkpass_metrics_snapshot_timeouts_total") == 1
        assert value(m, "linkpass_failovers_total", rail=0) == 0  # the sink-fed metrics are still there
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


async def _start_on_loop(d: Daemon) -> int:
    return d.metrics.start("127.0.0.1", 0, asyncio.get_running_loop())[1]


def test_metrics_off_builds_nothing(tmp_path):
    d = make_daemon(tmp_path, "[metrics]\nenabled = false\n")
    assert d.metrics is None
    assert not any(isinstance(getattr(s, "__self__", None), DaemonMetrics) for s in d.history_readers)


@pytest.mark.parametrize("body, where", [
    ('address = "localhost"', "metrics.address"),
    ('address = 127', "metrics.address"),
    ("port = 0", "metrics.port"),
    ("port = 70000", "metrics.port"),
    ('port = "9472"', "metrics.port"),
    ("enable = true", "metrics.enable"),
])
def test_bad_metrics_config_names_the_key(body, where):
    with pytest.raises(ConfigError) as ei:
        parse_config(make_toml() + f"\n[metrics]\n{body}\n", "x.toml")
    assert str(ei.value).startswith(f"x.toml: {where}: ")


def test_metrics_defaults():
    m = parse_config(make_toml(), "x.toml").metrics
    assert (m.enabled, m.address, m.port) == (True, "127.0.0.1", 9472)
    assert parse_config(make_toml() + '\n[metrics]\naddress = "::1"\n', "x.toml").metrics.address == "::1"


def _e(kind: str, t: int, **data) -> HistoryEntry:
    return HistoryEntry(kind, t, data)


@pytest.mark.parametrize("entries, want", [
    # cut: DOWN decided 0.5 ms after the event, plan 2 without rail 0, applied 3 ms after the decision
    ([_e("rail", 1000_500_000, rail=0, old="UP", new="DOWN", event_t_ns=1000_000_000),
      _e("plan", 1000_500_000, generation=2, usable=[1]),
      _e("routes_applied", 1003_500_000, generation=2)],
     [("failover", 0, None), ("detect", 0, 0.0005), ("reroute", 0, 0.003)]),
    # an older generation's ACK does not end the reroute; the newer one does
    ([_e("rail", 10, rail=1, old="SUSPECT", new="DOWN", event_t_ns=10),
      _e("plan", 10, generation=5, usable=[0]),
      _e("routes_applied", 20, generation=4),
      _e("routes_applied", 30, generation=6)],
     [("failover", 1, None), ("detect", 1, 0.0), ("reroute", 1, 20e-9)]),
    # DOWN from hold-down or at start, or a drain: no failover
    ([_e("rail", 10, rail=0, old="HOLD_DOWN", new="DOWN", event_t_ns=5),
      _e("rail", 10, rail=1, old="UNKNOWN", new="DOWN", event_t_ns=5),
      _e("rail", 10, rail=2, old="UP", new="DRAINED", event_t_ns=5)], []),
    # back before its routes were applied: a failback, no reroute sample
    ([_e("rail", 10, rail=0, old="UP", new="DOWN", event_t_ns=10),
      _e("rail", 50, rail=0, old="DOWN", new="HOLD_DOWN", event_t_ns=50),
      _e("rail", 90, rail=0, old="HOLD_DOWN", new="UP", event_t_ns=90),
      _e("plan", 90, generation=3, usable=[0, 1]),
      _e("routes_applied", 95, generation=3)],
     [("failover", 0, None), ("detect", 0, 0.0), ("failback", 0, None)]),
    # a plan recorded before the decision does not count
    ([_e("plan", 5, generation=2, usable=[1]),
      _e("rail", 10, rail=0, old="UP", new="DOWN", event_t_ns=10),
      _e("routes_applied", 20, generation=2)],
     [("failover", 0, None), ("detect", 0, 0.0)]),
])
def test_latency_tracker_follows_the_bench_definitions(entries, want):
    got = LatencyTracker().feed(entries)
    assert [(w, r) for w, r, _ in got] == [(w, r) for w, r, _ in want]
    for (_, _, v), (_, _, x) in zip(got, want):
        assert v == x if x is None else v == pytest.approx(x)
