"""Nexthop objects: nh_diff (desired routes vs kernel objects) and the rtnetlink codec."""

from __future__ import annotations

import socket
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.adapters import nhlink
from linkpass.core.model import Nexthop, RouteSpec
from linkpass.core.nexthops import IdRange, IdsExhausted, NexthopObject, apply_to_picture, nh_diff

OURS = 201
IDS = IdRange(1000, 100)
N0 = Nexthop("198.18.0.2", "rail0", 0)
N1 = Nexthop("198.18.1.2", "rail1", 1)


def want(dst: str = "198.19.0.2/32", *nhs: Nexthop, src: str | None = "198.19.0.1") -> RouteSpec:
    return RouteSpec(dst, tuple(sorted(nhs or (N0, N1))), src, 254, 0, OURS)


def leaf(i: int, nh: Nexthop, proto: int = OURS) -> NexthopObject:
    return NexthopObject(i, proto, nh.gateway, nh.netdev)


def group(i: int, *members: int, proto: int = OURS) -> NexthopObject:
    return NexthopObject(i, proto, group=members)


def routed(r: RouteSpec, nhid: int | None, proto: int = OURS) -> RouteSpec:
    return RouteSpec(r.dst, r.nexthops, r.prefsrc, r.table, r.metric, proto, nhid)


def ops(d) -> list[str]:
    return [op.describe() for op in d.ops]


def test_empty_kernel_gets_leaves_a_group_and_a_route():
    d = nh_diff([want()], [], [], OURS, IDS)
    assert ops(d) == ["add-nexthop id 1000 via 198.18.0.2 dev rail0 proto 201",
                      "add-nexthop id 1001 via 198.18.1.2 dev rail1 proto 201",
                      "replace-group id 1002 group 1000/1001 proto 201",
                      "replace-route 198.19.0.2/32 table 254 metric 0 nhid 1002"]


def test_rail_lost_is_one_group_replace_and_the_route_is_not_touched():
    objs = [leaf(1000, N0), leaf(1001, N1), group(1002, 1000, 1001)]
    d = nh_diff([want("198.19.0.2/32", N1)], [routed(want(), 1002)], objs, OURS, IDS)
    assert ops(d) == ["replace-group id 1002 group 1001 proto 201", "delete-nexthop id 1000 via 198.18.0.2 dev rail0 proto 201"]


def test_matching_kernel_state_needs_nothing_so_a_restart_changes_nothing():
    objs = [leaf(1000, N0), leaf(1001, N1), group(1002, 1001, 1000)]
    assert nh_diff([want()], [routed(want(), 1002)], objs, OURS, IDS).ops == ()


def test_leaf_flushed_by_the_kernel_is_re_added_at_failback():
    """Carrier loss deleted leaf 1000 and took it out of the group (nexthop_flush_dev)."""
    objs = [leaf(1001, N1), group(1002, 1001)]
    d = nh_diff([want()], [routed(want("198.19.0.2/32", N1), 1002)], objs, OURS, IDS)
    assert ops(d) == ["add-nexthop id 1000 via 198.18.0.2 dev rail0 proto 201", "replace-group id 1002 group 1000/1001 proto 201"]


def test_ids_held_by_others_are_skipped_and_their_objects_never_touched():
    objs = [NexthopObject(1000, 3, "198.18.0.2", "rail0"), NexthopObject(1001, OURS, blackhole=True, netdev=""),
            NexthopObject(5, OURS, "198.18.0.9", "rail0"), group(1003, 1000, proto=3)]
    d = nh_diff([want()], [], objs, OURS, IDS)
    touched = {op.obj.id for op in d.ops if op.obj is not None}
    assert touched == {1001, 1002, 1004, 1005}  # new ones skip 1000/1001/1003; our stray blackhole 1001 goes
    assert not any(op.op.startswith("delete") and op.obj.id in (1000, 1003, 5) for op in d.ops if op.obj)


def test_our_blackhole_in_range_is_garbage_and_outside_the_range_is_not_ours():
    objs = [NexthopObject(1001, OURS, blackhole=True), NexthopObject(5, OURS, "198.18.0.9", "rail0")]
    d = nh_diff([], [], objs, OURS, IDS)
    assert ops(d) == ["delete-nexthop id 1001 blackhole proto 201"]


