"""Config parsing and validation: every bad input is ONE line naming the file and the field."""

from __future__ import annotations

import ipaddress
import os
import re

import pytest

from linkpass.config import DEFAULT_ROUTE_PROTOCOL, Config, ConfigError, load_config, parse_config, read_key_file
from unit_helpers import make_toml

# the docstring example of linkpass/config.py, with the second rail it refers to
EXAMPLE = """
[daemon]
host = "h0"
mode = "host-ip"
host_ip = "198.19.0.1"
control_socket = "/run/linkpass/lp/h0.sock"
notice_key_file = "/run/linkpass/lp/notice.key"

[[rails]]
id = 0
netdev = "rail0"
address = "198.18.0.1"

[[rails]]
id = 1
netdev = "rail1"
address = "198.18.1.1"

[[peers]]
name = "h1"
host_ip = "198.19.0.2"
rail_ips = { "0" = "198.18.0.2", "1" = "198.18.1.2" }
"""


def test_example_parses_with_defaults():
    cfg = parse_config(EXAMPLE, "x.toml")
    assert isinstance(cfg, Config)
    d = cfg.daemon
    assert (d.host, d.mode, d.host_ip) == ("h0", "host-ip", ipaddress.IPv4Address("198.19.0.1"))
    assert d.route_protocol == DEFAULT_ROUTE_PROTOCOL == 201
    assert (d.route_table, d.route_metric, d.hold_down_ms, d.notice_port) == (254, 0, 2000, 7471)
    assert d.notice_key_file == "/run/linkpass/lp/notice.key"
    assert [(r.id, r.netdev) for r in cfg.rails] == [(0, "rail0"), (1, "rail1")]
    (p,) = cfg.peers
    assert p.rail_ips == {0: ipaddress.IPv4Address("198.18.0.2"), 1: ipaddress.IPv4Address("198.18.1.2")}


def test_docstring_example_text_itself_names_an_unknown_rail():
    """The docstring example has one rail but the peer names rail 1: it must be rejected clearly."""
    text = EXAMPLE.replace('[[rails]]\nid = 1\nnetdev = "rail1"\naddress = "198.18.1.1"\n', "")
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert_one_line(ei.value, "x.toml", "peers[0].rail_ips")


@pytest.mark.parametrize("mode", ["host-ip", "per-rail-ip"])
@pytest.mark.parametrize("rails", [(0, 1), (0, 1, 2), (3, 5, 7, 9)])
def test_generated_configs_parse(mode, rails):
    cfg = parse_config(make_toml(mode=mode, rails=rails, n_peers=3), "x.toml")
    assert cfg.daemon.mode == mode and [r.id for r in cfg.rails] == list(rails) and len(cfg.peers) == 3


def test_per_rail_ip_needs_no_host_ip():
    cfg = parse_config(make_toml(mode="per-rail-ip"), "x.toml")
    assert cfg.daemon.host_ip is None and cfg.peers[0].host_ip is None


def test_config_is_frozen():
    cfg = parse_config(EXAMPLE)
    with pytest.raises(Exception):
        cfg.daemon.host = "other"  # type: ignore[misc]


# ----------------------------------------------------------------------------- bad input


def assert_one_line(err: ConfigError, source: str, field: str | None) -> str:
    s = str(err)
    assert "\n" not in s and "\r" not in s, s
    assert s.startswith(f"{source}: "), s
    if field is not None:
        assert re.search(rf"(^|[\s:(]){re.escape(field)}(:|\s)", s), f"{field!r} not named in {s!r}"
    return s


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


