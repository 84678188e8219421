"""One timer turn's replies and proofs go to the probe filter in one call
(ReplyGuard.accept, Prober._handle_native's batch, ProbeFilter.answered_many): the same
results, events and state as handling them one by one, on randomized streams."""

from __future__ import annotations

import random

import pytest
from test_probe import KEY, prober_for
from unit_helpers import make_cfg

from linkpass.adapters.prober import _ANSWERED_ITEM
from linkpass.config import probe_policy
from linkpass.core.model import ProbeResult
from linkpass.core.probe import REPLY, Pending, ProbeError, Probe, ReplyGuard
from linkpass.core.probe_filter import ProbeFilter

MS = 1_000_000
ADDR = ("198.18.0.2", 7472)


def _filter(n_peers=4):
    cfg = make_cfg(rails=(0, 1, 2), n_peers=n_peers)
    out = []
    return ProbeFilter(probe_policy(cfg.probe), out.append, {"rail0": 0, "rail1": 1, "rail2": 2}), out


def _state(f: ProbeFilter):
    return (dict(f.rail_n), dict(f.rail_lost), dict(f.last_report), dict(f.last_side), dict(f.last_ok_ns), f.absorbed,
            {k: list(v) for k, v in f.path_window.items()}, {k: t.state() for k, t in f.tests.items()}, sorted(f.lossy))


@pytest.mark.parametrize("seed", range(12))
def test_answered_many_posts_and_keeps_what_answered_one_by_one_does(seed):
    rng = random.Random(seed)
    one, out1 = _filter()
    many, out2 = _filter()
    peers = [f"h{i}" for i in range(1, 5)]
    loss = {(r, p): rng.choice([0.0, 0.0, 0.02, 0.1, 0.4, 1.0]) for r in range(3) for p in peers}
    t = 1_000 * MS
    pending = []
    for step in range(3000):
        if step % 500 == 0:  # the loss pattern changes: paths die, come back, turn lossy
            loss = {k: rng.choice([0.0, 0.0, 0.02, 0.1, 0.4, 1.0]) for k in loss}
        t += rng.choice([1, 2, 3, 10]) * MS // 4
        for r in range(3):
            for p in peers:
                if rng.random() < 0.3:
                    continue
                if rng.random() < loss[(r, p)]:
                    if pending:
                        many.answered_many(pending)
                        pending = []
                    miss = ProbeResult(r, p, False, t, None, step, peer_elsewhere=rng.choice([True, None, False]))
                    one(miss)
                    many(miss)
                else:
                    res = (r, p, t, rng.choice([None, 5_000]), step)
                    one.answered(*res)
                    pending.append(res)
                    if rng.random() < 0.2:
                        many.answered_many(pending)
                        pending = []
    many.answered_many(pending)
    assert out1 == out2
    assert _state(one) == _state(many)
    assert len(out1) > 20  # the stream did make the filter say things (loss reports, verdicts)


def _guard():
    g = ReplyGuard()
    g.add(Pending(0, "h1", 10, 100, 200))
    g.add(Pending(1, "h1", 11, 100, 200))
    g.add(Pending(1, "h1", 12, 150, 250))  # two outstanding on rail 1
    return g


@pytest.mark.parametrize("args", [(99, "h1", 0, 100, 150), (10, "h2", 0, 100, 150), (10, "h1", 1, 100, 150),
                                  (10, "h1", 0, 101, 150), (10, "h1", 0, 100, 200), (11, "h1", 1, 100, 150)],
                         ids=["unknown-seq", "other-peer", "other-rail", "other-ts", "at-deadline", "not-alone"])
def test_accept_leaves_every_other_case_to_check_and_changes_nothing(args):
    g = _guard()
    before = (dict(g._pending), dict(g._done), len(g))
    assert g.accept(*args) is None
    assert (dict(g._pending), dict(g._done), len(g)) == before


