"""`linkpass config check|show`, the generated example config and the schema's documentation.

Each bad file gives one line per problem, ``FILE: <key path>: <what>``, exit 2, never a
traceback; the example in deploy/ is byte for byte what the schema generates and passes check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
from unit_helpers import run_cli
from pydantic import BaseModel, ConfigDict, Field

from linkpass import config as config_mod
from linkpass.config import Config, parse_config
from linkpass.cli import config as config_cli
from linkpass.cli.config import EXAMPLE_PATH, render_config, render_defaults, render_example

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


@pytest.fixture(autouse=True)
def netdevs_here(tmp_path_factory, monkeypatch):
    """A /sys/class/net where the netdevs these configs name exist (their absence is a warning
    of its own, tested below)."""
    root = tmp_path_factory.mktemp("sys-class-net")
    for name in ("rail0", "rail1", "r0"):
        (root / name).mkdir()
    monkeypatch.setattr(config_cli, "SYS_CLASS_NET", root)
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


def write(tmp_path: Path, content: str | bytes, name: str = "linkpass.toml") -> Path:
    p = tmp_path / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def edit(old: str, new: str, text: str = GOOD) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# ----------------------------------------------------------------------------- check


def key_file(tmp_path: Path, mode: int = 0o600, name: str = "notice.key") -> Path:
    k = tmp_path / name
    k.write_text("0123456789abcdef0123456789abcdef\n")
    k.chmod(mode)
    return k


def good(tmp_path: Path) -> str:
    """GOOD with a notice key file that exists (mode 0600)."""
    return edit("/etc/linkpass/notice.key", str(key_file(tmp_path)))


def test_check_ok(tmp_path, capsys):
    p = write(tmp_path, good(tmp_path))
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
    "empty-file": ("", ["daemon: Field required",  # and the cross-field check that needs no daemon
                        'rails: at least one [[rails]] entry is required (or set [topology] rails = "auto")']),
    "several": (edit("interval_ms = 20", "interval_ms = 0\nport = 0", edit('host = "h0"', "host = 5")),
                ["daemon.host: Input should be a valid string (got 5)",
                 "probe.port: Input should be greater than or equal to 1 (got 0)",
                 "probe.interval_ms: Input should be greater than or equal to 1 (got 0)"]),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_check_reports_every_problem_on_its_own_line(tmp_path, capsys, case):
    text, want = BAD_LINES[case]
    p = write(tmp_path, text.replace("/etc/linkpass/notice.key", str(key_file(tmp_path))))  # no file problem
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
    "deep-array": ("x = " + "[" * 500 + "]" * 500 + "\n", "nested too deeply"),
    "deep-inline-table": ("x = " + "{a=" * 500 + "1" + "}" * 500 + "\n", "nested too deeply"),
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
    p = write(tmp_path, edit("interval_ms = 20", "interval_ms = 0", good(tmp_path)))
    r = subprocess.run([sys.executable, "-m", "linkpass.cli", "config", "check", str(p)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()  # then warnings of this host (the rails' netdevs are not here)
    assert lines[0] == f"{p}: probe.interval_ms: Input should be greater than or equal to 1 (got 0)", r.stderr
    assert all(f"{p}: warning: rails[" in x for x in lines[1:]), r.stderr


def test_config_without_subcommand_is_one_line(capsys):
    rc, out, err = run(capsys, "config")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "check|show" in err


def test_one_line_problem_of_load_config_is_the_first_of_the_list():
    text, want = BAD_LINES["several"]
    with pytest.raises(config_mod.ConfigError) as ei:
        parse_config(text, "f.toml")
    assert len(ei.value.problems) == 3
    assert str(ei.value) == f"{ei.value.problems[0]} (and 2 more problem(s))"


# ----------------------------------------------------------------------------- check: the files the config names

AUTO = """\
[daemon]
host = "h0"
host_ip = "198.19.0.1"
notice_key_file = "KEY"

