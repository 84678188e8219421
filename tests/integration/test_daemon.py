"""The daemon on a real emulated fabric: real namespaces, real kernel routes, real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from linkpass.lab import fabric as fab
from linkpass.config import read_key_file
from linkpass.core import notice as wire

from .daemons import Cluster, sh, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        c.start_all()
        yield c
    finally:
        c.close()


def _ping(c: Cluster, src: int, dst: int) -> bool:
    p = sh("ip", "netns", "exec", c.ns(src), "ping", "-c", "1", "-W", "1", "-I", c.host(src)["host_ip"], c.host(dst)["host_ip"], check=False)
    return p.returncode == 0


def _rail_state(c: Cluster, i: int, rail: int) -> str:
    return next(r["state"] for r in c.status(i)["rails"] if r["id"] == rail)


def test_routes_over_all_rails_at_start(cluster):
    c = cluster
    assert c.route_rails(0, 1) == [0, 1]
    assert c.route_rails(1, 0) == [0, 1]
    r = c.routes(0)[0]
    assert r["prefsrc"] == c.host(0)["host_ip"]
    assert _ping(c, 0, 1) and _ping(c, 1, 0)


@pytest.mark.parametrize("mode", ["carrier-loss", "admin-down"])
def test_cut_reroutes_both_ends_and_fails_back_after_hold_down(cluster, mode):
    c = cluster
    cut = fab.cut(c.name, 1, 0, mode)
    wait_for(lambda: c.route_rails(1, 0) == [1], what="local reroute on h1")
    wait_for(lambda: c.route_rails(0, 1) == [1], what="peer reroute on h0 (peer notice)")
    assert _rail_state(c, 1, 0) == "DOWN"
    assert _ping(c, 0, 1) and _ping(c, 1, 0)
    st0 = c.status(0)
    assert st0["peers"][0]["usable_rails"] == [1]

    heal = fab.heal(c.name, 1, 0)
    wait_for(lambda: c.route_rails(1, 0) == [0, 1], timeout=5, what="failback on h1")
    wait_for(lambda: c.route_rails(0, 1) == [0, 1], timeout=5, what="failback on h0")

    # the daemon's own timeline: DOWN declared after the cut, UP only hold-down after the link came back
    hist = c.history(1)
    rail0 = [e for e in hist if e["kind"] == "rail" and e["rail"] == 0 and e["t_ns"] >= cut["t_issued_ns"]]
    states = [e["new"] for e in rail0]
    # DOWN at the cut; back only through a hold-down that started after the heal.  (Probes sent
    # around the heal may still be lost and send it DOWN once more before the final hold-down.)
    assert states[0] == "DOWN" and states[-2:] == ["HOLD_DOWN", "UP"], rail0
    assert "UP" not in states[:-1]
    assert rail0[-2]["t_ns"] >= heal["t_issued_ns"]
    assert rail0[-1]["t_ns"] - rail0[-2]["t_ns"] >= 300 * 1_000_000
    plans_with_rail0 = [e for e in hist if e["kind"] == "plan" and e["t_ns"] > rail0[0]["t_ns"] and 0 in e["usable"]]
    assert plans_with_rail0 and plans_with_rail0[0]["t_ns"] >= rail0[-1]["t_ns"]


def test_flap_during_hold_down_restarts_it(cluster):
    c = cluster
    fab.cut(c.name, 1, 0, "carrier-loss")
    wait_for(lambda: _rail_state(c, 1, 0) == "DOWN")
    fab.heal(c.name, 1, 0)
    wait_for(lambda: _rail_state(c, 1, 0) == "HOLD_DOWN", timeout=10)
    fab.cut(c.name, 1, 0, "carrier-loss")
    wait_for(lambda: _rail_state(c, 1, 0) == "DOWN")
    wait_for(lambda: c.route_rails(1, 0) == [1], what="rail 0 out of use again")
    fab.heal(c.name, 1, 0)
    wait_for(lambda: c.route_rails(1, 0) == [0, 1], timeout=10, what="failback after the second heal")


def test_restart_after_kill9_reconciles_routes(cluster):
    c = cluster
    ns = c.ns(0)
    peer_ip = c.host(1)["host_ip"]
    # a stale route of ours (a peer no longer configured), and routes that are not ours
    sh("ip", "-n", ns, "route", "add", "198.19.9.9/32", "via", "198.18.0.2", "dev", "rail0", "proto", "201")
    sh("ip", "-n", ns, "route", "add", "198.19.8.8/32", "via", "198.18.0.2", "dev", "rail0", "proto", "static")
    sh("ip", "-n", ns, "route", "add", "198.19.7.7/32", "via", "198.18.1.2", "dev", "rail1", "proto", "boot")
    assert c.kill(0) == -signal.SIGKILL
    # while h0's daemon is dead its rail 1 loses carrier: the kernel keeps the stale multipath route
    fab.cut(c.name, 0, 1, "carrier-loss")
    c.start(0)
    wait_for(lambda: c.route_rails(0, 1) == [0], what="reconciled route on h0")
    ours = c.routes(0)
    assert [r["dst"] for r in ours] == [peer_ip], ours
    others = {r["dst"] for r in c.routes(0, proto=None)}
    assert {"198.19.8.8", "198.19.7.7"} <= others
    assert "198.19.9.9" not in others
    # no duplicate routes to the peer, in any protocol
    assert len([r for r in c.routes(0, proto=None) if r["dst"] == peer_ip]) == 1
    # the peer learned of h0's dead rail from the restarted daemon's notice
    wait_for(lambda: c.route_rails(1, 0) == [0], what="peer reroute after restart")


def test_foreign_route_on_our_destination_is_not_touched(cluster):
    c = cluster
    ns = c.ns(0)
    peer_ip = c.host(1)["host_ip"]
    sh("ip", "-n", ns, "route", "add", f"{peer_ip}/32", "via", "198.18.1.2", "dev", "rail1", "proto", "static", "metric", "5")
    fab.cut(c.name, 0, 1, "carrier-loss")
    wait_for(lambda: c.route_rails(0, 1) == [0])
    static = [r for r in c.routes(0, proto=None) if r["dst"] == peer_ip and r.get("protocol") == "static"]
    assert len(static) == 1 and static[0]["dev"] == "rail1"


def _send(c: Cluster, from_host: int, to_host: int, payload: bytes) -> None:
    """Send one UDP datagram from inside a host namespace to a peer's rail-0 address."""
    dst = c.host(to_host)["rails"][0]["address"]
    code = textwrap.dedent(f"""
        import socket, sys
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(bytes.fromhex(sys.argv[1]), ({dst!r}, 7471))
    """)
    sh(*fab.netns_exec(c.name, from_host), sys.executable, "-c", code, payload.hex())


