"""What an emulated fabric is: its names and limits, the description (layout and addresses)
:func:`linkpass.lab.fabric.fabric.up` records, and each host's daemon config.

Pure apart from :func:`_check_root` (the effective uid): no kernel change, no file written.
The layout and addresses are described in :mod:`linkpass.lab.fabric.fabric`.
"""

from __future__ import annotations

import os
import re

from linkpass.lab.fabric.errors import FabricError
from linkpass.lab.fabric.gpus import gpu_map

SCHEMA = "linkpass.lab.fabric/v1"
STATE_ROOT = "/run/linkpass/fabric"
MODES = ("host-ip", "per-rail-ip")
MAX_HOSTS = 250
MAX_RAILS = 16
HOLD_DOWN_MAX_MS = 3_600_000
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")


def _check_root() -> None:
    if os.geteuid() != 0:
        raise FabricError("must run as root (the emulated fabric needs CAP_NET_ADMIN)")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise FabricError(
            f"bad fabric name {name!r}: use 1-12 characters, a lowercase letter then lowercase letters or digits"
        )
    return name


def _check_int(what: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FabricError(f"bad {what} {value!r}: must be an integer {lo}..{hi}")
    return value


def _check_host(desc: dict, host: object) -> int:
    n = desc["hosts_count"]
    if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < n:
        raise FabricError(f"unknown host {host!r} in fabric {desc['name']}: hosts are 0..{n - 1}")
    return host


def _check_rail(desc: dict, rail: object) -> int:
    n = desc["rails_count"]
    if isinstance(rail, bool) or not isinstance(rail, int) or not 0 <= rail < n:
        raise FabricError(f"unknown rail {rail!r} in fabric {desc['name']}: rails are 0..{n - 1}")
    return rail


def _plan(name: str, hosts: int, rails: int, mode: str, hold_down_ms: int) -> dict:
    sdir = os.path.join(STATE_ROOT, name)
    fab = f"{name}-fab"
    host_list = []
    for i in range(hosts):
        host_list.append(
            {
                "index": i,
                "name": f"h{i}",
                "netns": f"{name}-h{i}",
                "host_ip": f"198.19.0.{i + 1}",
                "host_ip_prefixlen": 32,
                "host_netdev": "lp0",
                "config": os.path.join(sdir, f"h{i}.toml"),
                "control_socket": os.path.join(sdir, f"h{i}.sock"),
                "rails": [
                    {
                        "rail": k,
                        "netdev": f"rail{k}",
                        "address": f"198.18.{k}.{i + 1}",
                        "prefixlen": 24,
                        "switch_port": f"h{i}r{k}",
                    }
                    for k in range(rails)
                ],
            }
        )
    return {
        "schema": SCHEMA,
        "name": name,
        "status": "building",
        "hosts_count": hosts,
        "rails_count": rails,
        "mode": mode,
        "hold_down_ms": hold_down_ms,
        "fabric_netns": fab,
        "netns": [fab] + [h["netns"] for h in host_list],
        "state_dir": sdir,
        "notice_key_file": os.path.join(sdir, "notice.key"),
        "rails": [{"id": k, "bridge": f"br{k}", "subnet": f"198.18.{k}.0/24"} for k in range(rails)],
        "hosts": host_list,
        "faults": [],
    }


def _host_config(desc: dict, i: int) -> dict:
    h = desc["hosts"][i]
    return {
        "daemon": {
            "host": h["name"],
            "mode": desc["mode"],
            "host_ip": h["host_ip"],
            "control_socket": h["control_socket"],
            "notice_key_file": desc["notice_key_file"],
            "hold_down_ms": desc["hold_down_ms"],
        },
        "rails": [{"id": r["rail"], "netdev": r["netdev"], "address": r["address"]} for r in h["rails"]],
        # one NCCL env file per emulated host (the default /run/linkpass/nccl.env would be shared)
        "nccl": {"env_file": os.path.join(os.path.dirname(h["control_socket"]), f"h{i}.nccl.env")},
        # the emulated hosts share the machine's kernel log: each follows a file of its own
        # instead (a kernel-log line written there is that host's evidence), state kept beside it
        "device": {"kmsg_path": os.path.join(os.path.dirname(h["control_socket"]), f"h{i}.kmsg"),
                   "state_dir": os.path.dirname(h["control_socket"]),
                   # its emulated GPUs (no NVML here): PCI bus id -> index, so the daemon can tell
                   # which hook client a kernel-log Xid concerns (linkpass.lab.fabric.gpus)
                   "gpus": gpu_map()},
        # its hardware counters: a sysfs tree of its own (linkpass.lab.fabric.counters), polled at
        # the default 1 s (faster polls cost the probes CPU on a loaded fabric of many daemons)
        "risk": {"sysfs_root": os.path.join(os.path.dirname(h["control_socket"]), f"h{i}.sys"), "nvml": False},
        "peers": [
            {
                "name": p["name"],
                "host_ip": p["host_ip"],
                "rail_ips": {str(r["rail"]): r["address"] for r in p["rails"]},
            }
            for p in desc["hosts"]
            if p["index"] != i
        ],
    }
