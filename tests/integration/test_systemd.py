"""systemd integration: the unit file passes ``systemd-analyze verify``, and a real daemon on the
test fabric speaks the sd_notify protocol to a real ``$NOTIFY_SOCKET`` datagram socket: READY=1
after its first link dump and route reconciliation, STATUS= lines, WATCHDOG=1 every half
``$WATCHDOG_USEC`` and none while its event loop is blocked, RELOADING=1/READY=1 around SIGHUP,
STOPPING=1 on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .daemons import Cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "linkpass.service"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze missing (Debian package systemd; `make test` installs it)")


def _unit_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with ExecStart pointing at this venv's linkpass (verify checks that it exists)."""
    exe = Path(sys.executable).parent / "linkpass"
    assert exe.exists(), f"{exe} missing: pip install -e . first"
    text = (text or UNIT.read_text()).replace("ExecStart=/usr/local/bin/linkpass ", f"ExecStart={exe} ")
    assert f"ExecStart={exe} run --config" in text
    p = tmp_path / "linkpass.service"
    p.write_text(text)
    return p


def _verify(unit: Path) -> tuple[int, list[str]]:
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # only what concerns our unit (a container may have warnings about its own units)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if unit.name in ln or "linkpass" in ln]
    return p.returncode, lines


@needs_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    rc, lines = _verify(_unit_copy(tmp_path))
    assert rc == 0 and lines == [], lines


@needs_analyze
@pytest.mark.parametrize("old, new", [
    ("Type=notify\n", "Type=notifyy\n"),
    ("ProtectSystem=strict\n", "ProtectSystem=strictly\n"),
    ("WatchdogSec=10s\n", "WatchdogSec=10s\nWatchdogSecs=10s\n"),
])
def test_verify_catches_a_broken_unit(tmp_path, old, new):
    """The check above can fail: a bad value or an unknown key is reported for our unit."""
    text = UNIT.read_text()
    assert old in text
    _, lines = _verify(_unit_copy(tmp_path, text.replace(old, new, 1)))
    assert lines, "systemd-analyze said nothing about a broken unit"


@needs_analyze
def test_unit_hardening_keeps_exposure_low(tmp_path):
    """``systemd-analyze security`` (offline) rates the unit 4.0 or better (0 best, 10 worst)."""
    unit = _unit_copy(tmp_path)
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=40", str(unit)],
                       capture_output=True, text=True, timeout=60)
    if "--offline" in p.stderr and "unrecognized" in p.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_unit_asks_for_the_notify_protocol_and_few_capabilities():
    keys = {}
    for ln in UNIT.read_text().splitlines():
        if "=" in ln and not ln.startswith("#"):
            k, v = ln.split("=", 1)
            keys.setdefault(k.strip(), v.strip())
    assert keys["Type"] == "notify" and keys["Restart"] == "on-failure"
    assert keys["ExecReload"] == "/bin/kill -HUP $MAINPID" and keys["WatchdogSec"]
    caps = set(keys["CapabilityBoundingSet"].split())
    assert caps == {"CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_SYSLOG"}
    assert set(keys["AmbientCapabilities"].split()) == caps
    assert keys["NoNewPrivileges"] == "yes" and keys["ProtectSystem"] == "strict"
    # the daemon's threads at SCHED_RR, set by systemd (no CAP_SYS_NICE), equal to the config's default
    from linkpass.config.schema import REALTIME_PRIORITY_DEFAULT

    assert keys["CPUSchedulingPolicy"] == "rr" and "CPUSchedulingResetOnFork" not in keys  # it resets threads too
    assert int(keys["CPUSchedulingPriority"]) == REALTIME_PRIORITY_DEFAULT
    assert keys["RuntimeDirectory"] == "linkpass" and keys["StateDirectory"] == "linkpass"
    assert set(keys["ReadWritePaths"].split()) == {"/run/linkpass", "/var/lib/linkpass"}
    assert "ProtectKernelLogs" not in keys  # it would deny /dev/kmsg
    # before systemd 252 it implies DeviceAllow=char-rtc: /dev/kmsg, /dev/infiniband, /dev/nvidia* denied
    assert "ProtectClock" not in keys and "DeviceAllow" not in keys
    assert keys["RuntimeDirectoryPreserve"] == "yes"  # nccl.env outlives a stop
    assert keys["RestartPreventExitStatus"] == "2"  # a bad config is not restarted in a loop


# ---------------------------------------------------------------------------- the protocol, live

