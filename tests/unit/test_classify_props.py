"""Property tests of the classifier on the corpus: it never raises on mutated, truncated or
binary versions of it, and lines that are no evidence, put anywhere between records, do not
change the root incidents."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linkpass.core.classify import classify, classify_report
from linkpass.core.evidence.builder import events as _events
from linkpass.core.logparse import parse_lines

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
EXPECTED = json.loads((CORPUS / "expected.json").read_text())
LOGS = sorted(k for k, v in EXPECTED.items() if v.get("kind") == "log")
TEXTS = {rel: (CORPUS / rel).read_text(encoding="utf-8", errors="replace") for rel in LOGS}

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: lines that are no evidence of anything (from the corpus files themselves and the field)
NOISE = [
    "Feb 14 05:03:41 host systemd[1]: Started systemd-journald.service - Journal Service.",
    "[  12.345678] EXT4-fs (md127p3): re-mounted r/w. Quota mode: none.",
    "iter 83592: loss 1.5455, time: 4401.19ms, speed: - toks/s/device",
    "<host0>:3468:3905 [4] NCCL INFO proxy.cc:698 -> 6",
    "kern  :info  : 2025-01-17T15:36:29,665651+00:00 nvidia-nvswitch0: using MSI",
    "[Sun Feb 23 16:24:30 2025] clocksource: Long readout interval, skipping watchdog check",
    "6,2001,123456789,-;usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "# --- an operator's comment ---",
]


def roots(incs):
    return [(i.domain, i.device, i.code, i.action) for i in incs if i.secondary_of is None]


def is_noise(line: str) -> bool:
    return not _events(parse_lines([line]).records)


def test_noise_pool_is_noise():
    assert all(is_noise(n) for n in NOISE)


@SETTINGS
@given(rel=st.sampled_from(LOGS), data=st.data())
def test_never_raises_on_mutated_corpus_text(rel, data):
    text = TEXTS[rel]
    cut = data.draw(st.integers(0, len(text)))
    ops = data.draw(st.lists(st.tuples(st.integers(0, max(0, len(text) - 1)), st.text(max_size=8)), max_size=12))
    mutated = text[:cut]
    for pos, ins in ops:
        pos = min(pos, len(mutated))
        mutated = mutated[:pos] + ins + mutated[pos + 1:]
    r = classify_report(mutated.splitlines())
    assert r.error is None, r.error  # the classifier's own failure is reported, never hidden
    for i in r.incidents:
        j = i.to_json()
        assert j["secondary_of"] is None or 0 <= j["secondary_of"] < len(r.incidents)
        assert 1 <= j["first_line"] <= j["last_line"]


@SETTINGS
@given(rel=st.sampled_from(LOGS), junk=st.binary(max_size=300), at=st.integers(0, 10_000))
def test_never_raises_on_binary_and_truncated_bytes(rel, junk, at):
    data = TEXTS[rel].encode()
    at = min(at, len(data))
    blob = data[:at] + junk + data[at:]
    classify(blob.split(b"\n"))  # raises ClassifierError if the classifier itself fails
    classify(blob[: at // 2].split(b"\n"))


@SETTINGS
@given(lines=st.lists(st.one_of(st.text(max_size=200), st.binary(max_size=50), st.none(), st.integers()), max_size=30))
def test_never_raises_on_arbitrary_items(lines):
    r = classify_report(lines)
    assert r.lines == len(lines) and r.error is None, r.error


@SETTINGS
@given(rel=st.sampled_from(LOGS), data=st.data())
def test_shuffling_unrelated_lines_keeps_the_root_incidents(rel, data):
    """Records that are no evidence (the file's own and NOISE), shuffled and put anywhere
    between the evidence records (never inside a multi-line record), change no root."""
    lines = TEXTS[rel].splitlines()
    parsed = parse_lines(lines)
    groups = [lines[r.first_line - 1:r.last_line] for r in parsed.records]
    evidence = [g for g, r in zip(groups, parsed.records) if _events([r])]
    unrelated = [g for g, r in zip(groups, parsed.records) if not _events([r])]
    extra = data.draw(st.lists(st.sampled_from(NOISE), max_size=10))
    pool = data.draw(st.permutations(unrelated + [[n] for n in extra]))
    slots = sorted(data.draw(st.lists(st.integers(0, len(evidence)), min_size=len(pool), max_size=len(pool))))
    out: list[str] = []
    k = 0
    for i, g in enumerate(evidence + [[]]):
        while k < len(pool) and slots[k] == i:
            out += pool[k]
            k += 1
        out += g
    assert roots(classify(out)) == roots(classify(lines))
