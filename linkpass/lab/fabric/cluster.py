"""An emulated fabric with one linkpass daemon per host: what the demo, the benchmarks and
the integration tests all need.

    cl = Cluster(hosts=2, rails=2, name="lpdemo", hold_down_ms=2000)
    cl.up()                 # fabric.up(...)
    cl.start_all()          # one `linkpass run` per host namespace; waits until each is ready
    cl.ask(0, "history")    # control-socket request (blocking, any reply size)
    cl.close()              # SIGTERM (then SIGKILL) the daemons, fabric.down(...)
"""

from __future__ import annotations

import json
import os
import signal as _signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from linkpass.lab.fabric import fabric as fab


class ClusterError(Exception):
    """A daemon would not start or answer; the message names the host and its log file."""


def ask_socket(path: str, cmd: str = "status", timeout: float = 3.0) -> dict:
    """One request on a daemon's control socket (blocking; replies of any size).

    Raises:
        OSError: nothing listens at ``path`` (or it timed out).
        ValueError: the reply is not JSON.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
        buf = bytearray()
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


class Cluster:
    """A fabric ``name`` (hosts x rails) and the linkpass daemons running in it.

    Args:
        hosts, rails: fabric shape.
        name: fabric name.
        hold_down_ms: hold-down written into the daemons' configs.
        mode: ``host-ip`` or ``per-rail-ip``.
        workdir: where daemon logs go (a fresh temporary directory by default).
        daemon_argv: what follows the Python interpreter before ``run --config FILE``
            (default ``-m linkpass.cli``; a diagnostic wrapper can go here).
    """

    def __init__(self, hosts: int, rails: int, name: str, hold_down_ms: int = 2000, mode: str = "host-ip",
                 workdir: Path | None = None, daemon_argv: list[str] | None = None):
        self.hosts, self.rails, self.name = hosts, rails, name
        self.hold_down_ms, self.mode = hold_down_ms, mode
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"linkpass-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.daemon_argv = daemon_argv or ["-m", "linkpass.cli"]
        self.desc: dict | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        self.queries = 0

    # ---------------------------------------------------------------- fabric

    def up(self) -> dict:
        """Build the fabric (FabricError propagates)."""
        self.desc = fab.up(self.hosts, self.rails, self.name, hold_down_ms=self.hold_down_ms, mode=self.mode)
        return self.desc

    def host(self, i: int) -> dict:
        return self.desc["hosts"][i]

    def ns(self, i: int) -> str:
        return self.host(i)["netns"]

    # ---------------------------------------------------------------- daemons

    def start(self, i: int, config: str | None = None, wait: bool = True, ready_timeout: float = 20.0) -> subprocess.Popen:
        """Start host i's daemon (optionally with another config); wait until ready."""
        n = sum(1 for p in self.workdir.glob(f"daemon-h{i}*.log"))
        log = self.workdir / (f"daemon-h{i}.log" if n == 0 else f"daemon-h{i}-{n}.log")
        self.logs[i] = log
        with open(log, "w") as logf:
            self.procs[i] = subprocess.Popen(
                fab.netns_exec(self.name, i) + [sys.executable, *self.daemon_argv, "run", "--config", config or self.host(i)["config"]],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready(i, ready_timeout)
        return self.procs[i]

    def start_all(self, ready_timeout: float = 20.0) -> list[dict]:
        """Start every host's daemon, then wait for all; returns their first ready statuses."""
        for h in self.desc["hosts"]:
            self.start(h["index"], wait=False)
        deadline = time.monotonic() + ready_timeout
        return [self.wait_ready(h["index"], max(0.1, deadline - time.monotonic())) for h in self.desc["hosts"]]

    def try_status(self, i: int) -> dict | None:
        try:
            return self.ask(i)
        except (OSError, ValueError):
            return None

    def wait_ready(self, i: int, timeout: float = 20.0) -> dict:
        """Wait until host i's daemon has applied a plan and heard from every peer.

        Raises:
            ClusterError: the daemon exited, or was not ready in ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            p = self.procs[i]
            if p.poll() is not None:
                tail = self.logs[i].read_text(errors="replace")[-1500:]
                raise ClusterError(f"daemon on h{i} exited with status {p.returncode}; log {self.logs[i]}:\n{tail}")
            st = self.try_status(i)
            if st and st["applied_generation"] >= 1 and all(q["usable_rails"] is not None for q in st["peers"]):
                return st
            if time.monotonic() > deadline:
                raise ClusterError(f"daemon on h{i} not ready in {timeout:.0f} s; see {self.logs[i]}")
            time.sleep(0.05)

    def ask(self, i: int, cmd: str = "status", timeout: float = 3.0) -> dict:
        """A control-socket request to host i's daemon (see :func:`ask_socket`)."""
        self.queries += 1
        return ask_socket(self.host(i)["control_socket"], cmd, timeout)

    def history(self, i: int) -> list[dict]:
        return self.ask(i, "history", timeout=10)["history"]

    def signal(self, i: int, sig: int) -> None:
        os.killpg(self.procs[i].pid, sig)

    def stop(self, i: int, sig: int = _signal.SIGTERM, timeout: float = 10.0) -> int:
        """Send ``sig`` to host i's daemon and return its exit status (negative = signal)."""
        self.signal(i, sig)
        return self.procs[i].wait(timeout)

    def close(self) -> None:
        """Stop every daemon (SIGTERM, SIGKILL after 5 s) and remove the fabric; never raises."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, _signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, _signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        try:
            fab.down(self.name)
        except fab.FabricError as e:
            print(f"warning: fabric teardown: {e}", file=sys.stderr)
