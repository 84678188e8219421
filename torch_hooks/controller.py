"""The hook's fault controller: daemon notices and collective errors in, job-wide rebuilds out.

One :class:`Controller` per training process (started by :mod:`torch_hooks.bootstrap` when the
script's first process group is created) owns every :class:`torch_hooks.pg.ResilientProcessGroup`
of the process.  It acts on two triggers:

* a **daemon notice** (:class:`torch_hooks.client.DaemonClient`) whose affected rails include the
  rail the groups are on: the groups are aborted at once (pending collectives fail and park
  within milliseconds) and a rebuild is requested;
* a **collective error** on a group the controller did not abort (a peer aborted and its sockets
  closed, or the link died under it before any notice): a rebuild is requested.

Rebuilds are job-wide epochs ``e = 1, 2, ...`` agreed through the job's store (a TCPStore
client of its own to ``MASTER_ADDR:MASTER_PORT``, keys under ``linkpass/<job>/``):

1. ``rebuild/<e>/req``: the first rank to ``compare_set`` it asks for epoch ``e``; every rank's
   controller thread looks for that key
   (a ``check`` every :data:`POLL_S`), so a rank whose own daemon has not heard of the fault
   joins within about 20 ms;
2. ``rebuild/<e>/prop/<rank>``: each rank's :class:`torch_hooks.agreement.Proposal` (its step,
   the rails its daemon says every peer can use minus the ones it reports broken, its rail);
3. :func:`torch_hooks.agreement.decide` on all proposals gives the same rail on every rank;
4. every group, in creation order (the same on every rank: ``new_group`` is collective), is
   rebuilt under generation ``e`` on the chosen rail's interface and re-issues its interrupted
   collectives (:meth:`ResilientProcessGroup.rebuild`).  The script never sees an error.

A latched group (NCCL; the gloo wrapper with ``LINKPASS_LATCHED=1``) refuses to move to another
interface (:class:`torch_hooks.pg.LatchedInterfaceError`); the controller then hands the rank to
a spare (:mod:`torch_hooks.handover`) or, with none, exits with
:data:`torch_hooks.guard.EXIT_MIGRATE` and a one-line reason.

Every rebuild is recorded in :attr:`Controller.events` (times from ``time.monotonic_ns()``;
``*_ms`` in milliseconds) and reported to the daemon (``rebuilt``).
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from torch_hooks import agreement
from torch_hooks.client import DaemonClient
from torch_hooks.pg import job_store
from torch_hooks.protocol import Notice, Registration

log = logging.getLogger("linkpass.torch_hooks.controller")

#: exit statuses, shared with the explicit API (torch_hooks.guard) and the spares
EXIT_MIGRATE = 75
EXIT_REBUILD_FAILED = 76

#: the most rebuilds in :data:`RATE_WINDOW_S` before the controller stops rebuilding (a fault
#: that comes back at once is not a link fault a rebuild can fix)
MAX_REBUILDS = 8
RATE_WINDOW_S = 60.0

#: how long a rank waits for its own spare that is still starting before it says none is left (s)
SPARE_START_S = 60.0

#: how long a rebuild waits for a rail every rank can use, and how often it asks again (s): a
#: rail held down after a false alarm (the daemon's hold-down is 2 s by default) comes back
def _env_s(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name) or default))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; %.0f s", name, os.environ.get(name), default)
        return default


NO_RAIL_WAIT_S = _env_s("LINKPASS_NO_RAIL_WAIT_S", 10.0)
ROUND_S = 0.25

#: how long a rebuild waits for an optimizer step in progress to finish (s)
STEP_LOCK_S = 5.0

#: how many times a planned hand-over (GPU at risk) is put off because a peer had not completed
#: a collective from before the moving rank's step boundary, before the rank stays where it is
MAX_HANDOVER_DEFERRALS = 3

#: how often the controller thread checks the store for a rebuild request (s).  A check, not a
#: store wait() with a timeout: a timed-out TCPStore wait leaves a waiter on the server whose
#: late answer desynchronises the connection (torch_hooks/spare.py).  A rank whose own daemon
#: saw the fault does not wait for this: it aborts at once.
POLL_S = 0.02


def parse_rail_ifaces(text: str) -> dict[int, str]:
    """``"0=eth1,1=eth2"`` -> ``{0: "eth1", 1: "eth2"}`` (order kept: the preference order).

    Raises:
        ValueError: an item that is not ``RAIL=NETDEV`` with an integer rail.
    """
    out: dict[int, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        rail, sep, dev = item.partition("=")
        if not sep or not dev.strip() or not rail.strip().isdigit():
            raise ValueError(f"LINKPASS_RAIL_IFACES: {item!r} is not RAIL=NETDEV (e.g. 0=ens1f0np0)")
        out[int(rail)] = dev.strip()
    return out


class Settings:
    """What the controller needs to know, from the environment ``linkpass exec`` prepared.

    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (any launcher);
    ``LINKPASS_JOB`` (default ``TORCHELASTIC_RUN_ID``, else ``job``), ``LINKPASS_HOST`` (this
    host's name as the daemons know it; default the hostname), ``LINKPASS_RAIL_IFACES``
    (``RAIL=NETDEV,...``, preference order), ``LINKPASS_HOOKS_SOCKET`` (the daemon's hooks
    socket), ``LINKPASS_REBUILD_TIMEOUT_S`` (how long a rebuild waits for every rank, default 60),
    ``GLOO_SOCKET_IFNAME`` (the interface the job starts on).

    Raises:
        ValueError: a malformed variable, naming it.
    """

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ

        def num(name: str, default: str | None = None, kind=int):
            raw = env.get(name, default)
            if raw is None or raw == "":
                return None
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None

        self.rank = num("RANK", "0")
        self.world_size = num("WORLD_SIZE", "1")
        self.local_rank = num("LOCAL_RANK")
        self.master_addr = env.get("MASTER_ADDR") or None
        self.master_port = num("MASTER_PORT")
        self.job = env.get("LINKPASS_JOB") or env.get("TORCHELASTIC_RUN_ID") or "job"
        import socket as _s

        self.host = env.get("LINKPASS_HOST") or _s.gethostname()
        self.rails = parse_rail_ifaces(env.get("LINKPASS_RAIL_IFACES", ""))
        self.hooks_socket = env.get("LINKPASS_HOOKS_SOCKET") or None
        self.rebuild_timeout_s = num("LINKPASS_REBUILD_TIMEOUT_S", "60", float)
        start_if = env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME") or ""
        self.rail = next((r for r, d in self.rails.items() if d == start_if.split(",")[0]), None)
        self.gpu = num("LINKPASS_GPU") if env.get("LINKPASS_GPU") else self.local_rank


class Controller:
    """Owns the process's resilient groups; see the module docstring.

    Args:
        settings: :class:`Settings`.
        tracker: the :class:`torch_hooks.tracker.Tracker` (the step for proposals, the first step
            after a rebuild for timings).
        on_latched: ``fn(reason, decision) -> None`` when a latched group cannot move (the
            hand-over to a spare); default: exit :data:`EXIT_MIGRATE`.
        exit_fn: the one exit path (code, reason): report, flush, exit.  :meth:`exit_fn` first
            marks this rank as gone in the job's store (:meth:`mark_left`), so the other ranks,
            waiting for its proposal in a rebuild's agreement, stop at once with the reason
            instead of at the rebuild timeout.
    """

    def __init__(self, settings: Settings, tracker: Any, *, on_latched: Callable[[str, agreement.Decision], None] | None = None,
                 exit_fn: Callable[[int, str], None] | None = None):
        self.s = settings
        self.tracker = tracker
        self.groups: list[Any] = []
        self.epoch = 0
        self.rail = settings.rail
        self.events: list[dict] = []
        self.on_latched = on_latched
        self._exit = exit_fn or _default_exit
        self.client: DaemonClient | None = None
        self._kv = None       # this thread's store client
        self._kv_wait = None  # the controller thread's (blocked in wait)
        self._lock = threading.Lock()
        self._pending: tuple[str, str, int] | None = None   # (trigger, reason, t_ns) of a local request
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rebuild_times: list[float] = []
        self._after_rebuild: dict | None = None
        self.peers: tuple[str, ...] = ()
        self.handover_event: dict | None = None
        self._handing_over = False
        self._in_rebuild = False
        self._deferred: tuple[str, str] | None = None
        self._planned: tuple[dict, str] | None = None  # (claimed spare, why) of a GPU-at-risk move
        #: a planned hand-over put off (see _defer_planned): {"wait": [(group, seq)], "deadline"
        #: (time.monotonic()), "tries", "asked"}; the controller thread asks for it again
        self._held_plan: dict | None = None
        self._step_held = False   # the controller keeps tracker.step_lock across epochs (_held_plan)
        self._step_locked = False  # this rebuild holds tracker.step_lock
        self.spares: list = []                 # this worker's warm spare processes
        self.memsnap: Any = None               # torch_hooks.memsnap.MemorySnapshots, when on
        tracker.add_step_listener(self._on_step)

    # ---------------------------------------------------------------- wiring

    def attach(self, g: Any) -> None:
        """Take ``g`` (a new wrapper) under control; the first one starts the controller."""
        with self._lock:
            self.groups.append(g)
            first = len(self.groups) == 1
        g.add_fault_listener(self._on_group_fault)
        if first:
            self.start(g)

    def _store(self, g: Any | None):
        if self.s.master_addr and self.s.master_port:
            st = dist.TCPStore(self.s.master_addr, self.s.master_port, is_master=False,
                               timeout=datetime.timedelta(seconds=max(30.0, self.s.rebuild_timeout_s)))
        elif g is not None:
            st = g._store  # the group's store (init_method without MASTER_ADDR/PORT)
        else:
            raise RuntimeError("no MASTER_ADDR/MASTER_PORT and no process group: no store for the job")
        return job_store(st, self.s.job)

    def start(self, g: Any | None = None) -> None:
        self._kv = self._store(g)
        self._kv_wait = self._store(g)
        self._kv.set(f"host/{self.s.rank}", self.s.host)
        if os.environ.get("LINKPASS_NO_DAEMON") != "1":
            self.client = DaemonClient(self._registration(), socket_path=self.s.hooks_socket, on_notice=self._on_notice,
                                       on_device_fault=self._on_device_fault, on_at_risk=self._on_at_risk)
            self.client.start()
        if self.s.local_rank in (0, None):  # one line per host says the job is protected
            rails = ", ".join(f"{r}={d}" for r, d in self.s.rails.items()) or "unknown"
            # one write, newline included: the client thread's lines cannot land inside it
            sys.stderr.write(f"linkpass: rank {self.s.rank}: process groups protected ({g.getBackendName() if g is not None else '?'}"
                             f"{', latched' if g is not None and g.latched else ''}; rails {rails}; "
                             f"{'no daemon' if self.client is None else 'daemon ' + self.client.socket_path}; "
                             f"{len(self.spares)} spare(s) per worker)\n")
            sys.stderr.flush()
        self._thread = threading.Thread(target=self._run, name="linkpass-controller", daemon=True)
        self._thread.start()

    def _registration(self) -> Registration:
        return Registration(job=self.s.job, rank=self.s.rank, world_size=self.s.world_size, peers=self.peers,
                            local_rank=self.s.local_rank, gpu=self.s.gpu, rail=self.rail,
                            netdev=self.s.rails.get(self.rail) if self.rail is not None else None,
                            backend=self.groups[0].inner_backend if self.groups else "gloo")

    def close(self) -> None:
        """Stop the controller thread and the daemon client, and wait for the thread (it must not
        be inside a store call when the interpreter finalizes: a thread that takes the GIL back
        from C++ then is ended through C++ frames and the process aborts)."""
        self._stop.set()
        if self.client is not None:
            self.client.close(0.5)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)

    # ---------------------------------------------------------------- triggers

    def _on_notice(self, n: Notice) -> None:
        if self._in_rebuild:
            return  # judged against the rail the rebuild chooses, once it is done
        if not n.affects(self.rail):
            return
        self.request("notice", f"daemon notice generation {n.generation}: rails {sorted(n.affected_rails)} unusable"
                     f"{' (' + n.reason + ')' if n.reason else ''}", abort=True)

    def _on_group_fault(self, g: Any, err: BaseException) -> None:
        self.request("collective_error", f"{g.group_name or 'group'}: {str(err).splitlines()[0][:200] if str(err) else err!r}")

    def request(self, trigger: str, reason: str, abort: bool = False) -> None:
        """Ask for a job-wide rebuild (any thread; returns at once).  ``abort``: abort this
        process's groups now, so pending collectives stop within milliseconds."""
        with self._lock:
            if self._in_rebuild:
                # an error of the group being replaced, or a second notice: looked at again
                # against the new rail once the rebuild is done
                self._deferred = (trigger, reason)
                return
            first = self._pending is None
            if first:
                self._pending = (trigger, reason, time.monotonic_ns())
        if first:
            log.warning("linkpass: rank %d asks for rebuild epoch %d: %s: %s", self.s.rank, self.epoch + 1, trigger, reason)
        if abort:
            for g in list(self.groups):
                g.abort()
        try:
            e = self.epoch + 1
            self._kv.compare_set(f"rebuild/{e}/req", "", json.dumps(
                {"rank": self.s.rank, "trigger": trigger, "reason": reason[:300]}))
        except Exception as ex:  # noqa: BLE001 - the controller thread retries from _pending
            log.warning("rebuild request not written to the store: %s", ex)

    # ---------------------------------------------------------------- the controller thread

    def _run(self) -> None:
        self._learn_peers()
        while not self._stop.wait(POLL_S):
            if self._handing_over:
                return  # this process is about to become a proxy: the spare takes part from now on
            if self._held_plan is not None:
                self._poll_held_plan()
            e = self.epoch + 1
            key = f"rebuild/{e}/req"
            try:
                found = self._kv_wait.check([key])
                if not found:
                    with self._lock:
                        pending = self._pending
                    if pending is not None and time.monotonic_ns() - pending[2] > 200_000_000:
                        # our request could not be written when it was made: write it now
                        self._kv_wait.compare_set(key, "", json.dumps({"rank": self.s.rank, "trigger": pending[0],
                                                                       "reason": pending[1][:300]}))
                    continue
            except Exception as ex:  # noqa: BLE001 - the store is unreachable: keep trying
                log.debug("store check failed: %s", ex)
                continue
            try:
                self._rebuild(e)
            except SystemExit:
                raise
            except BaseException as ex:  # noqa: BLE001 - one exit path
                log.exception("rebuild %d failed", e)
                self.exit_fn(EXIT_REBUILD_FAILED, f"rebuild of the process groups (epoch {e}) failed: {ex}")
                return

    def _learn_peers(self) -> None:
        keys = [f"host/{r}" for r in range(self.s.world_size)]
        try:
            self._kv_wait.wait(keys, datetime.timedelta(seconds=max(30.0, self.s.rebuild_timeout_s)))
            hosts = [self._kv_wait.get(k).decode() for k in keys]
        except Exception as ex:  # noqa: BLE001 - registration goes on without peers
            log.warning("peer host names not learned from the store (%s); the daemon sees this rank without peers", ex)
            return
        self.peers = tuple(dict.fromkeys(h for h in hosts if h != self.s.host))
        if self.client is not None:
            self.client.update(self._registration())

    def _proposal(self) -> agreement.Proposal:
        n = self.client.latest if self.client is not None else None
        rails = list(self.s.rails)
        if n is None:
            usable = rails
        else:
            usable = [r for r in rails if r in n.usable_common and r not in n.affected_rails]
        return agreement.Proposal(step=self.tracker.steps, usable=tuple(usable), rail=self.rail)

    def _rebuild(self, e: int) -> None:
        t0 = time.monotonic_ns()
        req = json.loads(self._kv_wait.get(f"rebuild/{e}/req"))
        with self._lock:
            pending, self._pending = self._pending, None
        for g in list(self.groups):
            g.abort()
        t_abort = time.monotonic_ns()
        # the optimizer must not step while the position and (for a hand-over) the state are
        # read and until the groups are rebuilt: hold its lock (a step in progress finishes first)
        locked = self._step_held or self.tracker.step_lock.acquire(timeout=STEP_LOCK_S)
        if not locked:
            log.warning("the optimizer step did not finish within %.0f s (a collective inside step()?); the position "
                        "is read without it", STEP_LOCK_S)
        self._step_locked = locked
        with self._lock:
            self._in_rebuild = True
        try:
            self._rebuild_locked(e, t0, t_abort, req, pending)
        finally:
            if locked and not self._step_held:  # kept for a put-off hand-over (_defer_planned)
                self.tracker.step_lock.release()
            self._step_locked = False
            if self._held_plan is not None:
                self._held_plan["asked"] = False  # a request this epoch took the place of is asked again
            with self._lock:
                self._in_rebuild = False
                self._pending = None
                deferred, self._deferred = self._deferred, None
        n = self.client.latest if self.client is not None else None
        if n is not None and n.affects(self.rail):
            self._on_notice(n)
        elif deferred is not None and deferred[0] != "notice" and self.epoch == e:
            log.info("an error during rebuild %d (%s) is not acted on: the groups were being replaced", e, deferred[1])

    def _agree(self, kv, e: int, req: dict) -> tuple[agreement.Decision, int]:
        """Rounds of proposals until :func:`agreement.decide` gives a rail, or gives up.

        A round with no rail every rank can use ("no_rail": a rail in hold-down after a false
        alarm, or peers whose daemons have not replanned yet) is tried again every
        :data:`ROUND_S` for up to :data:`NO_RAIL_WAIT_S`, with fresh proposals: every rank sees
        the same proposals, so every rank takes the same number of rounds.  Round 0 keys are
        ``rebuild/<e>/prop/<rank>``, round k ``rebuild/<e>/r<k>/prop/<rank>``; a spare joining
        for a failed device writes round 0 only, and that proposal stands for later rounds."""
        ho = req.get("handover") or {}
        joining = ho.get("rank") if ho.get("kind") == "device" else None
        deadline = time.monotonic() + NO_RAIL_WAIT_S
        k = 0
        while True:
            pfx = f"rebuild/{e}/prop" if k == 0 else f"rebuild/{e}/r{k}/prop"
            kv.set(f"{pfx}/{self.s.rank}", json.dumps(self._proposal().to_mapping()))
            keys = [f"rebuild/{e}/prop/{r}" if (r == joining or k == 0) else f"{pfx}/{r}" for r in range(self.s.world_size)]
            self._wait_ranks(kv, keys, e)
            props = {r: agreement.Proposal.from_mapping(json.loads(kv.get(key))) for r, key in enumerate(keys)}
            t_agree = time.monotonic_ns()
            if not self.s.rails:  # no rail map: rebuild where the group was
                steps = [p.step for p in props.values() if p.step is not None]
                return agreement.Decision("ok", min(steps) if steps else None, None, "no rail map"), t_agree
            d = agreement.decide(props, list(self.s.rails), self.rail, keep_current=True, max_step_lag=1)
            if d.outcome != "no_rail" or time.monotonic() + ROUND_S > deadline:
                return d, t_agree
            if k == 0:
                log.warning("linkpass: rank %d: %s; waiting up to %.0f s for a rail every rank can use", self.s.rank,
                            d.reason, NO_RAIL_WAIT_S)
            k += 1
            time.sleep(ROUND_S)

    def _wait_ranks(self, kv, keys: list[str], e: int) -> None:
        """Wait up to the rebuild timeout for ``keys`` (rank ``r``'s is ``keys[r]``), a ``check``
        every :data:`POLL_S` (see there why not a store wait); a rank missing that has left the
        job (``left/<rank>``, see :meth:`mark_left`) ends the wait at once: it will not come.

        Raises:
            RuntimeError: the ranks missing, and whether they left or did not answer in time.
        """
        deadline = time.monotonic() + self.s.rebuild_timeout_s
        while not kv.check(keys):
            missing = [r for r, key in enumerate(keys) if not kv.check([key])]
            gone = [r for r in missing if kv.check([f"left/{r}"])]
            if gone:
                raise RuntimeError(f"rank(s) {gone} left the job (the script ended or failed there) and cannot take part "
                                   f"in rebuild epoch {e}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"ranks {missing} did not join rebuild epoch {e} within {self.s.rebuild_timeout_s:.0f} s")
            time.sleep(POLL_S)

    def exit_fn(self, code: int, reason: str) -> None:
        """Leave the job for good with ``code`` and ``reason`` (the one exit path of a rank that
        gives up: no spare, a failed rebuild or join): :meth:`mark_left`, then the exit function
        given to the constructor (report, flush, ``os._exit``)."""
        self.mark_left()
        self._exit(code, reason)

    def mark_left(self) -> None:
        """Say in the job's store that this rank's process is exiting (at interpreter exit, the
        script done or failed, or through :meth:`exit_fn`; never for a hand-over or a rollback,
        which replace the process with ``execve``), so a peer whose collective then fails stops
        at once with that reason instead of waiting out the rebuild timeout.  Written with the
        controller thread's store client when called there, else with the main one.  Never
        raises."""
        kv = self._kv_wait if self._thread is not None and threading.current_thread() is self._thread else self._kv
        try:
            if kv is not None:
                kv.set(f"left/{self.s.rank}", "1")
        except Exception as ex:  # noqa: BLE001 - exiting anyway
            log.debug("left marker not written: %s", ex)

    def _position(self) -> dict:
        """This rank's ``rebuild/<e>/pos`` (see torch_hooks/handover.py), with ``lows``: per group
        (:func:`group_key`), its lowest unfinished collective once the aborted generation's work
        has finished (what the group's rebuild exchanges; the groups are down, so it holds)."""
        return dict(self.tracker.boundary_pos, boundary_seqs=[g.boundary_seq for g in self.groups],
                    ddp_layouts=self.tracker.ddp_layouts, module_kinds=list(self.tracker.module_kinds),
                    boundaries={group_key(i, g): g.boundary_seq for i, g in enumerate(self.groups)},
                    lows={group_key(i, g): g.settled_low() for i, g in enumerate(self.groups)})

    def _rebuild_locked(self, e: int, t0: int, t_abort: int, req: dict, pending) -> None:
        self._rebuild_times = [t for t in self._rebuild_times if t > time.monotonic() - RATE_WINDOW_S] + [time.monotonic()]
        if len(self._rebuild_times) > MAX_REBUILDS:
            self.exit_fn(EXIT_REBUILD_FAILED, f"{len(self._rebuild_times)} rebuilds within {RATE_WINDOW_S:.0f} s "
                         f"(last: {req.get('reason')}): the fault is not one a rebuild fixes")
            return
        kv = self._kv_wait
        ho = req.get("handover")
        if ho and ho.get("kind") == "none" and ho.get("rank") == self.s.rank:
            return  # our own request: the device-fault path is exiting this process with the reason
        if ho and ho.get("kind") == "none":
            # the rank that lost its device is leaving with nothing to take its place: no
            # agreement can complete without it (its proposal never comes), so stop now, with
            # its reason, not at the rebuild timeout
            from torch_hooks.spare import EXIT_NO_SPARE

            self.exit_fn(EXIT_NO_SPARE, f"rank {ho.get('rank')} lost its device and no spare can take it: {ho.get('reason')}")
            return
        kv.set(f"rebuild/{e}/pos/{self.s.rank}", json.dumps(self._position()))
        if (ho or {}).get("kind") == "rollback":  # no agreement: every rank starts over
            self._roll_back(e, ho, kv)
            return
        d, t_agree = self._agree(kv, e, req)
        if not d.ok:
            self.exit_fn(EXIT_MIGRATE if d.outcome == "no_rail" else EXIT_REBUILD_FAILED,
                         f"rebuild epoch {e}: {d.reason}")
            return
        iface = self.s.rails.get(d.rail) if d.rail is not None else None
        if ho and ho.get("kind") == "device":
            from torch_hooks import handover

            survivors = [r for r in range(self.s.world_size) if r != ho["rank"]]
            kv.wait([f"rebuild/{e}/pos/{r}" for r in survivors], datetime.timedelta(seconds=self.s.rebuild_timeout_s))
            src = handover.source_rank({r: json.loads(kv.get(f"rebuild/{e}/pos/{r}")) for r in survivors})
            if src == self.s.rank:
                data = handover.capture_state(self.tracker)
                handover.put_state(kv, e, ho["rank"], data)
                log.warning("linkpass: rank %d: state (%d bytes) sent to the spare taking rank %d", self.s.rank, len(data),
                            ho["rank"])
        if req.get("trigger") == "at_risk" and req.get("rank") == self.s.rank and self._planned is not None:
            lag = self._planned_lag(kv, e)
            if not lag:
                self._hand_over_planned(e, kv)
                return
            self._defer_planned(e, lag)  # and rebuild in-process: this rank re-issues what the peer needs
        latched = any(g.latched for g in self.groups)
        moving = iface is not None and any(iface != g.interface for g in self.groups)
        if latched and moving and self._own_rail_dead():
            # NCCL keeps the HCA list it read at start (shared/NCCL-REFERENCE.md 1.7): with its own
            # rail dead this process cannot build a working communicator; a fresh process can
            self._hand_over_latched(e, d, kv)
            return
        # what this rank does in epoch e, for a spare whose rank is behind this one's boundary
        # (handover.forward_source; _hand_over_latched writes "handover" or "exit")
        kv.set(f"rebuild/{e}/fate/{self.s.rank}", "in-process")
        results = []
        for g in list(self.groups):
            results.append(g.rebuild(e, interface=iface, timeout=datetime.timedelta(seconds=self.s.rebuild_timeout_s),
                                     move_latched=True))
        t_done = time.monotonic_ns()
        rail_from, self.rail, self.epoch = self.rail, d.rail if d.rail is not None else self.rail, e
        trig_ns = pending[2] if pending else t0
        ev = {"event": "rebuilt", "epoch": e, "trigger": pending[0] if pending else req.get("trigger"),
              "reason": req.get("reason"), "requested_by": req.get("rank"), "rail_from": rail_from, "rail_to": self.rail,
              "interface": iface, "step": self.tracker.steps, "decision": d.reason,
              "trigger_t_ns": trig_ns, "abort_ms": round((t_abort - t0) / 1e6, 3),
              "agree_ms": round((t_agree - t_abort) / 1e6, 3), "build_ms": round((t_done - t_agree) / 1e6, 3),
              "rebuild_ms": round((t_done - trig_ns) / 1e6, 3), "done_t_ns": t_done,
              "reissued": sum(r["reissued"] for r in results), "reissued_scratch": sum(r["reissued_scratch"] for r in results),
              "first_step_t_ns": None}
        self.events.append(ev)
        self._after_rebuild = ev
        log.warning("linkpass: rank %d: process groups rebuilt (epoch %d) on rail %s (%s) in %.1f ms; %d collectives "
                    "issued again; the script saw nothing", self.s.rank, e, self.rail, iface or "same interface",
                    ev["rebuild_ms"], ev["reissued"])
        if self.client is not None:
            self.client.update(self._registration())
            self.client.report("rebuilt", epoch=e, rail=self.rail, rebuild_ms=ev["rebuild_ms"])

    # ---------------------------------------------------------------- hand-over to a spare

    def _own_rail_dead(self) -> bool:
        """The rail this process latched is not usable here: this host's daemon says so, or its
        netdev has no carrier now (the kernel's word, read directly: a rebuild another rank asked
        for can start before this host's daemon has told this process about its own link)."""
        if self.rail is None:
            return False
        n = self.client.latest if self.client is not None else None
        if n is not None and self.rail in n.unusable:
            return True
        return netdev_down(self.s.rails.get(self.rail))

    def _claim(self, kv, why: str):
        from torch_hooks.spare import claim_spare

        own = [p.pid for p in self.spares if p.poll() is None]
        d = claim_spare(kv, self.s.host, own_pids=own)
        deadline = time.monotonic() + SPARE_START_S
        while ((d is None or (own and d.get("pid") not in own)) and any(p.poll() is None for p in self.spares)
               and time.monotonic() < deadline):
            # this worker's own spare is still starting (importing torch): wait for it, since the
            # proxy can pass on only its own child's exit status; give back another's claimed meanwhile
            if d is not None:
                kv.add(f"spares/{d['id']}/claimed", -1)
            time.sleep(0.05)
            d = claim_spare(kv, self.s.host, own_pids=own)
        if d is not None:
            log.info("rank %d on %s claimed spare %s on %s (pid %s)", self.s.rank, self.s.host, d["id"], d.get("host"),
                     d.get("pid"))
        if d is None:
            from torch_hooks.spare import list_spares, spare_alive

            seen = []
            try:
                seen.append(f"seq={int(kv.add('spares/seq', 0))}")
            except Exception as ex:  # noqa: BLE001
                seen.append(f"the store did not answer ({str(ex).splitlines()[0][:160]})")
            for x in list_spares(kv):
                claimed = kv.check([f"spares/{x['id']}/claimed"]) and int(kv.add(f"spares/{x['id']}/claimed", 0)) > 0
                seen.append(f"{x['id']}@{x.get('host')}: " + ("claimed" if claimed else spare_alive(kv, x, self.s.host)[1] or "alive"))
            log.error("no spare left for rank %d (%s); spares announced: %s", self.s.rank, why, "; ".join(seen) or "none")
        return d

    def _assign(self, kv, e: int, d: dict, rail, reason: str) -> None:
        from torch_hooks.spare import Assignment, proc_start

        a = Assignment(epoch=e, rank=self.s.rank, world_size=self.s.world_size, step=self.tracker.steps,
                       rail=rail if rail is not None else -1, host=self.s.host, pid=os.getpid(),
                       start=proc_start(os.getpid()), spare=int(d["id"]), reason=reason[:300])
        kv.set(f"spares/{d['id']}/assign", a.to_json())

    def _hand_over_latched(self, e: int, d: agreement.Decision, kv) -> None:
        from torch_hooks import handover

        why = (f"rail {self.rail} ({self.s.rails.get(self.rail)}) is down on this host and the process group is "
               "latched to it (as NCCL is to its HCA list)")
        fate = f"rebuild/{e}/fate/{self.s.rank}"  # for a lagging peer's spare (handover.forward_source)
        if not self.tracker.modules:
            kv.set(fate, "exit")
            self.exit_fn(EXIT_MIGRATE, f"{why}; no protected module (DDP / fully_shard) to hand over")
            return
        spare = self._claim(kv, why)
        if spare is None:
            kv.set(fate, "exit")
            self.exit_fn(EXIT_MIGRATE, f"{why}; no spare left to take rank {self.s.rank} (start the job with "
                         "linkpass exec --spares N)")
            return
        kv.set(fate, "handover")
        data = handover.capture_state(self.tracker)
        # for this rank's spare should it resume a step later from a peer (handover.choose_forward)
        kv.set(f"handover/{e}/{self.s.rank}/rng", handover.own_rng(self.tracker, in_step=True))
        kv.set(f"handover/{e}/{self.s.rank}", json.dumps({"kind": "latched", "rank": self.s.rank, "spare": spare["id"],
                                            "src": self.s.rank, "t_ns": time.monotonic_ns()}))
        handover.put_state(kv, e, self.s.rank, data)
        self._assign(kv, e, spare, d.rail, why)
        log.warning("linkpass: rank %d hands over to spare %s (pid %s) on rail %s: %s", self.s.rank, spare["id"],
                    spare.get("pid"), d.rail, why)
        if self.client is not None:
            self.client.report("handover", epoch=e, spare=int(spare["id"]), rail=d.rail)
            time.sleep(0.01)
        handover.become_proxy(int(spare["pid"]), int(spare["id"]))

    def _on_device_fault(self, msg: dict) -> None:
        """The daemon says this rank's GPU failed: hand the rank to a spare, never touch the GPU
        or a collective again (the exec into the proxy ends every thread of this process)."""
        from torch_hooks import handover
        from torch_hooks.spare import EXIT_NO_SPARE

        inc = msg.get("incident") or {}
        why = f"GPU {msg.get('gpu')} failed: {inc.get('summary') or inc.get('code') or 'device fault'}"
        t_ns = time.monotonic_ns()
        kv = self._kv
        e = self.epoch + 1
        reason = None
        rollback = None
        if not self.tracker.modules:
            reason = "no protected module (DDP / fully_shard) whose state a spare could take"
        elif any(k == "fsdp2" for k in self.tracker.module_kinds):
            rollback, reason = self._rollback_step(kv)
        if reason is None and not self.tracker.position()["known"]:
            reason = ("the data position is unknown (no DataLoader over a DistributedSampler, no "
                      "torch_hooks.tracker.set_position): a spare would train on other batches")
        self._handing_over = True
        spare = None if reason else self._claim(kv, why)
        if spare is None:
            reason = reason or "no spare left (start the job with linkpass exec --spares N)"
            kv.compare_set(f"rebuild/{e}/req", "", json.dumps({"rank": self.s.rank, "trigger": "device_fault",
                                                               "reason": why, "handover": {"kind": "none", "rank": self.s.rank,
                                                                                           "reason": reason}}))
            self.exit_fn(EXIT_NO_SPARE, f"rank {self.s.rank}: {why}; {reason}")
            return
        ho = {"kind": "device", "rank": self.s.rank, "spare": spare["id"], "src": None, "t_ns": t_ns}
        if rollback is not None:
            ho.update(rollback, kind="rollback", at_step=self.tracker.boundary_pos.get("steps"))
        # from here this rank's optimizer cannot step (the lock is never given back: the process
        # becomes the proxy), so the replica ends at most one step past this rank's boundary
        if not self._step_held:  # else the controller thread holds it already (_defer_planned)
            self.tracker.step_lock.acquire(timeout=STEP_LOCK_S)
        kv.set(f"handover/{e}/{self.s.rank}", json.dumps(ho))
        got = kv.compare_set(f"rebuild/{e}/req", "", json.dumps({"rank": self.s.rank, "trigger": "device_fault",
                                                                 "reason": why, "handover": ho}))
        if json.loads(got).get("handover") != ho:
            self.exit_fn(EXIT_REBUILD_FAILED, f"rank {self.s.rank}: {why} while rebuild epoch {e} was already under way "
                         "for another reason: two faults at once")
            return
        self._assign(kv, e, spare, self.rail, why)
        if rollback is None:  # a rollback's part has the rank's RNG states at that boundary
            self._leave_rng(kv, e)
        log.error("linkpass: rank %d: %s; spare %s (pid %s) takes the rank over", self.s.rank, why, spare["id"],
                  spare.get("pid"))
        if self.client is not None:
            self.client.report("handover", epoch=e, spare=int(spare["id"]), reason=why[:200])
        handover.become_proxy(int(spare["pid"]), int(spare["id"]))

    def _on_at_risk(self, msg: dict) -> None:
        """The daemon says this rank's GPU is at risk (it still works): move the rank to a spare
        at the next step boundary, with this rank's own live state (the planned hand-over of
        :meth:`_hand_over_planned`: no step lost, sharded ranks too; put off by a step while a
        peer has not completed a collective from before the boundary, :meth:`_defer_planned`),
        or, when that cannot be
        done, report ``at_risk_unmovable`` with why and go on training here (the daemon's alert
        tells operators to drain the node)."""
        v = msg.get("verdict") or {}
        why = f"GPU {msg.get('gpu')} at risk: {v.get('summary') or v.get('rule') or 'its counters'}"
        reason = None
        if self._planned is not None or self._handing_over:
            return  # already moving
        if not self.tracker.modules:
            reason = "no protected module (DDP / fully_shard) whose state a spare could take"
        elif not self.tracker.position()["known"]:
            reason = ("the data position is unknown (no DataLoader over a DistributedSampler, no "
                      "torch_hooks.tracker.set_position): a spare would train on other batches")
        spare = None
        if reason is None:
            try:
                spare = self._claim(self._kv, why)
            except Exception as ex:  # noqa: BLE001 - the store did not answer: stay, say so
                reason = f"the job's store did not answer ({str(ex).splitlines()[0][:160] if str(ex) else ex!r})"
            else:
                if spare is None:
                    reason = "no spare left (start the job with linkpass exec --spares N)"
        if reason is not None:
            log.error("linkpass: rank %d: %s; the rank stays on this GPU: %s", self.s.rank, why, reason)
            if self.client is not None:
                self.client.report("at_risk_unmovable", gpu=msg.get("gpu"), rule=v.get("rule"), reason=reason[:300])
            return
        self._planned = (spare, why)
        log.warning("linkpass: rank %d: %s; moving to spare %s (pid %s) at the next step boundary", self.s.rank, why,
                    spare["id"], spare.get("pid"))
        if self.client is not None:
            self.client.report("at_risk_moving", gpu=msg.get("gpu"), rule=v.get("rule"), spare=int(spare["id"]))
        self.request("at_risk", why)

    def _planned_lag(self, kv, e: int) -> list[tuple[str, int, int, int]]:
        """For a planned hand-over in epoch ``e``: :func:`handover.behind_boundary` of this rank's
        boundary against the other ranks' positions (written before their proposals, so there
        once the agreement is: the wait is for form's sake).  Empty: the spare may resume at
        this rank's boundary.

        Raises:
            RuntimeError: a position did not come within the rebuild timeout (the store's error).
        """
        from torch_hooks import handover

        keys = {r: f"rebuild/{e}/pos/{r}" for r in range(self.s.world_size) if r != self.s.rank}
        kv.wait(list(keys.values()), datetime.timedelta(seconds=self.s.rebuild_timeout_s))
        own = {group_key(i, g): g.boundary_seq for i, g in enumerate(self.groups)}
        return handover.behind_boundary(own, {r: json.loads(kv.get(k)) for r, k in keys.items()})

    def _defer_planned(self, e: int, lag: list[tuple[str, int, int, int]]) -> None:
        """A peer has not completed a collective from before this rank's step boundary (``lag``,
        from :meth:`_planned_lag`): this rank completed it, stepped and went on, and the abort
        came before the peer had all of it.  A spare resuming at the boundary cannot issue it
        again, and would pair the peer's with its own next one.  So in epoch ``e`` the rank
        rebuilds in-process (the caller goes on to do so: it re-issues the collective for the
        peer into scratch outputs; the peers cannot tell this from a spare joining), keeps the
        optimizer step lock so its boundary stays where it is, and asks for the hand-over again
        once a collective at or after its boundary completes here in every lagging group (every
        rank issued it, so every rank completed what came before: :meth:`_poll_held_plan`).
        After :data:`MAX_HANDOVER_DEFERRALS` tries, or no such collective within the rebuild
        timeout, the rank stays on its GPU (``at_risk_unmovable``)."""
        spare, why = self._planned
        tries = (self._held_plan or {}).get("tries", 0) + 1
        what = "; ".join(f"rank {r} has not completed seq {low} of group {k} (this rank's boundary is at seq {b})"
                         for k, r, low, b in lag[:4])
        if tries > MAX_HANDOVER_DEFERRALS:
            self._give_up_plan(f"a peer was still behind this rank's step boundary after {MAX_HANDOVER_DEFERRALS} "
                               f"tries ({what})")
            return
        waits = {k: b for k, _, _, b in lag}
        self._held_plan = {"wait": [(g, waits[group_key(i, g)]) for i, g in enumerate(self.groups)
                                    if group_key(i, g) in waits],
                           "deadline": time.monotonic() + self.s.rebuild_timeout_s, "tries": tries, "asked": False,
                           "why": why}
        # the boundary must not move: the next step's collectives complete, then the optimizer
        # waits here (without the lock, e.g. a step stuck in a collective, the next try checks again)
        self._step_held = self._step_locked
        log.warning("linkpass: rank %d: the hand-over to spare %s waits for the next step's collectives (%s); "
                    "epoch %d rebuilds in-process", self.s.rank, spare["id"], what, e)

    def _poll_held_plan(self) -> None:
        """The controller thread, every :data:`POLL_S` while a hand-over is put off: ask for it
        once every lagging group completed a collective at or after this rank's boundary; give
        it up at the deadline."""
        h = self._held_plan
        if h is None or h["asked"] or self._in_rebuild:
            return
        if all(g.completed_since(seq) for g, seq in h["wait"]):
            h["asked"] = True
            self.request("at_risk", h["why"])
        elif time.monotonic() > h["deadline"]:
            self._give_up_plan(f"no collective after this rank's step boundary completed within "
                               f"{self.s.rebuild_timeout_s:.0f} s while a peer was behind it")

    def _give_up_plan(self, reason: str) -> None:
        """The planned hand-over cannot be done: give the claimed spare back, let the optimizer
        step again, say why (``at_risk_unmovable``); training goes on on this GPU."""
        spare, why = self._planned
        self._planned = self._held_plan = None
        try:
            self._kv.add(f"spares/{spare['id']}/claimed", -1)
        except Exception as ex:  # noqa: BLE001 - it stays claimed: one spare fewer
            log.warning("spare %s not given back: %s", spare["id"], ex)
        if self._step_held:
            self._step_held = False
            if not self._step_locked:  # inside a rebuild, its end lets the lock go
                self.tracker.step_lock.release()
        log.error("linkpass: rank %d: %s; the rank stays on this GPU: %s", self.s.rank, why, reason)
        if self.client is not None:
            self.client.report("at_risk_unmovable", reason=reason[:300])

    def _hand_over_planned(self, e: int, kv) -> None:
        """This rank's GPU is at risk and every rank has stopped at the boundary (rebuild epoch
        ``e``): hand the rank, with its own state, to the spare claimed for it, and become a proxy."""
        from torch_hooks import handover

        spare, why = self._planned
        data = handover.capture_state(self.tracker)
        kv.set(f"handover/{e}/{self.s.rank}", json.dumps({"kind": "planned", "rank": self.s.rank, "spare": spare["id"],
                                                          "src": self.s.rank, "t_ns": time.monotonic_ns()}))
        handover.put_state(kv, e, self.s.rank, data)
        self._handing_over = True
        self._assign(kv, e, spare, self.rail, why)
        log.warning("linkpass: rank %d hands over to spare %s (pid %s), state %d bytes: %s", self.s.rank, spare["id"],
                    spare.get("pid"), len(data), why)
        if self.client is not None:
            self.client.report("handover", epoch=e, spare=int(spare["id"]), reason=why[:200], kind="planned")
            time.sleep(0.01)
        handover.become_proxy(int(spare["pid"]), int(spare["id"]))

    def _rollback_step(self, kv) -> tuple[dict | None, str | None]:
        """For a sharded rank whose device failed: the in-memory snapshot every rank goes back
        to (:mod:`torch_hooks.memsnap`), as ``({"step", "ns", "holder"}, None)``, or
        ``(None, reason)`` when there is none."""
        ms = getattr(self, "memsnap", None)
        base = ("the model is sharded (fully_shard): no other rank holds this rank's shard, so a spare cannot take it "
                "over without a snapshot")
        if ms is None or not ms.mem.enabled:
            return None, f"{base} (in-memory snapshots are off: linkpass exec --snapshot-in-memory); stopping instead " \
                         "of training on wrong state"
        if ms.off_reason:
            return None, f"{base}, and in-memory snapshots are off here ({ms.off_reason})"
        try:
            step = ms.usable_step(kv)
            if step is None:
                return None, (f"{base}, and no in-memory snapshot is complete on every rank yet (one every "
                              f"{ms.mem.every} steps; this rank is at step {self.tracker.steps})")
            holder = memsnap_holder(ms, self.s.rank)
        except Exception as ex:  # noqa: BLE001 - the store is unreachable: no rollback to agree on
            return None, f"{base}; the job's store did not answer ({str(ex).splitlines()[0][:160] if str(ex) else ex!r})"
        return {"step": step, "ns": ms.ns, "holder": holder}, None

    def _roll_back(self, e: int, ho: dict, kv) -> None:
        """A survivor of a sharded rank's device fault: leave the faulty rank's part for its
        spare when this rank holds it, then re-execute this process to replay the script to the
        snapshot's step (:mod:`torch_hooks.memsnap`)."""
        from torch_hooks import handover, memsnap

        ms = getattr(self, "memsnap", None)
        step, ns = int(ho["step"]), int(ho.get("ns") or 0)
        d = ms.dir if ms is not None else memsnap.default_dir(self.s.job, self.s.host)
        try:
            if int(ho["holder"]) == self.s.rank:
                data = memsnap.read_part(memsnap.held_file(d, ns, step, int(ho["rank"])))
                handover.put_state(kv, e, int(ho["rank"]), data)
                log.warning("linkpass: rank %d: rank %d's part of the step-%d snapshot (%d bytes) sent to its spare",
                            self.s.rank, ho["rank"], step, len(data))
            own = memsnap.own_file(d, ns, step, self.s.rank)
            if not own.exists():
                raise FileNotFoundError(f"this rank's part {own} is gone")
        except Exception as ex:  # noqa: BLE001 - one exit path
            self.exit_fn(EXIT_REBUILD_FAILED, f"rank {self.s.rank}: cannot roll back to the in-memory snapshot of step "
                         f"{step}: {str(ex).splitlines()[0][:300] if str(ex) else type(ex).__name__}")
            return
        info = {"epoch": e, "step": step, "ns": ns, "file": str(own), "trigger_t_ns": ho.get("t_ns"),
                "at_step": self.tracker.steps, "failed_rank": ho["rank"], "last_step_ns": self.tracker.last_step_ns}
        pids = [p.pid for p in self.spares if p.poll() is None]
        log.warning("linkpass: rank %d: rank %d's GPU failed; this rank goes back to step %d (it is at step %d): the "
                    "process re-executes itself and replays the script", self.s.rank, ho["rank"], step, self.tracker.steps)
        if self.client is not None:
            self.client.report("rollback", epoch=e, step=step, at_step=self.tracker.steps, failed_rank=ho["rank"])
        if ms is not None:
            ms.close(remove=False)
        env = memsnap.rollback_env(os.environ, info, pids)
        iface = self.s.rails.get(self.rail) if self.rail is not None else None
        if iface:  # the rail the groups use now, which may not be the one the worker started on
            env["GLOO_SOCKET_IFNAME"] = iface
        handover.flush_all()
        os.execve(sys.executable, list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]), env)

    def _leave_rng(self, kv, e: int) -> None:
        """This rank's own RNG states for its spare (:func:`handover.own_rng`), written once the
        survivors stopped at the step the spare resumes at (their positions in the store): when
        the replica finished one step more than this rank's boundary, this rank's training
        thread reaches that optimizer step (held by the step lock) and leaves its state there."""
        from torch_hooks import handover

        resume = None
        try:
            keys = [f"rebuild/{e}/pos/{r}" for r in range(self.s.world_size) if r != self.s.rank]
            kv.wait(keys, datetime.timedelta(seconds=min(self.s.rebuild_timeout_s, handover.RNG_WAIT_S)))
            pos = {int(k.rsplit("/", 1)[1]): json.loads(kv.get(k)) for k in keys}
            resume = int(pos[handover.source_rank(pos)]["steps"])
        except Exception as ex:  # noqa: BLE001 - then whatever this rank has
            log.warning("the survivors' positions were not read (%s); RNG states left as they are", ex)
        deadline = time.monotonic() + STEP_LOCK_S
        while (resume is not None and resume == self.tracker.boundary_pos.get("steps", 0) + 1
               and resume not in self.tracker.rng_pre_step and time.monotonic() < deadline):
            time.sleep(0.005)  # the training thread is finishing that step's backward
        try:
            kv.set(f"handover/{e}/{self.s.rank}/rng", handover.own_rng(self.tracker))
        except Exception as ex:  # noqa: BLE001 - the spare then says it uses the replica's
            log.warning("RNG states not left for the spare: %s", ex)

    def propose_as_spare(self, kv, e: int) -> None:
        """A spare taking over a rank whose device failed: its proposal (no step: it takes a
        replica's state) for the epoch the survivors are rebuilding to."""
        n_rails = list(self.s.rails)
        kv.set(f"rebuild/{e}/prop/{self.s.rank}", json.dumps(agreement.Proposal(step=None, usable=tuple(n_rails),
                                                                                rail=self.rail).to_mapping()))

    def _on_step(self, steps: int) -> None:
        ev = self._after_rebuild
        if ev is not None:
            self._after_rebuild = None
            ev["first_step_t_ns"] = time.monotonic_ns()
            ev["first_step"] = steps


