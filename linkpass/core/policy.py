"""What the core decides with: the settings it reads, as frozen dataclasses.

The core never sees the validated config (pydantic models, file readers); the daemon builds
these from it at the edge (:func:`linkpass.config.policy_from_config`), once at start and again
on every accepted reload, and hands them in (:class:`~linkpass.core.engine.Engine`,
:class:`~linkpass.core.model.ConfigReloaded`, :class:`~linkpass.core.probe_filter.ProbeFilter`).
There are no defaults here: the config's are the only ones (``linkpass config show --defaults``),
so the two can never disagree.  Addresses are dotted-quad strings (``"198.18.0.1"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True)
class RailPolicy:
    """One rail of this host: its id (the same on every host of the job), the netdev that
    serves it here, and this host's address on it (None when the config gives none)."""

    id: int
    netdev: str
    address: str | None


@dataclass(frozen=True)
class PeerPolicy:
    """Another host of the job: its name (its ``daemon.host``), host IP (None in per-rail-ip
    mode when unset) and, per rail id, its address on that rail (config order kept)."""

    name: str
    host_ip: str | None
    rail_ips: Mapping[int, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "rail_ips", MappingProxyType(dict(self.rail_ips)))


@dataclass(frozen=True)
class HostPolicy:
    """This host and the routes it owns (``[daemon]``).

    Attributes:
        name: this host's name (``daemon.host``).
        mode: ``"host-ip"`` or ``"per-rail-ip"`` (DESIGN.md, addressing).
        host_ip: this host's address in host-ip mode (None otherwise, when unset).
        route_protocol, route_table, route_metric: what every route we install carries.
        hold_down_ms: how long a rail that comes back must stay up before it is used again.
    """

    name: str
    mode: Literal["host-ip", "per-rail-ip"]
    host_ip: str | None
    route_protocol: int
    route_table: int
    route_metric: int
    hold_down_ms: int


@dataclass(frozen=True)
class ProbePolicy:
    """Probe timing and verdict thresholds (``[probe]``); times in ms, shares and losses in 0..1.

    Attributes:
        interval_ms: fast-set probe interval per path (BFD desired min TX).
        detect_multiplier: misses in a row (and intervals without a reply) before a path is DOWN.
        slow_interval_ms: interval of the slow sweep over the other peers.
        rail_down_share: a rail fails when more than this share of its answering peers are DOWN.
        loss_window_ms: window of a rail's loss ratio.
        degraded_loss: loss ratio over the window that marks a rail DEGRADED.
        healthy_loss: per-probe (round-trip) loss of a healthy path, H0 of the lossy test
            (:mod:`linkpass.core.lossy`).
        lossy_loss: per-probe loss of a path to leave, H1 of the lossy test.
        lossy_alpha: bound on the lossy test's false alarms per probe at ``healthy_loss``.
        lossy_clear_alpha: bound on its wrong clears per probe at ``lossy_loss``.
    """

    interval_ms: int
    detect_multiplier: int
    slow_interval_ms: int
    rail_down_share: float
    loss_window_ms: int
    degraded_loss: float
    healthy_loss: float
    lossy_loss: float
    lossy_alpha: float
    lossy_clear_alpha: float


@dataclass(frozen=True)
class DampingPolicy:
    """Flap damping per rail (``[damping]``; :class:`~linkpass.core.damping.FlapDamper`).

    Attributes:
        enabled: damp at all.
        penalty: figure of merit added per down event.
        half_life_ms: the penalty halves every half-life.
        suppress: above this the rail stays out of use; reuse: ... until it decays below this.
        max_penalty: ceiling of the penalty (bounds the longest suppression).
    """

    enabled: bool
    penalty: int
    half_life_ms: int
    suppress: int
    reuse: int
    max_penalty: int


@dataclass(frozen=True)
class EnginePolicy:
    """Everything the engine and planner read: this host, its rails, its peers, probe and
    damping settings.  Rails and peers are in config order (rail ids and peer names unique)."""

    host: HostPolicy
    rails: tuple[RailPolicy, ...]
    peers: tuple[PeerPolicy, ...]
    probe: ProbePolicy
    damping: DampingPolicy
