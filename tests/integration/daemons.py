"""Helpers for integration tests: a fabric with real daemons in its host namespaces."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import time
from pathlib import Path

from linkpass.lab.fabric.cluster import Cluster as _Cluster

PROTO = 201


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def veth_pair(a: str, b: str, third_octet: int) -> None:
    """Namespaces ``a`` and ``b`` joined by two veth rails ``r0``/``r1`` (198.18.N.1 in ``a``,
    198.18.N.2 in ``b``, N = ``third_octet`` + k), and 198.19.N.1/32 on ``a``'s loopback."""
    sh("ip", "netns", "add", a)
    sh("ip", "netns", "add", b)
    for k in (0, 1):
        sh("ip", "link", "add", f"r{k}", "netns", a, "type", "veth", "peer", "name", f"r{k}", "netns", b)
        sh("ip", "-n", a, "addr", "add", f"198.18.{third_octet + k}.1/24", "dev", f"r{k}")
        sh("ip", "-n", b, "addr", "add", f"198.18.{third_octet + k}.2/24", "dev", f"r{k}")
        for ns in (a, b):
            sh("ip", "-n", ns, "link", "set", f"r{k}", "up")
    sh("ip", "-n", a, "addr", "add", f"198.19.{third_octet}.1/32", "dev", "lo")
    sh("ip", "-n", a, "link", "set", "lo", "up")


def wait_for(pred, timeout: float = 5.0, what: str = "condition"):
    """Poll ``pred`` until it returns a truthy value; raise AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last value {last!r})")


class Cluster(_Cluster):
    """The shared fabric+daemons cluster, built at once under a random name, plus route helpers."""

    def __init__(self, hosts: int = 2, rails: int = 2, hold_down_ms: int = 300, mode: str = "host-ip", tmp: Path | None = None):
        super().__init__(hosts, rails, "d" + secrets.token_hex(4), hold_down_ms, mode, workdir=tmp)
        self.up()

    def status(self, i: int, cmd: str = "status") -> dict:
        return self.ask(i, cmd)

    def routes(self, i: int, proto: int | None = PROTO) -> list[dict]:
        argv = ["ip", "-n", self.ns(i), "-j", "route", "show"]
        if proto is not None:
            argv += ["proto", str(proto)]
        return json.loads(sh(*argv).stdout or "[]")

    def route_rails(self, i: int, peer: int) -> list[int]:
        """Rail ids used by host i's route to peer's host IP (sorted), [] if none."""
        dst = self.host(peer)["host_ip"]
        rs = [r for r in self.routes(i) if r.get("dst") in (dst, f"{dst}/32")]
        if not rs:
            return []
        assert len(rs) == 1, f"duplicate routes to {dst}: {rs}"
        r = rs[0]
        devs = [nh["dev"] for nh in r["nexthops"]] if "nexthops" in r else [r["dev"]]
        return sorted(int(d.removeprefix("rail")) for d in devs)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> int:
        return self.stop(i, sig)
