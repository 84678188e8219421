"""Config parsing and validation: every bad input is ONE line naming the file and the field."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import threading
import typing
from pathlib import Path

import pytest

from linkpass import config as config_mod
from linkpass.config import (
    DEFAULT_ROUTE_PROTOCOL,
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    load_config,
    parse_config,
    read_key_file,
)
from unit_helpers import make_toml

# the docstring example of linkpass/config/__init__.py, with the second rail it refers to
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
    "gpu-map-not-a-bus-id": (EXAMPLE + '\n[device.gpus]\n"18:00" = 0\n', "device.gpus"),
    "gpu-map-index-out-of-range": (EXAMPLE + '\n[device.gpus]\n"0000:18:00.0" = 5000\n', "device.gpus"),
    "gpu-map-index-not-int": (EXAMPLE + '\n[device.gpus]\n"0000:18:00.0" = "0"\n', "device.gpus.0000:18:00.0"),
    "snapshot-every-absurd": (EXAMPLE + "\n[snapshot]\nevery_steps = 1000000000000\n", "snapshot.every_steps"),
    "snapshot-keep-absurd": (EXAMPLE + "\n[snapshot]\nkeep = 100000\n", "snapshot.keep"),
    "snapshot-dir-relative": (EXAMPLE + '\n[snapshot]\ndir = "snaps"\n', "snapshot.dir"),
    "snapshot-dir-blank": (EXAMPLE + '\n[snapshot]\ndir = "  "\n', "snapshot.dir"),
}


def test_snapshot_section_bounds_and_an_absolute_dir():
    cfg = parse_config(EXAMPLE + '\n[snapshot]\nevery_steps = 10000000\nkeep = 1000\ndir = "/shared/snaps"\n', "x.toml")
    assert (cfg.snapshot.every_steps, cfg.snapshot.keep, cfg.snapshot.dir) == (10_000_000, 1000, "/shared/snaps")
    with pytest.raises(ConfigError, match=r'x.toml: snapshot.dir: must be an absolute path .*got "snaps"'):
        parse_config(EXAMPLE + '\n[snapshot]\ndir = "snaps"\n', "x.toml")


def test_gpu_map_reports_every_bad_entry_and_refuses_one_index_for_two_bus_ids():
    text = EXAMPLE + ('\n[device.gpus]\n"18:00" = 0\n"zz" = 1\n"0000:19:00.0" = 5000\n"0000:1a:00.0" = 2\n'
                      '"0000:1b:00.0" = 2\n"0000:1A:00.0" = 3\n')
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert ei.value.problems == ['x.toml: device.gpus: key "18:00" is not a PCI bus id like "0000:18:00.0"; '
                                 'key "zz" is not a PCI bus id like "0000:18:00.0"; '
                                 "GPU index for 0000:19:00.0 must be in 0..1023, got 5000; "
                                 "GPU index 2 is given to both 0000:1a:00.0 and 0000:1b:00.0; "
                                 "0000:1a:00.0 and 0000:1A:00.0 are the same bus id"]


def test_gpu_map_override_is_read_and_lowercased():
    cfg = parse_config(EXAMPLE + '\n[device.gpus]\n"0000:1A:00.0" = 2\n"00000000:1b:00.0" = 3\n', "x.toml")
    assert cfg.device.gpus == {"0000:1a:00.0": 2, "00000000:1b:00.0": 3}


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


DEEP = {
    "array-500": "x = " + "[" * 500 + "]" * 500 + "\n",
    "inline-table-500": "x = " + "{a=" * 500 + "1" + "}" * 500 + "\n",
    "array-50000": "x = " + "[" * 50_000 + "]" * 50_000 + "\n",
    "deep-under-a-real-key": EXAMPLE.replace('host = "h0"', 'host = ' + "[" * 5000 + "]" * 5000, 1),
}


@pytest.mark.parametrize("case", list(DEEP))
def test_deeply_nested_toml_is_one_line_not_a_recursion_error(case):
    with pytest.raises(ConfigError) as ei:
        parse_config(DEEP[case], "x.toml")
    s = assert_one_line(ei.value, "x.toml", None)
    assert "nested too deeply" in s and ei.value.__cause__ is None and ei.value.__suppress_context__


def test_nesting_tomllib_can_take_is_an_ordinary_validation_error():
    with pytest.raises(ConfigError) as ei:
        parse_config(EXAMPLE + "x = " + "[" * 20 + "]" * 20 + "\n", "x.toml")
    assert "x: " in assert_one_line(ei.value, "x.toml", None)


def test_out_of_memory_while_parsing_is_one_line(monkeypatch):
    def boom(text):
        raise MemoryError

    monkeypatch.setattr(config_mod.loading.tomllib, "loads", boom)
    with pytest.raises(ConfigError) as ei:
        parse_config(EXAMPLE, "x.toml")
    assert "out of memory" in assert_one_line(ei.value, "x.toml", None)


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


def test_key_file_over_the_limit_is_refused_before_reading(tmp_path):
    p = key_file(tmp_path, b"k" * (config_mod.MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(ConfigError) as ei:
        read_key_file(p)
    s = assert_one_line(ei.value, str(p), None)
    assert f"{config_mod.MAX_KEY_FILE_BYTES + 1} bytes" in s and f"at most {config_mod.MAX_KEY_FILE_BYTES}" in s
    assert len(read_key_file(key_file(tmp_path, b"k" * config_mod.MAX_KEY_FILE_BYTES))) == config_mod.MAX_KEY_FILE_BYTES


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


# ----------------------------------------------------------------------------- daemon.host, mqtt.prefix


def _with_host(host: str) -> str:
    return EXAMPLE.replace('host = "h0"', f"host = {json.dumps(host)}", 1)


@pytest.mark.parametrize("host", ["h0", "h9", "a", "n1", "gpu-node-07", "node_1.rack-2.example.com", "7", "x" * 64])
def test_host_names_that_pass(host):
    assert parse_config(_with_host(host)).daemon.host == host


@pytest.mark.parametrize("host", ["h0+x", "h0/x", "h#", "h 0", "-h0", ".h0", "_h0", "h0\n", "hö", "x" * 65, "{host}"])
def test_host_names_that_could_break_topics_are_refused(host):
    with pytest.raises(ConfigError) as ei:
        parse_config(_with_host(host), "x.toml")
    s = assert_one_line(ei.value, "x.toml", "daemon.host")
    if len(host) <= 64:
        assert s == ('x.toml: daemon.host: must be a host name: letters, digits, ".", "-" and "_", starting with a letter '
                     f"or digit, at most 64 characters (it is part of MQTT topics), got {json.dumps(host, ensure_ascii=False)}")


def test_every_host_name_the_tests_and_the_fabric_use_still_passes():
    """Host names written as literals in tests/, linkpass/fabric and deploy/ (placeholders aside; the
    config tests, which write refused names on purpose, left out)."""
    root = Path(__file__).resolve().parents[2]
    files = [*root.glob("tests/**/*.py"), *root.glob("linkpass/fabric/*.py"), *root.glob("deploy/**/*.y*ml"),
             root / "deploy" / "linkpass.toml.example"]
    files = [f for f in files if not f.name.startswith("test_config")]
    pat = re.compile(r"""(?:\bhost\s*=\s*|["']host["']\s*:\s*)["']([^"'\\{}@\n]*)["']""")
    names = {m for f in files for m in pat.findall(f.read_text(encoding="utf-8", errors="replace"))}
    names |= {f"h{i}" for i in range(64)}  # the fabric's hosts (linkpass/lab/fabric/spec.py: f"h{i}")
    assert {"h0", "h1", "gpu-node-07"} <= names
    def broker_ip(n: str) -> bool:  # [mqtt] host = "::1" is a broker address, not a daemon.host
        try:
            return bool(ipaddress.ip_address(n))
        except ValueError:
            return False

    bad = sorted(n for n in names if n and not broker_ip(n) and not config_mod.HOST_NAME.fullmatch(n))
    assert bad == [], bad


@pytest.mark.parametrize("prefix,want", [("linkpass/v1/{host}/", "linkpass/v1/{host}/"), ("site/{host}", "site/{host}/"),
                                         ("{host}", "{host}/")])
def test_mqtt_prefix_with_host(prefix, want):
    assert parse_config(EXAMPLE + f'\n[mqtt]\nprefix = "{prefix}"\n').mqtt.prefix == want


@pytest.mark.parametrize("prefix", ["linkpass/v1/", "site/h0", "a"])
def test_mqtt_prefix_without_host_is_refused(prefix):
    with pytest.raises(ConfigError) as ei:
        parse_config(EXAMPLE + f'\n[mqtt]\nprefix = "{prefix}"\n', "x.toml")
    s = assert_one_line(ei.value, "x.toml", "mqtt.prefix")
    assert s == ("x.toml: mqtt.prefix: must contain {host} (replaced by daemon.host): without it every host publishes "
                 f"the same retained topics and overwrites the others', got \"{prefix}\"")


# ----------------------------------------------------------------------------- messages in TOML words, values quoted alike


@pytest.mark.parametrize("name", [n for n in Config.model_fields])
def test_every_section_of_the_wrong_type_is_named_in_toml_words(name):
    shape = config_mod._options_at((name,))
    assert shape, name  # every top-level field is a table or an array of tables
    is_array = typing.get_origin(Config.model_fields[name].annotation) is list
    want = f"an array of tables ([[{name}]])" if is_array else f"a table ([{name}])"
    text = EXAMPLE if name != "daemon" else EXAMPLE.replace(EXAMPLE[EXAMPLE.index("[daemon]"):EXAMPLE.index("[[rails]]")], "")
    for section in ("rails", "peers"):
        if name == section:
            text = re.sub(rf"\[\[{section}\]\][^\[]*", "", text)
    with pytest.raises(ConfigError) as ei:
        parse_config(f'{name} = "x"\n' + text, "x.toml")
    assert f'x.toml: {name}: must be {want}, got a string "x"' in ei.value.problems, ei.value.problems
    assert not any("Section" in p or "instance of" in p for p in ei.value.problems), ei.value.problems


@pytest.mark.parametrize("toml,line", [
    ('rails = ["x"]', 'rails[0]: must be a table (a [[rails]] entry), got a string "x"'),
    ("rails = [3]", "rails[0]: must be a table (a [[rails]] entry), got an integer 3"),
    ("probe = true", "probe: must be a table ([probe]), got a boolean true"),
    ("probe = 1979-05-27", "probe: must be a table ([probe]), got a date 1979-05-27"),
    ('peers = { a = 1 }', "peers: must be an array of tables ([[peers]]), got a table"),
    ('topology = { compute_nics = "x" }', 'topology.compute_nics: must be an array, got a string "x"'),
])
def test_wrong_shapes_in_toml_words(toml, line):
    text = toml + "\n" + (EXAMPLE if not toml.startswith(("rails", "peers")) else EXAMPLE[: EXAMPLE.index("[[rails]]")])
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    assert f"x.toml: {line}" in ei.value.problems, ei.value.problems


@pytest.mark.parametrize("setting,line", [
    ('[daemon]\nhost_ip = 5', "daemon.host_ip: must be an IPv4 address in quotes, got an integer 5"),
    ('[probe]\nrail_down_share = "0.5"', 'probe.rail_down_share: must be a number, got a string "0.5"'),
    ("[probe]\ndegraded_loss = nan", "probe.degraded_loss: must be a finite number, got nan"),
    ("[nccl]\nversion = \"it's 2\"", 'nccl.version: must be MAJOR.MINOR[.PATCH] like "2.29.7" (or "" to detect), got "it\'s 2"'),
    ('[metrics]\naddress = "a\\"b\\nc"', 'metrics.address: must be an IPv4 or IPv6 address like "127.0.0.1", got "a\\"b\\nc"'),
    ('[mqtt]\nprefix = "a/+/{host}"', 'mqtt.prefix: must not contain the MQTT wildcards + or # (or NUL), got "a/+/{host}"'),
    ('[daemon]\nlog_level = "loud"', "daemon.log_level: Input should be 'debug', 'info', 'warning' or 'error' (got \"loud\")"),
])
def test_got_values_are_quoted_json_style(setting, line):
    table, kv = setting.split("\n", 1)
    text = EXAMPLE.replace(table + "\n", f"{table}\n{kv}\n", 1) if table in EXAMPLE else EXAMPLE + f"\n{setting}\n"
    if kv.startswith("host_ip"):
        text = re.sub(rf'(?m)^{kv.split(" ")[0]} = "[^"]*"\n', "", text, count=1)
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "x.toml")
    (p,) = ei.value.problems
    assert p.startswith(f"x.toml: {line}"), p
    assert "\n" not in p


def test_duplicates_are_listed_json_style():
    with pytest.raises(ConfigError) as ei:
        parse_config(edit(EXAMPLE, 'netdev = "rail1"', 'netdev = "rail0"'), "x.toml")
    assert str(ei.value) == 'x.toml: rails: netdev used by two rails in ["rail0", "rail0"]'


# ----------------------------------------------------------------------------- special files, size, BOM


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "lp.toml"
    os.mkfifo(fifo)
    result: list = []

    def load():
        try:
            load_config(fifo)
        except ConfigError as e:
            result.append(str(e))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # blocked opening the FIFO: give it a writer so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("load_config blocked on a FIFO")
    assert result == [f"{fifo}: not a regular file (a FIFO)"]


@pytest.mark.parametrize("dev,kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_device_is_refused(dev, kind):
    with pytest.raises(ConfigError) as ei:
        load_config(dev)
    assert str(ei.value) == f"{dev}: not a regular file ({kind})"


def test_socket_is_refused(tmp_path):
    import socket

    path = tmp_path / "lp.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        with pytest.raises(ConfigError) as ei:
            load_config(path)
        assert str(ei.value) == f"{path}: not a regular file (a socket)"
    finally:
        s.close()


def test_size_limit_is_1_mib(tmp_path):
    p = tmp_path / "lp.toml"
    pad = MAX_CONFIG_BYTES - len(EXAMPLE.encode()) - 1
    p.write_text("#" * pad + "\n" + EXAMPLE)
    assert p.stat().st_size == MAX_CONFIG_BYTES == 1 << 20
    assert load_config(p).daemon.host == "h0"  # exactly 1 MiB: fine
    p.write_text("#" * (pad + 1) + "\n" + EXAMPLE)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value) == f"{p}: too large ({MAX_CONFIG_BYTES + 1} bytes; a config file is at most 1 MiB)"


def test_read_is_bounded_even_if_the_file_grows(tmp_path, monkeypatch):
    """stat(2) said small, the file is larger when read: at most limit + 1 bytes are read."""
    p = tmp_path / "lp.toml"
    p.write_bytes(b"#" * (3 * MAX_CONFIG_BYTES))
    real_stat, real_fstat = os.stat, os.fstat

    def small(st):
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 10,
                               st.st_atime, st.st_mtime, st.st_ctime))

    reads: list[int] = []
    real_fdopen = os.fdopen

    def fdopen(fd, *a, **kw):
        f = real_fdopen(fd, *a, **kw)
        real_read = f.read
        f.read = lambda n=-1: (reads.append(n), real_read(n))[1]
        return f

    monkeypatch.setattr(os, "stat", lambda path, *a, **kw: small(real_stat(path, *a, **kw)))
    monkeypatch.setattr(os, "fstat", lambda fd: small(real_fstat(fd)))
    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    monkeypatch.undo()
    assert reads == [MAX_CONFIG_BYTES + 1]
    assert str(ei.value) == f"{p}: too large (over {MAX_CONFIG_BYTES} bytes; a config file is at most 1 MiB)"


