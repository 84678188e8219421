"""The daemon's counter source (linkpass.adapters.risk_source) on captured-style sysfs trees:
rails found from netdevs alone, a rising symbol_error sequence -> one RiskChanged for the rail
(with its counters), a clean sequence -> none, a reset and a vanished device -> a warning once,
no verdict; and the [risk] config section."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from linkpass.adapters.counters import CounterPoller
from linkpass.adapters.risk_source import RiskSource, rail_sources_from_sysfs
from linkpass.config import ConfigError, parse_config
from linkpass.core.model import RiskChanged
from linkpass.core.risk import RiskTracker
from linkpass.lab import counter_trees
from unit_helpers import make_toml

SPEC = Path(__file__).resolve().parents[1] / "fixtures" / "counters" / "sequences.json"
S = 1_000_000_000


def _run(tmp_path: Path, name: str, clean_hold_s: float = 600.0, steps: int | None = None):
    spec = counter_trees.load(SPEC)
    host, seq = spec["host"], spec["sequences"][name]
    root = tmp_path / "root"
    counter_trees.build_host(root, host)
    rails = {r["rail"]: r["netdev"] for r in host["rails"]}
    posted: list = []
    now = [0]
    poller = CounterPoller(rail_sources_from_sysfs(root, rails), [], root=root, clock=lambda: now[0])
    src = RiskSource(poller, RiskTracker(clean_hold_s=clean_hold_s), posted.append, interval_s=seq["interval_s"])
    for step in range(min(seq["steps"], steps or seq["steps"])):
        counter_trees.write_step(root, host, seq, step)
        now[0] = step * int(seq["interval_s"] * S)
        src.step(*src.poller.poll(), now[0])
    src.close()
    return src, posted, seq


def test_rails_are_found_from_their_netdevs_in_sysfs(tmp_path):
    host = counter_trees.load(SPEC)["host"]
    counter_trees.build_host(tmp_path, host)
    got = rail_sources_from_sysfs(tmp_path, {r["rail"]: r["netdev"] for r in host["rails"]} | {9: "veth9"})
    want = {r["rail"]: (r["netdev"], r["hca"], r["port"], r["bdf"]) for r in host["rails"]}
    assert {s.rail: (s.netdev, s.hca, s.port, s.bdf) for s in got if s.rail != 9} == want
    (v,) = [s for s in got if s.rail == 9]
    assert (v.hca, v.port, v.bdf) == (None, None, None)  # no such netdev: counters of nothing, no error


def test_a_rising_symbol_error_rate_posts_one_at_risk_event_before_the_link_dies(tmp_path):
    src, posted, seq = _run(tmp_path, "symbol_error_rise_then_link_down")
    first = [e for e in posted if isinstance(e, RiskChanged) and e.at_risk]
    assert [(e.kind, e.subject) for e in first] == [("rail", 0)]
    e = first[0]
    assert e.t_ns < seq["failure"]["step"] * seq["interval_s"] * S
    assert e.verdict["counter"] in ("symbol_error", "link_error_recovery") and e.verdict["counters"]["symbol_error"] > 0
    assert e.verdict["citation"] and e.verdict["window_s"] > 0
    st = src.status()
    assert st["verdicts"] >= 1 and st["tracker"]["rail"]["0"]["at_risk"] is True


def test_a_clean_sequence_posts_nothing(tmp_path):
    _, posted, _ = _run(tmp_path, "clean", steps=60)  # the whole hour: tests/unit/test_risk.py
    assert posted == []


@pytest.mark.parametrize("name", ["reset_after_driver_reload", "vanished_device", "garbage_and_truncated"])
def test_bad_counters_warn_once_and_give_no_verdict(tmp_path, caplog, name):
    caplog.set_level(logging.WARNING, logger="linkpass.risk")
    src, posted, seq = _run(tmp_path, name)
    assert [e for e in posted if e.at_risk and [e.kind, e.subject] not in seq.get("expect_at_risk", [])] == []
    warned = [r.getMessage() for r in caplog.records if "no verdict from it" in r.getMessage()]
    assert warned and len(warned) == len(set(warned))  # each problem once
    assert src.counters["problems"] == len(warned) and src.status()["recent_problems"]


def test_the_risk_section_has_defaults_and_refuses_bad_values():
    cfg = parse_config(make_toml(rails=(0, 1), n_peers=1), "lp.toml")
    assert cfg.risk.enabled and cfg.risk.poll_interval_s == 1.0 and cfg.risk.clean_hold_s == 600.0
    with pytest.raises(ConfigError, match="poll_interval_s"):
        parse_config(make_toml(rails=(0, 1), n_peers=1) + "\n[risk]\npoll_interval_s = 0\n", "lp.toml")
    with pytest.raises(ConfigError, match="risk"):
        parse_config(make_toml(rails=(0, 1), n_peers=1) + "\n[risk]\nbogus = 1\n", "lp.toml")
