"""Peer notices over UDP: tell peers which of our rails are usable, hear theirs.

Sending: one UDP socket per rail, bound to the rail's netdev (SO_BINDTODEVICE, needs
CAP_NET_RAW), so a notice really leaves over that rail.  A notice goes to each peer's address
on every rail usable here (a failed rail cannot carry it).  Urgent notices are sent at once
and repeated at +10 ms and +50 ms (a single datagram may be lost); the current state is
also refreshed every ``notice_refresh_ms`` (longer on large clusters: at most
``notice_refresh_max_pps`` datagrams a second), over one usable rail at a time in turn.

Receiving: one socket on ``0.0.0.0:notice_port``.  Each datagram is verified
(:func:`linkpass.core.notice.decode`, HMAC-SHA256) and checked against replay; rejected
datagrams are counted by reason and never stop the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable

from linkpass.config import Config
from linkpass.core import notice as wire
from linkpass.core.model import Event, PeerRails, SendNotice

log = logging.getLogger("linkpass.notices")

REPEATS_S = (0.010, 0.050)
SEND_CHUNK = 512  # notice datagrams sent per event-loop turn (about 0.8 ms of sendto)
NOTICE_RCVBUF = 1 << 20  # bytes: about 800 queued notices at the kernel's ~1.3 KiB truesize each
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_MEMINFO = 55  # Linux: u32[SK_MEMINFO_VARS] (include/uapi/asm-generic/socket.h)
SK_MEMINFO_DROPS = 8
_MEMINFO = struct.Struct("@9I")


def refresh_period_s(cfg: Config) -> float:
    """Seconds between two refreshes: ``notice_refresh_ms``, or longer when sending one datagram
    to every peer in that time would exceed ``notice_refresh_max_pps``.  Every host refreshes
    every peer, so the cap also bounds what each host receives and verifies (about 7 us of CPU
    a datagram, deploy/SCALING.md: 16,383 a second, 12.8 % of a core, at 16,384 hosts
    uncapped)."""
    d = cfg.daemon
    return max(d.notice_refresh_ms / 1000, len(cfg.peers) / d.notice_refresh_max_pps)


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, owner: "NoticeService"):
        self.owner = owner

    def datagram_received(self, data: bytes, addr) -> None:
        self.owner.on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("notice socket error: %s", exc)


class NoticeService:
    """Sends and receives peer notices.

    Args:
        cfg: config (host name, rails, peers, port, refresh period).
        key: shared HMAC key.
        post: where to post :class:`PeerRails` events.

    Attributes:
        counters: ``sent``, ``send_errors``, ``accepted``, and ``rejected_<kind>`` for each
            rejection kind (``auth``, ``replay``, ``malformed``, ``oversized``, ``unknown_peer``);
            ``rx_dropped``: datagrams the kernel dropped because the receive queue was full
            (a flood: real notices in it are lost; the periodic refresh repairs that), read
            from the socket's ``SO_MEMINFO`` drop count whenever the counters are read.
    """

    def __init__(self, cfg: Config, key: bytes, post: Callable[[Event], None]):
        self.cfg = cfg
        self.key = key
        self.post = post
        self._counters: Counter[str] = Counter()
        self.guard = wire.ReplayGuard()
        self._seq = time.time_ns()
        self._state: SendNotice | None = None
        self._sending: asyncio.Handle | None = None  # the rest of a send, in a later loop turn
        self._send_socks: dict[int, socket.socket] = {}
        self._transport = None
        self._index(cfg)

    def reconfigure(self, cfg: Config, key: bytes) -> None:
        self.cfg, self.key = cfg, key
        self._index(cfg)
        for s in self._send_socks.values():
            s.close()
        self._send_socks = {}

    @property
    def counters(self) -> Counter[str]:
        drops = self._kernel_drops()
        if drops:
            self._counters["rx_dropped"] = drops
        return self._counters

    def _kernel_drops(self) -> int | None:
        """The receive socket's drop count (``SO_MEMINFO``, index ``SK_MEMINFO_DROPS``; see
        include/uapi/linux/sock_diag.h), None when unknown."""
        sock = self._transport.get_extra_info("socket") if self._transport else None
        if sock is None:
            return None
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size)
        except OSError:
            return None
        return _MEMINFO.unpack_from(raw)[SK_MEMINFO_DROPS] if len(raw) >= _MEMINFO.size else None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _Receiver(self), local_addr=("0.0.0.0", self.cfg.daemon.notice_port), reuse_port=False
        )
        sock = self._transport.get_extra_info("socket")
        if sock is not None:  # room for a burst of notices from every peer (and a flood's share)
            for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, NOTICE_RCVBUF)
                    break
                except OSError:
                    continue

    def close(self) -> None:
        if self._sending is not None:
            self._sending.cancel()
            self._sending = None
        if self._transport:
            self._transport.close()
        for s in self._send_socks.values():
            s.close()

    # ---------------------------------------------------------------- receive

    def on_datagram(self, data: bytes, addr) -> None:
        t = time.monotonic_ns()
        try:
            n = wire.decode(data, self.key)
            if n.sender not in self._peer_names:
                raise wire.NoticeError("unknown_peer", f"sender {n.sender!r} is not a configured peer")
            self.guard.check(n)
        except wire.NoticeError as e:
            self._counters[f"rejected_{e.kind}"] += 1
            n_kind = self._counters[f"rejected_{e.kind}"]
            if e.kind != "duplicate" and (n_kind <= 10 or n_kind % 1000 == 0):
                log.warning("notice from %s:%s dropped (%s, %d so far): %s", addr[0], addr[1], e.kind, n_kind, e)
            return
        except Exception as e:  # never let a datagram kill the daemon
            self._counters["rejected_malformed"] += 1
            log.warning("notice from %s dropped: %s", addr, e)
            return
        self._counters["accepted"] += 1
        self.post(PeerRails(n.sender, n.usable, n.generation, n.seq, t, self._rail_for_source(addr[0])))

    def _index(self, cfg: Config) -> None:
        self._peer_names = frozenset(p.name for p in cfg.peers)
        self._rail_of_addr = {str(a): rid for p in cfg.peers for rid, a in p.rail_ips.items()}

    def _rail_for_source(self, ip: str) -> int | None:
        return self._rail_of_addr.get(ip)

    # ---------------------------------------------------------------- send

    def _sock(self, rail_id: int) -> socket.socket | None:
        s = self._send_socks.get(rail_id)
        if s is not None:
            return s
        netdev = next((r.netdev for r in self.cfg.rails if r.id == rail_id), None)
        if netdev is None:
            return None
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, netdev.encode())
        except OSError as e:
            log.warning("cannot bind notice socket to %s: %s", netdev, e)
        self._send_socks[rail_id] = s
        return s

    def send(self, state: SendNotice, rails: Iterable[int] | None = None) -> None:
        """Send ``state`` to every peer over every usable rail (or over those of ``rails`` that
        are usable), and remember it.  Rail by rail, so every peer has a copy after the first
        rail's round.  At most :data:`SEND_CHUNK` datagrams go out per turn of the event loop,
        the rest in later turns (at 16,384 hosts x 8 rails one send is 131,064 datagrams, about
        0.2 s: the prober must not wait that long); a newer send replaces what is left of an
        older one (it carries the newer state)."""
        self._state = state
        self._seq += 1
        flags = {r.id: (r.id in state.usable) for r in self.cfg.rails}
        data = wire.encode(wire.Notice(self.cfg.daemon.host, self._seq, state.generation, flags), self.key)
        port = self.cfg.daemon.notice_port
        over = sorted(state.usable) if rails is None else sorted(set(rails) & set(state.usable))
        todo = [(rid, str(a)) for rid in over for p in self.cfg.peers if (a := p.rail_ips.get(rid)) is not None]
        if self._sending is not None:
            self._sending.cancel()
            self._sending = None
        self._send_some(data, port, todo, 0)

    def _send_some(self, data: bytes, port: int, todo: list[tuple[int, str]], i: int) -> None:
        self._sending = None
        end = min(len(todo), i + SEND_CHUNK)
        for rid, a in todo[i:end]:
            s = self._sock(rid)
            if s is None:
                continue
            try:
                s.sendto(data, (a, port))
                self._counters["sent"] += 1
            except OSError as e:
                self._counters["send_errors"] += 1
                log.debug("notice to %s on rail %d failed: %s", a, rid, e)
        if end < len(todo):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a tool or a test calling send directly): all at once
                self._send_some(data, port, todo, end)
                return
            self._sending = loop.call_soon(self._send_some, data, port, todo, end)

    def sending(self) -> bool:
        """Whether the last send still has datagrams to go (spread over loop turns)."""
        return self._sending is not None

    def submit(self, state: SendNotice) -> None:
        """Send now; if urgent, repeat shortly after (only if no newer state replaced it)."""
        self.send(state)
        if state.urgent:
            loop = asyncio.get_running_loop()
            for delay in REPEATS_S:
                loop.call_later(delay, self._repeat, state)

    def _repeat(self, state: SendNotice) -> None:
        if self._state is state:
            self.send(state)

    async def refresh_loop(self) -> None:
        """Resend the current state every notice_refresh_ms, over one usable rail at a time in
        turn (peers that restarted, or lost a notice, learn it).  One rail, not all: a refresh
        changes nothing at a peer that has the state, and every host receives one from every
        peer each period, so at 8 rails this is 8 times fewer datagrams to send and to verify
        (131,064 a second each way at 16,384 hosts otherwise).  A peer that can hear us on one
        rail only learns the state within ``usable rails`` periods.  Urgent notices still go
        over every usable rail.  A refresh while a send is still going out is left out.  The
        period is :func:`refresh_period_s` (longer than ``notice_refresh_ms`` on large clusters)."""
        turn = 0
        while True:
            await asyncio.sleep(refresh_period_s(self.cfg))
            st = self._state
            if st is None or not st.usable or self.sending():
                continue
            usable = sorted(st.usable)
            self.send(st, rails=(usable[turn % len(usable)],))
            turn += 1
