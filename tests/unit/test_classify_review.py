"""Fresh-user review of the classifier and `linkpass classify`: NUL padding (a kern.log after a
power loss), the 256 MiB cut (a warning, never silent), an NCCL completion error naming another
HCA than the kernel link-down, multi-line NVRM messages whose lines carry their own prefix, and
the Xid line's own format (cut-off code, old driver format)."""

from __future__ import annotations

import json
from pathlib import Path

from linkpass.cli import classify as classify_cli
from linkpass.cli import main
from linkpass.core.classify import classify, classify_text
from linkpass.core.logparse import parse_lines

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
ROCE = CORPUS / "kernel_logs" / "roce_bond_slave_mlx5_3_flapping_sxid22013.log"
RETRY = CORPUS / "nccl_errors" / "nccl1405_roce_status12_vendor129_retry_exceeded.log"
NOBUS = CORPUS / "kernel_logs" / "nvsentinel_issue155_fallen_off_bus_no_xid_probe_fail.log"
XID79 = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def run_cli(argv, capsys):
    rc = main(["classify", *argv])
    out, err = capsys.readouterr()
    return rc, [json.loads(x) for x in out.splitlines()] if "--json" in argv else out, err


# -- 4: NUL padding and the size limit -------------------------------------------------------------

def test_nul_padding_after_power_loss_is_not_binary_and_the_xid_after_it_is_read(capsys, tmp_path):
    f = tmp_path / "kern.log"
    # a line cut by the power loss, a block of NULs where the file system had allocated space, the
    # next boot's lines (one of them glued to the NUL run, as syslog appends after it)
    f.write_bytes(b"[  12.000001] mlx5_core 0000:53:00.0: firmware ver" + b"\x00" * 6000
                  + b"[  13.000002] " + XID79.encode() + b"\n" + b"\x00" * 100 + b"\n[  14.0] random: crng init done\n")
    rc, incs, err = run_cli(["--json", str(f)], capsys)
    assert rc == 0, err
    assert [(i["code"], i["device"], i["action"], i["first_line"]) for i in incs] == [("xid:79", "0000:91:00.0", "migrate-rank", 1)]
    assert err == ""


def test_nul_runs_split_a_line_in_the_parser_with_one_line_number():
    p = parse_lines(["[1.0] first\x00\x00\x00[2.0] " + XID79, "\x00\x00\x00", "[3.0] third"])
    assert [(r.first_line, r.msg) for r in p.records] == [(1, "first"), (1, XID79), (3, "third")]
    assert p.skipped == []


def test_mostly_binary_input_is_still_refused(capsys, tmp_path):
    f = tmp_path / "kern.log.gz"
    f.write_bytes(bytes(range(1, 32)) * 300 + b"\x00" * 100)
    rc, _, err = run_cli([str(f)], capsys)
    assert rc == 2 and err.strip() == f"linkpass classify: {f}: binary data, not a log"
    g = tmp_path / "zeros.log"  # nothing but padding: an empty log, not binary data
    g.write_bytes(b"\x00" * 10000)
    rc, out, err = run_cli([str(g)], capsys)
    assert rc == 0 and "no incidents" in out


