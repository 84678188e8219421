"""The pure parts of linkpass/adapters/netlink.py and routes.py on recorded kernel messages:
rtnetlink messages -> events, route dumps -> RouteSpec, desired routes -> netlink requests,
neighbour dumps -> entries to purge.

The messages in tests/fixtures/netlink/ were recorded from a real kernel in a network namespace
of their own by tests/fixtures/netlink/record.py (see its docstring); each is rebuilt here as
the pyroute2 message object the adapters receive (the dumped dict loaded, encoded to bytes and
decoded again, so nested attributes such as RTA_MULTIPATH are message objects as on the wire).
"""

from __future__ import annotations

import errno
import importlib
import json
import struct
from pathlib import Path

import pytest
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from linkpass.adapters import nhlink
from linkpass.adapters.netlink import event_from_msg, snapshot_events
from linkpass.adapters.routes import (
    NUD_FAILED,
    NUD_INCOMPLETE,
    link_names,
    neighbors_to_purge,
    route_from_msg,
)
from linkpass.adapters.nhlink import (
    RTM_DELROUTE,
    RTM_NEWROUTE,
    inline_route_request,
    parse_messages,
    route_delete_request,
    route_from_nlmsg,
)
from linkpass.core.model import AddrChanged, LinkChanged, LinkFacts, LinkSnapshot, Nexthop, RouteChanged, RouteSpec
from linkpass.core.reconcile import diff

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "netlink"
T = 123_000_000  # any monotonic ns
RAIL0, RAIL1 = 3, 5  # the ifindexes the recording gave rail0 and rail1
PEER_DSTS = {"198.19.0.2/32", "198.19.0.3/32"}


def rebuild(rec: dict):
    """The pyroute2 message a recorded ``{"class", "msg"}`` entry stands for."""
    mod, name = rec["class"].rsplit(".", 1)
    cls = getattr(importlib.import_module(mod), name)
    m = cls().load(rec["msg"])
    m.encode()
    out = cls(m.data)
    out.decode()
    out["event"] = rec["msg"]["event"]  # pyroute2 sets it from the header type on receipt
    return out


def dumps() -> dict:
    return {k: [rebuild(r) for r in v] for k, v in json.loads((FIXTURES / "dumps.json").read_text()).items()}


def steps() -> dict:
    return {s["step"]: [rebuild(r) for r in s["messages"]] for s in json.loads((FIXTURES / "events.json").read_text())}


def ours_or_our_dsts(dst: str, proto: int) -> bool:  # what the daemon's route filter selects
    return proto == 201 or dst in PEER_DSTS


def translate(msgs, ifindex=None) -> list:
    ifindex = {RAIL0: "rail0", RAIL1: "rail1"} if ifindex is None else ifindex
    return [e for m in msgs if (e := event_from_msg(m, T, ifindex, ours_or_our_dsts)) is not None]


def test_link_dump_becomes_one_snapshot_and_the_ifindex_map():
    d = dumps()
    ifindex, events = snapshot_events(d["link_dump_down"], [], T, "start")
    assert ifindex == {RAIL0: "rail0", RAIL1: "rail1"}
    assert events == [LinkSnapshot((LinkFacts("rail0", True, False, False, "DOWN"),
                                    LinkFacts("rail1", True, False, False, "DOWN")), T, "start")]
    _, (snap,) = snapshot_events(d["link_dump_up"], [], T, "overrun")
    assert [(f.netdev, f.healthy, f.operstate) for f in snap.links] == [("rail0", True, "UP"), ("rail1", True, "UP")]
    assert snap.reason == "overrun"


