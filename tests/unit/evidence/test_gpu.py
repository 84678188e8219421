"""GPU evidence (linkpass.core.evidence.gpu): lines written from the producers' format strings
(NVIDIA open-gpu-kernel-modules: kernel_rc.c krcReportXid_IMPL, kern_gpu_error_cont_ga100.c,
gpu.c's Xid 154, osinit.c / osapi.c "fallen off the bus", nv-tracepoint.h, nvswitch
common_nvswitch.h / intr_nvswitch.h / error_nvswitch.c) and the Xid catalog's buckets."""

from __future__ import annotations

from pathlib import Path

import pytest

from linkpass.core.classify import classify, classify_report, classify_text
from linkpass.core.evidence import gpu
from linkpass.core.evidence.gpu import (XID_BUCKETS, XID_CATALOG, XID_CATALOG_LATER, XID_DRIVER_ONLY, sxid_known,
                                        xid_entry, xid_known, xid_line_reading, xid_reading)

CSV = Path(__file__).resolve().parents[2] / "fixtures" / "corpus" / "xid_catalog" / "nvsentinel_xiderrorsmapping.csv"

PREFIXES = {
    "none": "",
    "dmesg": "[171167.620236] ",
    "dmesg-T": "[Wed Apr 15 07:56:59 2026] ",
    "syslog": "Apr 15 07:56:59 gpu-node-17 kernel: ",
    "journal-iso": "2026-04-15T07:56:59.123456+00:00 gpu-node-17 kernel: ",
}
BUSES = [(0x0000, 0x07, 0x00), (0x0009, 0x01, 0x00), (0x000F, 0x01, 0x00), (0x0000, 0xCB, 0x00), (0x0000, 0x3B, 0x1C)]


def pci(dom: int, bus: int, dev: int) -> str:
    """kernel_rc.c's "PCI:%04x:%02x:%02x"."""
    return f"PCI:{dom:04x}:{bus:02x}:{dev:02x}"


def full(dom: int, bus: int, dev: int) -> str:
    return f"{dom:04x}:{bus:02x}:{dev:02x}.0"


def xid_line(b, xid: int, msg: str, pid: int | None = 4242, name: str = "python3", attr: str = "") -> str:
    """XID_PRINT_WITH_ATTR: with a process "... %d, pid=%s, name=%s, %s%s", without "... %d, %s%s"."""
    head = f"NVRM: Xid ({pci(*b)}{attr}): {xid}, "
    return head + (f"pid={pid}, name={name}, {msg}" if pid is not None else msg)


def one(lines):
    got = classify(lines)
    assert len(got) == 1, [i.to_json() for i in got]
    return got[0]


def reading(inc):
    return inc.domain, inc.action, inc.remedy


# --- the catalog as data --------------------------------------------------------------------


def test_every_published_xid_has_a_catalog_row_and_bucket():
    # the catalog page lists Xids 1-172; the driver's nverror.h goes on to 176
    assert set(XID_CATALOG) | set(XID_CATALOG_LATER) == set(range(1, 173))
    assert set(XID_DRIVER_ONLY) == set(range(173, 177))
    for n in range(1, 173):
        mnemonic, immediate, _ = xid_entry(n)
        assert mnemonic and immediate in XID_BUCKETS, n
        assert xid_known(n)


def test_catalog_buckets_agree_with_nvsentinel_copy_but_where_the_page_differs():
    rows = [r.split(",") for r in CSV.read_text().splitlines() if r and not r.startswith("#")]
    alias = {"UNEXPECTED_ERR_REPORT_ISSUE": "CONTACT_SUPPORT"}
    differs = {n for n, (_, imm, _) in XID_CATALOG.items()
               for r in rows if int(r[0]) == n and alias.get(r[2].strip(), r[2].strip()) != imm}
    # 108/160: IGNORE on the page; 154: XID_154; 162: no bucket on the page
    assert differs == {108, 154, 160, 162}


