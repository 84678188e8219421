"""The rebuild agreement as a pure function: every rank's proposal in, one decision out.

When a process group must be rebuilt, every rank writes a :class:`Proposal` (the step it was in,
the rails it may use) to the job's store and reads everyone's; each rank then calls
:func:`decide` on the same proposals and so reaches the same :class:`Decision` without another
round trip.  The function is deterministic and has no side effects (no torch, no clock, no I/O:
tests/unit/test_layering.py checks the imports), in the spirit of torchft's ``quorum_compute``
(torchft/manager.py and the Rust lighthouse's ``quorum_compute``: participants in, quorum and a
reason out), but deciding what linkpass needs: the step to resume at and the rail to rebuild on.

The rules (the ones :class:`torch_hooks.guard.LinkPassGuard` applied inline before):

1. a proposal with ``failed`` set ends the agreement: ``outcome="failed"`` with that text (the
   guard exits 76, ``EXIT_REBUILD_FAILED``);
2. no proposal with a step (only joining spares): ``"no_step"``;
3. a rank more than ``max_step_lag`` steps from another cannot be replayed: ``"steps_apart"``
   (a rank is at most one step ahead: it finished a collective whose last message never reached
   its peer);
4. resume at the lowest step of all proposals that have one;
5. the rail: the current rail when every rank can use it and ``keep_current`` is true, else the
   first rail of ``rails`` (the preference order) that every rank can use; none: ``"no_rail"``
   (the guard reports the rank as unmovable, exit 75).

Shapes and units: ranks are ints (``0..world_size-1``), steps are training-step indices (ints,
counted from 0), rails are the daemon's rail ids (ints).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Outcomes of :func:`decide`; only ``"ok"`` carries a step and a rail.
OUTCOMES = ("ok", "failed", "steps_apart", "no_step", "no_rail")


@dataclass(frozen=True)
class Proposal:
    """One rank's proposal for a rebuild epoch.

    Attributes:
        step: the step this rank was in when the group broke; None for a joining spare (it takes
            the state, and so the step, of a healthy replica).
        usable: rail ids this rank may use (its daemon's view), any order.
        rail: the rail this rank's group was on (informational; None if unknown).
        failed: set by a rank that cannot take part, with why (e.g. a second device fault).
    """

    step: int | None
    usable: tuple[int, ...] = ()
    rail: int | None = None
    failed: str | None = None

    @classmethod
    def from_mapping(cls, d: Mapping) -> Proposal:
        """From the JSON object the guard stores (``{"step", "usable", "rail", "failed"}``).

        Raises:
            ValueError: ``step``/``rail`` not an int or None, ``usable`` not a list of ints.
        """
        step, rail = d.get("step"), d.get("rail")
        for name, v in (("step", step), ("rail", rail)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"proposal {name} must be an int or null, got {v!r}")
        usable = d.get("usable") or ()
        if not isinstance(usable, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in usable):
            raise ValueError(f"proposal usable must be a list of rail ids, got {usable!r}")
        failed = d.get("failed")
        return cls(step=step, usable=tuple(usable), rail=rail, failed=str(failed) if failed else None)

    def to_mapping(self) -> dict:
        return {"step": self.step, "usable": list(self.usable), "rail": self.rail, "failed": self.failed}


@dataclass(frozen=True)
class Decision:
    """What every rank does next.

    Attributes:
        outcome: one of :data:`OUTCOMES`.
        resume_step: the step to replay from (``outcome == "ok"``), else None.
        rail: the rail to rebuild on (``outcome == "ok"``), else None.
        reason: one line saying why, naming the ranks and rails involved.
    """

    outcome: str
    resume_step: int | None
    rail: int | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def _fmt(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def decide(proposals: Mapping[int, Proposal], rails: Sequence[int], current_rail: int | None, *,
           keep_current: bool = True, max_step_lag: int = 1) -> Decision:
    """Decide the resume step and the rail from every rank's proposal (module docstring rules).

    Args:
        proposals: rank -> its proposal; every rank of the group (the caller waits for all).
        rails: all rail ids of the job in order of preference (the guard's ``rails`` keys).
        current_rail: the rail the broken group was on (None: no preference).
        keep_current: stay on ``current_rail`` when every rank can use it (after a collective
            error or a migration); False when a notice named the rail broken, so the first
            usable rail of ``rails`` wins.
        max_step_lag: the most two ranks' steps may differ (1: a rank may be one step ahead).

    Returns:
        The :class:`Decision`; never raises for bad luck in the proposals, only for bad input.

    Raises:
        ValueError: no proposals, or ``max_step_lag`` negative.
    """
    if not proposals:
        raise ValueError("decide() needs at least one proposal")
    if max_step_lag < 0:
        raise ValueError("max_step_lag must be >= 0")
    ranks = sorted(proposals)
    failed = [(r, proposals[r].failed) for r in ranks if proposals[r].failed]
    if failed:
        r, why = failed[0]
        return Decision("failed", None, None, f"rank {r} cannot take part: {why}")
    steps = {r: proposals[r].step for r in ranks if proposals[r].step is not None}
    if not steps:
        return Decision("no_step", None, None, f"no rank has a step to resume from (ranks {_fmt(ranks)} all joining)")
    lo, hi = min(steps.values()), max(steps.values())
    if hi - lo > max_step_lag:
        behind = [r for r, s in steps.items() if s == lo]
        ahead = [r for r, s in steps.items() if s == hi]
        return Decision("steps_apart", None, None,
                        f"ranks are {hi - lo} steps apart (rank {_fmt(ahead)} at step {hi}, rank {_fmt(behind)} at step {lo}); "
                        f"at most {max_step_lag} can be replayed")
    common = set(rails)
    for r in ranks:
        common &= set(proposals[r].usable)
    order = [x for x in rails if x in common]
    step_why = f"resume at step {lo}" + ("" if hi == lo else f" (lowest of steps {dict(sorted(steps.items()))})")
    if not order:
        missing = {x: [r for r in ranks if x not in proposals[r].usable] for x in rails}
        detail = "; ".join(f"rail {x} not usable by rank {_fmt(rs)}" for x, rs in missing.items()) or "the job has no rails"
        return Decision("no_rail", None, None, f"no rail is usable by every rank ({detail})")
    if keep_current and current_rail in order:
        return Decision("ok", lo, current_rail, f"{step_why}; rail {current_rail} kept: every rank can use it")
    rail = order[0]
    if current_rail is None or current_rail == rail:
        why = f"rail {rail}: the first of {list(rails)} every rank can use"
    elif current_rail in order:
        why = f"rail {rail}: the first of {list(rails)} every rank can use (moving off rail {current_rail} as asked)"
    else:
        out = [r for r in ranks if current_rail not in proposals[r].usable]
        why = (f"rail {rail}: the first of {list(rails)} every rank can use "
               f"(rail {current_rail} is not usable by rank {_fmt(out)})")
    return Decision("ok", lo, rail, f"{step_why}; {why}")
