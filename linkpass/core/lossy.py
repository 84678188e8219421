"""Is a path losing too many probes to carry traffic?  A sequential test per path (pure).

BFD's rule (``detect_multiplier`` misses in a row, :mod:`linkpass.core.paths`) is the right test
for a dead path and a poor one for random loss: at a per-probe loss ``q`` it waits for a run of
``m`` misses, about ``(1 - q^m) / ((1 - q) q^m)`` probes (Feller, *An Introduction to Probability
Theory*, vol. 1, XIII.7): 14 at ``q = 0.5`` and ``m = 3``, 155 at ``q = 0.2``, and with the
confirm probes' time condition (about six misses in a row, :mod:`linkpass.core.paths`) 114 at
``q = 0.51`` and 19,500 at ``q = 0.2``, while a rail that loses a fifth of its packets is already
useless for RDMA.  This module decides between two
hypotheses about the per-probe loss of one path,

* H0, healthy: loss ``p_ok`` (``[probe] healthy_loss``, default 0.04: a link losing 2 % in
  each direction loses 1 - 0.98^2 = 3.96 % of round trips);
* H1, lossy: loss ``p_bad`` (``[probe] lossy_loss``, default 0.3),

with Wald's sequential probability ratio test (Wald, *Sequential Analysis*, 1947), restarted
whenever the evidence falls back to zero: Page's CUSUM (Page, "Continuous inspection schemes",
Biometrika 41, 1954)::

    S_0 = 0,  S_n = max(0, S_{n-1} + l(x_n)),   lossy once S_n >= h = ln(1 / alpha)
    l(miss) = ln(p_bad / p_ok),  l(answer) = ln((1 - p_bad) / (1 - p_ok))

Error bound: under H0 the likelihood ratio from any start is a martingale of mean 1, so by
Ville's inequality the test started at one probe ever reaches ``e^h`` with probability at most
``alpha``; the CUSUM alarms within ``N`` probes only if one of those ``N`` starts does, so
``P(false alarm within N probes at loss <= p_ok) <= N * alpha`` (any loss below ``p_ok`` only
lowers it).  With the defaults (``alpha`` = 1e-6) a path probed 100 times a second is wrongly
called lossy with probability at most 0.06 over 10 minutes; the true rate is far lower (the
bound counts every start point as if it had the whole budget; ``bench/loss_curve.py`` measures
it: no alarm in 10 simulated minutes at 2 % each way for alpha up to 1e-5).  Detection: at loss ``q`` the evidence grows by ``q l(miss) + (1 - q) l(answer)`` a probe
(0.87 at q = 0.51, the round-trip loss of 30 % each way; 0.52 at q = 0.36, 20 % each way), so
about ``h / that`` probes (16 and 26 with the defaults), never fewer than ``ceil(h / l(miss))``
(7).  The drift is positive above ``q* = -l(answer) / (l(miss) - l(answer))`` (0.136): a loss
of 20 % of round trips is caught too, more slowly; ``p_bad`` 0.3 rather than 0.2 makes each
miss weigh more (faster at heavy loss) and keeps ``q*`` well above the ~10 % of probes an
overloaded prober can lose by itself (issue 17), which the windowed DEGRADED ratio reports.

Recovery needs evidence too: once lossy, a second CUSUM accumulates ``-l(x)`` (evidence for
H0) and the path is clean again once it reaches ``h_clear = ln(1 / clear_alpha)``: at no loss
that is ``h_clear / -l(answer)`` answers in a row (22 with ``clear_alpha`` = 1e-3); each miss
sets it back by ``l(miss)`` (about six answers).  At a loss of ``p_bad`` or more a wrong clear has probability at
most ``clear_alpha`` per start (the same bound, the hypotheses swapped), and the next alarm
follows within about ``h / 0.87`` probes at 51 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def two_proportion_z(worse: tuple[float, int], better: tuple[float, int]) -> float:
    """z score of 'loss ratio ``worse`` over its n results exceeds ``better`` over its n'
    (pooled two-proportion test; +inf when both are exact and ``worse`` is higher)."""
    (lw, nw), (lb, nb) = worse, better
    p = (lw * nw + lb * nb) / (nw + nb)
    se = math.sqrt(p * (1 - p) * (1 / nw + 1 / nb))
    if se == 0:
        return math.inf if lw > lb else 0.0
    return (lw - lb) / se


@dataclass(frozen=True)
class LossTest:
    """Parameters of the test, derived from the ``[probe]`` knobs.

    Attributes:
        p_ok: per-probe loss of a healthy path (H0), 0 < p_ok < p_bad.
        p_bad: per-probe loss of a path to leave (H1), p_bad < 1.
        alpha: bound on a false alarm per probe at loss <= p_ok (h = ln(1/alpha)).
        clear_alpha: bound on a wrong clear per probe at loss >= p_bad.
    """

    p_ok: float
    p_bad: float
    alpha: float
    clear_alpha: float

    def __post_init__(self) -> None:
        if not 0 < self.p_ok < self.p_bad < 1:
            raise ValueError(f"need 0 < healthy loss < lossy loss < 1, got {self.p_ok} and {self.p_bad}")
        for what, a in (("alpha", self.alpha), ("clear_alpha", self.clear_alpha)):
            if not 0 < a < 1:
                raise ValueError(f"{what} must be in (0, 1), got {a}")

    @property
    def miss_llr(self) -> float:
        """Evidence for H1 of one lost probe (> 0)."""
        return math.log(self.p_bad / self.p_ok)

    @property
    def answer_llr(self) -> float:
        """Evidence for H1 of one answered probe (< 0)."""
        return math.log((1 - self.p_bad) / (1 - self.p_ok))

    @property
    def h(self) -> float:
        return math.log(1 / self.alpha)

    @property
    def h_clear(self) -> float:
        return math.log(1 / self.clear_alpha)

    def drift(self, q: float) -> float:
        """Mean evidence per probe at per-probe loss ``q`` (0..1)."""
        return q * self.miss_llr + (1 - q) * self.answer_llr

    def min_probes(self) -> int:
        """Fewest probes that can raise an alarm (all of them lost)."""
        return math.ceil(self.h / self.miss_llr)

    def expected_probes(self, q: float) -> float | None:
        """Wald's approximation of the probes to an alarm at loss ``q`` (None where the drift is
        not positive: then alarms are rare excursions, not a trend)."""
        d = self.drift(q)
        return self.h / d if d > 0 else None


class PathLossTest:
    """The running test of one path: feed it every counted result with :meth:`update`.

    Attributes:
        lossy: the current verdict.
        s: evidence for H1 while clean, for H0 while lossy (natural log units, >= 0).
        probes: results fed in since the last verdict change.
    """

    __slots__ = ("test", "lossy", "s", "probes", "_up", "_down", "_h")

    def __init__(self, test: LossTest) -> None:
        self.lossy = False
        self.s = 0.0
        self.probes = 0
        self.configure(test)

    def configure(self, test: LossTest) -> None:
        """New parameters (config reload); the evidence so far stays."""
        self.test = test
        self._up, self._down = test.miss_llr, test.answer_llr
        self._h = test.h_clear if self.lossy else test.h

    def state(self) -> tuple[bool, float, int]:
        """What :meth:`restore` takes back to."""
        return self.lossy, self.s, self.probes

    def restore(self, state: tuple[bool, float, int]) -> bool:
        """Go back to an earlier :meth:`state` (evidence that turned out to be something else);
        True when the verdict changed."""
        was = self.lossy
        self.lossy, self.s, self.probes = state
        self._h = self.test.h_clear if self.lossy else self.test.h
        return was != self.lossy

    def update(self, ok: bool) -> bool:
        """One probe result; True when the verdict (:attr:`lossy`) changed."""
        self.probes += 1
        step = self._down if ok else self._up
        if self.lossy:
            step = -step
        s = self.s + step
        self.s = s if s > 0.0 else 0.0
        if self.s < self._h:
            return False
        self.lossy = not self.lossy
        self.s = 0.0
        self.probes = 0
        self._h = self.test.h_clear if self.lossy else self.test.h
        return True
