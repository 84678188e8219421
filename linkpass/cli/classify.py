"""`linkpass classify`: kernel-log and NCCL/PyTorch error lines -> incidents.

    linkpass classify [FILE ...|-] [--json] [--topology FILE ...]

All FILEs (``-`` or none: stdin) are read as one host's evidence, in the order given, so a
kernel log and an NCCL log of the same host can explain each other; line numbers count
through the files in that order.  ``--topology`` takes captured tool outputs (NCCL topology
XML, ``nvidia-smi topo -m``, ``ibstat``, ``ibdev2netdev``, ``rdma link``...), read as
``linkpass topology --from`` reads them; with it, link events on ports that are not compute
rails are benign.  The classification is :func:`linkpass.core.classify.classify_report`.

Output: with ``--json`` one JSON object per incident and line (exactly the fields domain,
device, code, action, remedy, secondary_of, first_line, last_line); else a table.

Exit codes: 0 whatever the evidence says (faults included); 2 unreadable input (a missing,
unreadable, directory or binary FILE, or a ``--topology`` file from which nothing could be
read): one line on stderr naming the file.

NUL bytes are padding, not binary data (a kern.log after a power loss holds runs of them): they
separate lines (:mod:`linkpass.core.logparse`).  A FILE is binary only when more than
:data:`BINARY_SHARE` of its first 64 KiB (NULs left out) is not text.  At most
:data:`MAX_BYTES` are read from each FILE; a longer one is cut at the last whole line before
that and a warning on stderr says where (byte offset and line count): never silently.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from linkpass.core.classify import Classification, classify_report

PROG = "linkpass classify"
#: more than this is not a log excerpt; only the first part is read
MAX_BYTES = 256 * 1024 * 1024


class _BadInput(Exception):
    """One line for stderr, exit 2."""


def register(sub) -> None:
    """Add the ``classify`` sub-command to an argparse sub-parsers object."""
    c = sub.add_parser("classify", help="read kernel-log / NCCL error lines and say what broke (GPU, NVLink, NIC link, app, ...)",
                       description="Classify kernel-log and NCCL/PyTorch error lines into incidents: domain, device, "
                       "code, what linkpass does (action) and what the operator should do (remedy).")
    c.add_argument("files", nargs="*", metavar="FILE", help="log files ('-' or none: stdin), read as one host's evidence")
    c.add_argument("--json", action="store_true", help="JSON lines, one incident each")
    c.add_argument("--topology", action="append", default=[], metavar="FILE",
                   help="captured topology tool output (as for `linkpass topology --from`); repeatable")
    c.set_defaults(func=cmd_classify)


def _read(name: str) -> bytes:
    """The bytes of FILE (``-``: stdin), at most :data:`MAX_BYTES`, cut back to the last whole
    line when there was more (a warning on stderr says so and where).

    FILE is read by :func:`topology.importers.read_capped`: a regular file or a pipe
    (``<(journalctl -k)``; a FIFO without a writer reads as empty, never hangs); a device
    (``/dev/kmsg``, ``/dev/zero``) is refused: use ``dmesg | linkpass classify``."""
    from topology.importers import Refused, read_capped

    if name == "-":
        src = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else None
        data = src.read(MAX_BYTES + 1) if src is not None else sys.stdin.read(MAX_BYTES + 1).encode()
        label = "stdin"
    else:
        label = name
        p = Path(name)
        try:
            data = read_capped(p, MAX_BYTES)
        except Refused as e:
            raise _BadInput(f"{name}: {e}") from None
        except FileNotFoundError:
            raise _BadInput(f"{name}: no such file") from None
        except IsADirectoryError:
            raise _BadInput(f"{name}: is a directory") from None
        except PermissionError:
            raise _BadInput(f"{name}: permission denied") from None
        except OSError as e:
            raise _BadInput(f"{name}: cannot read: {e.strerror or e}") from None
    if _binary(data):
        raise _BadInput(f"{label}: binary data, not a log")
    if len(data) > MAX_BYTES:
        data = data[:MAX_BYTES]
        end = data.rfind(b"\n") + 1 or len(data)
        data = data[:end]
        nlines = data.count(b"\n")
        print(f"{PROG}: warning: {label}: input truncated: only the first {end} bytes "
              f"({nlines} lines) were classified; the rest (from byte {end}) was not read "
              f"(limit {MAX_BYTES // (1024 * 1024)} MiB: cut the log to the time of interest)", file=sys.stderr)
    return data


#: share of non-text characters (control characters other than tab/line ends, undecodable
#: bytes) above which a sample, NUL padding left out, is binary data rather than a log
BINARY_SHARE = 0.10
_SAMPLE = 65536


def _binary(data: bytes) -> bool:
    """Mostly non-text (a core dump, a compressed file)?  NUL runs are padding (a kern.log after
    a power loss) and do not count; nothing but NULs is an empty log, not binary data."""
    sample = data[:_SAMPLE].replace(b"\x00", b"")
    if not sample:
        return False
    text = sample.decode("utf-8", errors="replace")
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\x0c") or ch == "\x7f")
    return bad > BINARY_SHARE * len(text)


def _topology(files: list[str]):
    from topology.affinity import analyse
    from topology.importers import parse_file
    from topology.model import merge

    parts = [parse_file(f) for f in files]
    for f, t in zip(files, parts):
        if not (t.nics or t.gpus):
            why = "; ".join(t.warnings) or f"{f}: no GPU or NIC in it"
            raise _BadInput(f"--topology: {why}")
    topo = analyse(merge(parts))
    for w in topo.warnings:
        print(f"{PROG}: {w}", file=sys.stderr)
    return topo


def run(files: list[str], topology_files: list[str]) -> Classification:
    """Read and classify; raises :class:`_BadInput` on unreadable input."""
    topo = _topology(topology_files) if topology_files else None
    lines: list[str] = []
    for name in files or ["-"]:
        # line ends kept: a last line without one is cut off (logparse.Record.cut)
        lines += _read(name).decode("utf-8", errors="replace").splitlines(keepends=True)
    return classify_report(lines, topo)


def cmd_classify(args) -> int:
    try:
        result = run(args.files, args.topology)
    except _BadInput as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if result.skipped:
        print(f"{PROG}: skipped {len(result.skipped)} unreadable line(s) (first: line {result.skipped[0]})", file=sys.stderr)
    if result.error:  # the classifier failed: say so, never print "no incidents"
        print(f"{PROG}: the classifier failed, no reading given: {result.error}", file=sys.stderr)
        return 1
    if args.json:
        for inc in result.incidents:
            print(json.dumps(inc.to_json()))
        return 0
    _print_table(result)
    return 0


_COLORS = {"gpu": "red", "nvlink": "red", "gpu-memory": "yellow", "nic-link": "magenta", "nic-device": "magenta",
           "app": "cyan", "config": "yellow", "benign": "green", "unattributed": "white"}


def _print_table(result: Classification) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    c = Console(emoji=False)
    if not c.is_terminal:  # a pipe or file: do not cut the bus ids and codes short
        c = Console(emoji=False, width=160)
    incs = result.incidents
    roots = sum(1 for i in incs if i.secondary_of is None)
    if not incs:
        c.print(f"no incidents in {result.lines} line(s)", highlight=False)
        return
    t = Table("#", "domain", "device", "code", "action", "remedy", "follows", "lines", "seen")
    for n, i in enumerate(incs):
        lines = f"{i.first_line}" if i.first_line == i.last_line else f"{i.first_line}-{i.last_line}"
        code = escape(i.code) + ("" if i.known else " [dim](unknown code)[/]")
        t.add_row(str(n), f"[{_COLORS.get(i.domain, 'white')}]{i.domain}[/]", escape(i.device or "-"), code,
                  f"[bold]{i.action}[/]" if i.action != "none" else i.action, i.remedy,
                  "-" if i.secondary_of is None else f"#{i.secondary_of}", lines, f"{i.count}x")
    c.print(t)
    c.print(f"{len(incs)} incident(s), {roots} root(s), from {result.lines} line(s)", highlight=False)
