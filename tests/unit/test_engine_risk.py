"""The engine's handling of at-risk verdicts (issue 18): a rail at risk is drained through the
plan (independently of an operator's drain) and fails back after its hold-down once clear; a
GPU at risk becomes a NotifyAtRisk; both are history ``at_risk`` (the MQTT event) and status."""

from __future__ import annotations

from linkpass.config import policy_from_config
from linkpass.core.alerts import AlertMapper
from linkpass.core.engine import Engine
from linkpass.core.health import RailState
from linkpass.core.model import Drain, NotifyAtRisk, PublishHistory, RiskChanged, SetTimer, Tick
from unit_helpers import S, applies, carrier_lost, decided, make_cfg, notices, snapshot, up

VERDICT = {"counter": "symbol_error", "rate": 40.0, "unit": "per hour", "window_s": 3600.0,
           "threshold": ">= 10 per hour", "citation": "test", "counters": {"symbol_error": 1234}}


def started(rails=(0, 1)):
    cfg = make_cfg(rails=rails)
    eng = Engine(policy_from_config(cfg))
    eng.handle(snapshot(cfg, 0), 0)
    return eng


def risk(kind, subject, at_risk, t):
    return RiskChanged(kind, subject, at_risk, "ib.symbol_error.rate", "symbol_error 40 per hour over 3600 s",
                       VERDICT, t)


def history(acts):
    return [e for a in acts if isinstance(a, PublishHistory) for e in a.entries]


def test_rail_at_risk_is_drained_by_the_plan_and_fails_back_after_hold_down():
    eng = started()
    acts = eng.handle(risk("rail", 0, True, S), S)
    assert eng.rails[0].state == RailState.DRAINED and eng.rails[0].reason.startswith("at risk: ib.symbol_error.rate")
    assert notices(acts)[0].usable == frozenset({1})
    assert {nh.rail for r in applies(acts)[0].routes for nh in r.nexthops} == {1}
    (e,) = [e for e in history(acts) if e.kind == "at_risk"]
    assert e.data["rail"] == 0 and e.data["at_risk"] and e.data["action"] == "drain"
    st = eng.status(S)
    assert st["at_risk"][0]["rule"] == "ib.symbol_error.rate" and st["rails"][0]["at_risk"]["counter"] == "symbol_error"
    assert st["rails"][0]["drains"] == ["at-risk"]
    acts = eng.handle(risk("rail", 0, False, 10 * S), 10 * S)
    assert eng.rails[0].state == RailState.HOLD_DOWN and eng.status(10 * S)["at_risk"] == []
    assert SetTimer(12 * S) in decided(acts)
    acts = eng.handle(Tick(12 * S), 12 * S)
    assert {nh.rail for r in applies(acts)[0].routes for nh in r.nexthops} == {0, 1}


def test_operator_undrain_keeps_a_rail_at_risk_drained_and_the_other_way_round():
    eng = started()
    eng.handle(Drain(0, True, S), S)
    eng.handle(risk("rail", 0, True, 2 * S), 2 * S)
    eng.handle(Drain(0, False, 3 * S), 3 * S)
    assert eng.rails[0].state == RailState.DRAINED and eng.rails[0].drains.keys() == {"at-risk"}
    eng.handle(Drain(0, True, 4 * S), 4 * S)
    eng.handle(risk("rail", 0, False, 5 * S), 5 * S)
    assert eng.rails[0].state == RailState.DRAINED and eng.rails[0].reason == "drained by operator"
    eng.handle(Drain(0, False, 6 * S), 6 * S)
    assert eng.rails[0].state == RailState.HOLD_DOWN


def test_a_rail_at_risk_whose_link_dies_stays_out_and_comes_back_down_when_clear():
    eng = started()
    eng.handle(risk("rail", 0, True, S), S)
    assert decided(eng.handle(carrier_lost_ev(2 * S), 2 * S)) == []
    eng.handle(risk("rail", 0, False, 3 * S), 3 * S)
    assert eng.rails[0].state == RailState.DOWN


def carrier_lost_ev(t):
    from linkpass.core.model import LinkChanged

    return LinkChanged(carrier_lost("rail0"), t)


