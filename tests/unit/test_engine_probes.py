"""Engine + probe results: path health, rail verdict by share of peers, DEGRADED by loss."""

from __future__ import annotations

from collections import Counter

import pytest

from unit_helpers import decided, make_cfg, snapshot

from linkpass.config import policy_from_config, probe_policy
from linkpass.core.engine import Engine
from linkpass.core.model import ApplyRoutes, ConfigReloaded, PathLossy, PeerRails, ProbeLoss, ProbeResult, SendNotice, Tick

MS = 1_000_000


def rails_to(actions, dst_host_ip):
    a = [x for x in actions if isinstance(x, ApplyRoutes)][-1]
    r = next(r for r in a.routes if r.dst == f"{dst_host_ip}/32")
    return sorted(n.rail for n in r.nexthops)


def engine(n_peers=2):
    cfg = make_cfg(rails=(0, 1), n_peers=n_peers, hold_down_ms=100)
    e = Engine(policy_from_config(cfg))
    first = e.handle(snapshot(cfg, 0), 0)
    return cfg, e, first


def probe(e, t, rail, peer, ok):
    return decided(e.handle(ProbeResult(rail, peer, ok, t, rtt_ns=20_000 if ok else None), t))


def test_one_dead_peer_is_a_peer_problem_not_a_rail_problem():
    cfg, e, _ = engine(2)
    t = 1 * MS
    for peer in ("h1", "h2"):
        assert probe(e, t, 0, peer, True) == []  # UNKNOWN -> UP changes nothing routed
    acts = []
    for i in range(2 * cfg.probe.detect_multiplier):  # DOWN, and held for one more detection time
        t += 10 * MS
        acts += probe(e, t, 0, "h1", False)
    assert e.paths[(0, "h1")].state.value == "DOWN"
    assert e.rails[0].state.value == "UP"  # 1 of 2 peers down: not more than the 0.5 share
    h1_ip, h2_ip = (str(p.host_ip) for p in cfg.peers)
    assert rails_to(acts, h1_ip) == [1] and rails_to(acts, h2_ip) == [0, 1]
    assert not any(isinstance(a, SendNotice) for a in acts)  # our rails are fine: nothing to announce
    # a single answered probe brings the path back
    acts = probe(e, t + 10 * MS, 0, "h1", True)
    assert rails_to(acts, h1_ip) == [0, 1]


def test_all_peers_down_fails_the_rail_and_it_fails_back_after_hold_down():
    cfg, e, _ = engine(2)
    t = 0
    for peer in ("h1", "h2"):  # both peers answer on both rails first
        probe(e, t, 0, peer, True)
        probe(e, t, 1, peer, True)
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        for peer in ("h1", "h2"):
            probe(e, t, 0, peer, False)
            probe(e, t, 1, peer, True)
    assert e.rails[0].state.value == "DOWN" and "2/2 peers unreachable" in e.rails[0].reason
    assert not any(isinstance(a, ApplyRoutes) for a in e.handle(Tick(t), t))  # a stray tick changes nothing
    # answers again: one peer back is enough (1/2 down is not more than the share) -> HOLD_DOWN
    t += 10 * MS
    acts = probe(e, t, 0, "h1", True) + probe(e, t, 0, "h2", True)
    assert e.rails[1].state.value == "UP"
    assert e.rails[0].state.value == "HOLD_DOWN"
    deadline = next(a.at_ns for a in acts if a.__class__.__name__ == "SetTimer")
    assert deadline == t + 100 * MS
    acts = e.handle(Tick(deadline), deadline)
    assert e.rails[0].state.value == "UP" and any(isinstance(a, SendNotice) and a.usable == frozenset({0, 1}) for a in acts)


def _down_on_rail0(e, cfg, t, peers):
    for _ in range(cfg.probe.detect_multiplier):
        t += 10 * MS
        for peer in peers:
            probe(e, t, 0, peer, False)
            probe(e, t, 1, peer, True)
    return t


def test_a_peer_that_announced_its_own_rail_down_explains_the_silence_on_it():
    # two hosts: one peer per rail, so the path alone cannot tell the ends apart; the peer's
    # notice (its carrier went) says which end failed, and ours stays in use
    cfg, e, _ = engine(1)
    probe(e, 0, 0, "h1", True)
    probe(e, 0, 1, "h1", True)
    e.handle(PeerRails("h1", frozenset({1}), 2, 1, 1), 1 * MS)
    _down_on_rail0(e, cfg, 1 * MS, ["h1"])
    assert e.paths[(0, "h1")].state.value == "DOWN"
    assert e.rails[0].state.value == "UP"
    assert e.local_usable() == frozenset({0, 1})


