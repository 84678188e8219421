"""Kernel-log and NCCL-log lines -> records: the message text without its prefixes, its
timestamp and the input lines it spans.  Pure: no I/O, no clock.

Prefixes understood (they may nest, e.g. syslog around a raw dmesg stamp):

- raw ``dmesg``: ``[  123.456789] msg`` (also with the opening bracket cut off: `` 4428.4] msg``);
- ``dmesg -T``: ``[Thu Apr  4 18:03:56 2024] msg``;
- ``dmesg --time-format=iso`` and ``journalctl -o short-iso``: ``2025-01-17T15:36:25,406715+00:00 msg``,
  with or without ``dmesg --decode``'s ``kern  :info  : `` facility/level prefix;
- syslog and ``journalctl -k``: ``Dec  2 10:43:35 host kernel: msg`` (any ``prog[pid]:``);
- ``/dev/kmsg`` records: ``6,1234,5678,-;msg`` (the dictionary lines that follow,
  `` SUBSYSTEM=pci``, belong to the record);
- Talos-style ``node: kern: warning: [2026-04-22T21:25:20.45Z]: msg`` and mpirun's
  ``2019-06-02T16:13:44.884Z: [1,12]<stdout>:msg``.

Multi-line NVRM messages are joined into one record: continuation lines that carry no
timestamp and start with whitespace and ``NVRM:``, and continuation lines that carry their own
prefix (``[ts] NVRM: (PCI ID: 10de:26b5) installed in this system has``, the Talos-style
``node: kern: warning: [ts]: NVRM: ...``) when the previous NVRM line (the line just before,
same clock, stamped at most :data:`CONT_GAP_S` earlier) does not end a sentence and the new
piece starts lower-case or with ``(``.

NUL bytes are padding (a kern.log after a power loss holds runs of them where the file system
had allocated blocks that were never written): a NUL run splits a line into pieces, each read
as a line of its own with the same line number.  Lines that hold other control characters
(binary data) or undecodable bytes are skipped and counted; empty lines are ignored.

A last input line without a line end while the others have one (a file cut off mid-write)
is *cut*: its record has ``cut=True``, and a message cut short is read with care (an Xid code
that ends the cut line is not trusted, see :mod:`linkpass.core.classify`).

Timestamps: ``clock`` is ``"mono"`` for seconds since boot (raw dmesg, kmsg), ``"wall"`` for a
dated wall clock (seconds since 1970, UTC), ``"wall-noyear"`` for syslog stamps without a year.
Stamps of different clocks are never compared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Iterable

#: longest line looked at; the rest of a longer line is cut off
MAX_LINE = 16384

_MONTHS = {m: i + 1 for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"))}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

_KMSG = re.compile(r"^(\d{1,3}),(\d+),(\d+),[^;]{0,16};(.*)$")
_KMSG_DICT = re.compile(r"^ [A-Z_]+=")
_DECODE = re.compile(r"^(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:\s*"
                     r"(?:emerg|alert|crit|err|warn|warning|notice|info|debug)\s*:\s?")
_RAW = re.compile(r"^\s*\[?\s*(\d{1,10}\.\d{1,9})\]\s?")
_CTIME = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)\s+([A-Za-z]{3})\s+(\d{1,2})\s+(\d\d):(\d\d):(\d\d)\s+(\d{4})\]\s?")
_ISO = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(Z|[+-]\d\d:?\d\d)?\]?:?\s?")
_SYSLOG = re.compile(r"^([A-Za-z]{3})\s+(\d{1,2})\s+(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s+(\S+)\s+"
                     r"([A-Za-z][\w\-./@]*)(?:\[\d+\])?:\s?")
_ISO_PROG = re.compile(r"^(\S+)\s+(?:kernel|[A-Za-z][\w\-./@]*\[\d+\]):\s?")
_TALOS = re.compile(r"^\S+:\s+kern:\s*\w+:\s+(?=\[\d{4}-)")
_MPI = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:\s?")
_CONT = re.compile(r"^\s+NVRM:\s?(.*)$")
_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
_NULS = re.compile(r"\x00+")
_PREFIXED_CONT = re.compile(r"^NVRM:\s?([a-z(].*)$")
_SENTENCE_END = (".", ":", "!", "?", ";")
#: most seconds between the lines of one multi-line NVRM message that carry their own stamps
CONT_GAP_S = 1.0


@dataclass
class Record:
    """One logical log message.

    Attributes:
        first_line, last_line: 1-based numbers of the input lines it spans.
        msg: the message, prefixes removed, continuation lines joined with one space.
        ts: timestamp in seconds (see ``clock``), or None.
        clock: ``"mono"``, ``"wall"``, ``"wall-noyear"`` or None.
        cut: the record's last line is the input's last line and has no line end (cut off).
    """

    first_line: int
    last_line: int
    msg: str
    ts: float | None = None
    clock: str | None = None
    cut: bool = False


@dataclass
class Parsed:
    """What :func:`parse_lines` read: the records, the number of input lines, and the
    numbers of the lines skipped as unreadable (binary or undecodable)."""

    records: list[Record]
    lines: int
    skipped: list[int]


def _frac(text: str | None) -> float:
    return float("0." + text) if text else 0.0


def _wall(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: float = 0.0, tz: str | None = None) -> float | None:
    try:
        t = datetime(y, mo, d, h, mi, s, tzinfo=timezone.utc)
    except ValueError:
        return None
    off = 0
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        off = sign * (int(digits[:2]) * 3600 + int(digits[2:4] or 0) * 60)
    return (t - _EPOCH - timedelta(seconds=off)).total_seconds() + frac


def strip_prefixes(line: str) -> tuple[str, float | None, str | None]:
    """(message, ts, clock) of one physical line, every known prefix removed (first stamp wins)."""
    msg, ts, clock = line, None, None

    def stamp(t: float | None, c: str) -> None:
        nonlocal ts, clock
        if ts is None and t is not None:
            ts, clock = t, c

    m = _KMSG.match(msg)
    if m:
        stamp(int(m.group(3)) / 1e6, "mono")
        msg = m.group(4)
    for _ in range(6):
        m = _DECODE.match(msg)
        if m:
            msg = msg[m.end():]
            continue
        m = _TALOS.match(msg)
        if m:
            msg = msg[m.end():]
            continue
        m = _CTIME.match(msg)
        if m:
            mo = _MONTHS.get(m.group(1).lower())
            if mo:
                stamp(_wall(int(m.group(6)), mo, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))), "wall")
            msg = msg[m.end():]
            continue
        m = _ISO.match(msg)
        if m:
            g = m.groups()
            stamp(_wall(int(g[0]), int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5]), _frac(g[6]), g[7]), "wall")
            msg = msg[m.end():]
            m2 = _ISO_PROG.match(msg)
            if m2:
                msg = msg[m2.end():]
            m2 = _MPI.match(msg)
            if m2:
                msg = msg[m2.end():]
            continue
        m = _SYSLOG.match(msg)
        if m and m.group(1).lower() in _MONTHS:
            g = m.groups()
            stamp(_wall(2000, _MONTHS[g[0].lower()], int(g[1]), int(g[2]), int(g[3]), int(g[4]), _frac(g[5])), "wall-noyear")
            msg = msg[m.end():]
            continue
        m = _RAW.match(msg)
        if m:
            stamp(float(m.group(1)), "mono")
            msg = msg[m.end():]
            continue
        break
    return msg.strip(), ts, clock


def parse_lines(lines: Iterable) -> Parsed:
    """Records from input lines (str, or bytes decoded as UTF-8).

    Never raises on the lines' content: binary or undecodable lines are skipped (their numbers
    are in ``skipped``); over-long lines are cut at :data:`MAX_LINE` characters.  An item that
    is neither str nor bytes counts as skipped.  Lines may carry their line end (``"...\\n"``,
    as a file object yields them) or not (``str.splitlines()``); with line ends, a last line
    without one is *cut* (:attr:`Record.cut`).
    """
    records: list[Record] = []
    skipped: list[int] = []
    n = 0
    prev_kmsg = False
    any_ended = False  # some earlier line had a line end
    last_open: Record | None = None  # the record of the last line, when it has no line end
    for n, raw in enumerate(lines, 1):
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw).decode("utf-8", errors="replace")
        if not isinstance(raw, str):
            skipped.append(n)
            last_open = None
            continue
        has_end = raw.endswith(("\n", "\r"))
        before = len(records)
        for piece in _NULS.split(raw.rstrip("\r\n")[:MAX_LINE]):
            prev_kmsg = _one(piece, n, records, skipped, prev_kmsg)
        last_open = records[-1] if not has_end and any_ended and len(records) > before else None
        any_ended = any_ended or has_end
    if last_open is not None:
        last_open.cut = True
    return Parsed(records, n, skipped)


def _one(line: str, n: int, records: list[Record], skipped: list[int], prev_kmsg: bool) -> bool:
    """Read one physical line (a piece between NUL runs) into ``records``; returns whether it
    was a kmsg record (its dictionary lines follow)."""
    if not line.strip():
        return prev_kmsg
    if _BAD_CHARS.search(line.replace("\t", " ")):
        if not skipped or skipped[-1] != n:
            skipped.append(n)
        return prev_kmsg
    if prev_kmsg and _KMSG_DICT.match(line):
        records[-1].last_line = n
        return True
    cont = _CONT.match(line)
    if cont and records and records[-1].msg.startswith("NVRM:") and records[-1].last_line >= n - 1:
        records[-1].msg += " " + cont.group(1).strip()
        records[-1].last_line = n
        return False
    is_kmsg = bool(_KMSG.match(line))
    msg, ts, clock = strip_prefixes(line)
    if not msg:
        return is_kmsg
    m = _PREFIXED_CONT.match(msg)
    if m and records:
        prev = records[-1]
        if (prev.msg.startswith("NVRM:") and prev.last_line >= n - 1 and not prev.msg.rstrip().endswith(_SENTENCE_END)
                and prev.clock == clock and (ts is None or prev.ts is None or 0.0 <= ts - prev.ts <= CONT_GAP_S)):
            prev.msg += " " + m.group(1).strip()
            prev.last_line = n
            return is_kmsg
    records.append(Record(n, n, msg, ts, clock))
    return is_kmsg