def _counter(c: Cluster, i: int, name: str) -> int:
    return c.status(i)["counters"].get(name, 0)


def test_forged_replayed_and_garbage_notices_are_dropped(cluster):
    c = cluster
    key = read_key_file(c.desc["notice_key_file"])
    seq0 = time.time_ns() + 10**12  # above anything the real h1 daemon sends soon

    # forged: wrong key, claims h1 lost rail 0
    forged = wire.encode(wire.Notice("h1", seq0, 99, {0: False, 1: True}), b"not-the-key-not-the-key")
    _send(c, 1, 0, forged)
    wait_for(lambda: _counter(c, 0, "notices_rejected_auth") >= 1, what="auth rejection")
    assert c.route_rails(0, 1) == [0, 1]

    # garbage and truncated datagrams
    good = wire.encode(wire.Notice("h1", seq0, 99, {0: False, 1: True}), key)
    for junk in (b"", b"\x00" * 3, good[:40], os.urandom(2000), b"LPN1" + os.urandom(60)):
        _send(c, 1, 0, junk)
    wait_for(lambda: _counter(c, 0, "notices_rejected_malformed") + _counter(c, 0, "notices_rejected_oversized") + _counter(c, 0, "notices_rejected_auth") >= 5)

    # a genuine notice does change h0's routes (so the checks above could fail)...
    _send(c, 1, 0, good)
    wait_for(lambda: c.route_rails(0, 1) == [1], what="authentic notice applied")
    newer = wire.encode(wire.Notice("h1", seq0 + 1, 100, {0: True, 1: True}), key)
    _send(c, 1, 0, newer)
    wait_for(lambda: c.route_rails(0, 1) == [0, 1], what="newer notice applied")
    # ...but replaying the older one is refused
    _send(c, 1, 0, good)
    wait_for(lambda: _counter(c, 0, "notices_rejected_replay") >= 1, what="replay rejection")
    assert c.route_rails(0, 1) == [0, 1]
    assert c.procs[0].poll() is None


