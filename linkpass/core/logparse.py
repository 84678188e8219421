"""Kernel-log and NCCL-log lines -> records: the message text without its prefixes, its
timestamp and the input lines it spans.  Pure: no I/O, no clock.

Each prefix below is read as its producer prints it (the source named next to it); they may
nest (a ticket quoting a kubectl excerpt of a torchrun rank's NCCL line, syslog around a raw
dmesg stamp), and are stripped outermost first.  The first stamp found is the record's.

Stamps (util-linux ``sys-utils/dmesg.c``, ``print_record()`` and its ``--time-format`` cases;
systemd ``src/shared/logs-show.c``, ``output_short()``, documented in journalctl(1) ``-o``):

- raw ``dmesg``: ``[  123.456789] msg`` (also with the opening bracket cut off:
  `` 4428.4] msg``), ``dmesg -d``'s ``[  123.456789 <    0.000123>] msg``, and the stamp-less
  ``dmesg --time-format=reltime`` / ``delta`` forms ``[Feb15 11:22] ``, ``[  +0.000123] ``,
  ``[<    0.000123>] `` (stripped, no stamp);
- ``dmesg -T`` / ``ctime``: ``[Thu Apr  4 18:03:56 2024] msg``;
- ``dmesg --time-format=iso``: ``2025-01-17T15:36:25,406715+00:00 msg``; any of these after
  ``dmesg -x``/``--decode``'s ``kern  :info  : `` facility/level prefix, or after
  ``dmesg -r``'s ``<6>`` (printk level, ``include/linux/kern_levels.h``);
- journalctl ``-o short`` (the default; also ``journalctl -k`` and classic syslog files,
  RFC 3164 section 4.1.2, with or without its ``<PRI>``): ``Dec  2 10:43:35 host kernel: msg``
  (any ``ident[pid]:``; journalctl prints the month with the locale's ``%b``, so a Polish
  journal says ``kwi 15``: glibc ``localedata`` LC_TIME ``abmon`` of the common locales is
  known, other month words are stripped without a stamp); ``-o short-precise``:
  ``Dec 02 10:43:35.123456 host kernel: msg``; ``-o short-iso`` / ``short-iso-precise``:
  ``2024-01-02T03:04:05+0000 host kernel: msg`` (``+00:00`` in newer versions, and rsyslog's
  RFC 3339 file format); ``-o short-full`` / ``with-unit``: ``Tue 2024-01-02 03:04:05 UTC host
  kernel: msg``; ``-o short-monotonic``: ``[  123.456789] host kernel: msg``; ``-o short-delta``:
  ``[  123.456789 <    0.000123>] host kernel: msg``; ``-o short-unix``:
  ``1704164645.123456 host kernel: msg``; ``-o cat``: the message alone;
- RFC 5424 syslog (section 6): ``<6>1 2024-01-02T03:04:05.123Z host kernel - - - msg``
  (PRI, VERSION, TIMESTAMP, HOSTNAME, APP-NAME, PROCID, MSGID, STRUCTURED-DATA, each ``-``
  when nil; SD elements ``[id k="v"]``; MSG may start with a BOM);
- ``/dev/kmsg`` records: ``6,1234,5678,-;msg`` (kernel ``Documentation/ABI/testing/dev-kmsg``;
  the dictionary lines that follow, `` SUBSYSTEM=pci``, belong to the record);
- kubectl logs (``staging/src/k8s.io/kubectl/pkg/cmd/logs/logs.go``): ``--timestamps`` puts an
  RFC 3339 (nano) stamp first, ``2024-01-02T03:04:05.123456789Z msg``; ``--prefix`` puts
  ``[pod/<name>/<container>] `` first;
- container runtime log files: the CRI format (kubelet ``pkg/kubelet/kuberuntime/logs/logs.go``,
  ``parseCRILog``; tags in ``cri-api/pkg/apis/runtime/v1/constants.go``: ``P`` partial, ``F``
  full, ``:`` between tags) ``2024-01-02T03:04:05.123456789Z stderr F msg``, where ``P`` lines
  are pieces of one line the runtime split (joined here with the next piece of the same
  stream), and Docker's json-file driver ``{"log":"msg\\n","stream":"stderr","time":"..."}``
  (a ``log`` without its ``\\n`` is a partial piece, joined the same way); and ``journalctl -o json``
  (systemd's Journal JSON Format: ``MESSAGE``, a string or an array of bytes, stamped by
  ``__REALTIME_TIMESTAMP`` in microseconds since 1970);
- Talos-style ``node: kern: warning: [2026-04-22T21:25:20.45Z]: msg`` and pdsh/clush's
  ``host: `` in front of any of the stamps above.

Wrappers without a stamp:

- per-rank prefixes: torchrun's ``--tee`` header ``[<role><local_rank>]:`` (``[default3]:``,
  ``torch/distributed/elastic/multiprocessing/tail_log.py``, ``TailLog.start``), TORCH_LOGS'
  ``[rank3]:`` (``torch/_logging/_internal.py``, ``rankprefix``), Slurm ``srun --label``'s
  ``"%0*d: "`` task number (``0: ``, ``07: ``; srun's I/O ``_write_label``), Open MPI
  ``--tag-output``'s ``[1,12]<stdout>:``, after a ``--timestamp-output`` stamp or not.
  NCCL's own ``host:pid:tid [dev] NCCL INFO ...`` (``src/debug.cc``, ``ncclDebugLog``) is part
  of the message (the families read its device index); its optional
  ``NCCL_DEBUG_TIMESTAMP_FORMAT`` stamp ``[2026-03-13 22:26:02] `` is a stamp;
- text pasted into tickets and chats: quoting ``> `` (nested), bullets ``- `` / ``* ``,
  line numbers ``12: ``, ``12 | `` and ``cat -n``'s ``"%6d\\t"``, indented code blocks,
  ANSI colour sequences (ECMA-48 CSI / OSC), a leading BOM, CRLF line ends.  A message whose
  reporter cut the device name out (``mlx5_core: Link down``) is kept as it is.

Multi-line NVRM messages are joined into one record: continuation lines that carry no
timestamp and start with whitespace and ``NVRM:``, indented deeper than the line the message
started on (so an indented code block of separate ``NVRM:`` lines is not one message), and
continuation lines that carry their own prefix (``[ts] NVRM: (PCI ID: 10de:26b5) installed in
this system has``, the Talos-style ``node: kern: warning: [ts]: NVRM: ...``) when the previous
NVRM line (the line just before, same clock, stamped at most :data:`CONT_GAP_S` earlier) does
not end a sentence and the new piece starts lower-case or with ``(``.

NUL bytes are padding (a kern.log after a power loss holds runs of them where the file system
had allocated blocks that were never written): a NUL run (or a lone CR, a progress bar's
line end) splits a line into pieces, each read as a line of its own with the same line
number.  A line longer than :data:`MAX_LINE` is read in pieces of at most that length (cut at
a space where one is near), never dropped; its number is in :attr:`Parsed.long_lines`.  A run of
more than :data:`MAX_TOKEN` word characters (a base64 blob) is shortened to that many (the line's
number is in :attr:`Parsed.shortened`).  Pieces
that hold other control characters (binary data), or more than :data:`BAD_SHARE` undecodable
bytes, are skipped and their line counted in ``skipped`` (a few undecodable bytes read as ``?``); empty lines are ignored.

A last input line without a line end while the others have one (a file cut off mid-write)
is *cut*: its record has ``cut=True``, and a message cut short is read with care (an Xid code
that ends the cut line is not trusted, see :mod:`linkpass.core.classify`).

Timestamps: ``clock`` is ``"mono"`` for seconds since boot (raw dmesg, kmsg, short-monotonic),
``"wall"`` for a dated wall clock (seconds since 1970, UTC), ``"wall-noyear"`` for syslog stamps
without a year.  Stamps of different clocks are never compared.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Iterable

#: longest piece of a line read as one message; a longer line is read in pieces this long
MAX_LINE = 16384
#: longest run of word characters kept: a longer one (a base64 blob, a hex dump on one line) is
#: shortened to this many.  No producer read here prints a word that long (a device name, bus id,
#: GUID or code is far shorter; a printk record's text is at most 1 KiB, kernel/printk/printk.c,
#: and NCCL formats each line into a 1 KiB buffer, src/debug.cc ncclDebugLog), and the families'
#: patterns are not written for it: one of them takes time quadratic in a word's length.
MAX_TOKEN = 128
_LONG_WORD = re.compile(r"\w{%d,}" % (MAX_TOKEN + 1))

_MONTHS = {m: i + 1 for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"))}
#: month abbreviations journalctl prints under other locales (``%b``; glibc localedata LC_TIME
#: ``abmon`` of de, fr, es, it, pt, pl; a trailing "." is dropped before the lookup)
_LOCALE_MONTHS = {
    **{m: i + 1 for i, m in enumerate(("jan", "feb", "mär", "apr", "mai", "jun", "jul", "aug", "sep", "okt", "nov", "dez"))},
    **{m: i + 1 for i, m in enumerate(("janv", "févr", "mars", "avr", "mai", "juin", "juil", "août", "sept", "oct", "nov", "déc"))},
    **{m: i + 1 for i, m in enumerate(("ene", "feb", "mar", "abr", "may", "jun", "jul", "ago", "sep", "oct", "nov", "dic"))},
    **{m: i + 1 for i, m in enumerate(("gen", "feb", "mar", "apr", "mag", "giu", "lug", "ago", "set", "ott", "nov", "dic"))},
    **{m: i + 1 for i, m in enumerate(("jan", "fev", "mar", "abr", "mai", "jun", "jul", "ago", "set", "out", "nov", "dez"))},
    **{m: i + 1 for i, m in enumerate(("sty", "lut", "mar", "kwi", "maj", "cze", "lip", "sie", "wrz", "paź", "lis", "gru"))},
}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

# --- stamps ---------------------------------------------------------------------------------------
_KMSG = re.compile(r"^(\d{1,3}),(\d+),(\d+),[^;]{0,16};(.*)$", re.S)
_KMSG_DICT = re.compile(r"^ [A-Z_]+=")
_DECODE = re.compile(r"^(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:\s*"
                     r"(?:emerg|alert|crit|err|warn|warning|notice|info|debug)\s*:\s?")
_PRI = re.compile(r"^<(\d{1,3})>")
_RFC5424 = re.compile(r"^<\d{1,3}>\d{1,2} (\S+) \S+ \S+ \S+ \S+ (-|(?:\[(?:[^\]\\]|\\.)*\])+)(?: \ufeff?|$)")
_RAW = re.compile(r"^\s*\[?\s*(\d{1,10}\.\d{1,9})(?:\s*<\s*\d+\.\d+>)?\]\s?")
_RELTIME = re.compile(r"^\[(?:[A-Z][a-z]{2}\s?\d{1,2} \d\d:\d\d|\s*\+\d+\.\d+|<\s*\d+\.\d+>)\]\s?")
_CTIME = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)\s+([A-Za-z]{3})\s+(\d{1,2})\s+(\d\d):(\d\d):(\d\d)\s+(\d{4})\]\s?")
_ISO = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(?: ?(Z|[+-]\d\d:?\d\d(?![\d:])))?\]?:?\s?")
_PROG = r"(?:kernel|[A-Za-z][\w\-./@]*\[\d+\])"
_FULL = re.compile(r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))? (\S+) "
                   r"(?=\S+\s+" + _PROG + ":)")
_UNIX = re.compile(r"^(\d{9,11})\.(\d{1,9}) (?=\S+\s+" + _PROG + ":)")
_SYSLOG = re.compile(r"^([^\W\d_]{3,5})\.?\s+(\d{1,2})\s+(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s+(\S+)\s+"
                     r"([A-Za-z][\w\-./@]*)(?:\[\d+\])?:\s?")
_ISO_PROG = re.compile(r"^(\S+)\s+" + _PROG + r":\s?")
_TALOS = re.compile(r"^\S+:\s+kern:\s*\w+:\s+(?=\[\d{4}-)")
_CRI_STREAM = re.compile(r"^(?:stdout|stderr) [A-Z](?::[A-Z])*(?: |$)")
# the CRI line as the kubelet reads it: time, stream, tags, content
_CRI = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d)) (stdout|stderr) ([A-Z](?::[A-Z])*) ?(.*)$", re.S)

# --- wrappers without a stamp -------------------------------------------------------------------
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_QUOTE = re.compile(r"^[ ]{0,3}>[ ]?")
_BULLET = re.compile(r"^[ ]{0,8}[-*\u2022][ ]+(?=\S)")
_LINENO = re.compile(r"^[ ]{0,8}\d{1,7}(?::[ ]|\t|[ ]\|[ ]?)")
_PDSH = re.compile(r"^(?!NVRM:)[A-Za-z0-9][\w.-]*:[ ](?=\s+NVRM:|\[\s*\d+\.\d|\[[A-Z][a-z]{2} |<\d{1,3}>|[A-Z][a-z]{2}[ ]+\d{1,2} \d\d:\d\d:\d\d |"
                   r"\d{4}-\d\d-\d\d[T ]\d\d:|\d+,\d+,\d+,)")
_KUBE_PREFIX = re.compile(r"^\[[a-z][a-z.]*/[^/\]\s]+/[^\]\s]+\][ ]")
_ROLE = re.compile(r"^\[[A-Za-z_][\w.-]*?\d+\]:[ ]?")  # [default3]: (torchrun --tee), [rank3]: (TORCH_LOGS)
_MPI = re.compile(r"^\[\d+,\d+\]<std(?:out|err|diag)>:[ ]?")
_WRAPPERS = (_QUOTE, _BULLET, _LINENO, _KUBE_PREFIX, _ROLE, _MPI, _PDSH)
#: any one of them (one match a step instead of seven)
_WRAPPER = re.compile("|".join(f"(?:{p.pattern[1:]})" for p in _WRAPPERS))

_CONT = re.compile(r"^\s+NVRM:\s?(.*)$")
_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
#: a line with more undecodable characters than this share is binary; fewer (a process name in
#: Latin-1 inside an Xid line) are read as ``?``
BAD_SHARE = 0.1
_SPLIT = re.compile(r"[\x00\r\n]+")
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
    """What :func:`parse_lines` read: the records, the number of input lines, the numbers of
    the lines skipped as unreadable (binary or undecodable; a long line of which only some
    pieces were unreadable is counted too), the numbers of the lines longer than
    :data:`MAX_LINE`, read in pieces, and of those in which a word longer than
    :data:`MAX_TOKEN` was shortened."""

    records: list[Record]
    lines: int
    skipped: list[int]
    long_lines: list[int] = field(default_factory=list)
    shortened: list[int] = field(default_factory=list)


def _frac(text: str | None) -> float:
    return float("0." + text) if text else 0.0


def _wall(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: float = 0.0, tz: str | None = None) -> float | None:
    try:
        t = datetime(y, mo, d, h, mi, s, tzinfo=timezone.utc)
    except ValueError:
        return None
    off = 0
    if tz and tz not in ("Z", "UTC", "GMT"):
        if tz[0] not in "+-":
            return None  # a zone abbreviation other than UTC: no offset known
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        off = sign * (int(digits[:2]) * 3600 + int(digits[2:4] or 0) * 60)
    return (t - _EPOCH - timedelta(seconds=off)).total_seconds() + frac


def _iso_stamp(m: re.Match) -> float | None:
    g = m.groups()
    return _wall(int(g[0]), int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5]), _frac(g[6]), g[7])


def _unwrap(line: str) -> str:
    """``line`` without the stamp-less wrappers in front of it (quotes, bullets, line numbers,
    kubectl's ``--prefix``, rank labels), whitespace after them kept."""
    if line.startswith("\ufeff"):
        line = line[1:]
    for _ in range(8):
        m = _WRAPPER.match(line)
        if not m or not m.end():
            return line
        line = line[m.end():]
    return line


def _container(line: str) -> tuple[str, bool, str] | None:
    """A container runtime's log line (CRI or Docker json-file) as (stream, partial, text),
    ``text`` being the runtime's stamp and the content; None for any other line."""
    m = _CRI.match(line)
    if m:
        return m.group(2), "P" in m.group(3).split(":"), f"{m.group(1)} {m.group(4)}"
    if line.startswith('{"') and ('"log"' in line or '"MESSAGE"' in line):
        try:
            d = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(d, dict):
            return None
        msg = d.get("MESSAGE")
        if isinstance(msg, list) and all(isinstance(b, int) and 0 <= b < 256 for b in msg):
            msg = bytes(msg).decode("utf-8", errors="replace")  # not valid UTF-8: an array of bytes
        if isinstance(msg, str):
            us = d.get("__REALTIME_TIMESTAMP")
            t = ""
            if isinstance(us, str) and us.isdigit():
                t = datetime.fromtimestamp(int(us) // 1_000_000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{int(us) % 1_000_000:06d}Z "
            return "", False, t + msg.rstrip("\r\n")
        if isinstance(d.get("log"), str):
            log = d["log"]
            partial = not log.endswith("\n")
            t = d.get("time") if isinstance(d.get("time"), str) else ""
            return str(d.get("stream", "")), partial, (t + " " if t else "") + log.rstrip("\r\n")
    return None


def strip_prefixes(line: str) -> tuple[str, float | None, str | None]:
    """(message, ts, clock) of one physical line, every known prefix removed (first stamp wins)."""
    ts, clock = None, None

    def stamp(t: float | None, c: str) -> None:
        nonlocal ts, clock
        if ts is None and t is not None:
            ts, clock = t, c

    c = _container(line.lstrip())
    msg = c[2] if c else line
    if "\x1b" in msg:
        msg = _ANSI.sub("", msg)
    for _ in range(12):
        msg = _unwrap(msg).lstrip()
        m = _KMSG.match(msg)
        if m:
            stamp(int(m.group(3)) / 1e6, "mono")
            msg = m.group(4)
            continue
        m = _DECODE.match(msg)
        if m:
            msg = msg[m.end():]
            continue
        m = _TALOS.match(msg)
        if m:
            msg = msg[m.end():]
            continue
        m = _RFC5424.match(msg)
        if m:
            m2 = _ISO.match(m.group(1))
            if m2:
                stamp(_iso_stamp(m2), "wall")
            msg = msg[m.end():]
            continue
        m = _PRI.match(msg)
        if m and int(m.group(1)) <= 191:
            msg = msg[m.end():]
            continue
        m = _CTIME.match(msg)
        if m:
            mo = _MONTHS.get(m.group(1).lower())
            if mo:
                stamp(_wall(int(m.group(6)), mo, int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))), "wall")
            msg = msg[m.end():]
            continue
        m = _FULL.match(msg)
        if m:
            g = m.groups()
            stamp(_wall(int(g[0]), int(g[1]), int(g[2]), int(g[3]), int(g[4]), int(g[5]), _frac(g[6]), g[7]), "wall")
            msg = msg[m.end():]
            msg = msg[m2.end():] if (m2 := _ISO_PROG.match(msg)) else msg
            continue
        m = _UNIX.match(msg)
        if m:
            stamp(int(m.group(1)) + _frac(m.group(2)), "wall")
            msg = msg[m.end():]
            msg = msg[m2.end():] if (m2 := _ISO_PROG.match(msg)) else msg
            continue
        m = _ISO.match(msg)
        if m:
            stamp(_iso_stamp(m), "wall")
            msg = msg[m.end():]
            for follow in (_CRI_STREAM, _ISO_PROG):
                m2 = follow.match(msg)
                if m2:
                    msg = msg[m2.end():]
            continue
        m = _SYSLOG.match(msg)
        if m:
            g = m.groups()
            word = g[0].lower()
            mo = _MONTHS.get(word) or _LOCALE_MONTHS.get(word)
            if mo:
                stamp(_wall(2000, mo, int(g[1]), int(g[2]), int(g[3]), int(g[4]), _frac(g[5])), "wall-noyear")
            msg = msg[m.end():]  # a month in a locale not known here: stripped, no stamp
            continue
        m = _RAW.match(msg)
        if m:
            stamp(float(m.group(1)), "mono")
            msg = msg[m.end():]
            msg = msg[m2.end():] if (m2 := _ISO_PROG.match(msg)) else msg  # journalctl -o short-monotonic
            continue
        m = _RELTIME.match(msg)
        if m:
            msg = msg[m.end():]
            continue
        break
    return msg.strip(), ts, clock


