"""Route actuator: makes the kernel's routes match the engine's latest plan.

Routes are plain or ECMP multipath IPv4 routes (RTA_MULTIPATH) tagged with our routing
protocol number; only routes carrying that tag are ever replaced or deleted
(:mod:`linkpass.core.reconcile`).  With ``nexthop_objects`` each route instead points at a
nexthop group of ours (:mod:`linkpass.core.nexthops`, messages in
:mod:`linkpass.adapters.nhlink`): a plan change is one atomic group replace per destination,
and the kernel itself drops a leaf whose netdev loses carrier from every group.  Work is "latest wins": while one reconciliation runs,
newer plans overwrite the pending one, so a flapping link cannot queue up stale work.
After each pass the actuator posts :class:`~linkpass.core.model.RoutesApplied` with the
monotonic time the last kernel ACK arrived.

Route and nexthop changes go over one blocking NETLINK_ROUTE socket
(:class:`~linkpass.adapters.nhlink.NexthopSocket`): rtnetlink handles a request inside
``sendmsg``, so the ACK is there when ``send`` returns and a reroute does not wait for event
loop turns that the same moment's link events, probes and notices also want (with pyroute2's
async requests, DOWN to routes ACKed was p99 7.8 ms inline against 2.5 ms over this socket,
bench/README.md, kernel_reroute.py).  Dumps, links and neighbours stay on pyroute2.

The message translations (:func:`route_from_msg`, :func:`neighbors_to_purge`, and the
requests in :mod:`linkpass.adapters.nhlink`) are pure, tested on recorded kernel messages
(tests/unit/test_netlink_messages.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
from dataclasses import dataclass
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from linkpass.adapters.nhlink import (
    RTA_NH_ID,
    NetlinkBatchError,
    NetlinkNackError,
    NexthopSocket,
    inline_route_request,
    nexthop_delete_request,
    nexthop_request,
    route_delete_request,
    route_request,
)
from linkpass.core.model import ApplyRoutes, Event, Nexthop, RouteSpec, RoutesApplied
from linkpass.core.nexthops import IdRange, IdsExhausted, NexthopObject, NhOp, apply_to_picture, nh_diff
from linkpass.core.reconcile import diff

log = logging.getLogger("linkpass.routes")

FLUSH_PATH = "/proc/sys/net/ipv4/route/flush"
NUD_INCOMPLETE = 0x01
NUD_FAILED = 0x20
NUD_NOARP = 0x40
NUD_PERMANENT = 0x80


#: what building a request can raise: a netdev without a known ifindex (KeyError), a route with
#: no nexthop (ValueError), an address inet_aton refuses (OSError), a field out of range (struct.error)
_BUILD_ERRORS = (KeyError, ValueError, OSError, struct.error)


def _build_error(e: Exception) -> str:
    if isinstance(e, KeyError) and e.args:
        return f"netdev {e.args[0]} not found"
    return f"cannot encode the request: {e}"


#: a batch logs this many of its route and nexthop changes one by one at INFO; the rest at DEBUG,
#: with one INFO line saying how many (a reroute of thousands of destinations would otherwise
#: write thousands of lines, and format them in the engine's turn)
LOG_EACH = 16


class _ChangeLog:
    """The INFO lines of one batch of changes (one call of the apply step; a pass makes one
    or two): the first :data:`LOG_EACH` one by one, the rest counted (and at DEBUG when that is
    on); :meth:`close` writes the count."""

    def __init__(self, what: str) -> None:
        self.what, self.n = what, 0

    def done(self, op) -> None:
        self.n += 1
        if self.n <= LOG_EACH:
            log.info("%s %s", self.what, op.describe())
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", self.what, op.describe())

    def close(self) -> None:
        if self.n > LOG_EACH:
            log.info("%s: %d more change%s in this batch (listed at DEBUG)", self.what, self.n - LOG_EACH,
                     "" if self.n - LOG_EACH == 1 else "s")
        self.n = 0


def _send_ops(nl: NexthopSocket, ops: list, build: Callable[[object], bytes]) -> tuple[list[int], dict[int, object], int | None]:
    """Build each op's request (``build(op)``) and send them all in one ``nl.request_many``.
    Returns (indexes into ``ops`` done, index -> why it failed, monotonic ns of the answer or
    None when nothing was sent).  An op whose request cannot be built fails alone; on a socket
    failure the ops it could not confirm fail (they may or may not have been done)."""
    batch: list[int] = []
    msgs: list[bytes] = []
    failed: dict[int, object] = {}
    for k, op in enumerate(ops):
        try:
            msgs.append(build(op))
        except _BUILD_ERRORS as e:
            failed[k] = _build_error(e)
            continue
        batch.append(k)
    done: list[int] = []
    if not batch:
        return done, failed, None
    try:
        results: list[int | None] = list(nl.request_many(msgs))
        why = ""
    except NetlinkBatchError as e:
        results, why = e.results, f"not confirmed: {e}"
    t_ack = time.monotonic_ns()
    for k, res in zip(batch, results):
        if res is None:
            failed[k] = why
        elif res:
            failed[k] = NetlinkNackError(res, os.strerror(res))
        else:
            done.append(k)
    return done, failed, t_ack


def route_from_msg(msg, names: Mapping[int, str]) -> RouteSpec | None:
    """An rtmsg (route dump entry) as :class:`RouteSpec`; None when it is not IPv4.

    ``names`` maps ifindex -> netdev (an unknown ifindex reads ``if<N>``); nexthops are sorted,
    a missing gateway is ``""``, a missing table is 254 (main).
    """
    if msg.get("family") != socket.AF_INET:
        return None
    dst = msg.get("dst")
    dst_len = msg.get("dst_len", 0)
    prefix = f"{dst or '0.0.0.0'}/{dst_len}"
    nhs = []
    mp = msg.get("multipath")
    if mp:
        for nh in mp:
            gw = nh.get("gateway")
            nhs.append(Nexthop(gw or "", names.get(nh.get("oif"), f"if{nh.get('oif')}")))
    else:
        gw = msg.get("gateway")
        oif = msg.get("oif")
        if oif is not None:
            nhs.append(Nexthop(gw or "", names.get(oif, f"if{oif}")))
    table = msg.get("table") or 254
    # pyroute2 reads RTA_NH_ID (30) as UNKNOWN without its value: 0 says "some nexthop object"
    nhid = 0 if any(_is_nh_id(a) for a in msg.get("attrs", ()) or ()) else None
    return RouteSpec(prefix, tuple(sorted(nhs)), msg.get("prefsrc"), int(table), int(msg.get("priority") or 0), int(msg.get("proto") or 0), nhid)


def _is_nh_id(attr) -> bool:
    """Whether a decoded route attribute (pyroute2 nla_slot or a plain pair) is RTA_NH_ID."""
    try:
        return attr[0] == "UNKNOWN" and attr[1]["header"]["type"] == RTA_NH_ID
    except (KeyError, IndexError, TypeError):
        return False


def link_names(links) -> dict[int, str]:
    """ifindex -> netdev from a link dump's ifinfmsgs."""
    return {m["index"]: m.get("ifname") for m in links}


