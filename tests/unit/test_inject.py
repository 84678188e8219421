"""`linkpass inject device-fault`: argument errors (one line, exit 2) and the evidence it writes."""

from __future__ import annotations

import json

import pytest

from linkpass.cli import app as cli
from linkpass.lab import inject
from linkpass.lab import fabric as fab
from linkpass.core.classify import classify_text


@pytest.mark.parametrize("argv, why", [
    (["inject"], "say which fault"),
    (["inject", "link-fault", "--host", "0", "--gpu", "0"], "unknown fault kind"),
    (["inject", "device-fault", "--gpu", "0"], "--host is required"),
    (["inject", "device-fault", "--host", "x", "--gpu", "0"], "--host must be an integer"),
    (["inject", "device-fault", "--host", "0", "--gpu", "9"], "--gpu must be 0..7"),
    (["inject", "device-fault", "--host", "0", "--gpu", "0", "--xid", "0"], "--xid must be 1..999"),
    (["inject", "device-fault", "--host", "0", "--gpu", "0", "--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_one_line_exit_2(argv, why, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and why in err, err


def test_unknown_fabric_and_host_out_of_range(monkeypatch, tmp_path, capsys):
    def load(name):
        if name != "lp":
            raise fab.FabricError(f"no fabric named {name}")
        return {"hosts": [{"control_socket": str(tmp_path / "h0.sock")}, {"control_socket": str(tmp_path / "h1.sock")}]}
    monkeypatch.setattr(fab, "load", load)
    assert cli.main(["inject", "device-fault", "--host", "0", "--gpu", "0", "--name", "zz"]) == 2
    assert cli.main(["inject", "device-fault", "--host", "2", "--gpu", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no fabric named zz" in err[0] and "--host must be 0..1" in err[1]
    # a good one: a kmsg record the classifier reads as a GPU fault on GPU 1's bus id
    assert cli.main(["inject", "device-fault", "--host", "1", "--gpu", "1", "--xid", "79", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"host", "gpu", "pci", "xid", "kmsg", "line", "t_issued_ns"}
    assert out["pci"] == "0000:19:00.0" and out["kmsg"] == str(tmp_path / "h1.kmsg")
    rec = (tmp_path / "h1.kmsg").read_text()
    assert rec.startswith("3,1,") and ";NVRM: Xid (PCI:0000:19:00): 79," in rec
    # by default one line for a person, no JSON
    assert cli.main(["inject", "device-fault", "--host", "1", "--gpu", "0"]) == 0
    out = capsys.readouterr().out
    assert out == (f"injected Xid 79 on host 1 GPU 0 (0000:18:00.0): appended to {tmp_path / 'h1.kmsg'}, which that "
                   "host's daemon follows (`linkpass status` counts its device incidents)\n")
    assert (tmp_path / "h1.kmsg").read_text().splitlines()[1].startswith("3,2,")


def test_fake_pci_ids_map_back_to_gpu_indexes():
    m = inject.gpu_map()
    assert m["0000:18:00.0"] == 0 and m["0000:1f:00.0"] == 7 and len(m) == inject.MAX_GPUS
    for g in range(inject.MAX_GPUS):
        assert inject.fake_pci_bus_id(g) in m
    inc = classify_text("3,7,100,-;" + inject.xid_line(2, 79) + "\n")
    assert [(i.domain, i.device, i.code, i.action) for i in inc] == [("gpu", "0000:1a:00.0", "xid:79", "migrate-rank")]


def test_daemon_maps_a_fabric_pci_id_to_the_registered_gpu_index(tmp_path):
    from linkpass.daemon import gpu_index
    from linkpass.lab.fabric.fabric import _host_config

    # the config the fabric writes for a host carries its GPU map; the daemon reads only that
    desc = {"mode": "notify-only", "notice_key_file": str(tmp_path / "k"), "hold_down_ms": 300,
            "hosts": [{"index": 0, "name": "h0", "host_ip": "198.19.0.1", "control_socket": str(tmp_path / "h0.sock"),
                       "rails": []}]}
    gpus = _host_config(desc, 0)["device"]["gpus"]
    assert gpu_index("0000:18:00.0", overrides=gpus) == 0
    assert gpu_index("0000:19:00.0", overrides=gpus) == 1
    assert gpu_index("00000000:19:00.0", overrides=gpus) == 1  # NVML's 8-digit domain
    assert gpu_index("0000:91:00.0", overrides=gpus) is None
    assert gpu_index("0000:18:00.0") is None  # no map, no NVML, no topology


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_device_fault_help_prints_its_options_exit_0(flag, capsys):
    assert cli.main(["inject", "device-fault", flag]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: linkpass inject device-fault")
    for opt in ("--host I", "--gpu G", "--xid N", "--name NAME"):
        assert opt in out


@pytest.mark.parametrize("argv, why", [
    (["inject", "counters", "--rail", "0"], "--host is required"),
    (["inject", "counters", "--host", "0"], "say what climbs: --rail R or --gpu G"),
    (["inject", "counters", "--host", "0", "--rail", "0", "--gpu", "0"], "not allowed with argument"),
    (["inject", "counters", "--host", "0", "--rail", "0", "--rate", "x"],
     "--rate must be a number above 0 and at most 10000000 (increase per second), got 'x'"),
    (["inject", "counters", "--host", "0", "--rail", "0", "--for", "0"],
     "--for must be a number above 0 and at most 3600 (seconds), got '0'"),
    (["inject", "counters", "--host", "0", "--rail", "0", "--rate", "nan"], "--rate must be a number above 0"),
    (["inject", "counters", "--host", "0", "--rail", "0", "--add", "0"], "--add must be 1.."),
    (["inject", "counters", "--host", "0", "--rail", "0", "--name", "nosuchfabric"], "nosuchfabric"),
])
def test_counters_bad_arguments_one_line_exit_2(argv, why, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and why in err, err


@pytest.mark.parametrize("argv, why, other", [
    (["--rate", "abc"], "--rate must be a number", "--for"),  # a bad value is said first, alone
    (["--host", "0", "--rail", "0", "--rate", "abc"], "got 'abc'", "--for"),
    (["--host", "0", "--rail", "0", "--for", "x"], "--for must be a number", "--rate"),
])
def test_counters_a_bad_number_names_only_its_own_option(argv, why, other, capsys):
    rc = cli.main(["inject", "counters", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and other not in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_counters_climb_in_the_hosts_tree_and_the_poller_reads_them(tmp_path, monkeypatch, capsys):
    from linkpass.adapters.counters import CounterPoller
    from linkpass.adapters.risk_source import rail_sources_from_sysfs
    from linkpass.lab.fabric import counters as fc

    desc = {"state_dir": str(tmp_path), "hosts": [{"rails": [{"rail": 0, "netdev": "rail0"}, {"rail": 1, "netdev": "rail1"}]}]}
    monkeypatch.setattr(fab, "load", lambda name: desc)
    fc.build(desc, 0)
    assert cli.main(["inject", "counters", "--host", "0", "--rail", "1", "--counter", "symbol_error", "--add", "7", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["from"], r["to"], r["counter"]) == (0, 7, "symbol_error")
    assert cli.main(["inject", "counters", "--host", "0", "--gpu", "1", "--add", "3"]) == 0
    assert "raised aer_correctable of host 0 gpu 1 from 0 to 3" in capsys.readouterr().out
    assert cli.main(["inject", "counters", "--host", "0", "--rail", "0", "--counter", "bogus", "--add", "1"]) == 2
    assert "not a rail counter" in capsys.readouterr().err
    root = fc.tree_root(desc, 0)
    samples, problems = CounterPoller(rail_sources_from_sysfs(root, {0: "rail0", 1: "rail1"}), [], root=root).poll()
    got = {(s.subject, s.counter): s.value for s in samples}
    assert got[(1, "symbol_error")] == 7 and got[(0, "symbol_error")] == 0 and problems == []