def _pieces(text: str) -> list[str]:
    """``text`` split at NUL runs and lone CRs, each piece at most :data:`MAX_LINE` long."""
    out: list[str] = []
    for piece in _SPLIT.split(text):
        at = 0
        while len(piece) - at > MAX_LINE:
            cut = piece.rfind(" ", at + MAX_LINE - 512, at + MAX_LINE)
            cut = cut if cut > at else at + MAX_LINE
            out.append(piece[at:cut])
            at = cut
        out.append(piece[at:] if at else piece)
    return out


class _State:
    """What reading one line needs to know about the lines before it."""

    def __init__(self) -> None:
        self.prev_kmsg = False  # the last line was a kmsg record (its dictionary lines follow)
        self.indent = 0  # indentation of the line the last record started on (wrappers removed)


def parse_lines(lines: Iterable) -> Parsed:
    """Records from input lines (str, or bytes decoded as UTF-8).

    Never raises on the lines' content: binary or undecodable lines are skipped (their numbers
    are in ``skipped``); over-long lines are read in pieces of :data:`MAX_LINE` characters.
    An item that is neither str nor bytes counts as skipped.  Lines may carry their line end
    (``"...\\n"``, as a file object yields them) or not (``str.splitlines()``); with line ends,
    a last line without one is *cut* (:attr:`Record.cut`).
    """
    records: list[Record] = []
    skipped: list[int] = []
    long_lines: list[int] = []
    shortened: list[int] = []
    st = _State()
    n = 0
    any_ended = False  # some earlier line had a line end
    last_open: Record | None = None  # the record of the last line, when it has no line end
    partial: dict[str, tuple[int, str]] = {}  # stream -> (first line, text so far) of a split container line
    for n, raw in enumerate(lines, 1):
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw).decode("utf-8", errors="replace")
        if not isinstance(raw, str):
            skipped.append(n)
            last_open = None
            continue
        has_end = raw.endswith(("\n", "\r"))
        text = raw.rstrip("\r\n")
        first = n
        c = _container(text.lstrip()) if text[:1] in "{0123456789 " else None
        if c is not None:
            stream, is_partial, text = c
            if stream in partial:
                first, head = partial.pop(stream)
                text = head + text.split(" ", 1)[1] if " " in text else head
            if is_partial and len(text) < 4 * MAX_LINE:
                partial[stream] = (first, text)
                continue
        before = len(records)
        _read_line(text, first, n, records, skipped, long_lines, shortened, st)
        last_open = records[-1] if not has_end and any_ended and len(records) > before else None
        any_ended = any_ended or has_end
    for first, text in partial.values():  # pieces whose end never came: read as they are
        _read_line(text, first, n, records, skipped, long_lines, shortened, st)
    if last_open is not None:
        last_open.cut = True
    return Parsed(records, n, skipped, long_lines, shortened)


