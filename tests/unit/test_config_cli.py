"""`linkpass config check|show`, the generated example config and the schema's documentation.

Each bad file gives one line per problem, ``FILE: <key path>: <what>``, exit 2, never a
traceback; the example in deploy/ is byte for byte what the schema generates and passes check.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from linkpass import config as config_mod
from linkpass.cli import main as cli_main
from linkpass.config import Config, parse_config
from linkpass.config_cli import EXAMPLE_PATH, render_config, render_defaults, render_example

ROOT = Path(__file__).resolve().parents[2]

GOOD = """\
[daemon]
host = "h0"
host_ip = "198.19.0.1"
notice_key_file = "/etc/linkpass/notice.key"

[[rails]]
id = 0
netdev = "rail0"

[[rails]]
id = 1
netdev = "rail1"

[[peers]]
name = "h1"
host_ip = "198.19.0.2"
rail_ips = { "0" = "198.18.0.2", "1" = "198.18.1.2" }

[probe]
interval_ms = 20
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = cli_main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def write(tmp_path: Path, content: str | bytes, name: str = "linkpass.toml") -> Path:
    p = tmp_path / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def edit(old: str, new: str, text: str = GOOD) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# ----------------------------------------------------------------------------- check


def test_check_ok(tmp_path, capsys):
    p = write(tmp_path, GOOD)
    rc, out, err = run(capsys, "config", "check", str(p))
    assert (rc, err) == (0, "")
    assert out == f"{p}: OK (host h0, mode host-ip, 2 rails, 1 peer)\n"


