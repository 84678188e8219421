"""rtnetlink for nexthop objects: RTM_{NEW,DEL,GET}NEXTHOP and routes with RTA_NH_ID.

pyroute2 0.9.7 (the newest release) has no nexthop messages and drops the value of RTA_NH_ID
from route dumps (it reads as an ``UNKNOWN`` attribute), so this module speaks those few
messages itself over one NETLINK_ROUTE socket.  Layouts are the kernel's uapi headers:
``struct nhmsg`` and ``NHA_*`` (include/uapi/linux/nexthop.h), ``struct rtmsg`` and
``RTA_*`` (include/uapi/linux/rtnetlink.h).  rtnetlink handles a request inside ``sendmsg``,
so the ACK (or a dump's messages) is queued when ``send`` returns: a blocking socket costs the
event loop no more than the kernel's own work.

The encoders (:func:`nexthop_request`, :func:`route_request`, ...) and decoders
(:func:`parse_messages`, :func:`object_from_msg`, :func:`route_from_nlmsg`) are pure, tested
on bytes (tests/unit/test_nexthops.py).  Errors: :class:`NetlinkNackError` carries the
kernel's errno.
"""

from __future__ import annotations

import errno as _errno
import os
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from linkpass.core.model import Nexthop, RouteSpec
from linkpass.core.nexthops import NexthopObject

NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x01
NLM_F_MULTI = 0x02
NLM_F_ACK = 0x04
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400

RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWNEXTHOP, RTM_DELNEXTHOP, RTM_GETNEXTHOP = 104, 105, 106

NHA_ID, NHA_GROUP, NHA_GROUP_TYPE, NHA_BLACKHOLE, NHA_OIF, NHA_GATEWAY = 1, 2, 3, 4, 5, 6
NHA_FDB = 11
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_PREFSRC, RTA_MULTIPATH, RTA_TABLE, RTA_NH_ID = 1, 4, 5, 6, 7, 9, 15, 30
RTN_UNICAST = 1
RT_SCOPE_UNIVERSE = 0
RT_TABLE_UNSPEC = 0

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_SEQ, _SEQ_OFF = struct.Struct("=I"), 8  # nlmsghdr.nlmsg_seq and its offset
_FLAGS, _FLAGS_OFF = struct.Struct("=H"), 6  # nlmsghdr.nlmsg_flags and its offset
#: requests and bytes sent in one datagram by :meth:`NexthopSocket.request_many`.  Its answers
#: (a NACK per refused request, about 1 KiB of receive buffer each, and one ACK) must fit the
#: socket's receive buffer (SO_RCVBUF, capped at net.core.rmem_max: 208 KiB by default, doubled by
#: the kernel) and the datagram its send buffer (net.core.wmem_default: 208 KiB)
BATCH_MAX = 128
BATCH_BYTES = 32 << 10
SOL_NETLINK, NETLINK_CAP_ACK = 270, 10  # include/linux/socket.h, include/uapi/linux/netlink.h
_NHMSG = struct.Struct("=BBBBI")  # family, scope, protocol, resvd, flags
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_NLATTR = struct.Struct("=HH")
_NHGRP = struct.Struct("=IBBH")  # id, weight-1, resvd1, resvd2
_RTNH = struct.Struct("=HBBi")  # len, flags, hops, ifindex


class NetlinkNackError(OSError):
    """The kernel refused a request (``errno`` is the kernel's)."""


class NetlinkBatchError(OSError):
    """The socket failed during :meth:`NexthopSocket.request_many`.  ``results``: per request
    the kernel's errno where it answered before the failure (0: done), None where unknown."""

    def __init__(self, cause: OSError, results: list[int | None]):
        unknown = sum(1 for r in results if r is None)
        code = cause.errno if cause.errno is not None or not isinstance(cause, TimeoutError) else _errno.ETIMEDOUT
        super().__init__(code, f"{cause.strerror or str(cause) or type(cause).__name__} "
                                      f"({unknown} of {len(results)} requests unconfirmed)")
        self.results = results


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attr(kind: int, payload: bytes) -> bytes:
    n = _NLATTR.size + len(payload)
    return _NLATTR.pack(n, kind) + payload + b"\0" * (_align(n) - n)


def _u32(kind: int, v: int) -> bytes:
    return _attr(kind, struct.pack("=I", v))