def test_accept_of_the_simple_case_finishes_the_probe_as_check_does():
    g = _guard()
    p = g.accept(10, "h1", 0, 100, 150)
    assert p == Pending(0, "h1", 10, 100, 200) and len(g) == 2
    with pytest.raises(ProbeError) as e:
        g.check(Probe(REPLY, "h1", "h0", 0, 10, 100), 160)
    assert e.value.kind == "replay"
    assert g.accept(10, "h1", 0, 100, 150) is None


def _items(pr, clock, rng):
    """A turn's worth of recv_batch items: replies (in time, late, twice, unknown), proofs with
    and without a valid ack, requests the thread answered, in kernel arrival order."""
    pend = list(pr.guard._pending.values())
    rng.shuffle(pend)
    items = []
    for p in pend:
        r = rng.random()
        if r < 0.1:
            continue  # lost
        arrival = p.deadline_ns + MS if r < 0.2 else p.sent_ns + rng.randrange(1, 3 * MS)
        items.append((REPLY, p.peer, p.rail, p.seq, p.sent_ns, 0, ADDR, arrival))
        if r > 0.95:
            items.append((REPLY, p.peer, p.rail, p.seq, p.sent_ns, 0, ADDR, arrival + 1))  # twice
    if rng.random() < 0.2:
        items.append((REPLY, "h1", 0, 12345, clock[0], 0, ADDR, clock[0]))  # never sent
    for rail in (0, 1):
        s = pr._answered.get((rail, "h1"))
        last = next(reversed(s)) if s else 0
        seq = last + 1
        items.append((_ANSWERED_ITEM, "h1", rail, seq, clock[0], last if rng.random() < 0.8 else 7, ADDR,
                      clock[0] - rng.randrange(0, MS)))
    items.sort(key=lambda it: it[-1])
    return items


@pytest.mark.parametrize("seed", range(6))
def test_a_turn_handled_in_one_batch_gives_what_item_by_item_gives(seed):
    a, clock_a, _ = prober_for()
    b, clock_b, _ = prober_for()
    fa, out_a = _filter(1)
    fb, out_b = _filter(1)
    a.post, b.post = fa, fb
    b._seq = a._seq  # the same probes, so the same items fit both
    rng = random.Random(seed)
    for _turn in range(300):
        now = clock_a[0]
        for s in a.schedule.poll(now):
            a._send(s, now)
        for s in b.schedule.poll(now):
            b._send(s, now)
        clock_a[0] = clock_b[0] = now + rng.randrange(1, 12) * MS
        items = _items(a, clock_a, random.Random(rng.random()))
        a._handle_native(items, 0)
        for it in items:
            b._handle_native([it], 0)
        a._expire(clock_a[0])
        b._expire(clock_b[0])
    assert out_a == out_b and len(out_a) > 10
    assert a.counters == b.counters and a.counters["replies"] > 100 and a.counters["passive_ok"] > 100
    assert a.counters["late"] > 0 and a.counters["rejected_replay"] > 0
    assert a._last_ok == b._last_ok and a._peer_last == b._peer_last and a._expect == b._expect
    assert {k: s.to_json() for k, s in a.path_stats.items()} == {k: s.to_json() for k, s in b.path_stats.items()}


def test_a_result_whose_posting_fails_is_counted_and_the_turn_goes_on():
    """A post that raises once (the engine's queue, say): that result is an internal error,
    the turn's other datagrams are still handled and posted, nothing escapes the turn."""
    pr, clock, _ = prober_for()
    f, out = _filter(1)
    pr.post = f
    calls = [0]
    real = f.post

    def raises_once(ev):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("queue full")
        real(ev)

    f.post = raises_once
    for s in pr.schedule.poll(clock[0]):
        pr._send(s, clock[0])
    pend = sorted(pr.guard._pending.values(), key=lambda p: p.rail)
    clock[0] += 2 * MS
    items = [(REPLY, p.peer, p.rail, p.seq, p.sent_ns, 0, ADDR, p.sent_ns + MS) for p in pend]
    pr._handle_native(items, 0)  # the first result of each path goes through the filter's general path: it posts
    assert pr.counters["internal_errors"] == 1 and pr.counters["replies"] == 2
    assert [e.rail for e in out if isinstance(e, ProbeResult)] == [1]
