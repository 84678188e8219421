"""The emulated multi-host, multi-rail fabric behind ``linkpass fabric``.

Layout (``name`` defaults to ``lp``)::

    {name}-fab          fabric namespace: one Linux bridge per rail, br0 .. br{R-1}
    {name}-h{i}         host namespaces, i = 0 .. H-1
    rail{k} <-> h{i}r{k}  one veth pair per host per rail: ``rail{k}`` in the host namespace,
                        ``h{i}r{k}`` in the fabric namespace, enslaved to ``br{k}``
    lp0 (+ lp0-peer)    the host-IP interface inside each host namespace (a veth pair whose
                        two ends both stay in the host namespace; this kernel has no dummy module)

Addresses come from the benchmarking range 198.18.0.0/15: host i has 198.18.k.(i+1)/24 on rail k
and the host IP 198.19.0.(i+1)/32 on ``lp0``.  No routes between host IPs are installed: that is
the daemon's job.

Faults (see :func:`cut`) act on one host-rail link: ``admin-down`` (host side down),
``carrier-loss`` (switch side down, host side loses carrier), ``blackhole`` (nftables drops every
frame to and from the switch port; carrier stays up), ``loss:PCT`` (nftables ``numgen random``
drops PCT % of frames in each direction) and ``flap:PERIOD_MS:COUNT`` (a detached helper toggles
the switch side).

Everything lives under the state directory ``/run/linkpass/fabric/{name}/``: ``fabric.json`` (the
description returned by :func:`up` and :func:`load`), the per-host daemon configs ``h{i}.toml``,
the shared ``notice.key`` and the flap helpers' logs.  The state file names every namespace the
fabric owns and is written before any of them is created, so :func:`down` can clean up after a
crash half-way through :func:`up`; nothing that is not recorded there is ever touched.

All mutating calls need root and are serialised by an ``flock`` on ``/run/linkpass/fabric``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from linkpass.lab.fabric.gpus import gpu_map
from linkpass.lab.fabric._ns import (
    NsError,
    get_flags,
    ip_batch,
    netns_exists,
    nft,
    ns_socket,
    set_up,
    write_sysctls,
)

SCHEMA = "linkpass.lab.fabric/v1"
STATE_ROOT = "/run/linkpass/fabric"
MODES = ("host-ip", "per-rail-ip")
MAX_HOSTS = 250
MAX_RAILS = 16
HOLD_DOWN_MAX_MS = 3_600_000
FLAP_PERIOD_MS_RANGE = (10, 3_600_000)
FLAP_COUNT_RANGE = (1, 1_000_000)
FAULT_SYNTAX = (
    "admin-down, carrier-loss, blackhole, loss:PCT (PCT integer 1..100) or "
    f"flap:PERIOD_MS:COUNT (PERIOD_MS integer {FLAP_PERIOD_MS_RANGE[0]}..{FLAP_PERIOD_MS_RANGE[1]}, "
    f"COUNT integer {FLAP_COUNT_RANGE[0]}..{FLAP_COUNT_RANGE[1]})"
)
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_HELPER_MODULE = "linkpass.lab.fabric.flap"
_FLAP_READY_TIMEOUT_S = 5.0
_HELPER_STOP_TIMEOUT_S = 2.0

# Popen objects of flap helpers started by this process (so they can be reaped, never zombies).
_HELPERS: dict[int, subprocess.Popen] = {}


class FabricError(Exception):
    """Bad input or a refused request (not root, unknown host, name in use, ...).

    ``str(err)`` is one line.  ``exit_code`` is what the CLI exits with (2).
    """

    exit_code = 2


class FabricKernelError(FabricError):
    """A kernel or tool operation failed (``ip``, ``nft``, setns, an ioctl).  CLI exit code 1."""

    exit_code = 1


# --------------------------------------------------------------------------- validation


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


def _dec(text: str) -> int | None:
    """A plain decimal integer (digits only, no sign or spaces), else None."""
    return int(text) if text.isascii() and text.isdigit() else None


def parse_fault_mode(mode: object) -> tuple[str, tuple[int, ...], str]:
    """Parse a fault mode string.

    Returns:
        ``(kind, params, normalized)``, e.g. ``("loss", (50,), "loss:50")`` or
        ``("flap", (200, 3), "flap:200:3")``.

    Raises:
        FabricError: naming the mode and the valid syntax.
    """
    if not isinstance(mode, str):
        raise FabricError(f"bad fault mode {mode!r}: expected {FAULT_SYNTAX}")
    if mode in ("admin-down", "carrier-loss", "blackhole"):
        return mode, (), mode
    kind, _, rest = mode.partition(":")
    if kind == "loss":
        pct = _dec(rest)
        if pct is None or not 1 <= pct <= 100:
            raise FabricError(f"bad fault mode {mode!r}: expected loss:PCT with PCT an integer 1..100")
        return "loss", (pct,), f"loss:{pct}"
    if kind == "flap":
        parts = rest.split(":")
        if len(parts) != 2:
            raise FabricError(f"bad fault mode {mode!r}: expected flap:PERIOD_MS:COUNT")
        period, count = _dec(parts[0]), _dec(parts[1])
        (plo, phi), (clo, chi) = FLAP_PERIOD_MS_RANGE, FLAP_COUNT_RANGE
        if period is None or not plo <= period <= phi:
            raise FabricError(f"bad fault mode {mode!r}: PERIOD_MS must be an integer {plo}..{phi} (flap:PERIOD_MS:COUNT)")
        if count is None or not clo <= count <= chi:
            raise FabricError(f"bad fault mode {mode!r}: COUNT must be an integer {clo}..{chi} (flap:PERIOD_MS:COUNT)")
        return "flap", (period, count), f"flap:{period}:{count}"
    raise FabricError(f"bad fault mode {mode!r}: expected {FAULT_SYNTAX}")


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


# --------------------------------------------------------------------------- state


def state_dir(name: str) -> str:
    """The state directory of fabric ``name``."""
    return os.path.join(STATE_ROOT, _check_name(name))


def _state_file(name: str) -> str:
    return os.path.join(STATE_ROOT, name, "fabric.json")


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    os.makedirs(STATE_ROOT, mode=0o755, exist_ok=True)
    fd = os.open(STATE_ROOT, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_state(name: str) -> dict | None:
    path = _state_file(name)
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise FabricError(f"{path}: unreadable fabric state ({e})") from None
    if not isinstance(desc, dict) or desc.get("schema") != SCHEMA:
        raise FabricError(f"{path}: not a {SCHEMA} fabric state file")
    return desc


def _write_state(desc: dict) -> None:
    path = _state_file(desc["name"])
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(desc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _require(name: str) -> dict:
    desc = _read_state(name)
    if desc is None:
        raise FabricError(f"no fabric named {name} (create it with `linkpass fabric up --name {name} --hosts H --rails R`)")
    return desc


def _require_ready(name: str) -> dict:
    desc = _require(name)
    if desc.get("status") != "ready":
        raise FabricError(
            f"fabric {name} is incomplete (an earlier `up` did not finish); run `linkpass fabric down --name {name}`"
        )
    return desc


# --------------------------------------------------------------------------- plan


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


def _write_config(desc: dict, i: int) -> None:
    """Render host ``i``'s daemon config with tomli_w, validate it with parse_config, write it."""
    import tomli_w

    from linkpass.config import ConfigError, parse_config

    path = desc["hosts"][i]["config"]
    text = tomli_w.dumps(_host_config(desc, i))
    try:
        parse_config(text, path)
    except ConfigError as e:
        raise FabricKernelError(f"generated daemon config is invalid (a linkpass bug): {e}") from None
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_configs(desc: dict) -> None:
    """Write every host's config (O(hosts^2) work: about 12 s for 250 hosts x 16 rails)."""
    for i in range(len(desc["hosts"])):
        _write_config(desc, i)


