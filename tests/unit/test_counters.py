"""linkpass.adapters.counters: sysfs / NVML readers on captured trees, their parsers on
malformed and truncated input, the bounded poll, and the fixture sequences end to end with
the risk tracker (issue 18, parts 1 and 4)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from linkpass.adapters.counters import (CounterPoller, GpuSource, RailSource, ReadError, parse_aer, parse_counter,
                                        parse_millidegrees,
                                        upstream_ports)
from linkpass.adapters.counters_fake import FakeNvml, NVMLError
from linkpass.core.risk import RiskTracker
from linkpass.lab import counter_trees as ct

SPEC = ct.load(Path(__file__).resolve().parents[1] / "fixtures/counters/sequences.json")
HOST = SPEC["host"]
S = 1_000_000_000

AER_COR = """RxErr 0
BadTLP 1
BadDLLP 0
Rollover 0
Timeout 3
NonFatalErr 0
CorrIntErr 0
HeaderOF 0
TOTAL_ERR_COR 4
"""


@pytest.mark.parametrize("text,value", [("0\n", 0), ("12345\n", 12345), ("18446744073709551615\n", 2**64 - 1),
                                        (" 7 \n", 7)])
def test_parse_counter(text, value):
    assert parse_counter(text, "/sys/x") == value


@pytest.mark.parametrize("text", ["", "\n", "12a\n", "-3\n", "1 2\n", "N/A (no PMA)\n", "0x10\n", "١٢\n"])
def test_parse_counter_malformed(text):
    with pytest.raises(ReadError) as e:
        parse_counter(text, "/sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error")
    assert e.value.problem == "garbage" and "symbol_error" in e.value.detail


@pytest.mark.parametrize("text,value", [("61125\n", 61.125), ("-5000\n", -5.0)])
def test_parse_millidegrees(text, value):
    assert parse_millidegrees(text, "/sys/x") == value


@pytest.mark.parametrize("text", ["", "-", "61.5\n", "4a\n", "--1\n"])
def test_parse_millidegrees_malformed(text):
    with pytest.raises(ReadError) as e:
        parse_millidegrees(text, "/sys/class/net/x/device/hwmon/hwmon0/temp2_input")
    assert e.value.problem == "garbage" and "temp2_input" in e.value.detail


def test_parse_aer():
    total, per = parse_aer(AER_COR, "TOTAL_ERR_COR", "/sys/bus/pci/devices/0000:1b:00.0/aer_dev_correctable")
    assert total == 4 and per["Timeout"] == 3 and per["BadTLP"] == 1


@pytest.mark.parametrize("text,why", [
    (AER_COR.rsplit("TOTAL", 1)[0], "no TOTAL_ERR_COR"),   # truncated before the total
    (AER_COR[:-4], "not '<name> <count>'"),                # cut inside the total's number: "TOTAL_ERR_COR" alone
    (AER_COR.replace("Timeout 3", "Timeout three"), "line 5"),
    ("", "no TOTAL_ERR_COR"),
])
def test_parse_aer_malformed_and_truncated(text, why):
    with pytest.raises(ReadError) as e:
        parse_aer(text, "TOTAL_ERR_COR", "/sys/bus/pci/devices/0000:1b:00.0/aer_dev_correctable")
    assert e.value.problem == "garbage" and why in e.value.detail and "0000:1b:00.0" in e.value.detail


def _tree(tmp_path, seq_name, step=0):
    seq = SPEC["sequences"][seq_name]
    ct.build_host(tmp_path, HOST)
    ct.write_step(tmp_path, HOST, seq, step)
    return seq


def test_upstream_ports_walks_the_device_path(tmp_path):
    _tree(tmp_path, "clean")
    assert upstream_ports(tmp_path, "0000:1b:00.0") == ["0000:17:02.0"]
    assert upstream_ports(tmp_path, "0000:ff:00.0") == []


def test_poll_reads_every_source_of_a_captured_tree(tmp_path):
    _tree(tmp_path, "clean")
    nv = FakeNvml(ct.nvml_steps(SPEC["sequences"]["clean"], HOST))
    p = CounterPoller(ct.rail_sources(HOST), ct.gpu_sources(HOST), root=tmp_path, nvml=nv, clock=lambda: 5)
    try:
        samples, problems = p.poll()
    finally:
        p.close()
    assert problems == []
    got = {(s.kind, s.subject, s.counter): s for s in samples}
    assert got[("rail", 0, "symbol_error")].value == 3
    assert got[("rail", 0, "symbol_error")].source == "/sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error"
    assert ("rail", 2, "carrier_changes") in got
    assert got[("rail", 2, "module_temp_c")].value == 48.0 and got[("rail", 2, "module_temp_crit_c")].value == 75.0
    # AER: the endpoint's total plus its root port's
    assert got[("gpu", 1, "aer_correctable")].value == 1
    assert got[("gpu", 1, "aer_correctable")].source == "/sys/bus/pci/devices/{0000:2b:00.0,0000:27:02.0}/aer_dev_correctable"
    assert got[("gpu", 1, "aer_correctable_dll")].value == 0
    assert got[("gpu", 0, "ecc_volatile_corrected")].value == 4
    assert got[("gpu", 2, "nvlink_crc_flit")].value == 10
    assert got[("gpu", 0, "gpu_temp_slowdown_c")].value == 87
    assert all(s.t_ns == 5 for s in samples)


def test_aer_subjects_include_the_root_ports(tmp_path):
    _tree(tmp_path, "clean")
    p = CounterPoller(ct.rail_sources(HOST), ct.gpu_sources(HOST), root=tmp_path)
    try:
        subj = p.aer_subjects()
    finally:
        p.close()
    assert subj["0000:1b:00.0"] == ("gpu", 0) and subj["0000:17:02.0"] == ("gpu", 0)
    assert subj["0000:1a:00.0"] == ("rail", 0) and subj["0000:17:01.0"] == ("rail", 0)


def test_nvml_errors_are_problems_and_unsupported_is_silent():
    steps = {0: [{"ecc_corrected": NVMLError(999), "temp": "x", "slowdown": 87}]}
    p = CounterPoller([], [GpuSource(0)], root="/nonexistent", nvml=FakeNvml(steps), clock=lambda: 1)
    try:
        samples, problems = p.poll()
    finally:
        p.close()
    assert {(x.counter, x.problem) for x in problems} == {("ecc_volatile_corrected", "unreadable"),
                                                         ("gpu_temp_c", "garbage")}
    assert [s.counter for s in samples] == ["gpu_temp_slowdown_c"]  # the rest: NOT_SUPPORTED on this GPU


def test_a_gpu_nvml_does_not_know_is_vanished():
    p = CounterPoller([], [GpuSource(7)], root="/nonexistent", nvml=FakeNvml({0: [{}]}), clock=lambda: 1)
    try:
        _, problems = p.poll()
    finally:
        p.close()
    assert [(x.subject, x.problem) for x in problems] == [(7, "vanished")]


#: a hung-read test's poll deadline: only a guard, since its wait ends on an event (``over``);
#: a read that hangs where none should ends the poll after a minute with a timeout too many,
#: so the test fails, not hangs
GUARD_S = 60.0
#: stall_s of the hung-read tests: how soon a second reader takes over (a stall presumed
#: wrongly on a loaded machine only starts one more reader: the outcome is the same)
STALL_S = 0.05
IB0 = "sys/class/infiniband/mlx5_0/ports/1"


def _all_but(n_hung: int):
    """A poll's ``over`` hook: the wait ends once every read has started and all but
    ``n_hung`` are back: the deadline passing, as an event (no wall-clock bound for the
    healthy reads to meet)."""
    return lambda pp: pp.started == pp.n and pp.returned >= pp.n - n_hung


def _fifo(tmp_path, rel: str) -> Path:
    """A FIFO in place of the file ``rel``: open() blocks like a PMA read the firmware never
    answers."""
    f = tmp_path / rel
    f.unlink()
    os.mkfifo(f)
    return f


def _release(f: Path, text: bytes = b"9\n") -> int:
    """Lets a reader blocked on FIFO ``f`` return ``text``.  Opened read-write (never blocks,
    whether or not the reader is in open() yet) and left open until the caller closes the fd,
    so the text waits in the pipe for the reader."""
    fd = os.open(f, os.O_RDWR | os.O_NONBLOCK)
    os.write(fd, text)
    return fd


def _finish(p: CounterPoller, fifos: list[Path], fds: list[int] = ()) -> None:
    """Releases every reader still blocked on ``fifos``, waits for the reader threads (a
    guard, not a timing) and closes the poller."""
    fds = [*fds, *(_release(f) for f in fifos)]
    try:
        assert p.idle(GUARD_S), "a reader thread did not return"
    finally:
        for fd in fds:
            os.close(fd)
        p.close()


def _keys(samples) -> set:
    return {(s.kind, s.subject, s.counter) for s in samples}


def _clean_keys(tmp_path) -> set:
    p = CounterPoller(ct.rail_sources(HOST), [], root=tmp_path)
    try:
        samples, problems = p.poll()
    finally:
        p.close()
    assert problems == []
    return _keys(samples)


def test_a_hung_sysfs_read_is_a_timeout_and_is_skipped_until_it_returns(tmp_path):
    """The poll returns at its deadline (here: once every other read is done) with a timeout
    problem; the second poll skips the hung path without waiting for it."""
    _tree(tmp_path, "clean")
    f = _fifo(tmp_path, f"{IB0}/counters/symbol_error")  # the first read of the poll
    p = CounterPoller(ct.rail_sources(HOST)[:1], [], root=tmp_path, workers=2, deadline_s=GUARD_S, stall_s=STALL_S,
                      over=_all_but(1))
    try:
        s1, p1 = p.poll()
        p.over = None  # the hung read is skipped, not started again: nothing else may hang
        s2, p2 = p.poll()
        assert [(x.counter, x.problem) for x in p1] == [("symbol_error", "timeout")]
        assert "no answer" in p1[0].detail
        assert [(x.counter, x.problem) for x in p2] == [("symbol_error", "timeout")]
        assert "has not returned" in p2[0].detail
        assert ("rail", 0, "link_downed") in _keys(s1) and ("rail", 0, "link_downed") in _keys(s2)
        assert p.counters["timeouts"] == 1
    finally:
        _finish(p, [f])


def test_a_hung_read_in_the_middle_does_not_stop_the_reads_after_it(tmp_path):
    """One reader runs the reads in order; when it is stuck in the 4th, another goes on with
    the rest: every other counter of every rail is read."""
    _tree(tmp_path, "clean")
    want = _clean_keys(tmp_path)
    f = _fifo(tmp_path, f"{IB0}/counters/port_rcv_errors")
    p = CounterPoller(ct.rail_sources(HOST), [], root=tmp_path, workers=2, deadline_s=GUARD_S, stall_s=STALL_S,
                      over=_all_but(1))
    try:
        keys = [(r.kind, r.subject, r.counter) for r in p.plan()]
        assert keys.index(("rail", 0, "port_rcv_errors")) == 3 and len(keys) > 40
        samples, problems = p.poll()
        assert [(x.subject, x.counter, x.problem) for x in problems] == [(0, "port_rcv_errors", "timeout")]
        assert _keys(samples) == want - {("rail", 0, "port_rcv_errors")}
        assert p.counters["stalls"] >= 1
    finally:
        _finish(p, [f])


def test_two_hung_reads_are_two_timeouts_and_the_rest_is_read(tmp_path):
    _tree(tmp_path, "clean")
    want = _clean_keys(tmp_path)
    hung = {("rail", 0, "port_rcv_errors"), ("rail", 1, "carrier_changes")}
    fifos = [_fifo(tmp_path, f"{IB0}/counters/port_rcv_errors"),
             _fifo(tmp_path, "sys/class/net/ibp42s0/statistics/carrier_changes")]
    p = CounterPoller(ct.rail_sources(HOST), [], root=tmp_path, workers=3, deadline_s=GUARD_S, stall_s=STALL_S,
                      over=_all_but(2))
    try:
        s1, p1 = p.poll()
        p.over = None  # both are skipped now; one reader is left for the rest
        s2, p2 = p.poll()
        assert sorted((x.kind, x.subject, x.counter, x.problem) for x in p1) == sorted((*k, "timeout") for k in hung)
        assert sorted((x.kind, x.subject, x.counter) for x in p2) == sorted(hung)
        assert all("has not returned" in x.detail for x in p2)
        assert _keys(s1) == _keys(s2) == want - hung
    finally:
        _finish(p, fifos)


def test_reads_not_started_because_every_reader_is_stuck_are_reported(tmp_path):
    """With every reader stuck, the reads after the hung one cannot start: each is a timeout
    saying so (none is dropped), and is read by the next poll once a reader is free."""
    _tree(tmp_path, "clean")
    f = _fifo(tmp_path, f"{IB0}/counters/port_rcv_errors")  # read 3
    # the wait ends once the poll has seen the stall (and found no reader free), not at a time
    p = CounterPoller(ct.rail_sources(HOST)[:1], [], root=tmp_path, workers=1, deadline_s=GUARD_S, stall_s=STALL_S,
                      over=lambda pp: pp.stalls >= 1 and pp.returned == 3)
    fds: list[int] = []
    try:
        n = len(p.plan())
        samples, problems = p.poll()
        assert [s.counter for s in samples] == ["link_downed", "link_error_recovery", "symbol_error"]
        assert (problems[0].counter, problems[0].problem) == ("port_rcv_errors", "timeout")
        assert "no answer" in problems[0].detail
        rest = problems[1:]
        assert len(rest) == n - 4 and all(x.problem == "timeout" and "not started" in x.detail for x in rest)
        assert p.counters["not_started"] == n - 4 and p.counters["timeouts"] == 1
        fds.append(_release(f))
        assert p.idle(GUARD_S)
        f.unlink()
        f.write_text("0\n")
        p.over, p.deadline_s = None, GUARD_S
        s2, p2 = p.poll()
        assert p2 == [] and len(s2) == n + 2  # one sample a read, + module_temp_crit_c and aer_correctable_dll
    finally:
        _finish(p, [], fds)


def test_a_hung_read_that_returns_is_read_again_in_a_later_poll(tmp_path):
    _tree(tmp_path, "clean")
    f = _fifo(tmp_path, f"{IB0}/counters/symbol_error")
    p = CounterPoller(ct.rail_sources(HOST)[:1], [], root=tmp_path, workers=2, deadline_s=GUARD_S, stall_s=STALL_S,
                      over=_all_but(1))
    fds: list[int] = []
    try:
        _, p1 = p.poll()
        assert [(x.counter, x.problem) for x in p1] == [("symbol_error", "timeout")]
        fds.append(_release(f))  # the hung read returns 9 (its poll is over: not counted) ...
        f.unlink()
        f.write_text("11\n")     # ... and the file now reads 11
        assert p.idle(GUARD_S)
        p.over = None
        s2, p2 = p.poll()
        assert p2 == []
        assert {s.counter: s.value for s in s2}["symbol_error"] == 11
    finally:
        _finish(p, [], fds)


def test_a_stuck_read_that_returns_before_the_deadline_counts(tmp_path):
    """The read in the middle hangs; once the poll has handed the rest to another reader, the
    hung one is let go: it is back before the deadline, so it is a sample, not a timeout."""
    _tree(tmp_path, "clean")
    f = _fifo(tmp_path, f"{IB0}/counters/port_rcv_errors")  # read 3
    fds: list[int] = []

    def over(pp):
        if pp.stalls and pp.started > 4 and not fds:
            fds.append(_release(f))
        return pp.returned == pp.n  # every read back, the released one included
    p = CounterPoller(ct.rail_sources(HOST)[:1], [], root=tmp_path, workers=2, deadline_s=GUARD_S, stall_s=STALL_S,
                      over=over)
    try:
        samples, problems = p.poll()
        assert problems == []
        assert {s.counter: s.value for s in samples}["port_rcv_errors"] == 9
    finally:
        _finish(p, [], fds)


def test_a_hung_nvml_call_is_a_timeout():
    nv = FakeNvml({0: [{"ecc_corrected": "hang"}]})
    p = CounterPoller([], [GpuSource(0)], root="/nonexistent", nvml=nv, deadline_s=GUARD_S, over=_all_but(1))
    try:
        _, problems = p.poll()
        assert [(x.subject, x.problem) for x in problems] == [(0, "timeout")]
        assert "NVML GPU 0: no answer" in problems[0].detail
        _, problems = p.poll()
        assert [(x.subject, x.problem) for x in problems] == [(0, "timeout")]
        assert "an earlier call has not returned" in problems[0].detail
    finally:
        nv.release()
        assert p.idle(GUARD_S)
        p.close()


def test_the_cached_plan_picks_up_a_counter_file_that_appears_later(tmp_path):
    """The plan is kept between polls and made again every replan_polls polls (a hw_counters
    file that appears is read from then on) and after a read found a file gone (an
    hw_counters file that goes is no counter and no problem, as when it never was)."""
    _tree(tmp_path, "clean")
    hw = tmp_path / IB0 / "hw_counters"
    (hw / "out_of_sequence").unlink()
    p = CounterPoller(ct.rail_sources(HOST)[:1], [], root=tmp_path, replan_polls=2, clock=lambda: 1)
    try:
        s1, p1 = p.poll()
        assert p1 == [] and ("rail", 0, "out_of_sequence") not in _keys(s1)
        (hw / "out_of_sequence").write_text("5\n")
        p.poll()
        s3, p3 = p.poll()  # the plan is due again
        assert p3 == [] and {s.counter: s.value for s in s3}["out_of_sequence"] == 5
        assert p.counters["plans"] == 2
        (hw / "packet_seq_err").unlink()
        s4, p4 = p.poll()
        assert p4 == [] and ("rail", 0, "packet_seq_err") not in _keys(s4)
        s5, p5 = p.poll()  # planned again after the file went
        assert p5 == [] and _keys(s5) == _keys(s4) and p.counters["plans"] == 3
    finally:
        p.close()


def test_malformed_and_truncated_files_are_garbage_in_a_later_poll_too(tmp_path):
    """Bad text in files read before (the cached plan, the hwmon channel found before) is
    garbage, and reads well again once fixed."""
    _tree(tmp_path, "clean")
    p = CounterPoller(ct.rail_sources(HOST), [], root=tmp_path, clock=lambda: 1)
    try:
        s1, p1 = p.poll()
        assert p1 == []
        (tmp_path / IB0 / "counters/symbol_error").write_text("12a\n")
        (tmp_path / IB0 / "hw_counters/out_of_sequence").write_bytes(b"\xff\xfe\n")
        (tmp_path / "sys/class/net/ibp42s0/statistics/rx_crc_errors").write_text("")
        (tmp_path / "sys/bus/pci/devices/0000:1a:00.0/aer_dev_correctable").write_text(ct.aer_text(
            "aer_dev_correctable", "truncated"))
        (tmp_path / "sys/class/net/ens3np0/device/hwmon/hwmon0/temp2_input").write_text("4a\n")
        s2, p2 = p.poll()
        assert sorted((x.subject, x.counter, x.problem) for x in p2) == [
            (0, "aer_correctable", "garbage"), (0, "out_of_sequence", "garbage"), (0, "symbol_error", "garbage"),
            (1, "rx_crc_errors", "garbage"), (2, "module_temp_c", "garbage")]
        assert "no TOTAL_ERR_COR" in next(x.detail for x in p2 if x.counter == "aer_correctable")
        assert "temp2_input" in next(x.detail for x in p2 if x.counter == "module_temp_c")
        ct.write_step(tmp_path, HOST, SPEC["sequences"]["clean"], 0)
        s3, p3 = p.poll()
        assert p3 == [] and _keys(s3) == _keys(s1)
    finally:
        p.close()


def test_from_topology_matches_rails_to_hca_ports():
    from topology.model import Gpu, Nic, Port, Topology
    topo = Topology(nics=[Nic("mlx5_0", pci_bus_id="0000:1a:00.0", ports=[Port(1, netdev="ibp26s0")], kind="rdma"),
                          Nic("eno1", pci_bus_id="0000:03:00.0", netdevs=["eno1"], kind="ethernet")],
                    gpus=[Gpu(index=0, pci_bus_id="0000:1b:00.0"), Gpu(index=None, pci_bus_id="0000:99:00.0")])
    p = CounterPoller.from_topology({0: "ibp26s0", 1: "eno1", 2: "missing0"}, topo, root="/nonexistent")
    try:
        assert p.rails == [RailSource(0, "ibp26s0", "mlx5_0", 1, "0000:1a:00.0"),
                           RailSource(1, "eno1", None, None, "0000:03:00.0"), RailSource(2, "missing0")]
        assert p.gpus == [GpuSource(0, "0000:1b:00.0")]
    finally:
        p.close()


# -- the fixture sequences end to end


def run_sequence(tmp_path, name):
    """-> (verdicts as (step, verdict), problems, sequence)."""
    seq = SPEC["sequences"][name]
    ct.build_host(tmp_path, HOST)
    nv = FakeNvml(ct.nvml_steps(seq, HOST))
    clock = [0]
    p = CounterPoller(ct.rail_sources(HOST), ct.gpu_sources(HOST), root=tmp_path, nvml=nv, clock=lambda: clock[0])
    tr = RiskTracker()
    verdicts, problems = [], []
    written: dict = {}
    try:
        for n in range(seq["steps"]):
            clock[0] = int(n * seq["interval_s"] * S)
            ct.write_step(tmp_path, HOST, seq, n, written)
            nv.n = n
            samples, probs = p.poll()
            v, pr = tr.observe([*samples, *probs], clock[0])
            verdicts += [(n, x) for x in v]
            problems += pr
    finally:
        p.close()
    return verdicts, problems, seq


@pytest.mark.parametrize("name", sorted(SPEC["sequences"]))
def test_fixture_sequence_flags_what_it_should_before_the_failure(tmp_path, name):
    verdicts, _, seq = run_sequence(tmp_path, name)
    flagged = [(n, (x.kind, x.subject)) for n, x in verdicts if x.at_risk]
    assert sorted({s for _, s in flagged}) == sorted(tuple(e) for e in seq["expect_at_risk"])
    if seq["failure"]:
        f = seq["failure"]
        first = min(n for n, s in flagged if s == (f["kind"], f["subject"]))
        assert first < f["step"]


def test_reset_sequence_reports_each_reset_once(tmp_path):
    _, problems, _ = run_sequence(tmp_path, "reset_after_driver_reload")
    resets = sorted(x.counter for x in problems if x.problem == "reset")
    assert resets == ["aer_correctable", "link_downed", "port_rcv_errors", "symbol_error"]
    vanished = [x for x in problems if x.problem == "vanished"]
    assert vanished and len({(x.kind, x.subject, x.counter) for x in vanished}) == len(vanished)


def test_wrap_sequence_reports_the_wrap(tmp_path):
    _, problems, _ = run_sequence(tmp_path, "wrap_32bit_hw_counter")
    assert [(x.counter, x.problem) for x in problems] == [("local_ack_timeout_err", "wrap")]


def test_garbage_sequence_reports_each_bad_source_once(tmp_path):
    _, problems, _ = run_sequence(tmp_path, "garbage_and_truncated")
    assert sorted((x.kind, x.subject, x.counter, x.problem) for x in problems) == [
        ("gpu", 0, "aer_correctable", "garbage"), ("rail", 0, "symbol_error", "garbage"),
        ("rail", 1, "port_rcv_errors", "vanished"), ("rail", 2, "carrier_changes", "garbage")]


def _hwmon(tmp_path):
    _tree(tmp_path, "clean")
    return tmp_path / "sys/devices/pci0000:37/0000:37:01.0/0000:3a:00.0/hwmon/hwmon0"


def _rail2(tmp_path):
    p = CounterPoller([ct.rail_sources(HOST)[2]], [], root=tmp_path, clock=lambda: 1)
    try:
        return p.poll()
    finally:
        p.close()


def test_module_temperature_is_the_mlx5_module_sensor(tmp_path):
    hw = _hwmon(tmp_path)
    (hw / "temp2_input").write_text("61125\n")  # MTMP units of 0.125 degC * 125 = millidegrees
    samples, problems = _rail2(tmp_path)
    got = {s.counter: s for s in samples}
    assert problems == []
    assert got["module_temp_c"].value == 61.125
    assert got["module_temp_c"].source == "/sys/class/net/ens3np0/device/hwmon/hwmon0/temp2_input"
    assert got["module_temp_crit_c"].value == 75.0


def test_no_module_sensor_means_no_module_sample(tmp_path):
    hw = _hwmon(tmp_path)
    (hw / "temp2_label").write_text("sensor1\n")  # an ASIC sensor: the firmware found no module
    samples, problems = _rail2(tmp_path)
    assert problems == [] and not [s for s in samples if s.counter.startswith("module_temp")]


def test_garbage_module_temperature_is_a_problem(tmp_path):
    hw = _hwmon(tmp_path)
    (hw / "temp2_input").write_text("4a\n")
    samples, problems = _rail2(tmp_path)
    assert [(x.counter, x.problem) for x in problems] == [("module_temp_c", "garbage")]
    assert "temp2_input" in problems[0].detail


def test_a_device_without_aer_reporting_has_no_aer_counter_and_no_problem(tmp_path):
    _tree(tmp_path, "clean")
    d = tmp_path / "sys/devices/pci0000:17/0000:17:02.0/0000:1b:00.0"
    for f in ("aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal"):
        (d / f).unlink()
    p = CounterPoller([], [GpuSource(0, "0000:1b:00.0")], root=tmp_path, clock=lambda: 1)
    try:
        samples, problems = p.poll()
    finally:
        p.close()
    assert samples == [] and problems == []


def test_aer_dll_lines_are_counted_at_the_device_and_its_ports(tmp_path):
    _tree(tmp_path, "clean")
    base = tmp_path / "sys/devices/pci0000:17/0000:17:02.0"
    (base / "aer_dev_correctable").write_text(AER_COR)                  # BadTLP 1 + Timeout 3, total 4
    (base / "0000:1b:00.0" / "aer_dev_correctable").write_text(AER_COR.replace("RxErr 0", "RxErr 2")
                                                                .replace("TOTAL_ERR_COR 4", "TOTAL_ERR_COR 6"))
    p = CounterPoller([], [GpuSource(0, "0000:1b:00.0")], root=tmp_path, clock=lambda: 1)
    try:
        samples, problems = p.poll()
    finally:
        p.close()
    got = {s.counter: s.value for s in samples}
    assert problems == [] and got["aer_correctable"] == 10 and got["aer_correctable_dll"] == 8
