"""NIC evidence (linkpass.core.evidence.nic): lines written from the mlx5 driver's own format
strings (torvalds/linux drivers/net/ethernet/mellanox/mlx5/core health.c, cmd.c, events.c,
port.c, en_main.c, main.c; drivers/infiniband/core/cache.c; net/8021q/vlan.c), with the
prefixes of mlx5_core_err/_warn/mlx5_log ("func:line:(pid N): ") and mlx5_core_info (none),
across kernel versions, with and without timestamps."""

from __future__ import annotations

import pytest

from linkpass.core.classify import classify, classify_report, classify_text


def read(lines):
    return [(i.domain, i.device, i.code, i.action, i.remedy, i.secondary_of) for i in classify(lines)]


def one(lines):
    (inc,) = classify(lines)
    return inc


# --- firmware health (health.c) -------------------------------------------------------------

@pytest.mark.parametrize("line", [
    # 5.x/6.x poll_health, mlx5_core_err prefix
    "[ 8812.449102] mlx5_core 0000:3b:00.1: poll_health:801:(pid 0): device's health compromised - reached miss count",
    # 4.x: priv.name before the function, no " - reached miss count"
    "Jun  3 10:11:12 gpu17 kernel: mlx5_core 0000:5e:00.0: mlx5_0:poll_health:170:(pid 0): device's health compromised",
    # journal, no kernel timestamp
    "2025-01-09T04:05:06.123456+00:00 n3 kernel: mlx5_core 0000:c1:00.0: poll_health:955:(pid 12): "
    "device's health compromised - reached miss count",
])
def test_health_miss_count_is_a_device_fault(line):
    inc = one([line])
    assert (inc.domain, inc.code, inc.action, inc.remedy, inc.known) == \
        ("nic-device", "mlx5:health_compromised", "reroute", "reboot-node", True)
    assert inc.device.startswith("0000:") and inc.device.endswith((".0", ".1"))


def test_health_dump_follows_the_miss_count_and_names_the_syndrome():
    bus = "0000:86:00.0"
    p = f"mlx5_core {bus}: print_health_info:"
    lines = [f"[100.0] mlx5_core {bus}: poll_health:801:(pid 0): device's health compromised - reached miss count",
             f"[100.0] {p}424:(pid 0): Health issue observed, firmware internal error, severity(3) ERROR:"]
    lines += [f"[100.0] {p}428:(pid 0): assert_var[{n}] 0x0000{n:04x}" for n in range(5)]
    lines += [f"[100.0] {p}431:(pid 0): assert_exit_ptr 0x008033a0",
              f"[100.0] {p}445:(pid 0): synd 0x1: firmware internal error",
              f"[100.0] {p}447:(pid 0): ext_synd 0x8f1d"]
    got = read(lines)
    assert got == [("nic-device", bus, "mlx5:health_compromised", "reroute", "reboot-node", None),
                   ("nic-device", bus, "mlx5:fw_syndrome:0x1", "none", "none", 0)]
    incs = classify(lines)
    assert incs[1].count == 2 and len(incs[1].lines) == 1  # one dump, its two syndrome lines


def test_old_health_dump_with_dev_err_and_no_issue_line():
    # 4.x print_health_info: dev_err(&pdev->dev, "synd 0x%x: %s\n") with no function prefix
    inc = one(["mlx5_core 0000:04:00.0: synd 0x8: unrecoverable hardware error"])
    assert (inc.domain, inc.code, inc.action, inc.remedy, inc.known) == \
        ("nic-device", "mlx5:fw_syndrome:0x8", "reroute", "reboot-node", True)


def test_unknown_syndrome_is_an_incident_with_known_false():
    inc = one(["[5.5] mlx5_core 0000:af:00.1: print_health_info:445:(pid 0): synd 0x42: unrecognized error"])
    assert (inc.domain, inc.code, inc.action, inc.known) == ("nic-device", "mlx5:fw_syndrome:0x42", "reroute", False)
    inc = one(["[5.5] mlx5_core 0000:af:00.1: print_health_info:424:(pid 0): Health issue observed, "
               "unrecognized error, severity(3) ERROR:"])
    assert (inc.domain, inc.code, inc.known) == ("nic-device", "mlx5:fw_syndrome", False)