def _write_notice_key(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_bytes(32).hex() + "\n")


# --------------------------------------------------------------------------- build / teardown

_HOST_SYSCTLS = {
    "net.ipv4.conf.all.rp_filter": "2",
    "net.ipv4.conf.default.rp_filter": "2",
    "net.ipv4.conf.all.arp_ignore": "1",
    "net.ipv4.conf.default.arp_ignore": "1",
    "net.ipv4.conf.all.arp_announce": "2",
    "net.ipv4.conf.default.arp_announce": "2",
}
_IFACE_SYSCTLS = {"rp_filter": "2", "arp_ignore": "1", "arp_announce": "2"}


def _ipv6() -> bool:
    return os.path.isdir("/proc/sys/net/ipv6")


def _no_ipv6(devs: tuple[str, ...] | list[str] = ("all", "default")) -> dict[str, str]:
    return {f"net.ipv6.conf.{d}.disable_ipv6": "1" for d in devs} if _ipv6() else {}


def _create_netns(names: list[str]) -> None:
    """Create the network namespaces (one ``ip -batch``)."""
    ip_batch([f"netns add {ns}" for ns in names])


def _build(desc: dict) -> None:
    fab = desc["fabric_netns"]
    os.makedirs(desc["state_dir"], mode=0o755, exist_ok=True)
    _write_notice_key(desc["notice_key_file"])
    for i in range(len(desc["hosts"])):  # each emulated host's kernel log (see _host_config)
        open(os.path.join(desc["state_dir"], f"h{i}.kmsg"), "a").close()
    _create_netns(desc["netns"])
    # Defaults first, so every interface created afterwards inherits them.
    write_sysctls(fab, _no_ipv6())
    for h in desc["hosts"]:
        write_sysctls(h["netns"], {**_no_ipv6(), **_HOST_SYSCTLS})
    lines = ["link set dev lo up"]
    for r in desc["rails"]:
        lines += [
            f"link add name {r['bridge']} type bridge stp_state 0 forward_delay 0 mcast_snooping 0",
            f"link set dev {r['bridge']} up",
        ]
    for h in desc["hosts"]:
        for hr in h["rails"]:
            port, bridge = hr["switch_port"], desc["rails"][hr["rail"]]["bridge"]
            lines += [
                f"link add name {port} type veth peer name {hr['netdev']} netns {h['netns']}",
                f"link set dev {port} master {bridge}",
                f"link set dev {port} up",
            ]
    ip_batch(lines, fab)
    for h in desc["hosts"]:
        ns, dev = h["netns"], h["host_netdev"]
        lines = [
            "link set dev lo up",
            f"link add name {dev} type veth peer name {dev}-peer",
            f"addr add {h['host_ip']}/{h['host_ip_prefixlen']} dev {dev}",
            f"link set dev {dev} up",
            f"link set dev {dev}-peer up",
        ]
        for hr in h["rails"]:
            lines += [
                f"addr add {hr['address']}/{hr['prefixlen']} dev {hr['netdev']}",
                f"link set dev {hr['netdev']} up",
            ]
        ip_batch(lines, ns)
        devs = [dev, f"{dev}-peer"] + [hr["netdev"] for hr in h["rails"]]
        per_dev = {f"net.ipv4.conf.{d}.{k}": v for d in devs for k, v in _IFACE_SYSCTLS.items()}
        write_sysctls(ns, {**per_dev, **_no_ipv6(devs)})


