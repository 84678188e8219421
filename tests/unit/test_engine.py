"""Engine scenarios: events in, actions out, with a fake clock (plain ints)."""

from __future__ import annotations

import json
import logging
import re

import pytest

from linkpass.config import policy_from_config
from linkpass.core.engine import Engine
from linkpass.core.health import TRANSITIONS, RailState
from linkpass.core.model import (
    RefreshNeighbors,
    AddrChanged,
    ApplyRoutes,
    Drain,
    LinkChanged,
    LinkSnapshot,
    Nexthop,
    PeerRails,
    RouteChanged,
    RoutesApplied,
    RouteSpec,
    HookPlan,
    NotifyHooks,
    SendNotice,
    SetTimer,
    Tick,
)
from unit_helpers import (
    MS,
    S,
    admin_down,
    applies,
    carrier_lost,
    decided,
    gone,
    host_ip,
    make_cfg,
    notices,
    rail_ip,
    snapshot,
    timers,
    up,
)

PROTO = 201


def host_route(peer: int, rails, cfg_proto=PROTO, table=254, metric=0) -> RouteSpec:
    nhs = tuple(sorted(Nexthop(rail_ip(r, peer), f"rail{r}", r) for r in rails))
    return RouteSpec(f"{host_ip(peer)}/32", nhs, host_ip(0), table, metric, cfg_proto)


def started(**kw) -> tuple[Engine, list]:
    cfg = make_cfg(**kw)
    eng = Engine(policy_from_config(cfg))
    acts = eng.handle(snapshot(cfg, 0), 0)
    return eng, acts


def link(facts, t):
    return LinkChanged(facts, t)


# ----------------------------------------------------------------------------- start


@pytest.mark.parametrize("n_rails", [2, 3, 4])
@pytest.mark.parametrize("n_peers", [1, 2, 3])
def test_start_all_up_host_ip(n_rails, n_peers):
    rails = tuple(range(n_rails))
    eng, acts = started(rails=rails, n_peers=n_peers)
    expected_routes = tuple(sorted((host_route(p, rails) for p in range(1, n_peers + 1)), key=lambda r: r.dst))
    assert len(decided(acts)) == 3
    ap, nh, sn = decided(acts)
    assert isinstance(ap, ApplyRoutes) and isinstance(nh, NotifyHooks) and isinstance(sn, SendNotice)
    assert ap.generation == 1 and sn.generation == 1 and nh.plan.generation == 1
    assert nh.plan.rails == nh.plan.usable == frozenset(rails)
    assert nh.plan.peer_usable == {f"h{p}": None for p in range(1, n_peers + 1)}
    assert ap.routes == expected_routes
    assert ap.keep_dsts == frozenset()
    assert ap.resync is False
    assert sn.usable == frozenset(rails) and sn.urgent is True
    assert eng.generation == 1
    assert all(h.state == RailState.UP for h in eng.rails.values())
    assert eng.warnings == []


def test_start_all_up_multipath_route_exact():
    eng, acts = started(rails=(0, 1), route_table=100, route_metric=7)
    (ap,) = applies(acts)
    assert ap.routes == (
        RouteSpec(
            "198.19.0.2/32",
            (Nexthop("198.18.0.2", "rail0", 0), Nexthop("198.18.1.2", "rail1", 1)),
            "198.19.0.1",
            100,
            7,
            201,
        ),
    )


def test_start_all_up_per_rail_ip_has_no_routes():
    eng, acts = started(mode="per-rail-ip", rails=(0, 1, 2), n_peers=2)
    (ap,) = applies(acts)
    assert ap.routes == () and ap.keep_dsts == frozenset()
    assert notices(acts) == [SendNotice(1, frozenset({0, 1, 2}), True)]


def test_link_events_before_the_first_snapshot_do_nothing():
    cfg = make_cfg()
    eng = Engine(policy_from_config(cfg))
    assert decided(eng.handle(link(carrier_lost("rail0"), 5), 5)) == []
    assert eng.generation == 0
    assert eng.rails[0].state == RailState.UNKNOWN
    # the snapshot that follows decides from its own content
    acts = eng.handle(snapshot(cfg, 10), 10)
    assert applies(acts)[0].routes == (host_route(1, (0, 1)),)


