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