def test_without_the_peers_word_one_silent_peer_fails_the_rail_and_its_notice_clears_it():
    cfg, e, _ = engine(1)
    probe(e, 0, 0, "h1", True)
    probe(e, 0, 1, "h1", True)
    t = _down_on_rail0(e, cfg, 0, ["h1"])
    assert e.rails[0].state.value == "DOWN" and "1/1 peers unreachable" in e.rails[0].reason
    # the notice arrives late: our end is not the one at fault; back through hold-down
    e.handle(PeerRails("h1", frozenset({1}), 2, 1, 1), t + MS)
    assert e.rails[0].state.value == "HOLD_DOWN"
    assert 0 not in e.probe_failed
    # and a notice that clears the peer's rail while the path is still silent fails ours again
    e.handle(PeerRails("h1", frozenset({0, 1}), 3, 2, 1), t + 2 * MS)
    assert e.rails[0].state.value == "DOWN"


def test_probe_results_without_change_do_nothing():
    cfg, e, _ = engine(1)
    for i in range(50):
        assert probe(e, (i + 1) * MS, 1, "h1", True) == []


def test_loss_over_the_window_marks_the_rail_degraded_and_traffic_avoids_it():
    cfg, e, _ = engine(1)
    h1_ip = str(cfg.peers[0].host_ip)
    t = 10 * MS
    assert decided(e.handle(ProbeLoss(0, 0.25, 10, t), t)) == []  # too few samples to judge
    acts = e.handle(ProbeLoss(0, 0.25, 40, t), t) + e.handle(ProbeLoss(1, 0.0, 200, t), t)
    assert 0 in e.degraded and 1 not in e.degraded
    assert e.rails[0].state.value == "UP"  # degraded is not down
    assert rails_to(acts, h1_ip) == [1]
    st = e.status(t)
    assert st["rails"][0]["degraded"] is True and st["rails"][0]["probe_loss"] == 0.25
    assert decided(e.handle(ProbeLoss(0, 0.08, 200, t + 1000 * MS), t + 1000 * MS)) == []  # hysteresis: still degraded
    assert 0 in e.degraded
    acts = e.handle(ProbeLoss(0, 0.01, 200, t + 2000 * MS), t + 2000 * MS)
    assert 0 not in e.degraded and rails_to(acts, h1_ip) == [0, 1]


def test_a_degraded_rail_our_traffic_avoids_is_announced_to_peers_and_back_when_clean():
    """Peers leave a rail at once when this host's own probes over it lose clearly (carrier up,
    so nothing else would tell them; deploy/SCALING.md section 0); the rail stays usable here."""
    cfg, e, _ = engine(1)
    t = 10 * MS
    acts = e.handle(ProbeLoss(0, 0.25, 40, t), t) + e.handle(ProbeLoss(1, 0.0, 200, t), t)
    notes = [a for a in acts if isinstance(a, SendNotice)]
    assert notes and notes[-1].usable == frozenset({1}) and notes[-1].urgent
    assert e.local_usable() == frozenset({0, 1})  # DEGRADED is not down: our own state unchanged
    # nothing new to say while it stays avoided
    assert not any(isinstance(a, SendNotice) for a in e.handle(ProbeLoss(0, 0.08, 200, t + MS), t + MS))
    acts = e.handle(ProbeLoss(0, 0.01, 200, t + 2000 * MS), t + 2000 * MS)
    notes = [a for a in acts if isinstance(a, SendNotice)]
    assert notes and notes[-1].usable == frozenset({0, 1})


def test_a_degraded_rail_with_nothing_better_is_not_announced():
    cfg, e, _ = engine(1)
    t = 10 * MS
    acts = e.handle(ProbeLoss(0, 0.3, 40, t), t) + e.handle(ProbeLoss(1, 0.3, 40, t), t)
    assert not any(isinstance(a, SendNotice) for a in acts)