def _netns_pids(ns: str) -> list[int]:
    try:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in out.split() if x.isdigit() and int(x) != os.getpid()]


def _stop_processes(namespaces: list[str], grace_s: float = 3.0) -> int:
    """SIGTERM every process running in ``namespaces`` (daemons, trainers started with
    ``ip netns exec``), SIGKILL what is left after ``grace_s``.  Returns how many there were.

    A deleted namespace lives on, unnamed, while processes still run in it: they would keep
    logging errors and holding ports with nothing left to manage.
    """
    pids = sorted({p for ns in namespaces for p in _netns_pids(ns)})
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if os.path.exists(f"/proc/{p}")]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _teardown(desc: dict) -> int:
    """Kill recorded flap helpers and processes running in the fabric's namespaces, delete
    recorded namespaces that exist, remove the state dir.  Returns the processes stopped."""
    for f in desc.get("faults", []):
        if f.get("pid"):
            _stop_helper(f["pid"], _port_name(f["host"], f["rail"]))
    existing = [ns for ns in desc.get("netns", []) if netns_exists(ns)]
    stopped = _stop_processes(existing)
    if existing:
        try:
            ip_batch([f"netns del {ns}" for ns in existing], force=True)
        except NsError as e:
            left = [ns for ns in existing if netns_exists(ns)]
            if left:
                raise FabricKernelError(f"could not delete namespace(s) {', '.join(left)}: {e}") from None
    shutil.rmtree(os.path.join(STATE_ROOT, desc["name"]), ignore_errors=True)
    return stopped


# --------------------------------------------------------------------------- public API


