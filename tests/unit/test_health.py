"""RailHealth: the per-rail state machine, table-driven over every state x every input."""

from __future__ import annotations

import itertools
import logging

import pytest

from linkpass.core.health import TRANSITIONS, USABLE, IllegalTransition, RailHealth, RailState

S = RailState
MS = 1_000_000
HOLD = 2_000 * MS
T0 = 10_000 * MS  # time the setup reached its state


# ----------------------------------------------------------------------------- setups


def reach(setup: str, hold_down_ns: int = HOLD) -> RailHealth:
    """Reach a state through legal calls only (the way the engine would)."""
    h = RailHealth(3, hold_down_ns)
    if setup == "UNKNOWN":
        pass
    elif setup == "UP":
        h.on_link(True, "rail3 up", T0)
    elif setup == "DOWN":
        h.on_link(False, "carrier lost", T0)
    elif setup == "HOLD_DOWN":
        h.on_link(True, "rail3 up", T0 - 2 * MS)
        h.on_link(False, "carrier lost", T0 - MS)
        h.on_link(True, "rail3 up", T0)
    elif setup == "DRAINED_LINK_UP":
        h.on_link(True, "rail3 up", T0 - MS)
        h.on_drain(True, T0)
    elif setup == "DRAINED_LINK_DOWN":
        h.on_link(False, "carrier lost", T0 - MS)
        h.on_drain(True, T0)
    else:  # pragma: no cover
        raise AssertionError(setup)
    return h


SETUP_STATE = {
    "UNKNOWN": S.UNKNOWN,
    "UP": S.UP,
    "DOWN": S.DOWN,
    "HOLD_DOWN": S.HOLD_DOWN,
    "DRAINED_LINK_UP": S.DRAINED,
    "DRAINED_LINK_DOWN": S.DRAINED,
}

NOW = T0 + 500 * MS


def apply_input(h: RailHealth, inp: str):
    if inp == "link_ok":
        return h.on_link(True, "rail3 up", NOW)
    if inp == "link_lost":
        return h.on_link(False, "carrier lost on rail3", NOW)
    if inp == "tick_before":
        return h.on_tick(T0 + HOLD - 1)
    if inp == "tick_at":
        return h.on_tick(T0 + HOLD)
    if inp == "tick_after":
        return h.on_tick(T0 + HOLD + 7 * MS)
    if inp == "drain":
        return h.on_drain(True, NOW)
    if inp == "undrain":
        return h.on_drain(False, NOW)
    raise AssertionError(inp)  # pragma: no cover


INPUTS = ["link_ok", "link_lost", "tick_before", "tick_at", "tick_after", "drain", "undrain"]

# expected next state for every (setup, input)
EXPECTED = {
    #                   link_ok      link_lost  tick_before  tick_at  tick_after  drain      undrain
    "UNKNOWN":          (S.UP,        S.DOWN,    S.UNKNOWN,   S.UNKNOWN, S.UNKNOWN, S.DRAINED, S.UNKNOWN),
    "UP":               (S.UP,        S.DOWN,    S.UP,        S.UP,      S.UP,      S.DRAINED, S.UP),
    "DOWN":             (S.HOLD_DOWN, S.DOWN,    S.DOWN,      S.DOWN,    S.DOWN,    S.DRAINED, S.DOWN),
    "HOLD_DOWN":        (S.HOLD_DOWN, S.DOWN,    S.HOLD_DOWN, S.UP,      S.UP,      S.DRAINED, S.HOLD_DOWN),
    "DRAINED_LINK_UP":  (S.DRAINED,   S.DRAINED, S.DRAINED,   S.DRAINED, S.DRAINED, S.DRAINED, S.HOLD_DOWN),
    "DRAINED_LINK_DOWN": (S.DRAINED,  S.DRAINED, S.DRAINED,   S.DRAINED, S.DRAINED, S.DRAINED, S.DOWN),
}

CASES = [(setup, inp, EXPECTED[setup][i]) for setup in EXPECTED for i, inp in enumerate(INPUTS)]


def test_setups_reach_their_state():
    for setup, st in SETUP_STATE.items():
        assert reach(setup).state == st, setup


