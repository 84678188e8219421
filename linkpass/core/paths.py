"""Per-(rail, peer) path health from active probes.

A path is ``SUSPECT`` after one missed probe and ``DOWN`` once both hold: ``detect_multiplier``
probes in a row went unanswered, and no reply came for ``detect_multiplier x interval`` (BFD's
detection time, RFC 5880 section 6.8.4: detect multiplier x interval).  The prober sends extra
*confirm* probes on a path that missed one (every interval / 5), so under a blackhole the count
is reached well before the time and DOWN comes within one confirm spacing of BFD's detection
time; under random loss a path must lose every probe for the whole detection time (about six
in a row instead of three), which keeps ordinary loss from failing paths.  One answered probe
makes the path ``UP`` again.  ``UNKNOWN`` until the first
answered probe: like a BFD session that never came Up, a path that never answered is not a
failure (the peer's daemon may not run yet).  One transition table, checked in one setter; each change is logged once.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger("linkpass.paths")


class PathState(str, enum.Enum):
    UNKNOWN = "UNKNOWN"
    UP = "UP"
    SUSPECT = "SUSPECT"
    DOWN = "DOWN"


P = PathState

PATH_TRANSITIONS: dict[PathState, frozenset[PathState]] = {
    P.UNKNOWN: frozenset({P.UP, P.SUSPECT, P.DOWN}),
    P.UP: frozenset({P.SUSPECT, P.DOWN}),
    P.SUSPECT: frozenset({P.UP, P.DOWN}),
    P.DOWN: frozenset({P.UP}),
}


class IllegalPathTransition(RuntimeError):
    """A path state change not in :data:`PATH_TRANSITIONS` (a bug, never bad input)."""


class PathHealth:
    """Probe health of one path.

    Args:
        rail: local rail id.
        peer: peer host name.
        detect_multiplier: consecutive misses that make the path DOWN (>= 1).
    """

    def __init__(self, rail: int, peer: str, detect_multiplier: int, interval_ns: int = 0):
        self.rail, self.peer = rail, peer
        self.detect_multiplier = max(1, detect_multiplier)
        self.interval_ns = interval_ns
        self.state = PathState.UNKNOWN
        self.misses = 0
        self.since_ns = 0
        self.last_rtt_ns: int | None = None
        #: from the latest miss: did the peer answer on another rail meanwhile (see
        #: :attr:`linkpass.core.model.ProbeResult.peer_elsewhere`); None after an answer
        self.peer_elsewhere: bool | None = None
        #: misses in a row after which a path that never answered, while its peer answers on
        #: other rails, is DOWN (longer than BFD's count: the peer's rail socket may be opening)
        self.never_answered_misses = max(10, 2 * self.detect_multiplier)
        #: when the latest result (answer or miss) reached the engine (monotonic ns)
        self.last_result_ns = 0

    def _set(self, new: PathState, now_ns: int, reason: str) -> tuple[PathState, PathState] | None:
        old = self.state
        if new == old:
            return None
        if new not in PATH_TRANSITIONS[old]:
            raise IllegalPathTransition(f"path rail {self.rail} -> {self.peer}: {old.value} -> {new.value}")
        self.state, self.since_ns = new, now_ns
        # UP <-> SUSPECT happens all the time under ordinary loss: debug; anything with DOWN, info
        level = logging.INFO if PathState.DOWN in (old, new) or old == PathState.UNKNOWN else logging.DEBUG
        log.log(level, "path rail %d -> %s: %s -> %s (%s)", self.rail, self.peer, old.value, new.value, reason)
        return old, new

    def on_result(self, ok: bool, now_ns: int, rtt_ns: int | None = None,
                  since_ok_ns: int | None = None, peer_elsewhere: bool | None = None) -> tuple[PathState, PathState] | None:
        """Apply one probe result; returns (old, new) when the state changed.

        Args:
            ok: the probe was answered in time.
            now_ns: monotonic ns.
            rtt_ns: round-trip time of an answered probe.
            since_ok_ns: for a miss, ns since the last reply on this path (None: unknown, then
                the count alone decides).
            peer_elsewhere: for a miss, whether the peer answered on another rail meanwhile
                (kept in :attr:`peer_elsewhere`; it does not change the path's own state).

        DOWN after ``detect_multiplier`` misses in a row once no reply came for
        ``detect_multiplier x interval`` (both must hold).
        """
        self.last_result_ns = now_ns
        if ok:
            self.misses = 0
            self.last_rtt_ns = rtt_ns
            self.peer_elsewhere = None
            return self._set(PathState.UP, now_ns, "probe answered")
        self.misses += 1
        self.peer_elsewhere = peer_elsewhere
        if self.state == PathState.UNKNOWN:
            # never answered: not a failure while the peer may not run yet (like a BFD session
            # not yet Up), unless the peer answers on other rails all along: then this path
            # is broken from the start (e.g. a daemon restarted onto a rail already blackholed)
            if peer_elsewhere is True and self.misses >= self.never_answered_misses:
                return self._set(PathState.DOWN, now_ns, f"never answered in {self.misses} probes while the peer answers on other rails")
            return None
        silent_long = since_ok_ns is None or self.interval_ns <= 0 or since_ok_ns >= self.detect_multiplier * self.interval_ns
        if self.misses >= self.detect_multiplier and silent_long:
            why = (f"{self.misses} probes in a row unanswered" if since_ok_ns is None else
                   f"{self.misses} probes in a row unanswered, no reply for {since_ok_ns / 1e6:.1f} ms "
                   f"(>= {self.detect_multiplier} x {self.interval_ns / 1e6:g} ms)")
            return self._set(PathState.DOWN, now_ns, why)
        if self.state != PathState.DOWN:
            return self._set(PathState.SUSPECT, now_ns, f"{self.misses} probe(s) unanswered")
        return None