def _ip4(kind: int, text: str) -> bytes:
    return _attr(kind, socket.inet_aton(text))


def _message(mtype: int, flags: int, seq: int, body: bytes) -> bytes:
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), mtype, flags, seq, 0) + body


def nexthop_request(obj: NexthopObject, ifindex: Mapping[str, int], seq: int, replace: bool = True) -> bytes:
    """RTM_NEWNEXTHOP creating (or, with ``replace``, replacing) ``obj``: a leaf ``via gateway
    dev netdev`` or a group of its member ids (equal weights).  Raises KeyError for a leaf's
    netdev missing from ``ifindex``."""
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | (NLM_F_REPLACE if replace else NLM_F_EXCL)
    attrs = _u32(NHA_ID, obj.id)
    if obj.group:
        family = socket.AF_UNSPEC
        attrs += _attr(NHA_GROUP, b"".join(_NHGRP.pack(i, 0, 0, 0) for i in obj.group))
    else:
        family = socket.AF_INET
        attrs += _u32(NHA_OIF, ifindex[obj.netdev])
        if obj.gateway:
            attrs += _ip4(NHA_GATEWAY, obj.gateway)
    return _message(RTM_NEWNEXTHOP, flags, seq, _NHMSG.pack(family, 0, obj.proto, 0, 0) + attrs)


def nexthop_delete_request(nhid: int, seq: int) -> bytes:
    """RTM_DELNEXTHOP of object ``nhid``."""
    return _message(RTM_DELNEXTHOP, NLM_F_REQUEST | NLM_F_ACK, seq, _NHMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _u32(NHA_ID, nhid))


def nexthop_dump_request(seq: int) -> bytes:
    """RTM_GETNEXTHOP dump of every object of the namespace."""
    return _message(RTM_GETNEXTHOP, NLM_F_REQUEST | NLM_F_DUMP, seq, _NHMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0))


def _rtmsg(r: RouteSpec, rtype: int = RTN_UNICAST) -> tuple[bytes, bytes]:
    dst, _, plen = r.dst.partition("/")
    table = r.table if r.table < 256 else RT_TABLE_UNSPEC
    head = _RTMSG.pack(socket.AF_INET, int(plen or 32), 0, 0, table, r.proto, RT_SCOPE_UNIVERSE, rtype, 0)
    attrs = _ip4(RTA_DST, dst) + _u32(RTA_TABLE, r.table) + _u32(RTA_PRIORITY, r.metric)
    return head, attrs


def route_request(r: RouteSpec, nhid: int, seq: int) -> bytes:
    """RTM_NEWROUTE (create or replace) of ``r`` pointing at nexthop object ``nhid``."""
    head, attrs = _rtmsg(r)
    if r.prefsrc:
        attrs += _ip4(RTA_PREFSRC, r.prefsrc)
    attrs += _u32(RTA_NH_ID, nhid)
    return _message(RTM_NEWROUTE, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, seq, head + attrs)


def inline_route_request(r: RouteSpec, ifindex: Mapping[str, int], seq: int) -> bytes:
    """RTM_NEWROUTE (create or replace) of ``r`` with its nexthops inline: one nexthop as
    RTA_OIF + RTA_GATEWAY, several as RTA_MULTIPATH (``struct rtnexthop`` each, hops 0 = weight
    1, with its RTA_GATEWAY inside), as ``ip route replace ... nexthop via G dev D ...`` sends
    it (include/uapi/linux/rtnetlink.h).  An empty gateway is a device route (no RTA_GATEWAY).
    Raises KeyError for a nexthop netdev not in ``ifindex`` and ValueError for a route with no
    nexthop."""
    if not r.nexthops:
        raise ValueError(f"route {r.dst} has no nexthop")
    head, attrs = _rtmsg(r)
    if r.prefsrc:
        attrs += _ip4(RTA_PREFSRC, r.prefsrc)
    if len(r.nexthops) == 1:
        nh = r.nexthops[0]
        if nh.gateway:
            attrs += _ip4(RTA_GATEWAY, nh.gateway)
        attrs += _u32(RTA_OIF, ifindex[nh.netdev])
    else:
        mp = b""
        for nh in r.nexthops:
            gw = _ip4(RTA_GATEWAY, nh.gateway) if nh.gateway else b""
            mp += _RTNH.pack(_RTNH.size + len(gw), 0, 0, ifindex[nh.netdev]) + gw
        attrs += _attr(RTA_MULTIPATH, mp)
    return _message(RTM_NEWROUTE, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, seq, head + attrs)


