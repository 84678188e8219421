"""linkpass.core.logparse: lines as tools and people carry them.  Each case is built from the
producer's format (named next to it, see the module docstring), not copied from a corpus file;
the corpus is used for the generality checks at the end (shuffled and concatenated logs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from linkpass.core.classify import classify, classify_report
from linkpass.core.evidence.builder import events
from linkpass.core.logparse import MAX_LINE, Record, parse_lines, strip_prefixes

CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
LOGS = sorted(k for k, v in EXPECTED.items() if v.get("kind") == "log")

# messages of three families, as their producers print them
XID = "NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr 0x2a7b6c000."
LINK = "mlx5_core 0000:5a:00.1 ens2f1np1: Link down"
NCCL = "trainer-07:41234:41390 [2] transport/net_ib.cc:101 NCCL WARN NET/IB : mlx5_2:1 Got async event : port error"
MSGS = {"xid": XID, "link": LINK, "nccl": NCCL}


def reading(lines, shift: int = 0) -> set:
    """The incidents as a set, each secondary naming its root (code, device, first line)."""
    incs = [i.to_json() for i in classify(lines)]
    out = set()
    for i in incs:
        r = incs[i["secondary_of"]] if i["secondary_of"] is not None else None
        out.add((i["domain"], i["device"], i["code"], i["action"], i["remedy"], i["first_line"] + shift, i["last_line"] + shift,
                 None if r is None else (r["code"], r["device"], r["first_line"] + shift)))
    return out


def bare(msg: str) -> list[tuple]:
    got = [(i.domain, i.device, i.code, i.action, i.remedy) for i in classify([msg])]
    assert got, msg  # the message itself must be evidence, or the wrapped cases test nothing
    return got


# --- one line, one prefix -------------------------------------------------------------------------
# (format with {m} for the message, ts, clock); ts None: not checked or none
PREFIXES = {
    # util-linux dmesg.c print_record()
    "dmesg-raw": ("[ 5123.004417] {m}", 5123.004417, "mono"),
    "dmesg-raw-wide": ("[12345678.000100] {m}", 12345678.0001, "mono"),
    "dmesg-level-raw": ("<3>[  811.250001] {m}", 811.250001, "mono"),  # dmesg -r
    "dmesg-delta": ("[  811.250001 <    0.000120>] {m}", 811.250001, "mono"),  # dmesg -d
    "dmesg-reltime-head": ("[Mar 7 14:02] {m}", None, None),
    "dmesg-reltime": ("[  +0.000512] {m}", None, None),
    "dmesg-ctime": ("[Tue Mar  5 07:08:09 2024] {m}", 1709622489.0, "wall"),
    "dmesg-iso": ("2024-03-05T07:08:09,250000+01:00 {m}", 1709618889.25, "wall"),
    "dmesg-decode-raw": ("kern  :err   : [ 5123.004417] {m}", 5123.004417, "mono"),
    "dmesg-decode-ctime": ("kern  :warn  : [Tue Mar  5 07:08:09 2024] {m}", 1709622489.0, "wall"),
    # systemd logs-show.c output_short(), journalctl -o ...
    "journal-short": ("Mar 05 07:08:09 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "journal-short-1digit": ("Mar  5 07:08:09 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "journal-short-precise": ("Mar 05 07:08:09.123456 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "journal-short-iso": ("2024-03-05T07:08:09+0000 gpu-node-3 kernel: {m}", 1709622489.0, "wall"),
    "journal-short-iso-new": ("2024-03-05T07:08:09+00:00 gpu-node-3 kernel: {m}", 1709622489.0, "wall"),
    "journal-short-iso-precise": ("2024-03-05T07:08:09.500000-0500 gpu-node-3 kernel: {m}", 1709640489.5, "wall"),
    "journal-short-full": ("Tue 2024-03-05 07:08:09 UTC gpu-node-3 kernel: {m}", 1709622489.0, "wall"),
    "journal-short-full-offset": ("Tue 2024-03-05 08:08:09 +0100 gpu-node-3 kernel: {m}", 1709622489.0, "wall"),
    "journal-short-monotonic": ("[ 5123.004417] gpu-node-3 kernel: {m}", 5123.004417, "mono"),
    "journal-short-delta": ("[ 5123.004417 <    0.000120>] gpu-node-3 kernel: {m}", 5123.004417, "mono"),
    "journal-short-unix": ("1709622489.123456 gpu-node-3 kernel: {m}", 1709622489.123456, "wall"),
    "journal-cat": ("{m}", None, None),
    "journal-locale-pl": ("kwi 15 07:56:59 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "journal-locale-de": ("Mär 15 07:56:59 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "journal-locale-unknown": ("Xyz 15 07:56:59 gpu-node-3 kernel: {m}", None, None),
    "syslog-pid": ("Mar  5 07:08:09 gpu-node-3 python3[4411]: {m}", None, "wall-noyear"),
    "syslog-around-raw": ("Mar  5 07:08:09 gpu-node-3 kernel: [ 5123.004417] {m}", None, "wall-noyear"),
    # RFC 3164 section 4.1 with its PRI; RFC 5424 section 6
    "rfc3164-pri": ("<4>Mar  5 07:08:09 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "rfc5424": ("<4>1 2024-03-05T07:08:09.123Z gpu-node-3 kernel - - - {m}", 1709622489.123, "wall"),
    "rfc5424-sd": ('<4>1 2024-03-05T07:08:09.123+00:00 gpu-node-3 kernel 0 KERN [meta seq="17" x="a\\]b"] \ufeff{m}', 1709622489.123, "wall"),
    "rfc5424-nil-time": ("<4>1 - gpu-node-3 kernel - - - {m}", None, None),
    "rsyslog-rfc3339": ("2024-03-05T07:08:09.250000+00:00 gpu-node-3 kernel: [ 5123.004417] {m}", 1709622489.25, "wall"),
    "kmsg": ("4,2217,5123004417,-;{m}", 5123.004417, "mono"),
    # kubectl logs --timestamps (RFC 3339 nano) and --prefix
    "kubectl-ts": ("2024-03-05T07:08:09.123456789Z {m}", 1709622489.123456789, "wall"),
    "kubectl-prefix": ("[pod/trainer-0/main] {m}", None, None),
    "kubectl-prefix-ts": ("[pod/trainer-0/main] 2024-03-05T07:08:09.123456789Z {m}", 1709622489.123456789, "wall"),
    # CRI log file (kubelet parseCRILog), Docker json-file
    "cri-full": ("2024-03-05T07:08:09.123456789Z stderr F {m}", 1709622489.123456789, "wall"),
    "cri-offset": ("2024-03-05T08:08:09.5+01:00 stdout F {m}", 1709622489.5, "wall"),
    "docker-json": (None, 1709622489.25, "wall"),
    # journalctl -o json (systemd Journal JSON Format)
    "journal-json": ("journal-json", 1709622489.123456, "wall"),
    # rank labels: torchrun --tee, TORCH_LOGS, srun --label, Open MPI --tag-output, pdsh
    "torchrun-tee": ("[default3]:{m}", None, None),
    "torch-logs-rank": ("[rank3]:{m}", None, None),
    "torchrun-and-rank": ("[default3]:[rank11]:{m}", None, None),
    "srun-label": ("0: {m}", None, None),
    "srun-label-padded": ("07: {m}", None, None),
    "mpirun-tag": ("[1,12]<stderr>:{m}", None, None),
    "mpirun-tag-ts": ("2024-03-05T07:08:09.884Z: [1,12]<stdout>:{m}", 1709622489.884, "wall"),
    "pdsh-raw": ("gpu-node-3: [ 5123.004417] {m}", 5123.004417, "mono"),
    "pdsh-journal": ("gpu-node-3: Mar 05 07:08:09 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "talos": ("10.1.2.3: kern:    err: [2024-03-05T07:08:09.5Z]: {m}", 1709622489.5, "wall"),
    # ticket and chat excerpts
    "quote": ("> [ 5123.004417] {m}", 5123.004417, "mono"),
    "quote-nested": ("> > {m}", None, None),
    "bullet": ("- [ 5123.004417] {m}", 5123.004417, "mono"),
    "bullet-star": ("  * {m}", None, None),
    "code-block": ("    [ 5123.004417] {m}", 5123.004417, "mono"),
    "line-number": ("12: [ 5123.004417] {m}", 5123.004417, "mono"),
    "line-number-bar": (" 12 | {m}", None, None),
    "cat-n": ("    12\t{m}", None, None),
    "quote-line-number-journal": ("> 12: Mar 05 07:08:09 gpu-node-3 kernel: {m}", None, "wall-noyear"),
    "ansi": ("\x1b[31m[ 5123.004417] \x1b[0m{m}\x1b[0m", 5123.004417, "mono"),
    "bom": ("\ufeff[ 5123.004417] {m}", 5123.004417, "mono"),
    "kubectl-torchrun-srun": ("[pod/trainer-0/main] 2024-03-05T07:08:09Z 3: [default3]:{m}", 1709622489.0, "wall"),
}


def _line(name: str, msg: str) -> str:
    fmt = PREFIXES[name][0]
    if fmt is None:  # Docker json-file: one JSON object a line, the message's line end inside
        return json.dumps({"log": msg + "\n", "stream": "stderr", "time": "2024-03-05T07:08:09.25Z"})
    if fmt == "journal-json":
        return json.dumps({"__CURSOR": "s=1;i=2", "__REALTIME_TIMESTAMP": "1709622489123456",
                           "__MONOTONIC_TIMESTAMP": "5123004417", "_TRANSPORT": "kernel", "MESSAGE": msg})
    return fmt.format(m=msg)


@pytest.mark.parametrize("kind", sorted(MSGS))
@pytest.mark.parametrize("name", sorted(PREFIXES))
def test_prefix_is_stripped_and_the_reading_is_the_bare_messages(name, kind):
    msg = MSGS[kind]
    _, ts, clock = PREFIXES[name]
    line = _line(name, msg)
    got_msg, got_ts, got_clock = strip_prefixes(line)
    assert got_msg == msg
    assert got_clock == clock
    if ts is not None:
        assert got_ts == pytest.approx(ts, abs=1e-6)
    elif clock is None:
        assert got_ts is None
    want = bare(msg)
    for variant in ([line], [line + "\n"], [line + "\r\n"], [(line + "\r\n").encode()]):
        assert [(i.domain, i.device, i.code, i.action, i.remedy) for i in classify(variant)] == want


def test_messages_without_their_device_pass_through_unchanged():
    """A reporter who cut the bus id out leaves a message no prefix rule may eat."""
    for msg in ("mlx5_core: ens2f1np1: Link down", "NVRM: Xid 79, GPU has fallen off the bus.",
                "NVRM: GPU has fallen off the bus.", "kernel: mlx5_core Link down", "Link 12 03:04:05 down"):
        assert strip_prefixes(msg)[0] == msg
        assert strip_prefixes("[ 12.5] " + msg)[0] == msg


def test_nccl_own_stamp_with_spaced_offset_and_a_second_stamp():
    # a collector's "YYYY-MM-DD HH:MM:SS.mmm +08:00" in front of NCCL_DEBUG_TIMESTAMP_FORMAT's "[%F %T] "
    line = "2025-06-01 10:00:00.250 +08:00 [2025-06-01 02:00:00] " + NCCL
    msg, ts, clock = strip_prefixes(line)
    assert msg == NCCL and clock == "wall"
    assert ts == pytest.approx(1748743200.25)  # 02:00:00.25 UTC, the collector's stamp (first wins)


# --- records over several lines -------------------------------------------------------------------

def test_cri_partial_pieces_are_joined_with_the_next_piece_of_their_stream():
    head, tail = XID[:40], XID[40:]
    lines = ["2024-03-05T07:08:09.100000000Z stderr P " + head,
             "2024-03-05T07:08:09.100000100Z stdout F unrelated progress line",
             "2024-03-05T07:08:09.100000200Z stderr F " + tail]
    p = parse_lines(lines)
    (rec,) = [r for r in p.records if r.msg.startswith("NVRM")]
    assert (rec.msg, rec.first_line, rec.last_line, rec.clock) == (XID, 1, 3, "wall")
    (inc,) = classify(lines)
    assert (inc.code, inc.device, inc.first_line, inc.last_line) == ("xid:48", "0000:3b:00.0", 1, 3)


def test_docker_partial_pieces_are_joined_and_an_unfinished_piece_is_still_read():
    lines = [json.dumps({"log": XID[:30], "stream": "stderr", "time": "2024-03-05T07:08:09Z"}),
             json.dumps({"log": XID[30:] + "\n", "stream": "stderr", "time": "2024-03-05T07:08:09Z"}),
             json.dumps({"log": LINK, "stream": "stdout", "time": "2024-03-05T07:08:10Z"})]
    p = parse_lines(lines)
    assert [(r.msg, r.first_line, r.last_line) for r in p.records] == [(XID, 1, 2), (LINK, 3, 3)]
    assert {i.code for i in classify(lines)} == {"xid:48", "mlx5:link_down"}


def test_journal_json_message_as_bytes():
    line = json.dumps({"__REALTIME_TIMESTAMP": "1709622489000000", "MESSAGE": list(LINK.encode())})
    assert strip_prefixes(line) == (LINK, 1709622489.0, "wall")
    few = json.dumps({"__REALTIME_TIMESTAMP": "1709622489000000", "MESSAGE": list(b"\xff\xfe" + LINK.encode())})
    p = parse_lines([few])  # two undecodable bytes in a line of text: read, as "?"
    assert p.skipped == [] and p.records[0].msg == "??" + LINK
    bad = json.dumps({"__REALTIME_TIMESTAMP": "1709622489000000", "MESSAGE": list(b"\xff\xfe" * 40 + LINK.encode())})
    assert parse_lines([bad]).skipped == [1]  # mostly undecodable: counted, not guessed


def test_not_json_after_all_is_a_plain_line():
    assert strip_prefixes('{"log": broken ' + LINK)[0] == '{"log": broken ' + LINK


FALLEN = ["NVRM: The NVIDIA GPU 0000:c4:00.0",
          "NVRM: (PCI ID: 10de:2330) installed in this system has",
          "NVRM: fallen off the bus and is not responding to commands."]


@pytest.mark.parametrize("wrap", ["", "> ", "    ", "12: ", "[default0]:", "gpu-node-3: "])
@pytest.mark.parametrize("stamp", ["[ 9001.250000] ", "[Tue Mar  5 07:08:09 2024] "])
def test_multi_line_nvrm_message_under_any_wrapper(wrap, stamp):
    """dmesg pads the continuation lines of one printk to the message column."""
    pad = " " * len(stamp)
    lines = [wrap + stamp + FALLEN[0]] + [wrap + pad + x for x in FALLEN[1:]]
    (inc,) = classify(lines)
    assert (inc.code, inc.device, inc.first_line, inc.last_line) == ("nvrm:fallen_off_bus", "0000:c4:00.0", 1, 3)


def test_separate_nvrm_lines_in_an_indented_block_are_not_one_message():
    xid79 = "NVRM: Xid (PCI:0000:c4:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    lines = ["    NVRM: GPU at PCI:0000:c4:00: GPU-00000000-1111-2222-3333-444444444444",
             "    NVRM: GPU Board Serial Number: 1650000000000",
             "    " + xid79]
    p = parse_lines(lines)
    assert [r.first_line for r in p.records] == [1, 2, 3]
    (inc,) = classify(lines)
    assert (inc.code, inc.first_line) == ("xid:79", 3)


def test_lone_cr_and_nul_runs_split_a_line():
    p = parse_lines(["progress 10%\rprogress 20%\r[ 5.0] " + LINK + "\x00\x00\x00[ 6.0] " + XID + "\n"])
    assert [r.msg for r in p.records] == ["progress 10%", "progress 20%", LINK, XID]
    assert {r.first_line for r in p.records} == {1} and p.skipped == []


def test_long_line_is_read_in_pieces_and_counted():
    filler = "lorem ipsum " * (3 * MAX_LINE // 12)
    p = parse_lines(["[ 1.0] " + LINK + " " + filler + " " + XID, "[ 2.0] " + LINK])
    assert p.long_lines == [1] and p.skipped == []
    assert all(len(r.msg) <= MAX_LINE for r in p.records)
    assert any(XID in r.msg for r in p.records)  # the end of the line is read, not dropped


def test_record_api():
    r = parse_lines(["[ 1.5] " + LINK + "\n", "[ 2.5] " + XID]).records
    assert [(x.first_line, x.last_line, x.msg, x.ts, x.clock, x.cut) for x in r] == [
        (1, 1, LINK, 1.5, "mono", False), (2, 2, XID, 2.5, "mono", True)]
    assert isinstance(r[0], Record)


# --- generality: the corpus shuffled and concatenated --------------------------------------------

def corpus_lines(rel: str) -> list[str]:
    return (CORPUS / rel).read_text(encoding="utf-8", errors="replace").splitlines()


def evidence_lines(lines: list[str]) -> set[int]:
    """Line numbers that are evidence (a record some family reads), parts of multi-line
    records, or NVRM lines (which may join a neighbour): these stay where they are."""
    p = parse_lines(lines)
    keep = {1}
    for r in p.records:
        if r.last_line > r.first_line or r.msg.startswith("NVRM:"):
            keep.update(range(r.first_line, r.last_line + 1))
    for ev in events(p.records):
        keep.update(range(ev.rec.first_line, ev.rec.last_line + 1))
    return keep


@pytest.mark.parametrize("rel", LOGS)
def test_corpus_log_shuffled_gives_the_same_incidents(rel):
    lines = corpus_lines(rel)
    keep = evidence_lines(lines)
    free = [n for n in range(1, len(lines) + 1) if n not in keep]
    want = reading(lines)
    for seed in range(3):
        order = free[:]
        random.Random(f"{rel}/{seed}").shuffle(order)
        moved = lines[:]
        for at, src in zip(free, order):
            moved[at - 1] = lines[src - 1]
        assert reading(moved) == want, (seed, len(free))


def _devices(r: set) -> set:
    return {x[1] for x in r}


def _independent(a: set, b: set) -> bool:
    """Two readings that cannot explain each other: no device in common (None counts: a
    device-less symptom is linked to evidence anywhere in its input) and not a lost GPU in one
    next to NVSwitch SXids in the other (SXids after a lost GPU are its secondaries)."""
    if _devices(a) & _devices(b) or None in _devices(a) | _devices(b):
        return False
    lost = {"xid:79", "nvrm:fallen_off_bus"}
    for x, y in ((a, b), (b, a)):
        if {i[2] for i in x} & lost and any(i[2].startswith("sxid:") for i in y):
            return False
    return True


PAIRS = [(a, b) for i, a in enumerate(LOGS) for b in LOGS[i + 1:i + 5]]
PAIRS += [(b, a) for a, b in PAIRS]


def test_concatenated_corpus_logs_give_the_union():
    checked = 0
    for a, b in PAIRS:
        la, lb = corpus_lines(a), corpus_lines(b)
        ra, rb = reading(la), reading(lb, shift=len(la))
        if not _independent(ra, rb):
            continue
        assert reading(la + lb) == ra | rb, (a, b)
        checked += 1
    assert checked >= 40  # most neighbouring pairs are independent


def test_concatenated_logs_with_their_line_ends_and_skips_count_through():
    a, b = LOGS[0], LOGS[1]
    la = (CORPUS / a).read_text(errors="replace").splitlines(keepends=True)
    lb = (CORPUS / b).read_text(errors="replace").splitlines(keepends=True)
    rep = classify_report(la + [b"\xff\xfe binary\n"] + lb)
    assert rep.error is None and rep.lines == len(la) + 1 + len(lb) and rep.skipped == [len(la) + 1]
