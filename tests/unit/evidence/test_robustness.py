"""classify_report and `linkpass classify` on input that is not a tidy log: truncated, binary,
huge, one enormous line, empty, NUL runs.  Always a clear result (Classification.error None,
unreadable lines counted in ``skipped``) or a clear error, never a traceback, and no line is
lost without being counted: every input line is in a record, counted as skipped, or blank."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest

from linkpass.cli import main
from linkpass.core.classify import classify, classify_report, classify_text
from linkpass.core.logparse import MAX_LINE, MAX_TOKEN, parse_lines, strip_prefixes

CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
LOGS = sorted(k for k, v in EXPECTED.items() if v.get("kind") == "log")

XID79 = "NVRM: Xid (PCI:0000:c4:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
LINK = "mlx5_core 0000:5a:00.1 ens2f1np1: Link down"


def accounted(lines: list) -> None:
    """No silent loss: each line is part of a record, skipped, or holds no message."""
    p = parse_lines(lines)
    covered = {n for r in p.records for n in range(r.first_line, r.last_line + 1)} | set(p.skipped)
    for n, raw in enumerate(lines, 1):
        if n in covered:
            continue
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        pieces = text.replace("\r", "\x00").replace("\n", "\x00").split("\x00")
        assert all(not strip_prefixes(x)[0] for x in pieces), (n, text[:200])


def ok(lines) -> "object":
    rep = classify_report(lines)
    assert rep.error is None
    for i in rep.incidents:
        assert 1 <= i.first_line <= i.last_line <= max(rep.lines, 1)
    return rep


# --- empty ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("lines", [[], [""], ["\n"], ["\r\n"] * 5, [" \t "], [b""], ["\x00"], ["\ufeff"]])
def test_empty_input_is_no_incidents_without_error(lines):
    rep = ok(lines)
    assert rep.incidents == [] and rep.skipped == [] and rep.lines == len(lines)
    assert classify_text("") == [] and classify_text(b"") == []


# --- truncated ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", LOGS)
def test_corpus_log_cut_anywhere(rel):
    data = (CORPUS / rel).read_bytes()
    rnd = random.Random(rel)
    for cut in sorted({rnd.randrange(1, len(data)) for _ in range(6)} | {len(data) - 1}):
        part = data[:cut]  # may end inside a line and inside a UTF-8 sequence
        lines = part.decode("utf-8", "replace").splitlines(keepends=True)
        rep = ok(lines)
        assert rep.lines == len(lines)
        accounted(lines)


def test_xid_code_cut_short_is_not_read_as_another_code():
    full = "[ 7.25] " + XID79
    for k in range(len("[ 7.25] NVRM: Xid (PCI:0000:c4:00): 7"), len(full)):
        incs = classify(["[ 7.00] " + LINK + "\n", full[:k]])
        assert "xid:7" not in {i.code for i in incs}


# --- binary ---------------------------------------------------------------------------------------

def test_random_bytes_are_skipped_and_counted():
    blob = random.Random(7).randbytes(200_000)
    lines = blob.split(b"\n")
    rep = ok(lines)
    assert rep.lines == len(lines) and rep.skipped and set(rep.skipped) <= set(range(1, len(lines) + 1))
    accounted(lines)


def test_evidence_between_binary_lines_is_read():
    rnd = random.Random(11)
    junk = [bytes(rnd.randrange(1, 32) for _ in range(80)) for _ in range(50)]
    lines = junk[:25] + [("[ 9.5] " + XID79).encode()] + junk[25:] + [b"\xff\xfe\xfa" * 10 + b" " + LINK.encode()]
    rep = ok(lines)
    assert [(i.code, i.first_line) for i in rep.incidents] == [("xid:79", 26)]
    assert 52 in rep.skipped and 26 not in rep.skipped


def test_a_few_undecodable_bytes_in_a_line_of_text_do_not_hide_it():
    # a process name in Latin-1 inside an Xid line: the line is read, the bytes as "?"
    rep = ok([("[ 9.5] " + XID79).encode().replace(b"fallen", b"f\xe9llen"), b"\xff\xfe\xfa " + LINK.encode()])
    assert [i.code for i in rep.incidents] == ["xid:79", "mlx5:link_down"] and rep.skipped == []


def test_items_that_are_not_lines_are_counted():
    rep = ok([None, 42, {"log": LINK}, "[ 1.0] " + LINK, 3.5])
    assert rep.skipped == [1, 2, 3, 5] and [i.code for i in rep.incidents] == ["mlx5:link_down"]


def test_lone_surrogates_and_odd_unicode_do_not_break_the_reading():
    rep = ok(["[ 1.0] \ud800 " + LINK, "[ 2.0] \u2028\u0085 " + XID79, "\U0001F600" * 1000])
    assert {i.code for i in rep.incidents} == {"mlx5:link_down", "xid:79"}
    json.dumps([i.to_json() for i in rep.incidents])


def test_an_input_that_fails_while_read_is_an_error_not_no_incidents():
    def broken():
        yield "[ 1.0] " + LINK
        raise OSError("disk read error")

    rep = classify_report(broken())
    assert rep.error and "disk read error" in rep.error and rep.incidents == []


# --- huge -----------------------------------------------------------------------------------------

def flood(n: int):
    """n journal lines: a link flapping on two ports, an Xid repeated, and noise."""
    for i in range(n):
        k = i % 2
        if i % 50 == 0:
            yield f"Mar 05 07:{i // 6000 % 60:02d}:{i // 100 % 60:02d} gpu-node-3 kernel: mlx5_core 0000:5a:00.{k} ens2f{k}np{k}: Link down\n"
        elif i % 50 == 1:
            yield f"Mar 05 07:{i // 6000 % 60:02d}:{i // 100 % 60:02d} gpu-node-3 kernel: mlx5_core 0000:5a:00.{k} ens2f{k}np{k}: Link up\n"
        elif i % 997 == 0:
            yield f"[{i / 10:.6f}] " + XID79 + "\n"
        else:
            yield f"[{i / 10:.6f}] systemd[1]: Started session {i} of user root.\n"


def test_200k_lines_from_a_generator_complete_and_repeats_collapse():
    rep = ok(flood(200_000))
    assert rep.lines == 200_000 and rep.skipped == []
    assert rep.recognised > 8000
    # one incident per code and device, not per line
    assert len(rep.incidents) == len({(i.code, i.device) for i in rep.incidents}) <= 5


def test_memory_grows_with_the_records_not_faster():
    """By design the parser holds one record per message and the builder one incident per code
    and device: the peak is linear in the input (measured on 20k lines: a few hundred bytes a
    line), never a copy of the input per line."""
    tracemalloc.start()
    try:
        ok(flood(20_000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20_000 * 2048


def test_one_10_mb_line_is_read_to_its_end():
    filler = "payload chunk 0123456789 abcdefghij " * (10_000_000 // 36)
    line = "[ 3.0] " + LINK + " " + filler + " [ 3.5] " + XID79
    p = parse_lines([line])
    assert p.long_lines == [1] and p.skipped == [] and all(len(r.msg) <= MAX_LINE for r in p.records)
    rep = ok([line, "[ 4.0] " + LINK])
    assert "xid:79" in {i.code for i in rep.incidents}


def test_one_10_mb_word_is_shortened_and_counted():
    blob = "QUJDRA" * (10_000_000 // 6)  # a base64 payload on one line
    p = parse_lines(["[ 1.0] " + LINK, "data=" + blob + " [ 2.0] " + XID79])
    assert p.shortened == [2] and p.skipped == []
    assert max(len(w) for r in p.records for w in r.msg.split()) <= MAX_TOKEN + len("data=")
    assert {i.code for i in classify(["[ 1.0] " + LINK, "data=" + blob + " [ 2.0] " + XID79])} >= {"xid:79"}


# --- NUL runs -------------------------------------------------------------------------------------

def test_nul_runs_are_padding_between_lines():
    lines = ["[ 1.0] " + LINK + "\n", "\x00" * 4096 + "[ 2.0] " + XID79 + "\n", "\x00" * 100_000, "[ 3.0] " + LINK + "\x00\x00\n"]
    rep = ok(lines)
    assert [(i.code, i.first_line) for i in rep.incidents][:2] in ([("xid:79", 2), ("mlx5:link_down", 1)],
                                                                   [("mlx5:link_down", 1), ("xid:79", 2)])
    assert rep.skipped == []
    accounted(lines)
    assert classify_text(b"\x00" * 1_000_000) == []


# --- the command ----------------------------------------------------------------------------------

def run_cli(argv, capsys):
    rc = main(["classify", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_binary_file_is_refused_in_one_line(tmp_path, capsys):
    f = tmp_path / "core.bin"
    f.write_bytes(random.Random(3).randbytes(100_000))
    rc, out, err = run_cli([str(f)], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("content", [b"", b"\x00" * 70_000, b"\n\n\n", (b"x" * 3_000_000) + b"\n[ 1.0] " + LINK.encode(),
                                     b"[ 1.0] " + LINK.encode() + b"\r\n" + b"\xff\xfe\n" + b"[ 2.0] " + XID79.encode()[:40]])
def test_cli_odd_files_exit_0_with_json(tmp_path, capsys, content):
    f = tmp_path / "kern.log"
    f.write_bytes(content)
    rc, out, err = run_cli(["--json", str(f)], capsys)
    assert rc == 0 and "Traceback" not in err
    rows = [json.loads(x) for x in out.splitlines()]
    assert all(set(r) >= {"domain", "device", "code", "first_line", "last_line"} for r in rows)
    if b"\xff\xfe" in content:
        assert "skipped 1 unreadable line(s) (first: line 2)" in err
