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

This module is the public API (:func:`up`, :func:`down`, :func:`load`, :func:`cut`, :func:`heal`,
...); the parts behind it, each importable from here as before:
:mod:`~linkpass.lab.fabric.spec` (names, limits, the description and the daemon configs),
:mod:`~linkpass.lab.fabric.state` (``fabric.json`` and the lock), :mod:`~linkpass.lab.fabric.build`
(building and tearing down in the kernel) and :mod:`~linkpass.lab.fabric.faults` (fault modes,
nftables, flap helpers).
"""

from __future__ import annotations

import os
import shutil

from linkpass.lab.fabric._ns import NsError, get_flags, netns_exists, ns_socket
from linkpass.lab.fabric.build import (  # noqa: F401 (the build/teardown steps stay importable from here)
    _build,
    _create_netns,
    _stop_processes,
    _teardown,
    _write_config,
    _write_configs,
)
from linkpass.lab.fabric.errors import FabricError, FabricKernelError
from linkpass.lab.fabric.faults import (  # noqa: F401 (the fault modes stay importable from here)
    FAULT_SYNTAX,
    FLAP_COUNT_RANGE,
    FLAP_PERIOD_MS_RANGE,
    _apply,
    _find_fault,
    _heal_one,
    _helper_alive,
    _prune_faults,
    _stop_helper,
    parse_fault_mode,
)
from linkpass.lab.fabric.spec import (  # noqa: F401 (names, limits and the plan stay importable from here)
    HOLD_DOWN_MAX_MS,
    MAX_HOSTS,
    MAX_RAILS,
    MODES,
    SCHEMA,
    STATE_ROOT,
    _check_host,
    _check_int,
    _check_name,
    _check_rail,
    _check_root,
    _host_config,
    _plan,
)
from linkpass.lab.fabric.state import _lock, _read_state, _require, _require_ready, _write_state, state_dir  # noqa: F401


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