def test_firmware_severity_below_error_is_observed_not_rerouted():
    inc = one(["[7.0] mlx5_core 0000:17:00.0: print_health_info:424:(pid 0): Health issue observed, "
               "High temperature, severity(4) WARNING:"])
    assert (inc.code, inc.domain, inc.action, inc.remedy) == ("mlx5:fw_syndrome:0x10", "nic-device", "none", "observe")
    # 4.x spelling "High temprature" is the same syndrome
    inc = one(["mlx5_core 0000:17:00.0: synd 0x10: High temprature"])
    assert (inc.code, inc.known) == ("mlx5:fw_syndrome:0x10", True)


@pytest.mark.parametrize("n,name,known", [(1, "pci_comm_err", True), (5, "fw_synd_rfr", True), (9, "9", False)])
def test_fatal_sensor(n, name, known):
    inc = one([f"[42.0] mlx5_core 0000:b1:00.0: poll_health:786:(pid 0): Fatal error {n} detected"])
    assert (inc.domain, inc.code, inc.action, inc.remedy, inc.known) == \
        ("nic-device", f"mlx5:fatal_error:{name}", "reroute", "reboot-node", known)


def test_health_recovery_succeeded_leaves_observe_and_failed_keeps_reboot():
    bus = "0000:b1:00.0"
    base = [f"[42.0] mlx5_core {bus}: poll_health:786:(pid 0): Fatal error 5 detected",
            f"[42.1] mlx5_core {bus}: mlx5_health_try_recover:335:(pid 9): handling bad device here"]
    ok = one(base + [f"[44.0] mlx5_core {bus}: health recovery succeeded"])
    assert (ok.action, ok.remedy) == ("none", "observe")
    bad = one(base + [f"[44.0] mlx5_core {bus}: mlx5_health_try_recover:350:(pid 9): health recovery failed"])
    assert (bad.action, bad.remedy) == ("reroute", "reboot-node")


# --- firmware commands (cmd.c) ----------------------------------------------------------------

@pytest.mark.parametrize("line,code,reading", [
    # 6.x mlx5_cmd_out_err, with err(%d)
    ("[300.1] mlx5_core 0000:08:00.0: mlx5_cmd_out_err:838:(pid 4242): CREATE_MKEY(0x200) op_mod(0x0) failed, "
     "status bad parameter(0x3), syndrome (0x1b5e7c), err(-22)",
     "mlx5:cmd_status:bad_parameter", ("config", "none", "observe")),
    # 5.x cmd_status_print, with err(%d)
    ("mlx5_core 0000:08:00.1: cmd_status_print:818:(pid 77): QUERY_VPORT_COUNTER(0x770) op_mod(0x0) failed, "
     "status bad operation(0x2), syndrome (0x7f2a1), err(-22)",
     "mlx5:cmd_status:bad_operation", ("config", "none", "observe")),
    # 4.x mlx5_cmd_check, no err(%d)
    ("[12.0] mlx5_core 0000:81:00.0: mlx5_cmd_check:772:(pid 901): SET_HCA_CAP(0x109) op_mod(0x0) failed, "
     "status internal error(0x1), syndrome (0x5ce1b)",
     "mlx5:cmd_status:internal_error", ("nic-device", "reroute", "reboot-node")),
    ("mlx5_core 0000:81:00.0: mlx5_cmd_check:772:(pid 901): CREATE_QP(0x500) op_mod(0x0) failed, "
     "status limits exceeded(0x8), syndrome (0x3c8e6f)",
     "mlx5:cmd_status:limits_exceeded", ("config", "none", "observe")),
])
def test_command_failure_is_read_from_its_status(line, code, reading):
    inc = one([line])
    assert (inc.code, (inc.domain, inc.action, inc.remedy), inc.known) == (code, reading, True)
    assert inc.device in line


