"""Integration tests of `linkpass fabric`: real network namespaces, veth pairs, bridges, nftables.

Every test uses its own fabric name and tears it down in a fixture finalizer.  Needs root, `ip`,
`nft` and `ping`; skipped otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import stat
import subprocess
import time

import pytest

from linkpass.lab import fabric as F
from linkpass.config import load_config, read_key_file
from linkpass.lab.fabric import fabric as fabric_mod
from linkpass.lab.fabric.cli import register

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("ip", "nft", "ping")), reason="needs ip, nft and ping"
    ),
]


# --------------------------------------------------------------------------- helpers


def _name() -> str:
    return "t" + secrets.token_hex(4)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def link(ns: str, dev: str) -> dict:
    return json.loads(sh("ip", "-n", ns, "-j", "-d", "link", "show", "dev", dev).stdout)[0]


def addrs(ns: str, dev: str) -> set[str]:
    info = json.loads(sh("ip", "-n", ns, "-j", "addr", "show", "dev", dev).stdout)[0]
    return {f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", []) if a["family"] == "inet"}


def netns_list() -> set[str]:
    return {line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()}


def ping(ns: str, addr: str, *extra: str) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ns, "ping", *(extra or ("-c1", "-W1")), addr, check=False)


def sysctl(ns: str, key: str) -> str:
    return sh("ip", "netns", "exec", ns, "cat", "/proc/sys/" + key.replace(".", "/")).stdout.strip()


def is_lower_up(ns: str, dev: str) -> bool:
    return "LOWER_UP" in link(ns, dev)["flags"]


@pytest.fixture
def make_fabric():
    """Factory: make_fabric(hosts, rails, **kw) -> description; every fabric is torn down after."""
    made: list[str] = []

    def make(hosts: int = 2, rails: int = 2, name: str | None = None, **kw) -> dict:
        name = name or _name()
        made.append(name)
        return F.up(hosts, rails, name, **kw)

    yield make
    for name in made:
        F.down(name)


@pytest.fixture
def fab(make_fabric) -> dict:
    return make_fabric(2, 2)


# --------------------------------------------------------------------------- up / down


def test_up_builds_what_the_description_says(make_fabric):
    d = make_fabric(3, 2, mode="per-rail-ip", hold_down_ms=500)
    name = d["name"]
    assert d["schema"] == "linkpass.lab.fabric/v1"
    assert (d["hosts_count"], d["rails_count"], d["fabric_netns"]) == (3, 2, f"{name}-fab")
    assert [r["bridge"] for r in d["rails"]] == ["br0", "br1"]
    assert [r["subnet"] for r in d["rails"]] == ["198.18.0.0/24", "198.18.1.0/24"]
    with open(os.path.join(d["state_dir"], "fabric.json")) as f:
        assert json.load(f) == d
    assert F.load(name) == d
    assert {d["fabric_netns"]} | {h["netns"] for h in d["hosts"]} <= netns_list()

    fab = d["fabric_netns"]
    for r in d["rails"]:
        assert link(fab, r["bridge"])["linkinfo"]["info_kind"] == "bridge"
    for h in d["hosts"]:
        i, ns = h["index"], h["netns"]
        assert ns == f"{name}-h{i}" and h["host_ip"] == f"198.19.0.{i + 1}"
        assert addrs(ns, h["host_netdev"]) == {f"198.19.0.{i + 1}/32"}
        assert is_lower_up(ns, "lp0") and is_lower_up(ns, "lp0-peer") and "UP" in link(ns, "lo")["flags"]
        for hr in h["rails"]:
            k = hr["rail"]
            assert (hr["netdev"], hr["switch_port"], hr["prefixlen"]) == (f"rail{k}", f"h{i}r{k}", 24)
            assert addrs(ns, hr["netdev"]) == {f"198.18.{k}.{i + 1}/24"}
            assert is_lower_up(ns, hr["netdev"])
            assert link(fab, hr["switch_port"])["master"] == f"br{k}"
            assert sysctl(ns, f"net.ipv4.conf.rail{k}.rp_filter") == "2"
        for key, want in [("net.ipv4.conf.all.rp_filter", "2"), ("net.ipv4.conf.all.arp_ignore", "1"),
                          ("net.ipv4.conf.all.arp_announce", "2"), ("net.ipv6.conf.all.disable_ipv6", "1")]:
            assert sysctl(ns, key) == want, key
        # No routes between host IPs: only the connected rail subnets.
        routes = sh("ip", "-n", ns, "-4", "route", "show").stdout
        assert "198.19." not in routes
    assert sysctl(fab, "net.ipv6.conf.all.disable_ipv6") == "1"

    for r in d["rails"]:  # host 0 -> host 1 over every rail
        assert ping(d["hosts"][0]["netns"], d["hosts"][1]["rails"][r["id"]]["address"]).returncode == 0

    st = os.stat(d["notice_key_file"])
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert len(read_key_file(d["notice_key_file"])) == 64
    for h in d["hosts"]:
        cfg = load_config(h["config"])
        assert cfg.daemon.host == h["name"] and cfg.daemon.mode == "per-rail-ip"
        assert str(cfg.daemon.host_ip) == h["host_ip"] and cfg.daemon.hold_down_ms == 500
        assert cfg.daemon.control_socket == h["control_socket"]
        assert cfg.daemon.notice_key_file == d["notice_key_file"]
        assert [(r.id, r.netdev, str(r.address)) for r in cfg.rails] == [
            (r["rail"], r["netdev"], r["address"]) for r in h["rails"]]
        assert [p.name for p in cfg.peers] == [p["name"] for p in d["hosts"] if p["index"] != h["index"]]
        for p in cfg.peers:
            j = int(p.name[1:])
            assert str(p.host_ip) == f"198.19.0.{j + 1}"
            assert {k: str(v) for k, v in p.rail_ips.items()} == {0: f"198.18.0.{j + 1}", 1: f"198.18.1.{j + 1}"}
    assert F.netns_exec(name, 2) == ["ip", "netns", "exec", f"{name}-h2"]


def test_up_is_idempotent(fab):
    before = link(fab["hosts"][0]["netns"], "rail0")["ifindex"], link(fab["fabric_netns"], "br1")["ifindex"]
    again = F.up(2, 2, fab["name"])
    assert again == fab
    after = link(fab["hosts"][0]["netns"], "rail0")["ifindex"], link(fab["fabric_netns"], "br1")["ifindex"]
    assert before == after


def test_up_with_another_shape_is_refused(fab):
    with pytest.raises(F.FabricError, match=rf"fabric down --name {fab['name']}"):
        F.up(3, 2, fab["name"])
    assert F.load(fab["name"]) == fab


def test_foreign_namespace_is_refused_and_left_alone(make_fabric):
    name = _name()
    sh("ip", "netns", "add", f"{name}-h1")
    try:
        with pytest.raises(F.FabricError, match=rf"name in use: network namespace {name}-h1 exists"):
            make_fabric(2, 1, name=name)
        assert f"{name}-h1" in netns_list()
        assert not ({f"{name}-fab", f"{name}-h0"} & netns_list())
        assert F.down(name) is False
        assert f"{name}-h1" in netns_list()
    finally:
        sh("ip", "netns", "del", f"{name}-h1", check=False)


def test_down_removes_everything_and_is_idempotent(make_fabric):
    d = make_fabric(2, 2)
    F.cut(d["name"], 1, 1, "flap:10000:5")
    pid = F.load(d["name"])["faults"][0]["pid"]
    assert F.down(d["name"]) is True
    assert not (set(d["netns"]) & netns_list())
    assert not os.path.exists(d["state_dir"])
    assert not os.path.exists(f"/proc/{pid}")
    assert F.down(d["name"]) is False
    with pytest.raises(F.FabricError, match="no fabric named"):
        F.load(d["name"])


class _Crash(BaseException):
    """Stands in for the process dying half-way through up()."""


def test_down_after_a_crash_half_way_through_up(monkeypatch, make_fabric):
    name = _name()
    from linkpass.lab.fabric import build  # where _build finds _create_netns

    real = build._create_netns

    def create_two_then_die(names):
        real(names[:2])
        raise _Crash()

    monkeypatch.setattr(build, "_create_netns", create_two_then_die)
    with pytest.raises(_Crash):
        make_fabric(3, 2, name=name)
    monkeypatch.undo()
    state = F.load(name)
    assert state["status"] == "building"
    planned = [f"{name}-fab", f"{name}-h0", f"{name}-h1", f"{name}-h2"]
    assert state["netns"] == planned
    assert set(planned) & netns_list() == {f"{name}-fab", f"{name}-h0"}
    with pytest.raises(F.FabricError, match="incomplete"):
        F.cut(name, 0, 0, "admin-down")
    assert F.down(name) is True
    assert not (set(planned) & netns_list())
    assert not os.path.exists(state["state_dir"])
    assert F.down(name) is False


def test_up_after_a_crash_rebuilds(monkeypatch, make_fabric):
    name = _name()
    monkeypatch.setattr(fabric_mod, "_build", lambda desc: (fabric_mod._create_netns(desc["netns"]), _raise()))
    with pytest.raises(_Crash):
        make_fabric(2, 1, name=name)
    monkeypatch.undo()
    d = make_fabric(2, 1, name=name)
    assert d["status"] == "ready"
    assert ping(d["hosts"][0]["netns"], "198.18.0.2").returncode == 0


def _raise():
    raise _Crash()


# --------------------------------------------------------------------------- faults


def _check_timing(r: dict) -> None:
    assert r["changed"] is True
    assert isinstance(r["t_issued_ns"], int) and r["t_issued_ns"] <= r["t_done_ns"] <= time.monotonic_ns()


def test_admin_down_and_heal(fab):
    name, h0 = fab["name"], fab["hosts"][0]["netns"]
    r = F.cut(name, 0, 1, "admin-down")
    _check_timing(r)
    assert "UP" not in link(h0, "rail1")["flags"]
    assert F.load(name)["faults"] == [{"host": 0, "rail": 1, "mode": "admin-down", "pid": None,
                                       "t_issued_ns": r["t_issued_ns"]}]
    assert F.cut(name, 0, 1, "admin-down")["changed"] is False  # same mode: no-op
    h = F.heal(name, 0, 1)
    _check_timing(h)
    assert [x["mode"] for x in h["healed"]] == ["admin-down"]
    assert "UP" in link(h0, "rail1")["flags"]
    assert ping(h0, "198.18.1.2").returncode == 0
    assert F.heal(name, 0, 1)["changed"] is False  # healthy: no-op
    assert F.load(name)["faults"] == []


def test_carrier_loss_and_heal(fab):
    name, h1 = fab["name"], fab["hosts"][1]["netns"]
    F.cut(name, 1, 0, "carrier-loss")
    info = link(h1, "rail0")
    assert "NO-CARRIER" in info["flags"] and "LOWER_UP" not in info["flags"] and "UP" in info["flags"]
    # This kernel reports a veth whose peer is down as DOWN (older kernels: LOWERLAYERDOWN).
    assert info["operstate"] in ("LOWERLAYERDOWN", "DOWN")
    assert "UP" not in link(fab["fabric_netns"], "h1r0")["flags"]
    F.heal(name)
    assert is_lower_up(h1, "rail0")
    assert ping(h1, "198.18.0.1").returncode == 0


def test_blackhole_drops_but_keeps_carrier(fab):
    name, h0 = fab["name"], fab["hosts"][0]["netns"]
    assert ping(h0, "198.18.0.2").returncode == 0
    _check_timing(F.cut(name, 1, 0, "blackhole"))
    assert is_lower_up(fab["hosts"][1]["netns"], "rail0")
    assert ping(h0, "198.18.0.2").returncode != 0
    assert ping(h0, "198.18.1.2").returncode == 0
    table = json.loads(sh("ip", "netns", "exec", fab["fabric_netns"], "nft", "-j", "list", "table", "bridge",
                          "lpfault_h1r0").stdout)
    dropped = sum(e["counter"]["packets"] for item in table["nftables"] if "rule" in item
                  for e in item["rule"]["expr"] if "counter" in e)
    assert dropped > 0  # the bridge-family rules really drop on this kernel
    F.heal(name, 1, 0)
    assert ping(h0, "198.18.0.2").returncode == 0
    assert "lpfault" not in sh("ip", "netns", "exec", fab["fabric_netns"], "nft", "list", "ruleset").stdout


def test_random_loss(fab):
    name, h0 = fab["name"], fab["hosts"][0]["netns"]
    assert ping(h0, "198.18.0.2").returncode == 0  # resolves ARP first
    F.cut(name, 1, 0, "loss:50")
    out = ping(h0, "198.18.0.2", "-c", "100", "-i", "0.005", "-W", "1", "-q").stdout
    summary = next(line for line in out.splitlines() if "packets transmitted" in line)
    received = int(summary.split(",")[1].split()[0])
    loss_pct = 100 - received  # 100 sent
    assert 10 < loss_pct < 90, summary
    F.heal(name)
    out = ping(h0, "198.18.0.2", "-c", "50", "-i", "0.005", "-W", "1", "-q").stdout
    summary = next(line for line in out.splitlines() if "packets transmitted" in line)
    assert int(summary.split(",")[1].split()[0]) >= 49, summary


def test_flap(fab):
    name, h0 = fab["name"], fab["hosts"][0]["netns"]
    r = F.cut(name, 0, 1, "flap:200:3")
    _check_timing(r)
    pid = r["pid"]
    assert pid and os.path.exists(f"/proc/{pid}")
    states = [is_lower_up(h0, "rail1")]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states.append(is_lower_up(h0, "rail1"))
        if states[-1] and not F.load(name)["faults"]:
            break
        time.sleep(0.005)
    assert states[0] is False, "port is down when cut returns"
    assert states[-1] is True, "port is up after the flaps"
    downs = sum(1 for a, b in zip(states, states[1:]) if a and not b) + 1
    assert downs >= 2, f"saw {downs} down phases"
    assert F.load(name)["faults"] == []  # helper finished
    assert not os.path.exists(f"/proc/{pid}")
    assert ping(h0, "198.18.1.2").returncode == 0


def test_heal_stops_a_flap_and_modes_replace_each_other(fab):
    name, h0 = fab["name"], fab["hosts"][0]["netns"]
    pid = F.cut(name, 0, 0, "flap:60000:10")["pid"]
    r = F.cut(name, 0, 0, "blackhole")
    assert r["replaced"] == "flap:60000:10"
    assert not os.path.exists(f"/proc/{pid}")
    assert is_lower_up(h0, "rail0")
    assert [f["mode"] for f in F.load(name)["faults"]] == ["blackhole"]
    r = F.cut(name, 0, 0, "admin-down")
    assert r["replaced"] == "blackhole"
    assert "lpfault" not in sh("ip", "netns", "exec", fab["fabric_netns"], "nft", "list", "ruleset").stdout
    F.cut(name, 1, 1, "carrier-loss")
    h = F.heal(name)
    assert sorted((x["host"], x["rail"]) for x in h["healed"]) == [(0, 0), (1, 1)]
    assert ping(h0, "198.18.0.2").returncode == 0 and ping(h0, "198.18.1.2").returncode == 0


# --------------------------------------------------------------------------- errors


def test_bad_input_errors(fab):
    name = fab["name"]
    with pytest.raises(F.FabricError, match=r"unknown host 2 .*hosts are 0\.\.1"):
        F.cut(name, 2, 0, "admin-down")
    with pytest.raises(F.FabricError, match=r"unknown rail 5 .*rails are 0\.\.1"):
        F.cut(name, 0, 5, "admin-down")
    with pytest.raises(F.FabricError, match=r"unknown host -1"):
        F.heal(name, -1)
    for mode in ("loss:abc", "loss:0", "loss:101", "flap:10", "flap:x:3", "flap:200:0", "bogus", ""):
        with pytest.raises(F.FabricError, match=r"bad fault mode") as ei:
            F.cut(name, 0, 0, mode)
        assert "\n" not in str(ei.value)
    for bad in ("Lp", "1lp", "a-b", "abcdefghijklm", ""):
        with pytest.raises(F.FabricError, match="bad fabric name"):
            F.up(1, 1, bad)
    with pytest.raises(F.FabricError, match=r"hosts"):
        F.up(251, 1, _name())
    with pytest.raises(F.FabricError, match=r"rails"):
        F.up(1, 17, _name())
    with pytest.raises(F.FabricError, match="no fabric named"):
        F.cut(_name(), 0, 0, "admin-down")
    assert F.load(name)["faults"] == []


def _cli(*argv: str) -> int:
    ap = argparse.ArgumentParser(prog="linkpass")
    register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(list(argv))
    return args.func(args)


def test_cli(make_fabric, capsys):
    name = _name()
    make_fabric(2, 1, name=name)  # registers the teardown
    assert _cli("fabric", "up", "--hosts", "2", "--rails", "1", "--name", name, "--json") == 0
    assert json.loads(capsys.readouterr().out)["name"] == name
    assert _cli("fabric", "cut", "--host", "0", "--rail", "0", "--mode", "carrier-loss", "--name", name) == 0
    assert _cli("fabric", "show", "--name", name) == 0
    assert "carrier-loss" in capsys.readouterr().out
    assert _cli("fabric", "cut", "--host", "9", "--rail", "0", "--mode", "admin-down", "--name", name) == 2
    err = capsys.readouterr().err
    assert err.startswith("linkpass fabric: unknown host 9") and err.count("\n") == 1
    assert _cli("fabric", "up", "--hosts", "3", "--rails", "1", "--name", name) == 2
    assert _cli("fabric", "heal", "--name", name) == 0
    assert _cli("fabric", "down", "--name", name) == 0
    assert _cli("fabric", "down", "--name", name) == 0
    assert "nothing to do" in capsys.readouterr().out