def test_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "lp.toml"
    p.write_bytes(b"\xef\xbb\xbf" + EXAMPLE.encode())
    assert load_config(p) == parse_config(EXAMPLE)
    assert parse_config("\ufeff" + EXAMPLE) == parse_config(EXAMPLE)


def test_bom_keeps_toml_positions_and_only_the_first_is_dropped(tmp_path):
    with pytest.raises(ConfigError) as ei:
        parse_config("\ufeff[daemon\n", "x.toml")
    assert "(at line 1, column 8)" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        parse_config("\ufeff\ufeff" + EXAMPLE, "x.toml")
    assert "not valid TOML" in str(ei.value)


def test_an_integer_past_pythons_digit_limit_is_one_line():
    with pytest.raises(ConfigError) as ei:
        parse_config(EXAMPLE.replace("[daemon]", "[daemon]\nhold_down_ms = " + "9" * 5000, 1), "x.toml")
    s = assert_one_line(ei.value, "x.toml", None)
    assert "cannot parse" in s and "4300 digits" in s and "set_int_max_str_digits" not in s  # no advice for programmers


def test_empty_control_socket_and_a_peer_with_our_own_host_ip_are_refused():
    import re

    with pytest.raises(ConfigError) as ei:
        parse_config(re.sub(r'control_socket = "[^"]*"', 'control_socket = ""', EXAMPLE, count=1), "x.toml")
    assert "control_socket" in assert_one_line(ei.value, "x.toml", None)
    assert '"198.19.0.2"' in EXAMPLE
    with pytest.raises(ConfigError) as ei:
        parse_config(EXAMPLE.replace('"198.19.0.2"', '"198.19.0.1"', 1), "x.toml")
    assert "this host's own host_ip" in assert_one_line(ei.value, "x.toml", None)


def test_a_blank_path_is_refused_in_one_line():
    import re

    with pytest.raises(ConfigError) as ei:
        parse_config(re.sub(r'control_socket = "[^"]*"', 'control_socket = "   "', EXAMPLE, count=1), "x.toml")
    s = assert_one_line(ei.value, "x.toml", None)
    assert "control_socket" in s and "must be a path" in s