def test_degraded_rail_still_used_when_it_is_the_only_one():
    cfg, e, _ = engine(1)
    h1_ip = str(cfg.peers[0].host_ip)
    t = 10 * MS
    acts = e.handle(ProbeLoss(0, 0.3, 40, t), t) + e.handle(ProbeLoss(1, 0.3, 40, t), t)
    assert e.degraded == {0, 1} and not any(isinstance(a, ApplyRoutes) for a in acts)  # nothing better: no move
    r = next(r for r in e.plan.routes if r.dst == f"{h1_ip}/32")
    assert sorted(n.rail for n in r.nexthops) == [0, 1]


def test_probe_filter_forwards_only_what_decides():
    from linkpass.core.probe_filter import ProbeFilter

    cfg, _, _ = engine(1)
    out = []
    f = ProbeFilter(probe_policy(cfg.probe), out.append)
    f(ProbeResult(0, "h1", False, 1 * MS))            # never answered: absorbed
    assert out == []
    f(ProbeResult(0, "h1", True, 2 * MS, rtt_ns=1))   # first answer: forwarded (path comes UP)
    for i in range(3, 50):
        f(ProbeResult(0, "h1", True, i * MS, rtt_ns=1))  # steady successes: absorbed
    f(ProbeResult(0, "h1", False, 60 * MS))           # a miss: forwarded
    f(ProbeResult(0, "h1", True, 70 * MS, rtt_ns=1))  # first success after it: forwarded
    results = [x for x in out if isinstance(x, ProbeResult)]
    assert [(r.ok, r.t_ns) for r in results] == [(True, 2 * MS), (False, 60 * MS), (True, 70 * MS)]
    losses = [x for x in out if isinstance(x, ProbeLoss)]
    assert losses and losses[0].rail == 0 and f.absorbed >= 47


def test_never_answered_or_dead_peer_fails_no_rail():
    cfg, e, _ = engine(1)
    t = 0
    for _ in range(10):  # h1's prober is not up yet: nothing ever answers
        t += 10 * MS
        probe(e, t, 0, "h1", False)
        probe(e, t, 1, "h1", False)
    assert e.paths[(0, "h1")].state.value == "UNKNOWN" and e.rails[0].usable and e.rails[1].usable
    for r in (0, 1):
        probe(e, t, r, "h1", True)
    for _ in range(5):  # then h1's daemon stops: silent on every rail -> a peer problem
        t += 10 * MS
        probe(e, t, 0, "h1", False)
        probe(e, t, 1, "h1", False)
    assert e.paths[(0, "h1")].state.value == "DOWN" and e.paths[(1, "h1")].state.value == "DOWN"
    assert e.rails[0].usable and e.rails[1].usable and not e.probe_failed


def test_down_needs_both_the_count_and_bfd_detection_time():
    from linkpass.core.paths import PathHealth

    p = PathHealth(0, "h1", 3, 10 * MS)
    p.on_result(True, 0)
    assert p.on_result(False, 20 * MS, since_ok_ns=20 * MS)[1].value == "SUSPECT"
    assert p.on_result(False, 30 * MS, since_ok_ns=30 * MS) is None  # 30 ms silent but only 2 misses
    t = p.on_result(False, 31 * MS, since_ok_ns=31 * MS)
    assert t is not None and t[1].value == "DOWN"
    # confirm probes: many misses in a row but not yet 30 ms without a reply -> still SUSPECT
    q = PathHealth(0, "h1", 3, 10 * MS)
    q.on_result(True, 0)
    for i, since in enumerate((20, 22, 24, 26, 28, 29.9)):
        assert (q.on_result(False, int(since * MS), since_ok_ns=int(since * MS)) or (None, None))[1] in (None, q.state) \
            and q.state.value == "SUSPECT"
    assert q.on_result(False, 32 * MS, since_ok_ns=32 * MS)[1].value == "DOWN"
    # without a known last reply the count alone decides (slow paths, restarted filters)
    r = PathHealth(0, "h1", 3, 10 * MS)
    r.on_result(True, 0)
    r.on_result(False, 1 * MS)
    r.on_result(False, 2 * MS)
    assert r.on_result(False, 3 * MS)[1].value == "DOWN"


