"""Per-rail probe wire format, reply guard, probe schedule and path statistics (pure).

A prober sends a *request* to a peer's address on one rail, over that rail; the peer's
responder sends a *reply* back over the same rail.  Carrier can stay up while a rail drops
traffic (a gray failure: a blackholing switch port, a bad cable); only an answered probe proves
the path works.  Layout (network byte order), 67..193 bytes::

    magic      4  b"LPP2"
    type       1  1 request, 2 reply
    sender_len 1  1..64
    sender     sender_len bytes, UTF-8 host name of the datagram's author
    target_len 1  1..64
    target     target_len bytes, UTF-8 host name it is addressed to
    rail       2  u16, the prober's rail id (a reply carries the request's)
    seq        8  u64, the prober's probe number (a reply carries the request's)
    ts         8  u64, the prober's send time (monotonic ns; opaque to the responder, which
                  copies it into the reply)
    ack        8  u64, request only: the seq of the last reply the prober accepted from this
                  target on this rail (0: none); a reply carries 0
    mac        32 HMAC-SHA256(key, every byte before it)

A reply is the request with ``type`` 2, sender/target swapped and ``ack`` 0; the MAC covers
``type``, so a request cannot be reflected back as a reply.  The key is the notice key (one key
file).

``ack`` lets a responder learn, without probes of its own, that its replies arrive: a request
acking a reply it sent proves the path works both ways (see "passive paths" in
:mod:`linkpass.adapters.prober`).  ``LPP1`` (no ``ack``) is the previous layout and is rejected.

The responder is stateless.  The prober keeps its outstanding probes in a :class:`ReplyGuard`:
a reply is accepted once, only for a probe sent and still inside its deadline; anything else is
rejected with a :class:`ProbeError` kind.  :class:`Schedule` decides which paths to probe when
(a fast set per rail every ``interval``, the rest swept round-robin every ``slow_interval``, a
token bucket bounding the total rate); :class:`PathStats` keeps RTT and loss per path.

Nothing here reads a clock: every time is an ``int`` of monotonic nanoseconds passed in.
"""

from __future__ import annotations

import heapq
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from linkpass.core.wire import MAC_LEN, WireError, open_sealed, seal

MAGIC = b"LPP2"
REQUEST = 1
REPLY = 2
MAX_NAME = 64
_TAIL = struct.Struct("!HQQQ")  # rail, seq, ts, ack
MAX_LEN = 4 + 1 + 1 + MAX_NAME + 1 + MAX_NAME + _TAIL.size + MAC_LEN
MIN_LEN = 4 + 1 + 1 + 1 + 1 + 1 + _TAIL.size + MAC_LEN

#: Every kind a :class:`ProbeError` can carry.
KINDS = ("malformed", "oversized", "auth", "misaddressed", "unexpected", "replay", "late")


class ProbeError(WireError):
    """A probe datagram was rejected.

    ``kind`` is one of:

    - ``oversized``: longer than any valid probe;
    - ``malformed``: too short, bad magic, inconsistent lengths, unknown type, bad UTF-8;
    - ``auth``: the MAC does not match (wrong key or forged);
    - ``misaddressed``: authentic, but addressed to another host (or the wrong type here);
    - ``unexpected``: a reply whose seq this prober never sent, or that does not match the
      probe it names (peer, rail or send time differ);
    - ``replay``: a reply to a probe that was already answered (or long forgotten);
    - ``late``: a reply that arrived at or after its probe's deadline.
    """



class Probe(NamedTuple):
    """A decoded probe request or reply (see the module docstring for the fields).  A named
    tuple, not a frozen dataclass: one is made per datagram, and it is a third of the cost."""

    type: int
    sender: str
    target: str
    rail: int
    seq: int
    ts_ns: int
    ack: int = 0

    def reply(self) -> Probe:
        """The reply to this request: sender/target swapped, ack 0, everything else echoed."""
        return Probe(REPLY, self.target, self.sender, self.rail, self.seq, self.ts_ns)