def neighbors_to_purge(entries, ifindex: int, only_states: int | None = None) -> list[str]:
    """The IPv4 addresses of the dynamic neighbour entries (ndmsgs of a dump) on ``ifindex``
    to delete: never PERMANENT or NOARP ones; with ``only_states``, only entries in those NUD
    states."""
    out = []
    for m in entries:
        state = m.get("state", 0) or 0
        if m.get("ifindex") != ifindex or state & (NUD_PERMANENT | NUD_NOARP):
            continue
        if only_states is not None and not state & only_states:
            continue
        dst = m.get("dst")
        if dst:
            out.append(dst)
    return out


#: First id of the nexthop objects linkpass owns, and how many it may use (ids are u32; iproute2
#: and FRR allocate from the bottom, so ours sit high).
DEFAULT_NEXTHOP_ID_BASE = 0x4C500000
NEXTHOP_ID_COUNT = 1 << 16


@dataclass(frozen=True)
class RouteSettings:
    """What the actuator owns: the routes tagged with routing protocol number ``proto``
    (rtm_protocol, 5..255) in routing table ``table`` (254 = main); with ``nexthop_objects``
    also the nexthop objects tagged ``proto`` with ids ``nexthop_id_base`` ..
    ``nexthop_id_base + NEXTHOP_ID_COUNT - 1``."""

    proto: int
    table: int = 254
    nexthop_objects: bool = False
    nexthop_id_base: int = DEFAULT_NEXTHOP_ID_BASE

    @property
    def ids(self) -> IdRange:
        return IdRange(self.nexthop_id_base, NEXTHOP_ID_COUNT)


