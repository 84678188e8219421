"""The PCIe family (linkpass.core.evidence.pcie): lines built here from the kernel's format strings
(drivers/pci/pcie/aer.c, aer/aerdrv_errprint.c, err.c, dpc.c, hotplug/pciehp_ctrl.c), in the
wordings of several kernel eras, with varied bus ids, prefixes and cut-off lines."""

from __future__ import annotations

import pytest

from linkpass.core.classify import classify, classify_report
from linkpass.core.evidence.pcie import AER_ERROR_CLASS, CORRECTABLE_ERRORS, UNCORRECTABLE_ERRORS, pci_id

# -- line builders: the kernel's printf formats, Python-side ------------------------------------

SEV_OLD = {"corrected": "Corrected", "nonfatal": "Uncorrected (Non-Fatal)", "fatal": "Uncorrected (Fatal)"}
SEV_NEW = {"corrected": "Correctable", "nonfatal": "Uncorrectable (Non-Fatal)", "fatal": "Uncorrectable (Fatal)"}


def rid(bdf: str) -> int:
    _, bus, df = bdf.split(":")
    dev, fn = df.split(".")
    return int(bus, 16) << 8 | int(dev, 16) << 3 | int(fn)


def header(era: str, port: str, sev: str, src: str, multi: bool = False) -> str:
    """aer_print_port_info, printed on the Root Port."""
    m = "Multiple " if multi else ""
    if era == "4.x":
        return f"pcieport {port}: AER: {m}{SEV_OLD[sev]} error received: id={rid(src):04x}"
    if era == "5.x":
        return f"pcieport {port}: AER: {m}{SEV_OLD[sev]} error received: {src}"
    return f"pcieport {port}: AER: {m}{SEV_NEW[sev]} error message received from {src}"


def details(era: str, drv: str, dev: str, sev: str, layer: str, agent: str, status: int, mask: int,
            bits: list[tuple[int, str]], first: int | None = None, ids: str = "10de:2330") -> list[str]:
    """aer_print_error + __aer_print_error, printed on the device that logged the error."""
    words = SEV_OLD if era in ("4.x", "5.x") else SEV_NEW
    aer = "" if era == "4.x" else "AER: "
    idpart = f"id={rid(dev):04x}({agent})" if era == "4.x" else f"({agent})"
    out = [f"{drv} {dev}: {aer}PCIe Bus Error: severity={words[sev]}, type={layer}, {idpart}",
           f"{drv} {dev}: {aer}  device [{ids}] error status/mask={status:08x}/{mask:08x}"]
    for bit, name in bits:
        out.append(f"{drv} {dev}: {aer}   [{bit:2d}] {name:<22s}{' (First)' if first == bit else ''}")
    return out


def dmesg(lines: list[str], t0: float = 812.5, step: float = 0.000113) -> list[str]:
    return [f"[{t0 + n * step:12.6f}] {ln}" for n, ln in enumerate(lines)]


def journal(lines: list[str], hh: int = 4) -> list[str]:
    return [f"Jul 09 {hh:02d}:17:{10 + n % 40:02d} gpu-node-7 kernel: {ln}" for n, ln in enumerate(lines)]


def read(lines: list[str]) -> list[dict]:
    return [i.to_json() for i in classify(lines)]


def by_code(incs: list[dict], code: str) -> list[dict]:
    return [i for i in incs if i["code"] == code]


# -- the tables are the kernel's -----------------------------------------------------------------

def test_names_are_in_exactly_one_class():
    assert AER_ERROR_CLASS["Replay Timer Timeout"] == AER_ERROR_CLASS["Timeout"] == "corrected"
    assert AER_ERROR_CLASS["Surprise Down Error"] == AER_ERROR_CLASS["SDES"] == "uncorrectable"
    cor = {n for ns in CORRECTABLE_ERRORS.values() for n in ns}
    unc = {n for ns in UNCORRECTABLE_ERRORS.values() for n in ns}
    assert not cor & unc


def test_requester_id_decodes_like_the_kernel():
    # aer.c aer_print_port_info: bus = id >> 8, PCI_SLOT(devfn), PCI_FUNC(devfn)
    assert pci_id("0000:00:02.0", 0x0010) == "0000:00:02.0"
    assert pci_id("0002:80:01.0", 0x8103) == "0002:81:00.3"