def test_sigterm_leaves_routes_and_exits_zero(cluster):
    c = cluster
    fab.cut(c.name, 0, 0, "carrier-loss")
    wait_for(lambda: c.route_rails(0, 1) == [1])
    assert c.kill(0, signal.SIGTERM) == 0
    assert c.route_rails(0, 1) == [1]
    assert not os.path.exists(c.host(0)["control_socket"])


def test_sighup_reload_and_bad_reload(cluster, tmp_path):
    c = cluster
    cfg = c.host(0)["config"]
    text = open(cfg).read()
    assert "hold_down_ms = 300" in text
    open(cfg, "w").write(text.replace("hold_down_ms = 300", "hold_down_ms = 1234"))
    c.signal(0, signal.SIGHUP)
    wait_for(lambda: c.status(0)["hold_down_ms"] == 1234, what="reloaded hold-down")
    open(cfg, "w").write("[daemon\nbroken")
    c.signal(0, signal.SIGHUP)
    wait_for(lambda: "reload refused" in c.logs[0].read_text(), what="refused reload logged")
    assert c.procs[0].poll() is None and c.status(0)["hold_down_ms"] == 1234


def test_status_cli(cluster):
    c = cluster
    p = sh(sys.executable, "-m", "linkpass.cli", "status", "--config", c.host(0)["config"])
    assert "rail0" in p.stdout and "UP" in p.stdout and "h1" in p.stdout
    pj = sh(sys.executable, "-m", "linkpass.cli", "status", "--socket", c.host(0)["control_socket"], "--json")
    import json

    st = json.loads(pj.stdout)
    assert st["schema"] == "linkpass.status/v1" and st["host"] == "h0" and st["generation"] >= 1
    assert {r["state"] for r in st["rails"]} == {"UP"}


def test_drain_cli_moves_traffic_off_the_rail_and_undrain_brings_it_back(cluster):
    c = cluster
    cfg = c.host(0)["config"]
    p = sh(sys.executable, "-m", "linkpass.cli", "drain", "0", "--config", cfg)
    assert "rail 0: drain requested" in p.stdout
    wait_for(lambda: _rail_state(c, 0, 0) == "DRAINED" and c.route_rails(0, 1) == [1], what="rail 0 drained on h0")
    wait_for(lambda: c.route_rails(1, 0) == [1], what="h1 follows h0's notice")
    assert c.status(0)["dispatch_errors"] == {}
    bad = sh(sys.executable, "-m", "linkpass.cli", "drain", "7", "--config", cfg, check=False)
    assert bad.returncode == 2 and "no rail 7" in bad.stderr and "Traceback" not in bad.stderr
    sh(sys.executable, "-m", "linkpass.cli", "undrain", "0", "--config", cfg)
    wait_for(lambda: _rail_state(c, 0, 0) == "UP" and c.route_rails(0, 1) == [0, 1], what="rail 0 back after hold-down")


