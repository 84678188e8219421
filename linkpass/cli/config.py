"""`linkpass config check|show`: validate a config file, print effective or default settings.

    linkpass config check [--no-files] FILE
    linkpass config show FILE
    linkpass config show --defaults [--example]

``check`` validates FILE exactly as the daemon does (:func:`linkpass.config.load_config`) and
prints ``FILE: OK (...)`` on stdout, exit 0; or one line per problem on stderr,
``FILE: <key path>: <what is wrong>``, exit 2 (missing, unreadable, directory, FIFO or device,
over 1 MiB, non-UTF-8 file, TOML syntax errors with line and column, unknown keys, inline
secrets, bad values).  One run reports all it can: with the field errors come the cross-field
checks that need no invalid part and the file checks of the valid sections
(:attr:`ConfigError.sections`; discovery only for a valid config).  It reads the files the config names with the daemon's own functions
(:func:`file_problems`): a notice key file or (with ``rails = "auto"``) a peers file that would
stop the daemon at start is a problem line, exit 2, and so is ``rails = "auto"`` where discovery
on this host finds no compute NIC with a netdev; no ``notice_key_file`` (peer notices and probes
off) is a warning, and so is a ``[[rails]]`` netdev that is not on this host (the daemon keeps
that rail DOWN until it appears); a bad MQTT password, key or certificate file
(the daemon runs on, without alerts) is a ``FILE: warning: mqtt.<option>: ...`` line on stderr,
exit 0, and the OK line counts the warnings.  ``--no-files`` skips those file checks and
discovery (for a config checked on another machine than its node).

``show FILE`` prints the validated config as TOML with every default filled in (options that are
unset are left out).  ``show --defaults`` prints the default of every option, each under its
description as a comment; options without a default are marked "Required" and shown commented
out with an example value.  ``--example`` makes it the example config: required options, and
those that carry ``examples=`` in the schema, are set to their example value, and the arrays of
tables (``[[rails]]``, ``[[peers]]``) get one example entry.  That output is
``deploy/linkpass.toml.example`` (``make example-config`` regenerates it).

The renderer walks the pydantic schema of :class:`linkpass.config.Config`; a section added
there appears here without any change.

Exit codes: 0 ok; 2 bad input (an invalid config, bad arguments), one line per problem.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
import tomli_w
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from linkpass.cli.argtypes import one_line_errors
from linkpass.config import Config, ConfigError, load_config, notice_key

PROG = "linkpass config"
#: comment lines are wrapped to this many columns
WIDTH = 100
EXAMPLE_PATH = "deploy/linkpass.toml.example"

_BARE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")

_HEAD_EXAMPLE = """\
# linkpass configuration example: every option, under its description, with its default.
#
# Generated from the schema in linkpass/config/schema.py by
#     linkpass config show --defaults --example > deploy/linkpass.toml.example
# (`make example-config`); a test checks that this file matches the schema. Do not edit it by
# hand: change the schema's descriptions, defaults and examples instead.
#
# Options marked "Required" have no default; the values given for them, and for a few
# recommended options, are examples to replace. An option shown as "# name: not set" has no
# value by default. Secrets are never written in this file: an option ending in _file names a
# file (mode 0600, readable by root only) that holds the secret.
#
# `linkpass config check FILE` validates a file (one line per problem, exit 2);
# `linkpass config show FILE` prints its effective settings, defaults filled in.
"""

_HEAD_DEFAULTS = """\
# linkpass configuration: the default of every option, under its description.
#
# Options marked "Required" have no default and are shown commented out with an example
# value; an option shown as "# name: not set" has no value by default. Secrets are never
# options: an option ending in _file names a file (mode 0600) that holds the secret.
# `linkpass config show --defaults --example` prints a complete example instead.
"""


# ----------------------------------------------------------------------------- the schema walk


def _shape(annotation: object) -> tuple[str, type[BaseModel] | None, bool]:
    """How a field is written: ``("table", Model, optional)``, ``("tables", Model, False)`` for an
    array of tables, or ``("value", None, False)``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table", annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and type(None) in args and len(args) == 2:
            return "table", models[0], True
    if origin is list and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return "tables", args[0], False
    return "value", None, False