# -- corrected errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("era", ["4.x", "5.x", "6.16"])
def test_corrected_on_a_port_is_a_trend_to_observe(era):
    port = "0000:80:03.1"
    lines = [header(era, port, "corrected", port)] + details(
        era, "pcieport", port, "corrected", "Physical Layer", "Receiver ID", 0x1, 0x2000, [(0, "Receiver Error" if era == "4.x" else "RxErr")], 0,
        ids="1022:1483")
    incs = read(dmesg(lines))
    assert [(i["code"], i["device"], i["domain"], i["action"], i["remedy"], i["known"]) for i in incs] == [
        ("aer:corrected", port, "unattributed", "none", "observe", True)]
    assert incs[0]["first_line"] == 1 and incs[0]["last_line"] == 4


def test_corrected_on_an_endpoint_gpu_names_the_gpu():
    port, gpu = "0000:40:01.1", "0000:41:00.0"
    lines = [header("6.16", port, "corrected", gpu)] + details(
        "6.16", "nvidia", gpu, "corrected", "Data Link Layer", "Transmitter ID", 0x1000, 0x0, [(12, "Timeout")])
    (inc,) = read(journal(lines))
    assert (inc["code"], inc["device"], inc["domain"], inc["action"], inc["remedy"]) == (
        "aer:corrected", gpu, "gpu", "none", "observe")


def test_repeated_corrected_reports_are_one_incident_and_a_burst_is_a_warning():
    port, nic = "0000:16:02.0", "0000:17:00.1"
    one = [header("5.x", port, "corrected", nic)] + details(
        "5.x", "mlx5_core", nic, "corrected", "Data Link Layer", "Receiver ID", 0x40, 0x0, [(6, "BadTLP")], ids="15b3:101d")
    few = dmesg(one * 3, step=2.0)
    (inc,) = classify(few)
    assert inc.code == "aer:corrected" and inc.domain == "nic-device" and inc.remedy == "observe"
    assert inc.lines == (1, 5, 9) and inc.count == 12
    burst = dmesg(one * 12, step=0.5)
    (inc,) = read(burst)
    assert (inc["code"], inc["device"], inc["action"], inc["remedy"]) == ("aer:corrected", nic, "none", "replace-part")
    spread = dmesg(one * 12, step=100.0)  # the same count over 20 minutes: still a trend
    assert read(spread)[0]["remedy"] == "observe"


def test_mlx5_prefixed_aer_lines_are_read_by_the_pcie_rules():
    nic = "0000:b1:00.0"
    lines = details("5.x", "mlx5_core", nic, "corrected", "Physical Layer", "Receiver ID", 0x1, 0x0, [(0, "RxErr")])
    (inc,) = read(lines)
    assert inc["code"] == "aer:corrected" and inc["device"] == nic and inc["domain"] == "nic-device"


# -- uncorrectable non-fatal: a fault of the device named ----------------------------------------

def test_nonfatal_on_a_nic_is_a_device_fault_until_the_kernel_recovers_it():
    port, nic = "0000:3a:00.0", "0000:3b:00.0"
    lines = [header("5.x", port, "nonfatal", nic)] + details(
        "5.x", "mlx5_core", nic, "nonfatal", "Transaction Layer", "Requester ID", 0x4000, 0x0, [(14, "CmpltTO")], 14)
    (inc,) = read(lines)
    assert (inc["code"], inc["device"], inc["domain"], inc["action"], inc["remedy"]) == (
        "aer:uncorrectable", nic, "nic-device", "reroute", "reboot-node")
    rec = read(lines + [f"pcieport {port}: AER: Device recovery successful"])
    assert [(i["code"], i["action"], i["remedy"], i["last_line"]) for i in rec] == [("aer:uncorrectable", "none", "observe", 5)]


def test_nonfatal_on_a_gpu_migrates_its_rank():
    port, gpu = "0000:c0:01.1", "0000:c1:00.0"
    lines = [header("6.16", port, "nonfatal", gpu)] + details(
        "6.16", "nvidia", gpu, "nonfatal", "Transaction Layer", "Receiver ID", 0x40000, 0x0, [(18, "MalfTLP")], 18)
    (inc,) = read(journal(lines))
    assert (inc["domain"], inc["device"], inc["action"], inc["remedy"]) == ("gpu", gpu, "migrate-rank", "reset-gpu")


