"""Client of the linkpass daemon's hook socket, for use inside a training process.

It does not import torch (tests/unit/test_layering.py checks it), so it also suits launchers
and non-PyTorch jobs::

    from torch_hooks.client import DaemonClient
    from torch_hooks.protocol import Registration

    c = DaemonClient(Registration(job="llm7", rank=3, world_size=16, peers=("gpu-node-08",), rail=0)).start()
    ...
    n = c.latest            # newest torch_hooks.protocol.Notice, or None
    if n and n.affects(0): ...
    c.report("rebuilt", epoch=1, rail=1, rebuild_ms=180.2)
    c.close()

A background thread (daemon thread, named ``linkpass-hook-client``) connects to the socket,
registers, and reads notices.  If the daemon is absent or restarts, the thread reconnects with
a backoff (``reconnect_s``: first delay, doubling up to the maximum) and registers again; the
training process is never blocked by it.  Notices are kept only when newer
(:func:`torch_hooks.protocol.is_newer`).  Malformed, oversized or unexpected lines from the
socket are dropped, counted (``counters["bad_messages"]``) and logged.

Socket path: the ``socket_path`` argument, else ``$LINKPASS_HOOKS_SOCKET``, else
:data:`DEFAULT_SOCKET` (the default daemon's ``[hooks]`` socket).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from torch_hooks import protocol as proto

log = logging.getLogger("linkpass.torch_hooks.client")

DEFAULT_SOCKET = "/run/linkpass/linkpass.hooks.sock"
SOCKET_ENV = "LINKPASS_HOOKS_SOCKET"
#: Set by ``linkpass exec`` when it has said that no daemon answers (linkpass/cli/nccl.py).
NO_DAEMON_SAID_ENV = "LINKPASS_NO_DAEMON_SAID"
_SEND_TIMEOUT_S = 0.5
_LOUD = 5


class DaemonClient:
    """Registration with the daemon and the newest plan notice, kept up to date in a thread.

    Args:
        registration: who this process is (:class:`torch_hooks.protocol.Registration`).
        socket_path: the daemon's hooks socket (see the module docstring for the default).
        reconnect_s: (first, max) delay between connection attempts, seconds.
        on_notice: called in the client thread with each newer :class:`Notice` (keep it short;
            exceptions are logged and ignored).
        on_device_fault: called in the client thread with each ``device_fault`` message (the
            decoded dict, see :func:`torch_hooks.protocol.build_device_fault`); exceptions are
            logged and ignored.  Rank migration (:mod:`torch_hooks.spare`) acts on it.
        on_at_risk: called in the client thread with each ``gpu_at_risk`` message
            (:func:`torch_hooks.protocol.build_gpu_at_risk`); exceptions are logged and ignored.

    Attributes:
        latest: the newest notice (None before the first).
        notices_seen: count of newer notices accepted (a cheap change counter).
        connected: True while registered with a daemon.
        counters: ``connects``, ``disconnects``, ``connect_failures``, ``notices``,
            ``stale_notices``, ``bad_messages``, ``reports_sent``, ``reports_dropped``,
            ``errors_from_daemon``.
    """

    def __init__(self, registration: proto.Registration, socket_path: str | None = None,
                 reconnect_s: tuple[float, float] = (0.05, 1.0), on_notice: Callable[[proto.Notice], None] | None = None,
                 on_device_fault: Callable[[dict], None] | None = None,
                 on_at_risk: Callable[[dict], None] | None = None):
        self.registration = registration
        self.on_device_fault = on_device_fault
        self.on_at_risk = on_at_risk
        self.device_faults: list[dict] = []
        self.socket_path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        self.reconnect_s = reconnect_s
        self.on_notice = on_notice
        self.latest: proto.Notice | None = None
        self.notices_seen = 0
        self.connected = False
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()          # latest / notices_seen
        self._send_lock = threading.Lock()     # the socket's send side
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._absent_logged = False

    # ---------------------------------------------------------------- public

    def start(self) -> "DaemonClient":
        """Start the background thread (returns self; never raises for an absent daemon)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="linkpass-hook-client", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the connection."""
        self._stop.set()
        s = self._sock
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def generation(self) -> int:
        """Plan generation of the newest notice (0 before the first)."""
        n = self.latest
        return 0 if n is None else n.generation

    def affected_rails(self) -> frozenset[int]:
        """Rails the newest notice says are broken on one of this process's paths."""
        n = self.latest
        return frozenset() if n is None else n.affected_rails

    def wait_notice(self, after: int, timeout: float) -> bool:
        """Block until ``notices_seen > after`` or ``timeout`` seconds pass; True if it did."""
        with self._changed:
            return self._changed.wait_for(lambda: self.notices_seen > after, timeout)

    def wait_connected(self, timeout: float) -> bool:
        """Block until registered with a daemon (polls; for tests and start-up)."""
        deadline = time.monotonic() + timeout
        while not self.connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def update(self, registration: proto.Registration) -> None:
        """Register again with new facts (e.g. the rail of a rebuilt process group)."""
        self.registration = registration
        self._send(registration.to_msg())

    def report(self, event: str, **fields) -> bool:
        """Tell the daemon what the hook did.  Never blocks for long, never raises; returns
        False (and counts ``reports_dropped``) when not connected or the send failed."""
        try:
            ok = self._send({"type": "report", "event": event, **fields})
        except proto.ProtocolError as e:
            log.warning("report %s not sent: %s", event, e)
            ok = False
        self.counters["reports_sent" if ok else "reports_dropped"] += 1
        return ok

    # ---------------------------------------------------------------- thread

    def _send(self, msg: dict) -> bool:
        data = proto.encode(msg)
        with self._send_lock:
            s = self._sock
            if s is None or not self.connected and msg.get("type") != "register":
                return False
            try:
                s.sendall(data)
                return True
            except OSError as e:
                log.debug("send to daemon failed: %s", e)
                try:
                    s.shutdown(socket.SHUT_RDWR)  # the reader sees EOF and reconnects
                except OSError:
                    pass
                return False

    def _run(self) -> None:
        delay = self.reconnect_s[0]
        while not self._stop.is_set():
            try:
                self._session()
                delay = self.reconnect_s[0]
            except Exception:  # never let the thread die: the training goes on without notices
                log.exception("hook client: unexpected error; reconnecting")
            if self._stop.wait(delay):
                break
            delay = min(self.reconnect_s[1], delay * 2)

    def _say_absent(self, msg: str) -> None:
        """The first failed connect, said once per host (local rank 0), and not at all when
        ``linkpass exec`` has already said that no daemon answers (``LINKPASS_NO_DAEMON_SAID=1``)
        or for other local ranks (debug log only).  Without logging set up by the script it is
        one line like the hook's others (``linkpass: rank R: ...``), else a warning record."""
        said = os.environ.get(NO_DAEMON_SAID_ENV) == "1"
        if said or self.registration.local_rank not in (0, None):
            log.debug("%s", msg)
        elif log.hasHandlers():  # the script set logging up (root or ours)
            log.warning("%s", msg)
        else:  # logging's last-resort handler would print it bare
            import sys

            sys.stderr.write(f"linkpass: rank {self.registration.rank}: {msg}\n")
            sys.stderr.flush()

    def _session(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(_SEND_TIMEOUT_S)
        try:
            s.connect(self.socket_path)
        except OSError as e:
            s.close()
            self.counters["connect_failures"] += 1
            if not self._absent_logged:
                self._say_absent(f"no linkpass daemon at {self.socket_path} ({e.strerror or e}); training goes on, "
                                 "retrying in the background")
                self._absent_logged = True
            return
        self._absent_logged = False
        self._sock = s
        try:
            if not self._send(self.registration.to_msg()):
                return
            self.connected = True
            self.counters["connects"] += 1
            log.info("connected to linkpass daemon at %s", self.socket_path)
            s.settimeout(None)
            buf = bytearray()
            discarding = False
            while not self._stop.is_set():
                try:
                    chunk = s.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                now = time.monotonic_ns()
                buf += chunk
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        if len(buf) >= proto.MAX_MESSAGE_BYTES:
                            if not discarding:
                                self._bad(f"line longer than {proto.MAX_MESSAGE_BYTES} bytes")
                            discarding = True
                            buf.clear()
                        break
                    line = bytes(buf[:nl])
                    del buf[:nl + 1]
                    if discarding:
                        discarding = False
                        continue
                    if line.strip():
                        self._on_line(line, now)
        finally:
            with self._send_lock:
                self._sock = None
                was = self.connected
                self.connected = False
            s.close()
            if was:
                self.counters["disconnects"] += 1
                if not self._stop.is_set():
                    log.warning("lost the linkpass daemon at %s; reconnecting", self.socket_path)

    def _bad(self, why: str) -> None:
        self.counters["bad_messages"] += 1
        log.log(logging.WARNING if self.counters["bad_messages"] <= _LOUD else logging.DEBUG,
                "dropped a message from the daemon: %s", why)

    def _on_line(self, line: bytes, now_ns: int) -> None:
        try:
            msg = proto.decode(line, proto.SERVER_TYPES)
        except proto.ProtocolError as e:
            self._bad(str(e))
            return
        t = msg["type"]
        if t == "notice":
            try:
                n = proto.parse_notice(msg, now_ns)
            except proto.ProtocolError as e:
                self._bad(f"notice: {e}")
                return
            with self._changed:
                if not proto.is_newer(n, self.latest):
                    self.counters["stale_notices"] += 1
                    return
                self.latest = n
                self.notices_seen += 1
                self.counters["notices"] += 1
                self._changed.notify_all()
            if self.on_notice is not None:
                try:
                    self.on_notice(n)
                except Exception:
                    log.exception("on_notice callback failed")
        elif t == "device_fault":
            self.counters["device_faults"] += 1
            msg["received_ns"] = now_ns
            kept = getattr(self, "device_faults", None)  # absent on a client built without __init__ (tests)
            if kept is not None:
                kept.append(msg)
            cb = getattr(self, "on_device_fault", None)
            if cb is not None:
                try:
                    cb(msg)
                except Exception:
                    log.exception("on_device_fault callback failed")
        elif t == "gpu_at_risk":
            self.counters["at_risk"] += 1
            cb = getattr(self, "on_at_risk", None)
            if cb is not None:
                try:
                    cb(msg)
                except Exception:
                    log.exception("on_at_risk callback failed")
        elif t == "error":
            self.counters["errors_from_daemon"] += 1
            log.warning("the daemon dropped one of our messages: %s", str(msg.get("error"))[:300])
        # registered / pong: nothing to do