def test_input_over_the_limit_is_cut_at_a_line_with_a_warning(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(classify_cli, "MAX_BYTES", 300)
    f = tmp_path / "big.log"
    head = "".join(f"[{i}.0] filler line number {i:04d}\n" for i in range(1, 8))
    f.write_text(head + "[99.0] " + XID79 + "\n" + "x" * 500 + "\n")
    rc, incs, err = run_cli(["--json", str(f)], capsys)
    assert rc == 0 and incs == []  # the Xid is past the cut
    (line,) = err.strip().splitlines()
    cut = len(head.encode())
    assert line == (f"linkpass classify: warning: {f}: input truncated: only the first {cut} bytes (7 lines) were classified; "
                    f"the rest (from byte {cut}) was not read (limit 0 MiB: cut the log to the time of interest)")
    monkeypatch.setattr(classify_cli, "MAX_BYTES", 10_000)
    rc, incs, err = run_cli(["--json", str(f)], capsys)
    assert err == "" and [i["code"] for i in incs] == ["xid:79"]


# -- 5: an NCCL completion error names its HCA ------------------------------------------------------

def _nccl_naming(tmp_path, hca: str) -> Path:
    line = next(x for x in RETRY.read_text().splitlines() if "Got completion from peer" in x)
    f = tmp_path / f"nccl-{hca}.log"
    f.write_text(line + f" hca {hca}\n")
    return f


def test_completion_error_on_another_hca_is_not_charged_to_a_link_down(capsys, tmp_path):
    rc, incs, _ = run_cli(["--json", str(ROCE), str(_nccl_naming(tmp_path, "mlx5_5"))], capsys)
    assert rc == 0
    wc = [i for i in incs if i["code"] == "ibv_wc:12"]
    assert [(i["domain"], i["device"], i["secondary_of"], i["action"]) for i in wc] == [("unattributed", "mlx5_5", None, "none")]
    assert any(i["code"] == "mlx5:link_down" and i["device"] == "mlx5_3/1" for i in incs)


def test_completion_error_on_the_same_hca_follows_its_link_down(capsys, tmp_path):
    rc, incs, _ = run_cli(["--json", str(ROCE), str(_nccl_naming(tmp_path, "mlx5_3"))], capsys)
    assert rc == 0
    (wc,) = [i for i in incs if i["code"] == "ibv_wc:12"]
    root = incs[wc["secondary_of"]]
    assert (wc["domain"], root["code"], root["device"]) == ("nic-link", "mlx5:link_down", "mlx5_3/1")


# -- 6: multi-line NVRM messages whose lines carry their own prefix --------------------------------

def _fallen_lines() -> list[str]:
    """The corpus's multi-line "fallen off the bus" message, without its prefixes."""
    lines = [x for x in NOBUS.read_text().splitlines() if "NVRM:" in x][:3]
    return [x[x.index("NVRM:"):] for x in lines]


def test_fallen_off_the_bus_with_a_stamp_on_every_line():
    parts = _fallen_lines()
    assert parts[0] == "NVRM: The NVIDIA GPU 0000:b3:00.0" and "fallen off the bus" in parts[2]
    for fmt in ("[ 1843.30814{i}] {m}", "10.0.0.7: kern: warning: [2026-04-22T21:25:20.4{i}Z]: {m}",
                "2026-04-22T21:25:20,40{i}+00:00 node7 kernel: {m}", "6,{i}1,184330814{i},-;{m}"):
        lines = [fmt.format(i=i, m=m) for i, m in enumerate(parts)] + [fmt.format(i=5, m="NVRM: loading NVIDIA module")]
        incs = classify(lines)
        assert [(i.code, i.device, i.action, i.first_line, i.last_line) for i in incs] == \
            [("nvrm:fallen_off_bus", "0000:b3:00.0", "migrate-rank", 1, 3)], fmt


def test_prefixed_nvrm_lines_that_are_separate_messages_are_not_joined():
    recs = parse_lines(["[1.0] NVRM: GPU at PCI:0000:91:00: GPU-00000006-0000",
                        "[1.0] NVRM: GPU Board Serial Number: 1000000000005",
                        "[1.0] NVRM: A GPU crash dump has been created.",
                        "[1.0] NVRM: nvidia-bug-report.sh as root",
                        "[9.0] NVRM: (late) not the same message"]).records
    assert [r.first_line for r in recs] == [1, 2, 3, 4, 5]


# -- 7: the Xid line's format -----------------------------------------------------------------------

def test_cut_off_xid_code_is_not_trusted_but_old_format_is_read(tmp_path, capsys):
    cut = "[5.0] NVRM: Xid (PCI:0000:91:00): 7"
    assert classify_text("[4.0] boot\n" + cut) == []          # cut off (no line end): maybe 79
    assert [i.code for i in classify_text("[4.0] boot\n" + cut + ", pid=1, PTE error\n")] == ["xid:7"]
    assert [i.code for i in classify_text("[4.0] boot\n" + XID79[:XID79.index(",")])] == []  # "...: 79" cut: not trusted either
    assert [i.code for i in classify_text("[4.0] boot\n" + XID79[:40])] == ["xid:79"]  # the comma ends the code
    old = classify_text("[4.0] NVRM: Xid (0000:03:00): 79\n[4.1] NVRM: Xid (0000:04:00): 48, DBE\n")
    assert [(i.code, i.device, i.action) for i in old] == [("xid:79", "0000:03:00.0", "migrate-rank"),
                                                          ("xid:48", "0000:04:00.0", "migrate-rank")]
    f = tmp_path / "cut.log"
    f.write_text("[4.0] boot\n" + cut)
    rc, incs, _ = run_cli(["--json", str(f)], capsys)
    assert rc == 0 and incs == []