def test_multiple_errors_give_one_incident_per_device_that_logged_one():
    port, a, b = "0000:5c:02.0", "0000:5d:00.0", "0000:5e:00.0"
    lines = [header("5.x", port, "nonfatal", a, multi=True)]
    lines += details("5.x", "mlx5_core", a, "nonfatal", "Transaction Layer", "Requester ID", 0x100000, 0x0, [(20, "UnsupReq")], 20)
    lines += details("5.x", "mlx5_core", b, "nonfatal", "Transaction Layer", "Requester ID", 0x100000, 0x0, [(20, "UnsupReq")])
    incs = read(lines)
    assert sorted(i["device"] for i in incs) == [a, b]
    assert all(i["code"] == "aer:uncorrectable" and i["secondary_of"] is None for i in incs)


# -- the device behind the port is lost ----------------------------------------------------------

def test_fatal_surprise_down_with_a_gpu_behind_and_no_gpu_report_is_the_root():
    port, gpu = "0000:a0:03.1", "0000:a3:00.0"
    lines = [header("5.x", port, "fatal", port)] + details(
        "5.x", "pcieport", port, "fatal", "Transaction Layer", "Receiver ID", 0x20, 0x0, [(5, "SDES")], 5, ids="1022:1483")
    lines += [f"nvidia {gpu}: AER: can't recover (no error_detected callback)", f"pcieport {port}: AER: device recovery failed"]
    (inc,) = read(dmesg(lines, t0=90211.0))
    assert (inc["code"], inc["device"], inc["domain"], inc["action"], inc["remedy"], inc["last_line"]) == (
        "aer:uncorrectable", port, "gpu", "migrate-rank", "reboot-node", 6)


@pytest.mark.parametrize("era", ["4.x", "5.x", "6.16"])
def test_the_gpus_own_xid79_is_the_root_and_the_ports_fatal_error_its_secondary(era):
    port, gpu = "0000:c0:03.1", "0000:c3:00.0"
    corr = [header(era, port, "corrected", port)] + details(
        era, "pcieport", port, "corrected", "Data Link Layer", "Transmitter ID", 0x100, 0x0,
        [(8, "RELAY_NUM Rollover" if era == "4.x" else "Rollover")], ids="1022:1483")
    fatal = [header(era, port, "fatal", port)] + details(
        era, "pcieport", port, "fatal", "Transaction Layer", "Receiver ID", 0x20, 0x0,
        [(5, "Surprise Down Error" if era == "4.x" else "SDES")], 5, ids="1022:1483")
    fatal += [f"pcieport {port}: broadcast error_detected message", f"nvidia {gpu}: device has no AER-aware driver",
              "NVRM: GPU at PCI:0000:c3:00: GPU-00000000-0000-0000-0000-000000000000",
              "NVRM: Xid (PCI:0000:c3:00): 79, pid=1234, GPU has fallen off the bus."]
    lines = dmesg(corr, t0=100.0) + dmesg(fatal, t0=160.0)
    incs = read(lines)
    assert [(i["code"], i["device"], i["domain"], i["action"], i["remedy"], i["secondary_of"]) for i in incs] == [
        ("aer:corrected", port, "gpu", "none", "observe", None),
        ("xid:79", gpu, "gpu", "migrate-rank", "reboot-node", None),
        ("aer:uncorrectable", port, "gpu", "none", "none", 1)]


def test_a_lost_gpu_without_any_line_naming_it_behind_the_port_is_linked_by_bus_and_time():
    port, gpu = "0000:00:01.0", "0000:01:00.0"
    lines = [header("6.16", port, "fatal", port)] + details(
        "6.16", "pcieport", port, "fatal", "Data Link Layer", "Receiver ID", 0x10, 0x0, [(4, "DLP")], 4)
    lines += ["NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."]
    incs = read(dmesg(lines))
    assert [(i["code"], i["secondary_of"]) for i in incs] == [("xid:79", None), ("aer:uncorrectable", 0)]
    assert incs[1]["domain"] == "gpu"


def test_an_unrelated_gpu_on_a_lower_bus_is_not_behind_the_port():
    port = "0000:80:01.0"
    lines = [header("5.x", port, "fatal", port)] + details(
        "5.x", "pcieport", port, "fatal", "Transaction Layer", "Receiver ID", 0x20, 0x0, [(5, "SDES")], 5)
    lines += ["NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus."]
    incs = read(dmesg(lines))
    assert all(i["secondary_of"] is None for i in incs)
    assert by_code(incs, "aer:uncorrectable")[0]["domain"] == "unattributed"