def test_unknown_command_status_gives_an_incident_with_known_false():
    inc = one(["mlx5_core 0000:08:00.0: mlx5_cmd_out_err:838:(pid 1): ALLOC_PD(0x800) op_mod(0x0) failed, "
               "status unknown status(0x77), syndrome (0x1), err(-5)"])
    assert (inc.code, inc.domain, inc.action, inc.known) == ("mlx5:cmd_status:0x77", "unattributed", "none", False)


def test_repeated_command_failures_collapse():
    line = ("[{t}] mlx5_core 0000:08:00.0: mlx5_cmd_out_err:838:(pid {p}): DESTROY_FLOW_TABLE(0x931) op_mod(0x0) "
            "failed, status bad resource(0x5), syndrome (0x{s:x}), err(-22)")
    incs = classify([line.format(t=10.0 + n, p=100 + n, s=0xa000 + n) for n in range(4)])
    assert len(incs) == 1 and incs[0].count == 4 and incs[0].code == "mlx5:cmd_status:bad_resource"


@pytest.mark.parametrize("line", [
    "[748.005230] mlx5_core 0000:08:00.2: wait_func:1094:(pid 12985): MANAGE_PAGES(0x108) timeout. "
    "Will cause a leak of a command resource",
    "mlx5_core 0000:18:00.0: cb_timeout_handler:880:(pid 7): cmd[3]: QUERY_Q_COUNTER(0x773) Async, timeout. "
    "Will cause a leak of a command resource",
    "mlx5_core 0000:18:00.0: wait_func:1172:(pid 5): MODIFY_CQ(0x403) canceled on out of queue timeout.",
    "mlx5_core 0000:18:00.0: wait_func:1180:(pid 5): ENABLE_HCA(0x104) timeout while waiting for command semaphore.",
])
def test_command_timeout_is_a_device_fault(line):
    inc = one([line])
    assert (inc.domain, inc.code, inc.action, inc.remedy) == ("nic-device", "mlx5:cmd_timeout", "reroute", "reboot-node")


def test_command_timeout_recovered_by_eq_recovery_is_observed():
    bus = "0000:56:00.0"
    lines = [f"[257.111] mlx5_core {bus}: wait_func_handle_exec_timeout:1159:(pid 72061): cmd[0]: ACCESS_REG(0x805) "
             "No done completion",
             f"[257.120] mlx5_core {bus}: wait_func_handle_exec_timeout:1167:(pid 72061): cmd[0]: ACCESS_REG(0x805) "
             "recovered after timeout"]
    inc = one(lines)
    assert (inc.code, inc.action, inc.remedy, inc.last_line) == ("mlx5:cmd_timeout", "none", "observe", 2)
    # not recovered: the resource leak line follows the "No done completion"
    inc = one([lines[0], f"[262.2] mlx5_core {bus}: wait_func:1189:(pid 72061): ACCESS_REG(0x805) timeout. "
                         "Will cause a leak of a command resource"])
    assert (inc.action, inc.remedy) == ("reroute", "reboot-node")


def test_command_timeouts_after_a_health_fault_follow_it():
    bus = "0000:3b:00.0"
    lines = [f"[1.0] mlx5_core {bus}: poll_health:801:(pid 0): device's health compromised - reached miss count",
             f"[9.0] mlx5_core {bus}: wait_func:1155:(pid 31): QUERY_VPORT_STATE(0x750) timeout. Will cause a leak "
             "of a command resource",
             # another function's timeout is its own root
             "[9.5] mlx5_core 0000:3b:00.1: wait_func:1155:(pid 32): NOP(0x755) timeout. Will cause a leak of a "
             "command resource"]
    assert read(lines) == [("nic-device", bus, "mlx5:health_compromised", "reroute", "reboot-node", None),
                           ("nic-device", "0000:3b:00.1", "mlx5:cmd_timeout", "reroute", "reboot-node", None),
                           ("nic-device", bus, "mlx5:cmd_timeout", "none", "none", 0)]


