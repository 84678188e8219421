"""Argument checks shared by the ``linkpass`` sub-commands (and the bench scripts' own parsers).

argparse calls a ``type=`` function on the option's text before any command runs, so a bad value
is refused before anything is measured, probed or built.  Each function here raises
:class:`argparse.ArgumentTypeError` with the value and what is allowed; argparse adds the
option's name (``argument --trials: -3 is negative; it must be a whole number >= 1``).
:func:`one_line_errors` makes a parser print that as one line naming the command, exit 2, instead
of the usage block.

    p.add_argument("--trials", type=int_range(1), default=10)
    p.add_argument("--gpu", type=gpu_index)
    one_line_errors(p)
    # linkpass bench detect: argument --trials: -3 is negative; it must be a whole number >= 1 (see `...`)
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

#: The largest GPU index taken (``--gpu``, ``--local-rank``): a host has far fewer GPUs, and
#: ``[device] gpus`` takes the same range (0..1023).
MAX_GPU_INDEX = 1023


def one_line_errors(p: argparse.ArgumentParser, prog: str | None = None) -> None:
    """Make ``p`` report a usage error as one line on stderr, ``PROG: MESSAGE (see `PROG --help`)``,
    and exit 2 (argparse would print the usage block first)."""
    name = prog or p.prog

    def error(message: str):
        print(f"{name}: {message} (see `{name} --help`)", file=sys.stderr)
        sys.exit(2)

    p.error = error  # type: ignore[method-assign]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _allowed(lo: float | None, hi: float | None, kind: str, lo_open: bool = False, hi_open: bool = False) -> str:
    """What a value may be, in words: ``a whole number from 0 to 1023``, ``a number > 0``."""
    if lo is not None and hi is not None:
        if not lo_open and not hi_open:
            return f"{kind} from {_num(lo)} to {_num(hi)}"
        return f"{kind} in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{kind} {'<' if hi_open else '<='} {_num(hi)}"
    return kind


def int_range(lo: int | None = None, hi: int | None = None, kind: str = "a whole number") -> Callable[[str], int]:
    """A ``type=`` for a whole number in ``lo..hi`` (either bound may be None: unbounded);
    ``kind`` names it in the message (``"a GPU index"``)."""
    must = f"it must be {_allowed(lo, hi, kind)}"

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:  # also past Python's 4300-digit conversion limit
            raise argparse.ArgumentTypeError(f"{_short(text)!r} is not a whole number; {must}") from None
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"{_short(text)} is {'negative' if v < 0 <= lo else 'too small'}; {must}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"{_short(text)} is too large; {must}")
        return v

    parse.__name__ = kind
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False) -> Callable[[str], float]:
    """A ``type=`` for a finite number in ``[lo, hi]`` (``lo_open``/``hi_open``: the bound itself is out)."""
    must = f"it must be {_allowed(lo, hi, 'a number', lo_open, hi_open)}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_short(text)!r} is not a number; {must}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{_short(text)} is not a finite number; {must}")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and (v > hi or (hi_open and v == hi))):
            raise argparse.ArgumentTypeError(f"{_short(text)} is out of range; {must}")
        return v

    parse.__name__ = "number"
    return parse


def int_list(lo: int | None = None, hi: int | None = None) -> Callable[[str], str]:
    """A ``type=`` for comma-separated whole numbers, each in ``lo..hi``.  Returns the text
    unchanged (the commands split it themselves), once every item is known to be good."""
    allowed = _allowed(lo, hi, "whole numbers")

    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        for x in items:
            try:
                v = int(x)
            except ValueError:
                v = None
            if v is None or (lo is not None and v < lo) or (hi is not None and v > hi):
                what = "" if len(items) == 1 else f" ({_short(x)!r} is not)" if v is None else f" ({v} is not)"
                raise argparse.ArgumentTypeError(f"{_short(text)}: must be comma-separated {allowed}{what}")
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated {allowed}")
        return text

    parse.__name__ = "list of whole numbers"
    return parse


def _short(text: str, n: int = 40) -> str:
    """The value as the message shows it: at most ``n`` characters."""
    t = text.strip()
    return t if len(t) <= n else f"{t[:n]}... ({len(t)} characters)"


#: ``--gpu N``, ``--local-rank N``: a GPU index, 0..:data:`MAX_GPU_INDEX`.
gpu_index = int_range(0, MAX_GPU_INDEX, "a GPU index")