def encode(p: Probe, key: bytes) -> bytes:
    """Serialize and sign.

    Raises:
        ValueError: unknown type, a name empty or over 64 bytes, rail over 16 bits, seq,
            ts_ns or ack outside u64.
    """
    head = _heads.get((p.type, p.sender, p.target))
    if head is None:
        head = _head(p.type, p.sender, p.target)
    try:
        tail = _TAIL.pack(p.rail, p.seq, p.ts_ns, p.ack)
    except struct.error:
        if not 0 <= p.rail <= 0xFFFF:
            raise ValueError(f"rail id {p.rail} does not fit 16 bits") from None
        for what, v in (("seq", p.seq), ("ts_ns", p.ts_ns), ("ack", p.ack)):
            if not 0 <= v < 2**64:
                raise ValueError(f"{what} {v} does not fit an unsigned 64-bit field") from None
        raise
    return seal(head + tail, key)


#: (type, sender, target) -> the datagram's bytes before ``rail``: a host sends to the same few
#: names thousands of times a second, so each is checked and encoded once (bounded: cleared
#: when full)
_heads: dict[tuple[int, str, str], bytes] = {}
_HEADS_MAX = 65536


def _head(ptype: int, sender_name: str, target_name: str) -> bytes:
    if ptype not in (REQUEST, REPLY):
        raise ValueError(f"probe type must be {REQUEST} or {REPLY}, got {ptype}")
    sender, target = sender_name.encode(), target_name.encode()
    for what, name in (("sender", sender), ("target", target)):
        if not 1 <= len(name) <= MAX_NAME:
            raise ValueError(f"{what} name must be 1..{MAX_NAME} bytes, got {len(name)}")
    head = b"".join((MAGIC, bytes((ptype, len(sender))), sender, bytes((len(target),)), target))
    if len(_heads) >= _HEADS_MAX:
        _heads.clear()
    _heads[(ptype, sender_name, target_name)] = head
    return head


def decode(data: bytes, key: bytes) -> Probe:
    """Verify and parse one datagram.

    Raises:
        ProbeError: ``oversized``, ``malformed`` or ``auth``; the MAC is checked (constant
            time) before any field after the magic is trusted.
    """
    body = open_sealed(data, key, magic=MAGIC, min_len=MIN_LEN, max_len=MAX_LEN, what="probe", error=ProbeError)
    ptype, slen = body[4], body[5]
    if ptype not in (REQUEST, REPLY):
        raise ProbeError("malformed", f"unknown probe type {ptype}")
    if not 1 <= slen <= MAX_NAME:
        raise ProbeError("malformed", f"sender name length {slen}")
    off = 6 + slen
    if len(body) < off + 1:
        raise ProbeError("malformed", "truncated after sender name")
    tlen = body[off]
    if not 1 <= tlen <= MAX_NAME:
        raise ProbeError("malformed", f"target name length {tlen}")
    toff = off + 1
    if len(body) != toff + tlen + _TAIL.size:
        raise ProbeError("malformed", f"{len(body)} bytes before the MAC do not match names of {slen} and {tlen} bytes")
    try:
        sender = body[6:off].decode()
        target = body[toff:toff + tlen].decode()
    except UnicodeDecodeError:
        raise ProbeError("malformed", "host name is not UTF-8") from None
    rail, seq, ts, ack = _TAIL.unpack_from(body, toff + tlen)
    return Probe(ptype, sender, target, rail, seq, ts, ack)


# --------------------------------------------------------------------------- reply guard


class Pending(NamedTuple):
    """One probe sent and not yet answered (a named tuple: one per probe sent).

    Attributes:
        rail: local rail id it left on.
        peer: peer host name.
        seq: its sequence number.
        sent_ns: when it was sent (also its ``ts`` field).
        deadline_ns: a reply at or after this time is late; at this time the probe is lost.
        fast: sent as part of the fast set (else by the slow sweep).
    """

    rail: int
    peer: str
    seq: int
    sent_ns: int
    deadline_ns: int
    fast: bool = True