@pytest.mark.parametrize("setup,inp,expected", CASES, ids=[f"{s}-{i}" for s, i, _ in CASES])
def test_transition_table(setup, inp, expected, caplog):
    h = reach(setup)
    before = h.state
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="linkpass.health"):
        t = apply_input(h, inp)
    assert h.state == expected
    lines = [r.getMessage() for r in caplog.records if r.name == "linkpass.health"]
    if expected == before:
        assert t is None
        assert lines == []
    else:
        assert t is not None
        assert (t.rail, t.old, t.new) == (3, before, expected)
        assert expected in TRANSITIONS[before]
        assert lines == [f"rail 3: {before.value} -> {expected.value} ({t.reason})"]
        assert h.reason == t.reason
        assert h.since_ns == t.t_ns


def test_hold_down_deadline_and_next_deadline():
    h = reach("HOLD_DOWN")
    assert h.hold_until_ns == T0 + HOLD
    assert h.next_deadline() == T0 + HOLD
    assert not h.usable
    assert h.on_tick(T0 + HOLD - 1) is None
    t = h.on_tick(T0 + HOLD)
    assert t is not None and t.new == S.UP and t.t_ns == T0 + HOLD
    assert h.usable
    assert h.hold_until_ns is None
    assert h.next_deadline() is None


def test_second_link_ok_during_hold_down_does_not_restart_it():
    h = reach("HOLD_DOWN")
    assert h.on_link(True, "operstate UP", T0 + 1_000 * MS) is None
    assert h.next_deadline() == T0 + HOLD


def test_flap_during_hold_down_restarts_hold_down_from_the_new_link_up():
    h = reach("HOLD_DOWN")
    h.on_link(False, "carrier lost", T0 + 1_000 * MS)
    assert h.state == S.DOWN and h.next_deadline() is None
    assert h.on_tick(T0 + HOLD) is None  # the old deadline does nothing now
    assert h.state == S.DOWN
    h.on_link(True, "up", T0 + 1_500 * MS)
    assert h.next_deadline() == T0 + 1_500 * MS + HOLD
    assert h.on_tick(T0 + 1_500 * MS + HOLD - 1) is None
    assert h.on_tick(T0 + 1_500 * MS + HOLD).new == S.UP


@pytest.mark.parametrize("setup", list(SETUP_STATE))
def test_next_deadline_only_in_hold_down(setup):
    h = reach(setup)
    if h.state == S.HOLD_DOWN:
        assert h.next_deadline() == T0 + HOLD
    else:
        assert h.next_deadline() is None


def test_hold_down_zero_goes_straight_back_to_up(caplog):
    h = RailHealth(1, 0)
    h.on_link(True, "up", 0)
    h.on_link(False, "carrier lost", 5)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="linkpass.health"):
        t = h.on_link(True, "up", 9)
    assert h.state == S.UP and h.usable
    assert t is not None and (t.old, t.new, t.t_ns) == (S.HOLD_DOWN, S.UP, 9)
    lines = [r.getMessage() for r in caplog.records if r.name == "linkpass.health"]
    assert lines == ["rail 1: DOWN -> HOLD_DOWN (link back)", "rail 1: HOLD_DOWN -> UP (hold-down is 0 ms)"]
    assert h.next_deadline() is None


def test_first_healthy_observation_goes_straight_to_up():
    h = RailHealth(0, HOLD)
    assert h.state == S.UNKNOWN and not h.usable
    t = h.on_link(True, "rail0 up", 42)
    assert t.new == S.UP and h.reason == "link up at start" and h.since_ns == 42


def test_undrain_without_any_link_information_goes_down():
    h = RailHealth(0, HOLD)
    h.on_drain(True, 1)
    assert h.state == S.DRAINED
    h.on_drain(False, 2)
    assert h.state == S.DOWN and h.reason == "undrained, link down"