EARLY_EVENTS = {
    "peer_notice": PeerRails("h1", frozenset({0, 1}), 1, 1, 5),
    "tick": Tick(5),
    "drain": Drain(1, True, 5),
}


@pytest.mark.parametrize("kind", list(EARLY_EVENTS))
def test_no_plan_and_no_notice_before_the_first_snapshot(kind):
    eng = Engine(policy_from_config(make_cfg()))
    ev = EARLY_EVENTS[kind]
    acts = eng.handle(ev, ev.t_ns)
    assert applies(acts) == [] and notices(acts) == []
    assert eng.generation == 0


def test_peer_notice_before_the_first_snapshot_is_remembered():
    cfg = make_cfg(rails=(0, 1))
    eng = Engine(policy_from_config(cfg))
    eng.handle(PeerRails("h1", frozenset({1}), 1, 1, 5), 5)
    acts = eng.handle(snapshot(cfg, 10), 10)
    (ap,) = applies(acts)
    assert ap.routes == (host_route(1, (1,)),)
    assert notices(acts)[-1].usable == frozenset({0, 1})


def test_missing_netdev_at_start_warns_and_rail_is_down():
    cfg = make_cfg(rails=(0, 1, 2))
    eng = Engine(policy_from_config(cfg))
    acts = eng.handle(snapshot(cfg, 0, missing=(1,)), 0)
    assert len(eng.warnings) == 1
    assert "rail 1" in eng.warnings[0] and "'rail1'" in eng.warnings[0] and "not found" in eng.warnings[0]
    assert eng.rails[1].state == RailState.DOWN
    assert "not present" in eng.rails[1].reason
    (ap,) = applies(acts)
    assert ap.routes == (host_route(1, (0, 2)),)
    assert notices(acts)[0].usable == frozenset({0, 2})
    # a second dump does not repeat the warning
    eng.handle(snapshot(cfg, S, missing=(1,)), S)
    assert len(eng.warnings) == 1


def test_netdev_appearing_later_goes_through_hold_down():
    cfg = make_cfg(rails=(0, 1))
    eng = Engine(policy_from_config(cfg))
    eng.handle(snapshot(cfg, 0, missing=(1,)), 0)
    acts = eng.handle(link(up("rail1"), S), S)
    assert eng.rails[1].state == RailState.HOLD_DOWN
    assert applies(acts) == [] and timers(acts) == [SetTimer(3 * S)]


# ----------------------------------------------------------------------------- failover / failback


def test_carrier_loss_then_failback_after_hold_down():
    eng, _ = started(rails=(0, 1, 2))
    t1 = 1 * S
    acts = eng.handle(link(carrier_lost("rail1"), t1), t1)
    assert decided(acts) == [
        ApplyRoutes(2, (host_route(1, (0, 2)),), frozenset(), "link change on rail1", resync=False, purge_neighbors=("rail1",)),
        NotifyHooks(HookPlan(2, frozenset({0, 1, 2}), frozenset({0, 2}), {"h1": None}, "link change on rail1", t1)),
        SendNotice(2, frozenset({0, 2}), urgent=True),
    ]
    assert eng.rails[1].state == RailState.DOWN
    assert eng.rails[1].reason == "carrier lost on rail1"

    # link back: hold-down, no route change, a timer at now + hold-down
    t2 = 5 * S
    acts = eng.handle(link(up("rail1"), t2), t2)
    assert eng.rails[1].state == RailState.HOLD_DOWN
    # the link is back: refresh its unresolved neighbour entries, and a hold-down timer
    assert decided(acts) == [RefreshNeighbors("rail1"), SetTimer(t2 + 2 * S)]
    assert eng.generation == 2

    # a tick before the deadline changes nothing
    t3 = t2 + 2 * S - 1
    acts = eng.handle(Tick(t3), t3)
    assert applies(acts) == [] and notices(acts) == []
    assert all(a.at_ns == t2 + 2 * S for a in timers(acts))
    assert eng.rails[1].state == RailState.HOLD_DOWN
    assert eng.generation == 2

    # at the deadline: UP, and the route spans rail1 again
    t4 = t2 + 2 * S
    acts = eng.handle(Tick(t4), t4)
    assert eng.rails[1].state == RailState.UP
    (ap,) = applies(acts)
    assert ap.generation == 3 and ap.routes == (host_route(1, (0, 1, 2)),)
    assert notices(acts) == [SendNotice(3, frozenset({0, 1, 2}), True)]
    assert timers(acts) == []