def test_loss_ratio_leaves_out_dead_paths_but_counts_lossy_ones():
    import random

    from linkpass.core.probe_filter import ProbeFilter

    cfg = make_cfg(rails=(0, 1), n_peers=2, hold_down_ms=100)
    out = []
    f = ProbeFilter(probe_policy(cfg.probe), out.append)
    rng = random.Random(7)
    t = 0
    for i in range(300):  # rail 0: h1 dies after 50 probes, h2 is clean; rail 1: 30 % random loss
        t += 10 * MS
        f(ProbeResult(0, "h1", i < 50, t, rtt_ns=1 if i < 50 else None))
        f(ProbeResult(0, "h2", True, t, rtt_ns=1))
        f(ProbeResult(1, "h1", i == 0 or rng.random() > 0.3, t, rtt_ns=1))
    ratio = {r: f.rail_lost[r] / f.rail_n[r] for r in (0, 1)}
    assert ratio[0] == 0 and 199 <= f.rail_n[0] <= 201  # the dead path left the ratio after 20 misses
    assert 0.2 < ratio[1] < 0.4 and 199 <= f.rail_n[1] <= 201
    assert any(isinstance(x, ProbeLoss) and x.rail == 1 and x.loss > 0.1 for x in out)  # reported at once
    f(ProbeResult(0, "h1", True, t + MS, rtt_ns=1))  # h1 answers again: it counts again, afresh
    # 201: h1's one answer in, and h2's answer of 2 s before gone (entries leave by time, rail-wide)
    assert f.rail_n[0] == 201 and f.rail_lost[0] == 0
    f(ProbeResult(0, "h1", False, t + 5 * MS))  # sent before it came back: not loss
    assert f.rail_lost[0] == 0
    f(ProbeResult(0, "h1", False, t + 12 * MS))  # sent after: loss
    assert f.rail_lost[0] == 1


def test_loss_window_totals_equal_a_recount_of_the_live_paths_windows():
    """The rail totals are kept incrementally (a cheap path for an answer on a live path, a
    full one otherwise); after every result they must equal a recount from the windows."""
    import random

    from linkpass.core.probe_filter import ProbeFilter

    cfg = make_cfg(rails=(0,), n_peers=3, hold_down_ms=100)
    f = ProbeFilter(probe_policy(cfg.probe), [].append)
    rng = random.Random(11)
    t = 0
    loss = {"h1": 0.05, "h2": 0.4, "h3": 0.0}
    for i in range(3000):
        t += rng.choice((1, 3, 10, 10, 10, 40)) * MS
        peer = rng.choice(sorted(loss))
        dead = peer == "h3" and 1200 <= i < 1500  # h3 dies for a while, then answers again
        f(ProbeResult(0, peer, not dead and rng.random() >= loss[peer], t, rtt_ns=1))
        live = [k for k in f.path_window if f._live(k)]
        assert f.rail_n.get(0, 0) == sum(len(f.path_window[k]) for k in live)
        assert f.rail_lost.get(0, 0) == sum(1 for k in live for _, ok in f.path_window[k] if not ok)
        for k, win in f.path_window.items():
            assert f.path_lost[k] == sum(1 for _, ok in win if not ok)
            horizon = win[-1][0] - f.probe.loss_window_ms * MS if win else 0
            assert all(tt >= horizon for tt, _ in win) or not f._live(k) or f.streak.get(k)


def test_old_answers_of_slow_paths_leave_the_rail_ratio_on_time():
    """Entries leave the loss window by time, rail-wide: 50 slow paths that answered once, 3 s
    ago, are not in the ratio of a rail whose fast path now loses probes (before, each stayed
    until its path's next result, one slow sweep later: at scale the ratio was diluted)."""
    from linkpass.core.probe_filter import ProbeFilter

    cfg = make_cfg(rails=(0,), n_peers=51, hold_down_ms=100)
    out = []
    f = ProbeFilter(probe_policy(cfg.probe), out.append)
    for i in range(1, 51):  # the slow sweep: each answered once, long ago
        f(ProbeResult(0, f"h{i}", True, i * MS, rtt_ns=1))
    t = 2500 * MS
    for _ in range(50):  # the fast path answers, then loses 10 probes in a row
        t += 10 * MS
        f(ProbeResult(0, "h51", True, t, rtt_ns=1))
    for _ in range(10):
        t += 10 * MS
        f(ProbeResult(0, "h51", False, t, peer_elsewhere=True))
    assert (f.rail_n[0], f.rail_lost[0]) == (60, 10)
    # reported at once on crossing the DEGRADED threshold, over the recent entries only (with
    # the 50 stale answers in, 10 of 110 would stay under it)
    crossed = [x for x in out if isinstance(x, ProbeLoss) and x.loss > cfg.probe.degraded_loss]
    assert crossed and all(x.samples <= 60 for x in crossed)