@pytest.mark.parametrize("lines_for", [
    # 5.x - 6.15: two lines, source id in the first
    lambda p, n: [f"pcieport {p}: DPC: containment event, status:0x1f01 source:0x{rid(n):04x}",
                  f"pcieport {p}: DPC: unmasked uncorrectable error detected"],
    # 6.16+: one line
    lambda p, n: [f"pcieport {p}: DPC: containment event, status:0x1f05, ERR_FATAL received from {n}"],
    # 4.x
    lambda p, n: [f"pcieport {p}: DPC containment event, status:0x1f01 source:0x{rid(n):04x}",
                  f"pcieport {p}: DPC ERR_FATAL detected"],
])
def test_dpc_containment_cuts_off_the_nic_behind(lines_for):
    port, nic = "0000:d0:01.0", "0000:d1:00.0"
    lines = lines_for(port, nic) + [f"pcieport {port}: AER: device recovery failed"]
    (inc,) = read(journal(lines, hh=11))
    assert (inc["code"], inc["device"], inc["domain"], inc["action"], inc["remedy"]) == (
        "dpc:containment", port, "unattributed", "none", "reboot-node")  # nothing names a driver at d1:00.0
    lines = [f"mlx5_core {nic}: firmware version: 28.39.1002"] + lines
    incs = read(journal(lines, hh=11))
    assert [(i["code"], i["domain"], i["action"]) for i in incs] == [("dpc:containment", "nic-device", "reroute")]


def test_dpc_prints_its_ports_aer_details_as_part_of_the_containment():
    port = "0000:e0:03.2"
    lines = [f"pcieport {port}: DPC: containment event, status:0x0009 source:0x0000",
             f"pcieport {port}: DPC: unmasked uncorrectable error detected"]
    lines += details("5.x", "pcieport", port, "fatal", "Transaction Layer", "Receiver ID", 0x20, 0x0, [(5, "SDES")], 5)
    lines += [f"pcieport {port}: AER: device recovery successful"]
    incs = read(dmesg(lines))
    assert [(i["code"], i["action"], i["remedy"], i["secondary_of"]) for i in incs] == [
        ("dpc:containment", "none", "observe", None), ("aer:uncorrectable", "none", "none", 0)]


def test_dpc_with_the_nics_own_reset_report_makes_the_nic_the_root():
    port, nic = "0000:c0:01.1", "0000:c1:00.0"
    lines = [f"pcieport {port}: DPC: containment event, status:0x1f05, ERR_FATAL received from {nic}",
             f"mlx5_core {nic}: mlx5_pci_err_detected Device state = 1 pci_status: 1. Enter, result = 3, need reset",
             f"pcieport {port}: AER: device recovery failed"]
    incs = read(dmesg(lines))
    assert [(i["code"], i["device"], i["secondary_of"]) for i in incs] == [
        ("mlx5:pci_slot_reset", nic, None), ("dpc:containment", port, 0)]
    assert incs[0]["action"] == "reroute"


@pytest.mark.parametrize("prefix", ["pcieport 0000:00:1c.4: pciehp: ", "pciehp 0000:00:1c.4:pcie004: "])
def test_pciehp_surprise_removal(prefix):
    lines = [f"{prefix}Slot(7): Link Down", f"{prefix}Slot(7): Card not present"]
    (inc,) = read(dmesg(lines))
    assert (inc["code"], inc["device"], inc["action"], inc["remedy"], inc["last_line"]) == (
        "pciehp:link_down", "0000:00:1c.4", "none", "reboot-node", 2)
    (inc,) = read(dmesg(lines + [f"{prefix}Slot(7): Card present", f"{prefix}Slot(7): Link Up"]))
    assert inc["remedy"] == "observe" and inc["last_line"] == 4


def test_recovery_failed_with_nothing_before_it_is_its_own_incident():
    (inc,) = read(["mlx5_core 0000:4b:00.1: AER: Device recovery failed"])
    assert (inc["code"], inc["domain"], inc["action"]) == ("aer:recovery_failed", "nic-device", "reroute")
    assert read(["pcieport 0000:4a:00.0: AER: device recovery successful"]) == []


