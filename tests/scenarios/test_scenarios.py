"""Scenarios: event traces shaped like what the adapters post in field incidents, fed to a real
engine (the pure core); its actions must match the checked-in golden files.

Each ``traces/<name>.jsonl`` (format: :mod:`tests.scenarios.runner`) is replayed with its clock
(``now_ns``) and the daemon's timer, and the serialized actions (and rail states where they
change) are compared with ``golden/<name>.json``, entry by entry.  A difference fails the test
with the first entry that differs, both sides shown: the engine decides differently from what
was reviewed.

When a change of behaviour is intended, regenerate the goldens and review their diff::

    LINKPASS_UPDATE_GOLDENS=1 .venv/bin/python -m pytest -q tests/scenarios
    git diff tests/scenarios/golden

A new scenario: add ``traces/<name>.jsonl``, run the line above, read the new golden, commit
both.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.scenarios.runner import GOLDEN, TRACES, TraceError, load_trace, run_trace

UPDATE = os.environ.get("LINKPASS_UPDATE_GOLDENS") == "1"
NAMES = sorted(p.stem for p in TRACES.glob("*.jsonl"))


def render(result: list[dict]) -> str:
    """A golden file's text: one engine call per line, so a diff shows which call changed."""
    return "[\n" + ",\n".join(json.dumps(e, sort_keys=True) for e in result) + "\n]\n"


@pytest.mark.parametrize("name", NAMES)
def test_trace_gives_the_golden_actions(name):
    result = run_trace(TRACES / f"{name}.jsonl")
    golden = GOLDEN / f"{name}.json"
    if UPDATE:
        golden.write_text(render(result), encoding="utf-8")
    assert golden.exists(), f"no golden for {name}: run with LINKPASS_UPDATE_GOLDENS=1 and review it"
    want = json.loads(golden.read_text(encoding="utf-8"))
    got = json.loads(render(result))  # the same JSON round trip as the file (tuples -> lists)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (f"{name}: engine call {i} (now_ns {w.get('now_ns')}, {w.get('event')}) differs from the golden\n"
                        f"  golden: {json.dumps(w, sort_keys=True)}\n  now:    {json.dumps(g, sort_keys=True)}")
    assert len(got) == len(want), f"{name}: {len(got)} engine calls, the golden has {len(want)}"


def test_the_scenarios_from_the_field_are_all_there():
    assert set(NAMES) >= {"carrier_loss_hold_down", "flapping_link_damped", "gray_failure_probe_loss",
                          "device_fault_xid79", "peer_dead_rail"}
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == NAMES  # no golden without its trace


def test_a_bad_trace_line_is_a_clear_error(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"config": "h0_two_rails.toml"}\n{"now_ns": 1, "event": "LinkChanged", "facts": {"nodev": "x"}}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: "):
        load_trace(p)
    p.write_text('{"now_ns": 1}\n')
    with pytest.raises(TraceError, match="header"):
        load_trace(p)
