"""linkpass/daemon.py: the control socket (a real Daemon's server on a real unix socket in this
process, no namespaces) and SIGHUP reloads that must keep the running config."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from linkpass import daemon as daemon_mod
from linkpass.config import load_config
from linkpass.daemon import Daemon, parse_request


@pytest.fixture
def short_dir():
    """A directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix="lpc", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def make_daemon(d: Path, extra: str = "") -> Daemon:
    cfg_path = d / "lp.toml"
    cfg_path.write_text(f'[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\ncontrol_socket = "{d}/c.sock"\n'
                        '[[rails]]\nid = 0\nnetdev = "rail0"\n[probe]\nenabled = false\n[nccl]\nwrite_env_file = false\n'
                        + extra)
    return Daemon(str(cfg_path), load_config(cfg_path))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


# ----------------------------------------------------------------------------- parse_request


@pytest.mark.parametrize("line,needle", [
    (b"\xff\xfe{}\n", "not UTF-8"),
    (b'{"cmd": "st\xc3', "not UTF-8"),
    (b"{nope\n", "not JSON"),
    (b"\n", "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"\n", "nested too deeply"),
    (b"[1, 2]\n", "JSON object"),
    (b'"status"\n', "JSON object"),
    (b'{"cmd": ["status"]}\n', '"cmd" must be a string'),
    (b'{"cmd": ' + b"9" * 5000 + b"}\n", "more digits than any setting can use"),
])
def test_bad_request_lines_give_one_line_reasons(line, needle):
    req, why = parse_request(line)
    assert req is None and needle in why and "\n" not in why and "set_int_max_str_digits" not in why


def test_good_and_empty_request_lines():
    assert parse_request(b'{"cmd": "history"}\n') == ({"cmd": "history"}, None)
    assert parse_request(b"{}\n") == ({}, None)
    assert parse_request(b"") == ({"cmd": "status"}, None)  # closed without a line: status


def test_throttle_allows_one_per_interval_and_counts_the_rest():
    clock = FakeClock()
    t = daemon_mod._Throttle(10, clock)
    assert t.allow() == (True, 0)
    assert [t.allow() for _ in range(3)] == [(False, 1), (False, 2), (False, 3)]
    clock.now = 10
    assert t.allow() == (True, 3)
    assert t.allow() == (False, 1)


# ----------------------------------------------------------------------------- the socket


async def _ask(path: str, payload: bytes) -> bytes:
    r, w = await asyncio.open_unix_connection(path, limit=daemon_mod.QUERY_LIMIT)
    try:
        w.write(payload)
        await w.drain()
        return await asyncio.wait_for(r.readline(), 10)
    finally:
        w.close()


def test_every_bad_request_gets_a_json_error_and_no_traceback(short_dir, caplog, monkeypatch):
    d = make_daemon(short_dir)
    clock = FakeClock()
    d._bad_request_warn = daemon_mod._Throttle(daemon_mod.BAD_REQUEST_WARN_INTERVAL_NS, clock)
    monkeypatch.setattr(daemon_mod, "CONTROL_TIMEOUT_S", 0.2)  # the silent client's wait
    path = str(short_dir / "c.sock")
    bad = {
        "not-utf8": b"\xff\xfe\xfd\n",
        "over-64k": b"{" + b" " * (daemon_mod.MAX_REQUEST_BYTES + 10) + b"}\n",
        "deep-json": b"[" * 30_000 + b"]" * 30_000 + b"\n",
        "not-json": b"hello\n",
        "list": b"[]\n",
        "unknown-cmd": b'{"cmd": "reboot"}\n',
        "silent": b"",  # connects, sends nothing, keeps the connection open
    }

    async def silent() -> bytes:
        r, w = await asyncio.open_unix_connection(path)
        try:
            return await asyncio.wait_for(r.readline(), 10)
        finally:
            w.close()

    async def main():
        await d._start_control(Path(path))
        try:
            out = {}
            for name, payload in bad.items():
                out[name] = await (silent() if name == "silent" else _ask(path, payload))
            out["status"] = await _ask(path, b'{"cmd": "status"}\n')
            return out
        finally:
            d._server.close()
            await d._server.wait_closed()

    with caplog.at_level(logging.DEBUG, logger="linkpass"):
        out = asyncio.run(main())
    for name in bad:
        assert out[name].endswith(b"\n") and out[name].count(b"\n") == 1, name
        assert set(json.loads(out[name])) == {"error"}, (name, out[name])
    assert "UTF-8" in json.loads(out["not-utf8"])["error"]
    assert "over 65536 bytes" in json.loads(out["over-64k"])["error"]
    assert "nested too deeply" in json.loads(out["deep-json"])["error"]
    assert "no request line" in json.loads(out["silent"])["error"]
    st = json.loads(out["status"])
    assert st["schema"] == daemon_mod.STATUS_SCHEMA and st["counters"]["control_bad_requests"] == len(bad)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged for client input"
    said = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]  # the clock did not move: one warning for all of them
    clock.now += daemon_mod.BAD_REQUEST_WARN_INTERVAL_NS
    with caplog.at_level(logging.WARNING, logger="linkpass"):
        caplog.clear()
        d._bad_request("x")
    assert [r.getMessage() for r in caplog.records] == [
        f"control socket: bad request answered with an error: x ({len(bad) - 1} more since the last warning)"]