def _read_line(text: str, first: int, n: int, records: list[Record], skipped: list[int], long_lines: list[int],
               shortened: list[int], st: _State) -> None:
    if len(text) > MAX_TOKEN:
        text, k = _LONG_WORD.subn(lambda m: m.group()[:MAX_TOKEN], text)
        if k and n not in shortened[-1:]:
            shortened.append(n)
    if len(text) > MAX_LINE and n not in long_lines[-1:]:
        long_lines.append(n)
    for piece in _pieces(text):
        _one(piece, first, n, records, skipped, st)


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip())


def _one(line: str, first: int, n: int, records: list[Record], skipped: list[int], st: _State) -> None:
    """Read one physical line (a piece between NUL runs) into ``records``."""
    if not line.strip():
        return
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    bad = line.count("\ufffd")
    if _BAD_CHARS.search(line.replace("\t", " ")) or bad > BAD_SHARE * len(line):
        if n not in skipped[-1:]:
            skipped.append(n)
        return
    if bad:
        line = line.replace("\ufffd", "?")
    if st.prev_kmsg and _KMSG_DICT.match(line):
        records[-1].last_line = n
        return
    inner = _unwrap(line)
    cont = _CONT.match(inner)
    if (cont and records and records[-1].msg.startswith("NVRM:") and records[-1].last_line >= first - 1
            and _indent(inner) > st.indent):
        records[-1].msg += " " + cont.group(1).strip()
        records[-1].last_line = n
        st.prev_kmsg = False
        return
    st.prev_kmsg = bool(_KMSG.match(line))
    msg, ts, clock = strip_prefixes(line)
    if not msg:
        return
    m = _PREFIXED_CONT.match(msg)
    if m and records:
        prev = records[-1]
        if (prev.msg.startswith("NVRM:") and prev.last_line >= first - 1 and not prev.msg.rstrip().endswith(_SENTENCE_END)
                and prev.clock == clock and (ts is None or prev.ts is None or 0.0 <= ts - prev.ts <= CONT_GAP_S)):
            prev.msg += " " + m.group(1).strip()
            prev.last_line = n
            return
    records.append(Record(first, n, msg, ts, clock))
    st.indent = _indent(inner)