# --- port modules (events.c, port.c) ---------------------------------------------------------

@pytest.mark.parametrize("line,code", [
    # 5.x/6.x events.c port_module: mlx5_core_err prefix
    ("[5001.2] mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 0, Cable error, "
     "High Temperature", "mlx5:cable_error:high_temperature"),
    ("mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 1, Cable error, "
     "Bus stuck (I2C or data shorted)", "mlx5:cable_error:bus_stuck"),
    ("mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 1, Cable error, "
     "Bad or shorted cable/module", "mlx5:cable_error:bad_or_shorted_cable"),
    ("mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 0, Cable error, "
     "Power budget exceeded", "mlx5:cable_error:power_budget_exceeded"),
    ("mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 0, Cable error, "
     "One or more network ports have been powered down due to insufficient/unadvertised power on the PCIe slot",
     "mlx5:cable_error:pcie_power_slot_exceeded"),
    # 4.11-4.19 port.c: mlx5_core_info, no prefix, "Bus stuck(I2C ...)" without the space
    ("Mar  1 01:02:03 h kernel: mlx5_core 0000:ca:00.0: Port module event[error]: module 0, Cable error, "
     "Bus stuck(I2C or data shorted)", "mlx5:cable_error:bus_stuck"),
    ("mlx5_core 0000:ca:00.0: Port module event[error]: module 2, Cable error, Long Range for non MLNX cable",
     "mlx5:cable_error:long_range_non_mlnx_cable"),
])
def test_module_errors_are_link_faults_needing_the_part(line, code):
    inc = one([line])
    assert (inc.domain, inc.device, inc.code, inc.action, inc.remedy, inc.known) == \
        ("nic-link", "0000:ca:00.0", code, "reroute", "replace-part", True)


def test_cable_over_temperature_explains_the_link_down_that_follows():
    lines = ["[10.0] mlx5_core 0000:ca:00.0 enp202s0f0np0: Link up",
             "[900.0] mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 0, "
             "Cable error, High Temperature",
             "[900.2] mlx5_core 0000:ca:00.0 enp202s0f0np0: Link down",
             "[901.0] mlx5_core 0000:ca:00.1 enp202s0f1np1: Link down"]  # the other port: its own fault
    got = read(lines)
    assert got[0] == ("nic-link", "0000:ca:00.0", "mlx5:cable_error:high_temperature", "reroute", "replace-part", None)
    assert ("nic-link", "enp202s0f0np0", "mlx5:link_down", "none", "none", 0) in got
    assert ("nic-link", "enp202s0f1np1", "mlx5:link_down", "reroute", "replace-part", None) in got


def test_unknown_module_error_type_is_an_incident_with_known_false():
    inc = one(["mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: module 0, Cable error, "
               "Unknown error"])
    assert (inc.domain, inc.code, inc.action, inc.known) == ("nic-link", "mlx5:cable_error", "reroute", False)


def test_cut_off_module_lines_never_raise():
    # a last line without its end: "Cable unpl..." says nothing yet; an error with its type cut is
    # still a module error, of a type the tables cannot name
    assert classify_text("[3.0] mlx5_core 0000:ca:00.0: Port module event: module 0, Cable unpl") == []
    (inc,) = classify_text("[3.0] mlx5_core 0000:ca:00.0: port_module:1100:(pid 0): Port module event[error]: "
                           "module 0, Cable error, High Temp")
    assert (inc.domain, inc.code, inc.action, inc.known) == ("nic-link", "mlx5:cable_error", "reroute", False)
    (inc,) = classify_text("mlx5_core 0000:ca:00.0: Port module event[error]: module 0, Cable error, Hig")
    assert (inc.code, inc.known) == ("mlx5:cable_error", False)


def test_module_disabled_is_a_configuration_matter_on_a_used_port():
    lines = ["[1.0] mlx5_core 0000:ca:00.0 ens1f0: Link up",
             "[50.0] mlx5_core 0000:ca:00.0: Port module event: module 0, Cable disabled",
             "[50.1] mlx5_core 0000:ca:00.0 ens1f0: Link down"]
    got = read(lines)
    assert got == [("nic-link", "0000:ca:00.0", "mlx5:cable_disabled", "reroute", "check-config", None),
                   ("nic-link", "ens1f0", "mlx5:link_down", "none", "none", 0)]