@pytest.mark.parametrize("xid,expected", [
    (13, ("app", "none", "none")),          # RESTART_APP
    (37, ("app", "none", "none")),          # IGNORE, investigate CHECK_APP/CUDA
    (38, ("gpu", "none", "observe")),       # IGNORE, CONTACT_SUPPORT: a driver firmware error
    (43, ("app", "none", "none")),
    (106, ("gpu", "none", "none")),         # IGNORE / IGNORE (SMBPBI test message)
    (137, ("app", "none", "none")),         # XID_137_FLOW: application-level bugs
    (160, ("gpu", "none", "observe")),
    (46, ("gpu", "migrate-rank", "reset-gpu")),
    (79, ("gpu", "migrate-rank", "reboot-node")),
    (151, ("gpu", "migrate-rank", "reboot-node")),
    (78, ("config", "none", "check-config")),
    (74, ("nvlink", "migrate-rank", "reset-gpu")),
    (147, ("nvlink", "migrate-rank", "reset-gpu")),
    (163, ("gpu", "none", "observe")),      # no bucket published yet
    (168, ("gpu-memory", "none", "check-config")),
    (171, ("gpu", "migrate-rank", "reset-gpu")),
    (4711, ("gpu", "none", "observe")),
])
def test_bucket_readings(xid, expected):
    assert xid_reading(xid) == expected


def test_sxid_numbers_from_the_driver_enum():
    assert sxid_known(20034) and sxid_known(10000) and sxid_known(19084) and sxid_known(30006)
    assert not sxid_known(19085) and not sxid_known(31000) and not sxid_known(999)


# --- NVRM Xid lines ---------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", list(PREFIXES.values()), ids=list(PREFIXES))
@pytest.mark.parametrize("b", BUSES)
def test_xid_line_any_prefix_any_bus(prefix, b):
    inc = one([prefix + xid_line(b, 109, "channel 0x00000007, errorString CTX SWITCH TIMEOUT, Info 0x74007")])
    assert (inc.code, inc.device, reading(inc), inc.known) == ("xid:109", full(*b), ("gpu", "migrate-rank", "reset-gpu"), True)


def test_xid_line_without_process_and_with_empty_message():
    b = (0, 0x5A, 0)
    inc = one([xid_line(b, 79, "GPU has fallen off the bus.", pid=None)])
    assert (inc.code, inc.device, reading(inc)) == ("xid:79", "0000:5a:00.0", ("gpu", "migrate-rank", "reboot-node"))
    inc = one([xid_line(b, 62, "", pid=None) + "\n"])  # pMsg NULL: "...: 62, " and nothing after
    assert (inc.code, reading(inc)) == ("xid:62", ("gpu", "migrate-rank", "reset-gpu"))


def test_old_and_tracepoint_formats():
    inc = one(["NVRM: Xid (0000:03:00): 14, Channel 00000001"])  # the catalog page's example
    assert (inc.code, inc.device, inc.domain) == ("xid:14", "0000:03:00.0", "benign")
    inc = one(["  python3-9911  [012] d..1. 5120.331: nvidia_dev_xid: Xid (PCI:0000:91:00.0): 48, An uncorrectable double bit error"])
    assert (inc.code, inc.device, reading(inc)) == ("xid:48", "0000:91:00.0", ("gpu", "migrate-rank", "reset-gpu"))


def test_elided_pci_id_still_reads_the_xid():
    for elided in ("PCI:...", "PCI:<bus>", "PCI:XXXX:XX:XX", "..."):
        inc = one([f"[ 77.1] NVRM: Xid ({elided}): 79, pid=1234, name=python, GPU has fallen off the bus."])
        assert (inc.code, inc.device, reading(inc)) == ("xid:79", None, ("gpu", "migrate-rank", "reboot-node"))


@pytest.mark.parametrize("attr", [" GPU-I:05", " GPU-I:05 GPU-CI:01", " GPU-I:13 GPU-CI:00"])
def test_mig_attribution(attr):
    b = (0, 0x01, 0)
    inc = one([xid_line(b, 94, "Contained: CE User Channel (0x9). RST: No, D-RST: No", pid=7194, attr=attr)])
    assert (inc.code, inc.device, reading(inc)) == ("xid:94", "0000:01:00.0", ("app", "none", "observe"))


