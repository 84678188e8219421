"""Misses the link state or the peer's notice explain are not loss (linkpass.core.probe_filter):
a rail whose carrier went away for a while, or that a peer announced unusable, is neither
DEGRADED nor lossy once it is back; misses nothing explains still are."""

from __future__ import annotations

from unit_helpers import carrier_lost, make_cfg, up

from linkpass.config import probe_policy
from linkpass.core.model import LinkChanged, LinkSnapshot, PathLossy, PeerRails, ProbeLoss, ProbeResult
from linkpass.core.probe_filter import ProbeFilter

MS = 1_000_000
RAILS = {"rail0": 0, "rail1": 1}


def make(rails=RAILS):
    cfg = make_cfg(rails=(0, 1), n_peers=1)
    out = []
    return ProbeFilter(probe_policy(cfg.probe), out.append, rails), out


def run(f, t0, n, ok0):
    """n intervals of 10 ms from t0: rail 0 answers when ok0(i), rail 1 always; returns the end time."""
    t = t0
    for i in range(n):
        t += 10 * MS
        ok = ok0(i)
        f(ProbeResult(0, "h1", ok, t, rtt_ns=1 if ok else None, peer_elsewhere=None if ok else True))
        f(ProbeResult(1, "h1", True, t, rtt_ns=1))
    return t


def lossy(out):
    return [x.lossy for x in out if isinstance(x, PathLossy)]


def worst_loss(out, rail=0):
    return max((x.loss for x in out if isinstance(x, ProbeLoss) and x.rail == rail), default=0.0)


def outage(f, down_at, up_at, ev_down, ev_up):
    """Rail 0 answers except for probes whose deadline falls in [down_at, up_at) ms (plus the
    probe in flight at up_at, lost like a real one); the events are observed at those times."""
    out_t = []

    def ok0(i):
        t = (i + 1) * 10
        if t == down_at:
            f.observe(ev_down)
        if t == up_at:
            f.observe(ev_up)
        lost = down_at <= t <= up_at
        if not lost:
            out_t.append(t)
        return not lost
    return ok0


def test_a_carrier_outage_is_not_loss():
    f, out = make()
    t = run(f, 0, 100, lambda i: True)  # 1 s clean: the window is full
    ok0 = outage(f, 1100, 1170, LinkChanged(carrier_lost("rail0"), 1100 * MS), LinkChanged(up("rail0"), 1170 * MS))
    run(f, t, 100, lambda i: ok0(i + 100))
    assert lossy(out) == [] and worst_loss(out) == 0.0
    assert f.explained == 8  # deadlines 1100..1170 ms
    # the engine still sees every miss (BFD's rule)
    assert sum(1 for x in out if isinstance(x, ProbeResult) and not x.ok) == 8


def test_the_same_misses_unexplained_are_loss():
    f, out = make()  # nothing observed: the same six misses in a row count
    t = run(f, 0, 100, lambda i: True)
    run(f, t, 100, lambda i: not 10 <= i <= 17)
    assert lossy(out)[:1] == [True] and worst_loss(out) > 0.05 and f.explained == 0


def test_a_peer_announcing_the_rail_unusable_explains_the_misses():
    f, out = make()
    t = run(f, 0, 100, lambda i: True)
    ok0 = outage(f, 1100, 1170, PeerRails("h1", frozenset({1}), 2, 2, 1100 * MS),
                 PeerRails("h1", frozenset({0, 1}), 3, 3, 1170 * MS))
    run(f, t, 100, lambda i: ok0(i + 100))
    assert lossy(out) == [] and worst_loss(out) == 0.0 and f.explained == 8


def test_another_peer_announcement_or_another_rail_explains_nothing():
    f, out = make()
    t = run(f, 0, 100, lambda i: True)
    f.observe(PeerRails("h2", frozenset({1}), 2, 2, t))  # another peer's rail 0
    f.observe(LinkChanged(carrier_lost("rail1"), t))  # our other rail
    f.observe(LinkChanged(carrier_lost("eth9"), t))  # not a rail
    run(f, t, 100, lambda i: not 10 <= i <= 17)
    assert lossy(out)[:1] == [True] and f.explained == 0


def test_misses_after_the_grace_are_loss_again():
    f, out = make()
    t = run(f, 0, 100, lambda i: True)
    f.observe(LinkChanged(carrier_lost("rail0"), t))
    f.observe(LinkChanged(up("rail0"), t + 5 * MS))
    # deadlines t+10 and t+20 ms: sent at t and t+10 ms, before the carrier came back or less
    # than an interval after: explained; from t+30 ms on (sent 15 ms after) the rail's own
    run(f, t, 3, lambda i: False)
    assert f.explained == 2
    run(f, t + 30 * MS, 7, lambda i: False)
    assert f.explained == 2 and lossy(out) == [True]


def test_a_link_snapshot_sets_and_clears_the_state():
    f, _ = make()
    f.observe(LinkSnapshot((up("rail1"),), 0))  # rail0 absent: down
    assert f.link_down == {0: 0}
    f.observe(LinkSnapshot((up("rail0"), up("rail1")), 50 * MS))
    assert f.link_down == {} and f.link_up == {0: 50 * MS}


def test_reconfigure_can_change_the_rails_map():
    f, _ = make()
    f.reconfigure(f.probe, {"ens1": 0})
    f.observe(LinkChanged(carrier_lost("rail0"), 0))
    assert f.link_down == {}
    f.observe(LinkChanged(carrier_lost("ens1"), 0))
    assert f.link_down == {0: 0}
