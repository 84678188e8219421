"""Netlink monitor: subscribe, then dump, then stream (DESIGN.md rule 7).

Uses pyroute2's asyncio API (:class:`pyroute2.AsyncIPRoute`).  One socket is bound to the
link, IPv4 address and IPv4 route multicast groups *before* a second socket dumps the links,
so no change can slip between the dump and the stream.  Each RTM_NEWLINK/RTM_DELLINK becomes
a :class:`~linkpass.core.model.LinkChanged` stamped with ``time.monotonic_ns()`` on receipt;
RTM_NEWADDR/DELADDR and RTM_NEWROUTE/DELROUTE become AddrChanged / RouteChanged.

On a netlink overrun (the kernel reports ENOBUFS when the socket buffer overflowed and
events were lost) or any socket error, the monitor reopens its sockets, subscribes again and
posts a fresh :class:`~linkpass.core.model.LinkSnapshot`, so the engine never runs on a stale
picture.  A message that cannot be decoded is counted and skipped.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_LINK

from linkpass.core.model import AddrChanged, Event, LinkChanged, LinkFacts, LinkSnapshot, RouteChanged

log = logging.getLogger("linkpass.netlink")

IFF_UP = 0x1
IFF_LOWER_UP = 0x10000
RCVBUF = 4 * 1024 * 1024


def link_facts(msg) -> LinkFacts | None:
    """Turn an ifinfmsg (RTM_NEWLINK/RTM_DELLINK or dump entry) into :class:`LinkFacts`.

    Returns None when the message carries no interface name.
    """
    name = msg.get("ifname")
    if not name:
        return None
    if msg.get("event") == "RTM_DELLINK":
        return LinkFacts(name, present=False, admin_up=False, carrier=False, operstate="NOTPRESENT")
    flags = int(msg.get("flags") or 0)
    return LinkFacts(
        netdev=name,
        present=True,
        admin_up=bool(flags & IFF_UP),
        carrier=bool(flags & IFF_LOWER_UP),
        operstate=str(msg.get("operstate") or "UNKNOWN"),
    )


class NetlinkMonitor:
    """Streams link/address/route events of the current network namespace into ``post``.

    Args:
        post: callable taking one event (``queue.put_nowait``).
        route_filter: optional predicate ``(dst, proto) -> bool`` selecting the route events
            worth posting (the daemon passes "ours, or one of our destinations").

    Attributes:
        resyncs: number of dumps taken after the first one (overruns, errors).
        bad_messages: messages skipped because they could not be decoded.
        ifindex: last known ifindex -> netdev name map (used by the route actuator).
    """

    def __init__(self, post: Callable[[Event], None], route_filter: Callable[[str, int], bool] | None = None, rcvbuf: int = RCVBUF):
        self.post = post
        self.rcvbuf = rcvbuf
        self.route_filter = route_filter
        self.resyncs = 0
        self.overruns = 0
        self.bad_messages = 0
        self.ifindex: dict[int, str] = {}
        self._events: AsyncIPRoute | None = None
        self.ready = asyncio.Event()

    async def _subscribe(self) -> AsyncIPRoute:
        ev = AsyncIPRoute()
        await ev.bind(groups=RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV4_ROUTE)
        try:
            ev.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        except OSError as e:
            log.warning("netlink: cannot set SO_RCVBUF to %d: %s", self.rcvbuf, e)
        return ev

    async def dump(self, reason: str) -> None:
        """Dump all links (and IPv4 addresses) and post a LinkSnapshot."""
        links = []
        async with AsyncIPRoute() as ipr:
            async for msg in await ipr.link("dump"):
                f = link_facts(msg)
                if f is not None:
                    links.append(f)
                    self.ifindex[msg["index"]] = f.netdev
            addrs = []
            async for msg in await ipr.addr("dump", family=2):
                addrs.append(msg)
        t = time.monotonic_ns()
        self.post(LinkSnapshot(tuple(links), t, reason))
        for msg in addrs:
            self._post_addr(msg, t)

    def _post_addr(self, msg, t: int) -> None:
        dev = self.ifindex.get(msg.get("index"))
        addr = msg.get("address")
        if dev and addr:
            self.post(AddrChanged(dev, addr, int(msg.get("prefixlen") or 0), msg.get("event") != "RTM_DELADDR", t))

    def _handle(self, msg) -> None:
        t = time.monotonic_ns()
        kind = msg.get("event")
        if kind in ("RTM_NEWLINK", "RTM_DELLINK"):
            f = link_facts(msg)
            if f is None:
                self.bad_messages += 1
                return
            if kind == "RTM_NEWLINK":
                self.ifindex[msg["index"]] = f.netdev
            self.post(LinkChanged(f, t))
        elif kind in ("RTM_NEWADDR", "RTM_DELADDR"):
            self._post_addr(msg, t)
        elif kind in ("RTM_NEWROUTE", "RTM_DELROUTE"):
            dst = msg.get("dst")
            dst = f"{dst}/{msg.get('dst_len', 0)}" if dst else f"0.0.0.0/{msg.get('dst_len', 0)}"
            proto = int(msg.get("proto") or 0)
            if self.route_filter is None or self.route_filter(dst, proto):
                table = msg.get("table") or msg.get("RTA_TABLE") or 0
                self.post(RouteChanged(dst, proto, int(table), kind == "RTM_DELROUTE", t))

    async def run(self) -> None:
        """Run forever: subscribe, dump, stream; resync on overrun or error."""
        reason = "start"
        backoff = 0.05
        while True:
            ev = None
            try:
                ev = await self._subscribe()
                await self.dump(reason)
                if reason != "start":
                    self.resyncs += 1
                self.ready.set()
                backoff = 0.05
                while True:
                    async for msg in ev.get():
                        try:
                            self._handle(msg)
                        except Exception as e:  # a malformed message must not kill the monitor
                            self.bad_messages += 1
                            log.warning("netlink: skipping undecodable message: %s", e)
            except asyncio.CancelledError:
                raise
            except (NetlinkError, OSError) as e:
                # pyroute2 surfaces an overrun as OSError(ENOBUFS) from the transport, or as
                # NetlinkError with code ENOBUFS when it arrives inside a message
                code = e.code if isinstance(e, NetlinkError) else e.errno
                if code == errno.ENOBUFS:
                    self.overruns += 1
                    log.warning("netlink: overrun (ENOBUFS), events were lost; resyncing from a dump")
                    reason = "overrun"
                else:
                    log.warning("netlink: error %s; reconnecting and resyncing", e)
                    reason = "reconnect"
            finally:
                if ev is not None:
                    try:
                        ev.close()
                    except Exception:
                        pass
            if reason != "overrun":
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
