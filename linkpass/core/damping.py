"""Flap damping for one rail: a decaying penalty with suppress/reuse limits.

Modelled on RFC 2439, "BGP Route Flap Damping" (Villamizar, Chandra, Govindan, 1998):

- every down event adds a fixed ``penalty`` to the rail's *figure of merit*;
- the figure of merit decays exponentially with a half-life::

      value(t) = value(t0) * 2 ** (-(t - t0) / half_life)

- it never exceeds ``max_penalty`` (RFC 2439's ceiling), which bounds the longest
  suppression to :func:`max_suppress_ns`;
- when it reaches the ``suppress`` limit (RFC 2439's cut-off threshold) the rail is
  *suppressed*: kept out of use even while its link is up;
- a suppressed rail is released only when the decayed figure of merit has fallen to the
  ``reuse`` limit, which is below ``suppress`` (hysteresis).  Because the decay is exact, the
  release instant is known in advance (:meth:`FlapDamper.release_at`), so the engine sets a
  timer for it instead of polling.

Penalties are unitless; every time is monotonic nanoseconds (``*_ns``), passed in by the
caller (DESIGN.md rule 2: the clock is a parameter).  Time never runs backwards here: a
``now_ns`` earlier than the last down event is read as that event's time.

Two states, one transition table (:data:`TRANSITIONS`), one setter
(:meth:`FlapDamper.set_state`); each transition is logged once as
``rail N: OLD -> NEW (reason)``.  Queries (:meth:`~FlapDamper.suppressed`,
:meth:`~FlapDamper.penalty_at`, :meth:`~FlapDamper.release_at`, :meth:`~FlapDamper.to_json`)
never change state: a release that has fallen due is *reported* by the queries at once and
*recorded* (logged, state set) by the next :meth:`~FlapDamper.on_tick` or
:meth:`~FlapDamper.on_down`.

Guarantee (what makes "no route change more often than the damping allows" true): a
suppression lasts at least :func:`min_suppress_ns`, so two onsets of suppression are at least
that far apart and a window of ``w`` ns holds at most ``w // min_suppress_ns + 1`` of them
(:func:`max_onsets`).
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass

from linkpass.core.policy import DampingPolicy

log = logging.getLogger("linkpass.damping")


class DampState(str, enum.Enum):
    ALLOWED = "ALLOWED"  # the damper does not object to using the rail
    SUPPRESSED = "SUPPRESSED"  # keep the rail out of use until the penalty decays to reuse


D = DampState

#: Allowed transitions: from-state -> set of to-states.
TRANSITIONS: dict[DampState, frozenset[DampState]] = {
    D.ALLOWED: frozenset({D.SUPPRESSED}),
    D.SUPPRESSED: frozenset({D.ALLOWED}),
}


class IllegalDampTransition(RuntimeError):
    """A state change not in :data:`TRANSITIONS` was attempted (a bug, never bad input)."""


@dataclass(frozen=True)
class DampTransition:
    rail: int | None
    old: DampState
    new: DampState
    reason: str
    t_ns: int


# ----------------------------------------------------------------------------- decay maths


def decayed(value: float, elapsed_ns: int, half_life_ns: int) -> float:
    """``value`` after ``elapsed_ns`` of exponential decay with ``half_life_ns`` (both ns).

    Negative ``elapsed_ns`` counts as 0 (time does not run backwards).  Every penalty this
    module reports comes from this one function, so release instants computed with
    :func:`decay_ns` agree with :meth:`FlapDamper.penalty_at` to the nanosecond.
    """
    if elapsed_ns <= 0 or value <= 0.0:
        return value
    return value * 2.0 ** (-(elapsed_ns / half_life_ns))


def decay_ns(start: float, target: float, half_life_ns: int) -> int:
    """Smallest whole number of ns after which ``start`` has decayed to at most ``target``.

    That is the least ``n >= 0`` with ``decayed(start, n, half_life_ns) <= target``: the
    ceiling of ``half_life_ns * log2(start / target)``, settled against :func:`decayed`
    itself so float rounding cannot put it one ns off.

    Raises:
        ValueError: ``target`` is not positive (a positive value never decays to 0).
    """
    if target <= 0:
        raise ValueError(f"decay target must be positive, got {target!r}")
    if start <= target:
        return 0
    n = max(1, math.ceil(half_life_ns * math.log2(start / target)))
    while decayed(start, n, half_life_ns) > target:
        n += 1
    while n > 0 and decayed(start, n - 1, half_life_ns) <= target:
        n -= 1
    return n


def max_suppress_ns(half_life_ns: int, reuse: float, max_penalty: float) -> int:
    """Longest possible suppression, in ns: the time ``max_penalty`` takes to decay to ``reuse``.

    ``half_life_ns * log2(max_penalty / reuse)``, rounded up to a whole ns.  No rail is ever
    suppressed longer than this after its last down event (RFC 2439 derives its ceiling the
    other way round: ``ceiling = reuse * 2 ** (max_hold_down / half_life)``).  With the
    defaults (half-life 15 s, reuse 800, max_penalty 8000) this is about 49.8 s.
    """
    return decay_ns(max_penalty, reuse, half_life_ns)


def min_suppress_ns(half_life_ns: int, suppress: float, reuse: float) -> int:
    """Shortest possible suppression, in ns: the time ``suppress`` takes to decay to ``reuse``.

    A suppression starts with the penalty at or above ``suppress`` and ends when it has
    decayed to ``reuse``, with no decrease other than decay, so it lasts at least this long.
    With the defaults (half-life 15 s, suppress 2500, reuse 800) this is about 24.7 s.
    """
    return decay_ns(suppress, reuse, half_life_ns)


def max_onsets(window_ns: int, half_life_ns: int, suppress: float, reuse: float) -> int:
    """Most times a rail can go from not suppressed to suppressed within ``window_ns`` ns.

    Onsets of suppression are at least :func:`min_suppress_ns` apart (the rail is released
    no earlier than that after an onset, and cannot be suppressed again before its release),
    so a half-open window of ``window_ns`` holds at most ``window_ns // min_suppress_ns + 1``.
    """
    return max(0, window_ns) // min_suppress_ns(half_life_ns, suppress, reuse) + 1


# ----------------------------------------------------------------------------- the damper


class FlapDamper:
    """Flap penalty of one rail (RFC 2439 figure of merit).

    Args:
        penalty: added to the figure of merit per down event (unitless, > 0).
        half_life_ns: the figure of merit halves every ``half_life_ns`` ns (> 0).
        suppress: at or above this the rail is suppressed (RFC 2439 cut-off threshold).
        reuse: a suppressed rail is released once the penalty has decayed to this (> 0).
        max_penalty: ceiling of the figure of merit; bounds the longest suppression
            (:func:`max_suppress_ns`).
        rail: rail id, for logs only.

    Requires ``0 < reuse < suppress <= max_penalty``.  ``suppress == max_penalty`` is
    allowed: a capped penalty suppresses.

    Raises:
        ValueError: the limits are out of order or not positive.
    """

    def __init__(self, penalty: float, half_life_ns: int, suppress: float, reuse: float, max_penalty: float,
                 *, rail: int | None = None):
        if not penalty > 0:
            raise ValueError(f"damping penalty must be positive, got {penalty!r}")
        if not (isinstance(half_life_ns, int) and half_life_ns > 0):
            raise ValueError(f"damping half_life_ns must be a positive integer, got {half_life_ns!r}")
        if not reuse > 0:
            raise ValueError(f"damping reuse must be positive (a penalty never decays to 0), got {reuse!r}")
        if not reuse < suppress <= max_penalty:
            raise ValueError(f"damping limits need reuse < suppress <= max_penalty, got {reuse!r}, {suppress!r}, {max_penalty!r}")
        self.penalty = penalty
        self.half_life_ns = half_life_ns
        self.suppress = suppress
        self.reuse = reuse
        self.max_penalty = max_penalty
        self.rail = rail
        self.state = DampState.ALLOWED
        self.downs = 0  # down events seen (for status)
        self._value = 0.0  # figure of merit at _t_ns
        self._t_ns = 0  # time of the last down event (the decay reference)
        self._release_ns: int | None = None  # set exactly while SUPPRESSED

    @classmethod
    def from_policy(cls, policy: DampingPolicy, *, rail: int | None = None) -> FlapDamper:
        """Build from the damping settings (:class:`~linkpass.core.policy.DampingPolicy`).

        Raises:
            ValueError: limits out of order (as the constructor)."""
        return cls(policy.penalty, policy.half_life_ms * 1_000_000, policy.suppress, policy.reuse,
                   policy.max_penalty, rail=rail)

    # ------------------------------------------------------------------------- queries

    def penalty_at(self, now_ns: int) -> float:
        """Figure of merit at ``now_ns`` (monotonic ns): the last value, decayed; never negative."""
        return decayed(self._value, now_ns - self._t_ns, self.half_life_ns)

    def suppressed(self, now_ns: int) -> bool:
        """True when the rail must stay out of use at ``now_ns`` (monotonic ns).

        Turns on when a down event brings the penalty to ``suppress`` or above; stays on
        until the decayed penalty has fallen to ``reuse`` (:meth:`release_at`).
        """
        return self._release_ns is not None and now_ns < self._release_ns

    def release_at(self, now_ns: int) -> int | None:
        """Monotonic ns at which a suppressed rail is released, or None when not suppressed.

        Exact: the first ns at which :meth:`penalty_at` is at most ``reuse``, so
        ``suppressed(t)`` is True for ``t < release_at`` and False from ``release_at`` on,
        unless another down event comes first.  A later down event never moves it earlier.
        """
        return self._release_ns if self.suppressed(now_ns) else None

    def next_deadline(self) -> int | None:
        """Monotonic ns at which :meth:`on_tick` has work (the pending release), or None."""
        return self._release_ns if self.state == DampState.SUPPRESSED else None

    def to_json(self, now_ns: int) -> dict:
        """Status at ``now_ns`` for `linkpass status` and metrics."""
        release = self.release_at(now_ns)
        return {
            "rail": self.rail,
            "penalty": round(self.penalty_at(now_ns), 3),
            "suppressed": release is not None,
            "release_at_ns": release,
            "release_in_ms": None if release is None else round((release - now_ns) / 1e6, 3),
            "downs": self.downs,
            "limits": {"penalty": self.penalty, "half_life_ms": self.half_life_ns / 1e6, "suppress": self.suppress,
                       "reuse": self.reuse, "max_penalty": self.max_penalty},
        }

    # ------------------------------------------------------------------------- changes

    def set_state(self, new: DampState, now_ns: int, reason: str) -> DampTransition | None:
        """The one setter.  Returns the transition, or None if already in ``new``.

        Raises:
            IllegalDampTransition: ``old -> new`` is not in :data:`TRANSITIONS`.
        """
        old = self.state
        if new == old:
            return None
        if new not in TRANSITIONS[old]:
            raise IllegalDampTransition(f"rail {self.rail}: {old.value} -> {new.value} is not allowed ({reason})")
        self.state = new
        if new == DampState.ALLOWED:
            self._release_ns = None
        log.info("rail %s: %s -> %s (%s)", self.rail, old.value, new.value, reason)
        return DampTransition(self.rail, old, new, reason, now_ns)

    def on_tick(self, now_ns: int) -> DampTransition | None:
        """Record a release that has fallen due by ``now_ns``.  The transition carries the
        exact release instant, not ``now_ns``."""
        rel = self._release_ns
        if self.state == DampState.SUPPRESSED and rel is not None and now_ns >= rel:
            return self.set_state(DampState.ALLOWED, rel, f"penalty decayed to reuse {self.reuse:g}")
        return None

    def on_down(self, now_ns: int) -> bool:
        """A down event at ``now_ns`` (monotonic ns).  Returns whether the rail is now suppressed.

        Decays the penalty to ``now_ns``, adds ``penalty``, caps at ``max_penalty``.  A rail
        not suppressed becomes suppressed when the result is ``suppress`` or more; a
        suppressed rail stays suppressed and its release moves later (never earlier).
        """
        self.on_tick(now_ns)
        now_ns = max(now_ns, self._t_ns)
        value = min(self.penalty_at(now_ns) + self.penalty, self.max_penalty)
        self._value, self._t_ns = value, now_ns
        self.downs += 1
        release = now_ns + decay_ns(value, self.reuse, self.half_life_ns)
        if self.state == DampState.SUPPRESSED:
            # In exact arithmetic the new release is never earlier; max() absorbs a 1 ns float tie.
            self._release_ns = release if self._release_ns is None else max(release, self._release_ns)
        elif value >= self.suppress:
            self._release_ns = release
            self.set_state(DampState.SUPPRESSED, now_ns,
                           f"flap penalty {value:.0f} >= suppress {self.suppress:g}, released in {(release - now_ns) / 1e9:.1f} s")
        return self.suppressed(now_ns)

    def clear(self, now_ns: int, reason: str = "cleared by operator") -> DampTransition | None:
        """Forget the flap history (penalty 0) and release the rail if suppressed."""
        self._value, self._t_ns = 0.0, max(now_ns, self._t_ns)
        if self.state == DampState.SUPPRESSED:
            return self.set_state(DampState.ALLOWED, now_ns, reason)
        return None