def test_route_of_ours_pointing_at_a_foreign_group_is_moved_to_our_own():
    objs = [NexthopObject(7, 3, group=(8,)), NexthopObject(8, 3, "198.18.0.2", "rail0")]
    d = nh_diff([want()], [routed(want(), 7)], objs, OURS, IDS)
    assert ops(d)[-1] == "replace-route 198.19.0.2/32 table 254 metric 0 nhid 1002"
    assert not any(op.op.startswith("delete") for op in d.ops)


def test_foreign_route_slot_is_a_conflict():
    d = nh_diff([want()], [routed(want(), None, proto=4)], [], OURS, IDS)
    assert d.ops == () and "held by a route of proto 4" in d.conflicts[0]


def test_dropped_destination_goes_with_its_group_but_a_kept_one_stays():
    objs = [leaf(1000, N0), group(1001, 1000), group(1002, 1000)]
    a, b = want("198.19.0.2/32", N0), want("198.19.0.3/32", N0)
    d = nh_diff([], [routed(a, 1001), routed(b, 1002)], objs, OURS, IDS, keep_dsts=frozenset({b.dst}))
    assert ops(d) == ["delete-route 198.19.0.2/32 table 254 metric 0", "delete-group id 1001 group 1000 proto 201"]


def test_group_used_by_a_foreign_route_is_not_deleted():
    objs = [leaf(1000, N0), group(1001, 1000)]
    d = nh_diff([], [routed(want("198.19.9.9/32", N0), 1001, proto=4)], objs, OURS, IDS)
    assert d.ops == ()


def test_inline_route_of_ours_is_converted_with_one_route_replace():
    d = nh_diff([want()], [routed(want(), None)], [], OURS, IDS)
    assert [op.op for op in d.ops] == ["add-nexthop", "add-nexthop", "replace-group", "replace-route"]


def test_full_id_range_is_an_error():
    objs = [NexthopObject(i, 3) for i in range(IDS.first, IDS.first + IDS.count)]
    try:
        nh_diff([want()], [], objs, OURS, IDS)
    except IdsExhausted as e:
        assert "no free nexthop id in 1000..1099" in str(e)
    else:
        raise AssertionError("expected IdsExhausted")


NHS = st.lists(st.sampled_from([N0, N1, Nexthop("198.18.2.2", "rail2", 2)]), min_size=1, max_size=3, unique=True)
PLANS = st.lists(st.tuples(st.sampled_from(["198.19.0.2/32", "198.19.0.3/32", "198.19.0.4/32"]), NHS), max_size=3,
                 unique_by=lambda t: t[0])


@settings(max_examples=150, deadline=None)
@given(st.lists(PLANS, min_size=1, max_size=4))
def test_applying_the_diff_reaches_the_plan_and_a_second_diff_is_empty(plans):
    routes: list[RouteSpec] = []
    objects: list[NexthopObject] = [NexthopObject(1003, 3, "198.18.9.9", "rail0")]
    for p in plans:
        desired = [want(dst, *nhs) for dst, nhs in p]
        d = nh_diff(desired, routes, objects, OURS, IDS)
        routes, objects = apply_to_picture(d.ops, routes, objects)
        assert nh_diff(desired, routes, objects, OURS, IDS).ops == ()
        by_id = {o.id: o for o in objects}
        for w in desired:
            r = next(r for r in routes if r.dst == w.dst)
            members = {(by_id[i].gateway, by_id[i].netdev) for i in by_id[r.nhid].group}
            assert members == {(n.gateway, n.netdev) for n in w.nexthops}
        assert {r.dst for r in routes} == {w.dst for w in desired}
        assert by_id[1003].proto == 3  # the foreign object survives every plan
        used = {r.nhid for r in routes} | {m for r in routes for m in by_id[r.nhid].group} | {1003}
        assert set(by_id) == used  # no garbage of ours left


# ------------------------------------------------------------------ codec


def _reply(mtype: int, body: bytes, seq: int = 7, flags: int = nhlink.NLM_F_MULTI) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), mtype, flags, seq, 0) + body


def _body(msg: bytes) -> bytes:
    (m,) = list(nhlink.parse_messages(msg))
    return m.body