def group_key(i: int, g: Any) -> str:
    """How positions name a process group to other ranks: torch's group name (the same on every
    rank), else its index in creation order."""
    return str(getattr(g, "group_name", "") or i)


def memsnap_holder(ms: Any, rank: int) -> int:
    from torch_hooks import memsnap

    return memsnap.holder_of(rank, ms.hosts(timeout_s=5.0))


#: where the kernel shows netdevs (a test points it at a tree of its own)
SYS_NET = "/sys/class/net"


def netdev_down(netdev: str | None) -> bool:
    """True when ``netdev`` exists here and the kernel says it has no carrier or is down
    (``/sys/class/net/<netdev>/carrier`` is ``0``, or reading it fails with EINVAL as it does on
    an admin-down device; ``operstate`` ``down`` / ``lowerlayerdown``).  False when unknown (no
    such netdev here, no sysfs): the daemon's notice decides then."""
    if not netdev or "/" in netdev:
        return False
    base = os.path.join(SYS_NET, netdev)
    if not os.path.isdir(base):
        return False
    try:
        with open(os.path.join(base, "operstate")) as f:
            if f.read().strip() in ("down", "lowerlayerdown"):
                return True
    except OSError:
        pass
    try:
        with open(os.path.join(base, "carrier")) as f:
            return f.read().strip() == "0"
    except OSError as e:
        return e.errno == errno.EINVAL
    except ValueError:
        return False


def _default_exit(code: int, reason: str) -> None:
    msg = f"linkpass: {reason}; exiting with status {code}"
    if log.hasHandlers():  # else logging's last-resort handler would print the line a second time
        log.error("%s", msg)
    print(msg, file=sys.stderr, flush=True)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001,S110
            pass
    os._exit(code)
