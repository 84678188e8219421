"""linkpass.autoconf: rails from a topology document, peers from a peers file."""

from __future__ import annotations

import pytest

from linkpass.autoconf import parse_peers_file, resolve
from linkpass.config import ConfigError, parse_config

BASE = """
[daemon]
host = "n1"
host_ip = "10.200.0.1"
[topology]
rails = "auto"
"""


def doc(*nics):
    return {"schema": "linkpass.topology/v1", "nics": list(nics)}


def nic(name, rail, netdev=None, netdevs=()):
    return {"name": name, "rail": rail, "netdevs": list(netdevs),
            "ports": [{"port": 1, "state": "ACTIVE", "netdev": netdev}]}


LINKS = {"ib0": {"addresses": ["10.0.0.1/16", "fe80::1/64"]}, "ib1": {"addresses": ["10.1.0.1/16"]}, "eth9": {"addresses": []}}


def test_rails_from_compute_nics_with_addresses():
    cfg = parse_config(BASE)
    r = resolve(cfg, doc(nic("mlx5_1", 1, "ib1"), nic("mlx5_0", 0, "ib0"), nic("mlx5_9", None, "eth9")), LINKS)
    assert [(x.id, x.netdev, str(x.address)) for x in r.config.rails] == [(0, "ib0", "10.0.0.1"), (1, "ib1", "10.1.0.1")]
    assert not r.config.auto and r.config.peers == []


def test_peers_file_derives_rail_addresses_from_host_bits():
    cfg = parse_config(BASE)
    text = "# hosts\nn1 10.200.0.1\nn2 10.200.3.7   # comment\n\nbad line here\nn3 not-an-ip\nn2 10.200.9.9\n"
    r = resolve(cfg, doc(nic("mlx5_0", 0, "ib0"), nic("mlx5_1", 1, "ib1")), LINKS, text, "hosts.txt")
    assert [(p.name, str(p.host_ip), {k: str(v) for k, v in p.rail_ips.items()}) for p in r.config.peers] == [
        ("n2", "10.200.3.7", {0: "10.0.3.7", 1: "10.1.3.7"})]
    assert any("hosts.txt: line 5" in w for w in r.warnings)
    assert any("hosts.txt: line 6" in w and "not an IPv4" in w for w in r.warnings)
    assert any("line 7" in w and "twice" in w for w in r.warnings)


def test_bond_netdev_and_nic_without_netdev():
    cfg = parse_config(BASE)
    r = resolve(cfg, doc(nic("mlx5_bond_0", 0, None, ["bond0"]), nic("mlx5_3", 1, None)), {"bond0": {"addresses": ["10.9.0.1/24"]}})
    assert [(x.id, x.netdev) for x in r.config.rails] == [(0, "bond0")]
    assert any("mlx5_3" in w and "no netdev" in w for w in r.warnings)


def test_no_usable_rail_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        resolve(parse_config(BASE), doc(nic("mlx5_0", None, "ib0")), LINKS)
    assert "no compute NIC" in str(e.value)


def test_config_rules_for_auto():
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + '[[rails]]\nid = 0\nnetdev = "ib0"\n', "x.toml")
    assert "leave [[rails]] out" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config(BASE.replace('rails = "auto"', 'rails = "config"'), "x.toml")
    assert "at least one [[rails]]" in str(e.value)


def test_parse_peers_file_on_garbage():
    peers, warnings = parse_peers_file("\x00\x01 garbage\n" * 3 + "ok 10.0.0.2\n", "p")
    assert peers == [("ok", "10.0.0.2")] and len(warnings) == 3