class Listener:
    """The service manager's end: an AF_UNIX datagram socket; remembers every message with
    the monotonic time it was read."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.got: list[tuple[int, str]] = []

    def pump(self) -> list[str]:
        """Read everything queued now; returns the new messages."""
        new = []
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                break
            new.append(data.decode())
            self.got.append((time.monotonic_ns(), new[-1]))
        return new

    def wait(self, pred, timeout: float = 20.0, what: str = "message", since: int | None = None):
        """Pump until a message satisfies ``pred`` (among those read from index ``since`` on,
        default: from now on); returns (t_ns, message)."""
        seen = len(self.got) if since is None else since

        def check():
            self.pump()
            for t, m in self.got[seen:]:
                if pred(m):
                    return t, m
            return None

        return wait_for(check, timeout, what)

    def close(self) -> None:
        self.sock.close()


def _proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ("T": stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _fields(msg: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in msg.split("\n") if "=" in ln)


@pytest.fixture
def notified(tmp_path, monkeypatch):
    """A 2-host fabric; h0's daemon started with NOTIFY_SOCKET, WATCHDOG_USEC (0.6 s: a ping
    every 0.3 s); h1's daemon not yet."""
    lst = Listener(tmp_path / "notify.sock")
    c = Cluster(hosts=2, rails=2, hold_down_ms=300, tmp=tmp_path)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
        monkeypatch.setenv("WATCHDOG_USEC", "600000")
        c.start(0, wait=False)
        monkeypatch.delenv("NOTIFY_SOCKET")
        monkeypatch.delenv("WATCHDOG_USEC")
        yield c, lst
    finally:
        c.close()
        lst.close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
@pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft")
def test_notify_protocol_with_a_real_daemon(notified):
    c, lst = notified
    # READY=1 with a STATUS= line, after the daemon's first link dump and route reconciliation
    t_ready, msg = lst.wait(lambda m: "READY=1" in m.split("\n"), what="READY=1")
    f = _fields(msg)
    assert f["STATUS"] == "2/2 rails up, plan generation 1, 0/1 peers heard", msg
    hist = c.history(0)
    dump = next(e for e in hist if e["kind"] == "link_dump")
    applied = next(e for e in hist if e["kind"] == "routes_applied")
    assert dump["t_ns"] <= applied["t_ns"] < t_ready  # one monotonic clock for the whole host
    before = [m for t, m in lst.got if t < t_ready]
    assert not any("READY=1" in m for m in before)
    assert any(m.startswith("STATUS=starting") for m in before)

    # STATUS= follows the state: the peer comes up
    mark = len(lst.got)
    c.start(1)
    lst.wait(lambda m: _fields(m).get("STATUS", "").endswith("1/1 peers heard"), what="STATUS with the peer heard", since=mark)

    # WATCHDOG=1 keeps coming while the loop runs
    n0 = sum(1 for _, m in lst.got if m == "WATCHDOG=1")
    wait_for(lambda: lst.pump() is not None and sum(1 for _, m in lst.got if m == "WATCHDOG=1") >= n0 + 3,
             timeout=15, what="three more WATCHDOG=1")
    st = c.status(0)["systemd"]
    assert st["notify"] and st["ready"] and st["watchdog_interval_s"] == pytest.approx(0.3)

    # ... and stops while the daemon is hung (stopped with SIGSTOP: nothing runs, as with a
    # blocked event loop): nothing for 2 s; pings again once it runs on (SIGCONT)
    c.signal(0, signal.SIGSTOP)
    try:
        pid = c.procs[0].pid
        wait_for(lambda: _proc_state(pid) == "T", timeout=10, what="the daemon stopped")
        lst.pump()  # what it sent before it stopped
        # a bounded wait for the next datagram, which must not come while it is stopped
        readable, _, _ = select.select([lst.sock], [], [], 2.0)
        during = lst.pump() if readable else []
    finally:
        c.signal(0, signal.SIGCONT)
    assert during == [], f"messages while the daemon was stopped: {during}"
    lst.wait(lambda m: m == "WATCHDOG=1", timeout=20, what="WATCHDOG=1 again after SIGCONT", since=len(lst.got))

    # SIGHUP: RELOADING=1 (with MONOTONIC_USEC), then READY=1 again
    mark = len(lst.got)
    c.signal(0, signal.SIGHUP)
    _, rel = lst.wait(lambda m: m.startswith("RELOADING=1"), what="RELOADING=1", since=mark)
    assert int(_fields(rel)["MONOTONIC_USEC"]) > 0
    _, again = lst.wait(lambda m: "READY=1" in m.split("\n"), what="READY=1 after reload", since=mark)
    order = [m.split("\n")[0] for _, m in lst.got[mark:] if m.split("\n")[0] in ("RELOADING=1", "READY=1")]
    assert order[:2] == ["RELOADING=1", "READY=1"], order
    assert _fields(again)["STATUS"].startswith("2/2 rails up")

    # SIGTERM: STOPPING=1, exit 0
    assert c.stop(0, signal.SIGTERM) == 0
    lst.pump()
    assert any(m.startswith("STOPPING=1") for _, m in lst.got)


