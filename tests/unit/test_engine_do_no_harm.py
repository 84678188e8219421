"""Do no harm: a healthy local rail is failed only on evidence that its local end is at fault.

Each case drives the pure engine with probe results as the prober reports them (kernel arrival
times, ``peer_elsewhere`` as the prober computes it, or None where it cannot tell) and counts
rail transitions and route changes; nothing here depends on time passing.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from unit_helpers import make_cfg, snapshot

from linkpass.config import policy_from_config, probe_policy
from linkpass.core.engine import Engine
from linkpass.core.model import ApplyRoutes, ProbeResult

MS = 1_000_000


def engine(n_peers=2, rails=(0, 1)):
    cfg = make_cfg(rails=rails, n_peers=n_peers, hold_down_ms=100)
    e = Engine(policy_from_config(cfg))
    e.handle(snapshot(cfg, 0), 0)
    return cfg, e


def res(e, t, rail, peer, ok, elsewhere=None):
    return e.handle(ProbeResult(rail, peer, ok, t, rtt_ns=20_000 if ok else None, peer_elsewhere=None if ok else elsewhere), t)


def all_up(e, cfg, t, rails=(0, 1)):
    for p in cfg.peers:
        for r in rails:
            res(e, t, r, p.name, True)


def route_rails(e, peer_ip):
    r = next(r for r in e.plan.routes if r.dst == f"{peer_ip}/32")
    return sorted(n.rail for n in r.nexthops)


def test_issue_reproduction_one_remote_fault_plus_one_transient_miss_fails_no_local_rail():
    """3 hosts, every path answering; 3 misses on (rail 1, h1); then one miss each on (rail 0,
    h2) and (rail 1, h2) at the same moment: before the fix rail 1 went DOWN ("1/1 peers")."""
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        res(e, t, 1, "h1", False)  # elsewhere unknown: the engine's own picture decides
        res(e, t, 0, "h1", True)
    assert e.paths[(1, "h1")].state.value == "DOWN"
    t += 10 * MS
    res(e, t, 0, "h2", False)
    res(e, t, 1, "h2", False)
    assert e.paths[(0, "h2")].state.value == "SUSPECT" and e.paths[(1, "h2")].state.value == "SUSPECT"
    assert e.rails[1].state.value == "UP" and e.rails[0].state.value == "UP" and not e.probe_failed
    assert e.totals["rail_down"] == 0
    for _ in range(cfg.probe.detect_multiplier):  # h1 stays silent on rail 1 for the path hold
        t += 10 * MS
        res(e, t, 1, "h1", False)
        res(e, t, 0, "h1", True)
    h1_ip = str(cfg.peers[0].host_ip)
    assert route_rails(e, h1_ip) == [0]  # traffic to h1 leaves its broken rail all the same


def test_one_remote_port_fault_with_prober_flags_fails_no_local_rail_but_reroutes_that_peer():
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    for _ in range(6):
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    assert e.paths[(1, "h1")].state.value == "DOWN" and not e.probe_failed
    assert route_rails(e, str(cfg.peers[0].host_ip)) == [0]
    assert route_rails(e, str(cfg.peers[1].host_ip)) == [0, 1]


def test_a_path_alone_down_is_left_only_after_one_more_detection_time():
    """One path silent for BFD's detection time while its peer answers on the other rail: a
    pair-only fault or a delay on that path alone (a reply 35 ms late under CPU load); the
    routes wait one more detection time, and a reply in that time moves nothing."""
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    h1_ip = str(cfg.peers[0].host_ip)
    gen = e.generation
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    assert e.paths[(1, "h1")].state.value == "DOWN"
    t += 5 * MS
    res(e, t, 1, "h1", True)  # the late reply: it was a delay
    assert route_rails(e, h1_ip) == [0, 1] and e.generation == gen
    for _ in range(cfg.probe.detect_multiplier):  # now a real fault: DOWN, then the hold
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    assert e.paths[(1, "h1")].state.value == "DOWN" and route_rails(e, h1_ip) == [0, 1]
    down_at = t
    while t < down_at + cfg.probe.detect_multiplier * cfg.probe.interval_ms * MS:
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    assert route_rails(e, h1_ip) == [0] and e.generation == gen + 1
    t += 10 * MS
    res(e, t, 1, "h1", True)
    assert route_rails(e, h1_ip) == [0, 1]


def test_a_local_fault_needs_two_peers_down_and_fails_the_rail():
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        for p in ("h1", "h2"):
            res(e, t, 1, p, False, elsewhere=True)
    assert e.rails[1].state.value == "DOWN" and "2/2 peers unreachable" in e.rails[1].reason


def test_a_peer_silent_on_every_rail_changes_no_route_and_no_rail():
    """A stalled or overloaded peer (its daemon SIGSTOPped, a starved CPU): every path to it
    goes DOWN with peer_elsewhere False; routes and rails stay as they are."""
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    applied_before = e.generation
    routes_before = e.plan.routes
    for _ in range(20):
        t += 10 * MS
        for r in (0, 1):
            res(e, t, r, "h1", False, elsewhere=False)
    assert e.paths[(0, "h1")].state.value == "DOWN" and e.paths[(1, "h1")].state.value == "DOWN"
    assert e.plan.routes == routes_before and e.generation == applied_before
    assert not e.probe_failed and e.totals["rail_down"] == 0
    # it comes back: still nothing to change
    t += 10 * MS
    for r in (0, 1):
        res(e, t, r, "h1", True)
    assert e.plan.routes == routes_before and e.generation == applied_before


def test_a_down_path_whose_peer_then_falls_silent_stops_being_routed_around():
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    for _ in range(2 * cfg.probe.detect_multiplier):  # DOWN, then held for a detection time
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    h1_ip = str(cfg.peers[0].host_ip)
    assert route_rails(e, h1_ip) == [0]
    t += 10 * MS
    res(e, t, 1, "h1", False, elsewhere=False)  # now h1 answers nowhere: a peer problem
    assert (1, "h1") not in {k for k, p in e.paths.items() if e._path_counts(p)}
    assert route_rails(e, h1_ip) == [0, 1]


def test_one_peer_per_rail_the_ends_cannot_be_told_apart_and_the_rail_fails():
    """The documented limit: with one peer, its DOWN path (while it answers on rail 0) fails
    the local rail 1 (either end may be at fault; traffic to that peer must leave it anyway)."""
    cfg, e = engine(1)
    t = 1 * MS
    all_up(e, cfg, t)
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    assert e.rails[1].state.value == "DOWN"


def test_stale_down_paths_do_not_count():
    cfg, e = engine(2)
    t = 1 * MS
    all_up(e, cfg, t)
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    t_h1_last = t
    # h1's path stops reporting (e.g. it left the schedule); much later h2's path goes DOWN
    t += (2 * cfg.probe.slow_interval_ms + 100) * MS
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        res(e, t, 1, "h2", False, elsewhere=True)
    assert t - t_h1_last > 2 * cfg.probe.slow_interval_ms * MS
    assert e.rails[1].state.value == "UP", e.rails[1].reason


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["h2", "h3"]), st.booleans(),
                          st.sampled_from([None, True, False])), max_size=60))
def test_property_a_single_remote_fault_never_fails_a_local_rail(noise):
    """h1's rail 1 is dead (its paths always miss, h1 answering on rail 0); any pattern of
    answers and misses on the other peers' paths that never makes them DOWN on rail 1 while
    answering elsewhere leaves every local rail in service."""
    cfg, e = engine(3)
    t = 1 * MS
    all_up(e, cfg, t)
    for rail, peer, ok, elsewhere in noise:
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
        res(e, t, 0, "h1", True)
        # keep the other peers short of a DOWN rail-1 path that counts: at most 2 misses in a row
        if not ok and e.paths.get((rail, peer)) is not None and e.paths[(rail, peer)].misses >= cfg.probe.detect_multiplier - 1:
            ok = True
        res(e, t, rail, peer, ok, elsewhere)
    assert e.totals["rail_down"] == 0 and not e.probe_failed


def test_a_path_that_never_answered_while_the_peer_answers_elsewhere_goes_down():
    """A daemon restarted onto a rail that is already blackholed: (rail 1, h1) never answers,
    h1 answers on rail 0 all along; after never_answered_misses the path is DOWN and traffic to
    h1 avoids it.  Without evidence elsewhere (None/False) a never-answered path stays UNKNOWN."""
    cfg, e = engine(2)
    t = 1 * MS
    for p in cfg.peers:
        res(e, t, 0, p.name, True)
        res(e, t, 1, "h2", True)
    for i in range(12):
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=False)
    assert e.paths[(1, "h1")].state.value == "UNKNOWN"
    for i in range(12):
        t += 10 * MS
        res(e, t, 1, "h1", False, elsewhere=True)
    assert e.paths[(1, "h1")].state.value == "DOWN"
    assert route_rails(e, str(cfg.peers[0].host_ip)) == [0]
    assert not e.probe_failed  # one peer's path: our rail is fine


def test_probe_filter_forwards_never_answered_misses_only_with_evidence_elsewhere():
    from linkpass.core.probe_filter import ProbeFilter

    cfg, _ = engine(1)
    posted = []
    f = ProbeFilter(probe_policy(cfg.probe), posted.append)
    f(ProbeResult(1, "h1", False, 10 * MS, peer_elsewhere=None))
    f(ProbeResult(1, "h1", False, 20 * MS, peer_elsewhere=False))
    assert posted == []
    f(ProbeResult(1, "h1", False, 30 * MS, peer_elsewhere=True))
    assert len(posted) == 1 and posted[0].peer_elsewhere is True
