"""LinkPassGuard: keep a data-parallel job training when the rail under its process group dies.

The lifecycle follows torchft's reconfigurable process group (``ProcessGroup.configure(store,
rank, world_size)`` builds a fresh group for a new store prefix, ``abort()`` drops the old one,
``errored()`` says whether an async error happened; torchft/process_group.py)::

    import torch.distributed as dist
    from torch_hooks.guard import LinkPassGuard

    # the store must live outside the ranks (torchrun's agent hosts it; or a store process like
    # ``python -m linkpass.lab.demo_train --store-only``): a rank hosting it cannot be migrated (the
    # store would die with it), so only then can every rank move to a spare
    store = dist.TCPStore(master_addr, port, world_size, is_master=False)
    guard = LinkPassGuard(store, rank, world_size, rails={0: "rail0", 1: "rail1"}, rail=0,
                          state=[model, opt], job="llm7", peers=["gpu-node-08"])

    def train_step(step):                       # the user's step, unchanged except that its
        opt.zero_grad()                         # collectives go through the guard
        loss = loss_fn(model(batch(step)))
        loss.backward()
        guard.all_reduce(flat_grads)            # instead of dist.all_reduce(flat_grads)
        opt.step()
        return loss

    for step in range(steps):
        loss = guard.step(train_step, step)     # never raises for a link fault it handled
    guard.close()

What happens on a link fault (a daemon notice, :mod:`torch_hooks.client`, whose affected
rails include the rail of the current process group):

1. **abort at once**: the collective in flight is abandoned (collectives are issued with
   ``async_op`` semantics and waited in a loop that also watches notices, so nobody waits for
   the process group timeout).  Gloo has no working abort for an operation blocked on a dead
   peer: ``ProcessGroupGloo.abort()`` returns but the pending work stays blocked until the
   timeout (measured with torch 2.13, see tests/unit/test_torch_hooks_guard.py), and its
   destructor joins the worker threads, so it would block too.  The guard therefore also
   ``shutdown(SHUT_RDWR)``s the TCP sockets the group opened (recorded when it was built), which
   makes gloo fail the pending work with "Connection closed" within milliseconds.
2. **agree**: every rank must rebuild, including those whose own daemon has not heard of the
   fault yet.  The rank that saw the notice writes ``rebuild/<epoch>/req`` in the store;
   every rank checks that key while it waits on a collective (every ``store_check_s``) and
   after a collective error.  Each rank then writes the step it was in and the rails it may
   use (its daemon's ``usable_common``); all ranks read all proposals and compute the same
   answer: resume at the lowest step (a rank may be one step ahead: it finished a collective
   whose last message never reached its peer), on the first rail of ``rails`` usable by every
   rank (the current one if still usable).
3. **rebuild**: a new process group for epoch N with its own store prefix
   (``PrefixStore("linkpass/<job>/gen<N>", store)``), same ranks, the gloo device bound to the
   chosen rail's interface (``ProcessGroupGloo.create_device(interface=...)``, the same thing
   ``GLOO_SOCKET_IFNAME`` selects).  Daemon plan generations are per host, so the group's
   generation is the job-wide rebuild epoch; notices' generations are reported alongside.
4. **replay**: the model/optimizer state (``state``: objects with ``state_dict`` /
   ``load_state_dict``) and torch's CPU RNG state are restored to what they were before the
   step to replay, the step is run again, and training continues.  Bitwise the same result as
   without the fault when the step is deterministic (same data for the same step index, same
   reduction order: same ranks, same algorithm).

It reports what it did to the daemon (``report``: ``rebuilt``, ``unmovable``) and logs it
(logger ``linkpass.torch_hooks``); :attr:`events` keeps the record (timings in ms on the
monotonic clock).

**Where it cannot move in-process** (``backend="nccl"``): NCCL reads its HCA list once per
process and never rescans (NCCL-REFERENCE.md 1.7: the ``ncclNIbDevs`` guard in
``src/transport/net_ib/init.cc`` is never reset), so a new communicator in the same process
would use the dead HCA again.  Unless NCCL's own port failover is configured
(``NCCL_IB_RESILIENCY_PORT_FAILOVER=1``, NCCL >= 2.29.7, which then handles the fault inside
its fused NIC and the guard leaves it alone; ``linkpass nccl-env``/``exec`` set it only when a
listed NIC has a second healthy port on the same card, and the guard ignores it when
``NCCL_IB_HCA`` names a single port, see :func:`nccl_port_failover`), the guard aborts the communicator
(``ProcessGroupNCCL.abort()`` -> ``ncclCommAbort``), reports ``unmovable`` to the daemon, logs
why, and exits the process with status :data:`EXIT_MIGRATE` (75, ``EX_TEMPFAIL`` in
sysexits.h: "try again later") for the launcher to restart the rank elsewhere (rank migration
is a later issue).  The other ranks learn it through the store and exit with the same status.
The same happens when no rail is usable by every rank.

Requirements and limits:

* the store must be reachable over a network the fault does not cut (the rendezvous store
  normally lives on the front-end network);
* the step must start from the restored state: it computes gradients from zero, and reads its
  data by step index (or from a loader whose position is part of ``state``);
* one snapshot of ``state`` per step (a clone of every tensor): fine for the demo's MLP, costly
  for large models (there, snapshot on GPU or rely on a checkpoint instead);
* every rank must call :meth:`step` the same number of times, with the same collectives.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_hooks import agreement
from torch_hooks import spare as sp
from torch_hooks.client import DaemonClient
from torch_hooks.protocol import Notice, Registration
# the gloo socket shutdown lives in torch_hooks.sockets (shared with torch_hooks.pg); the old
# names stay importable from here
from torch_hooks.sockets import _shutdown_fds, _socket_fds, _tcp_fds  # noqa: F401

log = logging.getLogger("linkpass.torch_hooks")

#: Exit status when the rank cannot continue in this process (EX_TEMPFAIL): a launcher should
#: start it again (elsewhere, once rank migration exists).
EXIT_MIGRATE = 75
#: Exit status when the ranks could not agree on or build a new process group within
#: ``rebuild_timeout_s`` (a rank that died for good, a fault on the spare, a second fault during
#: a migration): 76, ``EX_PROTOCOL`` in sysexits.h.  Distinct from 75 (move the rank), 74 (this
#: rank was fenced) and 69 (no spare left).
EXIT_REBUILD_FAILED = 76


def nccl_port_failover(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether NCCL's own IB port failover can handle a dead port for this process:
    ``(True, "")`` or ``(False, why)``.

    True only when ``NCCL_IB_RESILIENCY_PORT_FAILOVER`` is ``1`` and ``NCCL_IB_HCA`` does not
    rule failover out.  ``linkpass nccl-env`` / ``linkpass exec`` export the variable only when a
    listed NIC has a second healthy port on the same card (failover acts only inside such a
    fused NIC, NVIDIA/nccl#2192), so its presence means "checked, it can work".  A value set by
    hand is trusted too, except when ``NCCL_IB_HCA`` names exactly one port (``=mlx5_0:1``):
    one port can never be fused, so the guard keeps its abort + exit 75.
    """
    if environ.get("NCCL_IB_RESILIENCY_PORT_FAILOVER", "").strip() != "1":
        return False, "NCCL_IB_RESILIENCY_PORT_FAILOVER is not 1"
    hca = environ.get("NCCL_IB_HCA", "").strip()
    if hca and not hca.startswith("^"):
        entries = [e.strip() for e in hca.lstrip("=").split(",") if e.strip()]
        if len(entries) == 1 and ":" in entries[0]:
            return False, (f"NCCL_IB_HCA={hca} names one port, and NCCL's port failover needs a second port of the "
                           "same NIC (NVIDIA/nccl#2192)")
    return True, ""


