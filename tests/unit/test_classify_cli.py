"""`linkpass classify`: JSON lines, table, stdin, several files, --topology, bad input (exit 2)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path


from linkpass.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
GB200 = CORPUS / "kernel_logs" / "gpud_gb200_xid149_nvlink5_xid154_recovery_action.log"
ROCE = CORPUS / "kernel_logs" / "roce_bond_slave_mlx5_3_flapping_sxid22013.log"
LIT = CORPUS / "nccl_errors" / "litllama380_port_error_all_ranks_node48_then_remote_error12.log"
FIELDS = ["domain", "device", "code", "action", "remedy", "secondary_of", "first_line", "last_line", "known"]


def run_cli(argv, capsys, stdin: bytes | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    rc = main(["classify", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_lines(capsys):
    rc, out, err = run_cli(["--json", str(GB200)], capsys)
    assert rc == 0 and err == ""
    rows = [json.loads(x) for x in out.splitlines()]
    assert len(rows) == 6 and all(list(r) == FIELDS for r in rows)
    assert rows[0] == {"domain": "nvlink", "device": "0009:01:00.0", "code": "xid:149", "action": "migrate-rank",
                       "remedy": "drain-node", "secondary_of": None, "first_line": 2, "last_line": 7, "known": True}


def test_table_exit_0_with_faults(capsys):
    rc, out, err = run_cli([str(ROCE)], capsys)
    assert rc == 0
    assert "mlx5_3/1" in out and "mlx5:link_down" in out and "reroute" in out and "replace-part" in out
    assert "2 incident(s), 2 root(s)" in out


def test_table_without_incidents(capsys, tmp_path):
    f = tmp_path / "quiet.log"
    f.write_text("[  1.0] Linux version 6.1\n[  2.0] EXT4-fs mounted\n")
    rc, out, _ = run_cli([str(f)], capsys)
    assert rc == 0 and "no incidents in 2 line(s)" in out


def test_stdin(capsys, monkeypatch):
    rc, out, _ = run_cli(["--json", "-"], capsys, stdin=GB200.read_bytes(), monkeypatch=monkeypatch)
    assert rc == 0 and len(out.splitlines()) == 6
    rc, out, _ = run_cli(["--json"], capsys, stdin=GB200.read_bytes(), monkeypatch=monkeypatch)
    assert rc == 0 and len(out.splitlines()) == 6


def test_several_files_are_one_hosts_evidence(capsys, tmp_path):
    nccl = tmp_path / "nccl.log"
    nccl.write_text("h:1:2 [0] NCCL WARN NET/IB : Got completion from peer x<1> with status=12 opcode=0 len=0 "
                    "vendor err 129 (Recv) hca mlx5_3\n")
    rc, out, _ = run_cli(["--json", str(ROCE), str(nccl)], capsys)
    rows = [json.loads(x) for x in out.splitlines()]
    assert rc == 0
    wc = next(r for r in rows if r["code"] == "ibv_wc:12")
    assert rows[wc["secondary_of"]]["device"] == "mlx5_3/1" and wc["domain"] == "nic-link"
    assert wc["first_line"] == len(ROCE.read_text().splitlines()) + 1
    rc, out, _ = run_cli(["--json", str(nccl)], capsys)
    assert json.loads(out)["domain"] == "unattributed"


def test_topology(capsys):
    topo = CORPUS / "ib_tools" / "dgxh100_like_ibdev2netdev_8ib_3eth.txt"
    rc, out, _ = run_cli(["--json", "--topology", str(topo), str(CORPUS / "kernel_logs" / "gpud_hgx_h100_boot_mlx5_enumeration_ports_down.log")], capsys)
    rows = [json.loads(x) for x in out.splitlines()]
    assert rc == 0 and rows and all(r["domain"] == "benign" for r in rows)


def test_missing_file(capsys, tmp_path):
    rc, out, err = run_cli([str(ROCE), str(tmp_path / "nope.log")], capsys)
    assert rc == 2 and out == ""
    assert err.strip() == f"linkpass classify: {tmp_path / 'nope.log'}: no such file"


def test_binary_file(capsys, tmp_path):
    f = tmp_path / "core.bin"
    f.write_bytes(b"\x7fELF\x00\x00\x01" + bytes(range(256)))
    rc, out, err = run_cli([str(f)], capsys)
    assert rc == 2 and err.strip() == f"linkpass classify: {f}: binary data, not a log"
    assert "Traceback" not in err


def test_directory(capsys, tmp_path):
    rc, _, err = run_cli([str(tmp_path)], capsys)
    assert rc == 2 and err.strip() == f"linkpass classify: {tmp_path}: is a directory"


def test_devices_are_refused_unread_and_a_fifo_without_writer_does_not_hang(capsys, tmp_path):
    rc, _, err = run_cli(["/dev/zero"], capsys)  # no end: reading it up to the cap would be 256 MiB of NULs
    assert rc == 2 and err.strip() == "linkpass classify: /dev/zero: not a regular file (a character device)"
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    rc, out, _ = run_cli([str(fifo)], capsys)
    assert rc == 0 and "no incidents in 0 line(s)" in out


def test_unreadable_topology(capsys, tmp_path):
    rc, _, err = run_cli(["--topology", str(tmp_path / "none.txt"), str(ROCE)], capsys)
    assert rc == 2 and err.startswith("linkpass classify: --topology: ") and "no such file" in err
    assert len(err.strip().splitlines()) == 1


def test_undecodable_lines_are_reported_not_fatal(capsys, tmp_path):
    f = tmp_path / "mixed.log"
    f.write_bytes(LIT.read_bytes() + b"\n\xff\xfe garbage\n")
    rc, out, err = run_cli(["--json", str(f)], capsys)
    assert rc == 0 and "skipped 1 unreadable line(s)" in err
    assert [json.loads(x)["code"] for x in out.splitlines()] == ["ibv_event:port_err", "ibv_wc:12"]


def test_console_script_subprocess():
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "classify", "--json", str(LIT)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 2


def test_bus_ids_are_printed_as_they_are(capsys, tmp_path):
    f = tmp_path / "k.log"  # rich would turn ":ab:" into an emoji shortcode
    f.write_text("[ 1.0] NVRM: Xid (PCI:0000:ab:00): 79, pid=1, name=p, GPU has fallen off the bus.\n"
                 "[ 2.0] NVRM: Xid (PCI:0000:ab:00): 999, pid=1, name=p, x\n")
    rc, out, err = run_cli([str(f)], capsys)
    assert rc == 0 and "0000:ab:00.0" in out and "\U0001f18e" not in out
    assert "xid:999 (unknown code)" in out
