"""Desired routes vs kernel nexthop objects -> ordered nexthop/route operations.

With nexthop objects (Linux >= 5.3, ``ip nexthop``) each planned destination's route points
at a nexthop *group* of ours (``nhid``) whose members are *leaf* nexthops of ours, one per
(gateway, netdev).  A plan change that moves a destination between rails is then one atomic
``ip nexthop replace id G group A/B``: the route itself does not change.

The kernel works on these objects without us: a leaf whose netdev goes down or loses carrier
is deleted and removed from every group (``nexthop_flush_dev`` in net/ipv4/nexthop.c, on
NETDEV_DOWN, NETDEV_UNREGISTER and NETDEV_CHANGE without IFF_RUNNING/IFF_LOWER_UP); a group
left empty is deleted with the routes that use it.  So at a carrier loss traffic leaves the
dead rail before the daemon acts, and the daemon re-creates the leaf at failback.

Rules (DESIGN.md rule 6, extended to objects):

* an object is ours when its protocol is ours *and* its id is in our id range; nothing else
  is ever replaced or deleted, and ids held by anything else are never allocated;
* a route is ours when its protocol is ours (as in :mod:`linkpass.core.reconcile`); a slot
  (dst, table, metric) held by another protocol is a conflict, never overwritten;
* ids are kept across plans and restarts: a destination keeps the group its route already
  points at, a (gateway, netdev) keeps its leaf, so a restarted daemon changes nothing;
* order: leaf adds, group replaces, route replaces, then route deletes, group deletes, leaf
  deletes (nothing is removed while something planned still needs it);
* an object still referenced by a route or group we do not delete is never deleted (the
  kernel would delete a foreign route along with a group of ours it points at).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from linkpass.core.model import RouteSpec


@dataclass(frozen=True)
class NexthopObject:
    """One kernel nexthop object (``ip nexthop``), as planned or as read back.

    A leaf has ``gateway`` (IPv4 text, "" for none) and ``netdev``; a group has ``group``,
    the member ids in the kernel's order.  ``blackhole`` and ``fdb`` mark kinds we never
    create (read back from someone else); ``proto`` is the nhm_protocol tag.
    """

    id: int
    proto: int
    gateway: str = ""
    netdev: str = ""
    group: tuple[int, ...] = ()
    blackhole: bool = False
    fdb: bool = False

    @property
    def is_group(self) -> bool:
        return bool(self.group)

    @property
    def is_plain_leaf(self) -> bool:
        """A gateway/netdev nexthop (what we create), not a group, blackhole or fdb one."""
        return not self.group and not self.blackhole and not self.fdb and bool(self.netdev)

    def describe(self) -> str:
        """``ip nexthop``-like one-line text."""
        if self.group:
            what = "group " + "/".join(str(i) for i in self.group)
        elif self.blackhole:
            what = "blackhole"
        else:
            what = (f"via {self.gateway} " if self.gateway else "") + f"dev {self.netdev}"
        return f"id {self.id} {what}{' fdb' if self.fdb else ''} proto {self.proto}"


@dataclass(frozen=True)
class NhOp:
    """One operation.

    ``op``: ``add-nexthop`` (a leaf; create-or-replace), ``replace-group``,
    ``replace-route`` (``route`` pointed at group ``nhid``), ``delete-route``,
    ``delete-group``, ``delete-nexthop``.  ``obj`` is set for nexthop ops, ``route`` for
    route ops.
    """

    op: str
    obj: NexthopObject | None = None
    route: RouteSpec | None = None
    nhid: int | None = None

    def describe(self) -> str:
        if self.route is not None:
            tail = f" nhid {self.nhid}" if self.nhid is not None else ""
            return f"{self.op} {self.route.dst} table {self.route.table} metric {self.route.metric}{tail}"
        assert self.obj is not None
        return f"{self.op} {self.obj.describe()}"


@dataclass(frozen=True)
class NhDiff:
    """Result of :func:`nh_diff`: ``ops`` in the order to apply them, and conflicts found
    (:func:`apply_to_picture` gives the state once they are applied)."""

    ops: tuple[NhOp, ...]
    conflicts: tuple[str, ...]


@dataclass(frozen=True)
class IdRange:
    """Nexthop ids we may allocate: ``first`` .. ``first + count - 1`` (ids are u32, 0 invalid)."""

    first: int
    count: int

    def __contains__(self, i: int) -> bool:
        return self.first <= i < self.first + self.count


class IdsExhausted(ValueError):
    """Every id of the range is taken."""


def _ours(o: NexthopObject, proto: int, ids: IdRange) -> bool:
    return o.proto == proto and o.id in ids


def nh_diff(desired: Iterable[RouteSpec], observed_routes: Iterable[RouteSpec], objects: Iterable[NexthopObject],
            proto: int, ids: IdRange, keep_dsts: frozenset[str] = frozenset()) -> NhDiff:
    """Compute the operations that make the kernel hold ``desired`` through nexthop groups.

    Args:
        desired: routes we want (all with ``proto``; their ``nhid`` is ignored).
        observed_routes: every route of the relevant table(s), ours and others', with ``nhid``
            where the kernel route points at a nexthop object.
        objects: every nexthop object of the namespace (ours and others').
        proto: our routing protocol number (tags routes and objects).
        ids: the id range our objects live in.
        keep_dsts: destinations whose routes of ours (and the objects they use) stay as they are.

    Returns:
        :class:`NhDiff`.

    Raises:
        IdsExhausted: a new object is needed and no id of ``ids`` is free.
    """
    objects = list(objects)
    observed_routes = list(observed_routes)
    by_id = {o.id: o for o in objects}
    taken = set(by_id)
    ours = {o.id: o for o in objects if _ours(o, proto, ids)}
    next_free = [ids.first]

    def alloc() -> int:
        i = next_free[0]
        while i in taken:
            i += 1
        if i not in ids:
            raise IdsExhausted(f"no free nexthop id in {ids.first}..{ids.first + ids.count - 1}")
        taken.add(i)
        next_free[0] = i + 1
        return i

    leaf_of: dict[tuple[str, str], int] = {}
    for o in sorted(ours.values(), key=lambda o: o.id):
        if o.is_plain_leaf:
            leaf_of.setdefault((o.gateway, o.netdev), o.id)

    foreign_routes = {r.key: r for r in observed_routes if r.proto != proto}
    our_routes = [r for r in observed_routes if r.proto == proto]
    have_route = {}
    for r in our_routes:
        have_route.setdefault(r.key, r)

    adds: list[NhOp] = []
    groups: list[NhOp] = []
    routes: list[NhOp] = []
    conflicts: list[str] = []
    wanted_keys: set = set()
    claimed_groups: set[int] = set()
    live: dict[int, NexthopObject] = {}  # our objects the kernel holds once the ops are done

    for want in desired:
        if want.key in foreign_routes:
            f = foreign_routes[want.key]
            conflicts.append(f"{want.dst} table {want.table} metric {want.metric} is held by a route of proto {f.proto}; not touching it")
            continue
        wanted_keys.add(want.key)
        members = []
        for nh in want.nexthops:
            lid = leaf_of.get((nh.gateway, nh.netdev))
            if lid is None:
                lid = leaf_of[(nh.gateway, nh.netdev)] = alloc()
                leaf = NexthopObject(lid, proto, nh.gateway, nh.netdev)
                adds.append(NhOp("add-nexthop", leaf))
            live[lid] = ours.get(lid) or NexthopObject(lid, proto, nh.gateway, nh.netdev)
            members.append(lid)
        members_t = tuple(sorted(set(members)))
        have = have_route.get(want.key)
        gid = None
        if have is not None and have.nhid is not None and have.nhid not in claimed_groups:
            g = ours.get(have.nhid)
            if g is not None and g.is_group:
                gid = have.nhid
        if gid is None:
            gid = alloc()
            old = None
        else:
            old = ours[gid]
        claimed_groups.add(gid)
        grp = NexthopObject(gid, proto, group=members_t)
        live[gid] = grp
        if old is None or tuple(sorted(old.group)) != members_t:
            groups.append(NhOp("replace-group", grp))
        if have is None or have.nhid != gid or have.prefsrc != want.prefsrc:
            routes.append(NhOp("replace-route", route=want, nhid=gid))

    deletes: list[NhOp] = []
    remaining_routes = [r for r in observed_routes if r.proto != proto]
    for have in our_routes:
        if have.key in wanted_keys:
            continue
        if have.dst in keep_dsts:
            remaining_routes.append(have)
            continue
        deletes.append(NhOp("delete-route", route=have))

    # what stays referenced: groups used by routes that stay, and their members
    referenced: set[int] = {r.nhid for r in remaining_routes if r.nhid is not None}
    referenced |= set(live)
    for o in objects:  # foreign groups keep our leaves they use
        if o.is_group and not _ours(o, proto, ids):
            referenced |= set(o.group)
    for gid in list(referenced):
        g = live.get(gid) or ours.get(gid)
        if g is not None and g.is_group:
            referenced |= set(g.group)
    for o in sorted(ours.values(), key=lambda o: o.id):
        if o.id not in referenced and o.is_group:
            deletes.append(NhOp("delete-group", o))
    for o in sorted(ours.values(), key=lambda o: o.id):
        if o.id not in referenced and not o.is_group:
            deletes.append(NhOp("delete-nexthop", o))
    return NhDiff(tuple(adds + groups + routes + deletes), tuple(conflicts))


def apply_to_picture(ops: Iterable[NhOp], routes: list[RouteSpec], objects: list[NexthopObject]) -> tuple[list[RouteSpec], list[NexthopObject]]:
    """The (routes, objects) picture after ``ops`` succeeded on (``routes``, ``objects``):
    what the actuator caches instead of dumping the kernel again."""
    rmap = {(r.key, r.proto): r for r in routes}
    omap = {o.id: o for o in objects}
    for op in ops:
        if op.op in ("add-nexthop", "replace-group"):
            assert op.obj is not None
            omap[op.obj.id] = op.obj
        elif op.op in ("delete-group", "delete-nexthop"):
            assert op.obj is not None
            omap.pop(op.obj.id, None)
        elif op.op == "replace-route":
            assert op.route is not None
            rmap[(op.route.key, op.route.proto)] = RouteSpec(op.route.dst, op.route.nexthops, op.route.prefsrc, op.route.table,
                                                             op.route.metric, op.route.proto, op.nhid)
        elif op.op == "delete-route":
            assert op.route is not None
            rmap.pop((op.route.key, op.route.proto), None)
    return list(rmap.values()), list(omap.values())
