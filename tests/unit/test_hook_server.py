"""linkpass/adapters/hook_server.py on a real unix socket (asyncio server in this process),
with raw sockets and with the real torch_hooks client (no torch needed)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat

import pytest

from linkpass.adapters.hook_server import HookServer, PlanState, default_socket_path
from torch_hooks import protocol as proto
from torch_hooks.client import DaemonClient
from tests.wait import async_wait_until


def _plan(gen, usable=(0, 1), peers=None):
    return PlanState(gen, frozenset({0, 1}), frozenset(usable), peers if peers is not None else {"h1": frozenset({0, 1}), "h2": None},
                     "test", 123)


async def _readline(reader, timeout=2.0) -> dict:
    return json.loads(await asyncio.wait_for(reader.readline(), timeout))


def _reg(**kw) -> bytes:
    m = {"type": "register", "v": 1, "job": "j", "rank": 0, "world_size": 2, "peers": ["h1"], "rail": 0, "backend": "gloo"}
    m.update(kw)
    return json.dumps(m).encode() + b"\n"


def test_default_socket_path_sits_beside_the_control_socket():
    assert default_socket_path("/run/linkpass/linkpass.sock") == "/run/linkpass/linkpass.hooks.sock"
    assert default_socket_path("/run/linkpass/fabric/lp/h0.sock") == "/run/linkpass/fabric/lp/h0.hooks.sock"
    assert default_socket_path("/tmp/ctl") == "/tmp/ctl.hooks.sock"


def test_register_notice_priority_peers_reports_and_bad_input(tmp_path):
    path = str(tmp_path / "hooks.sock")
    prio: list[list[str]] = []

    async def main():
        srv = HookServer(path, "h0", ["h1", "h2"], prio.append)
        await srv.start()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        srv.publish(_plan(3))
        r, w = await asyncio.open_unix_connection(path)
        w.write(_reg(peers=["h1", "nosuch"]))
        await w.drain()
        reg = await _readline(r)
        assert reg["type"] == "registered" and reg["host"] == "h0" and reg["unknown_peers"] == ["nosuch"]
        n = await _readline(r)
        assert n["type"] == "notice" and n["generation"] == 3 and n["affected"] == {"rails": [], "peers": []}
        assert prio[-1] == ["h1"]  # only configured peers go to the prober
        # a plan change where the peer lost rail 0: this client's rail
        srv.publish(_plan(4, peers={"h1": frozenset({1}), "h2": None}))
        n = await _readline(r)
        assert n["generation"] == 4 and n["affected"] == {"rails": [0], "peers": ["h1"]} and n["usable_common"] == [1]
        # garbage of every kind: each dropped, counted, answered with an error; the server lives on
        for bad in (b"not json\n", b"[1,2]\n", b'{"no":"type"}\n', b'{"type":"notice","generation":9}\n',
                    _reg(rank=5), b'{"type":"report"}\n', b"\xff\xfe\n"):
            w.write(bad)
            await w.drain()
            e = await _readline(r)
            assert e["type"] == "error", (bad, e)
        w.write(b"x" * (proto.MAX_MESSAGE_BYTES + 10) + b"\n")  # oversized: dropped whole
        w.write(b'{"type":"ping"}\n')
        await w.drain()
        e = await _readline(r)
        assert e["type"] == "error" and "oversized" in e["error"]
        assert (await _readline(r))["type"] == "pong"
        w.write(b'{"type":"report","event":"rebuilt","rail_to":1}\n')
        await w.drain()
        await async_wait_until(lambda: srv.counters["reports"], 5, "the report to be counted")
        c = srv.counters
        assert c["bad_malformed"] == 5 and c["bad_type"] == 1 and c["bad_register"] == 1 and c["bad_oversized"] == 1
        assert c["reports"] == 1 and srv.reports[-1]["event"] == "rebuilt" and srv.reports[-1]["pid"] == os.getpid()
        st = srv.status()
        assert st["clients"][0]["rank"] == 0 and st["clients"][0]["pid"] == os.getpid()
        # a client that goes away is forgotten, and its peers leave the priority list
        w.close()
        await async_wait_until(lambda: srv.clients == {}, 5, "the closed client to be forgotten")
        assert prio[-1] == []
        await srv.close()
        assert not os.path.exists(path)

    asyncio.run(main())


def test_report_cannot_overwrite_identity_and_bad_json_is_malformed(tmp_path, caplog):
    path = str(tmp_path / "hooks.sock")

    async def main():
        srv = HookServer(path, "h0", ["h1"])
        await srv.start()
        r, w = await asyncio.open_unix_connection(path)
        w.write(_reg(job="real", rank=1))
        await w.drain()
        assert (await _readline(r))["type"] == "registered"
        cid = next(iter(srv.clients))
        # a report claiming another identity: kept, but the server's own fields win
        w.write(json.dumps({"type": "report", "event": "rebuilt", "job": "evil", "rank": 0, "pid": 1,
                            "client_id": 99, "t_ns": 5, "rail_to": 1}).encode() + b"\n")
        await w.drain()
        await async_wait_until(lambda: srv.reports, 5, "the report to arrive")
        rec = srv.reports[-1]
        assert (rec["job"], rec["rank"], rec["pid"], rec["client_id"]) == ("real", 1, os.getpid(), cid)
        assert rec["t_ns"] != 5 and rec["event"] == "rebuilt" and rec["rail_to"] == 1
        assert srv.counters["report_fields_dropped"] == 1 and srv.counters["reports"] == 1
        assert srv.status()["clients"][0]["last_report"]["job"] == "real"
        # non-finite numbers and nesting too deep: answered with an error, counted malformed
        bad = (b'{"type":"report","event":"x","v":NaN}\n', b'{"type":"report","event":"x","v":Infinity}\n',
               b'{"type":"report","event":"x","v":-Infinity}\n', b'{"type":"report","event":"x","v":1e999}\n',
               b"[" * 30000 + b"]" * 30000 + b"\n")
        for line in bad:
            w.write(line)
            await w.drain()
            e = await _readline(r)
            assert e["type"] == "error" and e["error"].startswith("malformed:"), (line[:40], e)
        w.write(b'{"type":"ping"}\n')  # still connected
        await w.drain()
        assert (await _readline(r))["type"] == "pong"
        assert srv.counters["bad_malformed"] == len(bad) and srv.counters["reports"] == 1
        json.loads(json.dumps(srv.status(), allow_nan=False))  # status stays strict JSON
        w.close()
        await async_wait_until(lambda: srv.clients == {}, 5, "the closed client to be forgotten")
        await srv.close()

    with caplog.at_level("WARNING", logger="linkpass.hooks"):
        asyncio.run(main())
    hooks = [r for r in caplog.records if r.name == "linkpass.hooks"]
    assert not any(r.exc_info or "unexpected error" in r.getMessage() for r in hooks)
    assert any("server-known field(s) client_id, job, pid, rank, t_ns" in r.getMessage() for r in hooks)


def test_decode_refuses_non_finite_numbers_and_deep_nesting():
    for line in (b'{"type":"ping","x":NaN}', b'{"type":"ping","x":[-Infinity]}', b'{"type":"ping","x":-1e400}',
                 b"[" * 30000 + b"]" * 30000):
        with pytest.raises(proto.ProtocolError):
            proto.decode(line, proto.CLIENT_TYPES)
    assert proto.decode(b'{"type":"ping","x":1.5e3}', proto.CLIENT_TYPES)["x"] == 1500.0


def test_real_client_gets_notices_and_reconnects_after_a_daemon_restart(tmp_path):
    path = str(tmp_path / "hooks.sock")

    async def main():
        srv = HookServer(path, "h0", ["h1"])
        await srv.start()
        srv.publish(_plan(1))
        c = DaemonClient(proto.Registration(job="j", rank=1, world_size=2, peers=("h1",), rail=0), path,
                         reconnect_s=(0.02, 0.1)).start()
        try:
            await asyncio.to_thread(c.wait_notice, 0, 3)
            assert c.connected and c.generation == 1 and not c.latest.affects(0)
            srv.publish(_plan(2, usable=(1,)))
            await asyncio.to_thread(c.wait_notice, 1, 3)
            assert c.generation == 2 and c.latest.affects(0) and c.affected_rails() == {0}
            assert c.report("rebuilt", rail_to=1)
            await async_wait_until(lambda: srv.reports, 5, "the client's report to arrive")
            assert srv.reports[-1]["rail_to"] == 1
            # restart: a new instance counts generations from 1 again; the client takes it
            await srv.close()
            srv2 = HookServer(path, "h0", ["h1"])
            await srv2.start()
            srv2.publish(_plan(1))
            seen = c.notices_seen
            assert await asyncio.to_thread(c.wait_notice, seen, 5)
            assert c.generation == 1 and c.latest.instance == srv2.instance and c.counters["connects"] == 2
            await srv2.close()
        finally:
            c.close()

    asyncio.run(main())


def test_check_path_refuses_a_file_and_a_live_server(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        HookServer(str(f), "h0").check_path()
    live = str(tmp_path / "live.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(live)
    s.listen(1)
    try:
        with pytest.raises(OSError, match="another daemon"):
            HookServer(live, "h0").check_path()
    finally:
        s.close()
    # a stale socket (nobody listening) is replaced
    HookServer(live, "h0").check_path()
    assert not os.path.exists(live)


def test_config_reroute_and_hooks_options():
    from linkpass.config import ConfigError, parse_config

    base = '[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\n{extra}\n[[rails]]\nid = 0\nnetdev = "rail0"\n{tail}'
    cfg = parse_config(base.format(extra="", tail=""))
    assert cfg.daemon.reroute == "kernel" and cfg.hooks.enabled and cfg.hooks.socket is None
    cfg = parse_config(base.format(extra='reroute = "notify-only"', tail='[hooks]\nsocket = "/tmp/x.sock"\n'))
    assert cfg.daemon.reroute == "notify-only" and cfg.hooks.socket == "/tmp/x.sock"
    with pytest.raises(ConfigError, match="daemon.reroute"):
        parse_config(base.format(extra='reroute = "sometimes"', tail=""))
    with pytest.raises(ConfigError, match="hooks"):
        parse_config(base.format(extra="", tail="[hooks]\nbogus = 1\n"))


def test_hooks_socket_equal_to_control_socket_is_refused_by_validation():
    from linkpass.config import ConfigError, parse_config

    text = ('[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\ncontrol_socket = "/run/lp/h0.sock"\n'
            '[[rails]]\nid = 0\nnetdev = "rail0"\n[hooks]\nsocket = "{s}"\n')
    with pytest.raises(ConfigError) as ei:
        parse_config(text.format(s="/run/lp/./h0.sock"), "lp.toml")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("lp.toml: hooks.socket: ") and "daemon.control_socket" in msg
    assert parse_config(text.format(s="/run/lp/h0.hooks.sock")).hooks.socket == "/run/lp/h0.hooks.sock"


def test_reload_warns_once_that_a_new_hooks_socket_needs_a_restart(tmp_path, caplog, monkeypatch):
    from linkpass.config import load_config
    from linkpass.daemon import Daemon

    cfg_path = tmp_path / "lp.toml"
    base = (f'[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\ncontrol_socket = "{tmp_path}/c.sock"\n'
            '[[rails]]\nid = 0\nnetdev = "rail0"\n[probe]\nenabled = false\n[nccl]\nwrite_env_file = false\n')
    cfg_path.write_text(base)
    d = Daemon(str(cfg_path), load_config(cfg_path))
    monkeypatch.setattr(d, "_tune_rails", lambda: None)
    assert d.hooks.path == f"{tmp_path}/c.hooks.sock"
    with caplog.at_level("WARNING", logger="linkpass.daemon"):
        d._reload()  # unchanged: nothing said about the hooks socket
        assert not any("hooks" in r.getMessage() for r in caplog.records)
        cfg_path.write_text(base + f'[hooks]\nsocket = "{tmp_path}/new.sock"\n')
        d._reload()
    said = [r.getMessage() for r in caplog.records if "hooks" in r.getMessage()]
    assert len(said) == 1 and f"{tmp_path}/new.sock" in said[0] and "only after a restart" in said[0]
    assert d.hooks.path == f"{tmp_path}/c.hooks.sock" and d.reload_error is None


def test_plain_status_shows_reroute_mode_and_hook_clients(capsys, tmp_path):
    from linkpass.cli.app import _print_status

    srv = HookServer(str(tmp_path / "h.sock"), "h0")
    hooks = srv.status()
    hooks["clients"] = [{"id": 1, "pid": 11, "job": "llm7", "rank": 0}, {"id": 2, "pid": 12, "job": "llm7", "rank": 1},
                        {"id": 3, "pid": 13, "registered": False}]
    st = {"host": "h0", "mode": "host-ip", "generation": 3, "applied_generation": 3, "uptime_s": 1.0, "rails": [],
          "peers": [], "warnings": [], "reroute": "notify-only", "hooks": hooks}
    _print_status(st)
    out = capsys.readouterr().out
    assert "reroute: notify-only" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("hook clients:"))
    assert line.startswith("hook clients: 3 (llm7/0, llm7/1, unregistered(pid 13))")
    _print_status({**st, "reroute": "kernel", "hooks": None})
    out = capsys.readouterr().out
    assert "reroute: kernel" in out and "hook clients: hooks off" in out