def test_insufficient_slot_power_report_is_platform_noise():
    lines = [f"[2.{n}] mlx5_core 0000:{b}:00.0: mlx5_pcie_event:301:(pid 10): Detected insufficient power on the PCIe "
             f"slot (27W)." for n, b in enumerate(("1b", "3c", "9d"))]
    inc = one(lines)
    assert (inc.domain, inc.code, inc.action, inc.count) == ("benign", "mlx5:insufficient_power", "none", 3)


def test_asic_temperature_warning_is_observed():
    inc = one(["mlx5_core 0000:ca:00.0: temp_warn:168:(pid 0): High temperature on sensors with bit set 0 1"])
    assert (inc.domain, inc.code, inc.action, inc.remedy) == ("nic-device", "mlx5:temp_warning", "none", "observe")


# --- PCI error recovery (main.c) --------------------------------------------------------------

def test_old_pci_error_recovery_that_recovered():
    bus = "0000:5e:00.0"
    lines = [f"[10.0] mlx5_core {bus}: mlx5_pci_err_detected was called",
             f"[10.0] mlx5_core {bus}: mlx5_error_sw_reset:252:(pid 9): PCI channel offline, stop waiting for NIC IFC",
             f"[11.0] mlx5_core {bus}: mlx5_pci_slot_reset was called",
             f"[12.0] mlx5_core {bus}: mlx5_pci_resume was called",
             f"[13.0] mlx5_core {bus}: mlx5_pci_resume: device recovered"]
    inc = one(lines)  # the offline line belongs to the recovery it is printed in
    assert (inc.domain, inc.device, inc.code, inc.action, inc.remedy, inc.last_line) == \
        ("nic-device", bus, "mlx5:pci_slot_reset", "none", "observe", 5)


def test_pci_error_recovery_that_failed():
    bus = "0004:01:00.0"
    lines = [f"[81.06] mlx5_core {bus}: mlx5_pci_err_detected Device state = 1 health sensors: 1 pci_status: 1. "
             "Enter, pci channel state = 2",
             f"[82.40] mlx5_core {bus}: mlx5_pci_slot_reset Device state = 2 pci_status: 0. Exit, err = 0, result = 5, "
             "recovered",
             f"[90.00] mlx5_core {bus}: mlx5_pci_resume Device state = 1 pci_status: 1. Done, err = -5, device Failed"]
    inc = one(lines)
    assert (inc.domain, inc.action, inc.remedy) == ("nic-device", "reroute", "reboot-node")


def test_pci_channel_offline_alone():
    inc = one(["mlx5_core 0000:31:00.0: mlx5_health_try_recover:340:(pid 8): health recovery flow aborted, "
               "PCI channel offline"])
    assert (inc.domain, inc.code, inc.action) == ("nic-device", "mlx5:pci_channel_offline", "reroute")


# --- port and link state (cache.c, en_main.c, vlan.c) ----------------------------------------------

def test_ib_port_down_on_a_renamed_rdma_device():
    lines = ["[3.0] mlx5_core 0000:08:00.1 rdmap8s0f1: Port: 2 Link ACTIVE",
             "[700.0] mlx5_core 0000:08:00.1 rdmap8s0f1: Port: 2 Link DOWN"]
    assert read(lines) == [("nic-link", "rdmap8s0f1/2", "mlx5:link_down", "reroute", "replace-part", None)]


def test_unknown_ib_port_state_is_an_incident_with_known_false():
    inc = one(["mlx5_core 0000:08:00.0 mlx5_0: Port: 1 Link UNKNOWN"])
    assert (inc.domain, inc.code, inc.device, inc.known) == ("unattributed", "mlx5:port_state_unknown", "mlx5_0/1", False)


