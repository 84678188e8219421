"""What every ``linkpass demo`` scenario shares: its error, the cut modes, and reading the
rails' byte counters and a daemon's status or history."""

from __future__ import annotations

import json
import subprocess

from linkpass.lab.fabric.cluster import ask_socket


class DemoError(Exception):
    """The demo could not run; the message says why.  ``exit_code`` is 2 for bad input
    (arguments, not root, name in use) and 1 for a failure while running."""

    def __init__(self, msg: str, exit_code: int = 1):
        super().__init__(msg)
        self.exit_code = exit_code


#: Cut modes the demo can show: link-down faults (seen through netlink) and a blackhole (carrier
#: up, seen by the per-rail probes about 30 ms later).  Random loss and flaps are not a single
#: cut with a clear before and after; `linkpass bench detect` and bench/soak.py measure them.
DEMO_MODES = ("carrier-loss", "admin-down", "blackhole")


def _rail_bytes(ns: str, netdev: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", netdev], capture_output=True, text=True, check=True).stdout
    st = json.loads(out)[0]["stats64"]
    return int(st["rx"]["bytes"]) + int(st["tx"]["bytes"])


def _counters(desc: dict, host: int) -> dict[int, int]:
    h = desc["hosts"][host]
    return {r["rail"]: _rail_bytes(h["netns"], r["netdev"]) for r in h["rails"]}


def _status(sock: str, cmd: str = "status") -> dict:
    return ask_socket(sock, cmd, timeout=10)
