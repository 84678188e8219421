"""systemd service notifications (``Type=notify``): READY, WATCHDOG, STATUS, RELOADING, STOPPING.

The protocol (sd_notify(3), https://www.freedesktop.org/software/systemd/man/latest/sd_notify.html)
is one datagram per notification, sent on an ``AF_UNIX``/``SOCK_DGRAM`` socket to the address in
``$NOTIFY_SOCKET``: newline-separated ``KEY=VALUE`` assignments (``READY=1``, ``STATUS=...``,
``WATCHDOG=1``, ``RELOADING=1`` with ``MONOTONIC_USEC=`` of CLOCK_MONOTONIC, ``STOPPING=1``).
An address starting with ``@`` is in the abstract namespace (the ``@`` stands for a leading NUL
byte); otherwise it is an absolute file-system path.  Without ``$NOTIFY_SOCKET`` (not started by
systemd) every call is a no-op.  The watchdog (sd_watchdog_enabled(3)): ``$WATCHDOG_USEC`` is the
timeout in microseconds, for us only when ``$WATCHDOG_PID`` is unset or our pid; the daemon
should send ``WATCHDOG=1`` every half of it.  The protocol is a few lines, so it is implemented
here instead of adding a dependency.

:class:`SdNotifier` speaks the protocol; :class:`ServiceNotifier` is what the daemon uses: READY=1
once (after the first link dump and route reconciliation), STATUS= when the one-line summary
changes (an event sink, like MQTT and metrics), WATCHDOG=1 from a task on the event loop (a
blocked loop stops pinging, so systemd's ``WatchdogSec=`` restarts the daemon), RELOADING=1 /
READY=1 around a SIGHUP reload, STOPPING=1 on stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping

from linkpass.core.status import DaemonSnapshot

log = logging.getLogger("linkpass.systemd")


class SdNotifier:
    """Sends sd_notify(3) datagrams to one ``$NOTIFY_SOCKET`` address.

    Args:
        address: the ``$NOTIFY_SOCKET`` value (absolute path, or ``@name`` for the abstract
            namespace); None or "" = not under systemd: every send is a no-op returning False.
        watchdog_usec: the watchdog timeout (``$WATCHDOG_USEC``), None when off.

    Send errors are logged (once per errno) and never raised: the daemon's network job matters
    more than telling systemd about it.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address: bytes | None = None
        if address:
            if address.startswith("@"):
                self.address = b"\0" + os.fsencode(address[1:])
            elif address.startswith("/"):
                self.address = os.fsencode(address)
            else:
                log.warning("NOTIFY_SOCKET=%r is neither an absolute path nor an abstract socket (@name); "
                            "systemd notifications are off", address)
        self.watchdog_usec = watchdog_usec if self.address else None
        self.sent = 0
        self._sock: socket.socket | None = None
        self._errors_seen: set[int] = set()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SdNotifier:
        """Build from ``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID`` (sd_watchdog_enabled(3):
        the watchdog is ours when WATCHDOG_PID is unset or equals our pid; a bad value = off)."""
        env = os.environ if environ is None else environ
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC")
        if raw:
            try:
                usec = int(raw)
            except ValueError:
                log.warning("WATCHDOG_USEC=%r is not a number; the watchdog is off", raw)
            else:
                if usec <= 0:
                    usec = None
            pid = env.get("WATCHDOG_PID")
            if usec and pid:
                try:
                    if int(pid) != os.getpid():
                        usec = None  # the watchdog is for another process (we were started by it)
                except ValueError:
                    log.warning("WATCHDOG_PID=%r is not a number; the watchdog is off", pid)
                    usec = None
        return cls(env.get("NOTIFY_SOCKET"), usec)

    @property
    def enabled(self) -> bool:
        """True when running under a service manager that listens for notifications."""
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """Seconds between two WATCHDOG=1 (half the timeout, as sd_watchdog_enabled(3) advises), or None."""
        return None if not self.watchdog_usec else self.watchdog_usec / 2e6

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments as one datagram.  Returns True when it was sent.

        A value must not contain a newline (it would start another assignment); newlines in
        STATUS text are replaced by spaces by :meth:`status` and :class:`ServiceNotifier`.
        """
        if self.address is None or not assignments:
            return False
        data = "\n".join(assignments).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(data, self.address)
        except OSError as e:
            if e.errno not in self._errors_seen:
                self._errors_seen.add(e.errno)
                log.warning("cannot notify systemd at NOTIFY_SOCKET: %s (reported once per error)", e.strerror or e)
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={_one_line(status)}"] if status else []))

    def reloading(self) -> bool:
        # MONOTONIC_USEC: CLOCK_MONOTONIC at the start of the reload (sd_notify(3), systemd >= 253
        # needs it for Type=notify-reload; older ones ignore it)
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={_one_line(status)}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    return " ".join(str(text).split("\n"))


def status_line(snap: DaemonSnapshot) -> str:
    """The one-line summary for ``STATUS=`` (what ``systemctl status`` shows), rendered from a
    :class:`~linkpass.core.status.DaemonSnapshot`, e.g.
    ``2/2 rails up, plan generation 5, 1/1 peers heard``; degraded rails, route errors and a
    refused reload are added when there are any."""
    parts = [f"{len(snap.usable_rails)}/{len(snap.rails)} rails up", f"plan generation {snap.generation}"]
    if snap.peers_configured:
        parts.append(f"{snap.peers_heard}/{snap.peers_configured} peers heard")
    degraded = sorted(r.id for r in snap.rails if r.degraded)
    if degraded:
        parts.append("degraded rail(s) " + ",".join(str(r) for r in degraded))
    if snap.route_errors:
        parts.append(f"{snap.route_errors} route error(s)")
    if snap.reload_error:
        parts.append("last reload refused (old config kept)")
    return ", ".join(parts)


class ServiceNotifier:
    """The daemon's side of ``Type=notify``, built on an :class:`SdNotifier`; it reads the
    daemon's state only from the snapshots it is handed.

    Args:
        notifier: the protocol end (``SdNotifier.from_env()``).

    Use: ``s.ready(snap)`` once the first reconciliation is done; ``s.update(snap)`` after a
    loop turn that recorded history (only when :attr:`wants_updates`, so the daemon builds no
    snapshot for nothing); run ``s.watchdog_loop()`` as a task when
    ``s.notifier.watchdog_interval_s``; ``s.reloading()`` / ``s.reloaded(snap)`` around SIGHUP;
    ``s.stopping()`` on stop.
    """

    def __init__(self, notifier: SdNotifier) -> None:
        self.notifier = notifier
        self.is_ready = False
        self.watchdogs_sent = 0
        self._last_status: str | None = None
        self._reloading = False  # between RELOADING=1 and READY=1: reloaded() sends the line

    def starting(self) -> None:
        self._status("starting: waiting for the first link dump and route reconciliation")

    def ready(self, snap: DaemonSnapshot) -> None:
        """READY=1 with the first STATUS= line (once; later calls do nothing)."""
        if self.is_ready:
            return
        self.is_ready = True
        line = status_line(snap)
        self._last_status = line
        self.notifier.ready(line)

    @property
    def wants_updates(self) -> bool:
        """True when :meth:`update` would send anything (READY=1 sent, notifications on, not
        in the middle of a reload)."""
        return self.is_ready and self.notifier.enabled and not self._reloading

    def update(self, snap: DaemonSnapshot) -> None:
        """A new STATUS= line when the summary changed (only after READY=1)."""
        if self.wants_updates:
            self._status(status_line(snap))

    def reloading(self) -> None:
        if self.is_ready:
            self._reloading = True
            self.notifier.reloading()

    def reloaded(self, snap: DaemonSnapshot) -> None:
        """READY=1 again after a reload (refused or not: the daemon runs on), with STATUS=."""
        self._reloading = False
        if self.is_ready:
            line = status_line(snap)
            self._last_status = line
            self.notifier.ready(line)

    def stopping(self) -> None:
        self.notifier.stopping("stopping; routes are left in place")

    def _status(self, line: str) -> None:
        if line != self._last_status:
            self._last_status = line
            self.notifier.status(line)

    async def watchdog_loop(self) -> None:
        """Send WATCHDOG=1 every half watchdog timeout, from the event loop (never returns).
        A loop blocked for longer than the timeout sends nothing, and systemd acts."""
        interval = self.notifier.watchdog_interval_s
        if not interval:
            return
        while True:
            if self.notifier.watchdog():
                self.watchdogs_sent += 1
            await asyncio.sleep(interval)