def test_firmware_first_report_reads_its_severity_from_the_registers():
    dev = "0000:9d:00.0"
    fatal = [f"nvidia {dev}: AER: aer_status: 0x00000020, aer_mask: 0x00000000",
             f"nvidia {dev}: AER:    [ 5] SDES                   (First)",
             f"nvidia {dev}: AER: aer_layer=Transaction Layer, aer_agent=Receiver ID",
             f"nvidia {dev}: AER: aer_uncor_severity: 0x00062030"]
    (inc,) = read(fatal)
    assert (inc["code"], inc["domain"], inc["action"], inc["remedy"]) == ("aer:uncorrectable", "gpu", "migrate-rank", "reboot-node")
    corr = [f"nvidia {dev}: AER: aer_status: 0x00000001, aer_mask: 0x00000000",
            f"nvidia {dev}: AER:    [ 0] RxErr                  (First)"]
    assert read(corr)[0]["code"] == "aer:corrected"


# -- names the tables do not know, and broken input ----------------------------------------------

def test_an_unknown_error_name_still_gives_an_incident_marked_unknown():
    port = "0000:20:01.0"
    lines = [header("6.16", port, "nonfatal", port)] + details(
        "6.16", "pcieport", port, "nonfatal", "Transaction Layer", "Receiver ID", 0x8000000, 0x0, [(27, "FlitErr")], 27)
    (inc,) = read(lines)
    assert inc["code"] == "aer:uncorrectable" and inc["known"] is False
    lines = details("4.x", "pcieport", port, "corrected", "Physical Layer", "Receiver ID", 0x2, 0x0, [(1, "Unknown Error Bit")])
    (inc,) = read(lines)
    assert inc["code"] == "aer:corrected" and inc["known"] is False
    (inc,) = read([f"pcieport {port}: AER: PCIe Bus Error: severity=Deferred, type=Transaction Layer, (Receiver ID)"])
    assert inc["code"] == "aer:unknown" and inc["known"] is False and inc["action"] == "none"
    (inc,) = read([f"pcieport {port}: DPC: containment event, status:0x1f07: quantum error detected"])
    assert inc["code"] == "dpc:containment" and inc["known"] is False


def test_header_without_details_is_read_from_the_header():
    # 6.16+: "(no details found)"; earlier kernels print the header and "can't find device of ID..."
    (inc,) = read(["pcieport 0000:00:1c.5: AER: Uncorrectable (Non-Fatal) error message received from 0000:02:00.0 (no details found)"])
    assert (inc["code"], inc["device"]) == ("aer:uncorrectable", "0000:02:00.0")


@pytest.mark.parametrize("text", [
    "pcieport 0000:00:02.0: PCIe Bus Error: severity=Uncorr",
    "pcieport 0000:00:02.0:    [ 5] Surpr",
    "pcieport 0000:00:02.0:    [",
    "pcieport 0000:00:02.0: AER: Corrected error received: id=",
    "pcieport 0000:00:02.0: DPC: containment event, status:0x",
    "pcieport 0000:00:02.0:   device [8086:6f04] error status/mask=0000",
    "nvidia 0000:02:00.0: AER: aer_uncor_severity: 0x00062030",
    "pcieport 0000:00:1c.0: pciehp: Slot(: Link Down",
])
def test_truncated_lines_never_raise(text):
    head = [header("5.x", "0000:00:02.0", "fatal", "0000:00:02.0")]
    for lines in ([text], head + [text], [text, text]):
        rep = classify_report([ln + "\n" for ln in lines[:-1]] + [lines[-1]])  # the last line cut off
        assert rep.error is None


def test_a_cut_off_block_still_gives_the_fatal_reading():
    port = "0000:00:02.0"
    lines = details("4.x", "pcieport", port, "fatal", "Transaction Layer", "Receiver ID", 0x20, 0x0, [(5, "Surprise Down Error")], 5)
    rep = classify_report([ln + "\n" for ln in lines[1:-1]] + [lines[-1]])  # its first line lost
    assert rep.error is None
    (inc,) = [i.to_json() for i in rep.incidents]
    assert inc["code"] == "aer:uncorrectable" and inc["remedy"] == "reboot-node"


def test_a_lone_numbered_line_of_another_driver_is_not_an_aer_report():
    assert read(["xhci_hcd 0000:00:14.0:    [ 3] port reset complete"]) == []
    (inc,) = read(["pcieport 0000:00:02.0:    [ 3] Unknown Error Bit"])  # no header, but the kernel's own words
    assert inc["known"] is False and inc["code"] == "aer:unknown"
