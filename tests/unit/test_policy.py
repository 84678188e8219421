"""linkpass.config.policy_from_config: the core's frozen view of a validated config carries
every setting the core reads, with the config's values (the policy has no defaults of its own)."""

from __future__ import annotations

import dataclasses

import pytest

from linkpass.config import DampingSection, ProbeSection, damping_policy, parse_config, policy_from_config, probe_policy
from linkpass.core.policy import DampingPolicy, EnginePolicy, ProbePolicy

from unit_helpers import host_ip, make_cfg, make_toml, rail_ip


def test_host_rails_and_peers_as_strings_in_config_order():
    cfg = make_cfg(rails=(2, 0), n_peers=2, hold_down_ms=1234, route_protocol=99, route_table=100, route_metric=7)
    p = policy_from_config(cfg)
    assert isinstance(p, EnginePolicy)
    h = p.host
    assert (h.name, h.mode, h.host_ip, h.route_protocol, h.route_table, h.route_metric, h.hold_down_ms) == \
        ("h0", "host-ip", host_ip(0), 99, 100, 7, 1234)
    assert [(r.id, r.netdev, r.address) for r in p.rails] == [(2, "rail2", rail_ip(2, 0)), (0, "rail0", rail_ip(0, 0))]
    assert [(q.name, q.host_ip, dict(q.rail_ips)) for q in p.peers] == [
        (f"h{i}", host_ip(i), {2: rail_ip(2, i), 0: rail_ip(0, i)}) for i in (1, 2)]


def test_per_rail_ip_mode_has_no_host_ips():
    p = policy_from_config(make_cfg(mode="per-rail-ip"))
    assert p.host.mode == "per-rail-ip" and p.host.host_ip is None and p.peers[0].host_ip is None


def test_policy_is_frozen():
    p = policy_from_config(make_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.host = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.peers[0].rail_ips[0] = "198.18.9.9"  # type: ignore[index]
    assert policy_from_config(make_cfg()) == p  # equal configs, equal policies


@pytest.mark.parametrize("policy_cls,section,build", [(ProbePolicy, ProbeSection, probe_policy),
                                                      (DampingPolicy, DampingSection, damping_policy)])
def test_every_policy_field_is_the_option_of_the_same_name(policy_cls, section, build):
    """Defaults come only from the config schema: each field equals its option, default or set."""
    names = [f.name for f in dataclasses.fields(policy_cls)]
    assert set(names) <= set(section.model_fields)
    assert {n: getattr(build(section()), n) for n in names} == {n: getattr(section(), n) for n in names}
    cfg = parse_config(make_toml() + "\n[probe]\ninterval_ms = 25\ndegraded_loss = 0.2\n[damping]\nenabled = false\nreuse = 700\n")
    p = policy_from_config(cfg)
    assert (p.probe.interval_ms, p.probe.degraded_loss, p.damping.enabled, p.damping.reuse) == (25, 0.2, False, 700)