def test_streamed_messages_become_events_step_by_step():
    s = steps()
    # the kernel sets IFF_LOWER_UP before its link watch moves operstate to UP: the first
    # message has carrier but is not healthy yet, the second one is
    up = translate(s["link set up"])
    assert up == [
        LinkChanged(LinkFacts("rail0", True, True, True, "LOWERLAYERDOWN"), T),
        LinkChanged(LinkFacts("rail0", True, True, True, "UP"), T),
        LinkChanged(LinkFacts("rail1", True, True, True, "LOWERLAYERDOWN"), T),
        LinkChanged(LinkFacts("rail1", True, True, True, "UP"), T),
    ]
    assert [e.facts.healthy for e in up] == [False, True, False, True]
    # the address and its kernel routes (proto 2, not ours, not our destinations: filtered out)
    assert translate(s["addr add"]) == [AddrChanged("rail0", "198.18.0.1", 24, True, T),
                                        AddrChanged("rail1", "198.18.1.1", 24, True, T)]
    assert translate(s["route add"]) == [RouteChanged("198.19.0.2/32", 201, 254, False, T),
                                         RouteChanged("198.19.0.3/32", 201, 254, False, T)]
    # switch-side carrier loss: admin still up, no carrier; then admin down
    (carrier,) = translate(s["carrier lost"])
    assert carrier.facts == LinkFacts("rail0", True, True, False, "LOWERLAYERDOWN") and not carrier.facts.healthy
    assert translate(s["admin down"]) == [LinkChanged(LinkFacts("rail0", True, False, False, "DOWN"), T)]
    assert translate(s["route del"]) == [RouteChanged("198.19.0.3/32", 201, 254, True, T)]
    assert translate(s["addr del"]) == [AddrChanged("rail1", "198.18.1.1", 24, False, T)]
    assert translate(s["link del"]) == [LinkChanged(LinkFacts("rail1", True, False, False, "DOWN"), T),
                                        LinkChanged(LinkFacts("rail1", False, False, False, "NOTPRESENT"), T)]


def test_messages_left_out_and_undecodable_ones():
    s = steps()
    # an address on an ifindex not (yet) known: nothing rather than a guess
    assert translate(s["addr add"], ifindex={}) == []
    # no filter: every route message, the kernel's local/broadcast ones included
    routes = [e for m in s["addr add"] if isinstance(e := event_from_msg(m, T, {}), RouteChanged)]
    assert {(e.dst, e.proto) for e in routes} >= {("198.18.0.0/24", 2), ("198.18.1.0/24", 2)}
    # a link message that lost its name cannot be a LinkChanged: the monitor counts it as bad
    nameless = s["carrier lost"][0]
    nameless["attrs"] = [a for a in nameless["attrs"] if a[0] != "IFLA_IFNAME"]
    with pytest.raises(ValueError, match="without an interface name"):
        event_from_msg(nameless, T, {})
    assert event_from_msg({"event": "RTM_NEWNEIGH"}, T, {}) is None


def test_route_dump_becomes_route_specs():
    d = dumps()
    names = link_names(d["link_dump_up"])
    assert names == {RAIL0: "rail0", RAIL1: "rail1"}
    got = [route_from_msg(m, names) for m in d["route_dump"]]
    assert got == [
        RouteSpec("198.18.0.0/24", (Nexthop("", "rail0"),), "198.18.0.1", 254, 0, 2),
        RouteSpec("198.18.1.0/24", (Nexthop("", "rail1"),), "198.18.1.1", 254, 0, 2),
        RouteSpec("198.19.0.2/32", (Nexthop("198.18.0.2", "rail0"), Nexthop("198.18.1.2", "rail1")), "198.18.0.1", 254, 0, 201),
        RouteSpec("198.19.0.3/32", (Nexthop("198.18.1.3", "rail1"),), None, 254, 0, 201),
    ]
    # an ifindex the link dump did not name still reads as something, never a crash
    assert route_from_msg(d["route_dump"][3], {}).nexthops == (Nexthop("198.18.1.3", "if5"),)


def decoded(req: bytes) -> tuple[int, int, dict]:
    """(nlmsg type, flags, the rtmsg as pyroute2 decodes it): an independent reading of our
    encoder's bytes."""
    (m,) = parse_messages(req)
    msg = rtmsg(req)  # pyroute2 reads the nlmsghdr too
    msg.decode()
    out = {"dst": msg.get("dst"), "dst_len": msg["dst_len"], "table": msg.get("table"), "proto": msg["proto"],
           "priority": msg.get("priority"), "prefsrc": msg.get("prefsrc"), "gateway": msg.get("gateway"), "oif": msg.get("oif")}
    mp = msg.get("multipath")
    out["multipath"] = [(h.get("gateway"), h["oif"], h["hops"]) for h in mp] if mp else None
    return m.type, m.flags, out


