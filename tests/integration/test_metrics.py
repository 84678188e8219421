"""Prometheus metrics of real daemons on the test fabric, scraped over HTTP from inside their
network namespace (the endpoint listens on 127.0.0.1:9472 there, the default)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from linkpass.lab import fabric as fab
from linkpass.adapters.hook_server import default_socket_path

from .daemons import Cluster, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]

PORT = 9472
FETCH = ("import sys, urllib.request; "
         "r = urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics', timeout=10); "
         "sys.stdout.write(r.read().decode())")


def scrape(c: Cluster, i: int, port: int = PORT) -> dict[tuple[str, tuple], float]:
    """GET /metrics of host i's daemon; {(sample name, sorted label items): value}."""
    p = subprocess.run(fab.netns_exec(c.name, i) + [sys.executable, "-c", FETCH, str(port)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr[-2000:]
    out = {}
    for fam in text_string_to_metric_families(p.stdout):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels):
    return m.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        c.start_all()
        yield c
    finally:
        c.close()


def test_a_cut_and_heal_as_prometheus_sees_them(cluster):
    c = cluster
    m = scrape(c, 1)
    assert value(m, "linkpass_ready") == 1
    assert value(m, "linkpass_info", host="h1", mode="host-ip", reroute="kernel", version="0.1.0") == 1
    assert value(m, "linkpass_rails_usable") == 2 and value(m, "linkpass_rails_configured") == 2
    assert value(m, "linkpass_rail_state", rail=0, netdev="rail0", state="UP") == 1
    assert value(m, "linkpass_failovers_total", rail=0) == 0
    assert value(m, "process_resident_memory_bytes") > 0
    # probes between the two hosts: RTT and loss of the fast-probed paths, per rail too, on h0:
    # of two hosts probing each other only the smaller name sends probes (and measures RTTs);
    # h1's paths are proved by h0's requests and may never carry an RTT of their own
    m = wait_for(lambda: (lambda s: s if value(s, "linkpass_probe_rtt_seconds", rail=0, peer="h1") else None)(scrape(c, 0)),
                 timeout=10, what="probe RTT of h0's path (rail 0, h1)")
    assert 0 < value(m, "linkpass_probe_rtt_seconds", rail=0, peer="h1") < 1
    assert value(m, "linkpass_probe_loss_ratio", rail=0, peer="h1") is not None
    assert value(m, "linkpass_probe_replies_total", rail=0, peer="h1") > 0
    m = wait_for(lambda: (lambda s: s if value(s, "linkpass_rail_probe_rtt_seconds", rail=1, netdev="rail1") else None)(scrape(c, 0)),
                 timeout=10, what="probe RTT of h0's rail 1")
    assert value(m, "linkpass_rail_probe_rtt_seconds", rail=1, netdev="rail1") > 0
    # h1's probed paths: a loss ratio whether or not they carry an RTT
    wait_for(lambda: value(scrape(c, 1), "linkpass_probe_loss_ratio", rail=0, peer="h0") is not None,
             timeout=10, what="probe loss of h1's path (rail 0, h0)")

    fab.cut(c.name, 1, 0, "carrier-loss")
    wait_for(lambda: c.route_rails(1, 0) == [1], what="reroute on h1")
    wait_for(lambda: value(scrape(c, 1), "linkpass_reroute_latency_seconds_count", rail=0) == 1, what="reroute observed")
    m = scrape(c, 1)
    assert value(m, "linkpass_rail_state", rail=0, netdev="rail0", state="DOWN") == 1
    assert value(m, "linkpass_rail_usable", rail=0, netdev="rail0") == 0
    assert value(m, "linkpass_rails_usable") == 1
    fab.heal(c.name, 1, 0)
    wait_for(lambda: c.route_rails(1, 0) == [0, 1], timeout=10, what="failback on h1")
    m = wait_for(lambda: (lambda s: s if value(s, "linkpass_failbacks_total", rail=0) else None)(scrape(c, 1)),
                 what="failback counted")

    # the same definitions as bench/detect_reroute.py, from the daemon's own history
    hist = c.history(1)
    downs = [e for e in hist if e["kind"] == "rail" and e["rail"] == 0 and e["old"] in ("UP", "SUSPECT") and e["new"] == "DOWN"]
    assert len(downs) == value(m, "linkpass_failovers_total", rail=0) >= 1
    detect = sum((e["t_ns"] - e["event_t_ns"]) / 1e9 for e in downs)
    assert value(m, "linkpass_detection_latency_seconds_count", rail=0) == len(downs)
    assert value(m, "linkpass_detection_latency_seconds_sum", rail=0) == pytest.approx(detect, abs=1e-9)
    d0 = downs[0]
    plan = next(e for e in hist if e["kind"] == "plan" and e["t_ns"] >= d0["t_ns"] and 0 not in e["usable"])
    ap = next(e for e in hist if e["kind"] == "routes_applied" and e["generation"] >= plan["generation"])
    if len(downs) == 1:  # one cut, one reroute: the histogram holds exactly the bench's reroute_ms
        assert value(m, "linkpass_reroute_latency_seconds_count", rail=0) == 1
        assert value(m, "linkpass_reroute_latency_seconds_sum", rail=0) == pytest.approx((ap["t_ns"] - d0["t_ns"]) / 1e9, abs=1e-9)
    ups = [e for e in hist if e["kind"] == "rail" and e["rail"] == 0 and e["old"] == "HOLD_DOWN" and e["new"] == "UP"]
    assert value(m, "linkpass_failbacks_total", rail=0) == len(ups) >= 1
    assert value(m, "linkpass_plan_generation") == c.status(1)["generation"]
    assert value(m, "linkpass_engine_events_total", kind="routes_applied") >= 3
    assert value(m, "linkpass_route_ops_total") >= 1 and value(m, "linkpass_route_errors_total") == 0


def test_hook_connections_are_counted(cluster):
    c = cluster
    path = default_socket_path(c.host(0)["control_socket"])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        m = wait_for(lambda: (lambda x: x if value(x, "linkpass_hook_clients") == 1 else None)(scrape(c, 0)),
                     what="one hook client")
        assert value(m, "linkpass_hook_clients_registered") == 0
        assert value(m, "linkpass_hook_connections_total") == 1
    wait_for(lambda: value(scrape(c, 0), "linkpass_hook_clients") == 0, what="hook client gone")


def test_port_in_use_is_one_error_line_and_the_daemon_runs_on(tmp_path):
    c = Cluster(hosts=2, rails=1, hold_down_ms=300, tmp=tmp_path)
    holder = None
    try:
        holder = subprocess.Popen(fab.netns_exec(c.name, 0) + [
            sys.executable, "-c",
            f"import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', {PORT})); s.listen(); "
            "print('listening', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "listening"
        c.start_all()
        st = c.status(0)
        assert st["metrics"] == {"listening": None}
        assert c.status(1)["metrics"] == {"listening": f"127.0.0.1:{PORT}"}
        log = c.logs[0].read_text()
        errs = [ln for ln in log.splitlines() if "metrics" in ln and "ERROR" in ln]
        assert len(errs) == 1 and f"cannot listen on 127.0.0.1 port {PORT}" in errs[0] and "running without metrics" in errs[0], log
        assert "Traceback" not in log
        # the daemon does its network job all the same
        fab.cut(c.name, 0, 0, "carrier-loss")
        wait_for(lambda: next(r["state"] for r in c.status(0)["rails"] if r["id"] == 0) == "DOWN", what="rail 0 DOWN on h0")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(5)
        c.close()
