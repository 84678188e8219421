"""Building a planned fabric in the kernel (namespaces, bridges, veth pairs, addresses and
sysctls, with ``ip -batch``), writing its state directory (daemon configs, notice key, kernel
logs), and tearing it down again (stopping what runs inside, deleting recorded namespaces)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time

from linkpass.lab.fabric._ns import NsError, ip_batch, netns_exists, write_sysctls
from linkpass.lab.fabric.errors import FabricKernelError
from linkpass.lab.fabric.faults import _port_name, _stop_helper
from linkpass.lab.fabric.spec import STATE_ROOT, _host_config


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
    from linkpass.lab.fabric import counters

    for i in range(len(desc["hosts"])):  # each emulated host's kernel log and counters (see _host_config)
        open(os.path.join(desc["state_dir"], f"h{i}.kmsg"), "a").close()
        counters.build(desc, i)
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