def up(
    hosts: int,
    rails: int,
    name: str = "lp",
    *,
    hold_down_ms: int = 2000,
    mode: str = "host-ip",
) -> dict:
    """Build the fabric (idempotent) and return its description (:func:`up_report`'s first half)."""
    return up_report(hosts, rails, name, hold_down_ms=hold_down_ms, mode=mode)[0]


def up_report(
    hosts: int,
    rails: int,
    name: str = "lp",
    *,
    hold_down_ms: int = 2000,
    mode: str = "host-ip",
) -> tuple[dict, bool]:
    """Build the fabric (idempotent); return its description and whether it was already up.

    Args:
        hosts: number of host namespaces, 1..250.
        rails: number of rails (bridges), 1..16.
        name: fabric name, ``^[a-z][a-z0-9]{0,11}$``; prefixes every namespace.
        hold_down_ms: written to each host's daemon config.
        mode: ``host-ip`` or ``per-rail-ip``, written to each host's daemon config.

    Returns:
        ``(desc, existed)``: the description dict (also in ``fabric.json``), schema
        ``linkpass.lab.fabric/v1``, and True when a ready fabric was found and nothing was built.

    If a complete fabric of that name and shape already exists, its description is returned and
    nothing in the kernel changes (if ``mode`` or ``hold_down_ms`` differ, only the daemon configs
    and the description are rewritten).  A recorded but incomplete fabric of the same shape (a
    crash during an earlier ``up``, a namespace deleted by hand) is torn down and rebuilt.

    Raises:
        FabricError: not root, bad arguments, a fabric of that name with another shape exists,
            or a namespace it would create exists and is not recorded as this fabric's.
        FabricKernelError: a kernel operation failed (everything created is rolled back).
    """
    _check_root()
    _check_name(name)
    _check_int("hosts", hosts, 1, MAX_HOSTS)
    _check_int("rails", rails, 1, MAX_RAILS)
    _check_int("hold_down_ms", hold_down_ms, 0, HOLD_DOWN_MAX_MS)
    if mode not in MODES:
        raise FabricError(f"bad mode {mode!r}: must be one of {', '.join(MODES)}")
    with _lock():
        existing = _read_state(name)
        if existing is not None:
            if (existing["hosts_count"], existing["rails_count"]) != (hosts, rails):
                raise FabricError(
                    f"fabric {name} exists with {existing['hosts_count']} hosts x {existing['rails_count']} rails, "
                    f"not {hosts} x {rails}; run `linkpass fabric down --name {name}` first"
                )
            if existing.get("status") == "ready" and all(netns_exists(ns) for ns in existing["netns"]):
                _prune_faults(existing)
                if (existing.get("mode"), existing.get("hold_down_ms")) != (mode, hold_down_ms):
                    existing["configs_rewritten"] = f"mode {existing.get('mode')} -> {mode}, hold_down_ms {existing.get('hold_down_ms')} -> {hold_down_ms}"
                    existing["mode"], existing["hold_down_ms"] = mode, hold_down_ms
                    _write_configs(existing)
                else:
                    existing.pop("configs_rewritten", None)
                _write_state(existing)
                return existing, True
            _teardown(existing)
        desc = _plan(name, hosts, rails, mode, hold_down_ms)
        for ns in desc["netns"]:
            if netns_exists(ns):
                raise FabricError(f"name in use: network namespace {ns} exists and was not made by linkpass fabric")
        sdir = desc["state_dir"]
        if os.path.isdir(sdir):  # left by a crash before fabric.json was written: only our files
            shutil.rmtree(sdir)
        os.makedirs(sdir, mode=0o755)
        _write_state(desc)  # records the namespaces before any exists
        try:
            _build(desc)
            _write_configs(desc)
        except (NsError, OSError, FabricError) as e:
            try:
                _teardown(desc)
                note = "rolled back"
            except FabricError as e2:
                note = f"rollback incomplete: {e2}"
            if isinstance(e, FabricError):
                raise type(e)(f"fabric up failed ({note}): {e}") from None
            raise FabricKernelError(f"fabric up failed ({note}): {e}") from None
        desc["status"] = "ready"
        _write_state(desc)
        return desc, False