def test_unknown_interface_is_reported_not_fatal(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        cfg = tmp_path / "h0.toml"
        cfg.write_text(open(c.host(0)["config"]).read().replace('"rail1"', '"rail9"'))
        c.start(1, wait=False)
        c.start(0, config=str(cfg), wait=False)
        st = wait_for(lambda: (s := c.try_status(0)) and s["applied_generation"] >= 1 and s, what="h0 status")
        assert any("rail9" in w for w in st["warnings"])
        assert next(r for r in st["rails"] if r["id"] == 1)["state"] == "DOWN"
        wait_for(lambda: c.route_rails(0, 1) == [0])
    finally:
        c.close()


def test_per_rail_ip_mode_reroutes_rail_addresses(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, mode="per-rail-ip", tmp=tmp_path)
    try:
        c.start_all()
        assert c.routes(0) == []  # connected routes suffice while all rails are up
        fab.cut(c.name, 1, 0, "carrier-loss")
        h0_r0, h1_r0 = c.host(0)["rails"][0]["address"], c.host(1)["rails"][0]["address"]
        wait_for(lambda: [r["dst"] for r in c.routes(1)] == [h0_r0], what="h1 /32 to h0's rail-0 address")
        wait_for(lambda: [r["dst"] for r in c.routes(0)] == [h1_r0], what="h0 /32 to h1's rail-0 address")
        assert c.routes(0)[0]["dev"] == "rail1"
        p = sh("ip", "netns", "exec", c.ns(0), "ping", "-c", "1", "-W", "1", "-I", h0_r0, h1_r0, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        fab.heal(c.name, 1, 0)
        wait_for(lambda: c.routes(0) == [] and c.routes(1) == [], what="/32 routes removed after failback")
    finally:
        c.close()


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("[daemon]\nhost = 'h0'\nmode = 'host-ip'\nhost_ip = '198.19.0.1'\n", "rails: at least one [[rails]] entry is required"),
    ("[daemon]\nhost = 'h0'\nhost_ip = '198.19.0.1'\n[[rails]]\nid = 0\nnetdev = 'rail0'\nbogus = 1\n", "rails[0].bogus"),
    ("[daemon]\nhost = 'h0'\nhost_ip = 'not-an-ip'\n[[rails]]\nid = 0\nnetdev = 'rail0'\n", "daemon.host_ip"),
    ("[daemon\n", "not valid TOML"),
])
def test_bad_config_one_line_exit_2(tmp_path, content, needle):
    path = tmp_path / "linkpass.toml"
    if content is not None:
        path.write_text(content)
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "run", "--config", str(path)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert str(path) in lines[0] and needle in lines[0], lines[0]
    assert "Traceback" not in p.stderr


def test_world_readable_key_is_refused(tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32)
    key.chmod(0o644)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nhost = 'h0'\nhost_ip = '198.19.0.1'\nnotice_key_file = '{key}'\ncontrol_socket = '{tmp_path}/s'\n[[rails]]\nid = 0\nnetdev = 'lo'\n")
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "run", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "0600" in p.stderr and str(key) in p.stderr


def test_status_without_daemon_is_clear(tmp_path):
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "status", "--socket", str(tmp_path / "none.sock")], capture_output=True, text=True, timeout=30)
    assert p.returncode == 3 and "no daemon answers" in p.stderr and "Traceback" not in p.stderr


@pytest.fixture
def small_buffer_cluster(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        cfg = c.host(0)["config"]
        text = open(cfg).read()
        assert "hold_down_ms = 300" in text
        open(cfg, "w").write(text.replace("hold_down_ms = 300", "hold_down_ms = 300\nnetlink_rcvbuf_bytes = 16384"))
        c.start_all()
        yield c
    finally:
        c.close()


def test_netlink_overrun_resyncs_from_a_dump(small_buffer_cluster):
    """Freeze the daemon, flood its netlink socket past its buffer, cut a rail, thaw it:
    the kernel reports ENOBUFS, events are lost, and the daemon must still see the cut."""
    c = small_buffer_cluster
    pid = c.procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        batch = "".join(f"link set dev lp0-peer {'down' if k % 2 == 0 else 'up'}\n" for k in range(400)) + "link set dev lp0-peer up\n"
        subprocess.run(["ip", "-n", c.ns(0), "-batch", "-"], input=batch, text=True, check=True, capture_output=True)
        fab.cut(c.name, 0, 0, "carrier-loss")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: c.route_rails(0, 1) == [1], what="reroute after resync")
    st = c.status(0)
    assert st["counters"]["netlink_overruns"] >= 1 and st["counters"]["netlink_resyncs"] >= 1
    assert next(r for r in st["rails"] if r["id"] == 0)["state"] == "DOWN"


