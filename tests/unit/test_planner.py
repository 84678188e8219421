"""plan_routes / all_destinations in both addressing modes."""

from __future__ import annotations

import itertools

import pytest

from linkpass.config import policy_from_config
from linkpass.core.model import Nexthop, RouteSpec
from linkpass.core.planner import all_destinations, plan_routes
from unit_helpers import host_ip, make_cfg, rail_ip

# ----------------------------------------------------------------------------- host-ip


def test_host_ip_all_usable_one_multipath_route_per_peer():
    cfg = make_cfg(rails=(0, 1, 2), n_peers=2, route_protocol=99, route_table=77, route_metric=5)
    plan = plan_routes(policy_from_config(cfg), {0, 1, 2}, {})
    assert plan.keep_dsts == frozenset() and plan.notes == ()
    assert plan.routes == tuple(
        RouteSpec(
            f"{host_ip(p)}/32",
            tuple(Nexthop(rail_ip(r, p), f"rail{r}", r) for r in (0, 1, 2)),
            "198.19.0.1",
            77,
            5,
            99,
        )
        for p in (1, 2)
    )


def test_host_ip_nexthops_are_sorted_and_only_usable_rails():
    # rail ids chosen so that rail order, gateway string order and netdev order differ
    cfg = make_cfg(rails=(10, 2, 7, 3), n_peers=1)
    plan = plan_routes(policy_from_config(cfg), [7, 10, 2], {})
    (route,) = plan.routes
    assert route.nexthops == tuple(sorted(route.nexthops))
    assert {n.rail for n in route.nexthops} == {2, 7, 10}
    assert {(n.gateway, n.netdev) for n in route.nexthops} == {(rail_ip(r, 1), f"rail{r}") for r in (2, 7, 10)}
    assert route.prefsrc == host_ip(0)


def test_host_ip_peer_announcement_restricts_rails_per_peer():
    cfg = make_cfg(rails=(0, 1, 2), n_peers=3)
    plan = plan_routes(policy_from_config(cfg), {0, 1, 2}, {"h2": frozenset({1}), "h3": frozenset({0, 2})})
    by_dst = {r.dst: [n.rail for n in r.nexthops] for r in plan.routes}
    assert by_dst == {"198.19.0.2/32": [0, 1, 2], "198.19.0.3/32": [1], "198.19.0.4/32": [0, 2]}


def test_host_ip_no_common_rail_keeps_destination_with_a_note():
    cfg = make_cfg(rails=(0, 1), n_peers=2)
    plan = plan_routes(policy_from_config(cfg), {0}, {"h1": frozenset({1})})
    assert [r.dst for r in plan.routes] == ["198.19.0.3/32"]
    assert plan.keep_dsts == frozenset({"198.19.0.2/32"})
    assert len(plan.notes) == 1 and "h1" in plan.notes[0]


def test_host_ip_peer_with_fewer_rails():
    cfg = make_cfg(rails=(0, 1, 2), n_peers=1, peer_rails={1: (0, 2)})
    (route,) = plan_routes(policy_from_config(cfg), {0, 1, 2}, {}).routes
    assert [n.rail for n in route.nexthops] == [0, 2]


def test_host_ip_empty_announcement_means_no_rail():
    cfg = make_cfg(rails=(0, 1))
    plan = plan_routes(policy_from_config(cfg), {0, 1}, {"h1": frozenset()})
    assert plan.routes == () and plan.keep_dsts == frozenset({"198.19.0.2/32"})


def test_plan_is_deterministic_and_sorted_by_dst():
    cfg = make_cfg(rails=(0, 1, 2), n_peers=3)
    a = plan_routes(policy_from_config(cfg), [2, 0, 1], {"h3": frozenset({2, 1})})
    b = plan_routes(policy_from_config(cfg), {0, 1, 2}, {"h3": frozenset({1, 2})})
    assert a == b
    assert [r.dst for r in a.routes] == sorted(r.dst for r in a.routes)


# ----------------------------------------------------------------------------- per-rail-ip


def test_per_rail_ip_all_usable_no_routes():
    cfg = make_cfg(mode="per-rail-ip", rails=(0, 1, 2), n_peers=2)
    plan = plan_routes(policy_from_config(cfg), {0, 1, 2}, {})
    assert plan.routes == () and plan.keep_dsts == frozenset()