def down(name: str = "lp") -> bool:
    """Remove fabric ``name``: its flap helpers, its namespaces and its state directory.

    Works on a half-built fabric too (only recorded namespaces that exist are deleted); nothing
    not recorded in the state file is touched.  Processes still running inside the fabric's
    namespaces (daemons or trainers started with ``ip netns exec``) are stopped first
    (SIGTERM, then SIGKILL after 3 s); ``down_report(name)`` tells how many.

    Returns:
        True if something was removed, False if no fabric of that name exists.
    """
    _check_root()
    _check_name(name)
    with _lock():
        sdir = os.path.join(STATE_ROOT, name)
        try:
            desc = _read_state(name)
        except FabricError:
            desc = None  # unreadable: we cannot know its namespaces; remove only our directory
        if desc is None:
            if os.path.isdir(sdir):
                shutil.rmtree(sdir)
                return True
            return False
        _LAST_DOWN[name] = _teardown(desc)
        return True


_LAST_DOWN: dict[str, int] = {}


def down_report(name: str) -> int:
    """Processes the last ``down(name)`` in this process stopped inside the fabric."""
    return _LAST_DOWN.get(name, 0)


def load(name: str = "lp") -> dict:
    """The description of fabric ``name`` (finished flaps are left out of ``faults``).

    Raises:
        FabricError: no such fabric, or its state file is unreadable.
    """
    _check_name(name)
    desc = _require(name)
    _prune_faults(desc)
    return desc


def netns_exec(name: str, host: int) -> list[str]:
    """The argv prefix that runs a command inside host ``host``: ``["ip", "netns", "exec", ns]``."""
    desc = load(name)
    _check_host(desc, host)
    return ["ip", "netns", "exec", desc["hosts"][host]["netns"]]


def cut(name: str, host: int, rail: int, mode: str) -> dict:
    """Break the link of host ``host`` on rail ``rail``.

    Modes: ``admin-down``, ``carrier-loss``, ``blackhole``, ``loss:PCT`` (1..100, dropped in each
    direction, so a ping round trip is lost with probability 1-(1-PCT/100)^2) and
    ``flap:PERIOD_MS:COUNT``.  Returns once the kernel change is made (for a flap: once the helper
    has set the port down the first time).  Cutting with the mode already active is a no-op;
    cutting with another mode heals the link first.

    Returns:
        ``{"name", "action": "cut", "host", "rail", "mode", "changed", "replaced",
        "t_issued_ns", "t_done_ns", "pid"}``: ``t_issued_ns`` is ``time.monotonic_ns()`` taken
        right before the kernel change (None when nothing changed), ``t_done_ns`` right after it
        returned; for ``blackhole``/``loss`` the interval includes starting ``nft`` (a few ms).
        ``pid`` is the flap helper's pid.  ``replaced`` is the mode healed first, if any.

    Raises:
        FabricError: bad name, no such fabric, unknown host/rail, bad mode.
        FabricKernelError: the kernel change failed.
    """
    _check_root()
    _check_name(name)
    with _lock():
        desc = _require_ready(name)
        _check_host(desc, host)
        _check_rail(desc, rail)
        kind, params, norm = parse_fault_mode(mode)
        _prune_faults(desc)
        result = {"name": name, "action": "cut", "host": host, "rail": rail, "mode": norm, "changed": False,
                  "replaced": None, "t_issued_ns": None, "t_done_ns": None, "pid": None}
        old = _find_fault(desc, host, rail)
        if old is not None and old["mode"] == norm:
            result["pid"] = old.get("pid")
            return result
        try:
            if old is not None:
                _heal_one(desc, old)
                desc["faults"].remove(old)
                result["replaced"] = old["mode"]
                result["changed"] = True
            t0, t1, pid = _apply(desc, host, rail, kind, params)
        finally:
            _write_state(desc)
        desc["faults"].append({"host": host, "rail": rail, "mode": norm, "pid": pid, "t_issued_ns": t0})
        desc["faults"].sort(key=lambda f: (f["host"], f["rail"]))
        _write_state(desc)
        result.update(changed=True, t_issued_ns=t0, t_done_ns=t1, pid=pid)
        return result


