"""The pure parts of linkpass/adapters/netlink.py and routes.py on recorded kernel messages:
rtnetlink messages -> events, route dumps -> RouteSpec, desired routes -> netlink requests,
neighbour dumps -> entries to purge.

The messages in tests/fixtures/netlink/ were recorded from a real kernel in a network namespace
of their own by tests/fixtures/netlink/record.py (see its docstring); each is rebuilt here as
the pyroute2 message object the adapters receive (the dumped dict loaded, encoded to bytes and
decoded again, so nested attributes such as RTA_MULTIPATH are message objects as on the wire).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from linkpass.adapters.netlink import event_from_msg, snapshot_events
from linkpass.adapters.routes import (
    NUD_FAILED,
    NUD_INCOMPLETE,
    delete_request,
    link_names,
    neighbors_to_purge,
    replace_request,
    route_from_msg,
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


def test_requests_rebuild_the_recorded_routes():
    d = dumps()
    names = link_names(d["link_dump_up"])
    ifindex = {v: k for k, v in names.items()}
    by_dst = {m.get("dst"): m for m in d["route_dump"]}
    mp = replace_request(route_from_msg(by_dst["198.19.0.2"], names), ifindex)
    assert mp == {"dst": "198.19.0.2/32", "table": 254, "proto": 201, "priority": 0, "prefsrc": "198.18.0.1",
                  "multipath": [{"gateway": "198.18.0.2", "oif": RAIL0}, {"gateway": "198.18.1.2", "oif": RAIL1}]}
    rec = by_dst["198.19.0.2"]
    assert [(nh.get("gateway"), nh.get("oif")) for nh in rec.get("multipath")] == [(h["gateway"], h["oif"]) for h in mp["multipath"]]
    one = replace_request(route_from_msg(by_dst["198.19.0.3"], names), ifindex)
    assert one == {"dst": "198.19.0.3/32", "table": 254, "proto": 201, "priority": 0, "gateway": "198.18.1.3", "oif": RAIL1}
    with pytest.raises(KeyError):
        replace_request(route_from_msg(by_dst["198.19.0.3"], names), {})


def test_desired_routes_against_the_recorded_kernel_become_ordered_requests():
    """rail0 lost: the multipath route to h1 moves onto rail1 alone, the route to h2 is no longer
    wanted; the kernel's connected routes (proto 2) are never touched."""
    d = dumps()
    names = link_names(d["link_dump_up"])
    ifindex = {v: k for k, v in names.items()}
    observed = [route_from_msg(m, names) for m in d["route_dump"]]
    want = [RouteSpec("198.19.0.2/32", (Nexthop("198.18.1.2", "rail1"),), "198.18.1.1", 254, 0, 201)]
    ops = diff(want, observed, 201).ops
    reqs = [(op.op, replace_request(op.route, ifindex) if op.op == "replace" else delete_request(op.route)) for op in ops]
    assert reqs == [
        ("replace", {"dst": "198.19.0.2/32", "table": 254, "proto": 201, "priority": 0, "prefsrc": "198.18.1.1",
                     "gateway": "198.18.1.2", "oif": RAIL1}),
        ("delete", {"dst": "198.19.0.3/32", "table": 254, "priority": 0, "proto": 201}),
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
