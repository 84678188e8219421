"""What a guarded step is replayed from: a copy of the training state (``state_dict()`` of
every object in ``state``, tensors cloned) and torch's CPU RNG state, taken before each step
and restored before a replay."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Call:
    index: int
    fn: Callable
    args: tuple
    kwargs: dict
    snapshot: Any


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, _clone(v)) for k, v in x.items()) if not hasattr(x, "_metadata") else _clone_od(x)
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    return copy.deepcopy(x)


def _clone_od(x):
    out = type(x)((k, _clone(v)) for k, v in x.items())
    out._metadata = copy.deepcopy(x._metadata)  # nn.Module.state_dict() carries version metadata
    return out


class StateMixin:
    """Snapshot and restore for :class:`~torch_hooks.guard.LinkPassGuard` (uses its ``state``)."""

    def _snapshot(self):
        return [_clone(o.state_dict()) for o in self.state], torch.get_rng_state()

    def _restore(self, snap) -> None:
        states, rng = snap
        for o, sd in zip(self.state, states):
            o.load_state_dict(_clone(sd))  # a fresh copy: load_state_dict may keep references
        torch.set_rng_state(rng)