def test_tick_after_deadline_also_fails_back():
    eng, _ = started(rails=(0, 1))
    eng.handle(link(carrier_lost("rail0"), S), S)
    eng.handle(link(up("rail0"), 2 * S), 2 * S)
    acts = eng.handle(Tick(10 * S), 10 * S)
    assert applies(acts)[0].routes == (host_route(1, (0, 1)),)
    assert eng.rails[0].since_ns == 10 * S


def test_hold_down_zero_fails_back_at_once():
    eng, _ = started(rails=(0, 1), hold_down_ms=0)
    eng.handle(link(carrier_lost("rail0"), S), S)
    acts = eng.handle(link(up("rail0"), 2 * S), 2 * S)
    assert eng.rails[0].state == RailState.UP
    assert timers(acts) == []
    assert applies(acts)[0].routes == (host_route(1, (0, 1)),)
    assert notices(acts)[0].usable == frozenset({0, 1})


def test_link_lost_during_hold_down_and_stale_tick():
    eng, _ = started(rails=(0, 1))
    eng.handle(link(carrier_lost("rail0"), S), S)
    eng.handle(link(up("rail0"), 2 * S), 2 * S)
    acts = eng.handle(link(carrier_lost("rail0"), 3 * S), 3 * S)
    assert eng.rails[0].state == RailState.DOWN
    assert decided(acts) == []  # nothing usable changed
    acts = eng.handle(Tick(4 * S), 4 * S)  # the timer set for the first hold-down
    assert applies(acts) == [] and eng.rails[0].state == RailState.DOWN
    acts = eng.handle(link(up("rail0"), 5 * S), 5 * S)
    assert timers(acts) == [SetTimer(7 * S)]


def test_two_rails_in_hold_down_get_the_earliest_timer_then_the_next():
    eng, _ = started(rails=(0, 1, 2))
    eng.handle(link(carrier_lost("rail0"), S), S)
    eng.handle(link(carrier_lost("rail1"), S), S)
    assert timers(decided(eng.handle(link(up("rail1"), 2 * S), 2 * S))) == [SetTimer(4 * S)]
    assert timers(decided(eng.handle(link(up("rail0"), 3 * S), 3 * S))) == []  # 4 s is still earlier
    acts = eng.handle(Tick(4 * S), 4 * S)
    assert eng.rails[1].state == RailState.UP and eng.rails[0].state == RailState.HOLD_DOWN
    assert timers(acts) == [SetTimer(5 * S)]
    assert applies(acts)[0].routes == (host_route(1, (1, 2)),)


def test_operstate_unknown_counts_as_healthy():
    eng, _ = started(rails=(0, 1))
    from linkpass.core.model import LinkFacts

    acts = eng.handle(link(LinkFacts("rail0", operstate="UNKNOWN"), S), S)
    assert decided(acts) == [] and eng.rails[0].state == RailState.UP
    acts = eng.handle(link(LinkFacts("rail0", operstate="DORMANT"), 2 * S), 2 * S)
    assert eng.rails[0].state == RailState.DOWN and "operstate DORMANT" in eng.rails[0].reason


def test_repeated_identical_link_event_is_not_a_change():
    eng, _ = started(rails=(0, 1))
    eng.handle(link(carrier_lost("rail1"), S), S)
    g = eng.generation
    assert decided(eng.handle(link(carrier_lost("rail1"), 2 * S), 2 * S)) == []
    assert decided(eng.handle(link(up("rail0"), 2 * S), 2 * S)) == []
    assert eng.generation == g