def test_rails_ignore_linkdown_nexthops(cluster):
    c = cluster
    for k in (0, 1):
        v = sh("ip", "netns", "exec", c.ns(0), "cat", f"/proc/sys/net/ipv4/conf/rail{k}/ignore_routes_with_linkdown").stdout.strip()
        assert v == "1"


def test_neighbour_purge_frees_a_dead_rails_entries(cluster):
    """Packets queued behind a neighbour entry of a dead rail would stall TCP for 3 s (see
    ApplyRoutes.purge_neighbors); the route actuator deletes that rail's dynamic entries."""
    c = cluster
    ns = c.ns(1)
    sh("ip", "-n", ns, "neigh", "replace", "198.18.1.77", "lladdr", "02:00:00:00:00:77", "dev", "rail1", "nud", "stale")
    sh("ip", "-n", ns, "neigh", "replace", "198.18.1.78", "lladdr", "02:00:00:00:00:78", "dev", "rail1", "nud", "permanent")
    sh("ip", "-n", ns, "neigh", "replace", "198.18.0.77", "lladdr", "02:00:00:00:00:79", "dev", "rail0", "nud", "stale")
    code = textwrap.dedent("""
        import asyncio
        from pyroute2 import AsyncIPRoute
        from linkpass.adapters.routes import RouteActuator, RouteSettings
        async def main():
            a = RouteActuator(lambda e: None, RouteSettings(201, 254))
            async with AsyncIPRoute() as ipr:
                print(await a.purge_neighbors(ipr, "rail1"))
        asyncio.run(main())
    """)
    out = sh(*fab.netns_exec(c.name, 1), sys.executable, "-c", code).stdout.strip()
    assert int(out) >= 1
    neigh = sh("ip", "-n", ns, "neigh", "show").stdout
    assert "198.18.1.77" not in neigh
    assert "198.18.1.78" in neigh  # permanent entries are not ours to delete
    assert "198.18.0.77" in neigh  # other rails untouched


def test_second_daemon_is_refused_and_first_keeps_working(cluster):
    c = cluster
    p = subprocess.run(fab.netns_exec(c.name, 0) + [sys.executable, "-m", "linkpass.cli", "run", "--config", c.host(0)["config"]],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "another linkpass daemon is running" in p.stderr and "Traceback" not in p.stderr
    assert c.status(0)["host"] == "h0"  # the first one still answers


def test_notice_port_in_use_is_a_clear_error(cluster, tmp_path):
    c = cluster
    cfg = tmp_path / "h0b.toml"
    cfg.write_text(open(c.host(0)["config"]).read().replace(c.host(0)["control_socket"], str(tmp_path / "other.sock")))
    p = subprocess.run(fab.netns_exec(c.name, 0) + [sys.executable, "-m", "linkpass.cli", "run", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "notice_port 7471" in p.stderr and "Traceback" not in p.stderr


def test_control_socket_path_that_is_a_file_is_not_replaced(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("important data")
    key = tmp_path / "key"
    key.write_text("k" * 32)
    key.chmod(0o600)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\nhost = 'h0'\nhost_ip = '198.19.0.1'\nnotice_key_file = '{key}'\ncontrol_socket = '{victim}'\n[[rails]]\nid = 0\nnetdev = 'lo'\n")
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "run", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "is not a socket" in p.stderr
    assert victim.read_text() == "important data"


def test_fabric_down_stops_daemons_running_in_it(tmp_path):
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        c.start_all()
        pids = [p.pid for p in c.procs.values()]
        assert fab.down(c.name) and fab.down_report(c.name) == 2
        for p in c.procs.values():
            assert p.wait(10) == 0  # SIGTERM: a clean stop
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    finally:
        c.close()