def test_requests_rebuild_the_recorded_routes():
    """Our inline route requests, read back by pyroute2's decoder, carry what the kernel
    reported for the recorded routes (RTA_MULTIPATH with one rtnexthop per rail, or
    RTA_GATEWAY + RTA_OIF); NLM_F_CREATE|NLM_F_REPLACE|NLM_F_ACK."""
    d = dumps()
    names = link_names(d["link_dump_up"])
    ifindex = {v: k for k, v in names.items()}
    by_dst = {m.get("dst"): m for m in d["route_dump"]}
    rec = by_dst["198.19.0.2"]
    mtype, flags, mp = decoded(inline_route_request(route_from_msg(rec, names), ifindex, 7))
    assert (mtype, flags) == (RTM_NEWROUTE, 0x1 | 0x4 | 0x400 | 0x100)
    assert mp == {"dst": "198.19.0.2", "dst_len": 32, "table": 254, "proto": 201, "priority": 0, "prefsrc": "198.18.0.1",
                  "gateway": None, "oif": None, "multipath": [("198.18.0.2", RAIL0, 0), ("198.18.1.2", RAIL1, 0)]}
    assert [(nh.get("gateway"), nh.get("oif")) for nh in rec.get("multipath")] == [(g, o) for g, o, _ in mp["multipath"]]
    _, _, one = decoded(inline_route_request(route_from_msg(by_dst["198.19.0.3"], names), ifindex, 8))
    assert one == {"dst": "198.19.0.3", "dst_len": 32, "table": 254, "proto": 201, "priority": 0, "prefsrc": None,
                   "gateway": "198.18.1.3", "oif": RAIL1, "multipath": None}
    with pytest.raises(KeyError):
        inline_route_request(route_from_msg(by_dst["198.19.0.3"], names), {}, 9)
    with pytest.raises(ValueError, match="198.19.0.9/32"):
        inline_route_request(RouteSpec("198.19.0.9/32", ()), ifindex, 10)


def test_inline_requests_read_back_as_the_route_they_encode():
    """Encoder and our own decoder agree (a route dump of what we installed compares equal),
    including a device route (no gateway), a metric, a table above 255 and three nexthops."""
    idx = {"rail0": 3, "rail1": 5, "rail2": 9}
    names = {v: k for k, v in idx.items()}
    routes = [
        RouteSpec("198.19.0.2/32", (Nexthop("198.18.0.2", "rail0"), Nexthop("198.18.1.2", "rail1"), Nexthop("198.18.2.2", "rail2")),
                  "198.18.0.1", 254, 0, 201),
        RouteSpec("198.19.4.0/24", (Nexthop("", "rail1"),), None, 1000, 7, 201),
        RouteSpec("198.19.0.3/32", (Nexthop("198.18.2.3", "rail2"),), "198.18.2.1", 254, 20, 201),
    ]
    for r in routes:
        (m,) = parse_messages(inline_route_request(r, idx, 1))
        assert route_from_nlmsg(m.body, names) == r


def test_desired_routes_against_the_recorded_kernel_become_ordered_requests():
    """rail0 lost: the multipath route to h1 moves onto rail1 alone, the route to h2 is no longer
    wanted; the kernel's connected routes (proto 2) are never touched."""
    d = dumps()
    names = link_names(d["link_dump_up"])
    ifindex = {v: k for k, v in names.items()}
    observed = [route_from_msg(m, names) for m in d["route_dump"]]
    want = [RouteSpec("198.19.0.2/32", (Nexthop("198.18.1.2", "rail1"),), "198.18.1.1", 254, 0, 201)]
    ops = diff(want, observed, 201).ops
    reqs = [decoded(inline_route_request(op.route, ifindex, 1) if op.op == "replace" else route_delete_request(op.route, 2))
            for op in ops]
    assert [(t, m) for t, _, m in reqs] == [
        (RTM_NEWROUTE, {"dst": "198.19.0.2", "dst_len": 32, "table": 254, "proto": 201, "priority": 0, "prefsrc": "198.18.1.1",
                        "gateway": "198.18.1.2", "oif": RAIL1, "multipath": None}),
        (RTM_DELROUTE, {"dst": "198.19.0.3", "dst_len": 32, "table": 254, "proto": 201, "priority": 0, "prefsrc": None,
                        "gateway": None, "oif": None, "multipath": None}),
    ]
    assert not diff(observed[2:], observed, 201).ops  # the kernel already has what we want


