"""(policy, rail health, peers' rail notices) -> the routes we want.

Two addressing modes (DESIGN.md):

* **host-ip**: one route per peer host IP (``/32``) with one nexthop per rail usable at
  both ends, ``src`` = our host IP.  Several rails make an ECMP multipath route (the kernel
  hashes each flow onto one rail); flows survive a rail loss because their addresses do not
  belong to any rail.
* **per-rail-ip**: rails have their own subnets and the connected routes carry traffic.  When
  rail *k* is unusable at either end, each peer's rail-*k* address gets a ``/32`` route over a
  usable rail *m* (``src`` = our rail-*k* address, so sockets bound to it keep working;
  rp_filter must be loose, which the fabric sets).

A peer with no rail usable at both ends keeps whatever route it had (``keep_dsts``): a stale
route is better than traffic leaking to a default route.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from linkpass.core.model import Nexthop, RouteSpec
from linkpass.core.policy import EnginePolicy, PeerPolicy


@dataclass(frozen=True)
class Plan:
    """What the planner wants: routes, destinations to leave alone, and notes for the log."""

    routes: tuple[RouteSpec, ...]
    keep_dsts: frozenset[str]
    notes: tuple[str, ...] = ()


def _common_rails(policy: EnginePolicy, peer: PeerPolicy, local_usable: frozenset[int], peer_usable: Mapping[str, frozenset[int]],
                  path_down: frozenset[tuple[int, str]] = frozenset(), degraded: frozenset[int] = frozenset()) -> list[int]:
    remote = peer_usable.get(peer.name)
    common = [r.id for r in policy.rails if r.id in local_usable and r.id in peer.rail_ips
              and (remote is None or r.id in remote) and (r.id, peer.name) not in path_down]
    clean = [r for r in common if r not in degraded]
    return sorted(clean or common)


def plan_routes(policy: EnginePolicy, local_usable: Iterable[int], peer_usable: Mapping[str, frozenset[int]],
                path_down: frozenset[tuple[int, str]] = frozenset(), degraded: frozenset[int] = frozenset()) -> Plan:
    """Compute the desired routes.

    Args:
        policy: rails, peers, mode, route protocol/table/metric (:class:`~linkpass.core.policy.EnginePolicy`).
        local_usable: ids of our rails in a usable state (UP).
        peer_usable: per peer name, the rails that peer last announced as usable; a peer
            never heard from is assumed to use all its configured rails.
        path_down: (rail, peer) paths whose probes say DOWN: that peer is not reached over
            that rail even though the rail itself is fine (a peer problem, not a rail problem).
        degraded: rails losing more than the configured share of probes; used for a peer only
            when no clean rail reaches it.

    Returns:
        :class:`Plan` with routes sorted by destination (deterministic: same inputs give
        the same plan).
    """
    local = frozenset(local_usable)
    netdev = {r.id: r.netdev for r in policy.rails}
    d = policy.host
    routes: list[RouteSpec] = []
    keep: set[str] = set()
    notes: list[str] = []
    for peer in policy.peers:
        common = _common_rails(policy, peer, local, peer_usable, path_down, degraded)
        if d.mode == "host-ip":
            dst = f"{peer.host_ip}/32"
            if not common:
                keep.add(dst)
                notes.append(f"peer {peer.name}: no rail usable at both ends; leaving its route as it is")
                continue
            nhs = tuple(sorted(Nexthop(str(peer.rail_ips[r]), netdev[r], r) for r in common))
            routes.append(RouteSpec(dst, nhs, str(d.host_ip), d.route_table, d.route_metric, d.route_protocol))
        else:
            own_addr = {r.id: r.address for r in policy.rails}
            for rid in sorted(peer.rail_ips):
                if rid in common or rid not in netdev:
                    continue
                dst = f"{peer.rail_ips[rid]}/32"
                if not common:
                    keep.add(dst)
                    notes.append(f"peer {peer.name}: rail {rid} unusable and no substitute rail")
                    continue
                sub = common[rid % len(common)]
                nh = (Nexthop(str(peer.rail_ips[sub]), netdev[sub], sub),)
                src = str(own_addr[rid]) if own_addr.get(rid) is not None else None
                routes.append(RouteSpec(dst, nh, src, d.route_table, d.route_metric, d.route_protocol))
    routes.sort(key=lambda r: r.dst)
    return Plan(tuple(routes), frozenset(keep), tuple(notes))


def all_destinations(policy: EnginePolicy) -> frozenset[str]:
    """Every prefix the planner may ever route with this policy (to spot foreign routes)."""
    if policy.host.mode == "host-ip":
        return frozenset(f"{p.host_ip}/32" for p in policy.peers)
    return frozenset(f"{ip}/32" for p in policy.peers for ip in p.rail_ips.values())
