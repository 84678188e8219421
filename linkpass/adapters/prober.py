"""Per-rail UDP probing: find gray failures (carrier up, traffic lost) in a few intervals.

Responder: one UDP socket on ``0.0.0.0:probe.port``.  An authenticated request addressed to
this host is answered over the rail it names (from this host's per-rail socket for that rail
id, bound to the rail netdev), so the reply takes the probed rail back even when our routes
carry the prober's rail addresses elsewhere; a request naming a rail we do not have is answered
from the responder socket.  The responder's only state is the request replay guard (per
prober, RFC 4303's anti-replay window: :class:`linkpass.core.probe.RequestGuard`).

Sender: per rail, a UDP socket bound to the rail netdev (``SO_BINDTODEVICE``, needs
CAP_NET_RAW), so a probe really leaves over that rail (a /32 route of ours via another rail
does not apply to it); replies come back to the same socket.  Which paths are probed when is
:class:`linkpass.core.probe.Schedule`'s decision: per rail a fast set (``fast_peers`` peers,
``set_priority_peers`` first, then :func:`ring_order`) every ``interval_ms``, every other peer swept
round-robin every ``slow_interval_ms``, at most ``max_pps`` probes per second (the slow sweep
yields first).

A fast path that answered before and then misses a probe gets a *confirm train*: a probe every
interval / 5 until it answers or ``detect_multiplier x interval`` has passed since its last
reply (:meth:`linkpass.core.probe.Schedule.confirm`; see :mod:`linkpass.core.paths` for why).

Passive paths: when two hosts probe each other fast on a rail (ring neighbours, see
:func:`ring_order`), only the one with the smaller name needs to send probes.  Its requests
carry ``ack``, the seq of the last reply it accepted from the other; a request acking a reply
we sent proves the path works both ways.  So the host with the larger name, as long as such
evidence came within 1.5 intervals, leaves its regular fast probe to that peer out and expects
the next evidence within 1.5 intervals instead; when that passes it counts a miss and starts a
confirm train of real probes, like for a missed probe.  This halves the probe packets of a
symmetric fast set (each datagram costs the prober its handling and the kernel its delivery), and detection
stays at BFD's time: the silence rule runs on the evidence time like on a reply time.  An ack
counts once and only when newer than the last one counted, so a replayed request proves nothing.

Every probe has a deadline, ``interval_ms`` (fast) or ``slow_interval_ms`` (slow) after it was
sent: an authenticated reply before it posts ``ProbeResult(ok=True, rtt_ns)``; when it passes,
``ProbeResult(ok=False)`` is posted.  A probe that could not be sent (no socket for the rail,
netdev gone, send error) is counted in ``send_errors`` and reported lost at its deadline like
any other.  A reply after the deadline is counted as ``late`` and ignored.

Timing: one timer (``loop.call_later``) armed for the earliest of the next schedule tick and
the next deadline; nothing polls.

Reading replies: the rail sockets are not watched by the event loop; each turn of the timer
reads what they hold before it judges or sends.  A reply is judged by its kernel arrival time
(``SO_TIMESTAMPNS``), so reading it at the next turn changes no verdict and no RTT, and the
turn after a send round (its deadlines, at most one interval later) always comes; a reply only
reaches the engine up to that much later.  This saves the loop a wake-up and a callback per
reply (at 8 rails x 4 peers, over a thousand a second).  A peer's request is answered as soon
as it comes: with the C datapath by a thread of the C module that reads the responder socket,
applies the request replay guard and sends the reply without the event loop (no wake-up per
request, and no answer waits for a busy loop); the proofs it queues are taken at the next timer
turn, like the replies.  Without it the event loop watches the responder socket.  Times are ``time.monotonic_ns()`` taken here, at the edge.
A bad datagram is counted (``rejected_<kind>``) and dropped; it never stops the prober.

Datapath: with ``[probe] datapath`` "auto" (the default) or "c" and
:mod:`linkpass.adapters._probe_io` built (``make install``), the socket reads (``recvmmsg``, a
whole queue per call), the MAC check and parse, and the signing and sending of requests and
replies run in C; every decision (the guards, proofs, verdicts) stays here, and a datagram C
does not accept in full goes through :meth:`Prober.on_datagram` as without it.  "python" (or
the module missing under "auto") runs the same steps in Python, and the event loop answers
requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import errno
import logging
import operator
import os
import select
import socket
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from linkpass.config import Config
from linkpass.core import probe as wire
from linkpass.core.model import Event, ProbeResult
from linkpass.core.probe_filter import ProbeFilter

try:  # the C datagram path, built by `make install` (setup.py); without it the Python one runs
    from linkpass.adapters import _probe_io as native_io
except ImportError:  # pragma: no cover - depends on the build
    native_io = None

log = logging.getLogger("linkpass.prober")

RECV_BUF = 512  # anything longer than wire.MAX_LEN is rejected as oversized anyway
RECV_BATCH = 64  # datagrams read per readiness callback before yielding to the loop
DRAIN_MAX = 4096  # datagrams read per socket when draining before a verdict (bounds one tick)
# Linux socket options Python does not name (include/uapi/asm-generic/socket.h):
# SO_TIMESTAMPNS (35): each datagram carries the time the stack received it (struct timespec,
# CLOCK_REALTIME) as an SCM_TIMESTAMPNS control message; SO_RXQ_OVFL (40): each carries the
# socket's running count of datagrams dropped because its receive queue was full (u32).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_TIMESPEC = struct.Struct("@qq")
_U32 = struct.Struct("@I")
_ANC_BUF = socket.CMSG_SPACE(_TIMESPEC.size) + socket.CMSG_SPACE(_U32.size)
#: truesize the kernel charges per queued small UDP datagram (an skb plus its data; about
#: 0.8-1.3 KiB on x86_64), to turn a datagram count into a receive buffer size
SKB_TRUESIZE = 1280
RCVBUF_MAX = 16 << 20
#: a tick this close before the next deadline waits for it (one wake-up instead of two)
COALESCE_NS = 500_000
SOCKET_RETRY_NS = 1_000_000_000  # a rail socket that could not be made is retried this often
_GONE = {errno.ENODEV, errno.ENXIO}
# the kinds of items the C responder thread queues besides requests (1), replies (2) and raw
# datagrams (0): see linkpass/adapters/_probe_io.c, Responder.take
_REPLAY_ITEM, _GONE_ITEM, _ANSWERED_ITEM = 3, 4, 5


def ring_order(me: str, peers: Sequence[str]) -> list[str]:
    """``peers`` ordered by distance from ``me`` on a ring of every host sorted by SHA-256 of its
    name: next, previous, second next, second previous, ...

    Every host computes the same ring, so the relation is symmetric: with a fast set of 2,
    A probes B fast exactly when B probes A fast (its ring neighbours), which lets one of the
    two answer instead of probing (passive paths).  Each host is the fast target of exactly
    ``fast_peers`` others (no hot spot), whatever the cluster size."""
    def pos(name: str) -> bytes:
        return hashlib.sha256(name.encode()).digest()

    ring = sorted(set(peers) | {me}, key=pos)
    i, n = ring.index(me), len(ring)
    out: list[str] = []
    seen = {me}  # a set: a scan of ``out`` per name would make this O(n^2) (seconds at 16 k hosts)
    for d in range(1, n):
        for name in (ring[(i + d) % n], ring[(i - d) % n]):
            if name not in seen:
                seen.add(name)
                out.append(name)
    return out


def rail_paths(cfg: Config) -> dict[int, list[str]]:
    """rail id -> the peers with an address on that rail ({} when disabled), in
    :func:`ring_order` (the first ``fast_peers`` of them form the rail's fast set)."""
    if not cfg.probe.enabled:
        return {}
    rails_of = {p.name: p.rail_ips for p in cfg.peers}
    order = ring_order(cfg.daemon.host, list(rails_of))
    return {r.id: [name for name in order if r.id in rails_of[name]] for r in cfg.rails}


#: the kernel receive time of a recv_batch item (0: none, first); itemgetter: a sort key called
#: for every datagram, in C
_arrival_of = operator.itemgetter(-1)


def datapath_problem(cfg: Config) -> str | None:
    """Why ``[probe] datapath`` cannot be had on this install (None: it can): "c" asked for and
    :mod:`linkpass.adapters._probe_io` not built.  The daemon refuses to start on it and
    ``linkpass config check`` reports it (exit 2)."""
    if cfg.probe.datapath == "c" and native_io is None:
        return ('"c", but linkpass.adapters._probe_io was not built (`make install` builds it; it needs gcc, '
                'the Python headers and libssl-dev); "auto" falls back to the Python datapath')
    return None


def native_datapath(cfg: Config) -> bool:
    """Whether the prober reads and answers through :mod:`linkpass.adapters._probe_io`:
    ``[probe] datapath`` "c" or "auto" and the module built (else the Python path).

    Raises:
        RuntimeError: "c" asked for and the module was not built (:func:`datapath_problem`)."""
    if cfg.probe.datapath == "python":
        return False
    why = datapath_problem(cfg)
    if why is not None:
        raise RuntimeError(f"[probe] datapath = {why}")
    return native_io is not None


class Prober:
    """Sends probes over every rail, answers peers' probes, posts :class:`ProbeResult` events.

    Args:
        cfg: config (host name, rails, peers, ``[probe]``).
        key: shared HMAC key (the notice key).
        post: where to post :class:`ProbeResult` events (called on the event loop).
        clock: monotonic ns clock (tests may pass another).

    Use: ``await start()`` (opens the sockets; the responder answers from then on), run
    ``run()`` as a task (the sender and deadlines), ``reconfigure(cfg, key)`` on reload,
    ``await close()`` at the end.

    Attributes:
        counters: ``sent``, ``send_errors``, ``replies`` (in time), ``timeouts`` (deadline
            passed), ``late``, ``answered`` (requests we replied to), ``answer_errors``, and
            ``confirm_trains`` (confirm trains started), ``passive`` (regular probes left out
            because the peer's requests prove the path), ``passive_ok`` (such proofs),
            ``passive_misses`` (expected proof that did not come), ``rejected_<kind>`` for each :class:`linkpass.core.probe.ProbeError` kind
            (``auth``, ``malformed``, ``oversized``, ``misaddressed``, ``unexpected``, ``replay``);
            ``socket_errors`` (a rail socket or the responder could not be opened) and
            ``internal_errors`` (a tick failed; logged with its traceback); ``rx_dropped``
            (datagrams the kernel dropped because a socket's receive queue was full, from
            ``SO_RXQ_OVFL``: real probes lost to a burst are counted here, never silently),
            ``late_wakeups`` (the prober's own timer ran more than :attr:`lag_void_ns` late)
            and ``voided_lag`` (probe misses found in such a late turn: not reported, see
            "Timing" above), ``peer_silent_misses`` (misses reported with
            ``peer_elsewhere=False``), ``responder_dropped`` (requests the responder thread
            answered whose proofs found its queue full, so were not judged).
        loop_lag_max_ns: the largest lateness of the prober's timer seen (ns).
    """

    def __init__(self, cfg: Config, key: bytes, post: Callable[[Event], None], *, clock: Callable[[], int] = time.monotonic_ns):
        self.cfg = cfg
        self.key = key
        self.post = post
        self._post_of: object = None  # the post whose ``answered`` (if any) is cached below
        self._answered_fast: Callable[..., None] | None = None
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.native = native_datapath(cfg)
        self._host_b = cfg.daemon.host.encode()  # this host's name as the wire carries it
        self._names_b: dict[str, bytes] = {}
        self.guard = wire.ReplyGuard()
        self.req_guard = wire.RequestGuard()
        self.loop_lag_max_ns = 0
        self._wake_at: int | None = None  # when the armed timer should fire (monotonic ns)
        self._rxq_drops: dict[int, int] = {}  # socket fd -> its SO_RXQ_OVFL count last seen
        self._peer_rails: dict[str, list[int]] = {}  # peer -> our rails that probe it
        self._peer_last: dict[str, int] = {}  # peer -> its latest evidence on any rail (ns)
        self._peer_back: dict[str, int] = {}  # peer -> when it last answered again after a peer-wide silence
        self._own_loss: set[tuple[int, str]] = set()  # paths whose misses were last judged their own
        self.path_stats: dict[tuple[int, str], wire.PathStats] = {}
        self._seq = time.time_ns()  # a restarted prober never reuses a recent seq
        self._priority: list[str] = []
        self._ips: dict[tuple[int, str], str] = {}
        self._ips_of: Config | None = None
        self._last_ok: dict[tuple[int, str], int] = {}  # path -> when its last reply came (ns)
        self._silenced: dict[tuple[int, str], int] = {}  # path -> the _last_ok whose silence was handled
        self._reply_seq: dict[tuple[int, str], int] = {}  # path -> seq of the last reply accepted (our acks)
        self._answered: dict[tuple[int, str], OrderedDict[int, None]] = {}  # (rail, prober) -> seqs we answered lately
        self._ack_used: dict[tuple[int, str], int] = {}  # path -> the newest ack counted as proof
        self._evidence_ns: dict[tuple[int, str], int] = {}  # path -> when the last proof came
        self._expect: dict[tuple[int, str], int] = {}  # passive path -> the next proof is due by
        self._gaps: dict[str, int] = {}  # peer -> _gap_ns, for the schedule version in _gaps_of
        self._gaps_of: tuple | None = None
        self._rail_ids: frozenset[int] = frozenset()
        self._rail_ids_of: Config | None = None
        self.schedule = self._new_schedule(cfg, clock())
        self._sync_stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resp: socket.socket | None = None
        self._responder = None  # native_io.Responder: the responder socket on a C thread (see _open_responder)
        self._rail_socks: dict[int, socket.socket] = {}
        self._rail_poll = select.poll()  # the rail sockets: which have datagrams, in one syscall
        self._rail_by_fd: dict[int, socket.socket] = {}
        self._rail_retry_ns: dict[int, int] = {}
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._stopped: asyncio.Future | None = None
        self._closed = False

    # ---------------------------------------------------------------- configuration

    def _new_schedule(self, cfg: Config, now: int) -> wire.Schedule:
        p = cfg.probe
        return wire.Schedule(interval_ns=p.interval_ms * 1_000_000, slow_interval_ns=p.slow_interval_ms * 1_000_000,
                             fast_peers=p.fast_peers, max_pps=p.max_pps, paths=rail_paths(cfg), now_ns=now,
                             priority=self._priority)

    def _peer_b(self, name: str) -> bytes:
        """A peer's name as the wire carries it (UTF-8; cached: encoded thousands of times a second)."""
        b = self._names_b.get(name)
        if b is None:
            if len(self._names_b) >= 65536:
                self._names_b.clear()
            b = self._names_b[name] = name.encode()
        return b

    @property
    def lag_void_ns(self) -> int:
        """Timer lateness (ns) above which the prober's own verdicts of that turn are void: half
        an interval (the loop was busy elsewhere: replies it did not see in time may sit
        unread, and on a starved host the peer is likely late for the same reason), at least
        2 ms (asyncio's timer resolution is about 1 ms)."""
        return max(2_000_000, self.schedule.interval_ns // 2)

    def _sync_stats(self) -> None:
        self._gaps_of = None
        wanted = set(self.schedule.paths())
        self._peer_rails = {}
        for rail, peer in sorted(wanted):
            self._peer_rails.setdefault(peer, []).append(rail)
        self.path_stats = {k: self.path_stats.get(k) or wire.PathStats() for k in self.schedule.paths()}
        self._last_ok = {k: v for k, v in self._last_ok.items() if k in wanted}
        self._silenced = {k: v for k, v in self._silenced.items() if k in wanted}
        for d in (self._reply_seq, self._answered, self._ack_used, self._evidence_ns, self._expect):
            for k in [k for k in d if k not in wanted]:
                del d[k]
        for d in (self._peer_last, self._peer_back):
            for k in [k for k in d if k not in self._peer_rails]:
                del d[k]
        self._own_loss &= wanted
        self.guard.forget(wanted)

    def reconfigure(self, cfg: Config, key: bytes) -> None:
        """Take a reloaded config and key: new paths, intervals and rates apply at once; the
        socket of a rail whose netdev changed is reopened; the responder moves if the port did
        (a bind failure is logged and counted in ``socket_errors``, never raised)."""
        old = self.cfg
        self.cfg, self.key = cfg, key
        self._host_b = cfg.daemon.host.encode()
        try:
            self.native = native_datapath(cfg)
        except RuntimeError as e:  # "c" without the module: keep probing, in Python
            self.native = False
            log.error("%s; probing with the Python datapath", e)
        now = self.clock()
        p = cfg.probe
        self.schedule.set_timing(interval_ns=p.interval_ms * 1_000_000, slow_interval_ns=p.slow_interval_ms * 1_000_000,
                                 fast_peers=p.fast_peers, max_pps=p.max_pps, now_ns=now)
        self.schedule.set_paths(rail_paths(cfg), now)
        self._sync_stats()
        if self._loop is None:
            return
        # keep the sockets of rails whose netdev did not change: replies to the probes in
        # flight arrive on them (closing them would report those probes lost)
        old_dev = {r.id: r.netdev for r in old.rails}
        new_dev = {r.id: r.netdev for r in cfg.rails}
        for rid in list(self._rail_socks):
            if old_dev.get(rid) != new_dev.get(rid):
                self._close_rail(rid)
        self._rail_retry_ns.clear()
        self._open_rails()
        if self._responder is not None:
            self._responder.configure(key, self._host_b)
        if old.probe.port != cfg.probe.port or self._resp is None or (self._responder is not None) != self._threaded():
            self._close_responder()
            try:
                self._open_responder()
            except OSError as e:
                self.counters["socket_errors"] += 1
                log.error("probe responder cannot bind UDP port %d: %s (not answering probes)", cfg.probe.port, e.strerror or e)
        self._rearm(now)

    def set_priority_peers(self, names: Sequence[str]) -> None:
        """Put these peers first in every rail's fast set (e.g. the training job's neighbours)."""
        self._priority = list(names)
        now = self.clock()
        self.schedule.set_priority(self._priority, now)
        self._sync_stats()
        if self._loop is not None:
            self._rearm(now)

    # ---------------------------------------------------------------- sockets

    async def start(self) -> None:
        """Open the responder socket and the per-rail sockets.

        Raises:
            OSError: the responder port cannot be bound.
        """
        self._loop = asyncio.get_running_loop()
        self._open_responder()
        self._open_rails()

    def _watch(self, s: socket.socket) -> None:
        """The responder socket: read as soon as a request comes (the peer's deadline runs)."""
        assert self._loop is not None
        self._tune(s)
        self._loop.add_reader(s.fileno(), self._readable, s)

    def rcvbuf_bytes(self) -> int:
        """Receive buffer asked for each probe socket (bytes): two seconds of ``max_pps``
        datagrams (the most this host sends, and about what it receives: probing is
        symmetric) at :data:`SKB_TRUESIZE` each, so a loop stalled for a second loses nothing;
        at least 256 KiB, at most 16 MiB."""
        return max(256 << 10, min(RCVBUF_MAX, 2 * self.cfg.probe.max_pps * SKB_TRUESIZE))

    def _tune(self, s: socket.socket) -> None:
        """Kernel receive timestamps, drop counts and a receive buffer sized to the probe rate.
        SO_RCVBUFFORCE (CAP_NET_ADMIN) may exceed net.core.rmem_max; without it SO_RCVBUF is
        capped there.  Failures are counted, never fatal."""
        for opt in (SO_TIMESTAMPNS, SO_RXQ_OVFL):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, 1)
            except OSError:
                self.counters["sockopt_errors"] += 1
        want = self.rcvbuf_bytes()
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, want)
        except OSError:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, want)
            except OSError:
                self.counters["sockopt_errors"] += 1

    def _close_sock(self, s: socket.socket | None) -> None:
        if s is None:
            return
        self._rxq_drops.pop(s.fileno(), None)
        if self._loop is not None:
            try:
                self._loop.remove_reader(s.fileno())
            except (ValueError, OSError):
                pass
        s.close()

    def _threaded(self) -> bool:
        """Whether the responder socket is read and answered on the C module's thread
        (:class:`linkpass.adapters._probe_io.Responder`) rather than by the event loop."""
        return bool(self.native) and hasattr(native_io, "Responder")

    def _open_responder(self) -> None:
        """Bind the responder socket.  With the C datapath a thread of the C module reads it
        and answers each request as it comes, without the event loop (no wake-up per request,
        no answer delayed by a busy loop); the proofs, replays and anything it does not accept
        in full are taken at the prober's timer turns (:meth:`drain`).  Otherwise the event
        loop watches it."""
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setblocking(False)
            s.bind(("0.0.0.0", self.cfg.probe.port))
        except OSError:
            s.close()
            raise
        self._resp = s
        if not self._threaded():
            self._watch(s)
            return
        self._tune(s)
        try:
            self._responder = native_io.Responder(s.fileno(), self.key, self._host_b)
        except (RuntimeError, OSError, ValueError) as e:  # no thread: the event loop answers
            log.warning("probe responder thread not started (%s); the event loop answers requests", e)
            self._watch(s)
            return
        for rid, rs in self._rail_socks.items():
            self._responder.set_rail(rid, rs.fileno())

    def _close_responder(self) -> None:
        """Stop the responder thread (what it queued is dropped) and close the socket."""
        if self._responder is not None:
            self._responder.stop()
            self._responder = None
        self._close_sock(self._resp)
        self._resp = None

    def _open_rails(self) -> None:
        for r in self.cfg.rails:
            self._rail_sock(r.id)

    def _rail_sock(self, rid: int) -> socket.socket | None:
        s = self._rail_socks.get(rid)
        if s is not None or self._loop is None:
            return s
        now = self.clock()
        if now < self._rail_retry_ns.get(rid, 0):
            return None
        netdev = next((r.netdev for r in self.cfg.rails if r.id == rid), None)
        if netdev is None:
            return None
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setblocking(False)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, netdev.encode())
            s.bind(("0.0.0.0", 0))
        except OSError as e:
            s.close()
            self._rail_retry_ns[rid] = now + SOCKET_RETRY_NS
            self.counters["socket_errors"] += 1
            log.warning("probe socket for rail %d on %s: %s (its probes count as lost; retrying in 1 s)", rid, netdev, e.strerror or e)
            return None
        self._rail_retry_ns.pop(rid, None)
        self._rail_socks[rid] = s
        if self._responder is not None:  # the thread answers requests for this rail out of it
            self._responder.set_rail(rid, s.fileno())
        # not watched: its replies are read at the prober's next turn (see "Reading replies")
        self._tune(s)
        self._rail_by_fd[s.fileno()] = s
        self._rail_poll.register(s.fileno(), select.POLLIN)
        return s

    def _close_rail(self, rid: int) -> None:
        s = self._rail_socks.pop(rid, None)
        if s is not None and self._responder is not None:  # before the fd number can be reused
            self._responder.set_rail(rid, -1)
        if s is not None and self._rail_by_fd.pop(s.fileno(), None) is not None:
            self._rail_poll.unregister(s.fileno())
        self._close_sock(s)

    async def close(self) -> None:
        """Stop probing and answering; close every socket (idempotent)."""
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        for rid in list(self._rail_socks):
            self._close_rail(rid)
        self._close_responder()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    # ---------------------------------------------------------------- timing

    async def run(self) -> None:
        """The sender: probe on schedule and report deadlines until :meth:`close`."""
        if self._loop is None:
            await self.start()
        self._stopped = self._loop.create_future()
        self._tick()
        try:
            await self._stopped
        finally:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None

    def _rearm(self, now: int) -> None:
        if self._stopped is None or self._closed:
            return  # run() not started: only the responder works
        if self._handle is not None:
            self._handle.cancel()
        wake = self.schedule.next_tick_ns
        dl = self.guard.next_deadline_ns()
        if dl is not None and dl < wake:
            wake = dl
        elif dl is not None and dl - wake <= COALESCE_NS:
            # the last round's deadlines come a few us after the next tick (each probe's clock
            # starts when it leaves): one wake-up for both, the sends that much late, the
            # verdicts on time
            wake = dl
        silent = self._next_silence_ns()
        if silent is not None and silent < wake:
            wake = silent
        if self._expect:
            due = min(self._expect.values())
            if due < wake:
                wake = due
        # +1 us: never wake a hair early because of the float clock of the loop
        self._wake_at = max(wake, now)
        self._handle = self._loop.call_later(max(0, wake - now) / 1e9 + 1e-6, self._tick)

    def _tick(self) -> None:
        self._handle = None
        try:
            # read every reply that has arrived (the rail sockets are read here only, see
            # "Reading replies"), and before judging anything also the requests queued on the
            # responder (a peer's request is a passive path's proof): under load the loop gets
            # here late, and datagrams queued meanwhile carry their kernel arrival times
            self.drain(responder=self._judging(self.clock()))
            now = self.clock()
            lag = 0 if self._wake_at is None else now - self._wake_at
            self.loop_lag_max_ns = max(self.loop_lag_max_ns, lag)
            void = lag > self.lag_void_ns
            if void:
                self.counters["late_wakeups"] += 1
            self._expire(now, void=void)
            for s in self.schedule.poll(now):
                self._send(s)
        except Exception:  # never let one bad tick stop probing
            self.counters["internal_errors"] += 1
            log.exception("probe tick failed")
        self._rearm(self.clock())

    def _detect_ns(self) -> int:
        return self.cfg.probe.detect_multiplier * self.schedule.interval_ns

    def _next_silence_ns(self) -> int | None:
        """When the first path under a confirm train reaches BFD's detection time (None: none)."""
        d = self._detect_ns()
        times = [self._last_ok[k] + d for k in self.schedule.confirming()
                 if k in self._last_ok and self._silenced.get(k) != self._last_ok[k]]
        return min(times) if times else None

    def _judging(self, now: int) -> bool:
        """Whether a turn at ``now`` declares something lost (a deadline, an expected proof or
        a silence has come)."""
        dl = self.guard.next_deadline_ns()
        if dl is not None and dl <= now:
            return True
        if self._expect and min(self._expect.values()) <= now:
            return True
        silent = self._next_silence_ns()
        return silent is not None and silent <= now

    def _gap_ns(self, peer: str) -> int:
        """Silence from ``peer`` on every rail longer than this is peer-wide: two of the
        intervals it is probed at (the fast one if any of its paths is fast)."""
        sched = self.schedule
        if self._gaps_of != (sched, sched.version):  # asked per datagram; the sets change rarely
            self._gaps, self._gaps_of = {}, (sched, sched.version)
        gap = self._gaps.get(peer)
        if gap is None:
            fast = any(sched.is_fast(r, peer) for r in self._peer_rails.get(peer, ()))
            gap = self._gaps[peer] = 2 * (sched.interval_ns if fast else sched.slow_interval_ns)
        return gap

    def _peer_evidence(self, peer: str, t: int) -> None:
        last = self._peer_last.get(peer)
        if last is not None and t - last > self._gap_ns(peer):
            self._peer_back[peer] = t  # it was silent everywhere and has just come back
        if last is None or t > last:
            self._peer_last[peer] = t

    def _elsewhere(self, rail: int, peer: str, since_ns: int, now_ns: int | None = None) -> bool | None:
        """Whether ``peer`` answered (a reply or a proof) on another of our rails at or after
        ``since_ns`` and within a gap (:meth:`_gap_ns`) before ``now_ns``, and has kept
        answering for BFD's detection time since its last peer-wide silence; None when no other
        rail leads to it.

        The second part matters when a stalled peer resumes: its rails come back one after the
        other within milliseconds, and a miss on the last one in that moment is the stall's,
        not the rail's.  A rail that stays silent while the others answer is judged so once
        the peer has answered elsewhere for the detection time."""
        others = [r for r in self._peer_rails.get(peer, ()) if r != rail]
        if not others:
            return None
        latest = max(self._last_ok.get((r, peer), -1) for r in others)
        if latest < since_ns:
            return False
        now = self.clock() if now_ns is None else now_ns
        if now - latest > self._gap_ns(peer):
            # answered elsewhere after this path's window opened, but silent everywhere since:
            # a peer that stalls in the middle of a send round leaves a few rails' evidence a
            # few ms newer than the rest, and the rest then miss while it is stalled
            return False
        back = self._peer_back.get(peer)
        return back is None or now - back >= self._detect_ns()

    def _post_miss(self, rail: int, peer: str, t_ns: int, seq: int, since_ns: int) -> None:
        key = (rail, peer)
        elsewhere = self._elsewhere(rail, peer, since_ns, t_ns)
        if elsewhere is False and key in self._own_loss:
            # once a path's loss is its own it stays so until the path answers or the peer falls
            # silent everywhere for longer than a gap: the other rails' evidence arrives on its
            # own schedule, and a probe window that happens to hold none of it would otherwise
            # flip the verdict (and the routes) back and forth on every miss
            last = self._peer_last.get(peer)
            if last is not None and t_ns - last <= self._gap_ns(peer):
                elsewhere = True
        if elsewhere:
            self._own_loss.add(key)
        else:
            self._own_loss.discard(key)
        if elsewhere is False:
            self.counters["peer_silent_misses"] += 1
        self.post(ProbeResult(rail, peer, False, t_ns, None, seq, peer_elsewhere=elsewhere))

    def _expire(self, now: int, void: bool = False) -> None:
        """Report the probes whose deadline passed as lost.  ``void``: this turn came late (the
        loop was busy elsewhere): the losses are recorded nowhere and reported to nobody (they
        would be the prober's own lateness as often as the path's); confirm trains still
        start, so a path that is really failing is probed densely and judged next turn."""
        if self._expect:
            self._expire_passive(now, void)
        lost = self.guard.expire(now)
        confirming = self.schedule.confirming()
        if confirming:
            # a path silent for detect_multiplier x interval since its last reply: its
            # outstanding probes are lost now (BFD declares the session down at that moment)
            d = self._detect_ns()
            for key in confirming:
                t_ok = self._last_ok.get(key)
                if t_ok is not None and now >= t_ok + d and self._silenced.get(key) != t_ok:
                    self._silenced[key] = t_ok  # once per silence
                    lost += self.guard.expire_path(*key)
        self._report_lost(lost, now, void)

    def _report_lost(self, lost: list[wire.Pending], now: int, void: bool = False) -> None:
        for p in lost:
            key = (p.rail, p.peer)
            if p.fast:  # a fast path missed a probe: a confirm train (if it ever answered)
                self._start_confirm(key, now)
            if void:
                self.counters["voided_lag"] += 1
                continue
            self.counters["timeouts"] += 1
            st = self.path_stats.get(key)
            if st is not None:
                st.record(False)
            self._post_miss(p.rail, p.peer, now, p.seq, p.sent_ns)

    def _expire_passive(self, now: int, void: bool = False) -> None:
        slack = self.schedule.interval_ns * 3 // 2
        for key, due in list(self._expect.items()):
            if due > now:
                continue
            del self._expect[key]
            self._start_confirm(key, now)
            if void:
                self.counters["voided_lag"] += 1
                continue
            self.counters["passive_misses"] += 1
            st = self.path_stats.get(key)
            if st is not None:
                st.record(False)
            self._post_miss(key[0], key[1], now, 0, due - slack)

    def _start_confirm(self, key: tuple[int, str], now: int) -> None:
        last_ok = self._last_ok.get(key)
        if last_ok is None:
            return
        # probe densely until it answers or BFD's detection time (plus one step) has passed
        # since its last reply
        end = last_ok + self._detect_ns() + self.schedule.confirm_step_ns
        if self.schedule.confirm(key[0], key[1], now, end):
            self.counters["confirm_trains"] += 1

    def _passive(self, s: wire.Send, now: int) -> bool:
        """Leave this regular fast probe out: the peer's requests prove the path (see above).
        Asked by :meth:`_send` only for a regular fast probe to a peer whose name sorts before
        ours (the one of the two that probes)."""
        key = (s.rail, s.peer)
        ev = self._evidence_ns.get(key)
        slack = self.schedule.interval_ns * 3 // 2
        if ev is None or now - ev > slack:
            return False
        if key not in self._expect:
            self._expect[key] = now + slack
        self.counters["passive"] += 1
        return True

    # ---------------------------------------------------------------- send

    def _peer_ip(self, rail: int, peer: str) -> str | None:
        cfg = self.cfg
        if self._ips_of is not cfg:  # one lookup table per config, not a scan per probe
            self._ips = {(int(r), p.name): str(a) for p in cfg.peers for r, a in p.rail_ips.items()}
            self._ips_of = cfg
        return self._ips.get((rail, peer))

    def _send(self, s: wire.Send, now: int | None = None) -> None:
        # the send time (and so the deadline) is read per probe, just before it leaves: a loop
        # descheduled in the middle of a tick must not shorten the later probes' deadlines
        if now is None:
            now = self.clock()
        rail, peer = s.rail, s.peer
        if s.fast and not s.confirm and peer < self.cfg.daemon.host and self._passive(s, now):
            return
        self._seq += 1
        seq = self._seq
        self.guard.add(wire.Pending(rail, peer, seq, now, now + s.timeout_ns, s.fast))
        ip = self._peer_ip(rail, peer)
        sock = self._rail_socks.get(rail) or self._rail_sock(rail)
        if ip is None or sock is None:
            self.counters["send_errors"] += 1
            return
        ack = self._reply_seq.get((rail, peer), 0)
        if self.native:
            err = native_io.send_probe(sock.fileno(), ip, self.cfg.probe.port, self.key, wire.REQUEST, self._host_b,
                                       self._peer_b(peer), rail, seq, now, ack)
        else:
            err = 0
            try:
                sock.sendto(wire.encode(wire.Probe(wire.REQUEST, self.cfg.daemon.host, s.peer, s.rail, seq, now, ack), self.key),
                            (ip, self.cfg.probe.port))
            except OSError as e:
                err = e.errno or -1
        if err:
            self.counters["send_errors"] += 1
            if err in _GONE:  # the netdev went away: rebind when it is back
                self._close_rail(s.rail)
            n = self.counters["send_errors"]
            if n <= 10 or n % 1000 == 0:
                log.debug("probe to %s on rail %d failed (%d so far): %s", ip, s.rail, n, os.strerror(err) if err > 0 else "error")
            return
        self.counters["sent"] += 1

    # ---------------------------------------------------------------- receive

    def _read(self, sock: socket.socket, limit: int, offset: int | None = None) -> int:
        """Read and handle up to ``limit`` queued datagrams; returns how many were read.
        ``offset``: CLOCK_REALTIME - CLOCK_MONOTONIC (ns) if the caller has read it (else read
        here, once per call, at the first timestamp)."""
        if self.native:
            return self._read_native(sock, limit, offset)
        n = 0
        while n < limit:
            try:
                data, anc, _flags, addr = sock.recvmsg(RECV_BUF, _ANC_BUF)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. an ICMP error queued on the socket
                log.debug("probe socket error: %s", e)
                break
            n += 1
            arrival = None
            for level, typ, cdata in anc:
                if level != socket.SOL_SOCKET:
                    continue
                if typ == SO_TIMESTAMPNS and len(cdata) >= _TIMESPEC.size:
                    sec, nsec = _TIMESPEC.unpack_from(cdata)
                    if offset is None:
                        offset = time.time_ns() - self.clock()
                    arrival = sec * 1_000_000_000 + nsec - offset
                elif typ == SO_RXQ_OVFL and len(cdata) >= _U32.size:
                    self._count_drops(sock, _U32.unpack_from(cdata)[0])
            self.on_datagram(data, addr, arrival)
        return n

    def _read_native(self, sock: socket.socket, limit: int, offset: int | None) -> int:
        """:meth:`_read` through :mod:`linkpass.adapters._probe_io`: one recvmmsg(2) per 64
        datagrams, and the MAC check and parse in C.  What C did not accept in full comes back
        raw and goes through :meth:`on_datagram` (the same rejection kinds and messages)."""
        items = self._recv_native(sock, limit)
        self._handle_native(items, offset)
        return len(items)

    def _recv_native(self, sock: socket.socket, limit: int) -> list:
        items, ovfl, err = native_io.recv_batch(sock.fileno(), self.key, self._host_b, limit)
        if ovfl >= 0:
            self._count_drops(sock, ovfl)
        if err:
            log.debug("probe socket error: %s", os.strerror(err))
        return items

    def _handle_native(self, items: list, offset: int | None) -> None:
        """Handle :func:`recv_batch` items in the order given (see its docstring for the shapes)."""
        if not items:
            return
        if offset is None:
            offset = time.time_ns() - self.clock()
        now = self.clock()
        host = self.cfg.daemon.host
        # the common cases (a reply in time, the path's only probe out; a proof) are handled
        # here and their results go to the filter in one call; anything else flushes them
        # first, so every path's results reach the filter in order
        accept, ok, REPLY = self.guard.accept, [], wire.REPLY
        for it in items:
            rt = it[-1]
            arrival = rt - offset if rt else None
            kind = it[0]
            # a kernel time from the future or from before a wall-clock step is not believed
            t = now if arrival is None or not now - 10_000_000_000 < arrival <= now else arrival
            try:
                if kind == REPLY:
                    pend = accept(it[3], it[1], it[2], it[4], t)
                    if pend is not None:
                        self._reply_ok(pend, t, ok)
                        continue
                elif kind == _ANSWERED_ITEM:  # the responder thread checked the guard and answered it
                    self._proof(it[2], it[1], it[3], it[5], t, ok)
                    continue
            except Exception as e:  # noqa: BLE001 - never let a datagram kill the daemon
                self._reject("malformed", it[6], e)
                continue
            if ok:
                self._post_many(ok)
                ok = []
            if kind == 0:
                self.on_datagram(it[1], it[2], arrival)
                continue
            if kind == _GONE_ITEM:  # a reply out of this rail's socket found its netdev gone
                self._close_rail(it[1])
                continue
            if kind == _REPLAY_ITEM:
                hi, below = it[4], it[5]
                why = f"is {hi - it[3]} below the newest ({hi})" if below else "was already answered"
                self._reject("replay", it[6], wire.ProbeError("replay", f"request seq {it[3]} from {it[1]} {why}"))
                continue
            p = wire.Probe(kind, it[1], host, it[2], it[3], it[4], it[5])
            try:
                if kind == wire.REQUEST:
                    self._on_request(p, it[6], t)
                else:
                    self._on_reply(p, t)
            except wire.ProbeError as e:
                self._reject(e.kind, it[6], e)
            except Exception as e:  # noqa: BLE001 - never let a datagram kill the daemon
                self._reject("malformed", it[6], e)
        if ok:
            self._post_many(ok)

    def _count_drops(self, sock: socket.socket, total: int) -> None:
        fd = sock.fileno()
        last = self._rxq_drops.get(fd, 0)
        if total != last:
            self.counters["rx_dropped"] += (total - last) & 0xFFFFFFFF  # u32 counter wraps
            self._rxq_drops[fd] = total
            n = self.counters["rx_dropped"]
            log.warning("probe socket receive queue overflowed: %d datagrams dropped by the kernel so far", n)

    def _readable(self, sock: socket.socket) -> None:
        self._read(sock, RECV_BATCH)

    def drain(self, responder: bool = True) -> int:
        """Read every datagram queued on the rail sockets and (``responder``) the responder
        socket, at most :data:`DRAIN_MAX` per socket, so verdicts are made with every reply
        that has arrived.  Returns the count."""
        n = 0
        offset = time.time_ns() - self.clock()
        if self.native and (self._rail_by_fd or self._responder is not None):
            # every queued datagram of every rail socket that holds one (a recvmmsg per 64),
            # until none does, and what the responder thread queued, handled in kernel arrival
            # order across the sockets
            batch: list = self._take_responder() if self._responder is not None else []
            for _ in range(DRAIN_MAX if self._rail_by_fd else 0):
                got = 0
                for fd, _ev in self._rail_poll.poll(0):
                    s = self._rail_by_fd.get(fd)
                    if s is not None:
                        items = self._recv_native(s, DRAIN_MAX)
                        got += len(items)
                        batch += items
                if not got or len(batch) >= DRAIN_MAX:
                    break
            batch.sort(key=_arrival_of)
            self._handle_native(batch, offset)
            n += len(batch)
        elif self._rail_by_fd:
            # one datagram from each rail socket that holds one, until none does: a poll(2) of
            # all of them costs a quarter of one recvmsg on an empty socket (a syscall and an
            # exception)
            for _ in range(DRAIN_MAX):
                got = 0
                for fd, _ev in self._rail_poll.poll(0):
                    s = self._rail_by_fd.get(fd)
                    if s is not None:
                        got += self._read(s, 1, offset)
                if not got:  # nothing left (or only an error or a closed socket: nothing to read)
                    break
                n += got
        if responder and self._resp is not None and self._responder is None:
            n += self._read(self._resp, DRAIN_MAX, offset)
        return n

    def _take_responder(self) -> list:
        """The responder thread's queue (see :class:`linkpass.adapters._probe_io.Responder`),
        its counts added to :attr:`counters`."""
        items, answered, errors, dropped, ovfl, err = self._responder.take()
        c = self.counters
        if answered:
            c["answered"] += answered
        if errors:
            c["answer_errors"] += errors
        if dropped:
            c["responder_dropped"] += dropped
            log.warning("probe responder queue full: %d requests answered but their proofs not judged (%d so far)",
                        dropped, c["responder_dropped"])
        if ovfl >= 0 and self._resp is not None:
            self._count_drops(self._resp, ovfl)
        if err:
            log.debug("probe responder socket error: %s", os.strerror(err))
        return items

    def on_datagram(self, data: bytes, addr, arrival_ns: int | None = None) -> None:
        """Handle one datagram from any of our sockets (a request to answer or a reply).

        ``arrival_ns``: when the kernel received it (monotonic ns; None: now).  A reply is
        judged against its probe's deadline by this time, not by when the loop got to it."""
        now = self.clock()
        # a kernel time from the future or from before a wall-clock step is not believed
        t = now if arrival_ns is None or not now - 10_000_000_000 < arrival_ns <= now else arrival_ns
        try:
            p = wire.decode(data, self.key)
            if p.target != self.cfg.daemon.host:
                raise wire.ProbeError("misaddressed", f"probe for {p.target!r}, this host is {self.cfg.daemon.host!r}")
            if p.type == wire.REQUEST:
                self._on_request(p, addr, t)
            else:
                self._on_reply(p, t)
        except wire.ProbeError as e:
            self._reject(e.kind, addr, e)
        except Exception as e:  # noqa: BLE001 - never let a datagram kill the daemon
            self._reject("malformed", addr, e)

    def _on_request(self, p: wire.Probe, addr, t: int) -> None:
        """An authentic request addressed to us, received at ``t``: answer it, take its proof.

        Raises:
            ProbeError: ``replay`` (the request guard)."""
        self.req_guard.check(p)
        self._answer(p, addr)
        self._proof(p.rail, p.sender, p.seq, p.ack, t)

    def _on_reply(self, p: wire.Probe, t: int) -> None:
        """An authentic reply addressed to us, received at ``t``.

        Raises:
            ProbeError: from :meth:`linkpass.core.probe.ReplyGuard.check`."""
        pend = self.guard.check(p, t)
        # earlier probes of this path whose deadline passed before this reply arrived are lost
        # before it counts (the engine sees the path's results in order)
        self._report_lost(self.guard.expire_path_before(pend.rail, pend.peer, t), t)
        self._reply_ok(pend, t)

    def _reply_ok(self, pend: wire.Pending, t: int, batch: list | None = None) -> None:
        """The reply to ``pend`` arrived at ``t``, in time and accepted by the reply guard.
        ``batch``: append the result there for :meth:`_post_many` (else posted now)."""
        key = (pend.rail, pend.peer)
        rtt = max(0, t - pend.sent_ns)
        self.counters["replies"] += 1
        last_ok = self._last_ok.get(key)
        if last_ok is None or t > last_ok:
            self._last_ok[key] = t
        self._own_loss.discard(key)
        self._peer_evidence(pend.peer, t)
        self._reply_seq[key] = pend.seq
        self.schedule.settle(*key)
        st = self.path_stats.get(key)
        if st is not None:
            st.record(True, rtt)
        if batch is None:
            self._post_ok(pend.rail, pend.peer, t, rtt, pend.seq)
        else:
            batch.append((pend.rail, pend.peer, t, rtt, pend.seq))

    def _proof(self, rail: int, sender: str, seq: int, ack: int, now: int, batch: list | None = None) -> None:
        """A request (``seq``, acking our reply ``ack``; 0: none) from a peer we probe on that
        rail, answered: remember that we answered it, and if it acks a reply of ours (newer than
        any ack counted so far), the path works both ways.  ``batch``: as in :meth:`_reply_ok`."""
        key = (rail, sender)
        st = self.path_stats.get(key)
        if st is None:
            return
        seen = self._answered.get(key)
        if seen is None:
            seen = self._answered[key] = OrderedDict()  # popitem(last=False) is O(1), see ReplyGuard
        seen[seq] = None
        if len(seen) > 16:
            seen.popitem(last=False)
        if not ack or ack <= self._ack_used.get(key, 0) or ack not in seen:
            return
        self._ack_used[key] = ack
        self._evidence_ns[key] = now
        self._expect.pop(key, None)
        last_ok = self._last_ok.get(key)
        if last_ok is None or now > last_ok:
            self._last_ok[key] = now
        self._own_loss.discard(key)
        self._peer_evidence(sender, now)
        self.schedule.settle(rail, sender)
        self.counters["passive_ok"] += 1
        st.record(True)
        if batch is None:
            self._post_ok(rail, sender, now, None, 0)
        else:
            batch.append((rail, sender, now, None, 0))

    def _post_many(self, results: list) -> None:
        """Post answered results ``(rail, peer, t_ns, rtt_ns, seq)`` in order: through the
        probe filter's ``answered_many`` when ``post`` is one, else one by one (:meth:`_post_ok`).
        A result whose posting fails is counted (``internal_errors``) and logged, and the
        others still go (as when each was posted with its datagram)."""
        post = self.post
        if isinstance(post, ProbeFilter):
            post.answered_many(results, on_error=self._post_failed)
            return
        for r in results:
            try:
                self._post_ok(*r)
            except Exception as e:  # noqa: BLE001 - never let a result kill the daemon
                self._post_failed(r, e)

    def _post_failed(self, result: tuple, err: Exception) -> None:
        self.counters["internal_errors"] += 1
        n = self.counters["internal_errors"]
        if n <= 10 or n % 1000 == 0:
            log.error("probe result (rail %s, peer %s) not posted (%d internal errors so far): %r", result[0], result[1], n, err)

    def _post_ok(self, rail: int, peer: str, t_ns: int, rtt_ns: int | None, seq: int) -> None:
        """Post an answered probe: through the probe filter's ``answered`` when ``post`` is one
        (:meth:`linkpass.core.probe_filter.ProbeFilter.answered`: the same result without
        making the event when the filter absorbs it), else as a ``ProbeResult``."""
        post = self.post
        if post is not self._post_of:
            self._post_of, self._answered_fast = post, post.answered if isinstance(post, ProbeFilter) else None
        if self._answered_fast is not None:
            self._answered_fast(rail, peer, t_ns, rtt_ns, seq)
        else:
            post(ProbeResult(rail, peer, True, t_ns, rtt_ns, seq))

    def _reject(self, kind: str, addr, err: Exception) -> None:
        name = "late" if kind == "late" else f"rejected_{kind}"
        self.counters[name] += 1
        n = self.counters[name]
        if kind != "late" and (n <= 10 or n % 1000 == 0):
            log.warning("probe datagram from %s:%s dropped (%s, %d so far): %s", addr[0], addr[1], kind, n, err)

    def _answer(self, req: wire.Probe, addr) -> None:
        if self._rail_ids_of is not self.cfg:
            self._rail_ids, self._rail_ids_of = frozenset(r.id for r in self.cfg.rails), self.cfg
        sock = self._rail_sock(req.rail) if req.rail in self._rail_ids else None
        out = sock or self._resp
        if out is None:  # closed, or no socket yet
            self.counters["answer_errors"] += 1
            return
        if self.native:
            err = native_io.send_probe(out.fileno(), addr[0], addr[1], self.key, wire.REPLY, self._host_b, self._peer_b(req.sender),
                                       req.rail, req.seq, req.ts_ns, 0)
        else:
            err = 0
            try:
                out.sendto(wire.encode(req.reply(), self.key), addr)
            except OSError as e:
                err = e.errno or -1
        if err:
            self.counters["answer_errors"] += 1
            if sock is not None and err in _GONE:
                self._close_rail(req.rail)
            return
        self.counters["answered"] += 1

    # ---------------------------------------------------------------- status

    def stats(self) -> dict:
        """JSON-ready counters and per-path figures (for `linkpass status` and metrics)."""
        sched = self.schedule
        return {
            "enabled": self.cfg.probe.enabled,
            "port": self.cfg.probe.port,
            "tick_ms": sched.tick_ns / 1e6,
            "outstanding": len(self.guard),
            "rcvbuf_bytes": self.rcvbuf_bytes(),
            "responder": "thread" if self._responder is not None else "event loop",
            "loop_lag_max_ms": round(self.loop_lag_max_ns / 1e6, 3),
            "counters": dict(sorted(self.counters.items())),
            "priority_peers": list(self._priority),
            "paths": [
                {"rail": rail, "peer": peer, "fast": sched.is_fast(rail, peer), **self.path_stats[(rail, peer)].to_json()}
                for rail, peer in sorted(sched.paths())
            ],
        }