def test_link_event_for_a_netdev_we_do_not_use_is_ignored():
    eng, _ = started()
    assert decided(eng.handle(link(carrier_lost("eth0"), S), S)) == []
    assert eng.generation == 1


# ----------------------------------------------------------------------------- resync flag


def test_admin_down_asks_for_resync_and_flag_is_then_cleared():
    eng, _ = started(rails=(0, 1, 2))
    acts = eng.handle(link(admin_down("rail2"), S), S)
    (ap,) = applies(acts)
    assert ap.resync is True
    assert ap.routes == (host_route(1, (0, 1)),)
    acts = eng.handle(link(carrier_lost("rail1"), 2 * S), 2 * S)
    (ap,) = applies(acts)
    assert ap.resync is False


def test_netdev_removed_asks_for_resync():
    eng, _ = started(rails=(0, 1))
    (ap,) = applies(eng.handle(link(gone("rail0"), S), S))
    assert ap.resync is True


def test_carrier_loss_does_not_ask_for_resync():
    eng, _ = started(rails=(0, 1))
    (ap,) = applies(eng.handle(link(carrier_lost("rail0"), S), S))
    assert ap.resync is False


def test_failback_after_hold_down_asks_for_resync():
    eng, _ = started(rails=(0, 1))
    eng.handle(link(carrier_lost("rail0"), S), S)
    eng.handle(link(up("rail0"), 2 * S), 2 * S)
    (ap,) = applies(eng.handle(Tick(4 * S), 4 * S))
    assert ap.resync is True


def test_noop_tick_does_not_make_the_next_failover_resync():
    eng, _ = started(rails=(0, 1, 2))
    eng.handle(link(carrier_lost("rail0"), S), S)
    eng.handle(link(up("rail0"), 2 * S), 2 * S)  # timer for 4 s
    eng.handle(link(carrier_lost("rail0"), 3 * S), 3 * S)  # hold-down aborted; timer not cancelled
    assert applies(decided(eng.handle(Tick(4 * S), 4 * S))) == []  # stale tick: nothing to do
    (ap,) = applies(eng.handle(link(carrier_lost("rail1"), 5 * S), 5 * S))
    assert ap.resync is False


# ----------------------------------------------------------------------------- all rails down


def test_all_rails_down_keeps_the_peer_route():
    eng, _ = started(rails=(0, 1), n_peers=2)
    eng.handle(link(carrier_lost("rail0"), S), S)
    acts = eng.handle(link(carrier_lost("rail1"), 2 * S), 2 * S)
    (ap,) = applies(acts)
    assert ap.routes == ()
    assert ap.keep_dsts == frozenset({"198.19.0.2/32", "198.19.0.3/32"})
    assert notices(acts) == [SendNotice(3, frozenset(), True)]


def test_all_rails_down_at_start():
    cfg = make_cfg(rails=(0, 1))
    eng = Engine(policy_from_config(cfg))
    acts = eng.handle(snapshot(cfg, 0, down=(0, 1)), 0)
    (ap,) = applies(acts)
    assert ap.routes == () and ap.keep_dsts == frozenset({"198.19.0.2/32"})
    assert notices(acts) == [SendNotice(1, frozenset(), True)]


def test_all_rails_down_per_rail_ip_keeps_every_peer_rail_address():
    eng, _ = started(mode="per-rail-ip", rails=(0, 1))
    eng.handle(link(carrier_lost("rail0"), S), S)
    (ap,) = applies(eng.handle(link(carrier_lost("rail1"), 2 * S), 2 * S))
    assert ap.routes == ()
    assert ap.keep_dsts == frozenset({"198.18.0.2/32", "198.18.1.2/32"})


# ----------------------------------------------------------------------------- per-rail-ip failover


def test_per_rail_ip_failover_routes_failed_rail_addresses_via_a_usable_rail():
    eng, _ = started(mode="per-rail-ip", rails=(0, 1, 2), n_peers=2)
    acts = eng.handle(link(carrier_lost("rail1"), S), S)
    (ap,) = applies(acts)
    # rail 1 -> common[1 % 2] = rail 2
    assert ap.routes == (
        RouteSpec("198.18.1.2/32", (Nexthop("198.18.2.2", "rail2", 2),), "198.18.1.1", 254, 0, PROTO),
        RouteSpec("198.18.1.3/32", (Nexthop("198.18.2.3", "rail2", 2),), "198.18.1.1", 254, 0, PROTO),
    )
    assert ap.keep_dsts == frozenset()


