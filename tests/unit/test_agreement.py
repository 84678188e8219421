"""torch_hooks.agreement.decide: table-driven, no torch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch_hooks.agreement import Decision, Proposal, decide  # noqa: E402

P = Proposal
RAILS = [0, 1, 2]

CASES = [
    # id, proposals, current rail, keep_current, (outcome, resume, rail), words in the reason
    ("same step, current rail fine, kept",
     {0: P(7, (0, 1)), 1: P(7, (0, 1))}, 0, True, ("ok", 7, 0), ["rail 0 kept"]),
    ("one rank a step ahead: resume at the lower",
     {0: P(7, (0, 1)), 1: P(8, (0, 1))}, 0, True, ("ok", 7, 0), ["resume at step 7", "lowest"]),
    ("current rail broken for one rank: first common rail",
     {0: P(3, (1, 2)), 1: P(3, (0, 1, 2))}, 0, True, ("ok", 3, 1), ["rail 1", "rail 0 is not usable by rank 0"]),
    ("a notice asks to move: first common rail even if the current one is usable",
     {0: P(3, (0, 1)), 1: P(3, (0, 1))}, 1, False, ("ok", 3, 0), ["moving off rail 1"]),
    ("order of rails is the preference, not the order in usable",
     {0: P(0, (2, 1)), 1: P(0, (2, 1))}, 0, True, ("ok", 0, 1), ["rail 1"]),
    ("no current rail: first common",
     {0: P(5, (2,)), 1: P(5, (1, 2))}, None, True, ("ok", 5, 2), ["rail 2"]),
    ("a joining spare has no step: the others' step counts",
     {0: P(4, (0,)), 1: P(None, (0, 1))}, 0, True, ("ok", 4, 0), ["resume at step 4"]),
    ("no common rail",
     {0: P(2, (0,)), 1: P(2, (1,))}, 0, True, ("no_rail", None, None), ["no rail is usable by every rank", "rank 1"]),
    ("usable rails outside the job's rails do not count",
     {0: P(2, (9,)), 1: P(2, (9,))}, 0, True, ("no_rail", None, None), ["no rail"]),
    ("a failed rank ends it, whatever the rest",
     {0: P(2, (0,)), 1: P(None, (), failed="lost its device too")}, 0, True, ("failed", None, None),
     ["rank 1 cannot take part", "lost its device too"]),
    ("only spares: no step",
     {0: P(None, (0,)), 1: P(None, (0,))}, 0, True, ("no_step", None, None), ["no rank has a step"]),
    ("two steps apart cannot be replayed",
     {0: P(5, (0,)), 1: P(7, (0,))}, 0, True, ("steps_apart", None, None), ["2 steps apart", "rank 1 at step 7"]),
    ("one rank", {0: P(0, (1,))}, 1, True, ("ok", 0, 1), ["kept"]),
]


@pytest.mark.parametrize("props, current, keep, want, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(props, current, keep, want, words):
    d = decide(props, RAILS, current, keep_current=keep)
    assert (d.outcome, d.resume_step, d.rail) == want, d
    assert d.ok == (want[0] == "ok")
    for w in words:
        assert w in d.reason, d.reason


def test_every_rank_decides_the_same_from_the_same_proposals():
    props = {0: P(11, (1, 2)), 1: P(12, (0, 1, 2)), 2: P(11, (1,))}
    ds = {decide(dict(reversed(list(props.items()))), RAILS, 0) for _ in range(3)} | {decide(props, RAILS, 0)}
    assert len(ds) == 1 and isinstance(next(iter(ds)), Decision)


def test_max_step_lag_is_a_parameter():
    props = {0: P(5, (0,)), 1: P(7, (0,))}
    assert decide(props, RAILS, 0, max_step_lag=2).resume_step == 5
    assert decide({0: P(5, (0,)), 1: P(6, (0,))}, RAILS, 0, max_step_lag=0).outcome == "steps_apart"


@pytest.mark.parametrize("bad", [{}, None])
def test_no_proposals_is_bad_input(bad):
    with pytest.raises(ValueError):
        decide(bad or {}, RAILS, 0)


@pytest.mark.parametrize("d, want", [
    ({"step": 3, "usable": [0, 1], "rail": 0}, P(3, (0, 1), 0)),
    ({"step": None, "usable": [1]}, P(None, (1,))),
    ({"step": None, "usable": [], "failed": "gone"}, P(None, (), None, "gone")),
])
def test_proposal_from_the_stored_json(d, want):
    assert Proposal.from_mapping(d) == want
    assert Proposal.from_mapping(want.to_mapping()) == want


@pytest.mark.parametrize("d", [{"step": "3", "usable": [0]}, {"step": 1, "usable": "0"}, {"step": 1, "usable": [True]},
                               {"step": True, "usable": [0]}])
def test_malformed_proposal_is_refused(d):
    with pytest.raises(ValueError):
        Proposal.from_mapping(d)
