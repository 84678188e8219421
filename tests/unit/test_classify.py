"""linkpass.core.classify and linkpass.core.logparse: the corpus (tests/fixtures/corpus, a copy of
../shared/corpus with each file's `source:` line), every timestamp format, and the linking rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from linkpass.core.classify import (
    ACTIONS,
    DOMAINS,
    REMEDIES,
    XID_CATALOG,
    classify,
    classify_report,
    classify_text,
    xid_reading,
)
from linkpass.core.logparse import parse_lines, strip_prefixes

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
LOGS = sorted(k for k, v in EXPECTED.items() if v.get("kind") == "log")
ROOT_FIELDS = ("domain", "device", "action")
FIELDS = ("domain", "device", "code", "action", "remedy", "secondary_of")


def corpus_lines(rel: str) -> list[str]:
    return (CORPUS / rel).read_text(encoding="utf-8", errors="replace").splitlines()


def roots(incidents: list[dict]) -> list[dict]:
    return [{k: i[k] for k in ROOT_FIELDS} for i in incidents if i["secondary_of"] is None]


def test_every_log_in_the_corpus_is_copied_with_its_source_line():
    on_disk = sorted(f"{d}/{p.name}" for d in ("kernel_logs", "nccl_errors") for p in (CORPUS / d).iterdir())
    assert on_disk == LOGS and len(LOGS) == 34
    for rel in LOGS:
        assert corpus_lines(rel)[0].startswith("# source: "), rel


@pytest.mark.parametrize("rel", LOGS)
def test_corpus_root_incidents(rel):
    """The issue's target: root incidents (domain, device, action) as expected.json says."""
    got = [i.to_json() for i in classify(corpus_lines(rel))]
    assert roots(got) == roots(EXPECTED[rel]["incidents"])


@pytest.mark.parametrize("rel", LOGS)
def test_corpus_full_reading(rel):
    """Every incident, secondaries included, with code, remedy and the link to its root."""
    got = [{k: i.to_json()[k] for k in FIELDS} for i in classify(corpus_lines(rel))]
    assert got == [{k: i[k] for k in FIELDS} for i in EXPECTED[rel]["incidents"]]


@pytest.mark.parametrize("rel", LOGS)
def test_incident_shape(rel):
    lines = corpus_lines(rel)
    incs = classify(lines)
    for n, i in enumerate(incs):
        j = i.to_json()
        assert list(j) == ["domain", "device", "code", "action", "remedy", "secondary_of", "first_line", "last_line", "known"]
        assert j["known"] is True
        assert j["domain"] in DOMAINS and j["action"] in ACTIONS and j["remedy"] in REMEDIES
        assert 1 <= j["first_line"] <= j["last_line"] <= len(lines)
        if j["secondary_of"] is not None:
            assert incs[j["secondary_of"]].secondary_of is None and j["secondary_of"] != n
    json.dumps([i.to_json() for i in incs])


def test_line_numbers_point_at_the_evidence():
    lines = corpus_lines("kernel_logs/akash209_xid79_fallen_off_bus_crash_dump.log")
    (inc,) = classify(lines)
    # the nvidia-smi handle error at the top belongs to the same lost GPU
    assert "Unable to determine the device handle" in lines[inc.first_line - 1]
    assert "GPU 0000:a1:00.0: GPU has fallen off the bus" in lines[inc.last_line - 1]


def test_xid_table_is_the_catalog():
    text = (CORPUS / "xid_catalog" / "nvsentinel_xiderrorsmapping.csv").read_text()
    rows = [r.split(",") for r in text.splitlines() if r and not r.startswith("#")]
    assert {int(r[0]) for r in rows} == set(XID_CATALOG)
    for r in rows:
        assert XID_CATALOG[int(r[0])][0] == (r[1].strip() or "(unnamed)")
    assert xid_reading(79) == ("gpu", "migrate-rank", "reboot-node")
    assert xid_reading(13) == ("app", "none", "none")
    assert xid_reading(74)[0] == xid_reading(149)[0] == "nvlink"
    assert xid_reading(9999) == ("gpu", "none", "observe")