def test_per_rail_ip_failed_rail_address_via_usable_rail_with_own_source():
    cfg = make_cfg(mode="per-rail-ip", rails=(0, 1, 2), n_peers=1, route_protocol=201, route_table=254, route_metric=3)
    plan = plan_routes(policy_from_config(cfg), {0, 2}, {})
    # rail 1's peer address, via common[1 % 2] == rail 2, source = our rail-1 address
    assert plan.routes == (
        RouteSpec("198.18.1.2/32", (Nexthop("198.18.2.2", "rail2", 2),), "198.18.1.1", 254, 3, 201),
    )
    assert plan.keep_dsts == frozenset()


@pytest.mark.parametrize("local,remote", [({0, 1, 2, 3}, {1, 3}), ({0, 2}, None), ({1}, {0, 1, 2}), ({3, 0}, {0, 1, 3})])
def test_per_rail_ip_every_unusable_rail_is_covered_via_a_common_rail(local, remote):
    rails = (0, 1, 2, 3)
    cfg = make_cfg(mode="per-rail-ip", rails=rails, n_peers=1)
    peer_usable = {} if remote is None else {"h1": frozenset(remote)}
    plan = plan_routes(policy_from_config(cfg), local, peer_usable)
    common = set(local) & (set(rails) if remote is None else set(remote))
    failed = set(rails) - common
    assert {r.dst for r in plan.routes} == {f"{rail_ip(k, 1)}/32" for k in failed}
    for r in plan.routes:
        k = int(r.dst.split(".")[2])
        (nh,) = r.nexthops
        assert nh.rail in common
        assert (nh.gateway, nh.netdev) == (rail_ip(nh.rail, 1), f"rail{nh.rail}")
        assert r.prefsrc == rail_ip(k, 0)
        assert r.proto == 201


def test_per_rail_ip_no_common_rail_keeps_all_failed_addresses():
    cfg = make_cfg(mode="per-rail-ip", rails=(0, 1), n_peers=2)
    plan = plan_routes(policy_from_config(cfg), {0}, {"h1": frozenset({1})})
    assert plan.keep_dsts == frozenset({"198.18.0.2/32", "198.18.1.2/32"})
    assert plan.routes == (RouteSpec("198.18.1.3/32", (Nexthop("198.18.0.3", "rail0", 0),), "198.18.1.1", 254, 0, 201),)


def test_per_rail_ip_spreads_failed_rails_over_common_rails_deterministically():
    cfg = make_cfg(mode="per-rail-ip", rails=(0, 1, 2, 3), n_peers=1)
    plan = plan_routes(policy_from_config(cfg), {0, 1}, {})
    via = {r.dst: r.nexthops[0].rail for r in plan.routes}
    assert via == {"198.18.2.2/32": 0, "198.18.3.2/32": 1}


# ----------------------------------------------------------------------------- destinations


def test_all_destinations_host_ip():
    cfg = make_cfg(rails=(0, 1), n_peers=3)
    assert all_destinations(policy_from_config(cfg)) == frozenset({"198.19.0.2/32", "198.19.0.3/32", "198.19.0.4/32"})


def test_all_destinations_per_rail_ip():
    cfg = make_cfg(mode="per-rail-ip", rails=(0, 1), n_peers=2)
    assert all_destinations(policy_from_config(cfg)) == frozenset(f"{rail_ip(r, p)}/32" for r, p in itertools.product((0, 1), (1, 2)))


@pytest.mark.parametrize("mode", ["host-ip", "per-rail-ip"])
def test_every_planned_or_kept_destination_is_in_all_destinations(mode):
    cfg = make_cfg(mode=mode, rails=(0, 1, 2), n_peers=2)
    dsts = all_destinations(policy_from_config(cfg))
    for k in range(8):
        local = {r for r in (0, 1, 2) if k >> r & 1}
        plan = plan_routes(policy_from_config(cfg), local, {"h2": frozenset({0, 1})})
        assert {r.dst for r in plan.routes} | plan.keep_dsts <= dsts
