"""Validation failures as messages: :class:`ConfigError` and one ``<file>: <field>: <problem>``
line per pydantic error, in TOML's words (unknown keys get a did-you-mean hint, inline secrets
the rule that secrets come only from files)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ValidationError

from linkpass.config.schema import Config
from linkpass.config.values import _got, _shown


class ConfigError(Exception):
    """A configuration file is missing, unreadable or invalid.

    ``str(err)`` is a single line: ``<file>: <field>: <what is wrong>``.  ``err.problems``
    lists every problem found, one such line each (``str(err)`` is the first, with a count of
    the others); ``linkpass config check`` prints them all.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems else [message]
        #: for a config that failed validation: its sections that are valid on their own
        #: (:func:`linkpass.config.loading.valid_sections`); None otherwise
        self.sections = None


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            out += " (key)"
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


#: An unknown key with this name is taken for an inline secret (``password``, ``mqtt_token``, ``key``...).
_SECRET_NAME = re.compile(r"(?i)(^|_)(pass(word|wd|phrase)?|secret|token|credentials?|key|psk)$")


def _options_at(loc: tuple) -> list[str]:
    """The option names of the table at ``loc`` (a pydantic error location), [] if unknown."""
    import typing

    model: object = Config
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return []
        todo, model = [fields[part].annotation], None
        while todo:  # unwrap list[X], X | None, ... down to a section model
            t = todo.pop(0)
            if isinstance(t, type) and issubclass(t, BaseModel):
                model = t
                break
            todo.extend(typing.get_args(t))
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _wanted(loc: tuple, kind: str) -> str:
    """What a table or array at ``loc`` should have been, in TOML words (for model/list/dict type errors)."""
    name = ".".join(str(x) for x in loc if not isinstance(x, int))
    if kind == "model_type":
        return f"a table (a [[{name}]] entry)" if loc and isinstance(loc[-1], int) else f"a table ([{name}])"
    if kind == "list_type":
        return f"an array of tables ([[{name}]])" if _options_at(loc) else "an array"
    return "a table"


def _problem(err: dict) -> str:
    """One ``<field>: <what is wrong>`` line for one pydantic error (no file name, no newline).

    Field validators' "Value error, " prefix is dropped; a cross-field check that names its field
    first (``"rails[1].address: ..."``) moves that name into the field; an unknown key gets a
    did-you-mean hint, or, when it looks like a secret, the rule that secrets come only from
    files; a wrong scalar value is quoted as ``(got ...)``.
    """
    import difflib

    loc = tuple(err.get("loc", ()))
    field = _loc(loc)
    msg = str(err.get("msg", "invalid")).replace("\n", " ")
    kind = err.get("type")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        # cross-field checks name their field at the start of the message: "rails[1].address: ..."
        m = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", msg)
        if m:
            field = f"{field}.{m.group(1)}" if field else m.group(1)
            msg = m.group(2)
    elif kind == "extra_forbidden":
        name = str(loc[-1]) if loc else ""
        if _SECRET_NAME.search(name):
            use = f"{name}_file" if f"{name}_file" in _options_at(loc[:-1]) else "a *_file option"
            msg = ("secrets are never taken inline: put the secret in a file that only root can read "
                   f"(mode 0600) and name that file with {use}")
        else:
            near = difflib.get_close_matches(name, _options_at(loc[:-1]), n=1, cutoff=0.6)
            msg += f" (unknown option; did you mean {near[0]!r}?)" if near else " (unknown option)"
    elif kind in ("model_type", "list_type", "dict_type"):  # not pydantic's class names: TOML's words
        msg = f"must be {_wanted(loc, kind)}, got {_got(err.get('input'))}"
    elif kind != "missing" and isinstance(err.get("input"), (str, int, float, bool)):
        msg += f" (got {_shown(err['input'])})"
    return f"{field or '(top level)'}: {msg}"


def problem_line(msg: str) -> str:
    """``<field>: <what is wrong>`` for a cross-field check's message, as :func:`_problem`
    writes the same message raised by the model validator."""
    return _problem({"loc": (), "msg": f"Value error, {msg}", "type": "value_error"})


def validation_problems(e: ValidationError, source: str) -> list[str]:
    """Every problem of a failed validation, one ``<source>: <field>: <what is wrong>`` line each.

    pydantic runs the cross-field checks (model validators) only once every field is valid;
    :func:`linkpass.config.loading.parse_config` adds those that do not need an invalid
    section.  Duplicate lines are dropped; the order is pydantic's.
    """
    out: list[str] = []
    for err in e.errors():
        line = f"{source}: {_problem(err)}"
        if line not in out:
            out.append(line)
    return out
