"""The guarded process group: :class:`LinkPassGuard`'s lifecycle (torchft-like), its
collectives, the watch for notices and store requests while they wait, and the step loop that
replays a step after a rebuild.  The other parts of the class live beside it (state, store,
rebuild, migration, exits); the whole story is in :mod:`torch_hooks.guard`."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_hooks import spare as sp
from torch_hooks.client import DaemonClient
from torch_hooks.guard.exits import EXIT_MIGRATE, ExitsMixin, RebuildFailed, _Interrupted
from torch_hooks.guard.migration import MigrationMixin
from torch_hooks.guard.rebuild import RebuildMixin
from torch_hooks.guard.state import StateMixin, _Call
from torch_hooks.guard.store import StoreMixin
from torch_hooks.protocol import Notice, Registration
from torch_hooks.sockets import _shutdown_fds, _socket_fds, _tcp_fds

log = logging.getLogger("linkpass.torch_hooks")


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


class LinkPassGuard(StateMixin, StoreMixin, RebuildMixin, MigrationMixin, ExitsMixin):
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

    def _first_step_done(self) -> None:
        ev, self._awaiting = self._awaiting, None
        now = time.monotonic_ns()
        ev["first_step_t_ns"] = now
        ev["rebuild_ms"] = round((now - ev["notice_t_ns"]) / 1e6, 3)
        log.info("rank %d: first step on process group epoch %d done, %.1f ms after the fault notice", self.rank,
                 ev["epoch"], ev["rebuild_ms"])
        if self.client is not None:
            self.client.report("rebuilt", **{k: v for k, v in ev.items() if k != "event"})