class RouteActuator:
    """Applies :class:`~linkpass.core.model.ApplyRoutes` plans with pyroute2.

    Args:
        post: where to post RoutesApplied events.
        settings: our routing protocol number and table (:class:`RouteSettings`); a reloaded
            config brings new ones through :meth:`reconfigure`.
    """

    def __init__(self, post: Callable[[Event], None], settings: RouteSettings):
        self.post = post
        self.settings = settings
        self._pending: ApplyRoutes | None = None
        self._wake = asyncio.Event()
        self.applied_generation = 0
        self.ops_total = 0
        self.errors_total = 0
        self._sock: AsyncIPRoute | None = None
        self._cache: list[RouteSpec] | None = None
        self._idx: dict[str, int] = {}
        self._nl: NexthopSocket | None = None
        # nexthop-object mode: the (routes, objects) picture after the last pass
        self._nh_cache: tuple[list[RouteSpec], list[NexthopObject]] | None = None
        self._gc_objects_pending = True  # inline mode: drop our objects left by nexthop mode, once
        self._busy = False  # a pass (run/reconcile) is between awaits
        # what apply_now put in for a plan the next pass completes: (generation, replaced, t_ns)
        self._early: tuple[int, int, int] | None = None
        self.early_total = 0  # plans whose replacements went in at submit time

    @property
    def proto(self) -> int:
        return self.settings.proto

    @property
    def table(self) -> int:
        return self.settings.table

    def reconfigure(self, settings: RouteSettings) -> None:
        """Adopt new settings (a reloaded config) from the next pass on; a changed table or
        protocol makes that pass read the kernel again (the cached picture is of the old ones)."""
        if settings != self.settings:
            if settings.nexthop_objects != self.settings.nexthop_objects:
                self._gc_objects_pending = True
            self.settings = settings
            self._cache = None
            self._nh_cache = None

    def submit(self, plan: ApplyRoutes, now: bool = False) -> None:
        """Queue a plan (replacing any not yet started one; a resync request is kept).

        With ``now``, the plan's route replacements (group replaces and leaf adds in
        nexthop-object mode) also go into the kernel before this returns (:meth:`apply_now`);
        the queued pass then does the rest (deletions, the dump a resync asks for, the
        neighbour purge) and posts ``RoutesApplied`` with the ACK time of those replacements."""
        if self._pending is None or plan.generation >= self._pending.generation:
            if self._pending is not None and self._pending.resync and not plan.resync:
                plan = dataclasses.replace(plan, resync=True)
            self._pending = plan
            self._wake.set()
            if now:
                self.apply_now(plan)

    def apply_now(self, plan: ApplyRoutes) -> bool:
        """Put ``plan``'s replacements into the kernel synchronously, from the cached picture;
        returns whether it did.

        Why: a reroute decided in an engine turn would otherwise wait for the actuator task's
        turn, behind the rest of the queue (the same moment's link, neighbour and route events,
        probe results, notices): on 2 shared cores that wait, not the kernel, was most of "DOWN
        to routes ACKed" (bench/README.md, kernel_reroute.py).  Replace is idempotent, so a
        stale picture cannot make a replacement wrong; a failed one drops the picture and the
        queued pass re-reads the kernel and redoes it, reporting its own errors.

        Not done (False) while a pass is between awaits (its picture is in flight), before the
        first pass (no picture), for a plan older than the last applied one, or when a nexthop
        netdev's ifindex is not known yet (looking it up needs the async socket)."""
        if self._busy or plan.generation <= self.applied_generation:
            return False
        settings = self.settings
        try:
            netdevs = {nh.netdev for r in plan.routes for nh in r.nexthops}
            idx = {d: self._idx[d] for d in netdevs}
        except KeyError:
            return False
        errors: list[str] = []
        if settings.nexthop_objects:
            if self._nh_cache is None:
                return False
            routes, objects = self._nh_cache
            try:
                d = nh_diff(plan.routes, routes, objects, settings.proto, settings.ids, plan.keep_dsts)
            except IdsExhausted:
                return False  # the pass reports it
            (replaced, _, t_last), done = self._apply_nh([op for op in d.ops if not op.op.startswith("delete")], errors)
            self._nh_cache = apply_to_picture(done, routes, objects)
        else:
            if self._cache is None:
                return False
            d = diff(plan.routes, self._cache, settings.proto, plan.keep_dsts)
            have = {r.key: r for r in self._cache}
            replaced, _, t_last = self._apply_sync([op for op in d.ops if op.op == "replace"], have, errors, idx)
            self._cache = list(have.values())
        if errors:  # the queued pass re-reads the kernel and tries again
            self._cache = None
            self._nh_cache = None
        if replaced:
            self.flush_route_cache()
        prev = self._early
        if t_last is not None:
            self._early = (plan.generation, replaced + (prev[1] if prev else 0), t_last)
            self.early_total += 1
        elif prev is not None and not errors:
            # nothing left to replace: an earlier in-turn apply (of a plan this one superseded
            # before its pass ran) already put these routes in, at its ACK time
            self._early = (plan.generation, prev[1], prev[2])
        return True

    async def observed(self, ipr: AsyncIPRoute) -> list[RouteSpec]:
        """Every IPv4 route in our table (ours and others')."""
        names = link_names([link async for link in await ipr.link("dump")])
        out = []
        async for msg in await ipr.route("dump", family=socket.AF_INET, table=self.table):
            r = route_from_msg(msg, names)
            if r is not None:
                out.append(r)
        return out

    async def _ipr(self) -> AsyncIPRoute:
        if self._sock is None:
            self._sock = AsyncIPRoute()
        return self._sock

    def _drop_caches(self) -> None:
        self._cache = None
        self._nh_cache = None
        self._idx = {}
        if self._nl is not None:
            self._nl.close()
            self._nl = None
        if self._sock is not None:
            try:
                self._sock.close()
            except Exception:
                pass
            self._sock = None

    async def _apply(self, ipr: AsyncIPRoute, ops, have: dict, errors: list[str]) -> tuple[int, int, int | None]:
        """Apply ``ops`` in order; update ``have`` (key -> route).  Returns (replaced, deleted,
        monotonic ns after the last replacement or None)."""
        idx: dict[str, int] = {}
        for op in ops:
            if op.op == "replace":
                for nh in op.route.nexthops:
                    if nh.netdev not in idx:
                        try:
                            idx[nh.netdev] = await self._ifindex(ipr, nh.netdev)
                        except KeyError:
                            pass  # the op naming it fails and is reported
        return self._apply_sync(ops, have, errors, idx)

    def _apply_sync(self, ops, have: dict, errors: list[str], idx: Mapping[str, int]) -> tuple[int, int, int | None]:
        """:meth:`_apply` over the blocking socket with the ifindexes in ``idx`` (netdev ->
        ifindex; a missing one fails its op, reported in ``errors``).  The replacements go to
        the kernel in one datagram (:meth:`NexthopSocket.request_many`), then the deletions in
        another: a plan's replacements are in the kernel's routes within one ``sendmsg``, and
        ``t_last`` is their ACK.  Errors and log lines come in the order of ``ops``."""
        replaced = deleted = 0
        t_last = None
        nl = self._nlsock()
        failed: dict[int, object] = {}  # op index -> why
        for kind in ("replace", "delete"):
            picked = [k for k, op in enumerate(ops) if (op.op == "replace") == (kind == "replace")]
            build = (lambda op: inline_route_request(op.route, idx, 0)) if kind == "replace" else (lambda op: route_delete_request(op.route, 0))
            done, why, t_ack = _send_ops(nl, [ops[k] for k in picked], build)
            failed.update((picked[k], w) for k, w in why.items())
            for k in done:
                r = ops[picked[k]].route
                if kind == "replace":
                    replaced += 1
                    have[r.key] = r
                    t_last = t_ack
                else:
                    deleted += 1
                    have.pop(r.key, None)
        changes = _ChangeLog("route")
        for k, op in enumerate(ops):
            if k in failed:
                errors.append(f"{op.op} {op.route.dst}: {failed[k]}")
                log.error("route %s failed: %s", op.describe(), failed[k])
            else:
                changes.done(op)
        changes.close()
        return replaced, deleted, t_last

    async def reconcile(self, plan: ApplyRoutes, full: bool = False) -> RoutesApplied:
        """One pass: diff against the kernel, apply replacements first, then deletions.

        The kernel is dumped on the first pass, when ``full`` is set (something outside the
        actuator may have changed our routes: a netdev went down, a netlink overrun) and after
        any failed operation; otherwise the result of the previous pass is the observed
        picture.  With ``full`` and a cached picture, the plan's replacements go in first
        (replace is idempotent, so a stale cache cannot make them wrong) and the dump only
        follows, to catch routes the kernel flushed and stale ones to delete: the reroute is
        not delayed by the dump.

        ``RoutesApplied.t_ns`` is when the wanted routes were in the kernel (the ACK of the
        last replacement; the end of the pass if nothing needed replacing).
        """
        settings = self.settings  # one pass, one picture: a reconfigure takes effect on the next
        if settings.nexthop_objects:
            return await self._reconcile_nh(plan, full, settings)
        errors: list[str] = []
        ipr = await self._ipr()
        replaced = deleted = 0
        t_in = None
        if full and self._cache is not None:
            early = diff(plan.routes, self._cache, settings.proto, plan.keep_dsts)
            have = {r.key: r for r in self._cache}
            rep, _, t_in = await self._apply(ipr, [op for op in early.ops if op.op == "replace"], have, errors)
            replaced += rep
            self._cache = None
        if self._cache is None:
            self._cache = await self.observed(ipr)
        d = diff(plan.routes, self._cache, settings.proto, plan.keep_dsts)
        have = {r.key: r for r in self._cache}
        rep, dele, t_last = await self._apply(ipr, d.ops, have, errors)
        replaced += rep
        deleted += dele
        if replaced or deleted:
            self.flush_route_cache()
        early_replaced, early_t = self._take_early(plan.generation)
        t_in = t_last or t_in or early_t or time.monotonic_ns()
        replaced += early_replaced
        for netdev in plan.purge_neighbors:
            await self.purge_neighbors(ipr, netdev)
        for c in d.conflicts:
            log.warning("route conflict: %s", c)
        if errors:
            self._drop_caches()
        elif self.settings == settings:
            self._cache = list(have.values())
        if self._gc_objects_pending and not errors:
            self._gc_objects_pending = False
            deleted += await self._gc_objects(ipr, settings)
        self.ops_total += replaced + deleted
        self.errors_total += len(errors)
        return RoutesApplied(plan.generation, t_in, replaced, deleted, tuple(errors), d.conflicts)

    def _take_early(self, generation: int) -> tuple[int, int | None]:
        """(replacements, ACK ns) that :meth:`apply_now` made for ``generation``, once;
        (0, None) if none (or they were for another plan)."""
        early, self._early = self._early, None
        if early is None or early[0] != generation:
            return 0, None
        return early[1], early[2]

    async def close(self) -> None:
        """At daemon stop: routes, and the nexthop groups they point at, stay as they are
        (traffic must not drop because the daemon stops; deleting a group deletes its routes);
        nexthop objects of ours that nothing uses (a dead rail's leaf kept for its failback)
        are deleted; the sockets are closed."""
        try:
            if self._nl is not None or self.settings.nexthop_objects:
                ipr = await self._ipr()
                n = await self._gc_objects(ipr, self.settings)
                if n:
                    log.info("stop: deleted %d unused nexthop object%s of ours", n, "" if n == 1 else "s")
        finally:
            self._drop_caches()
            self._gc_objects_pending = True

    # ------------------------------------------------------------------ nexthop objects

    def _nlsock(self) -> NexthopSocket:
        if self._nl is None:
            self._nl = NexthopSocket()
        return self._nl

    async def observed_nh(self, ipr: AsyncIPRoute, settings: RouteSettings) -> tuple[list[RouteSpec], list[NexthopObject]]:
        """Every IPv4 route of our table (with ``nhid``) and every nexthop object of the
        namespace (ours and others')."""
        names = link_names([link async for link in await ipr.link("dump")])
        nl = self._nlsock()
        return nl.routes(names, settings.table), nl.objects(names)

    async def _gc_objects(self, ipr: AsyncIPRoute, settings: RouteSettings) -> int:
        """Inline mode: delete our nexthop objects no route uses (left by nexthop-object mode)."""
        try:
            routes, objects = await self.observed_nh(ipr, settings)
            d = nh_diff((), routes, objects, settings.proto, settings.ids, keep_dsts=frozenset(r.dst for r in routes))
            n, _errs = self._apply_nh([op for op in d.ops if op.op in ("delete-group", "delete-nexthop")], [])
            return n[1]
        except (NetlinkError, OSError) as e:
            log.debug("nexthop object clean-up: %s", e)
            return 0

    def _apply_nh(self, ops: list[NhOp], errors: list[str]) -> tuple[tuple[int, int, int | None], list[NhOp]]:
        """Apply ``ops`` in order over the nexthop socket.  Returns ((replaced, deleted,
        monotonic ns after the last add/replace or None), the ops that took effect).  A delete
        of something already gone (the kernel flushes a leaf whose netdev lost carrier) counts
        as done.  After a failed add or replace the deletions are skipped: a leaf or group the
        failed replace was to take out of use may still be in use (deleting a group's last
        leaves deletes the group and every route using it), so they wait for a pass whose
        replacements went in.  Each run of adds and replaces goes to the kernel in one datagram
        (:meth:`_apply_nh_batch`), the deletions one by one (each waits on the errors before it)."""
        nl = self._nlsock()
        replaced = deleted = 0
        t_last = None
        done: list[NhOp] = []
        changes = _ChangeLog("nexthop")
        try:
            i = 0
            while i < len(ops):
                if not ops[i].op.startswith("delete"):
                    # a run of adds and replaces: one datagram (request_many); the kernel takes
                    # them in order, so a group replace sees the leaves added before it
                    j = i
                    while j < len(ops) and not ops[j].op.startswith("delete"):
                        j += 1
                    n, t = self._apply_nh_batch(nl, ops[i:j], errors, done, changes)
                    replaced += n
                    t_last = t if t is not None else t_last
                    i = j
                    continue
                op = ops[i]
                i += 1
                if errors:
                    continue
                try:
                    try:
                        if op.op == "delete-route":
                            assert op.route is not None
                            nl.request(lambda seq: route_delete_request(op.route, seq))
                        else:
                            assert op.obj is not None
                            nl.request(lambda seq: nexthop_delete_request(op.obj.id, seq))
                    except NetlinkNackError as e:
                        if e.errno not in (errno.ENOENT, errno.ESRCH):
                            raise
                    deleted += 1
                    done.append(op)
                    changes.done(op)
                except (NetlinkError, OSError, KeyError, ValueError) as e:
                    errors.append(f"{op.describe()}: {e}")
                    log.error("nexthop %s failed: %s", op.describe(), e)
        finally:
            changes.close()
        return (replaced, deleted, t_last), done

    def _apply_nh_batch(self, nl: NexthopSocket, ops: list[NhOp], errors: list[str], done: list[NhOp],
                        changes: _ChangeLog) -> tuple[int, int | None]:
        """Adds and replaces (``add-nexthop``, ``replace-group``, ``replace-route``) in one
        datagram; returns (how many went in, monotonic ns of their ACK or None).  Errors and
        log lines (``changes``) come in the order of ``ops``."""
        def build(op: NhOp) -> bytes:
            if op.op == "replace-route":
                assert op.route is not None and op.nhid is not None
                return route_request(op.route, op.nhid, 0)
            assert op.obj is not None
            return nexthop_request(op.obj, {op.obj.netdev: self._idx[op.obj.netdev]} if op.obj.netdev else {}, 0)

        ok, failed, t_ack = _send_ops(nl, ops, build)
        n = len(ok)
        for k, op in enumerate(ops):
            if k in failed:
                errors.append(f"{op.describe()}: {failed[k]}")
                log.error("nexthop %s failed: %s", op.describe(), failed[k])
            else:
                done.append(op)
                changes.done(op)
        return n, (t_ack if n else None)

    async def _reconcile_nh(self, plan: ApplyRoutes, full: bool, settings: RouteSettings) -> RoutesApplied:
        """One pass in nexthop-object mode (same contract as :meth:`reconcile`).

        The cached picture is used unless ``full`` or nothing is cached; with ``full`` and a
        cache, the adds and replaces computed from the cache go in first and the dump follows.
        Leaves no group uses are deleted only by a pass that dumped the kernel.
        A failed operation (the kernel changed our objects under us: a flushed leaf, another
        process) makes the pass dump the kernel and diff again, once; only the second
        attempt's errors are reported.
        """
        ipr = await self._ipr()
        replaced = deleted = 0
        t_in = None
        conflicts: tuple[str, ...] = ()
        errors: list[str] = []
        for attempt in (0, 1):
            errors = []
            try:
                for nh in {n.netdev for r in plan.routes for n in r.nexthops}:
                    try:
                        await self._ifindex(ipr, nh)
                    except KeyError:
                        pass  # the op naming it fails and is reported
                if full and self._nh_cache is not None and attempt == 0:
                    routes, objects = self._nh_cache
                    early = nh_diff(plan.routes, routes, objects, settings.proto, settings.ids, plan.keep_dsts)
                    (rep, _, t), _ = self._apply_nh([op for op in early.ops if not op.op.startswith("delete")], errors)
                    replaced += rep
                    t_in = t or t_in
                    self._nh_cache = None
                    errors = []  # the dump below finds and redoes what failed
                dumped = self._nh_cache is None
                if dumped:
                    self._nh_cache = await self.observed_nh(ipr, settings)
                routes, objects = self._nh_cache
                d = nh_diff(plan.routes, routes, objects, settings.proto, settings.ids, plan.keep_dsts)
            except IdsExhausted as e:
                errors.append(str(e))
                break
            conflicts = d.conflicts
            # An unused leaf is harmless and is what the next failback needs: it is deleted only
            # by a pass that read the kernel, so a reroute stays one group replace.
            ops = [op for op in d.ops if dumped or op.op != "delete-nexthop"]
            (rep, dele, t_last), done = self._apply_nh(ops, errors)
            replaced += rep
            deleted += dele
            t_in = t_last or t_in
            self._nh_cache = apply_to_picture(done, routes, objects)
            if not errors:
                break
            self._nh_cache = None  # re-read what the kernel really holds
            self._idx = {}
        if replaced or deleted:
            self.flush_route_cache()
        early_replaced, early_t = self._take_early(plan.generation)
        t_in = t_in or early_t or time.monotonic_ns()
        replaced += early_replaced
        for netdev in plan.purge_neighbors:
            await self.purge_neighbors(ipr, netdev)
        for c in conflicts:
            log.warning("route conflict: %s", c)
        if errors:
            self._drop_caches()
        elif self.settings != settings:
            self._nh_cache = None
        self.ops_total += replaced + deleted
        self.errors_total += len(errors)
        return RoutesApplied(plan.generation, t_in, replaced, deleted, tuple(errors), conflicts)

    async def refresh_neighbors(self, netdev: str) -> int:
        """Delete ``netdev``'s unresolved (INCOMPLETE/FAILED) entries; see RefreshNeighbors."""
        try:
            async with AsyncIPRoute() as ipr:  # its own socket: the route worker may be mid-request
                idx = self._idx.get(netdev)
                if idx is None:
                    found = await ipr.link_lookup(ifname=netdev)
                    if not found:
                        return 0
                    self._idx[netdev] = found[0]
                return await self.purge_neighbors(ipr, netdev, only_states=NUD_INCOMPLETE | NUD_FAILED)
        except (NetlinkError, OSError) as e:
            log.debug("neighbour refresh on %s: %s", netdev, e)
            return 0

    async def purge_neighbors(self, ipr: AsyncIPRoute, netdev: str, only_states: int | None = None) -> int:
        """Delete the dynamic IPv4 neighbour entries of ``netdev`` (like ``ip neigh flush dev``),
        freeing packets queued behind an unresolvable entry on a dead rail.  ``only_states``
        limits it to entries in those NUD states.  Returns the count."""
        try:
            idx = await self._ifindex(ipr, netdev)
        except KeyError:
            return 0
        n = 0
        entries = [m async for m in await ipr.neigh("dump", ifindex=idx, family=socket.AF_INET)]
        for dst in neighbors_to_purge(entries, idx, only_states):
            try:
                await ipr.neigh("del", dst=dst, ifindex=idx)
                n += 1
            except (NetlinkError, OSError) as e:
                log.debug("neighbour %s on %s: %s", dst, netdev, e)
        if n:
            log.info("purged %d neighbour entr%s on %s", n, "y" if n == 1 else "ies", netdev)
        return n

    @staticmethod
    def ignore_linkdown(netdevs: list[str]) -> list[str]:
        """Set ``net.ipv4.conf.<netdev>.ignore_routes_with_linkdown=1`` on each netdev.

        With it the kernel skips a multipath nexthop whose netdev lost carrier (RTNH_F_LINKDOWN)
        at once, so packets sent in the window between the carrier loss and our route change
        already avoid the dead rail.  Returns the netdevs that could not be set (absent ones).
        """
        failed = []
        for dev in netdevs:
            try:
                with open(f"/proc/sys/net/ipv4/conf/{dev}/ignore_routes_with_linkdown", "w") as f:
                    f.write("1")
            except OSError:
                failed.append(dev)
        return failed

    def flush_route_cache(self) -> None:
        """Invalidate every cached IPv4 dst in this network namespace (``ip route flush cache``).

        A connected socket keeps its route in a cached dst.  A route *replace* does not always
        invalidate it: a socket that looked its route up between the carrier loss and our
        replace got a dst through the dead nexthop, which survived the replace, and TCP kept
        retransmitting into the dead rail until its ``tcp_retries1`` (3) timeouts made it drop
        the dst (0.2+0.4+0.8+1.6 = 3 s stalls in the demo, about one run in five).  Writing
        to ``/proc/sys/net/ipv4/route/flush`` bumps the namespace's route generation id, so
        every socket re-resolves its route on its next send (kernel: ``rt_cache_flush``).
        """
        try:
            with open(FLUSH_PATH, "w") as f:
                f.write("1")
        except OSError as e:
            log.warning("cannot flush the route cache (%s): %s", FLUSH_PATH, e)

    async def _ifindex(self, ipr: AsyncIPRoute, netdev: str) -> int:
        i = self._idx.get(netdev)
        if i is None:
            found = await ipr.link_lookup(ifname=netdev)
            if not found:
                raise KeyError(f"netdev {netdev} not found")
            i = self._idx[netdev] = found[0]
        return i

    async def run(self) -> None:
        """Apply plans as they come, newest first; never dies on a failed operation."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            plan, self._pending = self._pending, None
            if plan is None or plan.generation < self.applied_generation:
                continue
            self._busy = True
            try:
                result = await self.reconcile(plan, full=plan.resync)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the actuator alive; report the failure
                log.error("route reconciliation for generation %d failed: %s", plan.generation, e)
                self._drop_caches()
                result = RoutesApplied(plan.generation, time.monotonic_ns(), errors=(str(e),))
            finally:
                self._busy = False
            self.applied_generation = plan.generation
            self.post(result)
