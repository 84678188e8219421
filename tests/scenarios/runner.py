"""Replays an event trace through a real :class:`~linkpass.core.engine.Engine` and serializes
what it decided.

A trace is a JSON-lines file (``traces/<name>.jsonl``):

- line 1, the header: ``{"config": "<file in configs/>", "about": "..."}``;
- then one step per line, in time order: ``{"now_ns": N, "event": "<model class>", ...fields}``
  feeds that :mod:`linkpass.core.model` event at monotonic time ``N`` (an event's ``t_ns``
  defaults to ``now_ns``; ``facts``/``links`` are :class:`LinkFacts` fields, ``usable`` a list
  of rail ids, ``incident`` a :class:`DeviceIncident`); ``{"now_ns": N}`` alone only moves the
  clock.  ``"//"`` keys are comments.

Timers are the daemon's: the latest :class:`SetTimer` fires as a :class:`Tick` at its
``at_ns``, before the first step at or after that time (a step ``"event": "Tick"`` in the
trace is fed as any other event).

The result (``golden/<name>.json``) is one entry per engine call: ``now_ns``, ``event`` (class
name; ``"Tick (timer)"`` for a timer the runner fired), ``actions`` (each
``{"action": <class name>, ...its fields}``, sets as sorted lists), and ``rails`` (rail id ->
state, with ``degraded`` rails) where it changed from the previous entry.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from linkpass.config import parse_config, policy_from_config
from linkpass.core import model
from linkpass.core.engine import Engine

HERE = Path(__file__).resolve().parent
TRACES = HERE / "traces"
GOLDEN = HERE / "golden"
CONFIGS = HERE / "configs"

_EVENTS = {cls.__name__: cls for cls in (model.LinkChanged, model.LinkSnapshot, model.AddrChanged, model.RouteChanged,
                                          model.PeerRails, model.RoutesApplied, model.ProbeResult, model.ProbeLoss,
                                          model.Tick, model.Drain, model.DeviceIncident, model.DeviceFaultDelivered,
                                          model.HookPeersChanged, model.HookReport)}


class TraceError(ValueError):
    """A trace line that cannot be read: names the file and line."""


def _event(step: dict) -> model.Event:
    """One trace step -> its event (raises KeyError/TypeError/ValueError on a bad step)."""
    kind = step["event"]
    fields = {k: v for k, v in step.items() if k not in ("event", "now_ns") and not k.startswith("//")}
    fields.setdefault("t_ns", step["now_ns"])
    if "facts" in fields:
        fields["facts"] = model.LinkFacts(**fields["facts"])
    if "links" in fields:
        fields["links"] = tuple(model.LinkFacts(**f) for f in fields["links"])
    if "usable" in fields:
        fields["usable"] = frozenset(fields["usable"])
    if "incident" in fields:
        fields["incident"] = model.DeviceIncident(**fields["incident"])
    for k in ("errors", "conflicts", "peers"):
        if k in fields:
            fields[k] = tuple(fields[k])
    return _EVENTS[kind](**fields)


def load_trace(path: Path) -> tuple[dict, list[dict]]:
    """(header, steps) of a trace file.  Raises :class:`TraceError` on a bad line."""
    lines = [(n, ln) for n, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
    out = []
    for n, ln in lines:
        try:
            d = json.loads(ln)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            if out and "event" in d:
                _event(d)  # check it now, so the error names the line
            out.append(d)
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{path.name}:{n}: {e}") from e
    if not out or "config" not in out[0]:
        raise TraceError(f"{path.name}:1: the first line must be the header with \"config\"")
    return out[0], out[1:]


def to_data(x: Any) -> Any:
    """JSON-ready form of an action's field: dataclasses as dicts, sets sorted, enums by value."""
    if isinstance(x, model.WriteNcclEnv):
        return {"generation": x.generation, "text": x.text}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_data(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, (set, frozenset)):
        return sorted(to_data(v) for v in x)
    if isinstance(x, (list, tuple)):
        return [to_data(v) for v in x]
    if isinstance(x, Mapping):
        return {str(k): to_data(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    return x


def action_data(a: model.Action) -> dict:
    return {"action": type(a).__name__, **to_data(a)}


def _rails(e: Engine) -> dict:
    return {"states": {str(rid): h.state.value for rid, h in sorted(e.rails.items())}, "degraded": sorted(e.degraded)}


def run_trace(path: Path) -> list[dict]:
    """Feed the trace at ``path`` to a fresh engine; the serialized result (see module doc)."""
    header, steps = load_trace(path)
    cfg_path = CONFIGS / header["config"]
    engine = Engine(policy_from_config(parse_config(cfg_path.read_text(encoding="utf-8"), str(cfg_path))))
    out: list[dict] = []
    timer: int | None = None
    last_rails: dict | None = None

    def feed(ev: model.Event, now_ns: int, name: str) -> None:
        nonlocal timer, last_rails
        actions = engine.handle(ev, now_ns)
        for a in actions:
            if isinstance(a, model.SetTimer):
                timer = a.at_ns
        entry = {"now_ns": now_ns, "event": name, "actions": [action_data(a) for a in actions]}
        rails = _rails(engine)
        if rails != last_rails:
            entry["rails"] = last_rails = rails
        out.append(entry)

    for step in steps:
        now = step["now_ns"]
        while timer is not None and timer <= now:
            at, timer = timer, None
            feed(model.Tick(at), at, "Tick (timer)")
        if "event" in step:
            feed(_event(step), now, step["event"])
    return out
