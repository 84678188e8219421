"""How configuration messages quote what the file holds: values in TOML/JSON style, their TOML
kinds, and reader errors in the user's words (one line each, never a traceback)."""

from __future__ import annotations

import datetime
import json
import math


def huge_number_text(e: ValueError) -> str:
    """A reader's ValueError as one line for the user: Python's integer-digit limit is named as
    what the input holds (its advice to call ``sys.set_int_max_str_digits`` is for programmers)."""
    msg = str(e)
    if "integer string conversion" in msg:
        return "a number with more digits than any setting can use (Python reads integers of up to 4300 digits)"
    return msg.split("; use sys.set_int_max_str_digits", 1)[0]


def _shown(v: object) -> str:
    """A value as every message quotes it, in JSON/TOML style on one line: ``"a\\tb"`` (JSON string
    escapes), ``true``, ``5``, ``1.5``, ``nan``, ``["a", 1]``; cut to 60 characters."""
    if isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, float) and not math.isfinite(v):
        text = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    elif isinstance(v, (int, float)):
        text = repr(v)
    elif isinstance(v, (str, list, tuple, dict)):
        text = json.dumps(v, ensure_ascii=False, default=str)
    else:  # dates and times from TOML
        text = v.isoformat() if hasattr(v, "isoformat") else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


#: TOML's names for the Python types tomllib returns (bool before int: a bool is an int).
_TOML_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"), (list, "an array"),
               (dict, "a table"), (datetime.datetime, "a date-time"), (datetime.date, "a date"), (datetime.time, "a time"))


def _got(v: object) -> str:
    """What a TOML value is, for a message: ``a string "x"``, ``an integer 5``, ``a table``."""
    kind = next((k for t, k in _TOML_KINDS if isinstance(v, t)), type(v).__name__)
    return kind if isinstance(v, dict) else f"{kind} {_shown(v)}"