def test_link_down_before_the_netdev_is_registered_names_the_function():
    inc = one(["[4.0] mlx5_core 0000:2a:00.0 (unnamed net_device) (uninitialized): Link down"])
    assert (inc.code, inc.device) == ("mlx5:link_down", "0000:2a:00.0")


def _open(t, dev):
    return f"Mar 27 15:37:{t:02d} node-a kernel: 8021q: adding VLAN 0 to HW filter on device {dev}"


def _up(t, dev, bus="0000:05:00.1"):
    return f"Mar 27 15:37:{t:02d} node-a kernel: mlx5_core {bus} {dev}: Link up"


def test_link_up_again_and_again_at_each_interface_open_is_configuration():
    lines = []
    for t in (1, 9, 17):
        lines += [_up(t, "ens2f1"), _open(t, "ens2f1")]
    assert read(lines) == [("config", "ens2f1", "mlx5:link_up", "none", "check-config", None)]
    assert classify(lines)[0].count == 3


def test_one_link_up_at_open_or_repeats_without_opens_are_normal():
    assert classify([_up(1, "ens2f1"), _open(1, "ens2f1")]) == []
    assert classify([_up(1, "ens2f1"), _up(30, "ens2f1")]) == []
    # opens of another interface say nothing about this one
    assert classify([_up(1, "ens2f1"), _open(1, "ens2f0"), _up(9, "ens2f1"), _open(9, "ens2f0")]) == []


def test_link_down_after_a_device_fault_follows_it():
    bus = "0000:3b:00.0"
    lines = [f"[1.0] mlx5_core {bus} ens3f0: Link up",
             f"[50.0] mlx5_core {bus}: poll_health:786:(pid 0): Fatal error 1 detected",
             f"[50.5] mlx5_core {bus} ens3f0: Link down"]
    assert read(lines) == [("nic-device", bus, "mlx5:fatal_error:pci_comm_err", "reroute", "reboot-node", None),
                           ("nic-device", "ens3f0", "mlx5:link_down", "none", "none", 0)]


# --- robustness --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "mlx5_core 0000:08:00.0: mlx5_cmd_out_err:838:(pid 1): CREATE_MKEY(0x200) op_mod(0x0) failed, status bad par",
    "mlx5_core 0000:08:00.0: poll_health:786:(pid 0): Fatal error ",
    "mlx5_core 0000:08:00.0: print_health_info:445:(pid 0): synd 0x",
    "mlx5_core 0000:08:00.0 mlx5_0: Port: 1 Link ",
    "mlx5_core 0000:08:00.0: wait_func:1155:(pid 3): TEARDOWN_HCA(0x1",
    "mlx5_core zz:08:00.0: poll_health:801:(pid 0): device's health compromised",
    "mlx5_core 0000:08:00.0: Port module event[error]: module , Cable error, High Temperature",
    "\x00mlx5_core 0000:08:00.0: \xff\xfe synd 0x1: firmware internal error",
])
def test_malformed_or_cut_lines_never_raise(text):
    rep = classify_report([text])
    assert rep.error is None
    rep = classify_report([text + "\n", text])  # repeated, the last one cut off
    assert rep.error is None


@pytest.mark.parametrize("line", [
    "[4428.43] bond0: (slave enp83s0f0np0): link status definitely down, disabling slave",
    "Jan  2 03:04:05 h kernel: bond0: link status definitely down for interface enp83s0f0np0, disabling it",
])
def test_bond_slave_down_is_a_link_fault_of_a_port_in_use(line):
    assert read([line]) == [("nic-link", "enp83s0f0np0", "mlx5:link_down", "reroute", "replace-part", None)]


def test_bond_slave_back_up_after_one_loss_is_observed():
    lines = ["[1.0] bond0: (slave ens1f0): link status definitely down, disabling slave",
             "[9.0] bond0: (slave ens1f0): link status definitely up, 100000 Mbps full duplex"]
    assert read(lines) == [("nic-link", "ens1f0", "mlx5:link_down", "reroute", "observe", None)]