# text -> the exact problem lines after "FILE: "
BAD_LINES = {
    "below-minimum": (edit("interval_ms = 20", "interval_ms = 0"),
                      ["probe.interval_ms: Input should be greater than or equal to 1 (got 0)"]),
    "missing-netdev": (edit('id = 1\nnetdev = "rail1"\n', "id = 1\n"), ["rails[1].netdev: Field required"]),
    "wrong-type": (edit('host = "h0"', "host = 5"), ["daemon.host: Input should be a valid string (got 5)"]),
    "bad-literal": (edit('host = "h0"', 'host = "h0"\nmode = "bonding"'),
                    ["daemon.mode: Input should be 'host-ip' or 'per-rail-ip' (got \"bonding\")"]),
    "unknown-key-near": (edit('host = "h0"', 'host = "h0"\nhold_dwn_ms = 5'),
                         ["daemon.hold_dwn_ms: Extra inputs are not permitted (unknown option; did you mean 'hold_down_ms'?)"]),
    "unknown-key": (edit("[probe]", "[probe]\nflavour = 1"), ["probe.flavour: Extra inputs are not permitted (unknown option)"]),
    "unknown-section": ("[colour]\nx = 1\n" + GOOD, ["colour: Extra inputs are not permitted (unknown option)"]),
    "cross-field": (edit('host_ip = "198.19.0.1"\n', ""), ['daemon.host_ip: required when mode = "host-ip"']),
    "empty-file": ("", ["daemon: Field required"]),
    "several": (edit("interval_ms = 20", "interval_ms = 0\nport = 0", edit('host = "h0"', "host = 5")),
                ["daemon.host: Input should be a valid string (got 5)",
                 "probe.port: Input should be greater than or equal to 1 (got 0)",
                 "probe.interval_ms: Input should be greater than or equal to 1 (got 0)"]),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_check_reports_every_problem_on_its_own_line(tmp_path, capsys, case):
    text, want = BAD_LINES[case]
    p = write(tmp_path, text)
    rc, out, err = run(capsys, "config", "check", str(p))
    assert rc == 2 and out == ""
    assert sorted(err.splitlines()) == sorted(f"{p}: {w}" for w in want), err


# content (or a setup) -> a needle of the single error line
BAD_FILES = {
    "toml-syntax": ("[daemon\nhost = 1\n", "not valid TOML: "),
    "truncated": (GOOD[: GOOD.index('"198.19.0.2"') + 5], "not valid TOML: "),
    "truncated-table-header": (GOOD[: GOOD.index("[probe]") + 3], "not valid TOML: "),
    "duplicate-key": (edit('host = "h0"', 'host = "h0"\nhost = "h2"'), "not valid TOML: "),
    "non-utf8": (GOOD.encode().replace(b"h1", b"h\xff1"), "not UTF-8 text"),
    "binary": (b"\x00\x01\x02\x7fELF\x00", "not valid TOML: "),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_check_bad_files_one_line(tmp_path, capsys, case):
    content, needle = BAD_FILES[case]
    p = write(tmp_path, content)
    rc, out, err = run(capsys, "config", "check", str(p))
    assert rc == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"{p}: ") and needle in line, line
    if needle.startswith("not valid TOML"):
        assert re.search(r"\(at (line \d+|end of document, line \d+), column \d+\)$", line), line


def test_check_toml_error_names_line_and_column(tmp_path, capsys):
    p = write(tmp_path, edit('netdev = "rail1"', "netdev = rail1"))
    rc, _, err = run(capsys, "config", "check", str(p))
    line_no = edit('netdev = "rail1"', "netdev = rail1").splitlines().index("netdev = rail1") + 1
    assert rc == 2 and f"(at line {line_no}, column 10)" in err, err


def test_truncated_file_names_where_it_ends(tmp_path, capsys):
    text = GOOD[: GOOD.index('"198.19.0.2"') + 5]  # cut inside a string
    p = write(tmp_path, text)
    rc, _, err = run(capsys, "config", "check", str(p))
    n = text.count("\n") + 1
    assert rc == 2 and err == f"{p}: not valid TOML: Unterminated string (at end of document, line {n}, column 16)\n"  # just after host_ip = "198.


def test_check_missing_file_and_directory(tmp_path, capsys):
    rc, out, err = run(capsys, "config", "check", str(tmp_path / "nope.toml"))
    assert (rc, out, err) == (2, "", f"{tmp_path / 'nope.toml'}: no such file\n")
    rc, out, err = run(capsys, "config", "check", str(tmp_path))
    assert (rc, out, err) == (2, "", f"{tmp_path}: is a directory, not a config file\n")


@pytest.mark.skipif(hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
                    reason="root reads a mode-000 file anyway")
def test_check_unreadable_file(tmp_path, capsys):
    p = write(tmp_path, GOOD)
    p.chmod(0)
    rc, _, err = run(capsys, "config", "check", str(p))
    assert rc == 2 and err == f"{p}: permission denied\n"


def test_inline_password_is_refused_without_echoing_it(tmp_path, capsys):
    p = write(tmp_path, edit('host = "h0"', 'host = "h0"\npassword = "hunter2-secret"'))
    rc, _, err = run(capsys, "config", "check", str(p))
    assert rc == 2
    (line,) = err.splitlines()
    assert line.startswith(f"{p}: daemon.password: secrets are never taken inline"), line
    assert "mode 0600" in line and "hunter2" not in line


def _sections(model: type[BaseModel] = Config, path: tuple[str, ...] = ()):
    """(path, model) of every table of the schema, nested ones included."""
    yield path, model
    for name, f in model.model_fields.items():
        for t in [f.annotation, *typing.get_args(f.annotation)]:
            if isinstance(t, type) and issubclass(t, BaseModel):
                yield from _sections(t, path + (name,))


def _fields():
    for path, model in _sections():
        for name, f in model.model_fields.items():
            yield ".".join(path + (name,)), name, f


@pytest.mark.parametrize("path,option", [(".".join(p), n[: -len("_file")]) for p, m in _sections() for n in m.model_fields
                                         if n.endswith("_file") and config_mod._SECRET_NAME.search(n[: -len("_file")])])
def test_inline_secret_points_at_its_file_option(path, option):
    """Every secret that has a *_file option (password_file, key_file...) is refused inline with that option named."""
    import tomli_w

    doc = node = tomllib.loads(GOOD)
    for part in path.split(".") if path else []:
        node = node.setdefault(part, {})
        node = node[0] if isinstance(node, list) else node
    node[option] = "s3cr3t-value"
    with pytest.raises(config_mod.ConfigError) as ei:
        parse_config(tomli_w.dumps(doc), "f.toml")
    line = next(x for x in ei.value.problems if f"{option}:" in x)
    assert "secrets are never taken inline" in line and f"{option}_file" in line and "s3cr3t" not in line


def test_no_option_takes_a_secret_inline():
    """Secrets only from files: an option named like a secret must be a *_file path."""
    bad = [p for p, name, _ in _fields() if config_mod._SECRET_NAME.search(name) and not name.endswith("_file")]
    assert bad == [], f"options that would take a secret inline: {bad}"


def test_check_as_a_real_process_has_no_traceback(tmp_path):
    p = write(tmp_path, edit("interval_ms = 20", "interval_ms = 0"))
    r = subprocess.run([sys.executable, "-m", "linkpass.cli", "config", "check", str(p)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == f"{p}: probe.interval_ms: Input should be greater than or equal to 1 (got 0)\n"


def test_config_without_subcommand_is_one_line(capsys):
    rc, out, err = run(capsys, "config")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "check|show" in err


def test_one_line_problem_of_load_config_is_the_first_of_the_list():
    text, want = BAD_LINES["several"]
    with pytest.raises(config_mod.ConfigError) as ei:
        parse_config(text, "f.toml")
    assert len(ei.value.problems) == 3
    assert str(ei.value) == f"{ei.value.problems[0]} (and 2 more problem(s))"


# ----------------------------------------------------------------------------- show


def test_show_file_is_the_effective_config_and_parses_back(tmp_path, capsys):
    p = write(tmp_path, GOOD)
    rc, out, err = run(capsys, "config", "show", str(p))
    assert (rc, err) == (0, "")
    assert out.startswith(f"# effective configuration of {p}")
    doc = tomllib.loads(out)
    assert doc["probe"]["interval_ms"] == 20 and doc["probe"]["detect_multiplier"] == 3  # set, and a default
    assert doc["daemon"]["route_protocol"] == 201 and "address" not in doc["rails"][0]  # unset options left out
    assert doc["peers"][0]["rail_ips"] == {"0": "198.18.0.2", "1": "198.18.1.2"}
    assert parse_config(out) == parse_config(GOOD)
    assert set(doc) == {n for n, f in Config.model_fields.items()}


def test_show_bad_file_is_exit_2(tmp_path, capsys):
    p = write(tmp_path, edit("interval_ms = 20", "interval_ms = 0"))
    rc, out, err = run(capsys, "config", "show", str(p))
    assert rc == 2 and out == "" and err == f"{p}: probe.interval_ms: Input should be greater than or equal to 1 (got 0)\n"


@pytest.mark.parametrize("argv", [["config", "show"], ["config", "show", "--defaults", "x.toml"]])
def test_show_needs_file_or_defaults(capsys, argv):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1


def test_show_defaults_documents_every_option(capsys):
    rc, out, err = run(capsys, "config", "show", "--defaults")
    assert (rc, err) == (0, "") and out == render_defaults()
    comments = " ".join(ln[2:] for ln in out.splitlines() if ln.startswith("# "))
    lines = out.splitlines()
    for path, name, f in _fields():
        assert f.description, f"{path} has no description"
        if typing.get_origin(f.annotation) is list and any(isinstance(a, type) and issubclass(a, BaseModel)
                                                           for a in typing.get_args(f.annotation)):
            assert f"# [[{path}]]" in lines, path
            continue
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            assert f"[{path}]" in lines, path
            continue
        assert any(ln.startswith((f"{name} = ", f"# {name} = ", f"# {name}: not set")) for ln in lines), path
        assert " ".join(f.description.split()) in comments, path
    assert '# host = "gpu-node-07"' in lines  # required: commented out with its example


def test_show_defaults_values_are_the_real_defaults(capsys):
    """The --defaults text plus the required options validates to the same config as the bare minimum."""
    _, out, _ = run(capsys, "config", "show", "--defaults")
    doc = tomllib.loads(out)
    doc["daemon"].update(host="h0", host_ip="198.19.0.1")
    doc["rails"] = [{"id": 0, "netdev": "rail0"}]
    minimal = '[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
    assert Config.model_validate(doc) == parse_config(minimal)


# ----------------------------------------------------------------------------- the example


def test_example_in_deploy_matches_the_generator_byte_for_byte():
    path = ROOT / EXAMPLE_PATH
    assert path.read_bytes() == render_example().encode(), (
        f"{EXAMPLE_PATH} is stale: regenerate it with `make example-config` "
        "(linkpass config show --defaults --example > deploy/linkpass.toml.example)")
    assert not (ROOT / "deploy" / "linkpass.example.toml").exists(), "the old example file is back"


def test_example_passes_check_and_cli_prints_it(capsys):
    rc, out, err = run(capsys, "config", "check", str(ROOT / EXAMPLE_PATH))
    assert rc == 0 and err == "" and out.endswith("OK (host gpu-node-07, mode host-ip, 1 rail, 1 peer)\n")
    rc, out, _ = run(capsys, "config", "show", "--defaults", "--example")
    assert rc == 0 and out == render_example()


def test_example_shows_every_section_and_sets_the_required_options():
    doc = tomllib.loads(render_example())
    assert set(doc) == set(Config.model_fields)  # every section, [[rails]] and [[peers]] with an entry
    assert doc["rails"] == [{"id": 0, "netdev": "ens1f0np0"}]  # address: optional in host-ip mode, commented out
    assert '# address = "198.18.0.7"' in render_example().splitlines()
    assert doc["daemon"]["notice_key_file"] == "/etc/linkpass/notice.key"  # recommended, marked IN_EXAMPLE
    assert "peers_file" not in doc["topology"]  # optional without an example: "# peers_file: not set"


def test_required_options_have_an_example():
    missing = [p for p, _, f in _fields() if f.is_required() and not f.examples
               and not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
    assert missing == [], f"required options without examples=[...]: {missing}"


# ----------------------------------------------------------------------------- the renderer is generic


class _Leaf(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int = Field(1, description="An integer.")
    tags: dict[str, int] = Field(default_factory=lambda: {"x y": 2}, description="A map.")


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(examples=["n"], description="A required name.")
    maybe: str | None = Field(None, examples=["m"], description="Optional, shown with its example.")
    leaf: _Leaf = Field(default_factory=_Leaf, description="A table.")
    items: list[_Leaf] = Field(default_factory=list, description="An array of tables.")
    off: _Leaf | None = Field(None, description="An optional table.")


def test_renderer_follows_any_schema():
    ex = render_defaults(example=True, model=_Schema)
    assert tomllib.loads(ex) == {"name": "n", "leaf": {"a": 1, "tags": {"x y": 2}}, "items": [{"a": 1, "tags": {"x y": 2}}]}
    assert '# maybe = "m"' in ex.splitlines() and "# [off]" in ex.splitlines()
    assert _Schema.model_validate(tomllib.loads(ex)).leaf.tags == {"x y": 2}
    defaults = tomllib.loads(render_defaults(model=_Schema))
    assert defaults == {"leaf": {"a": 1, "tags": {"x y": 2}}}


def test_renderer_refuses_a_required_option_without_example():
    class NoExample(BaseModel):
        x: int = Field(description="Required, no example.")

    with pytest.raises(ValueError, match="x: has no default and no examples"):
        render_defaults(example=True, model=NoExample)


def test_render_config_round_trips_the_example():
    cfg = parse_config(render_example())
    assert parse_config(render_config(cfg)) == cfg