@pytest.mark.parametrize("xid,msg,expected", [
    # kern_gpu_error_cont_ga100.c _gpuGenerateErrorLog, one per location type
    (95, "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No", ("gpu", "migrate-rank", "reset-gpu")),
    (95, "Uncontained: FBHUB Poison Error. RST: Yes, D-RST: No", ("gpu", "migrate-rank", "reset-gpu")),
    (95, "Uncontained: LTC Unsupported Client Poison (0x3, 0x0). RST: No, D-RST: No", ("gpu", "none", "observe")),
    (94, "Contained: FB DED in CBC Store (0x1, 0x0). physAddr: 0x2f3a1c000 RST: No, D-RST: Yes", ("gpu", "migrate-rank", "drain-node")),
    (94, "Contained: SM (0x1). RST: No, D-RST: No", ("app", "none", "observe")),
    (95, "Uncontained: LTC TAG (0x2, 0x1).", ("gpu", "migrate-rank", "reset-gpu")),  # no RST words: the bucket
])
def test_containment_rst_and_drain_reset(xid, msg, expected):
    inc = one([xid_line((0, 0x37, 0), xid, msg)])
    assert reading(inc) == expected


def test_repeats_are_one_incident_and_a_worse_repeat_wins():
    b = (0, 0xCA, 0)
    lines = [f"[{100 + i}.5] " + xid_line(b, 95, "Uncontained: LTC Unsupported Client Poison (0x3, 0x0). RST: No, D-RST: No")
             for i in range(3)]
    lines.append("[104.0] " + xid_line(b, 95, "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"))
    inc = one(lines)
    assert inc.count == 4 and reading(inc) == ("gpu", "migrate-rank", "reset-gpu")


def test_ctxsw_timeout_after_fecs_watchdog_at_driver_load():
    b = (0, 0x07, 0)
    lines = ["[ 12.1] NVRM: GPU at PCI:0000:07:00: GPU-00000000-1111-2222-3333-444444444444",
             "[ 12.2] " + xid_line(b, 38, "channel 0x00000003 0000c597 00000000 00000000", pid=326, name="modprobe")]
    lines += ["[ 12.3] " + xid_line(b, 109, "channel 0x00000007, errorString CTX SWITCH TIMEOUT, Info 0x74007",
                                    pid=326, name="modprobe")] * 4
    got = [(i.code, i.device, i.action, i.remedy, i.secondary_of, i.count) for i in classify(lines)]
    assert got == [("xid:38", "0000:07:00.0", "none", "observe", None, 1),
                   ("xid:109", "0000:07:00.0", "migrate-rank", "reset-gpu", None, 4)]
    assert classify(lines)[0].domain == "gpu"


def test_caused_by_previous_xid_links_to_that_xid():
    b, other = (0, 0x48, 0), (0, 0x0B, 0)
    lines = ["[50.0] " + xid_line(b, 74, "NVLink: fatal error detected on link 8(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"),
             "[50.1] " + xid_line(other, 13, "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address"),
             "[50.2] " + xid_line(b, 45, "Ch 00000010 caused by previous Xid 74"),
             "[50.3] " + xid_line(b, 45, "Ch 00000011 caused by previous Xid 74")]
    got = classify(lines)
    by = {i.code: i for i in got}
    assert by["xid:45"].count == 2
    assert got[by["xid:45"].secondary_of].code == "xid:74"
    assert (by["xid:45"].domain, by["xid:45"].action) == ("nvlink", "none")