# --- timestamp formats ---------------------------------------------------------------------------

XID79 = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FORMATS = {
    "raw": ("[6781741.548779] " + XID79, 6781741.548779, "mono"),
    "raw-no-bracket": (" 6781741.548779] " + XID79, 6781741.548779, "mono"),
    "ctime": ("[Fri Apr  5 21:29:39 2024] " + XID79, 1712352579.0, "wall"),
    "iso": ("2024-04-05T21:29:39,500000+00:00 " + XID79, 1712352579.5, "wall"),
    "iso-offset": ("2024-04-05T23:29:39,500000+02:00 " + XID79, 1712352579.5, "wall"),
    "decode-iso": ("kern  :warn  : 2024-04-05T21:29:39,500000+00:00 " + XID79, 1712352579.5, "wall"),
    "journal": ("Apr 05 21:29:39 host kernel: " + XID79, None, "wall-noyear"),
    "journal-precise": ("Apr 05 21:29:39.250000 host kernel: " + XID79, None, "wall-noyear"),
    "syslog-with-raw": ("Apr  5 21:29:39 worker4 kernel: [240314.528856] " + XID79, None, "wall-noyear"),
    "short-iso": ("2024-04-05T21:29:39+0000 host kernel: " + XID79, 1712352579.0, "wall"),
    "kmsg": ("3,1234,6781741548779,-;" + XID79, 6781741.548779, "mono"),
    "talos": ("10.0.0.1: kern: warning: [2024-04-05T21:29:39.5Z]: " + XID79, 1712352579.5, "wall"),
    "bare": (XID79, None, None),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_timestamp_formats(name):
    line, ts, clock = FORMATS[name]
    msg, got_ts, got_clock = strip_prefixes(line)
    assert msg == XID79
    assert got_clock == clock
    if ts is not None:
        assert got_ts == pytest.approx(ts)
    (inc,) = classify([line])
    assert (inc.domain, inc.device, inc.code, inc.action) == ("gpu", "0000:91:00.0", "xid:79", "migrate-rank")


def test_kmsg_dictionary_lines_belong_to_the_record():
    p = parse_lines(["6,1,100,-;mlx5_core 0000:53:00.0 enp83s0f0np0: Link down", " SUBSYSTEM=pci", " DEVICE=+pci:0000:53:00.0"])
    assert len(p.records) == 1 and p.records[0].last_line == 3 and p.skipped == []


def test_multi_line_nvrm_message_is_joined():
    lines = ["[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
             "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
             "               NVRM: fallen off the bus and is not responding to commands."]
    p = parse_lines(lines)
    assert len(p.records) == 1 and p.records[0].msg.endswith("not responding to commands.")
    (inc,) = classify(lines)
    assert (inc.code, inc.device, inc.first_line, inc.last_line) == ("nvrm:fallen_off_bus", "0000:b3:00.0", 1, 3)
    # without the join there is nothing to read
    assert classify(lines[1:]) == []


def test_unreadable_lines_are_skipped_and_counted():
    r = classify_report(["\x00\x01garbage", b"\xff\xfe\xfd", "[  1.0] " + XID79, 42, ""])
    assert r.skipped == [1, 2, 4] and r.lines == 5 and len(r.incidents) == 1
    assert classify_text(b"\x00" * 100) == []


# --- rules on small inputs -----------------------------------------------------------------------

def codes(incs):
    return [(i.code, i.domain, i.action, i.secondary_of) for i in incs]


def test_repeats_collapse_and_count():
    incs = classify(["[1.0] " + XID79] * 5)
    assert len(incs) == 1 and incs[0].count == 5 and (incs[0].first_line, incs[0].last_line) == (1, 5)


def test_xid45_links_to_the_named_cause_even_when_printed_first():
    incs = classify([
        "[10.0] NVRM: Xid (PCI:0000:48:00): 45, pid=1, name=w, channel 0x10 caused by previous Xid 74",
        "[10.1] NVRM: Xid (PCI:0000:48:00): 74, pid=1, name=w, NVLink: fatal error detected on link 8",
    ])
    assert codes(incs) == [("xid:74", "nvlink", "migrate-rank", None), ("xid:45", "nvlink", "none", 0)]


def test_xid45_alone_is_an_app_event():
    (inc,) = classify(["[10.0] NVRM: Xid (PCI:0000:48:00): 45, pid=1, name=w, Ch 00000010"])
    assert (inc.domain, inc.action, inc.secondary_of) == ("app", "none", None)


def test_xid154_alone_reads_the_recovery_action():
    (inc,) = classify(["NVRM: Xid (PCI:0000:48:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"])
    assert (inc.domain, inc.action, inc.remedy) == ("gpu", "migrate-rank", "reboot-node")


def test_sxid_before_a_lost_gpu_is_its_own_root_and_after_it_a_secondary():
    sx = "[20.0] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"
    after = classify(["[10.0] " + XID79, sx])
    assert codes(after) == [("xid:79", "gpu", "migrate-rank", None), ("sxid:20034", "nvlink", "none", 0)]
    alone = classify([sx])
    assert codes(alone) == [("sxid:20034", "nvlink", "migrate-rank", None)]
    # far apart in time: unrelated
    late = classify(["[10.0] " + XID79, "[5000.0]" + sx[6:]])
    assert [i.secondary_of for i in late] == [None, None]


def test_flush_after_retry_exceeded_is_secondary():
    incs = classify([
        "h:1:2 [0] NCCL WARN NET/IB : Got completion from peer 1.2.3.4<5> with status=12 opcode=0 len=0 vendor err 129 (Recv)",
        "h:1:2 [0] NCCL WARN NET/IB : Got completion from peer 1.2.3.4<5> with status=5 opcode=0 len=0 vendor err 249 (Recv)",
    ])
    assert codes(incs) == [("ibv_wc:12", "unattributed", "none", None), ("ibv_wc:5", "unattributed", "none", 0)]


def test_flush_alone_points_at_config():
    (inc,) = classify(["NCCL WARN NET/IB : Got completion from peer x<1> with status=5 opcode=0 len=0 vendor err 249"])
    assert (inc.domain, inc.remedy) == ("config", "check-config")


def test_retry_exceeded_is_attributed_when_the_kernel_names_the_nic():
    nccl = "NCCL WARN NET/IB : Got completion from peer x<1> with status=12 opcode=0 len=0 vendor err 129 (Recv) hca mlx5_3"
    kern = ["[100.0] mlx5_core 0000:53:00.0 enp83s0f0np0: Link up",
            "[200.0] mlx5_core 0000:53:00.0 mlx5_3: Port: 1 Link DOWN"]
    incs = classify(kern + [nccl])
    assert codes(incs) == [("mlx5:link_down", "nic-link", "reroute", None), ("ibv_wc:12", "nic-link", "none", 0)]
    assert incs[0].device == "mlx5_3/1"
    # the NCCL log first and the kernel log after it (two files of one host): still attributed
    incs = classify([nccl] + kern)
    assert [i.code for i in incs] == ["mlx5:link_down", "ibv_wc:12"] and incs[1].secondary_of == 0


def test_generic_nccl_symptom_is_secondary_of_a_gpu_fault():
    incs = classify(["[1.0] " + XID79,
                     "[E ProcessGroupNCCL.cpp:455] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
                     "OpType=ALLREDUCE) ran for 600005 milliseconds before timing out."])
    assert codes(incs) == [("xid:79", "gpu", "migrate-rank", None), ("nccl:watchdog_timeout", "gpu", "none", 0)]
    (alone,) = classify(["[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)"])
    assert (alone.domain, alone.action, alone.remedy) == ("unattributed", "none", "observe")


def test_boot_time_port_bringup_is_benign():
    (inc,) = classify(["Feb 14 05:03:41 h kernel: mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link INIT",
                       "Feb 14 05:03:41 h kernel: mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE"])
    assert (inc.domain, inc.code, inc.device, inc.last_line) == ("benign", "mlx5:port_init", "mlx5_5/1", 2)


def test_active_then_init_is_a_link_fault():
    incs = classify(["[1.0] mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE",
                     "[9.0] mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link INIT"])
    assert codes(incs) == [("mlx5:link_down", "nic-link", "reroute", None)]


def test_link_down_right_after_probe_is_benign_but_a_lone_one_is_a_fault():
    probe = "[5.0] mlx5_core 0000:9d:00.0: firmware version: 22.38.1002"
    down = "[40.0] mlx5_core 0000:9d:00.0 enp157s0f0np0: Link down"
    assert codes(classify([probe, down])) == [("mlx5:link_down", "benign", "none", None)]
    (inc,) = classify([down])
    assert (inc.domain, inc.action, inc.remedy) == ("nic-link", "reroute", "replace-part")
    # down and back up once: reroute, and only watch it
    (inc,) = classify([down, "[41.0] mlx5_core 0000:9d:00.0 enp157s0f0np0: Link up"])
    assert (inc.domain, inc.remedy) == ("nic-link", "observe")


def test_driver_unload_makes_port_down_benign():
    incs = classify(["[500.0] mlx5_core 0000:53:00.0: E-Switch: cleanup",
                     "[500.1] mlx5_core 0000:53:00.0 mlx5_3: Port: 1 Link DOWN"])
    assert codes(incs) == [("mlx5:link_down", "benign", "none", None)]


class _Port:
    def __init__(self, port, netdev):
        self.port, self.netdev = port, netdev


class _Nic:
    def __init__(self, name, bus, role, netdev):
        self.name, self.pci_bus_id, self.role, self.netdevs = name, bus, role, [netdev]
        self.ports = [_Port(1, netdev)]


class _Topo:
    def __init__(self, *nics):
        self.nics = list(nics)


def test_topology_decides_which_ports_can_have_a_link_fault():
    flap = ["[100.0] mlx5_core 0000:53:00.0 enp83s0f0np0: Link up",
            "[200.0] mlx5_core 0000:53:00.0 enp83s0f0np0: Link down"]
    compute = _Topo(_Nic("mlx5_3", "0000:53:00.0", "compute", "enp83s0f0np0"))
    front = _Topo(_Nic("mlx5_3", "0000:53:00.0", "front-end", "enp83s0f0np0"))
    (c,) = classify(flap, compute)
    (f,) = classify(flap, front)
    assert (c.domain, c.action, c.device) == ("nic-link", "reroute", "mlx5_3/1")
    assert (f.domain, f.action) == ("benign", "none")
    # a boot-time down on a compute rail is still a missing rail
    boot = ["[5.0] mlx5_core 0000:53:00.0: firmware version: 28.39.1002", "[40.0] mlx5_core 0000:53:00.0 enp83s0f0np0: Link down"]
    assert classify(boot, compute)[0].domain == "nic-link"
    assert classify(boot)[0].domain == "benign"


def test_topology_from_the_corpus_marks_ethernet_functions_benign():
    """hgx boot log + an ibdev2netdev capture: still no compute-rail fault."""
    from topology.affinity import analyse
    from topology.importers import parse_file

    topo = analyse(parse_file(CORPUS / "ib_tools" / "dgxh100_like_ibdev2netdev_8ib_3eth.txt"))
    incs = classify(corpus_lines("kernel_logs/gpud_hgx_h100_boot_mlx5_enumeration_ports_down.log"), topo)
    assert incs and all(i.domain == "benign" and i.action == "none" for i in incs)


def test_port_error_on_a_named_non_compute_nic_is_benign():
    line = "NCCL WARN NET/IB : mlx5_3:1 Got async event : port error"
    (inc,) = classify([line], _Topo(_Nic("mlx5_3", "0000:53:00.0", "storage", "enp83s0f0np0")))
    assert inc.domain == "benign"
    (inc,) = classify([line])
    assert (inc.domain, inc.device, inc.action) == ("nic-link", "mlx5_3/1", "reroute")