# ----------------------------------------------------------------------------- peer notices


def test_peer_notice_changes_only_that_peers_route():
    eng, _ = started(rails=(0, 1, 2), n_peers=2)
    acts = eng.handle(PeerRails("h1", frozenset({0, 2}), generation=9, seq=1, t_ns=S), S)
    (ap,) = applies(acts)
    assert ap.generation == 2
    assert ap.routes == (host_route(1, (0, 2)), host_route(2, (0, 1, 2)))
    assert notices(acts) == []  # our own rails did not change
    assert eng.peer_usable == {"h1": frozenset({0, 2})}


def test_same_peer_notice_again_is_not_a_change():
    eng, _ = started(rails=(0, 1, 2))
    eng.handle(PeerRails("h1", frozenset({0, 2}), 9, 1, S), S)
    assert decided(eng.handle(PeerRails("h1", frozenset({0, 2}), 9, 2, 2 * S), 2 * S)) == []
    assert eng.generation == 2
    assert eng.peer_last_ns["h1"] == 2 * S


def test_peer_announcing_all_rails_restores_its_route():
    eng, _ = started(rails=(0, 1))
    eng.handle(PeerRails("h1", frozenset({1}), 1, 1, S), S)
    (ap,) = applies(eng.handle(PeerRails("h1", frozenset({0, 1}), 2, 2, 2 * S), 2 * S))
    assert ap.routes == (host_route(1, (0, 1)),)


def test_peer_with_no_common_rail_is_kept():
    eng, _ = started(rails=(0, 1), n_peers=2)
    eng.handle(link(carrier_lost("rail0"), S), S)
    (ap,) = applies(eng.handle(PeerRails("h2", frozenset({0}), 1, 1, 2 * S), 2 * S))
    assert ap.routes == (host_route(1, (1,)),)
    assert ap.keep_dsts == frozenset({"198.19.0.3/32"})


def test_unknown_peer_notice_is_ignored():
    eng, _ = started(rails=(0, 1))
    assert decided(eng.handle(PeerRails("stranger", frozenset(), 1, 1, S), S)) == []
    assert eng.peer_usable == {} and "stranger" not in eng.peer_last_ns
    assert eng.generation == 1


def test_peer_notice_naming_unconfigured_rails_only_uses_known_ones():
    eng, _ = started(rails=(0, 1))
    (ap,) = applies(eng.handle(PeerRails("h1", frozenset({1, 9}), 1, 1, S), S))
    assert ap.routes == (host_route(1, (1,)),)


# ----------------------------------------------------------------------------- drain


def test_drain_and_undrain():
    eng, _ = started(rails=(0, 1))
    acts = eng.handle(Drain(0, True, S), S)
    assert eng.rails[0].state == RailState.DRAINED
    assert applies(acts)[0].routes == (host_route(1, (1,)),)
    assert notices(acts)[0].usable == frozenset({1})
    acts = eng.handle(Drain(0, False, 2 * S), 2 * S)
    assert eng.rails[0].state == RailState.HOLD_DOWN
    assert decided(acts) == [SetTimer(4 * S)]
    acts = eng.handle(Tick(4 * S), 4 * S)
    assert applies(acts)[0].routes == (host_route(1, (0, 1)),)


def test_drain_of_unknown_rail_is_ignored():
    eng, _ = started(rails=(0, 1))
    assert decided(eng.handle(Drain(9, True, S), S)) == []
    assert eng.generation == 1


def test_link_changes_while_drained_do_not_replan():
    eng, _ = started(rails=(0, 1))
    eng.handle(Drain(0, True, S), S)
    assert decided(eng.handle(link(carrier_lost("rail0"), 2 * S), 2 * S)) == []
    assert eng.rails[0].state == RailState.DRAINED
    eng.handle(Drain(0, False, 3 * S), 3 * S)
    assert eng.rails[0].state == RailState.DOWN