@pytest.mark.parametrize("to,name,remedy", [
    (1, "GPU Reset Required", "reset-gpu"), (2, "Node Reboot Required", "reboot-node"),
    (3, "Drain P2P", "drain-node"), (4, "Drain and Reset", "drain-node"), (5, "Recover IMEX Domain", "drain-node"),
])
def test_xid_154_recovery_action_sets_the_root_remedy(to, name, remedy):
    b = (0x0019, 0x01, 0)
    lines = ["[9.0] " + xid_line(b, 119, "Timeout after 6s of waiting for RPC response from GPU0 GSP!", pid=None),
             "[9.1] " + xid_line(b, 154, f"GPU recovery action changed from 0x0 (None) to 0x{to:x} ({name})", pid=None)]
    root, sec = classify(lines)
    assert (root.code, root.remedy, sec.code, sec.secondary_of, sec.remedy) == ("xid:119", remedy, "xid:154", 0, remedy)


def test_xid_154_alone_and_by_name_and_unknown_value():
    b = (0, 0x4E, 0)
    inc = one([xid_line(b, 154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", pid=None)])
    assert reading(inc) == ("gpu", "migrate-rank", "reboot-node") and inc.known
    # hex value lost in a paste: the name says it
    inc = one([xid_line(b, 154, "GPU recovery action changed from (None) to (GPU Reset Required)", pid=None)])
    assert inc.remedy == "reset-gpu"
    inc = one([xid_line(b, 154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x9 (Something New)", pid=None)])
    assert inc.known is False and inc.remedy == "observe"


@pytest.mark.parametrize("sev,expected", [
    ("Fatal", ("nvlink", "migrate-rank", "reset-gpu")), ("Nonfatal", ("nvlink", "none", "observe")),
    ("Non-fatal", ("nvlink", "none", "observe")), ("Link Fatal", ("nvlink", "migrate-rank", "reset-gpu")),
])
def test_nvlink5_severity_word(sev, expected):
    # catalog: "Xid (PCI:0000:BB:DF): <Xid Number> <sub component> <fatal vs nonfatal> <Crosscontain> <injected> <link> (...)"
    line = xid_line((0x0008, 0x01, 0), 149, f"NETIR_LINK_EVT  {sev}   XC0 i0 Link 07 (0x021465c6 0x00000000 0x0 0x0 0x0 0x0)", pid=None)
    assert reading(one([line])) == expected


def test_row_remap_with_dbe_on_the_same_gpu_is_drain_and_reset():
    b, o = (0, 0x10, 0x1C), (0, 0x90, 0x1C)
    lines = [xid_line(b, 48, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.", pid=None),
             xid_line(b, 63, "Row Remapper: New row marked for remapping, reset gpu to activate.", pid=None),
             xid_line(o, 48, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 2, subpartition 1.", pid=None)]
    got = classify(lines)
    by = {(i.code, i.device): i for i in got}
    assert by[("xid:48", "0000:10:1c.0")].remedy == "drain-node"
    assert by[("xid:48", "0000:90:1c.0")].remedy == "reset-gpu"
    # the 63 is the same fault's row remap: part of the DBE's incident, which carries the remedy
    assert got[by[("xid:63", "0000:10:1c.0")].secondary_of] is by[("xid:48", "0000:10:1c.0")]
    # on its own, a 63 asks for the reset that activates the remap
    assert reading(one([xid_line(b, 63, "Row Remapper: New row marked for remapping, reset gpu to activate.", pid=None)])) == (
        "gpu-memory", "none", "reset-gpu")


def test_sram_detail_follows_its_dbe():
    b = (0, 0xB3, 0)
    lines = ["[5.0] " + xid_line(b, 48, "GSP-RISCV uncorrectable ECC error", pid=None),
             "[5.0] " + xid_line(b, 172, "GSP-RISCV, Uncorrectable SRAM error", pid=None)]
    root, sec = classify(lines)
    assert (root.code, sec.code, sec.secondary_of) == ("xid:48", "xid:172", 0)


@pytest.mark.parametrize("xid,msg,expected", [
    (999, "some new driver text", ("gpu", "none", "observe")),
    (999, "Fatal error in new unit", ("gpu", "migrate-rank", "reset-gpu")),
    (1234, "Non-fatal error in new unit", ("gpu", "none", "observe")),
    (173, "C2C fatal link failure", ("gpu", "migrate-rank", "reset-gpu")),
    (176, "PCIe correctable error fault", ("gpu", "none", "observe")),
])
def test_unknown_xid_is_an_incident_marked_unknown(xid, msg, expected):
    inc = one([xid_line((0, 0x9B, 0), xid, msg)])
    assert (inc.code, reading(inc), inc.known, inc.to_json()["known"]) == (f"xid:{xid}", expected, False, False)


def test_driver_only_xid_with_a_reading_is_known():
    assert xid_line_reading(175, "") == (("gpu", "migrate-rank", "reset-gpu"), True)
    assert xid_line_reading(174, "")[1] is False


# --- fallen off the bus -------------------------------------------------------------------------


def test_gpu_lost_message_and_its_xid_are_one_incident():
    lines = ["[6781741.548779] NVRM: Xid (PCI:0000:c1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
             "[6781741.548790] NVRM: GPU 0000:c1:00.0: GPU has fallen off the bus.",
             "[6781741.548799] NVRM: GPU 0000:c1:00.0: GPU serial number is 1650000000000."]
    inc = one(lines)
    assert (inc.code, inc.device, inc.last_line) == ("xid:79", "0000:c1:00.0", 2)


def test_probe_message_unjoined_lines_take_the_gpu_from_the_first():
    # osapi.c prints three "NVRM:" lines; stamped 2 s apart here, so they stay separate records
    lines = ["[ 10.0] NVRM: The NVIDIA GPU 0000:1a:00.0",
             "[ 12.0] NVRM: (PCI ID: 10de:2330) installed in this system has",
             "[ 14.0] NVRM: fallen off the bus and is not responding to commands."]
    inc = one(lines)
    assert (inc.code, inc.device, reading(inc)) == ("nvrm:fallen_off_bus", "0000:1a:00.0", ("gpu", "migrate-rank", "reboot-node"))


# --- SXid (NVSwitch) ----------------------------------------------------------------------------


def sxid_line(sw: int, b: str, n: int, fmt: str) -> str:
    """NVSWITCH_PRINT_SXID: "nvidia-%s: SXid (PCI:%04x:%02x:%02x.%x): %05d, " _fmt."""
    return f"nvidia-nvswitch{sw}: SXid (PCI:{b}): {n:05d}, {fmt}"


@pytest.mark.parametrize("fmt,expected", [
    ("Non-fatal, Link 07 egress non-posted PRIV error (First)", ("nvlink", "none", "observe")),
    ("Correctable, Link 21 TX replay (First)", ("nvlink", "none", "observe")),
    ("Fatal, Link 33 LTSSM Fault Up", ("nvlink", "migrate-rank", "drain-node")),
    ("Severity 1 Engine instance 12 Sub-engine instance 00", ("nvlink", "migrate-rank", "drain-node")),
    ("Severity 0 Engine instance 60 Sub-engine instance 00", ("nvlink", "none", "observe")),
])
def test_sxid_severity_from_the_line(fmt, expected):
    inc = one(["[ 3.3] " + sxid_line(4, "0000:c5:00.0", 12028, fmt)])
    assert (inc.code, inc.device, reading(inc), inc.known) == ("sxid:12028", "0000:c5:00.0", expected, True)


def test_sxid_data_lines_are_the_same_incident_and_fatal_if_any_says():
    lines = [sxid_line(2, "0000:07:00.0", 20034, "Fatal, Link 37 LTSSM Fault Up"),
             sxid_line(2, "0000:07:00.0", 20034, "Severity 1 Engine instance 37 Sub-engine instance 00"),
             sxid_line(2, "0000:07:00.0", 20034, "Data {0x10000000, 0x10000000, 0x00000000, 0x10000000, 0x00000000}")]
    inc = one(lines)
    assert inc.count == 3 and reading(inc) == ("nvlink", "migrate-rank", "drain-node")


def test_unknown_sxid_is_marked_unknown():
    inc = one([sxid_line(0, "0000:05:00.0", 777, "Non-fatal, Link 02 something new")])
    assert (inc.code, inc.known, reading(inc)) == ("sxid:777", False, ("nvlink", "none", "observe"))
    inc = one([sxid_line(0, "0000:05:00.0", 31005, "Fatal, Link 02 something new")])
    assert (inc.known, reading(inc)) == (False, ("nvlink", "migrate-rank", "drain-node"))


def test_sxid_with_journal_prefix_and_elided_switch_id():
    inc = one(["2026-03-03T18:39:57+00:00 host kernel: " + sxid_line(3, "0000:08:00.0", 22013, "Non-fatal, Link 60 Minion Link DLREQ interrupt")])
    assert (inc.code, inc.device, reading(inc)) == ("sxid:22013", "0000:08:00.0", ("nvlink", "none", "observe"))
    inc = one(["nvidia-nvswitch1: SXid (PCI:...): 20034, Fatal, Link 48 LTSSM Fault Up"])
    assert (inc.code, inc.device, reading(inc)) == ("sxid:20034", None, ("nvlink", "migrate-rank", "drain-node"))


def test_fabric_manager_line():
    inc = one(["Mar 03 18:39:57 host nv-fabricmanager[5183]: detected NVSwitch fatal error 12028 on NodeId 0 "
               "on NVSwitch pci bus id 00000000:c5:00.0 physical id 4 port 7"])
    assert (inc.code, inc.device, reading(inc)) == ("sxid:12028", "0000:c5:00.0", ("nvlink", "migrate-rank", "drain-node"))


def test_sxids_after_a_lost_gpu_follow_it():
    lines = ["[100.0] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
             "[101.0] " + sxid_line(1, "0000:06:00.0", 20034, "Fatal, Link 48 LTSSM Fault Up")]
    root, sec = classify(lines)
    assert (root.code, sec.code, sec.secondary_of, sec.action) == ("xid:79", "sxid:20034", 0, "none")


# --- cut and malformed lines --------------------------------------------------------------------


def test_cut_off_last_line():
    b = (0, 0x91, 0)
    # "...: 7" may be the start of 79: nothing
    assert classify_text("[1.0] " + xid_line(b, 13, "x") + "\n[2.0] NVRM: Xid (PCI:0000:91:00): 7") == classify_text(
        "[1.0] " + xid_line(b, 13, "x") + "\n")
    got = classify_text("[2.0] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unkn")
    assert [(i.code, i.device) for i in got] == [("xid:79", "0000:91:00.0")]


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:", "NVRM: Xid (PCI:0000:91:00): , pid=", "NVRM: Xid (PCI:0000:91:00): 99999999999999999999999, x",
    "NVRM: Xid (PCI:0000:91:00 GPU-I:): 94, RST: Maybe, D-RST:", "NVRM: Xid (PCI:0000:91:00): 154, GPU recovery action changed from 0x",
    "NVRM: Xid (PCI:0000:91:00): 154, GPU recovery action changed from 0xzz (None) to 0x (", "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): ",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034", "SXid (PCI:): 1, Severity", "NVRM: The NVIDIA GPU 0000:zz:00.0",
    "NVRM: fallen off the bus and is not responding to commands.", "\x00\xff NVRM: Xid \x00",
])
def test_malformed_lines_never_raise(line):
    rep = classify_report([line, line + "\n"])
    assert rep.error is None


def test_module_cites_its_sources():
    doc = gpu.__doc__
    assert "analyzing-xid-catalog" in doc and "kernel_rc.c" in doc and "nverror.h" in doc


def test_lines_with_their_bus_id_cut_out_are_not_taken_for_one_gpu():
    from linkpass.core.classify import classify_text

    incs = classify_text("[Mon Mar  3 10:15:01 2025] NVRM: Xid 79, GPU has fallen off the bus.\n"
                         "[Mon Mar  3 10:15:02 2025] NVRM: Xid (PCI:<redacted>): 48, pid=1, An uncorrectable double bit "
                         "error (DBE) has been detected\n")
    assert [(i.code, i.device, i.secondary_of, i.remedy) for i in incs] == [
        ("xid:79", None, None, "reboot-node"), ("xid:48", None, None, "reset-gpu")]