def heal(name: str = "lp", host: int | None = None, rail: int | None = None) -> dict:
    """Undo faults: on one link, on all rails of a host, on one rail of all hosts, or all (None).

    Healing a healthy link is a no-op.

    Returns:
        ``{"name", "action": "heal", "host", "rail", "changed", "t_issued_ns", "t_done_ns",
        "healed": [{"host", "rail", "mode", "t_issued_ns", "t_done_ns"}, ...]}`` where the top
        level times are those of the first and last kernel change (None when nothing changed).
    """
    _check_root()
    _check_name(name)
    with _lock():
        desc = _require_ready(name)
        if host is not None:
            _check_host(desc, host)
        if rail is not None:
            _check_rail(desc, rail)
        _prune_faults(desc)
        todo = [f for f in desc["faults"]
                if (host is None or f["host"] == host) and (rail is None or f["rail"] == rail)]
        healed = []
        try:
            for f in todo:
                t0, t1 = _heal_one(desc, f)
                desc["faults"].remove(f)
                healed.append({"host": f["host"], "rail": f["rail"], "mode": f["mode"],
                               "t_issued_ns": t0, "t_done_ns": t1})
        finally:
            _write_state(desc)
        return {
            "name": name, "action": "heal", "host": host, "rail": rail, "changed": bool(healed),
            "t_issued_ns": healed[0]["t_issued_ns"] if healed else None,
            "t_done_ns": healed[-1]["t_done_ns"] if healed else None,
            "healed": healed,
        }


def link_states(name: str = "lp") -> list[dict]:
    """Live kernel state of every host-rail link (for ``linkpass fabric show``).

    Returns one dict per link: ``{"host", "rail", "host_up", "host_running", "switch_up"}`` where
    ``host_running`` is IFF_RUNNING of the host side (operstate up: carrier present).
    """
    desc = _require(name)
    fab_sock = ns_socket(desc["fabric_netns"])
    out = []
    try:
        for h in desc["hosts"]:
            sock = ns_socket(h["netns"])
            try:
                for hr in h["rails"]:
                    hf = get_flags(sock, hr["netdev"])
                    sf = get_flags(fab_sock, hr["switch_port"])
                    out.append({"host": h["index"], "rail": hr["rail"], "host_up": bool(hf & 0x1),
                                "host_running": bool(hf & 0x40), "switch_up": bool(sf & 0x1)})
            finally:
                sock.close()
    finally:
        fab_sock.close()
    return out


# --------------------------------------------------------------------------- faults


def _port_name(host: int, rail: int) -> str:
    return f"h{host}r{rail}"


def _table_name(host: int, rail: int) -> str:
    return f"lpfault_{_port_name(host, rail)}"


def _find_fault(desc: dict, host: int, rail: int) -> dict | None:
    for f in desc["faults"]:
        if f["host"] == host and f["rail"] == rail:
            return f
    return None


def _prune_faults(desc: dict) -> None:
    """Drop flap faults whose helper has finished (the link is healthy again)."""
    desc["faults"] = [
        f for f in desc.get("faults", [])
        if not (f["mode"].startswith("flap:") and not _helper_alive(f.get("pid"), _port_name(f["host"], f["rail"])))
    ]


def _kernel(fn, *args):
    try:
        return fn(*args)
    except NsError as e:
        raise FabricKernelError(str(e)) from None


def _toggle(ns: str, ifname: str, up_: bool) -> tuple[int, int]:
    def go() -> tuple[int, int]:
        sock = ns_socket(ns)
        try:
            flags = get_flags(sock, ifname)
            t0 = time.monotonic_ns()
            set_up(sock, ifname, up_, flags)
            return t0, time.monotonic_ns()
        finally:
            sock.close()

    return _kernel(go)


def _nft_fault(desc: dict, host: int, rail: int, pct: int | None) -> tuple[int, int]:
    table, port = _table_name(host, rail), _port_name(host, rail)
    cond = f" numgen random mod 100 < {pct}" if pct is not None and pct < 100 else ""
    script = (
        f"table bridge {table} {{}}\n"
        f"delete table bridge {table}\n"
        f"table bridge {table} {{\n"
        f"  chain drop_port {{\n"
        f"    type filter hook forward priority -10; policy accept;\n"
        f"    iifname \"{port}\"{cond} counter drop\n"
        f"    oifname \"{port}\"{cond} counter drop\n"
        f"  }}\n"
        f"}}\n"
    )
    t0 = time.monotonic_ns()
    _kernel(nft, desc["fabric_netns"], script, f"nft (fault on {port})")
    return t0, time.monotonic_ns()


