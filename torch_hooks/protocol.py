"""The hook protocol between the linkpass daemon and the torch hooks: pure data, no I/O.

Transport: a unix stream socket (the daemon's ``[hooks] socket``), one JSON object per line
(UTF-8, ``\\n``-terminated), at most :data:`MAX_MESSAGE_BYTES` bytes per line including the
newline.  Every message has a ``"type"``.

Client -> daemon:

* ``register``: ``{"type": "register", "v": 1, "job": str, "rank": int >= 0, "world_size": int
  >= 1, "local_rank": int >= 0 | null, "gpu": int >= 0 | null, "peers": [host name, ...],
  "rail": int >= 0 | null, "netdev": str | null, "backend": str}``.  ``peers`` are the hosts
  this rank's process group talks to (daemon peer names); ``rail``/``netdev`` the rail its
  process group is bound to, when known.  Sent again after every (re)connect; a second
  register on one connection replaces the first.
* ``report``: ``{"type": "report", "event": str, ...}``: what the hook did (``rebuilt``,
  ``unmovable``, ``ignored``...), any extra JSON fields; the daemon logs and keeps it, with
  ``job``, ``rank``, ``pid``, ``client_id`` and ``t_ns`` its own (a client's values for them
  are dropped and counted).
* ``ping``: answered by ``pong``.

Daemon -> client:

* ``registered``: ``{"type": "registered", "client_id": int, "host": str, "unknown_peers": [...]}``
  followed at once by a ``notice`` with the current plan.
* ``notice``: :func:`build_notice`; one per plan change (plan generation bump), to every
  registered client.
* ``pong``; ``error``: ``{"type": "error", "error": str}`` for a message the daemon dropped.
* ``device_fault``: :func:`build_device_fault`; a device fault on this host that needs a rank
  moved (a GPU fell off the bus, an uncorrectable ECC error...), sent to the clients whose
  ``gpu`` is the faulty one, or to every registered client when the daemon cannot tell which
  GPU index the fault's PCI bus id is (``gpu`` null).  Clients that do not know it ignore it.
* ``gpu_at_risk``: :func:`build_gpu_at_risk`; the GPU still works but its counters say it may
  fail soon (row remaps pending, a climbing corrected-error rate...): the clients on that GPU
  move their rank to a spare at the next step boundary, with the rank's own live state (no
  step lost), or report ``at_risk_unmovable`` with why.

Generations: a notice carries the daemon's plan ``generation`` and ``instance`` (a token
that changes when the daemon restarts, since a restarted daemon counts generations from 1
again).  A client acts on a notice only if it is newer: another instance, or a higher
generation of the same instance (DESIGN.md rule 5).

This module imports nothing with side effects (tests/unit/test_layering.py checks it): the
daemon's adapter, the client and the tests share it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

PROTOCOL_VERSION = 1
#: Longest line either side accepts, newline included (bytes).
MAX_MESSAGE_BYTES = 64 * 1024
CLIENT_TYPES = frozenset({"register", "report", "ping"})
SERVER_TYPES = frozenset({"registered", "notice", "pong", "error", "device_fault", "gpu_at_risk"})
_MAX_NAME = 128
_MAX_PEERS = 4096


class ProtocolError(ValueError):
    """A message that cannot be used; ``str(err)`` says why in one line."""


def encode(msg: Mapping) -> bytes:
    """One message as a line of compact JSON.

    Raises:
        ProtocolError: no ``type``, not JSON-serialisable, or longer than MAX_MESSAGE_BYTES.
    """
    if not isinstance(msg.get("type"), str):
        raise ProtocolError("message has no string 'type'")
    try:
        data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"not JSON-serialisable: {e}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message is {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (non-finite numbers are refused)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:40]} overflows to a non-finite number (refused)")
    return v


def decode(line: bytes, allowed: frozenset[str]) -> dict:
    """Parse one line (with or without its newline) into a message whose type is in ``allowed``.

    Strict JSON: ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow a float are
    refused (kept, they would make the daemon's ``status --json`` invalid JSON), and so is
    nesting too deep for the parser (``RecursionError``).

    Raises:
        ProtocolError: too long, not UTF-8 JSON, a non-finite number, nested too deeply, not an
            object, no/unknown ``type``.
    """
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"line is {len(line)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        msg = json.loads(line.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ProtocolError("not usable JSON: nested too deeply") from None
    except UnicodeDecodeError as e:
        raise ProtocolError(f"not UTF-8 JSON: {e}") from None
    except ValueError as e:  # JSONDecodeError, a non-finite number
        raise ProtocolError(f"not valid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    t = msg.get("type")
    if not isinstance(t, str):
        raise ProtocolError("message has no string 'type'")
    if t not in allowed:
        raise ProtocolError(f"unexpected message type {t[:40]!r} (expected one of {', '.join(sorted(allowed))})")
    return msg


# --------------------------------------------------------------------------- field checks


def _int(msg: Mapping, key: str, lo: int = 0, optional: bool = False) -> int | None:
    v = msg.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or v > 2**31:
        raise ProtocolError(f"{key}: must be an integer >= {lo}{' or null' if optional else ''}, got {v!r:.40}")
    return v


def _name(msg: Mapping, key: str, optional: bool = False) -> str | None:
    v = msg.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > _MAX_NAME or any(c in v for c in "\n\r\0"):
        raise ProtocolError(f"{key}: must be a non-empty string of at most {_MAX_NAME} characters")
    return v


def _rails(msg: Mapping, key: str) -> frozenset[int]:
    v = msg.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 65535 for x in v):
        raise ProtocolError(f"{key}: must be a list of rail ids (0..65535)")
    return frozenset(v)


# --------------------------------------------------------------------------- register


@dataclass(frozen=True)
class Registration:
    """One training process, as it registered.  See the module docstring for the fields."""

    job: str
    rank: int
    world_size: int
    peers: tuple[str, ...] = ()
    local_rank: int | None = None
    gpu: int | None = None
    rail: int | None = None
    netdev: str | None = None
    backend: str = "gloo"

    def to_msg(self) -> dict:
        return {"type": "register", "v": PROTOCOL_VERSION, "job": self.job, "rank": self.rank,
                "world_size": self.world_size, "local_rank": self.local_rank, "gpu": self.gpu,
                "peers": list(self.peers), "rail": self.rail, "netdev": self.netdev, "backend": self.backend}


def parse_register(msg: Mapping) -> Registration:
    """Validate a ``register`` message.

    Raises:
        ProtocolError: naming the first bad field.
    """
    v = msg.get("v", PROTOCOL_VERSION)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"v: protocol version {v!r} is not supported (this daemon speaks {PROTOCOL_VERSION})")
    job = _name(msg, "job")
    rank = _int(msg, "rank")
    world = _int(msg, "world_size", lo=1)
    if rank >= world:
        raise ProtocolError(f"rank: {rank} is not below world_size {world}")
    peers = msg.get("peers", [])
    if not isinstance(peers, list) or len(peers) > _MAX_PEERS:
        raise ProtocolError(f"peers: must be a list of at most {_MAX_PEERS} host names")
    for i, p in enumerate(peers):
        _name({"p": p}, "p")
    backend = _name(msg, "backend", optional=True) or "gloo"
    return Registration(job=job, rank=rank, world_size=world, peers=tuple(dict.fromkeys(peers)),
                        local_rank=_int(msg, "local_rank", optional=True), gpu=_int(msg, "gpu", optional=True),
                        rail=_int(msg, "rail", optional=True), netdev=_name(msg, "netdev", optional=True), backend=backend)


# --------------------------------------------------------------------------- notices


def affected(all_rails: Iterable[int], usable: Iterable[int], peer_usable: Mapping[str, Iterable[int] | None],
             peers: Iterable[str], rail: int | None) -> tuple[list[int], list[str], list[int]]:
    """Which of a client's paths a plan breaks.

    Args:
        all_rails: every rail id of this host.
        usable: rails usable here now.
        peer_usable: per peer host, the rails it announced usable (None or absent = not heard
            from yet: nothing known against any rail).
        peers: the hosts the client's process group talks to (unknown names are ignored).
        rail: the rail the client's process group is bound to, or None.

    Returns:
        ``(rails, peers, usable_common)``: rails unusable on at least one of the client's
        paths (here or at one of its peers), sorted; the peers whose path over ``rail`` is
        broken (over any rail when ``rail`` is None); rails usable here and at every one of
        the client's peers, sorted (where a rebuilt process group may go).
    """
    everything = frozenset(all_rails)
    local = frozenset(usable) & everything
    bad = set(everything - local)
    hit_peers = []
    common = set(local)
    for p in peers:
        if p not in peer_usable:
            continue
        pu = peer_usable[p]
        if pu is None:
            continue
        pu = frozenset(pu)
        bad_p = everything - pu
        bad |= bad_p
        common &= pu
        broken = (everything - local) | bad_p
        if (rail is None and broken) or (rail is not None and rail in broken):
            hit_peers.append(p)
    if rail is not None and rail not in local:
        hit_peers = [p for p in peers if p in peer_usable] or list(peers)
        hit_peers = list(dict.fromkeys(hit_peers))
    return sorted(bad), hit_peers, sorted(common)


def build_notice(*, generation: int, instance: str, host: str, all_rails: Iterable[int], usable: Iterable[int],
                 peer_usable: Mapping[str, Iterable[int] | None], reason: str, t_ns: int,
                 reg: Registration | None = None) -> dict:
    """A ``notice`` message for one client.

    Shape: ``{"type": "notice", "generation": int, "instance": str, "host": str, "rails":
    [all ids], "usable": [...], "unusable": [...], "peers": {peer: [usable ids] | null},
    "affected": {"rails": [...], "peers": [...]}, "usable_common": [...], "reason": str,
    "t_ns": daemon monotonic ns when the plan changed}``; ``peers``/``affected`` cover the
    client's registered peers only (all known peers when ``reg`` is None).
    """
    allr = sorted(frozenset(all_rails))
    use = sorted(frozenset(usable) & frozenset(allr))
    peers = list(reg.peers) if reg is not None else list(peer_usable)
    rails_bad, peers_hit, common = affected(allr, use, peer_usable, peers, None if reg is None else reg.rail)
    return {
        "type": "notice", "generation": generation, "instance": instance, "host": host,
        "rails": allr, "usable": use, "unusable": sorted(set(allr) - set(use)),
        "peers": {p: (None if peer_usable.get(p) is None else sorted(peer_usable[p])) for p in peers if p in peer_usable},
        "affected": {"rails": rails_bad, "peers": peers_hit},
        "usable_common": common, "reason": reason[:200], "t_ns": t_ns,
    }


def build_device_fault(*, instance: str, host: str, incident: Mapping, gpu: int | None, t_ns: int) -> dict:
    """A ``device_fault`` message: ``{"type": "device_fault", "v": 1, "instance": str, "host":
    str, "gpu": NVML index | null, "incident": {"domain", "device", "code", "action",
    "remedy", "source", "summary"}, "t_ns": daemon monotonic ns when it was seen}``."""
    keep = ("domain", "device", "code", "action", "remedy", "source", "summary")
    return {"type": "device_fault", "v": PROTOCOL_VERSION, "instance": instance, "host": host, "gpu": gpu,
            "incident": {k: incident.get(k) for k in keep}, "t_ns": t_ns}


def build_gpu_at_risk(*, instance: str, host: str, gpu: int, verdict: Mapping, t_ns: int) -> dict:
    """A ``gpu_at_risk`` message: ``{"type": "gpu_at_risk", "v": 1, "instance": str, "host": str,
    "gpu": NVML index, "verdict": {"rule", "counter", "rate", "unit", "window_s", "threshold",
    "summary"}, "t_ns": daemon monotonic ns of the verdict}``."""
    keep = ("rule", "counter", "rate", "unit", "window_s", "threshold", "summary")
    return {"type": "gpu_at_risk", "v": PROTOCOL_VERSION, "instance": instance, "host": host, "gpu": gpu,
            "verdict": {k: verdict.get(k) for k in keep}, "t_ns": t_ns}


@dataclass(frozen=True)
class Notice:
    """A parsed ``notice`` (see :func:`build_notice`), plus when the client received it.

    Attributes:
        received_ns: the receiving process's ``time.monotonic_ns()`` at receipt.
    """

    generation: int
    instance: str
    host: str
    rails: frozenset[int]
    usable: frozenset[int]
    unusable: frozenset[int]
    affected_rails: frozenset[int]
    affected_peers: tuple[str, ...]
    usable_common: frozenset[int]
    reason: str = ""
    t_ns: int = 0
    received_ns: int = 0
    peers: Mapping[str, frozenset[int] | None] = field(default_factory=dict)

    def affects(self, rail: int | None) -> bool:
        """True when the process group bound to ``rail`` has a broken path (any rail when None)."""
        return bool(self.affected_rails) if rail is None else rail in self.affected_rails


def parse_notice(msg: Mapping, received_ns: int = 0) -> Notice:
    """Validate a ``notice`` message.

    Raises:
        ProtocolError: naming the first bad field.
    """
    gen = _int(msg, "generation")
    inst = _name(msg, "instance")
    host = _name(msg, "host")
    rails = _rails(msg, "rails")
    usable = _rails(msg, "usable")
    unusable = _rails(msg, "unusable")
    aff = msg.get("affected")
    if not isinstance(aff, dict):
        raise ProtocolError("affected: must be an object with 'rails' and 'peers'")
    arails = _rails(aff, "rails")
    apeers = aff.get("peers")
    if not isinstance(apeers, list) or not all(isinstance(p, str) for p in apeers):
        raise ProtocolError("affected.peers: must be a list of host names")
    common = _rails(msg, "usable_common")
    peers_raw = msg.get("peers", {})
    if not isinstance(peers_raw, dict):
        raise ProtocolError("peers: must be an object")
    peers: dict[str, frozenset[int] | None] = {}
    for p, v in peers_raw.items():
        peers[p] = None if v is None else _rails({"v": v}, "v")
    if not (usable | unusable) <= rails or usable & unusable:
        raise ProtocolError("usable/unusable: must split 'rails'")
    t_ns = msg.get("t_ns", 0)
    reason = msg.get("reason", "")
    return Notice(generation=gen, instance=inst, host=host, rails=rails, usable=usable, unusable=unusable,
                  affected_rails=arails, affected_peers=tuple(apeers), usable_common=common,
                  reason=reason if isinstance(reason, str) else "", t_ns=t_ns if isinstance(t_ns, int) else 0,
                  received_ns=received_ns, peers=peers)


def is_newer(n: Notice, current: Notice | None) -> bool:
    """True when ``n`` should replace ``current``: first notice, another daemon instance (the
    daemon restarted), or a higher generation of the same instance."""
    return current is None or n.instance != current.instance or n.generation > current.generation