class LinkPassExit(SystemExit):
    """Raised (with ``on_unmovable="raise"``) instead of exiting with :data:`EXIT_MIGRATE`;
    ``code`` is 75 and ``reason`` says why, so an uncaught one still exits with 75."""

    def __init__(self, reason: str, code: int = EXIT_MIGRATE):
        super().__init__(code)
        self.reason = reason


class RebuildFailed(RuntimeError):
    """The ranks could not agree on or build a new process group (store timeout, connect
    failure, a rank more than one step ahead); the message says which."""


class _Interrupted(BaseException):
    """Unwinds the user's step when its process group must be dropped.  A BaseException, so a
    step's ``except Exception`` does not swallow it; it never leaves :meth:`LinkPassGuard.step`."""

    def __init__(self, trigger: str, reason: str, t_ns: int, notice: Notice | None = None):
        super().__init__(reason)
        self.trigger, self.reason, self.t_ns, self.notice = trigger, reason, t_ns, notice
        self.migration: dict | None = None


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


class LinkPassGuard:
    """The abortable, rebuildable process group around a training step.

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (TCPStore on the front-end
            network); the guard uses keys under ``linkpass/<job>/``.
        rank, world_size: this process's rank and the group size.
        rails: rail id -> network interface for the gloo device (``{0: "rail0", 1: "rail1"}``),
            in order of preference; None as interface means gloo's default device.
        rail: the rail of the first process group.
        state: objects with ``state_dict()``/``load_state_dict()`` (model, optimizer, a
            scheduler...) restored before a step is replayed.
        job: job id (store prefix, daemon registration).
        peers: daemon host names of the other ranks' hosts (for the daemon's probes and for
            which notices concern this rank).
        backend: ``"gloo"`` (rebuilt in-process) or ``"nccl"`` (exits with 75, see above).
        timeout: the process group's own timeout (gloo: per operation and for connecting).
        rebuild_timeout_s: how long to wait for every rank's proposal in the store.
        hooks_socket: the daemon's hooks socket (default: see :mod:`torch_hooks.client`);
            ``connect=False`` runs without a daemon (only store requests and errors then).
        local_rank, gpu: for the registration.
        on_unmovable: ``"exit"`` (``os._exit(75)`` after logging and reporting) or ``"raise"``
            (:class:`LinkPassExit`).
        error_grace_s: after a collective error, how long to look for a rebuild request from
            another rank before re-raising the error as not a link fault.
        poll_s, store_check_s: how often a waiting collective checks notices / the store.

    Raises:
        ValueError: ``rail`` not in ``rails``, bad backend.
        RuntimeError: the first process group could not be built (torch's error).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, rails: Mapping[int, str | None], rail: int,
                 state: Sequence[Any] = (), job: str = "job", peers: Sequence[str] = (), backend: str = "gloo",
                 timeout: datetime.timedelta = datetime.timedelta(seconds=30), rebuild_timeout_s: float = 30.0,
                 hooks_socket: str | None = None, connect: bool = True, local_rank: int | None = None,
                 gpu: int | None = None, on_unmovable: str = "exit", error_grace_s: float = 5.0,
                 poll_s: float = 0.005, store_check_s: float = 0.02, join: "sp.Assignment | None" = None,
                 host: str | None = None):
        if rail not in rails:
            raise ValueError(f"rail {rail} is not in rails {dict(rails)}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if on_unmovable not in ("exit", "raise"):
            raise ValueError("on_unmovable must be 'exit' or 'raise'")
        self.base_store = store
        self.kv = dist.PrefixStore(f"linkpass/{job}", store)
        self._store, self._job = store, job
        self._kept_stores: list[Any] = []
        self.rank, self.world_size = rank, world_size
        self.rails = dict(rails)
        self.state = list(state)
        self.job, self.peers, self.backend = job, tuple(peers), backend
        self.timeout = timeout
        self.rebuild_timeout_s = rebuild_timeout_s
        self.on_unmovable = on_unmovable
        self.error_grace_s = error_grace_s
        self.poll_s, self.store_check_s = poll_s, store_check_s
        self.local_rank, self.gpu = local_rank, gpu
        self.nccl_port_failover = False
        if backend == "nccl":
            self.nccl_port_failover, why = nccl_port_failover(os.environ)
            if not self.nccl_port_failover and os.environ.get("NCCL_IB_RESILIENCY_PORT_FAILOVER"):
                log.warning("NCCL_IB_RESILIENCY_PORT_FAILOVER is set but cannot act (%s): a dead rail aborts and exits %d",
                            why, EXIT_MIGRATE)
        self.pg: Any = None
        self.epoch = -1
        self.rail = rail
        self.step_index = 0
        self.events: list[dict] = []
        self._error: BaseException | None = None
        self._graveyard: list[Any] = []
        self._pg_fds: list[tuple[int, str]] = []
        self._prev: _Call | None = None
        self._awaiting: dict | None = None
        self._wake = threading.Event()
        self._seen = 0
        self._ignored_gen: tuple[str, int] | None = None
        self.host = host or sp.host_name()
        self._sync: dict | None = None
        self._fault_lock = threading.Lock()
        # set (client thread) before this rank hands itself to a spare: from then on the main
        # thread must never write a proposal or build a group (see _fence_point)
        self._fencing = threading.Event()
        self.client: DaemonClient | None = None
        if connect:
            self.client = DaemonClient(self._registration(), hooks_socket, on_notice=self._on_notice,
                                       on_device_fault=self._on_device_fault).start()
        if join is None:
            self.configure(0, rail)
        else:
            try:
                self._join(join)
            except RebuildFailed as e:
                self._rebuild_failed(e)

    # ---------------------------------------------------------------- lifecycle (torchft-like)

    def _registration(self) -> Registration:
        return Registration(job=self.job, rank=self.rank, world_size=self.world_size, peers=self.peers,
                            local_rank=self.local_rank, gpu=self.gpu, rail=self.rail,
                            netdev=self.rails.get(self.rail), backend=self.backend)

    def configure(self, epoch: int, rail: int) -> None:
        """Build the process group of ``epoch`` on ``rail`` (aborting any current one first).

        Blocks until every rank has built it (gloo connects the full mesh here).

        Raises:
            RuntimeError: torch could not build it within ``timeout`` (its message).
        """
        self._fence_point("configure")
        if self.pg is not None:
            self.abort()
        store = dist.PrefixStore(f"linkpass/{self.job}/gen{epoch}", self.base_store)
        before = _socket_fds()
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            iface = self.rails[rail]
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                             else dist.ProcessGroupGloo.create_default_device()]
            opts._timeout = self.timeout
            opts._threads = 2
            pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        else:  # pragma: no cover - needs a GPU
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        self._pg_fds = _tcp_fds(before, _socket_fds(), self._store_ports()) if self.backend == "gloo" else []
        self.pg, self.epoch, self.rail = pg, epoch, rail
        self._error = None
        if self.client is not None and epoch > 0:
            self.client.update(self._registration())
        log.info("process group epoch %d built on rail %d (%s), rank %d of %d", epoch, rail, self.rails[rail] or "default",
                 self.rank, self.world_size)

    def abort(self) -> None:
        """Drop the current process group at once: ``abort()`` it and shut its sockets down so
        a collective blocked on it fails now, not at the timeout.  Never raises."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        try:
            pg.abort()
        except Exception as e:  # not every backend/version has it
            log.debug("abort(): %s", e)
        n = _shutdown_fds(self._pg_fds)
        self._pg_fds = []
        self._graveyard.append(pg)  # its destructor joins gloo's threads: keep it until they are free
        log.info("process group epoch %d aborted (%d sockets shut down)", self.epoch, n)

    def errored(self) -> BaseException | None:
        """The error of the last failed collective on the current group, or None."""
        return self._error

    def close(self) -> None:
        """Stop the daemon client; the process group is left to the interpreter."""
        if self.client is not None:
            self.client.close()

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of ``tensor`` (any shape/dtype gloo supports) on the current
        group; returns ``tensor``.  Only inside :meth:`step`."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._wait(self.pg.allreduce([tensor], opts))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In-place broadcast from rank ``src``; returns ``tensor``.  Only inside :meth:`step`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._wait(self.pg.broadcast([tensor], opts))
        return tensor

    def barrier(self) -> None:
        """A barrier on the current group.  Only inside :meth:`step`."""
        self._wait(self.pg.barrier(dist.BarrierOptions()))

    def _on_notice(self, n: Notice) -> None:
        self._wake.set()

    def _wait(self, work) -> None:
        done = threading.Event()
        self._wake = done
        work.get_future().add_done_callback(lambda _f: done.set())
        started = time.monotonic()
        next_store = started + self.store_check_s
        while True:
            woke = done.wait(self.poll_s)
            if work.is_completed():
                break
            if woke:  # a notice, not the work
                done.clear()
            now = time.monotonic()
            check_store = now >= next_store
            if check_store:
                next_store = now + self.store_check_s
            self._check(check_store)
        try:
            work.wait()
        except Exception as e:
            self._error = e
            self._after_error(e)

    def _check(self, store: bool) -> None:
        """Raise _Interrupted when a notice breaks our rail or another rank asked to rebuild."""
        self._fence_point("check")
        c = self.client
        if c is not None and c.notices_seen != self._seen:
            self._seen = c.notices_seen
            n = c.latest
            if n is not None and n.affects(self.rail):
                if self.nccl_port_failover:
                    log.warning("notice generation %d: rail %d broken; NCCL port failover is configured, leaving it to NCCL",
                                n.generation, self.rail)
                else:
                    raise _Interrupted("notice", f"daemon notice generation {n.generation}: rails {sorted(n.affected_rails)} "
                                       f"broken ({n.reason})", n.received_ns, n)
            elif n is not None and (n.instance, n.generation) != self._ignored_gen:
                self._ignored_gen = (n.instance, n.generation)
                log.info("notice generation %d does not affect rail %d (broken rails: %s); no rebuild",
                         n.generation, self.rail, sorted(n.affected_rails) or "none")
        if store:
            try:
                asked = self.kv.check([f"rebuild/{self.epoch + 1}/req"])
            except Exception as e:  # the store itself is unreachable: nothing to learn from it now
                log.debug("store check failed: %s", e)
                asked = False
            if asked:
                raise _Interrupted("peer", f"rank {self._req_rank(self.epoch + 1)} asked for a rebuild", time.monotonic_ns())
            mig = sp.read_migration(self.kv, self.epoch + 1)
            if mig is not None:
                it = _Interrupted("migrate", f"rank {mig.get('rank')} lost its device and moves to spare {mig.get('spare')}",
                                  time.monotonic_ns())
                it.migration = mig
                raise it

    def _req_rank(self, epoch: int) -> str:
        try:
            return str(json.loads(self.kv.get(f"rebuild/{epoch}/req"))["rank"])
        except Exception:
            return "?"

    def _after_error(self, e: BaseException) -> None:
        """A collective failed: a rebuild another rank started, a notice, or a real error."""
        t_err = time.monotonic_ns()
        log.warning("collective on process group epoch %d failed: %s", self.epoch, str(e).splitlines()[0][:200])
        deadline = time.monotonic() + self.error_grace_s
        while time.monotonic() < deadline:
            self._check(True)
            time.sleep(self.store_check_s)
        if self.client is not None and self.client.latest is not None and self.client.latest.affects(self.rail):
            raise _Interrupted("error", f"collective failed and rail {self.rail} is broken", t_err, self.client.latest)
        raise e

    # ---------------------------------------------------------------- the step

    def step(self, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` (one training step using the guard's collectives) and
        return its result; on a link fault, rebuild and replay as described in the module
        docstring.

        Raises:
            RebuildFailed: with ``on_unmovable="raise"``: no agreement or no new process group
                (store or connect timeout).  With ``"exit"`` the process logs why, reports
                ``rebuild_failed`` and exits with :data:`EXIT_REBUILD_FAILED` instead: it never
                hangs and never leaves a traceback for a fault it could not handle.
            LinkPassExit: with ``on_unmovable="raise"``, when the rank cannot move in-process.
            Anything ``fn`` raises that is not a handled link fault.
        """
        try:
            return self._step(fn, *args, **kwargs)
        except RebuildFailed as e:
            self._rebuild_failed(e)

    def _rebuild_failed(self, e: BaseException, from_thread: bool = False):
        """Log why, report ``rebuild_failed``, then raise ``e`` (``on_unmovable="raise"``, main
        thread) or exit :data:`EXIT_REBUILD_FAILED`."""
        why = (f"linkpass: REBUILD FAILED: {e}. The job cannot go on in-process; this rank exits "
               f"with status {EXIT_REBUILD_FAILED} so the launcher can restart the job.")
        log.error("%s", why)
        if self.on_unmovable == "raise" and not from_thread:
            raise e
        print(why, file=sys.stderr, flush=True)
        if self.client is not None:
            try:
                self.client.report("rebuild_failed", reason=str(e)[:500], exit_code=EXIT_REBUILD_FAILED)
                time.sleep(0.02)
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        self._flush_logs()
        os._exit(EXIT_REBUILD_FAILED)

    def _step(self, fn: Callable, *args, **kwargs):
        cur = _Call(self.step_index, fn, args, kwargs, self._snapshot())
        queue = [cur]
        replay = False
        result = None
        while queue:
            call = queue[0]
            try:
                if replay:
                    self._restore(call.snapshot)
                self._check(False)
                out = call.fn(*call.args, **call.kwargs)
            except _Interrupted as it:
                resume = self._rebuild(it, call.index)
                if resume == cur.index:
                    queue = [cur]
                elif resume == cur.index - 1 and self._prev is not None:
                    queue = [self._prev, cur]
                else:
                    raise RebuildFailed(f"ranks disagree by more than one step (resume at {resume}, this rank at {cur.index})") from None
                if self._sync is not None:
                    self._send_state(queue[0].snapshot)
                replay = True
                continue
            queue.pop(0)
            if call is cur:
                result = out
            if self._awaiting is not None:
                self._first_step_done()
        self._prev = cur
        self.step_index += 1
        return result

    def _snapshot(self):
        return [_clone(o.state_dict()) for o in self.state], torch.get_rng_state()

    def _restore(self, snap) -> None:
        states, rng = snap
        for o, sd in zip(self.state, states):
            o.load_state_dict(_clone(sd))  # a fresh copy: load_state_dict may keep references
        torch.set_rng_state(rng)

    def _usable_view(self, it: _Interrupted) -> list[int]:
        """Rails this rank may use, by its daemon's newest notice (all of ``rails`` without one)."""
        n = self.client.latest if self.client is not None else None
        if n is None:
            view = list(self.rails)
        else:
            view = [r for r in self.rails if r in n.usable_common or (r not in n.rails)]
        if it.trigger == "notice" and it.notice is not None:
            view = [r for r in view if r not in it.notice.affected_rails]
        return view

    def _rebuild(self, it: _Interrupted, in_step: int) -> int:
        e = self.epoch + 1
        self._fence_point("rebuild")
        log.warning("rank %d: %s; abandoning process group epoch %d (rail %d) in step %d", self.rank, it.reason,
                    self.epoch, self.rail, in_step)
        rail_from = self.rail
        unmovable = self.backend != "gloo"
        req_key = f"rebuild/{e}/req"

        def ask() -> bool:
            # ask the others first (they find the request as soon as their collective fails), then abort
            if not self.kv.check([req_key]):
                self.kv.set(req_key, json.dumps({"rank": self.rank, "reason": it.reason, "unmovable": unmovable}))
                return False
            try:
                return bool(json.loads(self.kv.get(req_key)).get("unmovable"))
            except ValueError:
                return False

        try:
            unmovable = self._store_retry(f"rebuild epoch {e}", ask, time.monotonic() + self.rebuild_timeout_s) or unmovable
        except Exception as ex:
            raise RebuildFailed(f"the job's store is unreachable, rebuild epoch {e} cannot be agreed: {ex}") from None
        self.abort()
        t_abort = time.monotonic_ns()
        mig = it.migration or sp.read_migration(self.kv, e)
        if mig is None and it.trigger == "error":  # the faulty rank writes its request before it exits
            mig = sp.read_migration(self.kv, e)
        if mig is not None and mig.get("spare") is None:
            self._no_spare(f"rank {mig.get('rank')} lost its device ({mig.get('reason')}) and no spare worker is left")
        if unmovable:
            self._unmovable(f"{it.reason}; the {self.backend} communicator cannot move to another NIC in this process "
                            "(NCCL reads its HCA list once per process)" if self.backend != "gloo"
                            else f"{it.reason}; another rank cannot move in-process")
        view = self._usable_view(it)
        keep = it.trigger == "error" or mig is not None  # a migration keeps the rail when every rank can use it
        resume, new_rail, t_agree = self._agree(e, in_step, view, rail_from, keep, it.reason)
        t_built = time.monotonic_ns()
        if mig is not None:
            src = min(r for r in range(self.world_size) if r != mig["rank"])
            self._sync = {"src": src, "rank": mig["rank"], "spare": mig.get("spare")}
        n = it.notice
        ev = {"event": "rebuilt", "epoch": e, "trigger": it.trigger, "reason": it.reason, "rail_from": rail_from,
              "rail_to": new_rail, "interrupted_step": in_step, "resume_step": resume,
              "notice_generation": None if n is None else n.generation, "notice_t_ns": it.t_ns,
              "aborted_t_ns": t_abort, "agreed_t_ns": t_agree, "built_t_ns": t_built,
              "abort_ms": round((t_abort - it.t_ns) / 1e6, 3), "agree_ms": round((t_agree - t_abort) / 1e6, 3),
              "build_ms": round((t_built - t_agree) / 1e6, 3)}
        if mig is not None:
            ev.update(migrated_rank=mig["rank"], spare=mig.get("spare"), state_from=self._sync["src"])
        self.events.append(ev)
        self._awaiting = ev
        log.warning("rank %d: process group epoch %d on rail %d (was %d); replaying from step %d", self.rank, e, new_rail,
                    rail_from, resume)
        return resume

    def _agree(self, e: int, in_step: int, view: list[int], rail_from: int, keep_rail: bool, reason: str,
               rank: int | None = None) -> tuple[int, int, int]:
        """Write this rank's proposal for epoch ``e``, read everyone's, build the group: returns
        ``(resume step, rail, agreed t_ns)``.  Raises RebuildFailed on a store or connect timeout."""
        rank = self.rank if rank is None else rank
        self._fence_point("agree")
        deadline = time.monotonic() + self.rebuild_timeout_s
        mine = json.dumps({"step": in_step, "usable": view, "rail": rail_from})
        keys = [f"rebuild/{e}/rank/{r}" for r in range(self.world_size)]

        def exchange():
            # a store connection that breaks here is replaced (_store_retry) and the exchange
            # repeated: setting the same proposal twice is harmless
            self.kv.set(f"rebuild/{e}/rank/{rank}", mine)
            left = max(0.001, deadline - time.monotonic())
            self.kv.wait(keys, datetime.timedelta(seconds=left))
            return [json.loads(self.kv.get(k)) for k in keys]

        try:
            props = self._store_retry(f"rebuild epoch {e}", exchange, deadline)
        except Exception as ex:
            raise RebuildFailed(f"not every rank joined rebuild epoch {e} within {self.rebuild_timeout_s} s: {ex}") from None
        t_agree = time.monotonic_ns()
        try:
            d = agreement.decide({r: agreement.Proposal.from_mapping(p) for r, p in enumerate(props)}, list(self.rails),
                                 rail_from, keep_current=keep_rail)
        except ValueError as ex:
            raise RebuildFailed(f"rebuild epoch {e}: a bad proposal in the store: {ex}") from None
        if d.outcome == "no_rail":
            self._unmovable(f"{reason}; {d.reason} (proposals {props})")
        if not d.ok:
            raise RebuildFailed(f"rebuild epoch {e} cannot complete: {d.reason}")
        log.info("rank %d: rebuild epoch %d agreed: %s", self.rank, e, d.reason)
        resume, new_rail = d.resume_step, d.rail
        try:
            self.configure(e, new_rail)
        except Exception as ex:
            raise RebuildFailed(f"could not build process group epoch {e} on rail {new_rail}: {ex}") from None
        return resume, new_rail, t_agree

    # ---------------------------------------------------------------- rank migration (torch_hooks.spare)

    def _store_ports(self) -> frozenset[int]:
        ports = {getattr(st, "port", None) for st in [self._store, *self._kept_stores] if isinstance(st, dist.TCPStore)}
        return frozenset(p for p in ports if p)

    @staticmethod
    def _connection_error(ex: BaseException) -> bool:
        """A broken store connection (reconnect and retry), not a timeout (give up)."""
        if isinstance(ex, dist.DistStoreError) or "timeout" in str(ex).lower():
            return False
        return isinstance(ex, (dist.DistNetworkError, ConnectionError, OSError)) or any(
            t in str(ex) for t in ("Broken pipe", "Connection reset", "Failed to recv", "Connection refused"))

    def _reconnect_store(self, deadline: float) -> bool:
        """Replace ``base_store``/``kv`` (the agreement's and the gloo rendezvous' handles) with a
        fresh client connection to the same TCPStore; True when it worked.  The old handle is
        kept (it may host the store's server)."""
        st = self._store
        if not isinstance(st, dist.TCPStore):
            return False
        left = max(1.0, min(10.0, deadline - time.monotonic()))
        try:
            new = dist.TCPStore(st.host, st.port, is_master=False, timeout=datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - the store itself is gone
            log.warning("rank %d: could not reconnect to the job's store %s:%d: %s", self.rank, st.host, st.port,
                        str(e).splitlines()[0][:200])
            return False
        self._kept_stores.append(st)
        self.base_store = self._store = new
        self.kv = dist.PrefixStore(f"linkpass/{self._job}", new)
        log.warning("rank %d: the job's store connection broke; reconnected to %s:%d", self.rank, st.host, st.port)
        return True

    def _store_retry(self, what: str, fn: Callable, deadline: float):
        """``fn()`` (store operations on ``self.kv``); after a connection error (not a timeout)
        reconnect and call it again until ``deadline`` (monotonic s)."""
        while True:
            try:
                return fn()
            except Exception as ex:
                if not self._connection_error(ex) or time.monotonic() >= deadline:
                    raise
                log.warning("rank %d: store connection failed in %s: %s", self.rank, what, str(ex).splitlines()[0][:200])
                if not self._reconnect_store(deadline):
                    time.sleep(0.2)

    def _own_kv(self):
        """A second client connection to the job's store (TCPStore), under the same prefix; the
        shared one when the store is not a TCPStore."""
        st = self._store
        if isinstance(st, dist.TCPStore):
            try:
                own = dist.TCPStore(st.host, st.port, is_master=False, timeout=datetime.timedelta(seconds=3))
                return dist.PrefixStore(f"linkpass/{self._job}", own)
            except Exception as e:  # noqa: BLE001 - fall back to the shared connection
                log.warning("second store connection failed (%s); using the shared one", e)
        return self.kv

    def _on_device_fault(self, msg: dict) -> None:
        """The daemon says this process's GPU failed (client thread): hand the rank to a spare
        through the store and exit at once (fenced).  With no spare left: say so and exit
        :data:`torch_hooks.spare.EXIT_NO_SPARE` (the other ranks find the request and do the same)."""
        gpu = msg.get("gpu")
        if gpu is None:
            # a device fault naming no GPU would move every rank of the node at once: not ours
            # to act on (the daemon should not send one; an operator decides)
            inc = msg.get("incident") or {}
            log.warning("device fault without a GPU (%s on %s); no rank migrates for it", inc.get("code"), inc.get("device"))
            return
        if self.gpu is not None and gpu != self.gpu:
            log.info("device fault on GPU %s is not ours (GPU %s); ignored", gpu, self.gpu)
            return
        if not self._fault_lock.acquire(blocking=False):
            return  # already handing over
        # before anything is in the store: the main thread may find our own migration request
        # (it checks the store while it waits on a collective) and would then propose for the
        # new epoch and build its group as rank r, racing the spare that takes r over (gloo
        # then connects rank 0 to this dying process: "Connection closed", exit 76)
        self._fencing.set()
        inc = msg.get("incident") or {}
        reason = f"{inc.get('code')} on {inc.get('device')} ({inc.get('domain')}, action {inc.get('action')}): {inc.get('summary') or ''}"
        e_next = self.epoch + 1
        try:
            # this runs on the client thread while the main thread may be inside a store call:
            # a TCPStore client is one socket and not safe to share between threads, so the
            # request goes over a connection of its own
            own = self._own_kv()
            a = sp.request_migration(own, epoch=e_next, rank=self.rank, world_size=self.world_size,
                                     step=self.step_index, rail=self.rail, reason=reason, host=self.host)
        except sp.MigrationConflict as c:
            # two devices failed at once: one rank moves per epoch.  Tell the others (a failed
            # proposal ends their agreement at once) and stop the job: 76
            try:
                own.set(f"rebuild/{e_next}/rank/{self.rank}",
                        json.dumps({"step": None, "usable": [], "failed": f"rank {self.rank} lost its device too ({reason})"
                                    f" while rank {c.holder} migrates"}))
            except Exception:  # noqa: BLE001,S110 - the others then time out (76 as well)
                pass
            self._rebuild_failed(RebuildFailed(f"rank {self.rank} lost its device ({reason}) while {c}"), from_thread=True)
        except Exception as e:
            self._rebuild_failed(RebuildFailed(
                f"rank {self.rank} lost its device ({reason}) but the job's store is unreachable, so no spare can take "
                f"it over ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"), from_thread=True)
        if a is None:
            self._no_spare(f"rank {self.rank} lost its device ({reason}) and no spare worker is left", from_thread=True)
        msg_txt = (f"linkpass: rank {self.rank} lost its device ({reason}); spare {a.spare} takes rank {self.rank} over "
                   f"in process group epoch {a.epoch}; this process is fenced and exits with status {sp.EXIT_FENCED}")
        log.error("%s", msg_txt)
        print(msg_txt, file=sys.stderr, flush=True)
        if self.client is not None:
            self.client.report("migrating", reason=reason[:500], spare=a.spare, epoch=a.epoch, exit_code=sp.EXIT_FENCED)
            time.sleep(0.02)
        self._flush_logs()
        os._exit(sp.EXIT_FENCED)

    def _fence_point(self, where: str) -> None:
        """Stop the main thread here for good once this rank is handing itself to a spare
        (``_fencing``): the client thread exits the process within milliseconds.  If it has not
        after 30 s, exit :data:`torch_hooks.spare.EXIT_FENCED` from here."""
        if not self._fencing.is_set():
            return
        log.info("rank %d: fenced (device fault), main thread stops in %s", self.rank, where)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
        self._flush_logs()
        os._exit(sp.EXIT_FENCED)

    def _no_spare(self, reason: str, from_thread: bool = False):
        msg = (f"linkpass: NO SPARE LEFT: {reason}. The job cannot continue; every rank exits with status "
               f"{sp.EXIT_NO_SPARE}.")
        log.error("%s", msg)
        print(msg, file=sys.stderr, flush=True)
        if self.client is not None:
            self.client.report("no_spare", reason=reason[:500], exit_code=sp.EXIT_NO_SPARE)
            time.sleep(0.02)
        if self.on_unmovable == "raise" and not from_thread:
            raise LinkPassExit(reason, sp.EXIT_NO_SPARE)
        self._flush_logs()
        os._exit(sp.EXIT_NO_SPARE)

    @staticmethod
    def _flush_logs() -> None:
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass

    def _bcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Broadcast a byte string from ``src`` on the current group (gloo timeout bounds it)."""
        n = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([n], opts).wait()
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None and self.rank == src
               else torch.empty(int(n.item()), dtype=torch.uint8))
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.pg.broadcast([buf], opts).wait()
        return buf.numpy().tobytes()

    def _send_state(self, snapshot) -> None:
        """After a migration rebuild: the state of the step to replay goes from a healthy
        replica (``src``) to every rank (the spare loads it; the others already hold it)."""
        import io

        sync, self._sync = self._sync, None
        t0 = time.monotonic_ns()
        data = None
        if self.rank == sync["src"]:
            buf = io.BytesIO()
            torch.save({"states": snapshot[0], "rng": snapshot[1]}, buf)
            data = buf.getvalue()
        try:
            got = self._bcast_bytes(data, sync["src"])
        except Exception as ex:
            raise RebuildFailed(f"could not send the state to spare {sync.get('spare')} (rank {sync['rank']}): {ex}") from None
        if self.events:
            self.events[-1].update(state_bytes=len(got), state_ms=round((time.monotonic_ns() - t0) / 1e6, 3))

    def _join(self, a: "sp.Assignment") -> None:
        """A spare takes rank ``a.rank`` over: fence the faulty process, join the agreement of
        epoch ``a.epoch`` in its place, build the group, receive the state from a healthy replica."""
        import io

        t0 = time.monotonic_ns()
        fenced = sp.fence(a, self.host)
        log.warning("spare %d takes rank %d of %d over (epoch %d, step %d); faulty pid %d on %s: %s", a.spare, a.rank,
                    a.world_size, a.epoch, a.step, a.pid, a.host, fenced)
        self.rank, self.step_index = a.rank, a.step
        # no step of its own: the spare takes the state (and so the step) of a healthy replica;
        # the faulty rank's last step may lag the others' (it ran on while asking for a spare)
        resume, rail, t_agree = self._agree(a.epoch, None, list(self.rails), a.rail, True, a.reason)
        t_built = time.monotonic_ns()
        src = min(r for r in range(self.world_size) if r != a.rank)
        try:
            got = self._bcast_bytes(None, src)
        except Exception as ex:
            raise RebuildFailed(f"spare {a.spare}: no state from rank {src}: {ex}") from None
        snap = torch.load(io.BytesIO(got), weights_only=False)
        self._restore((snap["states"], snap["rng"]))
        self.step_index = resume
        t_state = time.monotonic_ns()
        ev = {"event": "joined", "epoch": a.epoch, "trigger": "migrate", "reason": a.reason, "rail_from": a.rail,
              "rail_to": rail, "interrupted_step": a.step, "resume_step": resume, "spare": a.spare, "fenced": fenced,
              "notice_t_ns": t0, "agreed_t_ns": t_agree, "built_t_ns": t_built, "state_t_ns": t_state,
              "agree_ms": round((t_agree - t0) / 1e6, 3), "build_ms": round((t_built - t_agree) / 1e6, 3),
              "state_ms": round((t_state - t_built) / 1e6, 3), "state_bytes": len(got)}
        self.events.append(ev)
        self._awaiting = ev

    def _first_step_done(self) -> None:
        ev, self._awaiting = self._awaiting, None
        now = time.monotonic_ns()
        ev["first_step_t_ns"] = now
        ev["rebuild_ms"] = round((now - ev["notice_t_ns"]) / 1e6, 3)
        log.info("rank %d: first step on process group epoch %d done, %.1f ms after the fault notice", self.rank,
                 ev["epoch"], ev["rebuild_ms"])
        if self.client is not None:
            self.client.report("rebuilt", **{k: v for k, v in ev.items() if k != "event"})

    def _unmovable(self, reason: str):
        msg = (f"linkpass: rank {self.rank} cannot continue in this process: {reason}. "
               f"Exiting with status {EXIT_MIGRATE} so the launcher can restart it.")
        log.error("%s", msg)
        print(msg, file=sys.stderr, flush=True)
        if self.client is not None:
            self.client.report("unmovable", reason=reason[:500], exit_code=EXIT_MIGRATE)
            time.sleep(0.05)  # let the report leave before the process does
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:
                pass
        if self.on_unmovable == "raise":
            raise LinkPassExit(reason)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(EXIT_MIGRATE)
