"""Hypothesis properties of the Engine, driven by a fake clock.

A small fake daemon feeds random event sequences (link changes, ticks, peer notices, drains,
foreign route changes) at increasing times, delivering the engine's own SetTimer requests
as Ticks when they fall due, exactly as the real daemon would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.config import Config, policy_from_config
from linkpass.core.engine import Engine
from linkpass.core.health import RailState
from linkpass.core.model import (
    ApplyRoutes,
    Drain,
    LinkChanged,
    LinkFacts,
    LinkSnapshot,
    PeerRails,
    RouteChanged,
    SendNotice,
    SetTimer,
    Tick,
)
from linkpass.core.planner import plan_routes
from unit_helpers import MS, make_cfg

LINK_VARIANTS = {
    "up": lambda d: LinkFacts(d),
    "unknown_oper": lambda d: LinkFacts(d, operstate="UNKNOWN"),
    "carrier_lost": lambda d: LinkFacts(d, carrier=False, operstate="LOWERLAYERDOWN"),
    "admin_down": lambda d: LinkFacts(d, admin_up=False, carrier=False, operstate="DOWN"),
    "gone": lambda d: LinkFacts(d, present=False, admin_up=False, carrier=False, operstate="NOTPRESENT"),
    "dormant": lambda d: LinkFacts(d, operstate="DORMANT"),
}


@functools.lru_cache(maxsize=None)
def cfg_for(mode: str, n_rails: int, n_peers: int, hold_down_ms: int) -> Config:
    return make_cfg(mode=mode, rails=tuple(range(n_rails)), n_peers=n_peers, hold_down_ms=hold_down_ms)


@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from(["host-ip", "per-rail-ip"]))
    n_rails = draw(st.integers(2, 4))
    n_peers = draw(st.integers(1, 3))
    hold_ms = draw(st.sampled_from([0, 5, 2000]))
    initial = draw(st.lists(st.sampled_from(list(LINK_VARIANTS) + ["missing"]), min_size=n_rails, max_size=n_rails))
    dt = st.one_of(st.just(0), st.integers(1, 3 * hold_ms + 10).map(lambda ms: ms * MS), st.integers(1, 10**6))
    step = st.one_of(
        st.tuples(st.just("link"), st.integers(0, n_rails - 1), st.sampled_from(list(LINK_VARIANTS))),
        st.tuples(st.just("link"), st.integers(0, n_rails - 1), st.sampled_from(["up", "carrier_lost"])),
        st.tuples(st.just("tick")),
        st.tuples(st.just("tick_just_before_timer")),
        st.tuples(st.just("peer"), st.integers(1, n_peers), st.sets(st.integers(0, n_rails - 1))),
        st.tuples(st.just("drain"), st.integers(0, n_rails - 1), st.booleans()),
        st.tuples(st.just("route"), st.integers(1, n_peers), st.booleans()),
    )
    steps = draw(st.lists(st.tuples(dt, step), max_size=40))
    return (mode, n_rails, n_peers, hold_ms), tuple(initial), tuple(steps)


@dataclass
class Tracker:
    """Independent bookkeeping of what the fake world did to each rail."""

    link_ok: dict[int, bool] = field(default_factory=dict)
    drained: dict[int, bool] = field(default_factory=dict)
    ever_out: dict[int, bool] = field(default_factory=dict)  # went DOWN or DRAINED at least once
    returned_at: dict[int, int] = field(default_factory=dict)  # last link-back or undrain time


@dataclass
class Run:
    cfg: Config
    engine: Engine
    log: list = field(default_factory=list)  # (t, event, actions)
    applies: list = field(default_factory=list)  # (t, ApplyRoutes)


def event_for(cfg: Config, step, t: int, seq: list[int]):
    kind = step[0]
    if kind == "link":
        _, rail, variant = step
        return LinkChanged(LINK_VARIANTS[variant](f"rail{rail}"), t)
    if kind == "tick":
        return Tick(t)
    if kind == "peer":
        _, p, usable = step
        seq[0] += 1
        return PeerRails(f"h{p}", frozenset(usable), generation=seq[0], seq=seq[0], t_ns=t)
    if kind == "drain":
        _, rail, drain = step
        return Drain(rail, drain, t)
    if kind == "route":
        _, p, deleted = step
        peer = cfg.peers[p - 1]
        dst = f"{peer.host_ip}/32" if cfg.daemon.mode == "host-ip" else f"{peer.rail_ips[0]}/32"
        return RouteChanged(dst, proto=4, table=254, deleted=deleted, t_ns=t)
    raise AssertionError(kind)  # pragma: no cover


def track(tr: Tracker, cfg: Config, ev, t: int) -> None:
    def on_link(rail: int, ok: bool) -> None:
        prev = tr.link_ok.get(rail)
        if not ok:
            tr.ever_out[rail] = True
        elif prev is False:
            tr.returned_at[rail] = t
        tr.link_ok[rail] = ok

    if isinstance(ev, LinkSnapshot):
        present = {f.netdev: f for f in ev.links}
        for r in cfg.rails:
            f = present.get(r.netdev)
            on_link(r.id, f is not None and f.healthy)
    elif isinstance(ev, LinkChanged):
        on_link(int(ev.facts.netdev.removeprefix("rail")), ev.facts.healthy)
    elif isinstance(ev, Drain):
        if ev.drain:
            tr.drained[ev.rail] = True
            tr.ever_out[ev.rail] = True
        elif tr.drained.get(ev.rail):
            tr.drained[ev.rail] = False
            tr.returned_at[ev.rail] = t


def drive(scenario, check=None) -> Run:
    (mode, n_rails, n_peers, hold_ms), initial, steps = scenario
    cfg = cfg_for(mode, n_rails, n_peers, hold_ms)
    run = Run(cfg, Engine(policy_from_config(cfg)))
    tr = Tracker()
    timer: list[int | None] = [None]
    seq = [0]

    def feed(ev, t):
        acts = run.engine.handle(ev, t)
        run.log.append((t, ev, acts))
        track(tr, cfg, ev, t)
        for a in acts:
            if isinstance(a, SetTimer):
                assert a.at_ns >= t, "timer in the past"
                timer[0] = a.at_ns
            elif isinstance(a, ApplyRoutes):
                run.applies.append((t, a))
        if check:
            check(run, tr, t, hold_ms * MS)

    links = tuple(LINK_VARIANTS[v](f"rail{i}") for i, v in enumerate(initial) if v != "missing")
    t = 0
    feed(LinkSnapshot(links, 0), 0)
    for dt, step in steps:
        if step[0] == "tick_just_before_timer":
            # a Tick one nanosecond before the pending deadline must not end hold-down
            if timer[0] is not None and timer[0] - 1 >= t:
                t = timer[0] - 1
                feed(Tick(t), t)
            continue
        t_next = t + dt
        while timer[0] is not None and timer[0] <= t_next:
            at = timer[0]
            timer[0] = None
            t = max(t, at)
            feed(Tick(t), t)
        t = t_next
        feed(event_for(cfg, step, t, seq), t)
    # quiesce: let every requested timer fire
    for _ in range(2 * n_rails + 2):
        if timer[0] is None:
            break
        at = timer[0]
        timer[0] = None
        t = max(t, at)
        feed(Tick(t), t)
    run.tracker = tr  # type: ignore[attr-defined]
    run.end_t = t  # type: ignore[attr-defined]
    run.timer_left = timer[0]  # type: ignore[attr-defined]
    return run


def peer_of_dst(cfg: Config, dst: str):
    for p in cfg.peers:
        if cfg.daemon.mode == "host-ip" and f"{p.host_ip}/32" == dst:
            return p, None
        for rid, ip in p.rail_ips.items():
            if cfg.daemon.mode == "per-rail-ip" and f"{ip}/32" == dst:
                return p, rid
    raise AssertionError(f"route to unknown destination {dst}")


def check_invariants(run: Run, tr: Tracker, t: int, hold_ns: int) -> None:
    eng, cfg = run.engine, run.cfg
    usable = eng.local_usable()

    # RailHealth agrees with the outside world: no usable rail with a bad link or drained
    for r in cfg.rails:
        if eng.rails[r.id].usable:
            assert tr.link_ok.get(r.id) is True, f"rail {r.id} usable with link down"
            assert not tr.drained.get(r.id), f"rail {r.id} usable while drained"

    if not run.applies:
        return
    _, latest = run.applies[-1]

    # (1) the latest plan only uses rails usable here and announced usable by the peer
    for route in latest.routes:
        assert route.nexthops, route
        assert route.dst not in latest.keep_dsts
        peer, failed_rail = peer_of_dst(cfg, route.dst)
        announced = eng.peer_usable.get(peer.name)
        for nh in route.nexthops:
            assert nh.rail in usable, f"{route.describe()} uses rail {nh.rail}, state {eng.rails[nh.rail].state}"
            assert eng.rails[nh.rail].state == RailState.UP
            assert announced is None or nh.rail in announced, f"{route.describe()} uses rail {nh.rail} that {peer.name} announced unusable"
            assert nh.rail in peer.rail_ips
        if failed_rail is not None:  # per-rail-ip: only failed rails get a /32
            assert not (failed_rail in usable and (announced is None or failed_rail in announced))
    # keep_dsts exactly for peers without a common rail
    for p in cfg.peers:
        announced = eng.peer_usable.get(p.name)
        common = {r for r in p.rail_ips if r in usable and (announced is None or r in announced)}
        if cfg.daemon.mode == "host-ip":
            assert (f"{p.host_ip}/32" in latest.keep_dsts) == (not common)

    # the latest plan is the current one (no change left unannounced)
    assert latest.routes == plan_routes(policy_from_config(cfg), usable, eng.peer_usable).routes
    assert latest.generation == eng.generation
    notices = [a for _, _, acts in run.log for a in acts if isinstance(a, SendNotice)]
    assert notices and notices[-1].usable == usable
    assert notices[-1].generation <= eng.generation

    # (2) failback only after hold-down (checked for each plan when it is emitted)
    t_last, _ = run.applies[-1]
    if t_last == t:
        for route in latest.routes:
            for nh in route.nexthops:
                if tr.ever_out.get(nh.rail):
                    back = tr.returned_at.get(nh.rail)
                    assert back is not None, f"rail {nh.rail} used again without ever coming back"
                    assert t >= back + hold_ns, f"rail {nh.rail} used at {t}, back at {back}, hold-down {hold_ns}"


SETTINGS = settings(max_examples=120, deadline=None)


@SETTINGS
@given(scenarios())
def test_routes_use_only_usable_rails_and_fail_back_only_after_hold_down(scenario):
    run = drive(scenario, check_invariants)

    # generations: every plan newer than the one before, except resync re-sends of the same plan
    gens = [a.generation for _, a in run.applies]
    assert gens == sorted(gens)
    for (_, a), (_, b) in zip(run.applies, run.applies[1:]):
        if b.generation == a.generation:
            assert b.resync and b.routes == a.routes and "outside linkpass" in b.reason
    # SendNotice always travels with a plan of the same generation
    for _, _, acts in run.log:
        for n in (a for a in acts if isinstance(a, SendNotice)):
            assert any(isinstance(a, ApplyRoutes) and a.generation == n.generation for a in acts)

    # liveness: once every timer fired, no rail is stuck in hold-down, and every rail with a
    # good link that is not drained is UP
    assert run.timer_left is None
    tr = run.tracker
    for r in run.cfg.rails:
        h = run.engine.rails[r.id]
        assert h.state != RailState.HOLD_DOWN
        if tr.link_ok.get(r.id) and not tr.drained.get(r.id):
            assert h.state == RailState.UP, (r.id, h.state, h.reason)


@SETTINGS
@given(scenarios())
def test_deterministic(scenario):
    a = drive(scenario)
    b = drive(scenario)
    assert [acts for _, _, acts in a.log] == [acts for _, _, acts in b.log]
    assert [ev for _, ev, _ in a.log] == [ev for _, ev, _ in b.log]
    assert a.engine.status(a.end_t) == b.engine.status(b.end_t)
