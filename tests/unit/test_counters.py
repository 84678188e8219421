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


def _all_but(n_hung: int):
    """A poll's wait that returns once every read but ``n_hung`` has finished: the deadline
    passing, as an event (no wall-clock bound for the healthy reads to meet).  A read that
    hangs where none should only ends the wait after a minute, so the test fails, not hangs."""
    import concurrent.futures as cf

    def wait(fs, timeout=None):
        fs = set(fs)
        done: set = set()
        while len(fs) - len(done) > n_hung:
            got, _ = cf.wait(fs - done, timeout=60, return_when=cf.FIRST_COMPLETED)
            if not got:
                break
            done |= got
        return done, fs - done
    return wait


def test_a_hung_sysfs_read_is_a_timeout_and_is_skipped_until_it_returns(tmp_path):
    """A FIFO in place of a counter file blocks open() like a PMA read the firmware never
    answers; the poll returns at its deadline (here: once every other read is done) with a
    timeout problem; the second poll skips the hung path without waiting for it."""
    _tree(tmp_path, "clean")
    f = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error"
    f.unlink()
    os.mkfifo(f)
    p = CounterPoller(ct.rail_sources(HOST)[:1], [], root=tmp_path, workers=2, wait=_all_but(1))
    try:
        s1, p1 = p.poll()
        p.wait = _all_but(0)  # the hung read is skipped, not submitted again: nothing else may hang
        s2, p2 = p.poll()
        assert [(x.counter, x.problem) for x in p1] == [("symbol_error", "timeout")]
        assert [(x.counter, x.problem) for x in p2] == [("symbol_error", "timeout")]
        assert "has not returned" in p2[0].detail
        assert ("rail", 0, "link_downed") in {(s.kind, s.subject, s.counter) for s in s1 + s2}
    finally:
        fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)  # releases the blocked reader
        os.write(fd, b"9\n")
        os.close(fd)
        p.close()


def test_a_hung_nvml_call_is_a_timeout():
    nv = FakeNvml({0: [{"ecc_corrected": "hang"}]})
    p = CounterPoller([], [GpuSource(0)], root="/nonexistent", nvml=nv, wait=_all_but(1))
    try:
        _, problems = p.poll()
        assert [(x.subject, x.problem) for x in problems] == [(0, "timeout")]
    finally:
        nv.release()
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
