"""Between the prober and the engine: pass on only the probe results that can change a decision,
and aggregate the rest into a per-rail loss ratio.

The prober produces one :class:`ProbeResult` per path per interval (8 rails x 4 peers at 10 ms is
3,200 a second).  The engine only needs: every failure (misses count toward SUSPECT/DOWN), the
first success after a failure or the first success ever (a path coming UP), and the loss ratio
of each rail over ``loss_window_ms``.  This filter forwards exactly those and posts a
:class:`ProbeLoss` per rail at most every ``REPORT_S`` seconds (and at once when a rail's ratio
crosses the DEGRADED threshold), so the engine sees tens of events a second instead of thousands.
Paths that have never answered are left out of the loss ratio (their peer may not run a prober
yet).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from linkpass.config import Config
from linkpass.core.model import Event, ProbeLoss, ProbeResult

REPORT_S = 0.25


class ProbeFilter:
    """Callable that takes ProbeResults from the prober and posts what the engine needs.

    Args:
        cfg: config (probe.loss_window_ms, probe.degraded_loss).
        post: the engine queue's ``put_nowait``.
    """

    def __init__(self, cfg: Config, post: Callable[[Event], None]):
        self.cfg = cfg
        self.post = post
        self.last_ok: dict[tuple[int, str], bool] = {}
        self.last_ok_ns: dict[tuple[int, str], int] = {}
        self.window: dict[int, deque] = {}
        self.lost: dict[int, int] = {}
        self.last_report: dict[int, float] = {}
        self.last_side: dict[int, bool] = {}
        self.forwarded = 0
        self.absorbed = 0

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    def __call__(self, ev: Event) -> None:
        if not isinstance(ev, ProbeResult):
            self.post(ev)
            return
        key = (ev.rail, ev.peer)
        prev = self.last_ok.get(key)
        answered_before = prev is not None or ev.ok
        if ev.ok:
            self.last_ok[key] = True
            self.last_ok_ns[key] = ev.t_ns
        elif prev is None:
            self.last_ok.pop(key, None)  # never answered: not a path yet
        else:
            self.last_ok[key] = False
        if prev is None and not ev.ok:
            self.absorbed += 1  # a path that never answered: nothing for the engine to decide
        elif not ev.ok:
            t_ok = self.last_ok_ns.get(key)
            self.post(dataclasses.replace(ev, since_ok_ns=None if t_ok is None else ev.t_ns - t_ok))
            self.forwarded += 1
        elif prev is not True:
            self.post(ev)
            self.forwarded += 1
        else:
            self.absorbed += 1
        if answered_before:
            self._account(ev)

    def _account(self, ev: ProbeResult) -> None:
        win = self.window.setdefault(ev.rail, deque())
        win.append((ev.t_ns, ev.ok))
        if not ev.ok:
            self.lost[ev.rail] = self.lost.get(ev.rail, 0) + 1
        horizon = ev.t_ns - self.cfg.probe.loss_window_ms * 1_000_000
        while win and win[0][0] < horizon:
            _, ok = win.popleft()
            if not ok:
                self.lost[ev.rail] -= 1
        ratio = self.lost.get(ev.rail, 0) / len(win)
        side = ratio > self.cfg.probe.degraded_loss
        now = time.monotonic()
        if side != self.last_side.get(ev.rail, False) or now - self.last_report.get(ev.rail, 0.0) >= REPORT_S:
            self.last_side[ev.rail] = side
            self.last_report[ev.rail] = now
            self.post(ProbeLoss(ev.rail, ratio, len(win), ev.t_ns))
