"""FlapDamper: RFC 2439-style flap damping of one rail, table-driven plus hypothesis properties.

Every test moves a fake clock (plain integers, monotonic ns); nothing sleeps.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.config import DampingSection, damping_policy
from linkpass.core.damping import (
    TRANSITIONS,
    DampState,
    FlapDamper,
    decay_ns,
    decayed,
    max_onsets,
    max_suppress_ns,
    min_suppress_ns,
)

MS = 1_000_000
S = 1_000 * MS
T0 = 100 * S  # an arbitrary monotonic start

# the config defaults: penalty 1000, half-life 15 s, suppress 2500, reuse 800, max 8000
DEFAULTS = {"penalty": 1000, "half_life_ns": 15 * S, "suppress": 2500, "reuse": 800, "max_penalty": 8000}


def damper(**over) -> FlapDamper:
    return FlapDamper(**{**DEFAULTS, **over})


def downs(d: FlapDamper, offsets_ms: list[float]) -> list[bool]:
    return [d.on_down(T0 + int(o * MS)) for o in offsets_ms]


# ----------------------------------------------------------------------------- examples

#: (name, overrides, down offsets in ms, query offset in ms, suppressed?, penalty at query)
EXAMPLES = [
    ("no downs", {}, [], 0, False, 0.0),
    ("one down never suppresses", {}, [0], 0, False, 1000.0),
    ("one down, one half-life later", {}, [0], 15_000, False, 500.0),
    ("two quick downs stay below suppress", {}, [0, 100], 100, False, 1000 * 2 ** (-100 / 15_000) + 1000),
    ("three quick downs suppress", {}, [0, 100, 200], 200, True, None),
    ("three simultaneous downs", {}, [0, 0, 0], 0, True, 3000.0),
    ("three downs a half-life apart do not", {}, [0, 15_000, 30_000], 30_000, False, 1750.0),
    ("suppressed, decayed below suppress but above reuse: still suppressed (hysteresis)",
     {}, [0, 0, 0], 15_000, True, 1500.0),
    ("suppressed, decayed to reuse: released", {}, [0, 0, 0], 15_000 * math.log2(3000 / 800) + 1, False, None),
    ("capped at max_penalty", {}, [0] * 20, 0, True, 8000.0),
    ("suppress == max_penalty: a capped penalty suppresses", {"suppress": 2000, "max_penalty": 2000}, [0, 0, 0], 0, True, 2000.0),
    ("exactly suppress suppresses", {"suppress": 2000}, [0, 0], 0, True, 2000.0),
    ("one big penalty suppresses at once", {"penalty": 3000}, [0], 0, True, 3000.0),
    ("earlier clock reads as the last down", {}, [0, 0], -5_000, False, 2000.0),
]


@pytest.mark.parametrize("name,over,offsets,query,want_suppressed,want_penalty", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_examples(name, over, offsets, query, want_suppressed, want_penalty):
    d = damper(**over)
    downs(d, offsets)
    now = T0 + int(query * MS)
    assert d.suppressed(now) is want_suppressed
    assert (d.release_at(now) is not None) is want_suppressed
    if want_penalty is not None:
        assert d.penalty_at(now) == pytest.approx(want_penalty, rel=1e-9)


def test_on_down_returns_suppression_and_third_down_is_the_one():
    d = damper()
    assert downs(d, [0, 100, 200]) == [False, False, True]


def test_rail_released_then_one_down_is_not_enough_but_two_are():
    d = damper()
    downs(d, [0, 0, 0])
    rel = d.release_at(T0)
    assert d.penalty_at(rel) == pytest.approx(800, rel=1e-6)
    assert d.on_down(rel) is False  # 800 + 1000 = 1800 < 2500: hysteresis lets it back
    assert d.on_down(rel + MS) is True  # ~2800


@pytest.mark.parametrize("offsets_ms", [[0, 0, 0], [0, 0.01, 0.02], [0] * 20, [0, 1, 2, 3000, 9000, 9000.5, 9001]])
@pytest.mark.parametrize("over", [{}, {"half_life_ns": 100 * MS}, {"half_life_ns": 7 * S + 3}, {"reuse": 1, "max_penalty": 10**8}])
def test_release_at_is_exact(offsets_ms, over):
    d = damper(**over)
    downs(d, offsets_ms)
    now = T0 + int(offsets_ms[-1] * MS)
    rel = d.release_at(now)
    assert rel is not None and rel > now
    assert d.penalty_at(rel) == pytest.approx(d.reuse, rel=1e-6)
    assert d.penalty_at(rel) <= d.reuse < d.penalty_at(rel - 1)
    assert d.suppressed(rel - 1) is True
    assert d.suppressed(rel) is False
    assert d.release_at(rel - 1) == rel
    assert d.release_at(rel) is None
    assert d.next_deadline() == rel


def test_cap_bounds_the_release_by_max_suppress():
    d = damper()
    longest = max_suppress_ns(15 * S, 800, 8000)
    assert longest == pytest.approx(15 * S * math.log2(8000 / 800), abs=1)  # ~49.8 s
    t = T0
    for _ in range(200):  # a storm: a down every 10 ms for 2 s
        d.on_down(t)
        assert d.penalty_at(t) <= 8000
        rel = d.release_at(t)
        assert rel is None or rel - t <= longest
        t += 10 * MS
    last = t - 10 * MS
    assert d.penalty_at(last) == 8000
    assert d.release_at(last) == last + longest


def test_a_later_down_never_moves_release_earlier():
    d = damper()
    downs(d, [0, 0, 0])
    rel = d.release_at(T0)
    d.on_down(T0 + 10 * S)
    assert d.release_at(T0 + 10 * S) > rel


def test_min_and_max_suppress_with_defaults():
    assert min_suppress_ns(15 * S, 2500, 800) == math.ceil(15 * S * math.log2(2500 / 800))  # ~24.7 s
    assert max_suppress_ns(15 * S, 800, 8000) == math.ceil(15 * S * math.log2(8000 / 800))  # ~49.8 s
    # three downs at once (3000) release after 15 s * log2(3000/800) ~ 28.6 s, between the two
    d = damper()
    downs(d, [0, 0, 0])
    assert min_suppress_ns(15 * S, 2500, 800) <= d.release_at(T0) - T0 <= max_suppress_ns(15 * S, 800, 8000)
    assert max_onsets(60 * S, 15 * S, 2500, 800) == 3


#: (name, down times in s over 10 minutes, onsets, downs that found the rail usable)
FLAPPING = [
    ("every 100 ms: suppressed at the 3rd down, held for good", [i * 0.1 for i in range(6000)], 1, 3),
    ("every 1 s", list(range(600)), 1, 3),
    ("every 10 s", list(range(0, 600, 10)), 1, 6),
    # steady penalty 1000 / (1 - 2**(-12/15)) ~ 2349 < 2500: the defaults tolerate flaps slower than ~11 s
    ("every 12 s: never suppressed", list(range(0, 600, 12)), 0, 50),
    ("a burst of 3 every 60 s: suppressed once per burst", [b + i * 0.01 for b in range(0, 600, 60) for i in range(3)], 10, 30),
    ("a burst of 3 every 30 s: later bursts land in the suppression and extend it",
     [b + i * 0.01 for b in range(0, 600, 30) for i in range(3)], 2, 5),
]


@pytest.mark.parametrize("name,times_s,want_onsets,want_usable", FLAPPING, ids=[f[0] for f in FLAPPING])
def test_steady_flapping(name, times_s, want_onsets, want_usable):
    tr = simulate(dict(DEFAULTS), [T0 + round(t * S) for t in times_s], deliver_ticks=True)
    assert (len(tr.onsets), len(tr.usable_downs)) == (want_onsets, want_usable)
    for a, b in zip(tr.onsets, tr.onsets[1:]):
        assert b - a >= min_suppress_ns(15 * S, 2500, 800)
    for i, start in enumerate(tr.onsets):
        assert sum(1 for s in tr.onsets[i:] if s < start + 60 * S) <= 3  # max_onsets(60 s) with defaults


@pytest.mark.parametrize(
    "start,target,hl,want",
    [(2000, 1000, 1000, 1000), (4000, 1000, 1000, 2000), (1000, 1000, 1000, 0), (500, 1000, 1000, 0), (1001, 1000, 10**12, 1_441_974_174)],
)
def test_decay_ns(start, target, hl, want):
    n = decay_ns(start, target, hl)
    assert n == want
    assert decayed(start, n, hl) <= target
    assert n == 0 or decayed(start, n - 1, hl) > target


def test_decay_to_zero_is_an_error():
    with pytest.raises(ValueError, match="positive"):
        decay_ns(10, 0, 1000)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"penalty": 0}, "penalty"),
        ({"half_life_ns": 0}, "half_life_ns"),
        ({"half_life_ns": 1.5e9}, "half_life_ns"),
        ({"reuse": 0}, "reuse must be positive"),
        ({"reuse": 2500}, "reuse < suppress"),
        ({"suppress": 9000}, "suppress <= max_penalty"),
    ],
)
def test_bad_limits_are_clear_errors(over, match):
    with pytest.raises(ValueError, match=match):
        damper(**over)


def test_from_config_section():
    d = FlapDamper.from_policy(damping_policy(DampingSection()), rail=2)
    assert (d.penalty, d.half_life_ns, d.suppress, d.reuse, d.max_penalty, d.rail) == (1000, 15 * S, 2500, 800, 8000, 2)


def test_transition_table_and_logging(caplog):
    assert set(TRANSITIONS) == set(DampState)
    d = damper(rail=3)
    caplog.set_level(logging.INFO, logger="linkpass.damping")
    downs(d, [0, 0, 0, 0])  # the fourth down while suppressed logs nothing
    rel = d.release_at(T0)
    assert d.on_tick(rel - 1) is None
    tr = d.on_tick(rel + 5 * S)  # the tick comes late; the transition keeps the exact instant
    assert (tr.old, tr.new, tr.t_ns, tr.rail) == (DampState.SUPPRESSED, DampState.ALLOWED, rel, 3)
    assert d.on_tick(rel + 6 * S) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "rail 3: ALLOWED -> SUPPRESSED (flap penalty 3000 >= suppress 2500, released in 28.6 s)"
    assert lines[1] == "rail 3: SUPPRESSED -> ALLOWED (penalty decayed to reuse 800)"
    assert d.set_state(DampState.ALLOWED, rel, "again") is None


def test_queries_do_not_change_state():
    d = damper()
    downs(d, [0, 0, 0])
    rel = d.release_at(T0)
    assert d.suppressed(rel) is False and d.state == DampState.SUPPRESSED  # reported, not yet recorded
    d.on_down(rel + S)  # the down records the release first, then decides afresh
    assert d.state == DampState.ALLOWED


def test_clear():
    d = damper()
    downs(d, [0, 0, 0])
    tr = d.clear(T0 + S)
    assert tr.new == DampState.ALLOWED and d.penalty_at(T0 + S) == 0 and not d.suppressed(T0 + S)
    assert d.clear(T0 + 2 * S) is None


def test_to_json():
    d = damper(rail=1)
    downs(d, [0, 0, 0])
    doc = d.to_json(T0 + S)
    assert doc["rail"] == 1 and doc["suppressed"] is True and doc["downs"] == 3
    assert doc["penalty"] == pytest.approx(3000 * 2 ** (-1 / 15), abs=1e-3)
    assert doc["release_at_ns"] == d.release_at(T0)
    assert doc["release_in_ms"] == pytest.approx((d.release_at(T0) - T0 - S) / 1e6)
    assert doc["limits"] == {"penalty": 1000, "half_life_ms": 15000.0, "suppress": 2500, "reuse": 800, "max_penalty": 8000}
    quiet = damper().to_json(T0)
    assert quiet["suppressed"] is False and quiet["release_at_ns"] is None and quiet["release_in_ms"] is None


# ----------------------------------------------------------------------------- properties


@st.composite
def params(draw):
    reuse = draw(st.integers(1, 3000))
    suppress = reuse + draw(st.integers(1, 5000))
    max_penalty = suppress + draw(st.sampled_from([0, 1, draw(st.integers(0, 20_000))]))
    return {
        # half the time a penalty comparable to the suppress-reuse gap, so suppression recurs
        "penalty": draw(st.one_of(st.integers(1, 4000), st.integers(max(1, (suppress - reuse) // 3), suppress))),
        "half_life_ns": draw(st.sampled_from([1, 1000, 100 * MS, 15 * S, draw(st.integers(1, 60 * S))])),
        "suppress": suppress,
        "reuse": reuse,
        "max_penalty": max_penalty,
    }


@st.composite
def streams(draw):
    """Parameters and increasing down times (ties allowed), bursts mixed with long gaps."""
    p = draw(params())
    hl = p["half_life_ns"]
    gap = st.one_of(st.just(0), st.integers(0, max(1, hl // 20)), st.integers(0, 4 * hl))
    gaps = draw(st.lists(gap, min_size=1, max_size=60))
    times, t = [], T0
    for g in gaps:
        t += g
        times.append(t)
    return p, times, draw(st.booleans())


@dataclass
class Trace:
    onsets: list[int] = field(default_factory=list)  # times the rail went not-suppressed -> suppressed
    usable_downs: list[int] = field(default_factory=list)  # downs that found the rail not suppressed


def check_quiet_stretch(d: FlapDamper, start: int, end: int) -> None:
    """Between two downs (start inclusive, end inclusive, before the down at end)."""
    rel = d.release_at(start)
    pts = {start, start + 1, (start + end) // 2, end - 1, end}
    if rel is not None:
        pts |= {rel - 1, rel, rel + 1}
    pts = sorted(p for p in pts if start <= p <= end)
    last = math.inf
    for t in pts:
        v = d.penalty_at(t)
        # (1) bounded
        assert 0.0 <= v <= d.max_penalty
        # (2) non-increasing between downs
        assert v <= last
        last = v
        # (3) suppressed exactly until the release instant, which does not move while quiet
        if rel is not None and t < rel:
            assert d.suppressed(t) and d.release_at(t) == rel
            assert v > d.reuse  # hysteresis: held while above reuse...
        else:
            assert not d.suppressed(t) and d.release_at(t) is None
            assert v < d.suppress  # ...and a usable rail is below suppress


def simulate(p: dict, times: list[int], deliver_ticks: bool) -> Trace:
    d = FlapDamper(**p)
    longest = max_suppress_ns(p["half_life_ns"], p["reuse"], p["max_penalty"])
    tr = Trace()
    prev = times[0]
    for t in times:
        check_quiet_stretch(d, prev, t)
        if deliver_ticks and (dl := d.next_deadline()) is not None and dl <= t:
            got = d.on_tick(t)  # the daemon's Tick, delivered when due
            assert got is not None and got.t_ns == dl
        was = d.suppressed(t)
        rel_before = d.release_at(t)
        now_suppressed = d.on_down(t)
        v = d.penalty_at(t)
        assert 0.0 <= v <= d.max_penalty  # (1)
        assert now_suppressed is d.suppressed(t)
        rel = d.release_at(t)
        if was:
            # (3) stays suppressed, and a later down never moves release earlier
            assert now_suppressed and rel >= rel_before
        else:
            tr.usable_downs.append(t)
            assert now_suppressed is (v >= d.suppress)
            if now_suppressed:
                tr.onsets.append(t)
        if rel is not None:
            assert t < rel <= t + longest  # the cap bounds every suppression
        prev = t
    rel = d.release_at(prev)
    check_quiet_stretch(d, prev, (rel + 10) if rel is not None else prev + p["half_life_ns"])
    return tr


@settings(max_examples=250, deadline=None)
@given(streams())
def test_properties_over_random_down_streams(stream):
    p, times, deliver_ticks = stream
    tr = simulate(p, times, deliver_ticks)
    hl, sup, reuse, pen = p["half_life_ns"], p["suppress"], p["reuse"], p["penalty"]

    # (4) onsets of suppression.  A suppression starts with the penalty >= suppress and ends
    # when pure decay has brought it to reuse: it lasts >= half_life * log2(suppress / reuse),
    # and the next onset cannot come before the release.
    shortest = min_suppress_ns(hl, sup, reuse)
    assert abs(shortest - hl * math.log2(sup / reuse)) <= 1
    for a, b in zip(tr.onsets, tr.onsets[1:]):
        assert b - a >= shortest
    for window in (1, hl, shortest, 3 * shortest + 7, 10 * hl):
        bound = window // shortest + 1
        assert bound == max_onsets(window, hl, sup, reuse)
        for i, start in enumerate(tr.onsets):  # the worst window starts at an onset
            assert sum(1 for s in tr.onsets[i:] if s < start + window) <= bound

    # (5) downs of a usable rail (each one a route change).  Within one stretch between
    # suppressions, n such downs inside a window w leave, just before the n-th, at least
    # (n - 1) * penalty * 2**(-w / half_life) < suppress; stretches in a window are at most
    # one more than the onsets in it.
    for window in (1, hl // 2 + 1, hl, 3 * hl):
        per_stretch = math.floor(sup * 2 ** (window / hl) / pen) + 1
        bound = (max_onsets(window, hl, sup, reuse) + 1) * per_stretch
        for i, start in enumerate(tr.usable_downs):
            assert sum(1 for s in tr.usable_downs[i:] if s < start + window) <= bound


@settings(max_examples=100, deadline=None)
@given(params(), st.integers(0, 10**13), st.integers(1, 10))
def test_release_at_is_exact_for_any_parameters(p, t0, n):
    d = FlapDamper(**p)
    for _ in range(n):
        d.on_down(t0)
    rel = d.release_at(t0)
    if rel is None:
        assert d.penalty_at(t0) < d.suppress
        return
    # exact to the ns: at release the penalty is at most reuse, and less than one ns of decay below it
    hl = p["half_life_ns"]
    assert d.reuse * 2 ** (-1 / hl) * (1 - 1e-12) <= d.penalty_at(rel) <= d.reuse < d.penalty_at(rel - 1)
    if hl >= MS:  # one ns of decay is then below 1e-6
        assert d.penalty_at(rel) == pytest.approx(d.reuse, rel=1e-6)
    assert d.suppressed(rel - 1) and not d.suppressed(rel)