def test_200_clients_connecting_at_once_all_get_their_reply(short_dir):
    """More clients than asyncio's default backlog (100) connect before the daemon accepts any:
    each non-blocking connect must succeed at once (EAGAIN: the backlog is full) and get a reply."""
    n = 200
    assert daemon_mod.CONTROL_BACKLOG >= n
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    if somaxconn < n:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: the kernel caps the backlog below {n}")
    d = make_daemon(short_dir)
    path = str(short_dir / "c.sock")

    async def main():
        await d._start_control(Path(path))
        socks, refused = [], 0
        try:
            for _ in range(n):  # no await in this loop: the server accepts nothing meanwhile
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(path)
                except BlockingIOError:
                    refused += 1
                    s.close()
                    continue
                s.send(b'{"cmd": "status"}\n')
                socks.append(s)

            async def reply(s: socket.socket) -> dict:
                r, w = await asyncio.open_unix_connection(sock=s, limit=daemon_mod.QUERY_LIMIT)
                try:
                    return json.loads(await asyncio.wait_for(r.readline(), 30))
                finally:
                    w.close()

            return refused, await asyncio.gather(*(reply(s) for s in socks), return_exceptions=True)
        finally:
            d._server.close()
            await d._server.wait_closed()

    refused, replies = asyncio.run(main())
    assert refused == 0
    assert [r.get("schema") if isinstance(r, dict) else repr(r) for r in replies] == [daemon_mod.STATUS_SCHEMA] * n


# ----------------------------------------------------------------------------- SIGHUP reload


@pytest.mark.parametrize("content", [
    "x = " + "[" * 500 + "]" * 500 + "\n",
    "x = " + "{a=" * 500 + "1" + "}" * 500 + "\n",
    b"[daemon]\nhost = \"h\xff0\"\n",
    "[daemon\n",
])
def test_failed_reload_keeps_the_config_and_says_why_once(short_dir, caplog, content):
    d = make_daemon(short_dir)
    old_cfg, old_source = d.cfg, d.source_cfg
    cfg_path = Path(d.config_path)
    good_text = cfg_path.read_text()
    cfg_path.write_bytes(content if isinstance(content, bytes) else content.encode())
    caplog.clear()  # the daemon's start warnings
    with caplog.at_level(logging.DEBUG, logger="linkpass"):
        d._reload()
    assert d.cfg is old_cfg and d.source_cfg is old_source
    assert d.reload_error and d.reload_error.startswith(f"last reload refused, running config kept: {cfg_path}: ")
    assert "\n" not in d.reload_error
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "reload refused" in errors[0].getMessage() and not errors[0].exc_info
    assert d.reload_error in d.status()["warnings"]
    cfg_path.write_text(good_text.replace('host = "h0"', 'host = "h0"\nhold_down_ms = 1234'))
    d._tune_rails = lambda only=None: None
    d._reload()
    assert d.reload_error is None and d.cfg.daemon.hold_down_ms == 1234