# ----------------------------------------------------------------------------- foreign routes


def test_foreign_route_to_our_destination_forces_resync_without_new_generation():
    eng, _ = started(rails=(0, 1))
    acts = eng.handle(RouteChanged("198.19.0.2/32", proto=4, table=254, deleted=False, t_ns=S), S)
    assert decided(acts) == [ApplyRoutes(1, (host_route(1, (0, 1)),), frozenset(), "route to 198.19.0.2/32 changed outside linkpass", resync=True)]
    assert eng.generation == 1


def test_our_route_deleted_by_someone_else_forces_resync():
    eng, _ = started(rails=(0, 1))
    acts = eng.handle(RouteChanged("198.19.0.2/32", proto=PROTO, table=254, deleted=True, t_ns=S), S)
    (ap,) = applies(acts)
    assert ap.resync is True and ap.generation == 1


def test_our_own_route_echo_is_ignored():
    eng, _ = started(rails=(0, 1))
    assert decided(eng.handle(RouteChanged("198.19.0.2/32", proto=PROTO, table=254, deleted=False, t_ns=S), S)) == []


def test_route_to_a_destination_not_ours_is_ignored():
    eng, _ = started(rails=(0, 1))
    assert decided(eng.handle(RouteChanged("10.0.0.0/8", proto=4, table=254, deleted=False, t_ns=S), S)) == []


def test_route_change_before_any_plan_is_ignored():
    eng = Engine(policy_from_config(make_cfg()))
    assert decided(eng.handle(RouteChanged("198.19.0.2/32", proto=4, table=254, deleted=False, t_ns=S), S)) == []


def test_echo_of_our_own_deletion_of_a_stale_route_is_ignored():
    eng, _ = started(mode="per-rail-ip", rails=(0, 1))
    eng.handle(link(carrier_lost("rail1"), S), S)  # /32 for 198.18.1.2 via rail0
    eng.handle(link(up("rail1"), 2 * S), 2 * S)
    (ap,) = applies(eng.handle(Tick(4 * S), 4 * S))
    assert ap.routes == ()  # the actuator now deletes 198.18.1.2/32 (ours)
    echo = RouteChanged("198.18.1.2/32", proto=PROTO, table=254, deleted=True, t_ns=4 * S + MS)
    assert decided(eng.handle(echo, 4 * S + MS)) == []


# ----------------------------------------------------------------------------- generations


def test_generations_strictly_increase_and_only_on_change():
    eng, acts = started(rails=(0, 1, 2), n_peers=2)
    gens = [a.generation for a in applies(acts)]
    steps = [
        (link(carrier_lost("rail0"), 1 * S), True),
        (link(carrier_lost("rail0"), 2 * S), False),
        (PeerRails("h1", frozenset({1, 2}), 1, 1, 3 * S), False),  # rail 0 already unusable locally
        (PeerRails("h1", frozenset({1}), 1, 2, 4 * S), True),
        (RoutesApplied(3, 5 * S), False),
        (AddrChanged("rail0", "198.18.0.1", 24, True, 6 * S), False),
        (link(up("rail0"), 7 * S), False),  # hold-down: nothing usable yet
        (Tick(8 * S), False),
        (Tick(9 * S), True),
        (Drain(2, True, 10 * S), True),
        (Drain(2, True, 11 * S), False),
    ]
    for ev, bumps in steps:
        before = eng.generation
        acts = eng.handle(ev, ev.t_ns)
        if bumps:
            assert eng.generation == before + 1, ev
            assert [a.generation for a in applies(acts)] == [eng.generation]
        else:
            assert eng.generation == before, ev
            assert applies(acts) == [], ev
        gens += [a.generation for a in applies(acts)]
    assert gens == sorted(set(gens))
    assert gens == list(range(1, len(gens) + 1))