def test_neighbour_purge_picks_dynamic_entries_of_that_netdev_only():
    entries = dumps()["neigh_dump"]
    assert {(m.get("dst"), m.get("ifindex")) for m in entries} == {
        ("198.18.0.77", RAIL0), ("198.18.0.78", RAIL0), ("198.18.1.77", RAIL1)}
    assert neighbors_to_purge(entries, RAIL0) == ["198.18.0.77"]  # .78 is permanent: not ours
    assert neighbors_to_purge(entries, RAIL1) == ["198.18.1.77"]
    # a rail whose link came back: only unresolved entries (these are STALE, so none)
    assert neighbors_to_purge(entries, RAIL0, only_states=NUD_INCOMPLETE | NUD_FAILED) == []


class _FakeNetlink:
    """Stands in for the NETLINK_ROUTE socket as rtnetlink behaves (netlink_rcv_skb): each
    datagram's requests are handled in order; a refused one (index over all requests in
    ``refuse`` -> errno) is answered with a NACK, a done one with an ACK only if it asked for
    one.  ``stale`` (answers to an earlier, failed batch) and a message that is no answer come
    first.  ``fail_recv``: the n-th recv raises ENOBUFS (answers still queued stay)."""

    def __init__(self, refuse: dict[int, int] | None = None, stale: bytes = b"", fail_recv: int | None = None):
        self.sent: list[bytes] = []
        self.refuse = refuse or {}
        self.queue: list[bytes] = []
        self.stale = stale
        self.fail_recv = fail_recv
        self.recvs = 0
        self.n = 0

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        if self.stale:
            self.queue.append(self.stale)
            self.stale = b""
        self.queue.append(struct.pack("=IHHII", 16, 99, 0, 0, 0))  # not an answer: ignored
        for m in nhlink.parse_messages(bytes(data)):
            hdr = struct.pack("=IHHII", 16 + len(m.body), 24, m.flags, m.seq, 0)
            err = self.refuse.get(self.n, 0)
            self.n += 1
            if err or m.flags & nhlink.NLM_F_ACK:
                self.queue.append(struct.pack("=IHHII", 16 + 4 + 16, nhlink.NLMSG_ERROR, 0, m.seq, 0) + struct.pack("=i", -err) + hdr)
        return len(data)

    timeout: float | None = 5.0

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, t: float | None) -> None:
        self.timeout = t

    def recv(self, n: int, flags: int = 0) -> bytes:
        self.recvs += 1
        if self.recvs == self.fail_recv:
            raise OSError(errno.ENOBUFS, "No buffer space available")
        if not self.queue:  # what a real socket does with nothing queued
            raise BlockingIOError(errno.EAGAIN, "empty") if self.timeout == 0 else TimeoutError("timed out")
        return self.queue.pop(0)

    def close(self) -> None:
        pass


