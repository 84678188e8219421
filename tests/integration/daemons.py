"""Helpers for integration tests: a fabric with real daemons in its host namespaces."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from linkpass import fabric as fab
from linkpass.daemon import query

PROTO = 201


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


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


class Cluster:
    """A fabric plus one linkpass daemon per host."""

    def __init__(self, hosts: int = 2, rails: int = 2, hold_down_ms: int = 300, mode: str = "host-ip", tmp: Path | None = None):
        self.name = "d" + secrets.token_hex(4)
        self.desc = fab.up(hosts, rails, self.name, hold_down_ms=hold_down_ms, mode=mode)
        self.procs: dict[int, subprocess.Popen] = {}
        self.tmp = tmp or Path(self.desc["state_dir"])
        self.logs: dict[int, Path] = {}

    def host(self, i: int) -> dict:
        return self.desc["hosts"][i]

    def ns(self, i: int) -> str:
        return self.host(i)["netns"]

    def start(self, i: int, config: str | None = None, wait: bool = True) -> subprocess.Popen:
        log = self.tmp / f"daemon-h{i}-{len(self.logs)}.log"
        self.logs[i] = log
        p = subprocess.Popen(fab.netns_exec(self.name, i) + [sys.executable, "-m", "linkpass.cli", "run", "--config", config or self.host(i)["config"]],
                             stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[i] = p
        if wait:
            self.wait_ready(i)
        return p

    def start_all(self) -> None:
        for h in self.desc["hosts"]:
            self.start(h["index"], wait=False)
        for h in self.desc["hosts"]:
            self.wait_ready(h["index"])

    def status(self, i: int, cmd: str = "status") -> dict:
        return asyncio.run(query(self.host(i)["control_socket"], cmd, timeout=3))

    def history(self, i: int) -> list[dict]:
        return self.status(i, "history")["history"]

    def wait_ready(self, i: int, timeout: float = 15) -> dict:
        def ready():
            if self.procs[i].poll() is not None:
                raise AssertionError(f"daemon h{i} exited with {self.procs[i].returncode}: {self.logs[i].read_text()[-2000:]}")
            try:
                st = self.status(i)
            except (OSError, asyncio.TimeoutError, json.JSONDecodeError):
                return None
            return st if st["applied_generation"] >= 1 and all(p["usable_rails"] is not None for p in st["peers"]) else None
        return wait_for(ready, timeout, f"daemon h{i} ready")

    def routes(self, i: int, dst: str | None = None, proto: int | None = PROTO) -> list[dict]:
        argv = ["ip", "-n", self.ns(i), "-j", "route", "show"]
        if proto is not None:
            argv += ["proto", str(proto)]
        if dst:
            argv += ["match", dst] if False else [dst]
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
        p = self.procs[i]
        os.killpg(p.pid, sig)
        return p.wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        fab.down(self.name)