BAD = {
    "missing-daemon": (EXAMPLE[EXAMPLE.index("[[rails]]"):], "daemon"),
    "unknown-daemon-key": (edit(EXAMPLE, 'host = "h0"', 'host = "h0"\nbogus = 1'), "daemon.bogus"),
    "unknown-top-key": ("colour = 1\n" + EXAMPLE, "colour"),
    "unknown-rail-key": (edit(EXAMPLE, 'netdev = "rail1"', 'netdev = "rail1"\nspeed = 1'), "rails[1].speed"),
    "missing-netdev": (edit(EXAMPLE, 'netdev = "rail1"\n', ""), "rails[1].netdev"),
    "netdev-too-long": (edit(EXAMPLE, 'netdev = "rail1"', 'netdev = "a-very-long-netdev-name"'), "rails[1].netdev"),
    "wrong-type-int": (edit(EXAMPLE, 'host = "h0"', 'host = "h0"\nhold_down_ms = "soon"'), "daemon.hold_down_ms"),
    "wrong-type-str": (edit(EXAMPLE, 'host = "h0"', "host = 5"), "daemon.host"),
    "fractional-metric": (edit(EXAMPLE, 'host = "h0"', 'host = "h0"\nroute_metric = 1.5'), "daemon.route_metric"),
    "bad-mode": (edit(EXAMPLE, 'mode = "host-ip"', 'mode = "bonding"'), "daemon.mode"),
    "bad-ip": (edit(EXAMPLE, 'host_ip = "198.19.0.1"', 'host_ip = "198.19.0.300"'), "daemon.host_ip"),
    "bad-peer-ip": (edit(EXAMPLE, '"1" = "198.18.1.2"', '"1" = "nope"'), "peers[0].rail_ips.1"),
    "protocol-reserved": (edit(EXAMPLE, 'host = "h0"', 'host = "h0"\nroute_protocol = 2'), "daemon.route_protocol"),
    "rail-id-negative": (edit(EXAMPLE, "id = 1", "id = -1"), "rails[1].id"),
    "no-rails": (EXAMPLE[: EXAMPLE.index("[[rails]]")] + EXAMPLE[EXAMPLE.index("[[peers]]"):].replace('"0" = "198.18.0.2", "1" = "198.18.1.2"', '"0" = "198.18.0.2"'), "rails"),
    "empty-rail-ips": (edit(EXAMPLE, 'rail_ips = { "0" = "198.18.0.2", "1" = "198.18.1.2" }', "rail_ips = {}"), "peers[0].rail_ips"),
    "host-ip-mode-without-host-ip": (edit(EXAMPLE, 'host_ip = "198.19.0.1"\n', ""), "daemon.host_ip"),
    "host-ip-mode-peer-without-host-ip": (edit(EXAMPLE, 'host_ip = "198.19.0.2"\n', ""), "peers[0].host_ip"),
    "per-rail-ip-without-rail-address": (edit(make_toml(mode="per-rail-ip", rails=(0, 1)), 'address = "198.18.1.1"\n', ""), "rails[1].address"),
    "duplicate-rail-id": (edit(EXAMPLE, "id = 1", "id = 0"), "rails"),
    "duplicate-netdev": (edit(EXAMPLE, 'netdev = "rail1"', 'netdev = "rail0"'), "rails"),
    "peer-rail-not-in-rails": (edit(EXAMPLE, '"1" = "198.18.1.2"', '"4" = "198.18.4.2"'), "peers[0].rail_ips"),
    "duplicate-peer": (EXAMPLE + '\n[[peers]]\nname = "h1"\nhost_ip = "198.19.0.3"\nrail_ips = { "0" = "198.18.0.3" }\n', "peers"),
    "self-as-peer": (edit(EXAMPLE, 'name = "h1"', 'name = "h0"'), "peers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_one_line_naming_file_and_field(case):
    text, field = BAD[case]
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert_one_line(ei.value, "x.toml", field)


def test_host_ip_mode_without_host_ip_message():
    text, _ = BAD["host-ip-mode-without-host-ip"]
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert "daemon.host_ip: required when mode" in str(ei.value)


def test_several_problems_are_still_one_line():
    text = edit(EXAMPLE, 'host = "h0"', 'host = 5\nbogus = 1\nhold_down_ms = "x"')
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    s = assert_one_line(ei.value, "x.toml", None)
    assert "more problem" in s


@pytest.mark.parametrize("text", ["[daemon\nhost = 1", 'host = "a"\nhost = "b"', "= 3", "[[rails]]\nid = 0x"])
def test_bad_toml(text):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    s = assert_one_line(ei.value, "x.toml", None)
    assert "not valid TOML" in s and ("line" in s or "end of document" in s)


@pytest.mark.parametrize(
    "case,field",
    [
        ("duplicate-rail-id", "rails"),
        ("peer-rail-not-in-rails", "peers[0].rail_ips"),
        ("per-rail-ip-without-rail-address", "rails[1].address"),
        ("host-ip-mode-without-host-ip", "daemon.host_ip"),
    ],
)
def test_cross_field_errors_put_the_field_in_the_field_position(case, field):
    text, _ = BAD[case]
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert str(ei.value).startswith(f"x.toml: {field}: "), str(ei.value)


@pytest.mark.parametrize("value", ["true", '"2000"', "2.0"], ids=["bool", "string", "float"])
def test_wrong_scalar_type_is_rejected_not_coerced(value):
    text = edit(EXAMPLE, 'host = "h0"', f'host = "h0"\nhold_down_ms = {value}')
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert_one_line(ei.value, "x.toml", "daemon.hold_down_ms")


# ----------------------------------------------------------------------------- files


def test_load_config_reads_the_file(tmp_path):
    p = tmp_path / "lp.toml"
    p.write_text(EXAMPLE, encoding="utf-8")
    assert load_config(p) == parse_config(EXAMPLE)
    assert load_config(str(p)).daemon.host == "h0"


def test_load_config_errors_name_the_path(tmp_path):
    p = tmp_path / "lp.toml"
    p.write_text(edit(EXAMPLE, 'netdev = "rail1"\n', ""), encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert_one_line(ei.value, str(p), "rails[1].netdev")


def test_missing_file(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "no such file" in assert_one_line(ei.value, str(p), None)


def test_directory(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    assert "directory" in assert_one_line(ei.value, str(tmp_path), None)


def test_unreadable_path_component_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    p = f / "lp.toml"
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "cannot read" in assert_one_line(ei.value, str(p), None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of mode 000")
def test_permission_denied(tmp_path):
    p = tmp_path / "lp.toml"
    p.write_text(EXAMPLE)
    p.chmod(0)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "permission denied" in assert_one_line(ei.value, str(p), None)


def test_not_utf8(tmp_path):
    p = tmp_path / "lp.toml"
    p.write_bytes(b'[daemon]\nhost = "h\xff0"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    s = assert_one_line(ei.value, str(p), None)
    assert "not UTF-8" in s and "byte 18" in s


# ----------------------------------------------------------------------------- key file


def key_file(tmp_path, content: bytes, mode: int = 0o600):
    p = tmp_path / "notice.key"
    p.write_bytes(content)
    p.chmod(mode)
    return p


def test_key_file_ok_and_stripped(tmp_path):
    p = key_file(tmp_path, b"  0123456789abcdef0123\n")
    assert read_key_file(p) == b"0123456789abcdef0123"
    p.chmod(0o400)
    assert read_key_file(str(p)) == b"0123456789abcdef0123"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o640, 0o610, 0o601, 0o666])
def test_key_file_group_or_world_access_is_rejected(tmp_path, mode):
    p = key_file(tmp_path, b"0123456789abcdef", mode)
    with pytest.raises(ConfigError) as ei:
        read_key_file(p)
    s = assert_one_line(ei.value, str(p), None)
    assert "0600" in s and f"{mode:04o}" in s


def test_key_file_too_short(tmp_path):
    p = key_file(tmp_path, b" 0123456789abcde \n")  # 15 bytes after stripping
    with pytest.raises(ConfigError) as ei:
        read_key_file(p)
    s = assert_one_line(ei.value, str(p), None)
    assert "15 bytes" in s and "16" in s


def test_key_file_missing(tmp_path):
    p = tmp_path / "none.key"
    with pytest.raises(ConfigError) as ei:
        read_key_file(p)
    assert "does not exist" in assert_one_line(ei.value, str(p), None)


def test_key_file_is_a_directory(tmp_path):
    d = tmp_path / "keydir"
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    with pytest.raises(ConfigError) as ei:
        read_key_file(d)
    assert_one_line(ei.value, str(d), None)


def test_example_config_in_deploy_is_valid():
    from pathlib import Path

    from linkpass.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "deploy" / "linkpass.toml.example")
    assert cfg.daemon.host == "gpu-node-07" and [r.id for r in cfg.rails] == [0]
    assert cfg.peers[0].rail_ips[0].compressed == "198.18.0.8"


def test_ip_written_as_a_number_is_refused():
    import pytest

    from linkpass.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as ei:
        parse_config("[daemon]\nhost = 'h0'\nhost_ip = 5\n[[rails]]\nid = 0\nnetdev = 'rail0'\n", "x.toml")
    assert "daemon.host_ip" in str(ei.value) and "in quotes" in str(ei.value)