class ReplyGuard:
    """The prober's outstanding probes: accepts each reply once, in time, for a probe it sent.

    Args:
        memory: how many finished probes (answered or expired) are remembered to tell a
            ``replay`` or ``late`` duplicate apart; older seqs are reported as ``replay``.
    """

    def __init__(self, memory: int = 8192) -> None:
        self._pending: dict[int, Pending] = {}
        # (rail, peer) -> its outstanding probes by seq (sent order): a reply's path is looked
        # at without a scan of every path's probes (thousands a second at 8 rails x 4 peers)
        self._by_path: dict[tuple[int, str], dict[int, Pending]] = {}
        self._deadlines: list[tuple[int, int]] = []  # heap of (deadline_ns, seq), lazily pruned
        # seq -> "answered" | "expired", oldest first.  An OrderedDict: dropping a plain dict's
        # first key over and over makes next(iter()) step over the deleted slots (2.1 against
        # 0.2 us per probe at 8,192 remembered)
        self._done: OrderedDict[int, str] = OrderedDict()
        self._memory = memory
        self._lo: int | None = None  # lowest seq ever added
        self._hi: int | None = None  # highest seq ever added

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, p: Pending) -> None:
        """Record a probe just sent.

        Raises:
            ValueError: its seq is already outstanding or finished (seqs must be unique).
        """
        seq = p.seq
        if seq in self._pending or seq in self._done:
            raise ValueError(f"seq {seq} was already used")
        self._pending[seq] = p
        key = (p.rail, p.peer)
        mine = self._by_path.get(key)
        if mine is None:
            self._by_path[key] = {seq: p}
        else:
            mine[seq] = p
        heapq.heappush(self._deadlines, (p.deadline_ns, seq))
        if self._lo is None or seq < self._lo:
            self._lo = seq
        if self._hi is None or seq > self._hi:
            self._hi = seq

    def _drop(self, p: Pending) -> None:
        del self._pending[p.seq]
        mine = self._by_path.get((p.rail, p.peer))
        if mine is not None:
            mine.pop(p.seq, None)
            if not mine:
                del self._by_path[(p.rail, p.peer)]

    def _finish(self, seq: int, how: str) -> None:
        self._done[seq] = how
        while len(self._done) > self._memory:
            self._done.popitem(last=False)

    def check(self, reply: Probe, now_ns: int) -> Pending:
        """Accept ``reply`` (already authenticated, addressed to us) for its outstanding probe.

        Returns:
            The probe it answers, now no longer outstanding.

        Raises:
            ProbeError: ``misaddressed`` (not a reply), ``unexpected`` (seq never sent, or
                peer/rail/send time differ from that probe's), ``replay`` (already answered or
                forgotten), ``late`` (at/after the deadline; the probe stays outstanding until
                :meth:`expire` reports it lost, or was already reported lost).
        """
        if reply.type != REPLY:
            raise ProbeError("misaddressed", "a request where a reply was expected")
        p = self._pending.get(reply.seq)
        if p is None:
            how = self._done.get(reply.seq)
            if how == "expired":
                raise ProbeError("late", f"reply to seq {reply.seq} after its deadline")
            if how == "answered":
                raise ProbeError("replay", f"seq {reply.seq} was already answered")
            if self._lo is None or not self._lo <= reply.seq <= self._hi:
                raise ProbeError("unexpected", f"no probe with seq {reply.seq} was sent")
            raise ProbeError("replay", f"seq {reply.seq} is long finished")
        if (reply.sender, reply.rail, reply.ts_ns) != (p.peer, p.rail, p.sent_ns):
            raise ProbeError("unexpected", f"reply to seq {reply.seq} names {reply.sender}/rail {reply.rail}/ts {reply.ts_ns}, "
                             f"the probe went to {p.peer}/rail {p.rail} at {p.sent_ns}")
        if now_ns >= p.deadline_ns:
            raise ProbeError("late", f"reply to seq {reply.seq} {(now_ns - p.deadline_ns) / 1e6:.3f} ms after its deadline")
        self._drop(p)
        self._finish(reply.seq, "answered")
        return p

    def accept(self, seq: int, peer: str, rail: int, ts_ns: int, now_ns: int) -> Pending | None:
        """The common case of :meth:`check` followed by :meth:`expire_path_before`, without
        the reply's :class:`Probe` (thousands a second): ``seq`` is outstanding, went to
        ``peer`` on ``rail`` at ``ts_ns``, its deadline is after ``now_ns``, and it is the
        only probe of its path outstanding.  Returns it, now finished as answered; None when
        any of that does not hold (nothing changed: :meth:`check` decides, with its error)."""
        p = self._pending.get(seq)
        if p is None or p.peer != peer or p.rail != rail or p.sent_ns != ts_ns or now_ns >= p.deadline_ns:
            return None
        key = (rail, peer)
        mine = self._by_path.get(key)
        if mine is None or len(mine) != 1:
            return None
        del self._pending[seq]
        del self._by_path[key]
        done = self._done
        done[seq] = "answered"
        if len(done) > self._memory:
            done.popitem(last=False)
        return p

    def expire(self, now_ns: int) -> list[Pending]:
        """Remove and return the probes whose deadline is at or before ``now_ns`` (oldest first)."""
        out = []
        dl = self._deadlines
        while dl and dl[0][0] <= now_ns:
            _, seq = heapq.heappop(dl)
            p = self._pending.get(seq)
            if p is not None:
                self._drop(p)
                self._finish(seq, "expired")
                out.append(p)
        return out

    def expire_path_before(self, rail: int, peer: str, t_ns: int) -> list[Pending]:
        """Remove and return the outstanding probes of one path whose deadline is at or before
        ``t_ns`` (oldest first): a reply of that path that arrived at ``t_ns`` comes after them,
        so they are lost before it counts.  Other paths are left alone: their replies may still
        wait, unread, in another socket's queue."""
        mine = self._by_path.get((rail, peer))
        if not mine:
            return []
        out = [p for p in mine.values() if p.deadline_ns <= t_ns]
        for p in out:
            self._drop(p)
            self._finish(p.seq, "expired")
        return sorted(out, key=lambda p: p.seq)

    def expire_path(self, rail: int, peer: str) -> list[Pending]:
        """Remove and return every outstanding probe of one path now, before its deadline (the
        path has been silent for the whole detection time: waiting longer adds nothing)."""
        out = list(self._by_path.get((rail, peer), {}).values())
        for p in out:
            self._drop(p)
            self._finish(p.seq, "expired")
        return sorted(out, key=lambda p: p.seq)

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline of an outstanding probe (None when none is outstanding)."""
        dl = self._deadlines
        while dl and dl[0][1] not in self._pending:
            heapq.heappop(dl)
        return dl[0][0] if dl else None

    def forget(self, keep: Iterable[tuple[int, str]]) -> int:
        """Drop, without reporting, outstanding probes whose (rail, peer) is not in ``keep``."""
        keep = set(keep)
        gone = [p for p in self._pending.values() if (p.rail, p.peer) not in keep]
        for p in gone:
            self._drop(p)
            self._finish(p.seq, "expired")
        return len(gone)


class RequestGuard:
    """Replay protection for probe *requests* (the responder side), like IPsec's anti-replay
    window (RFC 4303 section 3.4.3): per prober (sender name), the highest seq seen and which
    of the ``window`` seqs below it were seen.  A request is answered only when its seq is
    above the highest, or inside the window and not seen before.

    A prober numbers every request from one counter across its rails, starting at its start
    time in ns (:mod:`linkpass.adapters.prober`), so requests of a restarted prober are above
    those of the previous run; requests of one prober on different rails may arrive a little out
    of order, which the window absorbs (64 probes per rail per tick at most in practice).

    Why it matters although a replayed request can fool nobody about liveness (its reply names a
    seq the prober has finished with, and :class:`ReplyGuard` rejects it): without it, anyone who
    captured one request can make this host send authenticated replies, at any rate, to any
    address it spoofs, and spend our HMAC time.

    Args:
        window: seqs below the highest that are still accepted once each.
        max_senders: distinct sender names remembered (authenticated names only; the oldest is
            forgotten beyond this, so memory is bounded).
    """

    def __init__(self, window: int = 1024, max_senders: int = 4096) -> None:
        self.window = window
        self.max_senders = max_senders
        self._hi: dict[str, int] = {}
        self._seen: dict[str, set[int]] = {}

    def check(self, req: Probe) -> None:
        """Accept ``req`` (authenticated, addressed to us) or raise.

        Raises:
            ProbeError: ``replay`` when its seq was seen before or is at least ``window``
                below the highest seq seen from that sender.
        """
        hi = self._hi.get(req.sender)
        seq = req.seq
        if hi is None:
            if len(self._hi) >= self.max_senders:
                old = next(iter(self._hi))
                del self._hi[old]
                self._seen.pop(old, None)
            self._hi[req.sender] = seq
            self._seen[req.sender] = {seq}
            return
        seen = self._seen[req.sender]
        if seq > hi:
            self._hi[req.sender] = seq
            seen.add(seq)
            if len(seen) > 2 * self.window:
                floor = seq - self.window
                self._seen[req.sender] = {s for s in seen if s > floor}
            return
        if seq <= hi - self.window:
            raise ProbeError("replay", f"request seq {seq} from {req.sender} is {hi - seq} below the newest ({hi})")
        if seq in seen:
            raise ProbeError("replay", f"request seq {seq} from {req.sender} was already answered")
        seen.add(seq)


# --------------------------------------------------------------------------- schedule


class Send(NamedTuple):
    """One probe the schedule wants sent now; its deadline is ``timeout_ns`` after sending.
    ``confirm``: part of a confirm train (always sent; a regular fast probe may be left out by
    the prober when the path is passive).  A named tuple: thousands are made a second, and a
    frozen dataclass costs several times as much to make."""

    rail: int
    peer: str
    fast: bool
    timeout_ns: int
    confirm: bool = False


class TokenBucket:
    """``rate`` tokens per second, at most ``capacity`` stored; starts full."""

    def __init__(self, rate: float, capacity: float, now_ns: int) -> None:
        self.rate = float(rate)
        self.capacity = float(capacity)
        self.tokens = float(capacity)
        self._t = now_ns

    def refill(self, now_ns: int) -> None:
        if now_ns > self._t:
            self.tokens = min(self.capacity, self.tokens + (now_ns - self._t) * self.rate / 1e9)
            self._t = now_ns

    def take(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Schedule:
    """Which (rail, peer) paths to probe, and when.

    Work happens on a grid of *ticks*: every ``interval_ns`` when there is a fast set, else
    every ``slow_interval_ns / number of slow paths`` (at least 1 ms), or every
    ``slow_interval_ns`` when there is nothing to probe.  At each tick:

    1. every fast path is due (the fast set of a rail: the priority peers first, then the
       others in config order, the first ``fast_peers`` that have an address on that rail);
    2. the slow sweep is owed ``slow paths x tick / slow_interval`` more probes (fractions
       carry over), taken round-robin over every other path, so each slow path is probed once
       per ``slow_interval``.

    Between ticks, a fast path that missed a probe can be given a *confirm train*
    (:meth:`confirm`): one more probe every ``confirm_step_ns`` (interval / 5, at least 1 ms)
    until a reply settles it (:meth:`settle`) or the train's end.  The extra probes give a
    path under random loss more chances to answer within BFD's detection time, and give a
    dead path its DOWN verdict within one step of that time rather than one interval.

    A token bucket (``max_pps`` per second, holding one tick's worth plus one) bounds the total:
    fast probes take tokens first (starting at a rotating offset, so an overloaded fast set
    shares the budget), then confirm probes; the slow sweep gets what is left and otherwise
    waits (its debt is capped at one sweep).

    Args:
        paths: rail id -> the peers that have an address on that rail, in config order.
        priority: peers to put first in every rail's fast set (e.g. the training job's ring
            neighbours), in order.
    """

    MIN_TICK_NS = 1_000_000

    def __init__(self, *, interval_ns: int, slow_interval_ns: int, fast_peers: int, max_pps: int,
                 paths: Mapping[int, Sequence[str]], now_ns: int, priority: Sequence[str] = ()) -> None:
        if interval_ns <= 0 or slow_interval_ns <= 0 or max_pps <= 0 or fast_peers < 0:
            raise ValueError("intervals and max_pps must be positive, fast_peers not negative")
        self.interval_ns = interval_ns
        self.slow_interval_ns = slow_interval_ns
        self.fast_peers = fast_peers
        self.max_pps = max_pps
        self._paths = {r: list(ps) for r, ps in paths.items()}
        self._priority = list(priority)
        self._next_tick = now_ns
        self._fast_rot = 0
        self._slow_cursor = 0
        self._slow_debt = 0.0
        self._confirm: dict[tuple[int, str], list[int]] = {}  # path -> [next send ns, end ns]
        self.version = 0  # +1 per _arrange: callers cache what they derive from the sets
        self._arrange(now_ns)

    # ------------------------------------------------------------ configuration

    def _arrange(self, now_ns: int) -> None:
        self.version += 1
        fast: list[tuple[int, str]] = []
        slow: list[tuple[int, str]] = []
        per_rail_slow: dict[int, list[str]] = {}
        for rail in sorted(self._paths):
            peers = self._paths[rail]
            order = [p for p in self._priority if p in peers]
            seen = set(order)
            order += [p for p in peers if p not in seen]
            fast += [(rail, p) for p in order[: self.fast_peers]]
            per_rail_slow[rail] = order[self.fast_peers:]
        # interleave rails so one sweep visits rails evenly
        width = max((len(v) for v in per_rail_slow.values()), default=0)
        for i in range(width):
            for rail in sorted(per_rail_slow):
                if i < len(per_rail_slow[rail]):
                    slow.append((rail, per_rail_slow[rail][i]))
        old_slow = getattr(self, "slow", [])
        old_at = old_slow[self._slow_cursor % len(old_slow)] if old_slow else None
        self.fast, self.slow = fast, slow
        self._fast_set = set(fast)
        self._slow_cursor = slow.index(old_at) if old_at in slow else 0
        if fast:
            self.tick_ns = self.interval_ns
        elif slow:
            self.tick_ns = max(self.MIN_TICK_NS, self.slow_interval_ns // len(slow))
        else:  # nothing to probe: wake rarely
            self.tick_ns = self.slow_interval_ns
        tick_s = self.tick_ns / 1e9
        self._bucket = TokenBucket(self.max_pps, max(1.0, self.max_pps * tick_s) + 1.0, now_ns)
        self._slow_debt = min(self._slow_debt, float(len(slow)))
        self.confirm_step_ns = max(self.MIN_TICK_NS, self.interval_ns // 5)
        self._confirm = {k: v for k, v in self._confirm.items() if k in self._fast_set}

    def set_paths(self, paths: Mapping[int, Sequence[str]], now_ns: int) -> None:
        """Replace the paths (config reload); the fast/slow sets are recomputed."""
        self._paths = {r: list(ps) for r, ps in paths.items()}
        self._arrange(now_ns)

    def set_priority(self, peers: Sequence[str], now_ns: int) -> None:
        """Peers to put first in every rail's fast set (replaces the previous list)."""
        self._priority = list(peers)
        self._arrange(now_ns)

    def set_timing(self, *, interval_ns: int, slow_interval_ns: int, fast_peers: int, max_pps: int, now_ns: int) -> None:
        """Change the intervals, fast set size and rate bound (config reload)."""
        self.interval_ns, self.slow_interval_ns, self.fast_peers, self.max_pps = interval_ns, slow_interval_ns, fast_peers, max_pps
        self._next_tick = min(self._next_tick, now_ns + interval_ns)
        self._arrange(now_ns)

    def paths(self) -> list[tuple[int, str]]:
        """Every (rail, peer) path probed, fast ones first."""
        return self.fast + self.slow

    def is_fast(self, rail: int, peer: str) -> bool:
        return (rail, peer) in self._fast_set

    # ------------------------------------------------------------ running

    def confirm(self, rail: int, peer: str, now_ns: int, until_ns: int) -> bool:
        """Start (or extend) a confirm train on a fast path: a probe at ``now_ns`` and every
        ``confirm_step_ns`` after it, while before ``until_ns``.  Returns False (and does
        nothing) for a path that is not in the fast set."""
        key = (rail, peer)
        if key not in self._fast_set or until_ns <= now_ns:
            return False
        cur = self._confirm.get(key)
        if cur is None:
            self._confirm[key] = [now_ns, until_ns]
        else:
            cur[1] = max(cur[1], until_ns)
        return True

    def settle(self, rail: int, peer: str) -> None:
        """End the confirm train of a path (it answered)."""
        self._confirm.pop((rail, peer), None)

    def confirming(self) -> list[tuple[int, str]]:
        """The paths with a confirm train running."""
        return sorted(self._confirm)

    @property
    def next_tick_ns(self) -> int:
        """When :meth:`poll` next has something to send (the next tick or confirm probe)."""
        if not self._confirm:
            return self._next_tick
        return min(self._next_tick, min(v[0] for v in self._confirm.values()))

    def poll(self, now_ns: int) -> list[Send]:
        """The probes to send now (empty before the next tick or confirm probe); advances."""
        out: list[Send] = []
        if now_ns >= self._next_tick:
            out = self._tick(now_ns)
        if self._confirm:
            out += self._poll_confirm(now_ns, {(x.rail, x.peer) for x in out})
        return out

    def _poll_confirm(self, now_ns: int, just_sent: set[tuple[int, str]]) -> list[Send]:
        out: list[Send] = []
        b = self._bucket
        b.refill(now_ns)
        step = self.confirm_step_ns
        for key in sorted(self._confirm):
            train = self._confirm[key]
            if key in just_sent:  # the tick just probed it: the train goes on one step later
                train[0] = now_ns + step
            elif train[0] > now_ns:
                continue
            else:
                # no token left (the bucket bounds the rate): skip this one; the train goes on
                # one step later either way (never a burst after a stalled loop)
                if b.take():
                    out.append(Send(key[0], key[1], True, self.interval_ns, confirm=True))
                train[0] = now_ns + step
            if train[0] >= train[1]:
                del self._confirm[key]
        return out

    def _tick(self, now_ns: int) -> list[Send]:
        tick = self.tick_ns
        # stay on the grid; if far behind (a stalled loop), restart it from now
        self._next_tick += tick
        if self._next_tick <= now_ns:
            self._next_tick = now_ns + tick
        b = self._bucket
        b.refill(now_ns)
        out: list[Send] = []
        n = len(self.fast)
        if n:
            start = self._fast_rot % n
            for i in range(n):
                if not b.take():
                    self._fast_rot = start + i  # the ones left out go first next time
                    break
                rail, peer = self.fast[(start + i) % n]
                out.append(Send(rail, peer, True, self.interval_ns))
        m = len(self.slow)
        if m:
            self._slow_debt = min(float(m), self._slow_debt + m * tick / self.slow_interval_ns)
            while self._slow_debt >= 1.0 and b.take():
                rail, peer = self.slow[self._slow_cursor % m]
                self._slow_cursor = (self._slow_cursor + 1) % m
                self._slow_debt -= 1.0
                out.append(Send(rail, peer, False, self.slow_interval_ns))
        return out


