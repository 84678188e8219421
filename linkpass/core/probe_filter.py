"""Between the prober and the engine: pass on only the probe results that can change a decision,
and aggregate the rest into a per-rail loss ratio.

The prober produces one :class:`ProbeResult` per path per interval (8 rails x 4 peers at 10 ms is
3,200 a second).  The engine only needs: every failure (misses count toward SUSPECT/DOWN), the
first success after a failure or the first success ever (a path coming UP), and the loss ratio
of each rail over ``loss_window_ms``.  This filter forwards exactly those and posts a
:class:`ProbeLoss` per rail at most every ``REPORT_S`` seconds (and at once when a rail's ratio
crosses the DEGRADED threshold), so the engine sees tens of events a second instead of thousands.
Paths that have never answered are left out of the loss ratio (their peer may not run a prober
yet), and so are dead paths (20 misses in a row, or 2 x detect_multiplier if more, until they answer again): a
dead peer is a path problem, not loss on the rail.  Nor are misses the prober marks
``peer_elsewhere=False`` (the peer answered on none of our rails meanwhile): a peer that is
silent everywhere at once says nothing about any one rail.  And the ratio posted leaves out a path
that loses clearly more than the rail's other paths (:meth:`ProbeFilter._spread`): loss on our
end of a rail reaches every peer, one peer's fault does not.

Nor are *explained* misses: those of a probe outstanding while our end of the rail had no
carrier (or was down, or gone), or while the peer had announced the rail unusable at its end,
or sent less than one interval after either came back.  Netlink and the peer's notice already
said why those probes were lost; counting them as loss would leave a rail that lost its carrier
for 100 ms DEGRADED, and its path lossy, for a loss window after the carrier is back (a few
carrier flaps a second made a healthy 2-rail fabric DEGRADED in ``bench/detect_reroute.py``).
They still reach the engine: the path's state machine judges them as before.  The filter learns
the link state and the peers' rails from the events it is handed with :meth:`observe`
(``LinkChanged``, ``LinkSnapshot``, ``PeerRails``).

The same results (those the loss window counts, and no miss of a dead path) feed each path's
sequential loss test (:mod:`linkpass.core.lossy`); a change of its verdict is posted at once as a
:class:`PathLossy`.  That test sees every answer, which the engine does not.  Misses in a row
that end in a dead path are taken back out of the test (a dead path or a lost link is BFD's
rule's and the link state's to judge, and counting them would hold up the path's recovery).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from linkpass.core.lossy import LossTest, PathLossTest, two_proportion_z
from collections.abc import Mapping

from linkpass.core.model import Event, LinkChanged, LinkSnapshot, PathLossy, PeerRails, ProbeLoss, ProbeResult
from linkpass.core.policy import ProbePolicy

REPORT_S = 0.25
# one path's loss is its own, not the rail's, when it stands out this clearly from the rail's other
# paths (one-sided two-proportion z): by chance 1 in 740 with equal loss on 2 paths.  A path that
# goes silent among 2 stands out before its misses can move traffic (engine.avoided_degraded: z >= 4
# against a clean rail; checked for windows of 1 to 100 results per path).  Near z = 3 (a short
# window, some loss on the other paths too) it can still flag the rail DEGRADED for a moment
OUTLIER_Z = 3.0
REPORT_NS = int(REPORT_S * 1e9)


class ProbeFilter:
    """Callable that takes ProbeResults from the prober and posts what the engine needs.

    Pure (no clock, no I/O): times come from the results' ``t_ns``; what it passes on goes to
    ``post``.

    Args:
        probe: probe settings (``detect_multiplier``, ``interval_ms``, ``loss_window_ms``,
            ``degraded_loss``); :func:`linkpass.config.probe_policy` builds them.
        post: where events go (the engine queue's ``put_nowait``).
        rails: netdev -> rail id of our rails (to read :meth:`observe`'s link events); empty:
            no miss is explained by the link state.
    """

    def __init__(self, probe: ProbePolicy, post: Callable[[Event], None], rails: Mapping[str, int] | None = None):
        self.probe = probe
        self.post = post
        self.rails: dict[str, int] = dict(rails or {})
        self.link_down: dict[int, int] = {}  # rail -> since when (ns) our end is down
        self.link_up: dict[int, int] = {}  # rail -> when (ns) our end last came back
        self.peer_down: dict[tuple[int, str], int] = {}  # path -> since when the peer announces the rail unusable
        self.peer_up: dict[tuple[int, str], int] = {}  # path -> when the peer last announced it usable again
        self.explained = 0  # misses left out of the loss window and test as explained
        self.last_ok: dict[tuple[int, str], bool] = {}
        self.last_ok_ns: dict[tuple[int, str], int] = {}
        self.path_window: dict[tuple[int, str], deque] = {}  # path -> (t_ns, ok) in the loss window
        self.path_lost: dict[tuple[int, str], int] = {}
        self.rail_q: dict[int, deque] = {}  # rail -> ((t_ns, ok), path) of its paths' windows, oldest first
        self.streak: dict[tuple[int, str], int] = {}  # path -> misses in a row
        self.revived_ns: dict[tuple[int, str], int] = {}  # path -> when it last answered after being dead
        self.rail_n: dict[int, int] = {}  # per rail, over its live paths: probes in the window
        self.rail_lost: dict[int, int] = {}  # ... and of those, lost
        self.last_report: dict[int, int] = {}  # rail -> t_ns of its last ProbeLoss
        self.last_side: dict[int, bool] = {}
        self.rail_keys: dict[int, list[tuple[int, str]]] = {}  # rail -> its paths with a window
        self.worst: dict[int, tuple[tuple[int, str] | None, int]] = {}  # rail -> (path left out, when chosen)
        self.tests: dict[tuple[int, str], PathLossTest] = {}  # path -> its sequential loss test
        self.lossy: set[tuple[int, str]] = set()  # paths it calls lossy now
        self.before_streak: dict[tuple[int, str], tuple] = {}  # path -> its test's state before its misses in a row
        self.loss_test = loss_test(probe)
        self.forwarded = 0
        self.absorbed = 0

    def reconfigure(self, probe: ProbePolicy, rails: Mapping[str, int] | None = None) -> None:
        """New probe settings after a config reload (the windows and the evidence kept so far
        stay); ``rails``: the new netdev -> rail id map (None: keep the old one)."""
        self.probe = probe
        if rails is not None:
            self.rails = dict(rails)
        self.loss_test = loss_test(probe)
        for t in self.tests.values():
            t.configure(self.loss_test)

    def observe(self, ev: Event) -> None:
        """Learn from an event on its way to the engine (the caller still posts it): our rails'
        link state (``LinkChanged``, ``LinkSnapshot``; a rail is up when its netdev is
        :attr:`~linkpass.core.model.LinkFacts.healthy`) and the rails each peer announces
        (``PeerRails``).  Other events are ignored."""
        if isinstance(ev, LinkChanged):
            rail = self.rails.get(ev.facts.netdev)
            if rail is not None:
                self._set_link(rail, ev.facts.healthy, ev.t_ns)
        elif isinstance(ev, LinkSnapshot):
            healthy = {f.netdev for f in ev.links if f.healthy}
            for netdev, rail in self.rails.items():
                self._set_link(rail, netdev in healthy, ev.t_ns)
        elif isinstance(ev, PeerRails):
            for rail in set(self.rails.values()):
                key = (rail, ev.peer)
                if rail in ev.usable:
                    if self.peer_down.pop(key, None) is not None:
                        self.peer_up[key] = ev.t_ns
                else:
                    self.peer_down.setdefault(key, ev.t_ns)

    def _set_link(self, rail: int, up: bool, t_ns: int) -> None:
        if up:
            if self.link_down.pop(rail, None) is not None:
                self.link_up[rail] = t_ns
        else:
            self.link_down.setdefault(rail, t_ns)

    def _explained(self, ev: ProbeResult) -> bool:
        """Whether the miss ``ev`` is explained: our end of its rail is down, or its peer
        announces the rail unusable, now (``ev.t_ns``, its deadline) or when it was sent (one
        interval before), or it was sent less than one interval after either came back."""
        rail = ev.rail
        if rail in self.link_down:
            return True
        key = (rail, ev.peer)
        if key in self.peer_down:
            return True
        # sent at t_ns - interval; explained if before (the back time + one interval)
        cut = ev.t_ns - 2 * self.probe.interval_ms * 1_000_000
        up = self.link_up.get(rail)
        if up is not None and cut < up:
            return True
        up = self.peer_up.get(key)
        return up is not None and cut < up

    def _dead_streak(self) -> int:
        # long enough that heavy random loss (50 % of round trips) almost never looks dead
        # (0.5^20 per probe), short enough that a really dead path leaves the ratio in ~0.2 s
        return max(20, 2 * self.probe.detect_multiplier)

    def __call__(self, ev: Event) -> None:
        if not isinstance(ev, ProbeResult):
            self.post(ev)
            return
        key = (ev.rail, ev.peer)
        prev = self.last_ok.get(key)
        if ev.ok and prev is True:
            # the common case (thousands a second): an answer after an answer.  Nothing for the
            # engine; the loss window and the path's test take it (what the general path below
            # does for it, without its branches)
            self.last_ok_ns[key] = ev.t_ns
            self.absorbed += 1
            self._account(key, ev)
            self._test(key, ev)
            return
        answered_before = prev is not None or ev.ok
        if ev.ok:
            self.last_ok[key] = True
            self.last_ok_ns[key] = ev.t_ns
        elif prev is None:
            self.last_ok.pop(key, None)  # never answered: not a path yet
        else:
            self.last_ok[key] = False
        if prev is None and not ev.ok and ev.peer_elsewhere is not True:
            self.absorbed += 1  # a path that never answered, peer not heard elsewhere: nothing to decide
        elif not ev.ok:
            t_ok = self.last_ok_ns.get(key)
            self.post(dataclasses.replace(ev, since_ok_ns=None if t_ok is None else ev.t_ns - t_ok))
            self.forwarded += 1
        elif prev is not True:
            self.post(ev)
            self.forwarded += 1
        else:
            self.absorbed += 1
        if not ev.ok and self._explained(ev):
            self.explained += 1  # not loss: the link state or the peer's notice says why
            return
        if answered_before and (ev.ok or ev.peer_elsewhere is not False):
            # a miss while the peer answered on no rail at all is the peer's silence (stalled,
            # overloaded, gone), not loss on this rail
            if self._account(key, ev):
                if ev.ok or self._live(key):
                    self._test(key, ev)
                elif self.streak.get(key) == self._dead_streak():
                    self._undo_streak(key, ev)

    def answered(self, rail: int, peer: str, t_ns: int, rtt_ns: int | None = None, seq: int = 0) -> None:
        """An answered probe: exactly what ``self(ProbeResult(rail, peer, True, t_ns, rtt_ns,
        seq))`` does, without making the event in the common case (an answer after an answer
        on a live path whose loss test keeps its verdict), where nothing reaches the engine.
        The prober calls this for every reply and passive proof (thousands a second); inside
        the running daemon the event and the general path cost about a third of a reply's
        handling (bench/README.md)."""
        self.answered_many([(rail, peer, t_ns, rtt_ns, seq)])

    def answered_many(self, results: list[tuple[int, str, int, int | None, int]],
                      on_error: Callable[[tuple, Exception], None] | None = None) -> None:
        """:meth:`answered` for each ``(rail, peer, t_ns, rtt_ns, seq)`` in order (one timer
        turn's replies and proofs: one call instead of one per result).  ``on_error(result,
        exception)``: called for a result whose handling raised (``post`` failing, say), and the
        rest are handled; None: the exception propagates."""
        path_window, tests, last_ok, streak, last_ok_ns = self.path_window, self.tests, self.last_ok, self.streak, self.last_ok_ns
        for res in results:
            try:  # free in Python 3.11 unless it raises
                rail, peer, t_ns, rtt_ns, seq = res
                key = (rail, peer)
                win = path_window.get(key)
                t = tests.get(key)
                if win is None or t is None or last_ok.get(key) is not True or streak.get(key, 0):
                    self(ProbeResult(rail, peer, True, t_ns, rtt_ns, seq))
                    continue
                last_ok_ns[key] = t_ns
                self.absorbed += 1
                self._window_answer(key, rail, t_ns, win)
                probes = t.probes + 1  # _test for an answer
                if t.update(True):
                    self._post_verdict(key, ProbeResult(rail, peer, True, t_ns, rtt_ns, seq), t, probes)
            except Exception as ex:
                if on_error is None:
                    raise
                on_error(res, ex)

    def _test(self, key: tuple[int, str], ev: ProbeResult) -> None:
        t = self.tests.get(key)
        if t is None:
            t = self.tests[key] = PathLossTest(self.loss_test)
        if not ev.ok and self.streak.get(key) == 1:
            self.before_streak[key] = t.state()
        probes = t.probes + 1
        if t.update(ev.ok):
            self._post_verdict(key, ev, t, probes)

    def _undo_streak(self, key: tuple[int, str], ev: ProbeResult) -> None:
        """The misses in a row just made the path dead: they were a dead path (or a link down),
        which BFD's rule and the link state judge, not random loss; take them out of the test,
        as the loss window does, so that the path's recovery is not held up by them."""
        t, before = self.tests.get(key), self.before_streak.pop(key, None)
        if t is not None and before is not None and t.restore(before):
            self._post_verdict(key, ev, t, t.probes)

    def _post_verdict(self, key: tuple[int, str], ev: ProbeResult, t: PathLossTest, probes: int) -> None:
        win = self.path_window.get(key)
        n, lost = (len(win), self.path_lost.get(key, 0)) if win else (0, 0)
        (self.lossy.add if t.lossy else self.lossy.discard)(key)
        self.post(PathLossy(ev.rail, ev.peer, t.lossy, ev.t_ns, probes, lost / n if n else None, n))

    def _live(self, key: tuple[int, str]) -> bool:
        return self.streak.get(key, 0) < self._dead_streak()

    def _account(self, key: tuple[int, str], ev: ProbeResult) -> bool:
        """Loss window: per path, and per rail summed over its *live* paths only.  A path whose
        misses in a row reach 20 (or 2 x detect_multiplier) is dead (a blackholed or dead peer): that is
        the path/rail verdict's business, and counting it would mark the whole rail DEGRADED
        for one dead peer.  It counts again from its next answer, with its window restarted
        there (the dead time is not loss either).  Returns False for a miss left out (a probe
        sent while the path was dead).

        Entries leave by time, rail-wide: each result expires every entry of its rail older
        than the window, whatever path it came from (a rail-wide queue in arrival order), so a
        slow path's old answer leaves on time instead of at its next result one sweep later
        (at 16,384 peers the rail's ratio would otherwise hold one stale success per peer)."""
        rail = ev.rail
        t = ev.t_ns
        win = self.path_window.get(key)
        if ev.ok and win is not None and not self.streak.get(key, 0):
            self._window_answer(key, rail, t, win)
            return True
        if not ev.ok and t < self.revived_ns.get(key, -1) + self.probe.interval_ms * 1_000_000:
            return False  # a probe sent while the path was still dead, lost after it came back: not loss
        was_live = self._live(key)
        self.streak[key] = 0 if ev.ok else self.streak.get(key, 0) + 1
        if win is None:
            win = self.path_window[key] = deque()
            self.rail_keys.setdefault(rail, []).append(key)
        if was_live:  # take the path's old contribution out of the rail's totals
            self.rail_n[rail] = self.rail_n.get(rail, 0) - len(win)
            self.rail_lost[rail] = self.rail_lost.get(rail, 0) - self.path_lost.get(key, 0)
        else:  # a dead path answers again: its silence was not loss, start afresh
            self.revived_ns[key] = t
            win.clear()  # its entries still in the rail queue are skipped (no longer in the window)
            self.path_lost[key] = 0
        e = (t, ev.ok)
        win.append(e)
        q = self.rail_q.get(rail)
        if q is None:
            q = self.rail_q[rail] = deque()
        q.append((e, key))
        self.path_lost[key] = self.path_lost.get(key, 0) + (0 if ev.ok else 1)
        if self._live(key):
            self.rail_n[rail] = self.rail_n.get(rail, 0) + len(win)
            self.rail_lost[rail] = self.rail_lost.get(rail, 0) + self.path_lost[key]
        n = self._expire(rail, q, t - self.probe.loss_window_ms * 1_000_000, self.rail_n.get(rail, 0))
        self.rail_n[rail] = n
        self._report(rail, n, t)
        return True

    def _window_answer(self, key: tuple[int, str], rail: int, t: int, win: deque) -> None:
        """The common case of :meth:`_account`, kept cheap (thousands a second): an answer at
        ``t`` (ns) on a live path whose window ``win`` exists."""
        e = (t, True)
        win.append(e)
        q = self.rail_q.get(rail)
        if q is None:
            q = self.rail_q[rail] = deque()
        q.append((e, key))
        n = self.rail_n.get(rail, 0) + 1
        horizon = t - self.probe.loss_window_ms * 1_000_000
        if q[0][0][0] < horizon:
            n = self._expire(rail, q, horizon, n)
        self.rail_n[rail] = n
        self._report(rail, n, t)

    def _expire(self, rail: int, q: deque, horizon: int, n: int) -> int:
        """Drop the rail's window entries from before ``horizon`` (ns), from their path's window
        too and, for a live path, from the rail's totals; ``n`` is the rail's count so far.
        Returns the count after.  An entry is still in its path's window exactly when it is
        that window's head (both queues keep arrival order); one that is not was cleared by a
        revival."""
        dead = self._dead_streak()
        lost_gone = 0
        while q and q[0][0][0] < horizon:
            e, key = q.popleft()
            win = self.path_window.get(key)
            if not win or win[0] is not e:
                continue
            win.popleft()
            live = self.streak.get(key, 0) < dead
            if live:
                n -= 1
            if not e[1]:
                self.path_lost[key] -= 1
                if live:
                    lost_gone += 1
        if lost_gone:
            self.rail_lost[rail] -= lost_gone
        return n

    def _report(self, rail: int, n: int, t_ns: int) -> None:
        """Post the rail's ratio (``n`` results in its window, :meth:`_spread`) at most every
        REPORT_S, and at once when it crosses the DEGRADED threshold."""
        lost = self.rail_lost.get(rail, 0)
        was = self.last_side.get(rail, False)
        if not lost and not was and t_ns - self.last_report.get(rail, -REPORT_NS) < REPORT_NS:
            return  # the common case, thousands a second: a ratio of 0 on a clean rail, said recently
        thr = self.probe.degraded_loss
        if lost > n * thr / 2:  # the engine's hysteresis band: only here can one path's share change a verdict
            # while DEGRADED, and before saying it, with a path chosen now, not up to REPORT_S
            # ago: a path that has just gone bad stands out only after some results, and a
            # change of the side is posted at once
            ln = self._spread(rail, lost, n, t_ns, rescan=was)
            if ln[0] > ln[1] * thr and not was:
                ln = self._spread(rail, lost, n, t_ns, rescan=True)
            lost, n = ln
        ratio = lost / n if n else 0.0
        side = ratio > thr
        if side != was or t_ns - self.last_report.get(rail, -REPORT_NS) >= REPORT_NS:
            self.last_side[rail] = side
            self.last_report[rail] = t_ns
            self.post(ProbeLoss(rail, ratio, n, t_ns))

    def _spread(self, rail: int, lost: int, n: int, t_ns: int, rescan: bool = False) -> tuple[int, int]:
        """The rail's (lost, results) without the live path whose results raise its ratio
        most, when that path loses clearly more than the rail's other paths together
        (two-proportion z >= ``OUTLIER_Z``); else the rail's own (lost, results).

        DEGRADED says our end of the rail loses, which every peer over it sees.  One peer's
        fault (its port blackholed, lossy, or its daemon stalled) is that path's business (the
        path's state and its loss test): it must not move this host's traffic to every other
        peer off the rail, nor make this host tell every peer that the rail is unusable at its
        end (which would spread one port's fault to every host that talks to it).  Before a dead
        path leaves the window (:meth:`_dead_streak` misses in a row) its misses alone put a
        2-peer rail over 10 % (a blackholed port on one host made both of its peers avoid the
        rail for each other).  Loss on our end reaches every path about equally, and no path
        stands out: the ratio stays the rail's.  With one path the ends cannot be told apart.

        The path is chosen by a scan of the rail's paths, only while the ratio is in the
        hysteresis band (``lost > n x degraded_loss / 2``): every REPORT_S, and while the ratio
        says DEGRADED or is about to (``rescan``); between scans the same path is left out of
        the current totals.  A scan costs about 0.6 us a path (10-20 ms at 16,384), so scans are at least
        one probe interval apart per 64 paths: a large rail hovering at the threshold costs a
        few % of a core, not all of it."""
        key, at = self.worst.get(rail, (None, -1))
        keys = self.rail_keys.get(rail, ())
        gap = self.probe.interval_ms * 1_000_000 * max(1, len(keys) // 64)
        if at < 0 or t_ns - at >= max(gap, REPORT_NS) or (rescan and t_ns - at >= gap):
            key, best = None, (lost, n)
            for k in keys:
                win = self.path_window[k]
                if not win or not self._live(k):
                    continue
                rn, rl = n - len(win), lost - self.path_lost[k]
                if rn > 0 and rl * best[1] < best[0] * rn:  # rl / rn < best ratio
                    key, best = k, (rl, rn)
            if key is not None:
                own = (self.path_lost[key] / len(self.path_window[key]), len(self.path_window[key]))
                if two_proportion_z(own, (best[0] / best[1], best[1])) < OUTLIER_Z:
                    key = None
            self.worst[rail] = (key, t_ns)
        if key is None:
            return lost, n
        win = self.path_window[key]
        if not win or not self._live(key) or len(win) >= n:
            return lost, n
        return lost - self.path_lost[key], n - len(win)


def loss_test(probe: ProbePolicy) -> LossTest:
    """The lossy test's parameters from the ``[probe]`` settings."""
    return LossTest(probe.healthy_loss, probe.lossy_loss, probe.lossy_alpha, probe.lossy_clear_alpha)