[topology]
rails = "auto"
peers_file = "PEERS"
"""


def auto(tmp_path: Path, peers: Path, sysfs: Path | None = None) -> str:
    """AUTO with a good notice key, the peers file ``peers`` and, when given, ``sysfs_root``."""
    text = AUTO.replace("PEERS", str(peers)).replace("KEY", str(key_file(tmp_path, name="auto.key")))
    return text + (f'sysfs_root = "{sysfs}"\n' if sysfs else "")


def gpu_node(tmp_path: Path) -> Path:
    """A hand-built sysfs tree of an 8-GPU, 8-rail InfiniBand node (tests/unit/topology)."""
    sys.path.insert(0, str(ROOT / "tests" / "unit" / "topology"))
    import sysfs_trees as st

    root = tmp_path / "gpu-node-sys"
    st.build(root, st.hgx_h100_ib()[0])
    return root


def check(capsys, p: Path, *flags: str) -> tuple[int, str, list[str]]:
    rc, out, err = run(capsys, "config", "check", *flags, str(p))
    return rc, out, err.splitlines()


def test_missing_notice_key_is_a_problem_as_for_the_daemon(tmp_path, capsys):
    p = write(tmp_path, GOOD)
    rc, out, err = check(capsys, p)
    assert (rc, out) == (2, "")
    assert err == [f"{p}: daemon.notice_key_file: /etc/linkpass/notice.key: notice key file does not exist"]


# field errors, cross-field errors and file problems in one run (no fix-and-rerun loop)
ONE_RUN = edit("interval_ms = 20", "interval_ms = 0",  # a field error in [probe]
               edit('id = 1\nnetdev = "rail1"', 'id = 0\nnetdev = "rail1"',  # a duplicate rail id (cross-field)
                    edit('"1" = "198.18.1.2"', '"7" = "198.18.1.2"')))  # a peer naming an unknown rail


def test_check_reports_field_cross_field_and_file_problems_together(tmp_path, capsys):
    p = write(tmp_path, ONE_RUN)  # and its notice key file does not exist
    rc, out, err = check(capsys, p)
    assert (rc, out) == (2, "")
    assert err == [f"{p}: probe.interval_ms: Input should be greater than or equal to 1 (got 0)",
                   f"{p}: rails: duplicate rail id in [0, 0]",
                   f"{p}: peers[0].rail_ips: rail id(s) [7] are not in [[rails]]",
                   f"{p}: daemon.notice_key_file: /etc/linkpass/notice.key: notice key file does not exist"]
    rc, _, err = check(capsys, p, "--no-files")
    assert rc == 2 and len(err) == 3 and "notice_key_file" not in "".join(err)


def test_every_cross_field_error_at_once_when_the_fields_are_valid(tmp_path, capsys):
    text = edit('name = "h1"', 'name = "h0"', edit('id = 1\nnetdev = "rail1"', 'id = 0\nnetdev = "rail1"', good(tmp_path)))
    p = write(tmp_path, text)
    rc, _, err = check(capsys, p)
    assert rc == 2 and err == [f"{p}: rails: duplicate rail id in [0, 0]",
                               f"{p}: peers: this host (h0) is listed as its own peer",
                               f"{p}: peers[0].rail_ips: rail id(s) [1] are not in [[rails]]"]
    with pytest.raises(config_mod.ConfigError) as ei:  # the daemon's one line is still the first problem
        parse_config(text, "f.toml")
    assert str(ei.value) == "f.toml: rails: duplicate rail id in [0, 0] (and 2 more problem(s))"


def test_cross_field_checks_that_need_an_invalid_part_are_skipped(tmp_path, capsys):
    # rails[1] is invalid: whether the peer's rail 1 exists is unknown, so it is not reported
    text = edit('id = 1\nnetdev = "rail1"', 'id = 1\nnetdev = 5', good(tmp_path))
    p = write(tmp_path, text)
    rc, _, err = check(capsys, p)
    assert rc == 2 and err == [f"{p}: rails[1].netdev: Input should be a valid string (got 5)"]
    # [daemon] invalid: its notice key file is not read, and peers are not compared with it
    text = edit('host = "h0"', "host = 5", edit("/etc/linkpass/notice.key", "/nonexistent/k"))
    rc, _, err = check(capsys, write(tmp_path, text))
    assert rc == 2 and err == [f"{tmp_path / 'linkpass.toml'}: daemon.host: Input should be a valid string (got 5)"]


def test_not_toml_is_still_one_line_without_file_checks(tmp_path, capsys):
    p = write(tmp_path, "[daemon\n")
    rc, _, err = check(capsys, p)
    assert rc == 2 and len(err) == 1 and "not valid TOML" in err[0]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_notice_key_readable_by_others_is_a_problem(tmp_path, capsys, mode):
    k = key_file(tmp_path, mode)
    p = write(tmp_path, edit("/etc/linkpass/notice.key", str(k)))
    rc, out, err = check(capsys, p)
    assert (rc, out) == (2, "")
    assert err == [f"{p}: daemon.notice_key_file: {k}: notice key file has mode {mode:04o}; it must be 0600 "
                   "(no group/other access)"]


def test_no_files_skips_the_file_checks(tmp_path, capsys):
    p = write(tmp_path, GOOD)  # its key file does not exist here
    rc, out, err = check(capsys, p, "--no-files")
    assert (rc, err) == (0, [])
    assert out == f"{p}: OK (host h0, mode host-ip, 2 rails, 1 peer; files not checked)\n"


def test_check_help_documents_no_files(capsys):
    rc, out, _ = run(capsys, "config", "check", "--help")
    assert rc == 0 and "--no-files" in out and "notice_key_file" in out


def test_auto_peers_file_missing_or_a_fifo_is_a_problem(tmp_path, capsys):
    peers = tmp_path / "peers.txt"
    p = write(tmp_path, auto(tmp_path, peers))
    rc, _, err = check(capsys, p)
    assert rc == 2 and err == [f"{p}: topology.peers_file: {peers}: no such file"]
    os.mkfifo(peers)
    rc, _, err = check(capsys, p)  # a FIFO without a writer: opened, it would block forever
    assert rc == 2 and err == [f"{p}: topology.peers_file: {peers}: not a regular file (a FIFO)"]


def test_auto_peers_file_bad_lines_are_warnings(tmp_path, capsys):
    peers = tmp_path / "peers.txt"
    peers.write_text("h1 198.19.0.2\nh2 198.19.0.300\n# comment\nh3\n")
    p = write(tmp_path, auto(tmp_path, peers, gpu_node(tmp_path)))
    rc, out, err = check(capsys, p)
    assert rc == 0 and out == f"{p}: OK (host h0, mode host-ip, rails from discovery, 0 peers + {peers}; {len(err)} warnings)\n"
    assert err[:2] == [f'{p}: warning: topology.peers_file: {peers}: line 2: "198.19.0.300" is not an IPv4 address',
                       f'{p}: warning: topology.peers_file: {peers}: line 4: expected `name host_ip`, got "h3"']
    assert all(": warning: topology: " in ln for ln in err[2:]) and len(err) == len(set(err))  # discovery's, once each


def test_auto_with_no_compute_nic_is_a_problem_as_for_the_daemon(tmp_path, capsys):
    """`linkpass run` refuses rails = "auto" when discovery finds no compute NIC; check says so too."""
    peers = tmp_path / "peers.txt"
    peers.write_text("h1 198.19.0.2\n")
    (tmp_path / "empty-sys").mkdir()
    p = write(tmp_path, auto(tmp_path, peers, tmp_path / "empty-sys"))
    rc, out, err = check(capsys, p)
    assert (rc, out) == (2, "")
    assert err == [f'{p}: [topology] rails = "auto": discovery found no compute NIC with a netdev; '
                   "check `linkpass topology`, or list [[rails]] in the config"]
    rc, out, err = check(capsys, write(tmp_path, auto(tmp_path, peers, gpu_node(tmp_path)), "node.toml"))
    assert rc == 0 and "rails from discovery" in out, err


def test_auto_discovery_is_skipped_with_no_files(tmp_path, capsys):
    (tmp_path / "empty-sys").mkdir()
    p = write(tmp_path, auto(tmp_path, tmp_path / "none.txt", tmp_path / "empty-sys"))
    rc, out, err = check(capsys, p, "--no-files")
    assert (rc, err) == (0, []) and out.endswith("; files not checked)\n")


@pytest.mark.parametrize("probe", [True, False])
def test_no_notice_key_file_is_a_warning_saying_what_is_off(tmp_path, capsys, probe):
    text = good(tmp_path).replace(f'notice_key_file = "{tmp_path / "notice.key"}"\n', "", 1)
    text += "" if probe else "enabled = false\n"  # under [probe], the last section of GOOD
    p = write(tmp_path, text)
    rc, out, err = check(capsys, p)
    off = "peer notices and probes are off" if probe else "peer notices are off"
    assert rc == 0 and out == f"{p}: OK (host h0, mode host-ip, 2 rails, 1 peer; 1 warning)\n"
    assert err == [f"{p}: warning: daemon.notice_key_file: not set, so {off} (the key authenticates both; "
                   "see `linkpass config show --defaults`)"]


def test_peers_file_without_auto_is_not_read_and_says_so(tmp_path, capsys):
    p = write(tmp_path, good(tmp_path) + f'\n[topology]\npeers_file = "{tmp_path / "none.txt"}"\n')
    rc, out, err = check(capsys, p)
    assert rc == 0 and out.endswith("; 1 warning)\n")
    assert err == [f'{p}: warning: topology.peers_file: not read: peers come from [[peers]] unless [topology] rails = "auto"']


def _mqtt(tmp_path: Path, **files: Path) -> str:
    opts = "".join(f'{k} = "{v}"\n' for k, v in files.items())
    return good(tmp_path) + f"\n[mqtt]\nenabled = true\nusername = \"lp\"\n{opts}"


def test_mqtt_files_are_warnings_not_problems(tmp_path, capsys):
    pw = tmp_path / "mqtt.pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o644)
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    p = write(tmp_path, _mqtt(tmp_path, password_file=pw, ca_file=ca))
    rc, out, err = check(capsys, p)
    assert rc == 0 and out == f"{p}: OK (host h0, mode host-ip, 2 rails, 1 peer; 2 warnings)\n"
    assert len(err) == 2, err
    # the wording after the path is the MQTT adapter's (check_private_file, build_tls_context)
    assert err[0].startswith(f"{p}: warning: mqtt.password_file: {pw}: ") and "0644" in err[0], err[0]
    assert err[1].startswith(f"{p}: warning: mqtt.ca_file: {ca}: not usable CA certificates (PEM)"), err[1]
    assert "s3cret" not in "".join(err)
    pw.chmod(0o600)
    ca.unlink()
    rc, out, err = check(capsys, p)
    assert rc == 0 and err == [f"{p}: warning: mqtt.ca_file: {ca}: no such file"] and out.endswith("; 1 warning)\n")


def test_mqtt_key_file_and_missing_password_file(tmp_path, capsys):
    cert = tmp_path / "client.pem"
    cert.write_text("x\n")
    key = tmp_path / "client.key"
    key.write_text("x\n")
    key.chmod(0o604)
    p = write(tmp_path, _mqtt(tmp_path, password_file=tmp_path / "nope", cert_file=cert, key_file=key))
    rc, out, err = check(capsys, p)
    assert rc == 0 and out.endswith("; 2 warnings)\n") and len(err) == 2, err
    assert err[0] == f"{p}: warning: mqtt.password_file: {tmp_path / 'nope'}: no such file"
    assert err[1].startswith(f"{p}: warning: mqtt.key_file: {key}: ") and "0604" in err[1], err[1]


def test_mqtt_files_are_not_read_when_mqtt_is_off(tmp_path, capsys):
    text = _mqtt(tmp_path, password_file=tmp_path / "nope").replace("enabled = true", "enabled = false")
    p = write(tmp_path, text)
    rc, out, err = check(capsys, p)
    assert (rc, err) == (0, []) and out.endswith("1 peer)\n")


# ----------------------------------------------------------------------------- check: the config file itself


def test_config_that_is_a_fifo_or_a_device_is_refused(tmp_path, capsys):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    rc, out, err = check(capsys, fifo)
    assert (rc, out, err) == (2, "", [f"{fifo}: not a regular file (a FIFO)"])
    rc, out, err = check(capsys, Path("/dev/zero"))
    assert (rc, out, err) == (2, "", ["/dev/zero: not a regular file (a character device)"])


def test_config_over_1_mib_is_refused(tmp_path, capsys):
    big = write(tmp_path, "# " + "x" * (1 << 20) + "\n" + GOOD)
    rc, out, err = check(capsys, big)
    n = big.stat().st_size
    assert (rc, out, err) == (2, "", [f"{big}: too large ({n} bytes; a config file is at most 1 MiB)"])


def test_config_with_a_utf8_bom_is_read(tmp_path, capsys):
    p = write(tmp_path, b"\xef\xbb\xbf" + good(tmp_path).encode())
    rc, out, err = check(capsys, p)
    assert (rc, err) == (0, []) and out == f"{p}: OK (host h0, mode host-ip, 2 rails, 1 peer)\n"


@pytest.mark.parametrize("value,want", [
    ('"x"', 'daemon: must be a table ([daemon]), got a string "x"'),
    ("5", "daemon: must be a table ([daemon]), got an integer 5"),
    ("[1, 2]", "daemon: must be a table ([daemon]), got an array [1, 2]"),
])
def test_section_of_the_wrong_type_in_toml_words(tmp_path, capsys, value, want):
    p = write(tmp_path, f"daemon = {value}\n[[rails]]\nid = 0\nnetdev = \"r0\"\n")
    rc, _, err = check(capsys, p)
    assert rc == 2 and err == [f"{p}: {want}"]


# ----------------------------------------------------------------------------- the daemon refuses the same


def _daemon_line(cfg: Path, tmp_path: Path) -> str:
    """What `linkpass run --config cfg` prints (one line, exit 2) when the config is refused.

    Run in a network namespace of its own (when root) so that a daemon that did start by
    mistake could touch no route of this host; it is killed after 30 s."""
    argv = [sys.executable, "-m", "linkpass.cli", "run", "--config", str(cfg)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        argv = ["unshare", "--net", "--"] + argv
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("linkpass: ")]  # after any log lines
    return line[len("linkpass: "):]


def test_check_says_what_the_daemon_says(tmp_path, capsys):
    """`config check` and `linkpass run` refuse the same files with the same line (one daemon
    run per case: the daemon stops at the first problem)."""
    sock = f'control_socket = "{tmp_path}/lp.sock"\nreroute = "notify-only"\n'
    base = good(tmp_path).replace('host_ip = "198.19.0.1"\n', 'host_ip = "198.19.0.1"\n' + sock, 1)
    base += "\n[nccl]\nwrite_env_file = false\n"
    fifo = tmp_path / "peers.fifo"
    os.mkfifo(fifo)
    (tmp_path / "sys").mkdir()
    peers = tmp_path / "peers.txt"
    peers.write_text("h1 198.19.0.2\n")
    cases = {
        "key-missing": base.replace(str(tmp_path / "notice.key"), str(tmp_path / "none.key")),
        "key-0644": base.replace(str(tmp_path / "notice.key"), str(key_file(tmp_path, 0o644, "open.key"))),
        "peers-missing": auto(tmp_path, tmp_path / "none.txt", tmp_path / "sys"),
        "peers-fifo": auto(tmp_path, fifo, tmp_path / "sys"),
        "auto-no-compute-nic": auto(tmp_path, peers, tmp_path / "sys"),
    }
    for name, text in cases.items():
        p = write(tmp_path, text, f"{name}.toml")
        rc, _, err = check(capsys, p)
        assert rc == 2 and err == [_daemon_line(p, tmp_path)], name
    rc, _, err = check(capsys, fifo)  # the config itself
    assert rc == 2 and err == [_daemon_line(fifo, tmp_path)] == [f"{fifo}: not a regular file (a FIFO)"]


def test_run_refuses_what_the_reader_cannot_take_in_one_line(tmp_path, capsys):
    """Deep nesting (a RecursionError inside tomllib), bytes that are not UTF-8, an oversized
    file and a directory: `linkpass run` exits 2 with the line `config check` prints, no traceback."""
    cases = {name: write(tmp_path, BAD_FILES[name][0], f"{name}.toml")
             for name in ("deep-array", "deep-inline-table", "non-utf8")}
    cases["too-large"] = write(tmp_path, b"#" * (config_mod.MAX_CONFIG_BYTES + 1), "big.toml")
    cases["directory"] = tmp_path
    for name, p in cases.items():
        rc, _, err = check(capsys, p)
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"{p}: "), (name, err)
        assert _daemon_line(p, tmp_path) == err[0], name


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
    rc, out, err = run(capsys, "config", "check", "--no-files", str(ROOT / EXAMPLE_PATH))  # its key is a node's
    assert rc == 0 and err == "" and out.endswith("OK (host gpu-node-07, mode host-ip, 1 rail, 1 peer; files not checked)\n")
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


def test_a_rail_netdev_not_on_this_host_is_a_warning(tmp_path, capsys, netdevs_here):
    (netdevs_here / "rail1").rmdir()  # a typo in the config looks like this
    cfg = write(tmp_path, good(tmp_path))
    rc, out, err = run(capsys, "config", "check", str(cfg))
    assert rc == 0 and "OK" in out, (out, err)
    lines = [x for x in err.splitlines() if "rails[" in x]
    assert lines == [f"{cfg}: warning: rails[1].netdev: 'rail1' is not a netdev on this host (no {netdevs_here / 'rail1'}), "
                     "so the daemon keeps rail 1 DOWN until it appears"], err
    rc, out, err = run(capsys, "config", "check", "--no-files", str(cfg))  # checked for another machine
    assert rc == 0 and "rails[" not in err


def test_datapath_c_without_the_c_module_is_a_problem_as_the_daemon_refuses_it(tmp_path, capsys, monkeypatch):
    from linkpass.adapters import prober as prober_mod

    monkeypatch.setattr(prober_mod, "native_io", None)
    cfg = write(tmp_path, edit("interval_ms = 20", 'interval_ms = 20\ndatapath = "c"', good(tmp_path)))
    rc, out, err = run(capsys, "config", "check", str(cfg))
    assert rc == 2 and out == ""
    assert err.splitlines() == [f'{cfg}: probe.datapath: "c", but linkpass.adapters._probe_io was not built (`make install` '
                                "builds it; it needs gcc, the Python headers and libssl-dev); \"auto\" falls back to the "
                                "Python datapath"], err
    cfg.write_text(cfg.read_text().replace('datapath = "c"', 'datapath = "auto"'))
    rc, out, err = run(capsys, "config", "check", str(cfg))
    assert rc == 0, err
