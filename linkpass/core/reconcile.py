"""Desired routes vs routes observed in the kernel -> ordered route operations.

Rules (DESIGN.md rule 6, "we own only what we tag"):

* only routes whose ``proto`` is ours are ever replaced or deleted;
* a desired route whose (dst, table, metric) slot holds a route of another protocol is a
  *conflict*: reported, never overwritten;
* replacements come before deletions so that traffic is never left without a route;
* observed routes of ours for a destination in ``keep_dsts`` are left alone;
* several routes of ours for the same destination (a crash between two operations, or a
  metric change) collapse to one: the extra ones are deleted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from linkpass.core.model import RouteSpec


@dataclass(frozen=True)
class RouteOp:
    """One operation: ``op`` is ``replace`` or ``delete``."""

    op: str
    route: RouteSpec

    def describe(self) -> str:
        return f"{self.op} {self.route.describe()}"


@dataclass(frozen=True)
class Diff:
    """Result of :func:`diff`: ``ops`` in the order to apply them, and conflicts found."""

    ops: tuple[RouteOp, ...]
    conflicts: tuple[str, ...]


def diff(desired: Iterable[RouteSpec], observed: Iterable[RouteSpec], proto: int, keep_dsts: frozenset[str] = frozenset()) -> Diff:
    """Compute the operations that make the kernel match ``desired``.

    Args:
        desired: routes we want (all with ``proto``).
        observed: every route the kernel holds in the relevant table(s), ours and others'.
        proto: our routing protocol number.
        keep_dsts: destinations whose routes of ours must not be touched.

    Returns:
        :class:`Diff`.  Applying ``ops`` to ``observed`` yields ``desired`` for every
        destination not in conflict and not kept.
    """
    desired = list(desired)
    observed = list(observed)
    ours = [r for r in observed if r.proto == proto]
    ours_by_key: dict[tuple[str, int, int], RouteSpec] = {}
    for r in ours:  # the first of ours in each slot (a dict: a scan per desired route is O(n^2) at 1,000s of peers)
        ours_by_key.setdefault(r.key, r)
    foreign_keys = {r.key: r for r in observed if r.proto != proto}
    ops: list[RouteOp] = []
    conflicts: list[str] = []
    wanted_keys = set()
    for want in desired:
        if want.key in foreign_keys:
            f = foreign_keys[want.key]
            conflicts.append(f"{want.dst} table {want.table} metric {want.metric} is held by a route of proto {f.proto}; not touching it")
            continue
        wanted_keys.add(want.key)
        have = ours_by_key.get(want.key)
        if have is None or not have.same_forwarding(want):
            ops.append(RouteOp("replace", want))
    for have in ours:
        if have.key in wanted_keys or have.dst in keep_dsts:
            continue
        ops.append(RouteOp("delete", have))
    return Diff(tuple(ops), tuple(conflicts))
