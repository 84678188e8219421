"""Faults on one host-rail link: parsing a mode, making and undoing it in the kernel, and the
detached flap helpers (``python -m linkpass.lab.fabric.flap``) behind ``flap:PERIOD_MS:COUNT``.

Modes (see :func:`linkpass.lab.fabric.fabric.cut`): ``admin-down`` (host side down),
``carrier-loss`` (switch side down), ``blackhole`` and ``loss:PCT`` (an nftables table per
switch port in the fabric namespace), ``flap:PERIOD_MS:COUNT`` (a helper toggles the switch
side).  Each kernel change returns ``(t_issued_ns, t_done_ns)`` on the monotonic clock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from linkpass.lab.fabric._ns import NsError, get_flags, nft, ns_socket, set_up
from linkpass.lab.fabric.errors import FabricError, FabricKernelError

FLAP_PERIOD_MS_RANGE = (10, 3_600_000)
FLAP_COUNT_RANGE = (1, 1_000_000)
FAULT_SYNTAX = (
    "admin-down, carrier-loss, blackhole, loss:PCT (PCT integer 1..100) or "
    f"flap:PERIOD_MS:COUNT (PERIOD_MS integer {FLAP_PERIOD_MS_RANGE[0]}..{FLAP_PERIOD_MS_RANGE[1]}, "
    f"COUNT integer {FLAP_COUNT_RANGE[0]}..{FLAP_COUNT_RANGE[1]})"
)
_HELPER_MODULE = "linkpass.lab.fabric.flap"
_FLAP_READY_TIMEOUT_S = 5.0
_HELPER_STOP_TIMEOUT_S = 2.0

# Popen objects of flap helpers started by this process (so they can be reaped, never zombies).
_HELPERS: dict[int, subprocess.Popen] = {}


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
