"""torch_hooks.client and torch_hooks.protocol without torch: a thread server on a real unix
socket plays the daemon (malformed lines, stale notices, absence, restart)."""

from __future__ import annotations

import json
import socket
import sys
import threading

import pytest

from torch_hooks import protocol as proto
from tests.wait import wait_until
from torch_hooks.client import DaemonClient

REG = proto.Registration(job="j", rank=0, world_size=2, peers=("h1",), rail=0)


def _notice(gen, instance="i1", usable=(0, 1), peer=(0, 1)):
    return proto.build_notice(generation=gen, instance=instance, host="h0", all_rails=[0, 1], usable=usable,
                              peer_usable={"h1": frozenset(peer)}, reason="t", t_ns=1, reg=REG)


class Server:
    def __init__(self, path):
        self.path = path
        self.s = socket.socket(socket.AF_UNIX)
        self.s.bind(path)
        self.s.listen(4)
        self.conn = None
        self.lines: list[dict] = []
        self.got = threading.Event()
        self.accepted = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            self.conn, _ = self.s.accept()
        except OSError:
            return
        finally:
            self.accepted.set()
        for line in self.conn.makefile("rb"):
            self.lines.append(json.loads(line))
            self.got.set()

    def send(self, data: bytes):
        # the client is connected once the kernel queued the connection, which can be before
        # this server's accept() returned
        assert self.accepted.wait(5), "no connection accepted"
        self.conn.sendall(data)

    def close(self):
        for x in (self.conn, self.s):
            try:
                x and x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x and x.close()
        import os
        os.unlink(self.path)


def test_client_never_imports_torch():
    import subprocess

    code = "import sys, torch_hooks.client, torch_hooks.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_register_notices_malformed_stale_and_reports(tmp_path):
    srv = Server(str(tmp_path / "h.sock"))
    seen: list[proto.Notice] = []
    c = DaemonClient(REG, srv.path, reconnect_s=(0.02, 0.1), on_notice=seen.append).start()
    try:
        assert srv.got.wait(3) and srv.lines[0]["type"] == "register" and srv.lines[0]["peers"] == ["h1"]
        assert c.wait_connected(3)
        srv.send(proto.encode(_notice(4)))
        assert c.wait_notice(0, 3) and c.generation == 4 and not c.latest.affects(0)
        # garbage: not JSON, a client-side type, a notice missing fields, bad rails, oversized
        srv.send(b"{oops\n" + b'{"type":"register"}\n' + b'{"type":"notice","generation":5}\n'
                 + json.dumps({**_notice(5), "usable": [0, 1], "unusable": [1]}).encode() + b"\n"
                 + b"y" * (proto.MAX_MESSAGE_BYTES + 5) + b"\n")
        srv.send(proto.encode(_notice(3)))               # stale: same instance, older generation
        srv.send(proto.encode(_notice(6, usable=(1,))))  # newer: rail 0 gone here
        assert c.wait_notice(1, 3)
        assert c.generation == 6 and c.latest.affects(0) and c.latest.usable_common == {1}
        assert c.counters["bad_messages"] == 5 and c.counters["stale_notices"] == 1
        assert [n.generation for n in seen] == [4, 6]
        assert c.report("rebuilt", rail_to=1)
        wait_until(lambda: any(m.get("type") == "report" for m in srv.lines), 5, "the report at the server")
        assert srv.lines[-1] == {"type": "report", "event": "rebuilt", "rail_to": 1}
    finally:
        c.close()
        srv.close()


def test_daemon_absent_then_appears_then_restarts(tmp_path):
    path = str(tmp_path / "h.sock")
    c = DaemonClient(REG, path, reconnect_s=(0.02, 0.1)).start()
    try:
        wait_until(lambda: c.counters["connect_failures"] >= 2, 5, "two failed connects (no daemon yet)")
        assert not c.connected
        assert c.report("x") is False and c.counters["reports_dropped"] == 1  # never blocks, never raises
        srv = Server(path)
        assert c.wait_connected(3)
        srv.send(proto.encode(_notice(9)))
        assert c.wait_notice(0, 3)
        srv.close()  # the daemon goes away ...
        wait_until(lambda: not c.connected, 5, "the client to see the daemon gone")
        srv = Server(path)  # ... and comes back as a new instance counting from 1
        assert c.wait_connected(3) and srv.got.wait(3) and srv.lines[0]["type"] == "register"
        srv.send(proto.encode(_notice(1, instance="i2")))
        assert c.wait_notice(1, 3) and c.generation == 1 and c.latest.instance == "i2"
        assert c.counters["connects"] == 2 and c.counters["disconnects"] == 1
        srv.close()
    finally:
        c.close()


@pytest.mark.parametrize("msg,err", [
    ({"type": "register", "job": "", "rank": 0, "world_size": 1}, "job"),
    ({"type": "register", "job": "j", "rank": 2, "world_size": 2}, "rank"),
    ({"type": "register", "job": "j", "rank": 0, "world_size": 2, "peers": "h1"}, "peers"),
    ({"type": "register", "job": "j", "rank": 0, "world_size": 2, "rail": -1}, "rail"),
    ({"type": "register", "job": "j", "rank": True, "world_size": 2}, "rank"),
    ({"type": "register", "v": 9, "job": "j", "rank": 0, "world_size": 2}, "version"),
])
def test_parse_register_names_the_bad_field(msg, err):
    with pytest.raises(proto.ProtocolError, match=err):
        proto.parse_register(msg)


def test_affected_paths():
    # local rail 0 down: every peer's path over rail 0 is broken
    assert proto.affected([0, 1], [1], {"h1": {0, 1}}, ["h1"], 0) == ([0], ["h1"], [1])
    # a peer's rail 1 down, group on rail 0: rail 1 listed, no peer hit
    assert proto.affected([0, 1], [0, 1], {"h1": {0}, "h2": {0, 1}}, ["h1", "h2"], 0) == ([1], [], [0])
    # a peer never heard from counts against nothing
    assert proto.affected([0, 1], [0, 1], {"h1": None}, ["h1"], 0) == ([], [], [0, 1])
    n = proto.parse_notice(_notice(1, peer=(1,)))
    assert n.affects(0) and not n.affects(1) and n.affected_peers == ("h1",)
    assert proto.is_newer(n, None) and not proto.is_newer(n, n)
    assert proto.is_newer(proto.parse_notice(_notice(1, instance="other")), n)


def test_encode_refuses_oversized_and_untyped():
    with pytest.raises(proto.ProtocolError, match="limit"):
        proto.encode({"type": "report", "x": "y" * proto.MAX_MESSAGE_BYTES})
    with pytest.raises(proto.ProtocolError):
        proto.encode({"no": "type"})
