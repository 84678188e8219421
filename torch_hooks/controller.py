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
   controller thread blocks in a store ``wait`` on that key (server-side, no polling), so a rank
   whose own daemon has not heard of the fault joins within one store round trip;
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
from torch_hooks.protocol import Notice, Registration

log = logging.getLogger("linkpass.torch_hooks.controller")

#: exit statuses, shared with the explicit API (torch_hooks.guard) and the spares
EXIT_MIGRATE = 75
EXIT_REBUILD_FAILED = 76

#: the most rebuilds in :data:`RATE_WINDOW_S` before the controller stops rebuilding (a fault
#: that comes back at once is not a link fault a rebuild can fix)
MAX_REBUILDS = 8
RATE_WINDOW_S = 60.0

#: how long one store wait for a rebuild request lasts before the controller thread checks
#: whether it should stop (the request itself wakes it at once: the store notifies waiters)
WAIT_S = 0.25


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


class Controller:
    """Owns the process's resilient groups; see the module docstring.

    Args:
        settings: :class:`Settings`.
        tracker: the :class:`torch_hooks.tracker.Tracker` (the step for proposals, the first step
            after a rebuild for timings).
        on_latched: ``fn(reason, decision) -> None`` when a latched group cannot move (the
            hand-over to a spare); default: exit :data:`EXIT_MIGRATE`.
        exit_fn: the one exit path (code, reason): report, flush, exit.
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
        self.exit_fn = exit_fn or _default_exit
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
        return dist.PrefixStore(f"linkpass/{self.s.job}/", st)

    def start(self, g: Any | None = None) -> None:
        self._kv = self._store(g)
        self._kv_wait = self._store(g)
        self._kv.set(f"host/{self.s.rank}", self.s.host)
        self.client = DaemonClient(self._registration(), socket_path=self.s.hooks_socket, on_notice=self._on_notice)
        self.client.start()
        self._thread = threading.Thread(target=self._run, name="linkpass-controller", daemon=True)
        self._thread.start()

    def _registration(self) -> Registration:
        return Registration(job=self.s.job, rank=self.s.rank, world_size=self.s.world_size, peers=self.peers,
                            local_rank=self.s.local_rank, rail=self.rail,
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
            t.join(2 * WAIT_S + 1.0)

    # ---------------------------------------------------------------- triggers

    def _on_notice(self, n: Notice) -> None:
        if not n.affects(self.rail):
            return
        self.request("notice", f"daemon notice generation {n.generation}: rails {sorted(n.affected_rails)} broken"
                     f"{' (' + n.reason + ')' if n.reason else ''}", abort=True)

    def _on_group_fault(self, g: Any, err: BaseException) -> None:
        self.request("collective_error", f"{g.group_name or 'group'}: {str(err).splitlines()[0][:200] if str(err) else err!r}")

    def request(self, trigger: str, reason: str, abort: bool = False) -> None:
        """Ask for a job-wide rebuild (any thread; returns at once).  ``abort``: abort this
        process's groups now, so pending collectives stop within milliseconds."""
        with self._lock:
            if self._pending is None:
                self._pending = (trigger, reason, time.monotonic_ns())
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
        while not self._stop.is_set():
            e = self.epoch + 1
            key = f"rebuild/{e}/req"
            try:
                self._kv_wait.wait([key], datetime.timedelta(seconds=WAIT_S))
            except Exception as ex:  # noqa: BLE001 - a timeout (the usual case) or a store error
                if "timeout" not in str(ex).lower() and "wait timeout" not in str(ex).lower():
                    if self._stop.wait(0.2):
                        return
                with self._lock:
                    pending = self._pending
                if pending is not None:  # our request could not be written: try again
                    try:
                        self._kv_wait.compare_set(key, "", json.dumps({"rank": self.s.rank, "trigger": pending[0],
                                                                       "reason": pending[1][:300]}))
                    except Exception:  # noqa: BLE001,S110
                        pass
                continue
            if self._stop.is_set():
                return
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
        self._rebuild_times = [t for t in self._rebuild_times if t > time.monotonic() - RATE_WINDOW_S] + [time.monotonic()]
        if len(self._rebuild_times) > MAX_REBUILDS:
            self.exit_fn(EXIT_REBUILD_FAILED, f"{len(self._rebuild_times)} rebuilds within {RATE_WINDOW_S:.0f} s "
                         f"(last: {req.get('reason')}): the fault is not one a rebuild fixes")
            return
        prop = self._proposal()
        kv = self._kv_wait
        kv.set(f"rebuild/{e}/prop/{self.s.rank}", json.dumps(prop.to_mapping()))
        keys = [f"rebuild/{e}/prop/{r}" for r in range(self.s.world_size)]
        try:
            kv.wait(keys, datetime.timedelta(seconds=self.s.rebuild_timeout_s))
        except Exception as ex:  # noqa: BLE001
            missing = [r for r, k in enumerate(keys) if not kv.check([k])]
            raise RuntimeError(f"ranks {missing} did not join rebuild epoch {e} within {self.s.rebuild_timeout_s:.0f} s "
                               f"({str(ex).splitlines()[0][:120]})") from None
        props = {r: agreement.Proposal.from_mapping(json.loads(kv.get(k))) for r, k in enumerate(keys)}
        t_agree = time.monotonic_ns()
        rails = list(self.s.rails)
        if rails:
            d = agreement.decide(props, rails, self.rail, keep_current=True, max_step_lag=1)
        else:  # no rail map: rebuild where the group was
            d = agreement.Decision("ok", min(p.step for p in props.values() if p.step is not None), None, "no rail map")
        if not d.ok:
            self.exit_fn(EXIT_MIGRATE if d.outcome == "no_rail" else EXIT_REBUILD_FAILED,
                         f"rebuild epoch {e}: {d.reason}")
            return
        iface = self.s.rails.get(d.rail) if d.rail is not None else None
        from torch_hooks.pg import LatchedInterfaceError

        results = []
        try:
            for g in list(self.groups):
                results.append(g.rebuild(e, interface=iface, timeout=datetime.timedelta(seconds=self.s.rebuild_timeout_s)))
        except LatchedInterfaceError as ex:
            reason = str(ex)
            if self.on_latched is not None:
                self.on_latched(reason, d)
                return
            self.exit_fn(EXIT_MIGRATE, reason)
            return
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

    def _on_step(self, steps: int) -> None:
        ev = self._after_rebuild
        if ev is not None:
            self._after_rebuild = None
            ev["first_step_t_ns"] = time.monotonic_ns()
            ev["first_step"] = steps


def _default_exit(code: int, reason: str) -> None:
    msg = f"linkpass: {reason}; exiting with status {code}"
    log.error("%s", msg)
    print(msg, file=sys.stderr, flush=True)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001,S110
            pass
    os._exit(code)