def _request(i: int, flags: int = nhlink.NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBBBBBBBI", 2, 32, 0, 0, 254, 201, 0, 1, 0) + bytes([8, 0, 1, 0, 198, 19, i // 250, 1 + i % 250])
    return struct.pack("=IHHII", 16 + len(body), 24, flags, 0, 0) + body


def test_request_many_answers_each_request_in_order_and_splits_big_batches():
    nl = nhlink.NexthopSocket()
    nl.sock.close()
    nl._seq = 1000  # the stale answer below is to seq 1000, the last one before ours
    nl.sock = fake = _FakeNetlink(refuse={5: 19, 200: 101}, stale=struct.pack("=IHHII", 36, nhlink.NLMSG_ERROR, 0, 1000, 0) + struct.pack("=i", -1) + bytes(16))
    errnos = nl.request_many([_request(i) for i in range(300)])
    assert [(i, e) for i, e in enumerate(errnos) if e] == [(5, 19), (200, 101)]
    assert [len(list(nhlink.parse_messages(d))) for d in fake.sent] == [nhlink.BATCH_MAX, nhlink.BATCH_MAX, 300 - 2 * nhlink.BATCH_MAX]
    msgs = [m for d in fake.sent for m in nhlink.parse_messages(d)]
    assert len({m.seq for m in msgs}) == 300  # every request its own seq (answers are matched by it)
    # only the last request of a datagram asks for an ACK: the kernel NACKs a refused one anyway
    last = {nhlink.BATCH_MAX - 1, 2 * nhlink.BATCH_MAX - 1, 299}
    assert [i for i, m in enumerate(msgs) if m.flags & nhlink.NLM_F_ACK] == sorted(last)
    assert fake.queue == []  # every answer read


def test_a_socket_failure_mid_batch_says_what_is_known_and_leaves_the_socket_clean():
    nl = nhlink.NexthopSocket()
    nl.sock.close()
    # 3 datagrams; the recv after the first datagram's answers fails: the first datagram is
    # known (one refusal), the other two unknown; the answers still queued are dropped
    nl.sock = fake = _FakeNetlink(refuse={3: 22}, fail_recv=4)
    with pytest.raises(nhlink.NetlinkBatchError) as e:
        nl.request_many([_request(i) for i in range(300)])
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOBUFS and "172 of 300 requests unconfirmed" in str(e.value)
    r = e.value.results
    assert r[:nhlink.BATCH_MAX] == [0, 0, 0, 22] + [0] * (nhlink.BATCH_MAX - 4) and r[nhlink.BATCH_MAX:] == [None] * 172
    assert fake.queue == [] and len(fake.sent) == 2 and fake.timeout == 5.0
    fake.fail_recv = None
    assert nl.request_many([_request(1)]) == [0]  # the next request is not confused by old answers


def test_the_drain_after_a_failure_keeps_the_nacks_it_finds():
    nl = nhlink.NexthopSocket()
    nl.sock.close()
    # the first recv fails (ENOBUFS is reported before the queued answers): the NACK of request
    # 2 is still in the queue and is kept; the others stay unknown (a NACK can be lost)
    nl.sock = _FakeNetlink(refuse={2: 101}, fail_recv=1)
    with pytest.raises(nhlink.NetlinkBatchError) as e:
        nl.request_many([_request(i) for i in range(5)])
    assert e.value.results == [None, None, 101, None, None] and "4 of 5 requests unconfirmed" in str(e.value)


def test_the_drain_never_waits_on_a_real_socket():
    class Watch:  # the real socket, noting its timeout at each recv
        def __init__(self, s):
            self.s, self.seen = s, []

        def recv(self, n, flags=0):
            self.seen.append(self.s.gettimeout())
            return self.s.recv(n, flags)

        def __getattr__(self, name):
            return getattr(self.s, name)

    nl = nhlink.NexthopSocket()
    nl.sock = w = Watch(nl.sock)
    nl.sock.settimeout(2.0)  # a drain that waited would wait this long, then fail the check
    nl._drain({}, [])  # nothing queued: one recv, which must not wait for data
    assert w.seen == [0.0] and nl.sock.gettimeout() == 2.0
    nl.close()


def test_a_timeout_is_etimedout():
    e = nhlink.NetlinkBatchError(TimeoutError("timed out"), [None, 0])
    assert e.errno == errno.ETIMEDOUT and str(e) == "[Errno 110] timed out (1 of 2 requests unconfirmed)"


def test_a_datagram_holds_at_most_batch_bytes():
    nl = nhlink.NexthopSocket()
    nl.sock.close()
    nl.sock = fake = _FakeNetlink()
    big = [_request(i) + bytes(4000) for i in range(20)]  # padded: about 4 KiB a request
    big = [struct.pack("=I", len(m)) + m[4:] for m in big]
    assert nl.request_many(big) == [0] * 20
    assert all(len(d) <= nhlink.BATCH_BYTES for d in fake.sent) and len(fake.sent) == 3


def test_request_many_sets_the_ack_it_needs_and_refuses_a_bad_length():
    nl = nhlink.NexthopSocket()
    nl.sock.close()
    nl.sock = fake = _FakeNetlink()
    assert nl.request_many([_request(1, flags=nhlink.NLM_F_REQUEST)]) == [0]  # without the flag set here: a timeout
    with pytest.raises(ValueError, match="request 1 is 8 bytes"):
        nl.request_many([_request(1), b"\0" * 8])
    with pytest.raises(ValueError, match="request 0 is 40 bytes"):
        nl.request_many([_request(1) + bytes(4)])  # its header says 36
    assert len(fake.sent) == 1  # nothing of the refused calls was sent


def test_request_raises_the_nack():
    nl = nhlink.NexthopSocket()
    nl.sock.close()
    nl.sock = _FakeNetlink(refuse={0: 17})
    with pytest.raises(nhlink.NetlinkNackError) as e:
        nl.request(lambda seq: _request(3))
    assert e.value.errno == 17
