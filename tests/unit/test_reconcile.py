"""reconcile.diff: desired vs observed routes -> ordered operations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.core.model import Nexthop, RouteSpec
from linkpass.core.reconcile import RouteOp, diff

OURS = 201
BOOT = 3


def rt(dst: str, *gws: str, proto: int = OURS, metric: int = 0, table: int = 254, src: str | None = "198.19.0.1") -> RouteSpec:
    nhs = tuple(sorted(Nexthop(g, f"rail{i}", i) for i, g in enumerate(gws)))
    return RouteSpec(dst, nhs, src, table, metric, proto)


A = rt("198.19.0.2/32", "198.18.0.2", "198.18.1.2")
A_ONE = rt("198.19.0.2/32", "198.18.0.2")
B = rt("198.19.0.3/32", "198.18.0.3")
C = rt("198.19.0.4/32", "198.18.0.4")


def test_missing_route_is_replaced():
    d = diff([A], [], OURS)
    assert d.ops == (RouteOp("replace", A),) and d.conflicts == ()


def test_identical_route_needs_nothing():
    assert diff([A, B], [B, A], OURS).ops == ()


def test_nexthop_rail_annotation_does_not_matter():
    seen = RouteSpec(A.dst, tuple(Nexthop(n.gateway, n.netdev, None) for n in A.nexthops), A.prefsrc, A.table, A.metric, A.proto)
    assert diff([A], [seen], OURS).ops == ()


def test_different_nexthops_or_source_are_replaced():
    assert diff([A_ONE], [A], OURS).ops == (RouteOp("replace", A_ONE),)
    other_src = rt("198.19.0.2/32", "198.18.0.2", "198.18.1.2", src="198.19.0.9")
    assert diff([A], [other_src], OURS).ops == (RouteOp("replace", A),)


def test_stale_route_of_ours_is_deleted():
    d = diff([A], [A, B], OURS)
    assert d.ops == (RouteOp("delete", B),)


def test_foreign_routes_never_touched():
    foreign_b = rt("198.19.0.3/32", "10.0.0.1", proto=BOOT)
    foreign_other = rt("10.0.0.0/8", "10.0.0.1", proto=BOOT)
    d = diff([A], [A, foreign_b, foreign_other], OURS)
    assert d.ops == () and d.conflicts == ()


def test_foreign_route_in_our_slot_is_a_conflict_not_overwritten():
    foreign_a = rt("198.19.0.2/32", "10.0.0.1", proto=BOOT)
    d = diff([A, B], [foreign_a], OURS)
    assert d.ops == (RouteOp("replace", B),)
    assert len(d.conflicts) == 1
    assert "198.19.0.2/32" in d.conflicts[0] and "proto 3" in d.conflicts[0]
    assert all(op.route.proto == OURS for op in d.ops)


def test_foreign_route_same_dst_other_metric_is_no_conflict():
    foreign = rt("198.19.0.2/32", "10.0.0.1", proto=BOOT, metric=100)
    d = diff([A], [foreign], OURS)
    assert d.ops == (RouteOp("replace", A),) and d.conflicts == ()


def test_kept_destinations_are_left_alone():
    d = diff([A], [A, B, C], OURS, keep_dsts=frozenset({B.dst}))
    assert d.ops == (RouteOp("delete", C),)


def test_replacements_come_before_deletions():
    d = diff([A_ONE, C], [A, B], OURS)
    kinds = [op.op for op in d.ops]
    assert kinds == ["replace", "replace", "delete"]
    assert {op.route for op in d.ops if op.op == "replace"} == {A_ONE, C}
    assert [op.route for op in d.ops if op.op == "delete"] == [B]


def test_duplicate_routes_of_ours_with_another_metric_are_deleted():
    old_metric = rt("198.19.0.2/32", "198.18.0.2", "198.18.1.2", metric=50)
    d = diff([A], [old_metric, A], OURS)
    assert d.ops == (RouteOp("delete", old_metric),)
    # and when the wanted one is missing too: replace first, then delete the old one
    d = diff([A], [old_metric], OURS)
    assert d.ops == (RouteOp("replace", A), RouteOp("delete", old_metric))


def test_route_in_another_table_is_a_different_slot():
    other_table = rt(A.dst, "198.18.0.2", "198.18.1.2", table=100)
    d = diff([A], [other_table], OURS)
    assert d.ops == (RouteOp("replace", A), RouteOp("delete", other_table))


def test_describe_mentions_op_and_route():
    assert RouteOp("delete", B).describe().startswith("delete 198.19.0.3/32 src 198.19.0.1 proto 201 table 254 metric 0")


# ----------------------------------------------------------------------------- property

DSTS = [f"198.19.0.{i}/32" for i in range(2, 8)]
GWS = [f"198.18.{r}.9" for r in range(3)]


@st.composite
def route_sets(draw):
    """(desired, observed, keep_dsts) with one route per FIB slot in observed, as in the kernel."""
    slots = st.tuples(st.sampled_from(DSTS), st.sampled_from([254, 100]), st.sampled_from([0, 10]))
    fwd = st.tuples(st.lists(st.sampled_from(GWS), min_size=1, max_size=3, unique=True), st.sampled_from([None, "198.19.0.1"]))

    def mk(slot, f, proto):
        (dst, table, metric), (gws, src) = slot, f
        return RouteSpec(dst, tuple(sorted(Nexthop(g, "rail" + g.split(".")[2]) for g in gws)), src, table, metric, proto)

    desired_slots = draw(st.lists(slots, unique=True, max_size=6))
    desired = [mk(s, draw(fwd), OURS) for s in desired_slots]
    observed_slots = draw(st.lists(slots, unique=True, max_size=8))
    observed = [mk(s, draw(fwd), draw(st.sampled_from([OURS, OURS, BOOT, 4]))) for s in observed_slots]
    keep = frozenset(draw(st.lists(st.sampled_from(DSTS), max_size=2)))
    # the planner never both routes and keeps a destination
    desired = [r for r in desired if r.dst not in keep]
    return desired, observed, keep


@settings(max_examples=200, deadline=None)
@given(route_sets())
def test_applying_the_ops_yields_the_desired_routes(case):
    desired, observed, keep = case
    d = diff(desired, observed, OURS, keep)

    # ops only ever touch routes of ours; replacements before deletions
    assert all(op.route.proto == OURS for op in d.ops)
    kinds = [op.op for op in d.ops]
    assert kinds == sorted(kinds, key=lambda k: 0 if k == "replace" else 1)
    assert set(kinds) <= {"replace", "delete"}
    observed_set = set(observed)
    assert all(op.route in observed_set for op in d.ops if op.op == "delete")

    fib = {r.key: r for r in observed}
    for op in d.ops:
        if op.op == "replace":
            fib[op.route.key] = op.route
        else:
            assert fib.get(op.route.key) == op.route
            del fib[op.route.key]

    foreign = {r.key: r for r in observed if r.proto != OURS}
    conflicted = {r.key for r in desired if r.key in foreign}
    assert len(d.conflicts) == len(conflicted)
    # foreign routes are all still there, untouched
    for k, r in foreign.items():
        assert fib[k] == r
    # every non-conflicting desired route is in place
    for r in desired:
        if r.key not in conflicted:
            assert fib[r.key].same_forwarding(r)
    # every route of ours left is desired or kept
    wanted = {r.key for r in desired}
    for k, r in fib.items():
        if r.proto == OURS:
            assert k in wanted or r.dst in keep
    # kept routes of ours are untouched
    for r in observed:
        if r.proto == OURS and r.dst in keep:
            assert fib[r.key] == r
    # idempotent: diffing again gives no ops
    assert diff(desired, list(fib.values()), OURS, keep).ops == ()


def test_of_two_routes_of_ours_in_one_slot_the_first_observed_is_compared():
    # the kernel lists one route per (dst, table, metric); a picture may still hold two (a stale
    # cache): the first decides, as a scan in observed order would
    stale = rt("198.19.0.2/32", "198.18.0.9")
    assert diff([A], [A, stale], OURS).ops == ()
    assert diff([A], [stale, A], OURS).ops == (RouteOp("replace", A),)


def test_a_plan_of_thousands_of_destinations_is_diffed_per_slot():
    want = [rt(f"198.19.{i // 250}.{1 + i % 250}/32", "198.18.0.2") for i in range(3000)]
    have = [rt(f"198.19.{i // 250}.{1 + i % 250}/32", "198.18.1.2") for i in range(3000)]
    d = diff(want, have + [rt("198.19.99.1/32", "198.18.0.2")], OURS)
    assert [op.route for op in d.ops if op.op == "replace"] == want
    assert [op.route.dst for op in d.ops if op.op == "delete"] == ["198.19.99.1/32"]