def test_a_repeated_verdict_does_not_replan_and_a_clear_without_risk_does_nothing():
    eng = started()
    eng.handle(risk("rail", 0, True, S), S)
    g = eng.generation
    assert decided(eng.handle(risk("rail", 0, True, 2 * S), 2 * S)) == []
    assert eng.generation == g
    assert eng.handle(risk("rail", 1, False, 3 * S), 3 * S) == []
    assert eng.rails[1].state == RailState.UP


def test_unknown_rail_is_recorded_and_nothing_moves():
    eng = started()
    g = eng.generation
    acts = eng.handle(risk("rail", 7, True, S), S)
    assert decided(acts) == [] and eng.generation == g
    (e,) = history(acts)
    assert e.data["unknown"] is True


def test_gpu_at_risk_asks_the_hooks_to_move_the_rank_once():
    eng = started()
    acts = eng.handle(risk("gpu", 3, True, S), S)
    (n,) = [a for a in acts if isinstance(a, NotifyAtRisk)]
    assert n.gpu == 3 and n.verdict["rule"] == "ib.symbol_error.rate" and n.verdict["counters"] == {"symbol_error": 1234}
    assert not applies(acts)  # a GPU at risk moves no traffic
    assert not [a for a in eng.handle(risk("gpu", 3, True, 2 * S), 2 * S) if isinstance(a, NotifyAtRisk)]
    acts = eng.handle(risk("gpu", 3, False, 3 * S), 3 * S)
    assert not [a for a in acts if isinstance(a, NotifyAtRisk)] and eng.status(3 * S)["at_risk"] == []


def test_at_risk_entries_become_mqtt_at_risk_events():
    eng = started()
    m = AlertMapper({0: "rail0", 1: "rail1"})
    (e,) = [e for e in history(eng.handle(risk("rail", 0, True, S), S)) if e.kind == "at_risk"]
    a = m.from_entry(e.kind, e.t_ns, e.data)
    assert a.event == "at_risk" and a.critical and a.fields["netdev"] == "rail0"
    assert a.fields["counters"] == {"symbol_error": 1234} and a.fields["window_s"] == 3600.0
    (e,) = [e for e in history(eng.handle(risk("rail", 0, False, 9 * S), 9 * S)) if e.kind == "at_risk"]
    assert not m.from_entry(e.kind, e.t_ns, e.data).critical


def test_nccl_env_for_new_processes_leaves_a_rail_at_risk_out():
    eng = started()
    eng.handle(risk("rail", 0, True, S), S)
    rails = {r.id: r for r in eng.nccl_rails()}  # what WriteNcclEnv computes the file from
    assert not rails[0].usable and rails[0].state == "DRAINED" and rails[1].usable


def test_link_up_during_risk_drain_does_not_fail_back():
    eng = started()
    eng.handle(risk("rail", 0, True, S), S)
    from linkpass.core.model import LinkChanged

    assert decided(eng.handle(LinkChanged(up("rail0"), 2 * S), 2 * S)) == []
    assert eng.rails[0].state == RailState.DRAINED


def test_linkpass_status_says_what_is_at_risk_and_what_was_done():
    from linkpass.cli.app import _status_lines

    eng = started()
    eng.handle(risk("rail", 1, True, S), S)
    eng.handle(risk("gpu", 2, True, S), S)
    lines = [x for x in _status_lines({"hooks": {}, "at_risk": eng.status(S)["at_risk"]}) if x.startswith("AT RISK")]
    assert lines == ["AT RISK: GPU 2: symbol_error 40 per hour over 3600 s; move the rank to a spare at the next step boundary",
                     "AT RISK: rail 1: symbol_error 40 per hour over 3600 s; drain"]
    st = eng.status(S)["at_risk"]
    st[1]["summary"] = "rail 1 at risk: symbol_error 40 per hour"
    assert [x for x in _status_lines({"hooks": {}, "at_risk": st}) if x.startswith("AT RISK")][1] == \
        "AT RISK: rail 1: symbol_error 40 per hour; drain"