def test_routes_applied_is_recorded():
    eng, _ = started()
    eng.handle(RoutesApplied(1, 5, replaced=1, errors=("x",), conflicts=("c",)), 5)
    assert eng.applied_generation == 1 and eng.apply_errors == ("x",) and eng.conflicts == ("c",)
    eng.handle(RoutesApplied(0, 6), 6)  # older: does not overwrite
    assert eng.applied_generation == 1 and eng.apply_errors == ("x",)


def test_illegal_transition_is_never_reached_by_events(caplog):
    """Sanity: a busy event sequence logs only legal transitions (no exception escapes)."""
    eng, _ = started(rails=(0, 1))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="linkpass"):
        for i, f in enumerate([carrier_lost, up, carrier_lost, admin_down, up, gone, up]):
            eng.handle(link(f("rail0"), (i + 1) * S), (i + 1) * S)
            eng.handle(Drain(1, i % 2 == 0, (i + 1) * S), (i + 1) * S)
            eng.handle(Tick((i + 1) * S + S // 2), (i + 1) * S + S // 2)
    states = {s.value: s for s in RailState}
    seen: dict[int, list[tuple[RailState, RailState]]] = {0: [], 1: []}
    for r in caplog.records:
        m = re.fullmatch(r"rail (\d+): (\w+) -> (\w+) \(.*\)", r.getMessage(), re.S)
        if r.name == "linkpass.health" and m:
            seen[int(m[1])].append((states[m[2]], states[m[3]]))
    for rail, steps in seen.items():
        assert all(new in TRANSITIONS[old] for old, new in steps), (rail, steps)  # every logged one is legal
        assert all(a[1] == b[0] for a, b in zip(steps, steps[1:])), (rail, steps)  # and they chain: none unlogged
        assert steps and steps[-1][1] == eng.rails[rail].state, (rail, steps)  # ending where the engine is
    # the sequence went through the interesting states on both rails
    assert {new for _, new in seen[0]} >= {RailState.DOWN, RailState.HOLD_DOWN}, seen[0]
    assert RailState.DRAINED in {new for _, new in seen[1]}, seen[1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# ----------------------------------------------------------------------------- status


def test_status_shape():
    cfg = make_cfg(rails=(0, 1), n_peers=2)
    eng = Engine(policy_from_config(cfg))
    st = eng.status(0)
    assert [r["state"] for r in st["rails"]] == ["UNKNOWN", "UNKNOWN"]
    assert [r["last_change_ago_ms"] for r in st["rails"]] == [None, None]

    eng.handle(snapshot(cfg, 1 * S), 1 * S)
    eng.handle(link(carrier_lost("rail1"), 2 * S), 2 * S)
    eng.handle(PeerRails("h2", frozenset({1}), 4, 77, 3 * S), 3 * S)
    eng.handle(AddrChanged("rail0", "198.18.0.1", 24, True, 3 * S), 3 * S)
    st = eng.status(2 * S + 1_500 * MS)
    json.dumps(st)  # JSON-ready
    assert {"host", "mode", "generation", "rails", "peers"} <= set(st)
    assert st["host"] == "h0" and st["mode"] == "host-ip" and st["generation"] == eng.generation == 3
    r0, r1 = st["rails"]
    assert (r0["id"], r0["netdev"], r0["state"], r0["usable"]) == (0, "rail0", "UP", True)
    assert (r1["id"], r1["netdev"], r1["state"], r1["usable"]) == (1, "rail1", "DOWN", False)
    assert r1["reason"] == "carrier lost on rail1"
    assert r0["reason"] == "link up at start"
    assert r1["last_change_ago_ms"] == 1500.0
    assert r0["last_change_ago_ms"] == 2500.0
    assert r1["link"] == {"present": True, "admin_up": True, "carrier": False, "operstate": "LOWERLAYERDOWN"}
    assert r0["addresses"] == ["198.18.0.1/24"]
    p1, p2 = st["peers"]
    assert p1["name"] == "h1" and p1["usable_rails"] is None and p1["last_notice_ago_ms"] is None
    assert p2["name"] == "h2" and p2["usable_rails"] == [1] and p2["peer_generation"] == 4
    assert p2["last_notice_ago_ms"] == 500.0
    assert p2["host_ip"] == "198.19.0.3"
    assert [r["dst"] for r in st["routes"]] == ["198.19.0.2/32"]
    assert st["kept_destinations"] == ["198.19.0.3/32"]


def test_status_hold_down_left():
    eng, _ = started(rails=(0, 1))
    eng.handle(link(carrier_lost("rail0"), S), S)
    eng.handle(link(up("rail0"), 2 * S), 2 * S)
    st = eng.status(2 * S + 500 * MS)
    assert st["rails"][0]["state"] == "HOLD_DOWN"
    assert st["rails"][0]["hold_down_left_ms"] == 1500.0
    assert st["rails"][1]["hold_down_left_ms"] is None


def test_history_records_transitions_with_event_time():
    eng, _ = started(rails=(0, 1))
    eng.handle(link(carrier_lost("rail0"), S - 3), S)
    rail_entries = [h for h in eng.history if h.kind == "rail" and h.data["rail"] == 0]
    last = rail_entries[-1]
    assert (last.data["old"], last.data["new"], last.t_ns, last.data["event_t_ns"]) == ("UP", "DOWN", S, S - 3)


# ----------------------------------------------------------------------------- resync dumps


def test_resync_dump_with_a_change_replans():
    cfg = make_cfg(rails=(0, 1))
    eng = Engine(policy_from_config(cfg))
    eng.handle(snapshot(cfg, 0), 0)
    acts = eng.handle(LinkSnapshot(snapshot(cfg, S, down=(1,)).links, S, reason="overrun"), S)
    (ap,) = applies(acts)
    assert ap.generation == 2 and ap.routes == (host_route(1, (0,)),)
    assert "overrun" in ap.reason


def test_resync_dump_after_overrun_asks_the_actuator_to_reread_routes():
    cfg = make_cfg(rails=(0, 1))
    eng = Engine(policy_from_config(cfg))
    eng.handle(snapshot(cfg, 0), 0)
    acts = eng.handle(LinkSnapshot(snapshot(cfg, S).links, S, reason="overrun"), S)
    assert any(a.resync for a in applies(acts))


def test_purge_neighbors_names_only_rails_that_just_became_unusable():
    from unit_helpers import applies, carrier_lost, make_cfg, snapshot, up

    from linkpass.core.engine import Engine
    from linkpass.core.model import LinkChanged

    cfg = make_cfg(rails=(0, 1, 2))
    e = Engine(policy_from_config(cfg))
    first = applies(e.handle(snapshot(cfg, 1), 1))
    assert [a.purge_neighbors for a in first] == [()]
    acts = applies(e.handle(LinkChanged(carrier_lost("rail1"), 2), 2))
    assert [a.purge_neighbors for a in acts] == [("rail1",)]
    # the link coming back (into hold-down) purges nothing
    acts = applies(e.handle(LinkChanged(up("rail1"), 3), 3))
    assert all(a.purge_neighbors == () for a in acts)


# ----------------------------------------------------------------------------- events from the daemon's edges


def test_config_reloaded_is_an_event_that_forces_a_new_plan():
    from linkpass.core.model import ConfigReloaded

    eng, _ = started(rails=(0, 1))
    acts = eng.handle(ConfigReloaded(policy_from_config(make_cfg(rails=(0, 1))), None, 2 * S), 2 * S)
    assert [a.generation for a in applies(acts)] == [2] and [n.generation for n in notices(acts)] == [2]
    assert [h.kind for h in eng.history][-2:] == ["config_reloaded", "plan"]


def test_hook_peers_changed_becomes_set_probe_priority_of_configured_peers():
    from linkpass.core.model import HookPeersChanged, SetProbePriority

    eng, _ = started(rails=(0, 1), n_peers=2)
    assert decided(eng.handle(HookPeersChanged(("h2", "nobody", "h1"), S), S)) == [SetProbePriority(("h1", "h2"))]
    assert decided(eng.handle(HookPeersChanged(("h1", "h2"), 2 * S), 2 * S)) == []
    assert decided(eng.handle(HookPeersChanged((), 3 * S), 3 * S)) == [SetProbePriority(())]