# --------------------------------------------------------------------------- statistics


class PathStats:
    """Probe statistics of one (rail, peer) path.

    ``ewma_rtt_ns`` is smoothed like TCP's SRTT (gain 1/8); ``loss`` is the share of lost
    probes among the last ``window`` finished ones.
    """

    GAIN = 1 / 8

    def __init__(self, window: int = 100) -> None:
        self.results: deque[bool] = deque(maxlen=window)
        self.last_rtt_ns: int | None = None
        self.ewma_rtt_ns: float | None = None
        self.replies = 0
        self.lost = 0

    def record(self, ok: bool, rtt_ns: int | None = None) -> None:
        self.results.append(ok)
        if ok:
            self.replies += 1
            if rtt_ns is not None:
                self.last_rtt_ns = rtt_ns
                self.ewma_rtt_ns = float(rtt_ns) if self.ewma_rtt_ns is None else self.ewma_rtt_ns + self.GAIN * (rtt_ns - self.ewma_rtt_ns)
        else:
            self.lost += 1

    @property
    def loss(self) -> float | None:
        """Lost share over the window (None before any probe finished)."""
        if not self.results:
            return None
        return 1.0 - sum(self.results) / len(self.results)

    def to_json(self) -> dict:
        return {
            "last_rtt_us": None if self.last_rtt_ns is None else round(self.last_rtt_ns / 1e3, 1),
            "ewma_rtt_us": None if self.ewma_rtt_ns is None else round(self.ewma_rtt_ns / 1e3, 1),
            "loss": None if self.loss is None else round(self.loss, 4),
            "window": len(self.results),
            "replies": self.replies,
            "lost": self.lost,
        }
