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

The translation of messages into events (:func:`event_from_msg`, :func:`snapshot_events`) is
pure, tested on recorded kernel messages (tests/unit/test_netlink_messages.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable, Mapping

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


def addr_event(msg, t_ns: int, ifindex: Mapping[int, str]) -> AddrChanged | None:
    """An ifaddrmsg (RTM_NEWADDR/RTM_DELADDR or dump entry) as :class:`AddrChanged` at
    ``t_ns``; None when its ifindex is not in ``ifindex`` (ifindex -> netdev) or it has no
    address."""
    dev = ifindex.get(msg.get("index"))
    addr = msg.get("address")
    if not (dev and addr):
        return None
    return AddrChanged(dev, addr, int(msg.get("prefixlen") or 0), msg.get("event") != "RTM_DELADDR", t_ns)


def route_dst(msg) -> str:
    """An rtmsg's destination prefix, ``a.b.c.d/len`` (``0.0.0.0/0`` for a default route)."""
    dst = msg.get("dst")
    return f"{dst or '0.0.0.0'}/{msg.get('dst_len', 0)}"


def event_from_msg(msg, t_ns: int, ifindex: Mapping[int, str],
                   route_filter: Callable[[str, int], bool] | None = None) -> Event | None:
    """What one streamed rtnetlink message means, stamped ``t_ns`` (monotonic ns of receipt).

    RTM_NEWLINK/RTM_DELLINK -> :class:`LinkChanged`; RTM_NEWADDR/RTM_DELADDR ->
    :class:`AddrChanged` (see :func:`addr_event`); RTM_NEWROUTE/RTM_DELROUTE ->
    :class:`RouteChanged` when ``route_filter(dst, proto)`` allows it (all when None).  Any
    other message, and the ones left out, give None.  Pure: the caller keeps ``ifindex``.

    Raises:
        ValueError: a link message without an interface name.
    """
    kind = msg.get("event")
    if kind in ("RTM_NEWLINK", "RTM_DELLINK"):
        f = link_facts(msg)
        if f is None:
            raise ValueError(f"{kind} without an interface name (ifindex {msg.get('index')})")
        return LinkChanged(f, t_ns)
    if kind in ("RTM_NEWADDR", "RTM_DELADDR"):
        return addr_event(msg, t_ns, ifindex)
    if kind in ("RTM_NEWROUTE", "RTM_DELROUTE"):
        dst = route_dst(msg)
        proto = int(msg.get("proto") or 0)
        if route_filter is not None and not route_filter(dst, proto):
            return None
        table = msg.get("table") or msg.get("RTA_TABLE") or 0
        return RouteChanged(dst, proto, int(table), kind == "RTM_DELROUTE", t_ns)
    return None


def snapshot_events(links, addrs, t_ns: int, reason: str) -> tuple[dict[int, str], list[Event]]:
    """A dump's link and IPv4 address messages -> (ifindex -> netdev, events): one
    :class:`LinkSnapshot` of every named link, then an :class:`AddrChanged` per address."""
    facts: list[LinkFacts] = []
    ifindex: dict[int, str] = {}
    for msg in links:
        f = link_facts(msg)
        if f is not None:
            facts.append(f)
            ifindex[msg["index"]] = f.netdev
    events: list[Event] = [LinkSnapshot(tuple(facts), t_ns, reason)]
    events += [e for msg in addrs if (e := addr_event(msg, t_ns, ifindex)) is not None]
    return ifindex, events


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
        """Dump all links (and IPv4 addresses) and post a LinkSnapshot, then the addresses."""
        async with AsyncIPRoute() as ipr:
            links = [msg async for msg in await ipr.link("dump")]
            addrs = [msg async for msg in await ipr.addr("dump", family=2)]
        ifindex, events = snapshot_events(links, addrs, time.monotonic_ns(), reason)
        self.ifindex.update(ifindex)
        for e in events:
            self.post(e)

    def _handle(self, msg) -> None:
        try:
            ev = event_from_msg(msg, time.monotonic_ns(), self.ifindex, self.route_filter)
        except ValueError:
            self.bad_messages += 1
            return
        if ev is None:
            return
        if isinstance(ev, LinkChanged) and msg.get("event") == "RTM_NEWLINK":
            self.ifindex[msg["index"]] = ev.facts.netdev
        self.post(ev)

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