def test_equally_lossy_rails_keep_their_traffic_a_better_rail_takes_it():
    cfg, e, _ = engine(1)
    h1_ip = str(cfg.peers[0].host_ip)
    t = 10 * MS
    # rail 1 at 5 %, rail 0 crosses 10 %, 200 probes each: within the window's noise -> no move
    acts = e.handle(ProbeLoss(1, 0.05, 200, t), t) + e.handle(ProbeLoss(0, 0.11, 200, t), t)
    assert 0 in e.degraded and not any(isinstance(a, ApplyRoutes) for a in acts)
    # rail 1 gets clean: clearly better -> traffic leaves rail 0
    acts = e.handle(ProbeLoss(1, 0.005, 200, t + MS), t + MS)
    assert rails_to(acts, h1_ip) == [1]
    # rail 1 a little lossier: still better by z >= 2 -> no move back (hysteresis)
    assert not any(isinstance(a, ApplyRoutes) for a in e.handle(ProbeLoss(1, 0.03, 200, t + 2 * MS), t + 2 * MS))
    # rail 1 as lossy as rail 0: no better rail any more -> both rails again
    acts = e.handle(ProbeLoss(1, 0.09, 200, t + 3 * MS), t + 3 * MS)
    assert rails_to(acts, h1_ip) == [0, 1]


def test_totals_count_what_the_history_leaves_out():
    cfg, e, _ = engine(1)
    t = 0
    probe(e, t, 0, "h1", True)
    probe(e, t, 1, "h1", True)  # h1 answers on rail 1 too: a rail-0 failure is the rail's
    for i in range(5):  # UP -> SUSPECT -> UP five times
        t += 10 * MS
        probe(e, t, 0, "h1", False)
        t += 10 * MS
        probe(e, t, 0, "h1", True)
    kinds = [h.kind for h in e.history if h.kind == "path"]
    assert kinds == ["path", "path"]  # only UNKNOWN -> UP is kept
    tot = e.status(t)["totals"]
    assert tot["path_suspect"] == 5 and tot["path_up"] == 7 and "path_down" not in tot
    for _ in range(3):
        t += 10 * MS
        probe(e, t, 0, "h1", False)
    tot = e.status(t)["totals"]
    assert tot["path_down"] == 1 and tot["rail_down"] == 1 and tot["plan"] >= 2


def test_a_rail_whose_loss_window_runs_short_keeps_its_avoided_state():
    """A lossy rail whose window drops below 20 samples (its lossy path went dead and left the
    ratio) is not judged again from nothing: traffic stays where it was."""
    cfg, e, _ = engine(1)
    h1_ip = str(cfg.peers[0].host_ip)
    t = 10 * MS
    acts = e.handle(ProbeLoss(1, 0.0, 200, t), t) + e.handle(ProbeLoss(0, 0.5, 200, t), t)
    assert rails_to(acts, h1_ip) == [1]
    assert decided(e.handle(ProbeLoss(0, 0.5, 5, t + MS), t + MS)) == []
    assert decided(e.handle(ProbeLoss(1, 0.0, 200, t + 2 * MS), t + 2 * MS)) == []  # no flip back
    assert e.avoided_degraded() == frozenset({0})


def test_rejudging_only_the_touched_rails_decides_like_rejudging_every_rail(monkeypatch):
    """Per result the engine re-judges the result's rail (and the rails where that peer's DOWN
    path counts by its other paths), every rail only once a second.  Fed the same random
    results (every path heard well within the staleness bound, misses with and without the
    peer_elsewhere word), it must decide exactly as an engine that re-judges every rail each
    time."""
    import random

    from linkpass.core import engine as engine_mod

    def run(full_every_ns):
        monkeypatch.setattr(engine_mod, "FULL_REVERDICT_NS", full_every_ns)
        cfg = make_cfg(rails=(0, 1, 2), n_peers=4, hold_down_ms=100)
        e = Engine(policy_from_config(cfg))
        e.handle(snapshot(cfg, 0), 0)
        rng = random.Random(5)
        peers = [p.name for p in cfg.peers]
        bad = {0: 0.0, 1: 0.0, 2: 0.0}
        trace = []
        t = 0
        for i in range(4000):
            if i % 500 == 0:  # the fault moves: one rail blackholed for some peers, or none
                bad = {r: (0.95 if r == rng.choice((0, 1, 2, None)) else 0.02) for r in (0, 1, 2)}
            t += rng.choice((1, 2, 5)) * MS
            rail, peer = rng.choice((0, 1, 2)), rng.choice(peers)
            ok = rng.random() >= bad[rail] * (1.0 if peer != peers[0] else 0.3)
            word = None if ok else rng.choice((True, True, False, None))
            acts = e.handle(ProbeResult(rail, peer, ok, t, rtt_ns=20_000 if ok else None, peer_elsewhere=word), t)
            trace.append((dict(e.probe_failed), sorted(e._plan_path_down), [type(a).__name__ for a in acts]))
        return trace

    assert run(engine_mod.FULL_REVERDICT_NS) == run(0)


