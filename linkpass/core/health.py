"""Per-rail health state machine.

States (DESIGN.md): ``UP``, ``DOWN``, ``HOLD_DOWN``, ``DRAINED`` (an operator's
``linkpass drain``, or a rail at risk by its counters), plus ``UNKNOWN`` before the first link dump.  A rail carries traffic in
``UP`` only.  There is no rail ``SUSPECT`` state (it was never entered): gray failures are the
paths' ``SUSPECT`` (:mod:`linkpass.core.paths`), the probe verdict that fails a rail, and the
``degraded`` flag of a lossy rail (traffic prefers clean rails), none of which is a rail state.
A rail that comes back goes to ``HOLD_DOWN`` and is used again only after it stayed healthy
for the hold-down time (default 2 s); losing the link during hold-down goes back to ``DOWN``.

One transition table (:data:`TRANSITIONS`), checked in one setter (:meth:`RailHealth.set_state`);
illegal transitions raise :class:`IllegalTransition`; each transition is logged once as
``rail N: OLD -> NEW (reason)``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

log = logging.getLogger("linkpass.health")


class RailState(str, enum.Enum):
    UNKNOWN = "UNKNOWN"
    UP = "UP"
    DOWN = "DOWN"
    HOLD_DOWN = "HOLD_DOWN"
    DRAINED = "DRAINED"


S = RailState

#: Allowed transitions: from-state -> set of to-states.
#: DRAINED is entered by an operator (``linkpass drain``, a :class:`~linkpass.core.model.Drain` event)
#: or because the rail's counters say it is at risk (a :class:`~linkpass.core.model.RiskChanged` event).
TRANSITIONS: dict[RailState, frozenset[RailState]] = {
    S.UNKNOWN: frozenset({S.UP, S.DOWN, S.DRAINED}),
    S.UP: frozenset({S.DOWN, S.DRAINED}),
    S.DOWN: frozenset({S.HOLD_DOWN, S.DRAINED}),
    S.HOLD_DOWN: frozenset({S.UP, S.DOWN, S.DRAINED}),
    S.DRAINED: frozenset({S.DOWN, S.HOLD_DOWN}),
}

USABLE: frozenset[RailState] = frozenset({S.UP})

#: causes of a drain (:meth:`RailHealth.on_drain`)
OPERATOR = "operator"
AT_RISK = "at-risk"


class IllegalTransition(RuntimeError):
    """A state change not in :data:`TRANSITIONS` was attempted (a bug, never bad input)."""


@dataclass
class Transition:
    rail: int
    old: RailState
    new: RailState
    reason: str
    t_ns: int


class RailHealth:
    """Health of one rail on this host.

    Args:
        rail: rail id.
        hold_down_ns: how long a recovered link must stay healthy before reuse (ns).
    """

    def __init__(self, rail: int, hold_down_ns: int):
        self.rail = rail
        self.hold_down_ns = hold_down_ns
        self.state = RailState.UNKNOWN
        self.since_ns = 0
        self.reason = "no link information yet"
        self.link_ok: bool | None = None
        self.hold_until_ns: int | None = None
        self.drains: dict[str, str] = {}  # cause (OPERATOR, AT_RISK) -> why, while DRAINED

    def _drain_reason(self) -> str:
        return "; ".join(self.drains[c] for c in sorted(self.drains))

    @property
    def usable(self) -> bool:
        """True when traffic may use this rail."""
        return self.state in USABLE

    def set_state(self, new: RailState, now_ns: int, reason: str) -> Transition | None:
        """The one setter.  Returns the transition, or None if already in ``new``.

        Raises:
            IllegalTransition: ``old -> new`` is not in :data:`TRANSITIONS`.
        """
        old = self.state
        if new == old:
            return None
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"rail {self.rail}: {old.value} -> {new.value} is not allowed ({reason})")
        self.state = new
        self.since_ns = now_ns
        self.reason = reason
        self.hold_until_ns = now_ns + self.hold_down_ns if new == RailState.HOLD_DOWN else None
        log.info("rail %d: %s -> %s (%s)", self.rail, old.value, new.value, reason)
        return Transition(self.rail, old, new, reason, now_ns)

    def on_link(self, ok: bool, reason: str, now_ns: int) -> Transition | None:
        """Apply a link observation (carrier/operstate/admin state).

        The first observation after start (state UNKNOWN) of a healthy link goes straight
        to UP: there is nothing to fail back from.  Returns the last transition made.
        """
        self.link_ok = ok
        st = self.state
        if st == RailState.DRAINED:
            return None
        if not ok:
            if st in (RailState.UNKNOWN, RailState.UP, RailState.HOLD_DOWN):
                return self.set_state(RailState.DOWN, now_ns, reason)
            self.reason = reason  # still DOWN, maybe for another reason now (e.g. flap damping)
            return None
        # link healthy
        if st == RailState.UNKNOWN:
            return self.set_state(RailState.UP, now_ns, "link up at start")
        if st == RailState.DOWN:
            # say what came back: the reason the rail was DOWN for (the engine's wording)
            back = ("probes answer again" if self.reason.startswith("probes")
                    else "flap damping released it" if self.reason.startswith("flap damping") else "link back")
            if self.hold_down_ns == 0:
                self.set_state(RailState.HOLD_DOWN, now_ns, back)
                return self.set_state(RailState.UP, now_ns, "hold-down is 0 ms")
            return self.set_state(RailState.HOLD_DOWN, now_ns, f"{back}, holding down")
        return None

    def on_tick(self, now_ns: int) -> Transition | None:
        """Finish hold-down if it has run its course."""
        if self.state == RailState.HOLD_DOWN and self.hold_until_ns is not None and now_ns >= self.hold_until_ns:
            return self.set_state(RailState.UP, now_ns, f"stayed up for hold-down {self.hold_down_ns // 1_000_000} ms")
        return None

    def on_drain(self, drain: bool, now_ns: int, cause: str = OPERATOR, why: str | None = None) -> Transition | None:
        """Drain / undrain for one cause: the operator (``linkpass drain``) or :data:`AT_RISK`
        (counter trends, :mod:`linkpass.core.risk`), with ``why`` for the reason.  The causes
        are independent: the rail stays DRAINED while any holds (an operator's undrain leaves a
        rail at risk drained, and a rail whose counters are clean again stays drained while the
        operator's drain holds); the last one lifted starts the hold-down."""
        if drain:
            self.drains[cause] = why or ("drained by operator" if cause == OPERATOR else cause)
            if self.state == RailState.DRAINED:
                self.reason = self._drain_reason()
                return None
            return self.set_state(RailState.DRAINED, now_ns, self._drain_reason())
        if self.drains.pop(cause, None) is None or self.state != RailState.DRAINED:
            return None
        if self.drains:
            self.reason = self._drain_reason()
            return None
        if self.link_ok:
            t = self.set_state(RailState.HOLD_DOWN, now_ns, "undrained, holding down")
            if self.hold_down_ns == 0:
                return self.set_state(RailState.UP, now_ns, "hold-down is 0 ms")
            return t
        return self.set_state(RailState.DOWN, now_ns, "undrained, link down")

    def next_deadline(self) -> int | None:
        """Monotonic ns at which :meth:`on_tick` has work, or None."""
        return self.hold_until_ns if self.state == RailState.HOLD_DOWN else None