def test_unexpected_error_while_reloading_is_a_refused_reload_not_a_traceback(short_dir, caplog, monkeypatch):
    d = make_daemon(short_dir)
    old_cfg = d.cfg

    def boom(path):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(daemon_mod, "load_config", boom)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="linkpass"):
        d._reload()
    assert d.cfg is old_cfg and "RecursionError" in d.reload_error
    (rec,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "reload refused" in rec.getMessage() and not rec.exc_info


def test_an_integer_past_pythons_digit_limit_is_an_error_line_not_a_traceback():
    req, why = parse_request(b'{"cmd": "status", "x": ' + b"9" * 5000 + b"}\n")
    assert req is None and "cannot read" in why


def test_drain_and_undrain_requests_become_drain_events_and_bad_ones_errors(short_dir):
    from linkpass.core.model import Drain

    d = make_daemon(short_dir)
    path = str(short_dir / "c.sock")

    async def main():
        await d._start_control(Path(path))
        try:
            out = [json.loads(await _ask(path, json.dumps(req).encode() + b"\n")) for req in (
                {"cmd": "drain", "rail": 0}, {"cmd": "undrain", "rail": 0}, {"cmd": "undrain", "rail": 0},
                {"cmd": "drain", "rail": 7}, {"cmd": "drain", "rail": "0"}, {"cmd": "drain"}, {"cmd": "undrain", "rail": True})]
            posted = []
            while not d.queue.empty():
                posted.append(d.queue.get_nowait())
            via_cli = await daemon_mod.query(path, "drain", rail=0)
            return out, posted, via_cli
        finally:
            d._server.close()
            await d._server.wait_closed()

    out, posted, via_cli = asyncio.run(main())
    # was_drained follows the requests even before the engine has handled their events
    assert out[:3] == [{"ok": True, "cmd": "drain", "rail": 0, "was_drained": False},
                       {"ok": True, "cmd": "undrain", "rail": 0, "was_drained": True},
                       {"ok": True, "cmd": "undrain", "rail": 0, "was_drained": False}]
    assert [(e.rail, e.drain) for e in posted] == [(0, True), (0, False), (0, False)]
    assert all(isinstance(e, Drain) for e in posted)
    assert "no rail 7 in this daemon's config (rails: [0])" in out[3]["error"] and out[3]["bad_input"] is True
    assert all('"rail" must be a rail id' in o["error"] for o in out[4:])
    assert d.control_bad_requests == 4
    assert via_cli == {"ok": True, "cmd": "drain", "rail": 0, "was_drained": False}


def test_cli_drain_says_a_rail_not_in_the_config_exit_2_and_undrain_of_a_rail_not_drained(short_dir, capsys):
    from linkpass.cli import main

    d = make_daemon(short_dir)
    path = str(short_dir / "c.sock")

    async def run():
        await d._start_control(Path(path))
        try:
            out = []
            for argv in (["drain", "7"], ["undrain", "0"], ["drain", "0"], ["drain", "0"], ["undrain", "0"]):
                rc = await asyncio.to_thread(main, argv + ["--socket", path])
                cap = capsys.readouterr()
                out.append((rc, cap.out.strip(), cap.err.strip()))
            return out
        finally:
            d._server.close()
            await d._server.wait_closed()

    out = asyncio.run(run())
    rc, o, e = out[0]
    assert rc == 2 and not o and e.count("\n") == 0 and "no rail 7 in this daemon's config" in e, out[0]
    assert out[1:] == [(0, "rail 0: not drained; nothing to undrain", ""),
                       (0, "rail 0: drain requested (see `linkpass status`)", ""),
                       (0, "rail 0: already drained", ""),
                       (0, "rail 0: undrain requested (see `linkpass status`)", "")]


def test_cli_drain_without_a_daemon_says_so(short_dir, capsys):
    from linkpass.cli import main

    assert main(["drain", "1", "--socket", str(short_dir / "none.sock")]) == 3
    assert "no daemon answers on" in capsys.readouterr().err