def _describe(f: FieldInfo, model: type[BaseModel] | None = None) -> str:
    """The field's description, else the first sentence of its model's docstring (for tables)."""
    if f.description:
        return " ".join(f.description.split())
    doc = (model.__doc__ or "") if model is not None else ""
    first = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "")
    first = re.sub(r"^(The|One) \[+[\w.]+\]+ (table|entry)(: | \()?", "", first)
    first = first[:1].upper() + first[1:]
    return first.split(". ")[0].rstrip(".") + "." if first else ""


def _key(name: object) -> str:
    s = str(name)
    if _BARE_KEY.match(s):
        return s
    return tomli_w.dumps({"k": s})[4:-1]  # a basic string, escaped by tomli_w


def _value(v: object) -> str:
    """One TOML value on one line: scalars through tomli_w, arrays and inline tables by hand."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return tomli_w.dumps({"v": v})[4:-1]


def _comment(text: str, out: list[str]) -> None:
    for line in textwrap.wrap(text, WIDTH - 2, break_on_hyphens=False, break_long_words=False):
        out.append(f"# {line}")


class _Renderer:
    """Writes one TOML document from the schema; see :func:`render_defaults`."""

    def __init__(self, *, example: bool, comments: bool) -> None:
        self.example = example
        self.comments = comments
        self.out: list[str] = []

    # a header or key line, commented out when its block is
    def _line(self, text: str, commented: bool) -> None:
        self.out.append(f"# {text}" if commented else text)

    def _blank(self) -> None:
        if self.out and self.out[-1] != "":
            self.out.append("")

    def table(self, model: type[BaseModel], values: dict | None, path: list[str], commented: bool) -> None:
        """Options of ``model`` (scalars first, as TOML requires), then its sub-tables."""
        later = []
        for name, f in model.model_fields.items():
            kind, sub, optional = _shape(f.annotation)
            if kind == "value":
                self.option(name, f, values, path, commented)
            else:
                later.append((name, f, kind, sub, optional))
        for name, f, kind, sub, optional in later:
            where = ".".join(path + [name])
            if values is not None:
                v = values.get(name)
                if v is None:
                    continue
                for entry in (v if kind == "tables" else [v]):
                    self._header(where, f, sub, kind, False)
                    self.table(sub, entry, path + [name], False)
                continue
            if kind == "tables":
                # defaults: none; --defaults shows an example entry commented out, --example sets it
                self._header(where, f, sub, kind, commented or not self.example)
                self.table(sub, None, path + [name], commented or not self.example)
            else:
                off = commented or (optional and f.default is None)
                self._header(where, f, sub, kind, off)
                self.table(sub, None, path + [name], off)

    def _header(self, where: str, f: FieldInfo, sub: type[BaseModel], kind: str, commented: bool) -> None:
        head = f"[{where}]" if kind == "table" else f"[[{where}]]"
        self._blank()
        if self.comments:
            text = _describe(f, sub)
            _comment(f"{head} {text}" if text else head, self.out)
        self._line(head, commented)

    def option(self, name: str, f: FieldInfo, values: dict | None, path: list[str], commented: bool) -> None:
        """One ``key = value`` line, under its description when comments are on."""
        where = ".".join(path + [name])
        if values is not None:  # show FILE: the validated value, unset ones left out
            if values.get(name) is not None:
                if self.comments:
                    self._blank()
                    _comment(_describe(f), self.out)
                self.out.append(f"{_key(name)} = {_value(values[name])}")
            return
        examples = list(f.examples or [])
        required = f.is_required()
        default = None if required else f.get_default(call_default_factory=True)
        if required and not examples:
            raise ValueError(f"{where}: has no default and no examples=[...] in linkpass/config/schema.py, "
                             "so the example config cannot show it")
        if self.comments:
            self._blank()
            _comment(_describe(f) + (" Required." if required else ""), self.out)
        if required or (default is None and examples):
            marked = isinstance(f.json_schema_extra, dict) and bool(f.json_schema_extra.get("in_example"))
            on = self.example and not commented and (required or marked)
            self._line(f"{_key(name)} = {_value(to_jsonable_python(examples[0]))}", not on)
        elif default is None or default is PydanticUndefined:
            self.out.append(f"# {_key(name)}: not set")
        else:
            self._line(f"{_key(name)} = {_value(to_jsonable_python(default))}", commented)

    def text(self, head: str) -> str:
        lines = [ln.rstrip() for ln in self.out]
        while lines and lines[0] == "":
            lines.pop(0)
        body = "\n".join(lines).rstrip("\n")
        body = re.sub(r"\n{3,}", "\n\n", body)
        return (head + "\n" if head else "") + body + "\n"


def render_defaults(*, example: bool = False, model: type[BaseModel] = Config) -> str:
    """The whole schema as a commented TOML document.

    Args:
        example: False: every default, required options commented out with an example value
            (``linkpass config show --defaults``).  True: the example config, which passes
            ``linkpass config check``: required options and options with ``examples=`` set to
            their first example, one example entry in each array of tables.
        model: the schema (tests pass a small model).

    Returns:
        TOML text ending in one newline; every option sits under its ``description`` as a
        ``#`` comment wrapped to :data:`WIDTH` columns.

    Raises:
        ValueError: a required option has no ``examples=`` (the example could not be valid).
    """
    r = _Renderer(example=example, comments=True)
    r.table(model, None, [], False)
    return r.text(_HEAD_EXAMPLE if example else _HEAD_DEFAULTS)


def render_example() -> str:
    """The text of ``deploy/linkpass.toml.example`` (``render_defaults(example=True)``)."""
    return render_defaults(example=True)


def render_config(cfg: BaseModel, *, comments: bool = False, source: str | None = None) -> str:
    """A validated config as TOML, every default filled in and unset (None) options left out.

    Parsing the text again gives an equal config.  ``comments`` puts each option's description
    above it; ``source`` names the file in a first comment line.
    """
    r = _Renderer(example=False, comments=comments)
    r.table(type(cfg), cfg.model_dump(mode="json"), [], False)
    head = f"# effective configuration of {source} (defaults filled in)" if source else ""
    return r.text(head)


# ----------------------------------------------------------------------------- commands


def _summary(cfg: Config) -> str:
    rails = "rails from discovery" if cfg.auto else f"{len(cfg.rails)} rail{'s' if len(cfg.rails) != 1 else ''}"
    peers = f"{len(cfg.peers)} peer{'s' if len(cfg.peers) != 1 else ''}"
    if cfg.topology.peers_file:
        peers += f" + {cfg.topology.peers_file}"
    return f"host {cfg.daemon.host}, mode {cfg.daemon.mode}, {rails}, {peers}"


_MQTT_OPTION = re.compile(r"^(mqtt\.\w+) (.*)$")


SYS_CLASS_NET = Path("/sys/class/net")


def absent_netdevs(cfg: Config, sys_class_net: Path | None = None) -> list[str]:
    """``rails[i].netdev: ...`` for each configured rail whose netdev is not on this host (no
    ``/sys/class/net/<netdev>``, in this network namespace): the daemon starts anyway and keeps
    that rail DOWN until a netdev of that name appears (the engine's warning at its first link
    dump), which is what a typo in a netdev name looks like."""
    sys_class_net = sys_class_net or SYS_CLASS_NET
    out = []
    for i, r in enumerate(getattr(cfg, "rails", None) or ()):
        if getattr(r, "netdev", None) is None:  # an invalid entry of a partial config: its own problem line
            continue
        if not (sys_class_net / r.netdev).exists():
            out.append(f"rails[{i}].netdev: {r.netdev!r} is not a netdev on this host (no {sys_class_net / r.netdev}), "
                       f"so the daemon keeps rail {r.id} DOWN until it appears")
    return out


def file_problems(cfg: Config, source: str, complete: bool = True) -> tuple[list[str], list[str]]:
    """Read the files ``cfg`` names as the daemon does, with the daemon's own functions.

    Problems stop the daemon at start (exit 2): the notice key file
    (:func:`linkpass.config.notice_key`), ``[probe] datapath = "c"`` where the C module was not
    built (:func:`linkpass.adapters.prober.datapath_problem`) and, with ``[topology] rails =
    "auto"``, the peers file (:func:`linkpass.autoconf.read_peers_file`) and discovery finding no
    compute NIC with a netdev (:func:`linkpass.discovery.resolve_live`, what the daemon runs at
    start).  Warnings do not: no ``notice_key_file`` (the daemon runs with peer notices and probes
    off), lines of the peers file that the daemon skips, discovery's warnings, a ``peers_file``
    that is not read (rails not "auto"), a configured rail whose netdev is not on this host
    (:func:`absent_netdevs`), a ``[risk] sysfs_root`` that is not a sysfs root (counter trends
    off), and with ``mqtt.enabled`` the broker password and TLS files, checked by the MQTT
    adapter's :func:`~linkpass.adapters.mqtt_credentials.read_password_file` and
    :func:`~linkpass.adapters.mqtt_credentials.build_tls_context` (the daemon logs those and runs
    without alerts).

    Args:
        cfg: the validated config, or (``complete=False``) the sections of an invalid one that
            are valid on their own (:attr:`ConfigError.sections`; None for an invalid one): the
            checks of the valid sections run, and discovery, which needs the whole config, does not.
        source: the config's path, which starts every line.
        complete: False for such a partial config.

    Returns:
        ``(problems, warnings)``: lines ``<source>: <key path>: <what is wrong>`` and
        ``<source>: warning: <key path>: <what is wrong>``.
    """
    from linkpass.autoconf import parse_peers_file, read_peers_file
    from linkpass.discovery import resolve_live

    problems: list[str] = []
    warnings: list[str] = []
    try:
        if cfg.daemon is not None and notice_key(cfg, source) is None:  # the daemon runs, but blind to gray failures
            off = "peer notices and probes are off" if cfg.probe is None or cfg.probe.enabled else "peer notices are off"
            warnings.append(f"{source}: warning: daemon.notice_key_file: not set, so {off} "
                            "(the key authenticates both; see `linkpass config show --defaults`)")
    except ConfigError as e:
        problems.append(str(e))
    if cfg.topology is not None and cfg.auto:
        try:
            text = read_peers_file(cfg, source)
        except ConfigError as e:
            problems.append(str(e))
        else:
            skipped = []
            if text is not None:
                _, skipped = parse_peers_file(text, cfg.topology.peers_file)
                warnings += [f"{source}: warning: topology.peers_file: {w}" for w in skipped]
            if complete:  # discovery reads the whole config: only once it is valid
                try:  # discovery as `linkpass run` does it: no compute NIC stops the daemon at start
                    live = resolve_live(cfg, source)
                except ConfigError as e:
                    problems.append(str(e))
                else:
                    skipped_lines = set(skipped)
                    warnings += [f"{source}: warning: topology: {w}" for w in live.warnings if w not in skipped_lines]
    elif cfg.topology is not None and cfg.topology.peers_file:
        warnings.append(f"{source}: warning: topology.peers_file: not read: peers come from [[peers]] unless "
                        '[topology] rails = "auto"')
    if not (cfg.topology is not None and cfg.auto):
        warnings += [f"{source}: warning: {w}" for w in absent_netdevs(cfg)]
    if getattr(cfg, "probe", None) is not None:
        from linkpass.adapters.prober import datapath_problem

        why = datapath_problem(cfg)
        if why is not None:  # `linkpass run` refuses to start on it
            problems.append(f"{source}: probe.datapath: {why}")
    if cfg.risk is not None and cfg.risk.enabled:
        from linkpass.adapters.risk_source import sysfs_root_problem

        why = sysfs_root_problem(cfg.risk.sysfs_root)
        if why is not None:  # the daemon runs, without counter trends: say so
            warnings.append(f"{source}: warning: risk.sysfs_root: {why}, so counter trends are off")
    if cfg.mqtt is not None and cfg.mqtt.enabled:
        from linkpass.adapters.mqtt_credentials import MqttSetupError, build_tls_context, read_password_file

        checks = [functools.partial(read_password_file, cfg.mqtt.password_file)] if cfg.mqtt.password_file else []
        checks.append(functools.partial(build_tls_context, cfg.mqtt))
        for check in checks:
            try:
                check()
            except MqttSetupError as e:  # "mqtt.password_file /p: why" -> "mqtt.password_file: /p: why"
                warnings.append(f"{source}: warning: " + _MQTT_OPTION.sub(r"\1: \2", " ".join(str(e).split("\n"))))
    return problems, warnings


def cmd_check(args) -> int:
    """``linkpass config check [--no-files] FILE``: exit 0 and ``FILE: OK (...)`` (warnings on
    stderr), or one line per problem on stderr and exit 2."""
    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        # every problem found in one run: the field errors, the cross-field checks and the files
        # of the sections that are valid on their own (e.sections; None: the file is not TOML ...)
        problems, warnings = list(e.problems), []
        if e.sections is not None and not args.no_files:
            more, warnings = file_problems(e.sections, str(Path(args.file)), complete=False)
            problems += [p for p in more if p not in problems]
        for line in problems + warnings:
            print(line, file=sys.stderr)
        return 2
    if args.no_files:
        problems, warnings, note = [], [], "; files not checked"
    else:
        problems, warnings = file_problems(cfg, str(Path(args.file)))  # named as load_config names it
        note = f"; {len(warnings)} warning{'s' if len(warnings) != 1 else ''}" if warnings else ""
    for line in problems + warnings:
        print(line, file=sys.stderr)
    if problems:
        return 2
    print(f"{args.file}: OK ({_summary(cfg)}{note})")
    return 0


def cmd_show(args) -> int:
    """``linkpass config show FILE | --defaults [--example]``: TOML on stdout."""
    if args.file and (args.defaults or args.example):
        print(f"{PROG} show: give FILE or --defaults/--example, not both", file=sys.stderr)
        return 2
    if not args.file and not (args.defaults or args.example):
        print(f"{PROG} show: give a config FILE, or --defaults (with --example: the example config)", file=sys.stderr)
        return 2
    if args.file:
        try:
            cfg = load_config(args.file)
        except ConfigError as e:
            for line in e.problems:
                print(line, file=sys.stderr)
            return 2
        sys.stdout.write(render_config(cfg, source=args.file))
        return 0
    sys.stdout.write(render_defaults(example=args.example))
    return 0


def register(subparsers) -> None:
    """Add ``config check`` and ``config show`` to the ``linkpass`` parser."""
    c = subparsers.add_parser("config", help="check a config file, show effective or default settings",
                              description="Validate a linkpass TOML config, or print it with defaults filled in.")
    sub = c.add_subparsers(dest="config_command", required=True, metavar="check|show")
    k = sub.add_parser("check", help="validate FILE: exit 0, or one line per problem and exit 2",
                       description="Validate FILE as the daemon does at start, including the files it names "
                       "(notice key, peers file, discovery with rails = \"auto\", datapath = \"c\" without the C module; "
                       "MQTT password and TLS files, a missing notice_key_file and [[rails]] netdevs not on this host give "
                       "warnings only): FILE: OK and "
                       "exit 0, or one line per problem and exit 2.")
    k.add_argument("file", metavar="FILE", help="TOML config file")
    k.add_argument("--no-files", action="store_true",
                   help="do not read the files the config names (notice_key_file, peers_file, MQTT files) and skip "
                   "the netdev checks and discovery, e.g. to check a config on another machine than its node")
    k.set_defaults(func=cmd_check)
    s = sub.add_parser("show", help="print FILE's effective config, or the defaults of every option")
    s.add_argument("file", nargs="?", metavar="FILE", help="TOML config file (print it validated, defaults filled in)")
    s.add_argument("--defaults", action="store_true", help="print every option's default under its description")
    s.add_argument("--example", action="store_true", help="print the example config (deploy/linkpass.toml.example)")
    s.set_defaults(func=cmd_show)
    for p, prog in ((c, PROG), (k, f"{PROG} check"), (s, f"{PROG} show")):
        one_line_errors(p, prog)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m linkpass.cli.config config check FILE``), same as ``linkpass``."""
    p = argparse.ArgumentParser(prog="linkpass")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