def test_drained_rail_remembers_link_changes_for_undrain():
    h = reach("DRAINED_LINK_UP")
    h.on_link(False, "carrier lost", NOW)
    assert h.state == S.DRAINED
    h.on_drain(False, NOW + 1)
    assert h.state == S.DOWN
    h = reach("DRAINED_LINK_DOWN")
    h.on_link(True, "up", NOW)
    assert h.state == S.DRAINED
    h.on_drain(False, NOW + 1)
    assert h.state == S.HOLD_DOWN and h.next_deadline() == NOW + 1 + HOLD


def test_usable_only_up():
    assert USABLE == frozenset({S.UP})
    assert "SUSPECT" not in S.__members__  # never entered, removed (issue 15): gray failures are path states
    for setup, st in SETUP_STATE.items():
        assert reach(setup).usable == (st == S.UP), setup


# ----------------------------------------------------------------------------- the table itself

EXPECTED_TABLE = {
    S.UNKNOWN: {S.UP, S.DOWN, S.DRAINED},
    S.UP: {S.DOWN, S.DRAINED},
    S.DOWN: {S.HOLD_DOWN, S.DRAINED},
    S.HOLD_DOWN: {S.UP, S.DOWN, S.DRAINED},
    S.DRAINED: {S.DOWN, S.HOLD_DOWN},
}


def test_transition_table_is_the_documented_one():
    assert set(TRANSITIONS) == set(S)
    assert {k: set(v) for k, v in TRANSITIONS.items()} == EXPECTED_TABLE
    # nothing ever goes back to UNKNOWN, and DOWN never skips hold-down
    assert all(S.UNKNOWN not in v for v in TRANSITIONS.values())
    assert S.UP not in TRANSITIONS[S.DOWN]
    assert S.UP not in TRANSITIONS[S.DRAINED]


ILLEGAL = [(a, b) for a, b in itertools.product(S, S) if a != b and b not in EXPECTED_TABLE[a]]
LEGAL = [(a, b) for a, b in itertools.product(S, S) if b in EXPECTED_TABLE[a]]


@pytest.mark.parametrize("old,new", ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_illegal_transitions_raise_and_change_nothing(old, new, caplog):
    h = RailHealth(7, HOLD)
    h.state = old
    h.since_ns = 123
    h.reason = "before"
    with caplog.at_level(logging.INFO, logger="linkpass.health"):
        with pytest.raises(IllegalTransition) as ei:
            h.set_state(new, 456, "why")
    assert f"{old.value} -> {new.value}" in str(ei.value)
    assert "rail 7" in str(ei.value)
    assert (h.state, h.since_ns, h.reason) == (old, 123, "before")
    assert [r for r in caplog.records if r.name == "linkpass.health"] == []


@pytest.mark.parametrize("old,new", LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_legal_transitions_via_set_state(old, new, caplog):
    h = RailHealth(7, HOLD)
    h.state = old
    with caplog.at_level(logging.INFO, logger="linkpass.health"):
        t = h.set_state(new, 1_000, "because")
    assert h.state == new and t.old == old and t.new == new
    assert h.since_ns == 1_000
    assert h.hold_until_ns == (1_000 + HOLD if new == S.HOLD_DOWN else None)
    msgs = [r.getMessage() for r in caplog.records if r.name == "linkpass.health"]
    assert msgs == [f"rail 7: {old.value} -> {new.value} (because)"]


@pytest.mark.parametrize("st", list(S))
def test_same_state_is_no_transition(st, caplog):
    h = RailHealth(0, HOLD)
    h.state = st
    with caplog.at_level(logging.INFO, logger="linkpass.health"):
        assert h.set_state(st, 5, "again") is None
    assert caplog.records == []


def test_the_hold_down_reason_says_what_came_back():
    h = RailHealth(1, 2 * MS)
    h.on_link(True, "rail1 up", T0)
    h.on_link(False, "probes: 1/1 peers unreachable over rail 1", T0 + MS)
    h.on_link(True, "rail1 up", T0 + 2 * MS)
    assert h.state == RailState.HOLD_DOWN and h.reason == "probes answer again, holding down"
    h.on_link(False, "carrier lost on rail1", T0 + 3 * MS)
    h.on_link(True, "rail1 up", T0 + 4 * MS)
    assert h.reason == "link back, holding down"