def _nft_clear(desc: dict, host: int, rail: int) -> tuple[int, int]:
    table = _table_name(host, rail)
    script = f"table bridge {table} {{}}\ndelete table bridge {table}\n"
    t0 = time.monotonic_ns()
    _kernel(nft, desc["fabric_netns"], script, f"nft (heal {_port_name(host, rail)})")
    return t0, time.monotonic_ns()


def _apply(desc: dict, host: int, rail: int, kind: str, params: tuple[int, ...]) -> tuple[int, int, int | None]:
    h = desc["hosts"][host]
    hr = h["rails"][rail]
    if kind == "admin-down":
        return (*_toggle(h["netns"], hr["netdev"], False), None)
    if kind == "carrier-loss":
        return (*_toggle(desc["fabric_netns"], hr["switch_port"], False), None)
    if kind == "blackhole":
        return (*_nft_fault(desc, host, rail, None), None)
    if kind == "loss":
        return (*_nft_fault(desc, host, rail, params[0]), None)
    if kind == "flap":
        return _start_flap(desc, host, rail, *params)
    raise AssertionError(kind)


def _heal_one(desc: dict, fault: dict) -> tuple[int, int]:
    host, rail, mode = fault["host"], fault["rail"], fault["mode"]
    h = desc["hosts"][host]
    hr = h["rails"][rail]
    if mode == "admin-down":
        return _toggle(h["netns"], hr["netdev"], True)
    if mode == "carrier-loss":
        return _toggle(desc["fabric_netns"], hr["switch_port"], True)
    if mode == "blackhole" or mode.startswith("loss:"):
        return _nft_clear(desc, host, rail)
    if mode.startswith("flap:"):
        if fault.get("pid"):
            _stop_helper(fault["pid"], hr["switch_port"])
        return _toggle(desc["fabric_netns"], hr["switch_port"], True)
    raise FabricError(f"unknown recorded fault mode {mode!r} in fabric {desc['name']}")


def _start_flap(desc: dict, host: int, rail: int, period_ms: int, count: int) -> tuple[int, int, int]:
    port = _port_name(host, rail)
    log_path = os.path.join(desc["state_dir"], f"flap-{port}.log")
    pkg_root = str(Path(__file__).resolve().parents[3])  # the tree holding the linkpass package
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r, w = os.pipe()
    try:
        with open(log_path, "ab") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", _HELPER_MODULE, "--netns", desc["fabric_netns"], "--port", port,
                 "--period-ms", str(period_ms), "--count", str(count), "--ready-fd", str(w)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(w,), cwd="/", env=env,
                start_new_session=True,
            )
        os.close(w)
        w = -1
        _HELPERS[p.pid] = p
        data = b""
        deadline = time.monotonic() + _FLAP_READY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                break
            chunk = os.read(r, 64)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    t1 = time.monotonic_ns()
    if not data.strip().isdigit():
        _stop_helper(p.pid, port)
        tail = ""
        with contextlib.suppress(OSError):
            tail = "; ".join(Path(log_path).read_text(errors="replace").strip().splitlines()[-2:])
        raise FabricKernelError(f"flap helper for {port} did not start ({tail or 'no output'}; log {log_path})")
    return int(data), t1, p.pid


def _helper_alive(pid: int | None, port: str) -> bool:
    """True if ``pid`` is a running (not zombie) flap helper for ``port``."""
    if not pid:
        return False
    p = _HELPERS.get(pid)
    if p is not None:
        if p.poll() is not None:
            _HELPERS.pop(pid, None)
            return False
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError as e:
        if e.errno in (errno.ESRCH, errno.ENOENT):
            return False
        raise
    if state in (b"Z", b"X"):
        return False
    return _HELPER_MODULE.encode() in argv and port.encode() in argv


def _stop_helper(pid: int, port: str) -> None:
    """SIGTERM a recorded flap helper (only if it still is one), wait, SIGKILL if needed."""
    if not _helper_alive(pid, port):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for sig in (signal.SIGKILL, None):
        deadline = time.monotonic() + _HELPER_STOP_TIMEOUT_S
        while _helper_alive(pid, port):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        else:
            _HELPERS.pop(pid, None)
            return
        if sig is None:
            raise FabricKernelError(f"flap helper {pid} for {port} does not exit, even after SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
