"""linkpass.core.risk: counter samples -> at-risk verdicts (issue 18, part 2).  Time is a
parameter: every test moves t_ns by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from linkpass.core.risk import (COUNTER_WIDTHS, DEFAULT_RULES, AerLogCounter, CounterSample, RiskTracker, Rule,
                                SourceProblem, log_timeline)

S = 1_000_000_000
CORPUS = Path(__file__).resolve().parents[1] / "fixtures/corpus/kernel_logs"
GPUBURN = CORPUS / "gpuburn1_tesla_aer_replay_timeout_then_surprise_down_xid79.log"


def sample(counter, value, t_s, kind="rail", subject=0):
    return CounterSample(kind, subject, counter, value, int(t_s * S), f"test:{counter}")


def feed(tr, series, interval_s=10.0, kind="rail", subject=0, start_s=0.0):
    """series: list of {counter: value} per poll -> [(poll index, verdict)], [problems]."""
    verdicts, problems = [], []
    for n, vals in enumerate(series):
        t = start_s + n * interval_s
        v, p = tr.observe([sample(c, x, t, kind, subject) for c, x in vals.items()], int(t * S))
        verdicts += [(n, x) for x in v]
        problems += p
    return verdicts, problems


def test_rules_cite_a_source_and_are_well_formed():
    ids = [r.id for r in DEFAULT_RULES]
    assert len(ids) == len(set(ids))
    for r in DEFAULT_RULES:
        assert r.citation.strip() and r.unit and r.kind in ("rail", "gpu")
        assert r.mode in ("rate", "count", "gauge", "gauge_margin")
        assert r.min_polls >= 1


def test_unknown_rule_mode_is_refused():
    with pytest.raises(ValueError, match="bogus"):
        RiskTracker([Rule("bogus", "rail", "x", "median", 1, 1, "u", "c")])


def test_rising_symbol_error_flags_the_rail_with_the_rule_and_rate():
    tr = RiskTracker()
    # 1 error per 10 s poll = 360 per hour, over the 120/hour BER rule
    v, p = feed(tr, [{"symbol_error": max(0, n - 2)} for n in range(20)])
    assert p == []
    assert len(v) == 1
    n, verdict = v[0]
    assert verdict.at_risk and verdict.kind == "rail" and verdict.subject == 0
    assert verdict.rule == "ib.symbol_error.ber" and verdict.counter == "symbol_error"
    assert verdict.unit == "per hour" and verdict.rate > 120
    assert "NVSentinel" in verdict.citation
    # the evidence: at least 60 s of history and rises in two polls
    assert n * 10 >= 60
    j = verdict.to_json()
    assert j["rule"] == "ib.symbol_error.ber" and j["at_risk"] is True and j["window_s"] == 3600.0


def test_one_read_is_not_evidence():
    """A single jump (one poll) past the threshold gives no verdict: rate rules need rises in
    min_polls polls."""
    tr = RiskTracker()
    series = [{"symbol_error": 0}] * 10 + [{"symbol_error": 500}] * 10
    v, _ = feed(tr, series)
    assert v == []


def test_slow_background_rate_stays_clean():
    tr = RiskTracker()
    # one symbol error every 10 minutes: 6 per hour
    v, _ = feed(tr, [{"symbol_error": n // 60} for n in range(400)])
    assert v == []


@pytest.mark.parametrize("counter,before,after,problem", [
    ("symbol_error", 5000, 0, "reset"),            # 16-bit, saturates: a step back is a reset
    ("carrier_changes", 9, 2, "reset"),            # 64-bit netdev statistics
    ("local_ack_timeout_err", 2**32 - 5, 3, "wrap"),  # 32-bit mlx5 Q counter
    ("local_ack_timeout_err", 1000, 3, "reset"),   # 32-bit but nowhere near the top: a reset
])
def test_going_backwards_rebaselines_once_and_gives_no_verdict(counter, before, after, problem):
    tr = RiskTracker()
    series = [{counter: before}] * 5 + [{counter: after}] + [{counter: after}] * 5
    v, p = feed(tr, series)
    assert v == []
    assert [x.problem for x in p] == [problem]
    assert p[0].counter == counter and "re-baselined" in p[0].detail


def test_a_reset_is_reported_again_after_the_source_read_well():
    tr = RiskTracker()
    v, p = feed(tr, [{"symbol_error": 50}, {"symbol_error": 0}, {"symbol_error": 0}, {"symbol_error": 40},
                     {"symbol_error": 1}])
    assert v == [] and [x.problem for x in p] == ["reset", "reset"]


def test_a_saturated_counter_is_said_once():
    top = 2 ** COUNTER_WIDTHS["symbol_error"][0] - 1
    tr = RiskTracker()
    _, p = feed(tr, [{"symbol_error": top - 1}, {"symbol_error": top}, {"symbol_error": top}, {"symbol_error": top}])
    assert [x.problem for x in p] == ["saturated"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, "12", None, True])
def test_garbage_values_are_a_problem_not_a_crash(value):
    tr = RiskTracker()
    v, p = tr.observe([CounterSample("rail", 0, "symbol_error", value, 0, "x")], 0)
    assert v == [] and [x.problem for x in p] == ["garbage"]


def test_source_problems_are_reported_once_until_the_source_reads_well():
    tr = RiskTracker()
    gone = SourceProblem("rail", 1, "symbol_error", "/sys/x", "vanished", "/sys/x: gone", 0)
    assert tr.observe([gone], 0)[1] == [gone]
    assert tr.observe([gone], 10 * S)[1] == []
    assert tr.missing("rail", 1, "symbol_error", "/sys/x", 20 * S, "vanished", "gone") == []
    tr.observe([sample("symbol_error", 3, 30, subject=1)], 30 * S)
    assert len(tr.missing("rail", 1, "symbol_error", "/sys/x", 40 * S, "vanished", "gone")) == 1


def test_clean_hold_clears_the_verdict_only_after_the_hold():
    tr = RiskTracker(clean_hold_s=300)
    rising = [{"link_error_recovery": n} for n in range(12)]  # 6/min, over 5/min
    flat = [{"link_error_recovery": 11}] * 40
    v, _ = feed(tr, rising + flat)
    assert [x.at_risk for _, x in v] == [True, False]
    (n_on, on), (n_off, off) = v
    assert on.rule == "ib.link_error_recovery.rate"
    assert off.rule == on.rule and not off.at_risk
    # the last rise was poll 11; clean from there for >= 300 s
    assert (n_off - 11) * 10 >= 300
    assert tr.status()["rail"]["0"]["at_risk"] is False


def test_rises_during_the_hold_restart_it():
    tr = RiskTracker(clean_hold_s=300)
    rising = [{"link_error_recovery": n} for n in range(12)]
    # below the rate threshold now (one every 100 s) but still rising: not clean
    slow = [{"link_error_recovery": 11 + n // 10} for n in range(60)]
    v, _ = feed(tr, rising + slow)
    assert [x.at_risk for _, x in v] == [True]


def test_gauge_needs_two_consecutive_polls():
    tr = RiskTracker()
    v, _ = feed(tr, [{"module_temp_c": 50, "module_temp_crit_c": 75}, {"module_temp_c": 71, "module_temp_crit_c": 75},
                     {"module_temp_c": 60, "module_temp_crit_c": 75}, {"module_temp_c": 71, "module_temp_crit_c": 75},
                     {"module_temp_c": 72, "module_temp_crit_c": 75}])
    assert len(v) == 1 and v[0][0] == 4 and v[0][1].rule == "optics.module_temp.near_crit"
    assert v[0][1].unit == "°C"


def test_gauge_without_its_limit_reading_gives_no_verdict():
    tr = RiskTracker()
    v, _ = feed(tr, [{"module_temp_c": 90}] * 5)
    assert v == []


def test_gpu_row_remap_pending_flag():
    tr = RiskTracker()
    v, _ = feed(tr, [{"row_remap_pending": 0}] * 3 + [{"row_remap_pending": 1}] * 3, kind="gpu", subject=3)
    assert len(v) == 1 and v[0][1].kind == "gpu" and v[0][1].subject == 3
    assert v[0][1].rule == "gpu.row_remap_pending" and "Memory Error Management" in v[0][1].citation


def test_status_is_json_able_and_names_rates():
    import json
    tr = RiskTracker()
    feed(tr, [{"symbol_error": max(0, n - 2)} for n in range(20)])
    st = tr.status()
    json.dumps(st)
    assert st["rail"]["0"]["at_risk"] is True
    assert st["rail"]["0"]["verdict"]["rule"] == "ib.symbol_error.ber"
    assert st["rail"]["0"]["rates"]["ib.symbol_error.ber"] > 120


# -- kernel-log AER records


def test_corpus_replay_timer_timeout_flags_the_gpu_before_xid79():
    """wilicc/gpu-burn#1: a corrected Replay Timer Timeout on the root port 104 s before the
    surprise link-down and Xid 79 of the GPU below it."""
    lines = GPUBURN.read_text().splitlines(True)
    assert lines[0].startswith("# source:")
    subjects = {"0000:02:00.0": ("gpu", 0), "0000:00:02.0": ("gpu", 0)}
    tr = RiskTracker()
    flagged = failed = None
    for ts, samples, incs in log_timeline(lines, subjects):
        v, p = tr.observe(samples, int(ts * S))
        assert p == []
        for x in v:
            if x.at_risk and flagged is None:
                flagged = (ts, x)
        if any(i.code == "xid:79" for i in incs) and failed is None:
            failed = ts
    assert flagged is not None and failed is not None
    ts, verdict = flagged
    assert verdict.kind == "gpu" and verdict.subject == 0 and verdict.rule == "gpu.aer_log.dll_corrected"
    assert 100 < failed - ts < 110


# lines written from drivers/pci/pcie/aer.c (6.x): aer_print_port_info, aer_print_error
_RX_ERR = """[  100.000001] pcieport 0000:00:03.0: AER: Corrected error received: 0000:05:00.0
[  100.000002] nvidia 0000:05:00.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)
[  100.000003] nvidia 0000:05:00.0:   device [10de:2330] error status/mask=00000001/0000e000
[  100.000004] nvidia 0000:05:00.0:    [ 0] RxErr                  (First)
"""
_BAD_TLP = """[  200.000001] pcieport 0000:00:03.0: AER: Corrected error received: 0000:05:00.0
[  200.000002] nvidia 0000:05:00.0: PCIe Bus Error: severity=Corrected, type=Data Link Layer, (Receiver ID)
[  200.000003] nvidia 0000:05:00.0:   device [10de:2330] error status/mask=00000040/0000e000
[  200.000004] nvidia 0000:05:00.0:    [ 6] BadTLP                 (First)
"""


def _run_log(text):
    subjects = {"0000:05:00.0": ("gpu", 4), "0000:00:03.0": ("gpu", 4)}
    tr = RiskTracker()
    out = []
    for ts, samples, _ in log_timeline(text.splitlines(True), subjects):
        out += tr.observe(samples, int(ts * S))[0]
    return out


def test_one_physical_layer_receiver_error_is_not_a_risk():
    assert _run_log(_RX_ERR) == []


def test_a_data_link_layer_bad_tlp_on_the_gpu_is_a_risk():
    v = _run_log(_RX_ERR + _BAD_TLP)
    assert [(x.kind, x.subject, x.rule) for x in v] == [("gpu", 4, "gpu.aer_log.dll_corrected")]


def test_aer_log_counter_ignores_other_codes_and_unknown_devices():
    c = AerLogCounter({"0000:05:00.0": ("gpu", 4)})
    assert c.record("xid:79", "0000:05:00.0", "", 0) == []
    assert c.record("aer:corrected", "0000:99:00.0", "Replay Timer Timeout", 0) == []
    got = c.record("aer:corrected", "0000:05:00.0", "AER corrected error on 0000:05:00.0: Replay Timer Timeout", 5)
    assert {(s.counter, s.value) for s in got} == {("aer_log_corrected", 1.0), ("aer_log_corrected_dll", 1.0)}
    assert {(s.counter, s.value) for s in c.samples(9)} == {("aer_log_corrected", 1.0), ("aer_log_corrected_dll", 1.0)}


def test_truncated_log_gives_no_verdict_and_no_error():
    cut = _BAD_TLP.splitlines(True)[:1] + ["[  200.000002] nvidia 0000:05:00.0: PCIe Bus Err"]
    assert _run_log("".join(cut)) == []


def test_a_subject_that_stops_reporting_is_not_declared_clean():
    tr = RiskTracker(clean_hold_s=60)
    v, _ = feed(tr, [{"link_error_recovery": n} for n in range(12)])
    assert [x.at_risk for _, x in v] == [True]
    gone = SourceProblem("rail", 0, "link_error_recovery", "/sys/x", "vanished", "gone", 0)
    for n in range(12, 40):
        verdicts, _ = tr.observe([gone], n * 10 * S)
        assert verdicts == []
    assert tr.status()["rail"]["0"]["at_risk"] is True