def test_per_rail_probe_counts_equal_a_scan_of_the_rails_paths_through_every_kind_of_change():
    """The probe verdict reads per-rail sums kept at each change (Engine._recount) instead of
    scanning the rail's paths.  Through random results, lossy verdicts, peer notices that take
    rails out and put them back, gaps long enough for DOWN and SUSPECT paths to go stale, and a
    config reload, the sums must equal the scan after every event, on every rail."""
    import random

    cfg = make_cfg(rails=(0, 1, 2), n_peers=5, hold_down_ms=100)
    e = Engine(policy_from_config(cfg))
    e.handle(snapshot(cfg, 0), 0)
    pol = e.policy.probe
    stale_ns = (2 * pol.slow_interval_ms + pol.detect_multiplier * pol.interval_ms) * MS
    rng = random.Random(11)
    peers = [p.name for p in cfg.peers]
    t = 0
    kinds, seen = Counter(), Counter()
    for i in range(6000):
        t += rng.choice((1, 2, 5, 5, 20)) * MS if rng.random() > 0.01 else stale_ns + rng.choice((0, MS))
        rail, peer = rng.choice((0, 1, 2)), rng.choice(peers)
        roll = rng.random()
        if roll < 0.03:
            ev = PathLossy(rail, peer, rng.random() < 0.6, t, probes=20, loss=0.4)
        elif roll < 0.05:
            usable = frozenset(r for r in (0, 1, 2) if rng.random() < 0.7)
            ev = PeerRails(peer, usable, i, i, t)
        elif roll < 0.06:
            ev = Tick(t)
        elif i == 3000:
            ev = ConfigReloaded(policy_from_config(cfg), None, t)
        else:
            ok = rng.random() < (0.3 if rail == 0 and i % 1000 < 600 else 0.9)
            word = None if ok else rng.choice((True, True, False, None))
            ev = ProbeResult(rail, peer, ok, t, rtt_ns=20_000 if ok else None, peer_elsewhere=word)
        kinds[type(ev).__name__] += 1
        e.handle(ev, t)
        e._recount_stale(t)
        for r in (0, 1, 2):
            assert tuple(e._rail_sums.get(r, (0, 0, 0, 0))) == e._scan_counts(r, t), (i, ev, r)
        seen.update(p.state.value for p in e.paths.values())
        seen.update(f"failed {r}" for r in e.probe_failed)
    assert kinds["PathLossy"] > 50 and kinds["PeerRails"] > 50 and kinds["ConfigReloaded"] == 1, kinds
    # the run went through what the counts must follow: DOWN and SUSPECT paths, a rail failed
    assert {"UP", "SUSPECT", "DOWN", "failed 0"} <= set(seen), seen


def test_a_probe_count_that_differs_from_the_scan_is_caught():
    """The suite-wide check (CHECK_COUNTS, on in tests/conftest.py) can fail."""
    from linkpass.core import engine as engine_mod

    assert engine_mod.CHECK_COUNTS
    cfg = make_cfg(rails=(0, 1), n_peers=3)
    e = Engine(policy_from_config(cfg))
    e.handle(snapshot(cfg, 0), 0)
    e.handle(ProbeResult(0, cfg.peers[0].name, True, MS, rtt_ns=20_000), MS)
    e._rail_sums[0][1] += 1  # one more DOWN path than there is
    with pytest.raises(AssertionError, match="probe counts"):
        e._probe_verdict(0, 2 * MS)
