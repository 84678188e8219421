"""The core's view of a validated config: :mod:`linkpass.core.policy` dataclasses, built at the
edge (the daemon, at start and on every accepted reload) so the core never sees pydantic."""

from __future__ import annotations

import ipaddress

from linkpass.config.schema import Config, DampingSection, ProbeSection
from linkpass.core.policy import DampingPolicy, EnginePolicy, HostPolicy, PeerPolicy, ProbePolicy, RailPolicy


def policy_from_config(cfg: Config) -> EnginePolicy:
    """The core's view of a validated (and, in auto mode, resolved) config: what the engine,
    the planner and the probe filter decide with (:mod:`linkpass.core.policy`).  Addresses
    become dotted-quad strings; rails and peers keep their config order."""
    d = cfg.daemon
    return EnginePolicy(
        host=HostPolicy(name=d.host, mode=d.mode, host_ip=_ip_text(d.host_ip), route_protocol=d.route_protocol,
                        route_table=d.route_table, route_metric=d.route_metric, hold_down_ms=d.hold_down_ms),
        rails=tuple(RailPolicy(r.id, r.netdev, _ip_text(r.address)) for r in cfg.rails),
        peers=tuple(PeerPolicy(p.name, _ip_text(p.host_ip), {k: str(v) for k, v in p.rail_ips.items()}) for p in cfg.peers),
        probe=probe_policy(cfg.probe),
        damping=damping_policy(cfg.damping),
    )


def probe_policy(pc: ProbeSection) -> ProbePolicy:
    """:class:`~linkpass.core.policy.ProbePolicy` of a ``[probe]`` section."""
    return ProbePolicy(interval_ms=pc.interval_ms, detect_multiplier=pc.detect_multiplier,
                       slow_interval_ms=pc.slow_interval_ms, rail_down_share=pc.rail_down_share,
                       loss_window_ms=pc.loss_window_ms, degraded_loss=pc.degraded_loss,
                       healthy_loss=pc.healthy_loss, lossy_loss=pc.lossy_loss, lossy_alpha=pc.lossy_alpha,
                       lossy_clear_alpha=pc.lossy_clear_alpha)


def damping_policy(dc: DampingSection) -> DampingPolicy:
    """:class:`~linkpass.core.policy.DampingPolicy` of a ``[damping]`` section."""
    return DampingPolicy(enabled=dc.enabled, penalty=dc.penalty, half_life_ms=dc.half_life_ms, suppress=dc.suppress,
                         reuse=dc.reuse, max_penalty=dc.max_penalty)


def _ip_text(ip: ipaddress.IPv4Address | None) -> str | None:
    return None if ip is None else str(ip)
