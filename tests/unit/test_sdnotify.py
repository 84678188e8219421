"""The sd_notify(3) protocol end (linkpass.adapters.sdnotify) against real AF_UNIX datagram
sockets: a file-system path and an abstract-namespace name, as systemd hands them out."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time

import pytest
from unit_helpers import MS, S, carrier_lost, make_toml, snapshot

from linkpass.adapters.sdnotify import SdNotifier, ServiceNotifier, status_line
from linkpass.config import parse_config
from linkpass.core.model import LinkChanged, RoutesApplied
from linkpass.daemon import Daemon
from tests.wait import async_wait_until


def listener(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
    s.settimeout(2)
    return s


def recv_all(s: socket.socket) -> list[str]:
    """Every datagram queued now, decoded."""
    out = []
    s.setblocking(False)
    try:
        while True:
            out.append(s.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        s.settimeout(2)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path):
    addr = str(tmp_path / "notify") if request.param == "path" else f"@linkpass-test-{secrets.token_hex(6)}"
    s = listener(addr)
    yield addr, s
    s.close()


def test_messages_arrive_as_one_datagram_each(notify_socket):
    addr, s = notify_socket
    n = SdNotifier.from_env({"NOTIFY_SOCKET": addr})
    assert n.enabled and n.watchdog_interval_s is None
    assert n.ready("2/2 rails up,\nplan generation 1")
    assert s.recv(4096) == b"READY=1\nSTATUS=2/2 rails up, plan generation 1"
    assert n.watchdog()
    assert s.recv(4096) == b"WATCHDOG=1"
    assert n.reloading()
    msg = s.recv(4096).decode().split("\n")
    assert msg[0] == "RELOADING=1" and msg[1].startswith("MONOTONIC_USEC=")
    usec = int(msg[1].removeprefix("MONOTONIC_USEC="))
    assert abs(usec - time.monotonic_ns() // 1000) < 60_000_000  # CLOCK_MONOTONIC, microseconds
    assert n.stopping()
    assert s.recv(4096) == b"STOPPING=1"
    assert n.sent == 4
    n.close()


def test_not_under_systemd_everything_is_a_no_op():
    n = SdNotifier.from_env({})
    assert not n.enabled and not n.ready() and not n.watchdog() and n.watchdog_interval_s is None


@pytest.mark.parametrize("env, interval", [
    ({"WATCHDOG_USEC": "3000000"}, 1.5),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}, 1.5),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}, None),  # another process's watchdog
    ({"WATCHDOG_USEC": "junk"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "x"}, None),
])
def test_watchdog_interval_is_half_the_timeout_when_it_is_ours(env, interval, tmp_path):
    n = SdNotifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "n"), **env})
    assert n.watchdog_interval_s == interval


def test_relative_socket_address_is_refused(caplog):
    n = SdNotifier.from_env({"NOTIFY_SOCKET": "relative/path"})
    assert not n.enabled
    assert "neither an absolute path" in caplog.text


def test_nobody_listening_is_logged_once_and_never_raises(tmp_path, caplog):
    n = SdNotifier(str(tmp_path / "gone"))
    assert not n.watchdog() and not n.watchdog()
    assert caplog.text.count("cannot notify systemd") == 1


def make_daemon(tmp_path) -> Daemon:
    text = make_toml(rails=(0, 1), n_peers=1).replace("[daemon]\n", f'[daemon]\ncontrol_socket = "{tmp_path}/lp.sock"\n', 1)
    return Daemon(str(tmp_path / "lp.toml"), parse_config(text, "lp.toml"))


def test_service_notifier_ready_once_then_status_on_change(notify_socket, tmp_path):
    addr, s = notify_socket
    d = make_daemon(tmp_path)
    sn = ServiceNotifier(SdNotifier(addr))
    sn.reloading()
    sn.reloaded(d.snapshot())
    sn.update(d.snapshot())
    assert recv_all(s) == []  # nothing before READY=1 (a reload must not claim readiness)
    d.engine.handle(snapshot(d.cfg, 0), 0)
    d.engine.handle(RoutesApplied(1, MS), MS)
    sn.ready(d.snapshot())
    sn.ready(d.snapshot())
    assert recv_all(s) == ["READY=1\nSTATUS=2/2 rails up, plan generation 1, 0/1 peers heard"]
    sn.update(d.snapshot())
    assert recv_all(s) == []  # unchanged summary: no datagram
    d.engine.handle(LinkChanged(carrier_lost("rail0"), S), S)
    sn.update(d.snapshot())
    assert recv_all(s) == ["STATUS=1/2 rails up, plan generation 2, 0/1 peers heard"]
    sn.reloading()
    d.reload_error = "bad file"
    sn.reloaded(d.snapshot())
    got = recv_all(s)
    assert got[0].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert got[1] == "READY=1\nSTATUS=1/2 rails up, plan generation 2, 0/1 peers heard, last reload refused (old config kept)"
    sn.stopping()
    assert recv_all(s) == ["STOPPING=1\nSTATUS=stopping; routes are left in place"]


def test_status_line_names_degraded_rails_and_route_errors(tmp_path):
    d = make_daemon(tmp_path)
    d.engine.handle(snapshot(d.cfg, 0), 0)
    d.engine.handle(RoutesApplied(1, MS, errors=("replace 198.19.0.2/32: Network is unreachable",)), MS)
    d.engine.degraded.add(1)
    assert status_line(d.snapshot()) == "2/2 rails up, plan generation 1, 0/1 peers heard, degraded rail(s) 1, 1 route error(s)"


def test_watchdog_loop_pings_every_half_timeout_and_stops_when_the_loop_blocks(notify_socket, tmp_path):
    addr, s = notify_socket
    sn = ServiceNotifier(SdNotifier(addr, watchdog_usec=100_000))  # ping every 50 ms

    async def main() -> tuple[list[str], list[str]]:
        task = asyncio.create_task(sn.watchdog_loop())
        running: list[str] = []

        def three_pings() -> bool:
            running.extend(recv_all(s))
            return len(running) >= 3

        await async_wait_until(three_pings, 5, "three watchdog pings")
        # the loop is blocked (this sleep is the input, not a wait): no task runs, no ping goes out.
        # Nothing runs between the drain above and the block, so any datagram now came from a blocked loop.
        recv_all(s)
        time.sleep(0.3)  # six ping intervals
        blocked = recv_all(s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return running, blocked

    running, blocked = asyncio.run(main())
    assert len(running) >= 3 and all(m == "WATCHDOG=1" for m in running), running
    assert blocked == []