def test_leaf_request_round_trips_through_the_decoder():
    obj = NexthopObject(1000, OURS, "198.18.0.2", "rail0")
    msg = nhlink.nexthop_request(obj, {"rail0": 4}, seq=9)
    (m,) = list(nhlink.parse_messages(msg))
    assert m.type == nhlink.RTM_NEWNEXTHOP and m.seq == 9
    assert m.flags & nhlink.NLM_F_REPLACE and m.flags & nhlink.NLM_F_CREATE and m.flags & nhlink.NLM_F_ACK
    assert nhlink.object_from_msg(m.body, {4: "rail0"}) == obj


def test_group_request_round_trips_and_keeps_member_order():
    obj = NexthopObject(1002, OURS, group=(1001, 1000))
    assert nhlink.object_from_msg(_body(nhlink.nexthop_request(obj, {}, 1)), {}) == obj


def test_recorded_kernel_group_and_blackhole_messages_decode():
    # RTM_NEWNEXTHOP bodies recorded from a dump (Linux 6.18) after `ip nexthop add id 1001 dev lo
    # proto 201`, `... id 2001 group 1001/1002 proto 201` and `... id 9 blackhole`
    lo_leaf = bytes.fromhex("02fec9000000000008000100e90300000800050001000000")
    grp = bytes.fromhex("0000c9000000000008000100d1070000060003000000000014000200e903000000000000ea0300000000000008000e0000000080")
    bh = bytes.fromhex("0200000000000000080001000900000004000400")
    assert nhlink.object_from_msg(lo_leaf, {1: "lo"}) == NexthopObject(1001, 201, "", "lo")
    assert nhlink.object_from_msg(grp, {}) == NexthopObject(2001, 201, group=(1001, 1002))
    assert nhlink.object_from_msg(bh, {}) == NexthopObject(9, 0, blackhole=True)


def test_truncated_or_idless_messages_are_ignored_not_fatal():
    assert nhlink.object_from_msg(b"\x00\x01", {}) is None
    assert nhlink.object_from_msg(struct.pack("=BBBBI", 2, 0, 201, 0, 0), {}) is None
    assert list(nhlink.parse_messages(b"\x40\x00\x00\x00" + b"\x00" * 8)) == []
    assert nhlink.parse_attrs(b"\x08\x00\x01\x00\x01") == {}


def test_route_request_points_at_the_group_and_decodes_back():
    r = want()
    body = _body(nhlink.route_request(r, 1002, 3))
    got = nhlink.route_from_nlmsg(body, {})
    assert got == RouteSpec(r.dst, (), r.prefsrc, 254, 0, OURS, 1002)


def test_kernel_route_dump_entry_with_nhid_and_multipath_decodes():
    # rtmsg + RTA_TABLE + RTA_DST + RTA_PREFSRC + RTA_NH_ID + RTA_MULTIPATH (2 rtnh with RTA_GATEWAY)
    head = struct.pack("=BBBBBBBBI", socket.AF_INET, 32, 0, 0, 254, 201, 0, 1, 0)
    a = (nhlink._u32(nhlink.RTA_TABLE, 254) + nhlink._ip4(nhlink.RTA_DST, "198.19.0.2")
         + nhlink._ip4(nhlink.RTA_PREFSRC, "198.19.0.1") + nhlink._u32(nhlink.RTA_NH_ID, 1002))
    hops = b""
    for gw, oif in (("198.18.1.2", 3), ("198.18.0.2", 2)):
        sub = nhlink._ip4(nhlink.RTA_GATEWAY, gw)
        hops += struct.pack("=HBBi", 8 + len(sub), 0, 0, oif) + sub
    body = head + a + nhlink._attr(nhlink.RTA_MULTIPATH, hops)
    got = nhlink.route_from_nlmsg(body, {2: "rail0", 3: "rail1"})
    assert got == RouteSpec("198.19.0.2/32", (Nexthop("198.18.0.2", "rail0"), Nexthop("198.18.1.2", "rail1")), "198.19.0.1", 254, 0, 201, 1002)
    assert nhlink.route_from_nlmsg(b"\x0a" + body[1:], {}) is None  # IPv6: not ours


def test_nack_carries_the_kernel_errno():
    body = struct.pack("=i", -2) + b"\x00" * 16
    (m,) = list(nhlink.parse_messages(_reply(nhlink.NLMSG_ERROR, body, flags=0)))
    assert nhlink.nack_errno(m) == 2