def route_delete_request(r: RouteSpec, seq: int) -> bytes:
    """RTM_DELROUTE of our route ``r`` (matched by dst, table, metric and protocol)."""
    head, attrs = _rtmsg(r, rtype=0)
    return _message(RTM_DELROUTE, NLM_F_REQUEST | NLM_F_ACK, seq, head + attrs)


def route_dump_request(seq: int) -> bytes:
    """RTM_GETROUTE dump of the IPv4 routes (all tables; the caller filters)."""
    return _message(RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP, seq, _RTMSG.pack(socket.AF_INET, 0, 0, 0, 0, 0, 0, 0, 0))


@dataclass(frozen=True)
class NlMsg:
    """One netlink message: type, flags, seq, body (after the nlmsghdr)."""

    type: int
    flags: int
    seq: int
    body: bytes


def parse_messages(data: bytes) -> Iterator[NlMsg]:
    """The netlink messages in one datagram; a truncated tail is dropped."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        n, t, f, seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if n < _NLMSGHDR.size or off + n > len(data):
            return
        yield NlMsg(t, f, seq, data[off + _NLMSGHDR.size: off + n])
        off += _align(n)


def parse_attrs(data: bytes) -> dict[int, bytes]:
    """type -> payload of the netlink attributes in ``data`` (the nested bit stripped; the
    first of a repeated type wins)."""
    out: dict[int, bytes] = {}
    off = 0
    while off + _NLATTR.size <= len(data):
        n, t = _NLATTR.unpack_from(data, off)
        if n < _NLATTR.size or off + n > len(data):
            break
        out.setdefault(t & 0x3FFF, data[off + _NLATTR.size: off + n])
        off += _align(n)
    return out


def nack_errno(m: NlMsg) -> int:
    """The errno of an NLMSG_ERROR (0: an ACK)."""
    return -struct.unpack_from("=i", m.body)[0]


def object_from_msg(body: bytes, names: Mapping[int, str]) -> NexthopObject | None:
    """An RTM_NEWNEXTHOP body as :class:`NexthopObject`; None without NHA_ID.  ``names`` maps
    ifindex -> netdev (unknown: ``if<N>``)."""
    if len(body) < _NHMSG.size:
        return None
    family, _scope, proto, _r, _flags = _NHMSG.unpack_from(body)
    a = parse_attrs(body[_NHMSG.size:])
    if NHA_ID not in a:
        return None
    nhid = struct.unpack("=I", a[NHA_ID][:4])[0]
    group = ()
    if NHA_GROUP in a:
        raw = a[NHA_GROUP]
        group = tuple(_NHGRP.unpack_from(raw, i)[0] for i in range(0, len(raw) - _NHGRP.size + 1, _NHGRP.size))
    netdev = ""
    if NHA_OIF in a:
        oif = struct.unpack("=I", a[NHA_OIF][:4])[0]
        netdev = names.get(oif, f"if{oif}")
    gateway = ""
    if NHA_GATEWAY in a and family == socket.AF_INET and len(a[NHA_GATEWAY]) == 4:
        gateway = socket.inet_ntoa(a[NHA_GATEWAY])
    elif NHA_GATEWAY in a:
        gateway = a[NHA_GATEWAY].hex()  # IPv6: not ours; kept readable for logs
    return NexthopObject(nhid, proto, gateway, netdev, group, NHA_BLACKHOLE in a, NHA_FDB in a)


def route_from_nlmsg(body: bytes, names: Mapping[int, str]) -> RouteSpec | None:
    """An RTM_NEWROUTE body (IPv4 unicast) as :class:`RouteSpec` with ``nhid`` when the route
    points at a nexthop object; None for other families or route types.  Like
    :func:`linkpass.adapters.routes.route_from_msg`: sorted nexthops, "" for no gateway,
    table from RTA_TABLE (else rtm_table)."""
    if len(body) < _RTMSG.size:
        return None
    family, dst_len, _s, _tos, table, proto, _scope, rtype, _flags = _RTMSG.unpack_from(body)
    if family != socket.AF_INET or rtype != RTN_UNICAST:
        return None
    a = parse_attrs(body[_RTMSG.size:])
    dst = socket.inet_ntoa(a[RTA_DST]) if RTA_DST in a else "0.0.0.0"
    if RTA_TABLE in a:
        table = struct.unpack("=I", a[RTA_TABLE][:4])[0]
    metric = struct.unpack("=I", a[RTA_PRIORITY][:4])[0] if RTA_PRIORITY in a else 0
    prefsrc = socket.inet_ntoa(a[RTA_PREFSRC]) if RTA_PREFSRC in a else None
    nhid = struct.unpack("=I", a[RTA_NH_ID][:4])[0] if RTA_NH_ID in a else None
    nhs = []
    if RTA_MULTIPATH in a:
        raw = a[RTA_MULTIPATH]
        off = 0
        while off + _RTNH.size <= len(raw):
            n, _f, _h, oif = _RTNH.unpack_from(raw, off)
            if n < _RTNH.size:
                break
            sub = parse_attrs(raw[off + _RTNH.size: off + n])
            gw = socket.inet_ntoa(sub[RTA_GATEWAY]) if len(sub.get(RTA_GATEWAY, b"")) == 4 else ""
            nhs.append(Nexthop(gw, names.get(oif, f"if{oif}")))
            off += _align(n)
    elif RTA_OIF in a:
        oif = struct.unpack("=I", a[RTA_OIF][:4])[0]
        gw = socket.inet_ntoa(a[RTA_GATEWAY]) if len(a.get(RTA_GATEWAY, b"")) == 4 else ""
        nhs.append(Nexthop(gw, names.get(oif, f"if{oif}")))
    return RouteSpec(f"{dst}/{dst_len}", tuple(sorted(nhs)), prefsrc, int(table or 254), metric, proto, nhid)


class NexthopSocket:
    """One blocking NETLINK_ROUTE socket for nexthop objects and nhid routes (this process's
    network namespace).  Not thread-safe; one request at a time."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        try:  # a NACK carries the refused request's header only, not the whole request (Linux 4.3+)
            self.sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        except OSError:
            pass
        self.sock.settimeout(5.0)
        self.sock.bind((0, 0))
        self._seq = int.from_bytes(os.urandom(2), "little") << 8

    def close(self) -> None:
        self.sock.close()

    def _next(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
        return self._seq

    def request(self, build) -> None:
        """Send the message ``build(seq)`` and wait for its ACK; raises
        :class:`NetlinkNackError` on a NACK, :class:`NetlinkBatchError` (an OSError) when the
        socket fails."""
        e = self.request_many([build(0)])[0]
        if e:
            raise NetlinkNackError(e, os.strerror(e))

    def request_many(self, messages: Sequence[bytes]) -> list[int]:
        """Send the requests ``messages`` (each one whole netlink message; its seq field and
        NLM_F_ACK flag are overwritten) in as few datagrams as possible (:data:`BATCH_MAX`
        requests and :data:`BATCH_BYTES` bytes at most in one), and wait until the kernel has
        handled all of them.  Returns per message the kernel's errno (0: done).

        The kernel handles the messages of one datagram in order, each as if it came alone,
        inside the ``sendmsg``, and answers a refused one with a NACK whether or not it asked
        for an ACK (``netlink_rcv_skb``, net/netlink/af_netlink.c: ``if (nlh->nlmsg_flags &
        NLM_F_ACK || err) netlink_ack(...)``); a NACK does not stop the messages after it.  So
        only the last message of a datagram asks for an ACK: when its answer is read, every
        message before it was handled and the NACKs among them were read before it.  A plan's
        replacements cost one ``sendmsg`` and one ``recv`` per refusal plus one, not a
        ``sendmsg`` and a ``recv`` each.

        Raises:
            ValueError: a message whose header's length is not its length (nothing was sent).
            NetlinkBatchError: the socket failed (``socket.timeout`` after 5 s without the
                answer, ENOBUFS: answers lost to a full receive buffer, a refused ``sendmsg``);
                its ``results`` say which requests are known done or refused, the others may
                or may not have been done.  What the socket still held is read and dropped, so
                the next request starts clean.
        """
        for i, m in enumerate(messages):
            if len(m) < _NLMSGHDR.size or _NLMSGHDR.unpack_from(m)[0] != len(m):
                raise ValueError(f"netlink request {i} is {len(m)} bytes, and its header does not say so")
        out: list[int | None] = [None] * len(messages)
        start = 0
        while start < len(messages):
            buf = bytearray()
            seq_of: dict[int, int] = {}
            i, last_off, last_seq = start, 0, 0
            while i < len(messages) and len(seq_of) < BATCH_MAX and (not seq_of or len(buf) + len(messages[i]) <= BATCH_BYTES):
                last_seq = self._next()
                seq_of[last_seq] = i
                last_off = len(buf)
                buf += messages[i]
                buf += b"\0" * (_align(len(buf)) - len(buf))
                _SEQ.pack_into(buf, last_off + _SEQ_OFF, last_seq)
                flags = _FLAGS.unpack_from(buf, last_off + _FLAGS_OFF)[0]
                _FLAGS.pack_into(buf, last_off + _FLAGS_OFF, flags & ~NLM_F_ACK)
                i += 1
            flags = _FLAGS.unpack_from(buf, last_off + _FLAGS_OFF)[0]
            _FLAGS.pack_into(buf, last_off + _FLAGS_OFF, flags | NLM_F_ACK)
            try:
                self.sock.send(buf)
                answered = False
                while not answered:
                    for m in parse_messages(self.sock.recv(65536)):
                        if m.type != NLMSG_ERROR:
                            continue
                        j = seq_of.get(m.seq)  # None: a late answer to an earlier, failed batch
                        if j is not None:
                            out[j] = nack_errno(m)
                            answered = answered or m.seq == last_seq
            except OSError as e:
                self._drain(seq_of, out)
                raise NetlinkBatchError(e, out) from e
            for j in seq_of.values():
                if out[j] is None:
                    out[j] = 0
            start = i
        return out  # type: ignore[return-value]  # every entry is set once its datagram was answered

    def _drain(self, seq_of: Mapping[int, int], out: list[int | None]) -> None:
        """Read and drop whatever the socket holds (answers a failed batch left behind; after
        ENOBUFS the kernel drops every new answer until the queue is empty), keeping the NACKs
        of this batch's requests (``seq_of``: seq -> index into ``out``).  A request without a
        NACK here is left unknown: a NACK can be lost without the socket being marked."""
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0)  # with a timeout, Python waits for data before each recv
        try:
            while True:
                for m in parse_messages(self.sock.recv(65536)):
                    j = seq_of.get(m.seq) if m.type == NLMSG_ERROR else None
                    if j is not None:
                        e = nack_errno(m)
                        if e:
                            out[j] = e
        except OSError:
            pass  # empty (EAGAIN), or the socket itself failed: the next request finds out
        finally:
            self.sock.settimeout(timeout)

    def dump(self, build) -> list[NlMsg]:
        """Send the dump request ``build(seq)``; the messages up to NLMSG_DONE."""
        seq = self._next()
        self.sock.send(build(seq))
        out: list[NlMsg] = []
        while True:
            for m in parse_messages(self.sock.recv(1 << 20)):
                if m.seq != seq:
                    continue
                if m.type == NLMSG_DONE:
                    return out
                if m.type == NLMSG_ERROR:
                    e = nack_errno(m)
                    if e:
                        raise NetlinkNackError(e, os.strerror(e))
                    return out
                out.append(m)

    def objects(self, names: Mapping[int, str]) -> list[NexthopObject]:
        """Every nexthop object of the namespace (an empty list where the kernel has none)."""
        try:
            msgs = self.dump(nexthop_dump_request)
        except NetlinkNackError as e:
            if e.errno in (_errno.EOPNOTSUPP, _errno.EINVAL):
                return []
            raise
        out = []
        for m in msgs:
            if m.type == RTM_NEWNEXTHOP:
                o = object_from_msg(m.body, names)
                if o is not None:
                    out.append(o)
        return out

    def routes(self, names: Mapping[int, str], table: int) -> list[RouteSpec]:
        """Every IPv4 unicast route of ``table``."""
        out = []
        for m in self.dump(route_dump_request):
            if m.type == RTM_NEWROUTE:
                r = route_from_nlmsg(m.body, names)
                if r is not None and r.table == table:
                    out.append(r)
        return out
