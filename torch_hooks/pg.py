"""A resilient process group for unmodified DDP / FSDP2 scripts: abort, rebuild, re-issue.

Every group a script gets from ``torch.distributed.init_process_group`` / ``new_group`` becomes a
:class:`ResilientProcessGroup` wrapping the real backend (the *inner* group: ``ProcessGroupGloo``
now, ``ProcessGroupNCCL`` with the same code later).  DDP's reducer (``allreduce``, and
``broadcast``/``allgather`` when it is built) and FSDP2 (``all_gather_single``,
``reduce_scatter_single``, ``allreduce``) call the wrapper exactly as they call a backend; the
script never knows.  When a rail dies, whoever watches the daemon (the bootstrap; a test here)
calls :meth:`ResilientProcessGroup.abort` (pending work on the inner group fails within
milliseconds) and :meth:`ResilientProcessGroup.rebuild` (a fresh inner group under a new
generation prefix, on another interface if asked); the collectives that were in flight are
issued again on it and the caller's ``Work`` completes with the right result.  Nothing is
skipped: 0 steps lost.

How it plugs in (torch 2.13; the internals relied on are listed at the end)::

    import torch_hooks.pg as lp
    lp.install()                        # before the script runs (what ``linkpass exec`` injects)
    dist.init_process_group("gloo")     # the script, unchanged: gets backend "linkpass_gloo"

:func:`install` registers the backends ``linkpass_gloo`` and ``linkpass_nccl`` with
``Backend.register_backend(name, creator, extended_api=True, devices=...)`` and replaces
``init_process_group`` and ``new_group`` (in ``torch.distributed``, in
``torch.distributed.distributed_c10d`` and in any already imported ``torch.*`` module that bound
the same function) with thin wrappers that only rename the ``backend`` argument: ``"gloo"`` ->
``"linkpass_gloo"``, ``"nccl"`` -> ``"linkpass_nccl"``, None -> the one for this machine's
accelerator.  Why this way:

* the public functions and their ``backend`` argument are documented API; patching a private
  helper (``_new_process_group_helper``) would break with its signature;
* ``new_group(backend=None)``, which DDP, FSDP2 and DeviceMesh use, inherits the default group's
  backend name from torch's group map, so every subgroup is protected without more patching;
* the names carry no ``:`` (torch parses ``"cpu:gloo,cuda:nccl"`` as a device map), and the
  creator returns a ``torch.distributed.ProcessGroup`` subclass, which
  ``_new_process_group_helper`` uses as the group itself (the path torchft's
  ``ProcessGroup._register`` and torch's own ``threaded`` test backend take).

What is not wrapped gets one log line naming it and runs as without linkpass: a device map
(``"cpu:gloo,cuda:nccl"``), a third-party backend, ``LINKPASS_HOOK=0``.

**Re-issue.**  Every protected collective gets a sequence number (the same on every rank: the
ranks run the same program, SPMD).  The wrapper keeps, per collective, what it needs to issue it
again: the caller's tensors and options, and a copy of the inputs the collective overwrites
(``allreduce``, ``allreduce_coalesced``, and any op whose input shares storage with its
output), taken before it is issued.  Once an op completes locally, a copy of its other inputs
is taken too (before the caller sees the result): a peer may not have completed it (its last
message was lost), and then this rank must take part again with the same inputs, into scratch
outputs.  :meth:`~ResilientProcessGroup.rebuild` exchanges, over the store, each rank's lowest
collective it has not completed; every rank issues again, in order, every collective from the
lowest of those on (completed ones into scratch outputs, the others into the caller's tensors
after restoring the in-place inputs), then the ones the script issued while the group was down.
The same inputs, ranks and algorithm give bitwise the same result.

**Memory.**  In flight: one copy of each in-place input (DDP: the gradient buckets being
all-reduced; peak = the gradient size, in the gradient's dtype and on its device).  Retained:
the copies of completed collectives until no peer can need them.  A copy is released when a
collective issued after a later step boundary completes locally (that proves every rank issued
it, so every rank finished its previous step, whose collectives it had waited for: DDP waits for
all buckets before ``backward()`` returns; FSDP2 for its reduce-scatters before the optimizer
step).  Step boundaries come from a ``torch.optim`` step post-hook that :func:`install`
registers, or :meth:`~ResilientProcessGroup.mark_step`.  So the steady cost is about one step's
collective inputs: for DDP about 1x the gradient bytes (reported by
:meth:`~ResilientProcessGroup.stats`, ``retained_bytes``).  Without step boundaries (a custom
optimizer) the copies are capped at ``retain_limit_bytes`` (oldest dropped first, one warning);
a rebuild that would need a dropped one fails with :class:`RebuildError` naming it, never a
silent wrong result.

**Errors.**  An inner collective that fails while the group was not aborted: with no fault
listener (nobody will rebuild) the error goes to the caller at once, as without linkpass.  With
listeners (:meth:`~ResilientProcessGroup.add_fault_listener`; the bootstrap's controller) the
collective is parked, later ones are queued, the listeners are told, and if no rebuild starts
within ``error_grace_s`` every parked collective fails with its own error: never a hang.

**Latched mode** (``latched=True``; default for NCCL): NCCL reads its HCA list once per process
and never rescans (shared/NCCL-REFERENCE.md 1.7, ``ncclNIbDevs`` guard in
``src/transport/net_ib/init.cc``), so an in-process rebuild can only use the interface the
process started with.  A latched wrapper refuses a rebuild onto another interface with
:class:`LatchedInterfaceError` (the rank must hand over to a spare process); a rebuild on the
same interface (a peer moved) is allowed.  The gloo wrapper in latched mode behaves the same, so
tests and the demo run the code NCCL takes.

**Aborting gloo.**  ``ProcessGroupGloo.abort()`` does not unblock pending work in torch 2.13
(tests/unit/test_torch_hooks_guard.py); :mod:`torch_hooks.sockets` shuts the group's TCP sockets
down, which makes pending receives fail at once.  A collective blocked in gloo's ``waitSend``
is not woken by either (seen here with gdb: ``gloo::transport::tcp::UnboundBuffer::waitSend``
under ``gloo::ring``, in about one abort out of three in the tests); :meth:`rebuild` waits
``abandon_s`` (default 2 s) for the old collectives to fail, then abandons the ones still
blocked (they can write nothing more: nothing arrives on a dead socket) and leaks the old
group, whose destructor would join the blocked thread.  That wait is the recovery time in that
case.  NCCL: ``ProcessGroupNCCL.abort()`` (``ncclCommAbort``).  Not run on a GPU yet.

**Not protected** (passed to the inner group, not re-issued; they fail on a fault like without
linkpass): point-to-point (``send``/``recv``), ``reduce``, ``gather``, ``scatter``,
``alltoall``, and anything that gets the
backend from ``_get_backend()`` and calls it directly (functional collectives, DTensor's
dispatcher ops).  Each logs one line the first time.

Design sources (read, not copied): torchft/process_group.py (``ProcessGroupWrapper``: a Python
``ProcessGroup`` that forwards every collective to a reconfigurable inner group;
``configure(store_addr, ...)`` builds a fresh inner group per store prefix; ``abort``;
``ErrorSwallowingProcessGroupWrapper``/``ManagedProcessGroup``: errors are reported to the
Manager and the caller gets a dummy result, so the step is skipped and redone after the quorum;
here the collective itself is re-issued instead), torchft/manager.py (quorum, then
``configure`` with a new prefix per quorum id), torch/distributed/distributed_c10d.py 2.13
(``Backend.register_backend``, ``_new_process_group_helper``).

torch internals relied on (2.13): ``Backend.register_backend(..., extended_api=True)`` calling
``creator(_DistributedBackendOptions, backend_options)`` with ``.store``, ``.group_rank``,
``.group_size``, ``.timeout``, ``.group_id``, ``.global_ranks_in_group``; a returned
``ProcessGroup`` subclass being used as the group; pybind trampolines (``PyProcessGroup``,
``PyWork``) dispatching C++ calls (DDP's reducer) to the Python methods ``allreduce``,
``broadcast``, ``allgather``, ``barrier`` and to ``Work.wait``/``get_future``; the Python
collective API calling ``all_gather_single``/``reduce_scatter_single`` (2.13 names; older:
``_allgather_base``/``_reduce_scatter_base``, also defined); ``ProcessGroup._device_types``
read from Python; ``PrefixStore.underlying_store``; gloo's ``_allgather_base`` /
``_reduce_scatter_base`` Works not implementing ``get_future`` (a waiter thread waits for them).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from torch_hooks.sockets import _shutdown_fds, _socket_fds, _tcp_fds

log = logging.getLogger("linkpass.torch_hooks.pg")
_RED_OP_TYPE = getattr(dist.ReduceOp, "RedOpType", dist.ReduceOp)

#: Registered backend names are this prefix + the inner backend.
PREFIX = "linkpass_"
#: Inner backends the wrapper can hold, and the devices each supports (as torch registers them).
INNER_DEVICES = {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]}
#: Default for ``error_grace_s`` (s): how long a failed collective waits for a rebuild.
DEFAULT_ERROR_GRACE_S = 30.0
#: Default cap on retained input copies when no step boundary is ever marked (bytes).
DEFAULT_RETAIN_LIMIT_BYTES = 2 << 30
#: Default for ``abandon_s`` (s): old collectives normally fail within milliseconds of the abort.
DEFAULT_ABANDON_S = 2.0
#: How long a joining spare waits for the other ranks' lowest unfinished collectives (s); they
#: write them before they wait for its own (:meth:`ResilientProcessGroup._join`).
JOIN_LOWS_WAIT_S = 60.0
#: How long :meth:`ResilientProcessGroup.shutdown` waits, in all, for this group's own threads
#: (waiters, grace timers) to end (s); they normally end within microseconds.
SHUTDOWN_JOIN_S = 10.0


class LatchedInterfaceError(RuntimeError):
    """A latched group was asked to rebuild onto another interface (see module docstring)."""


class RebuildError(RuntimeError):
    """A rebuild could not complete (store exchange, connect, a needed input copy gone, old work
    still running); the group stays down with its collectives parked, so the caller can try the
    next generation or :meth:`ResilientProcessGroup.fail_parked`."""


_READY, _BROKEN, _REBUILDING, _CLOSED = "ready", "broken", "rebuilding", "closed"


@dataclass(eq=False)
class _Op:
    """One protected collective.  ``call(inner)`` issues it into the caller's tensors,
    ``scratch(inner, saved)`` from the retained input copies into throwaway outputs."""

    kind: str
    call: Callable[[Any], Any]
    scratch: Callable[[Any, list], Any]
    inputs: list            # the caller's tensors the collective reads
    inplace: bool           # the collective overwrites (some of) its inputs: copy before issuing
    result: Any             # the value of the caller's future
    seq: int = -1
    epoch: int = 0
    state: str = "queued"   # queued | in_flight | done | failed
    attempt: int = 0
    gen: int = -1
    saved: list | None = None
    error: BaseException | None = None
    future: Any = None
    settled: threading.Event = field(default_factory=threading.Event)   # the current attempt finished
    delivered: threading.Event = field(default_factory=threading.Event)  # the caller's future is set

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved or ())


def restart_attempt(environ: Any = None) -> int:
    """The worker group's attempt under torchrun: ``TORCHELASTIC_RESTART_COUNT`` (0 for the first
    attempt, for any other launcher, and for a value that is not a non-negative integer)."""
    raw = (os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        n = int(raw or 0)
    except ValueError:
        return 0
    return max(n, 0)


def attempt_store(store: Any, environ: Any = None) -> Any:
    """``store`` for this attempt's keys: unchanged on attempt 0, else under
    ``PrefixStore("linkpass/attempt<N>/", store)``.

    torchrun's c10d rendezvous keeps one TCPStore across restarts of the worker group
    (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, the shared TCP store, unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so without this a restarted rank can read keys of
    the dead attempt (its gloo addresses, its rebuild and snapshot agreements)."""
    n = restart_attempt(environ)
    return dist.PrefixStore(f"linkpass/attempt{n}/", store) if n else store


def job_store(store: Any, job: str, environ: Any = None) -> Any:
    """The job's own keys in the job's store: ``PrefixStore("linkpass/<job>", attempt_store(store))``
    (the controller's rebuild agreement, spares, snapshots, in-memory copies)."""
    return dist.PrefixStore(f"linkpass/{job}", attempt_store(store, environ))


def peers_behind(lows: dict[int, int], low: int) -> dict[int, int]:
    """The entries of ``lows`` (rank -> its lowest unfinished collective, a sequence number)
    below ``low``: the ranks that still need a collective that a rank resuming at ``low`` will
    not issue again."""
    return {r: v for r, v in lows.items() if v < low}


def _copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _overlaps(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether any tensor of ``a`` shares storage with any of ``b`` (an in-place collective)."""
    def span(t):
        s = t.untyped_storage()
        return s.data_ptr(), s.data_ptr() + s.nbytes()
    sb = [span(t) for t in b if t.numel()]
    for t in a:
        if not t.numel():
            continue
        lo, hi = span(t)
        if any(lo < h and l2 < hi for l2, h in sb):
            return True
    return False


def _flat(lists) -> list[torch.Tensor]:
    return [t for lst in lists for t in lst]


class _Work(dist.Work):
    """The caller's handle on one protected collective: completes when the collective has
    completed on some generation of the inner group (after any re-issue)."""

    def __init__(self, op: _Op):
        super().__init__()
        self._op = op

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the collective completed; True.  Raises its error (after the grace, see
        the module docstring), or RuntimeError when ``timeout`` (a positive timedelta) passes."""
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        if secs > 0 and not self._op.delivered.wait(secs):
            raise RuntimeError(f"linkpass: {self._op.kind} (seq {self._op.seq}) timed out after {secs} s")
        self._op.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._op.future

    def is_completed(self) -> bool:
        return self._op.future.done()

    def is_success(self) -> bool:
        return self._op.future.done() and self._op.error is None and self._op.state == "done"

    def exception(self):
        return None if self._op.state == "done" else self._op.error

    def result(self) -> list:
        r = self._op.result
        return list(r) if isinstance(r, (list, tuple)) else [r]

    def synchronize(self) -> None:
        pass


class _AllWork(dist.Work):
    """Several protected collectives as one ``Work`` (the coalesced forms)."""

    def __init__(self, works: list[_Work], result: list):
        super().__init__()
        self._works, self._result = works, result
        self._future = torch.futures.collect_all([w.get_future() for w in works]).then(lambda f: self._value(f))

    def _value(self, fut):
        for f in fut.value():
            f.value()  # raises the first error
        return self._result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self._works:
            w.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def result(self) -> list:
        return list(self._result)

    def synchronize(self) -> None:
        pass


class ResilientProcessGroup(dist.ProcessGroup):
    """A process group whose collectives survive the loss of the inner group's network path.

    Args:
        store: the group's store (the creator gets ``PrefixStore("<group>/<device>/", default
            store)``); inner groups live under ``PrefixStore("linkpass/gen<N>/", store)``.
        rank, world_size: this process's rank in the group and the group size.
        inner: ``"gloo"`` or ``"nccl"``.
        timeout: the inner group's timeout (gloo: per operation and for connecting).
        interface: the gloo device's interface (comma list allowed, as ``GLOO_SOCKET_IFNAME``);
            None: ``GLOO_SOCKET_IFNAME`` or gloo's default device, as torch would pick.
        latched: refuse in-process rebuilds onto another interface (default: True for NCCL,
            ``LINKPASS_LATCHED=1`` for gloo).
        error_grace_s: how long a failed collective waits for a rebuild when fault listeners
            are attached (s).
        retain_limit_bytes: the cap on retained input copies (bytes), see "Memory".
        abandon_s: how long :meth:`rebuild` waits for the old group's collectives to fail after
            the abort before it abandons them (s; see :meth:`_abandon`).
        group_name, global_ranks: torch's group name and the group's global ranks (for logs).
        backend_options: ``ProcessGroupNCCL.Options`` for an NCCL inner group.

    Raises:
        ValueError: an unknown ``inner``.
        RuntimeError: the first inner group could not be built (torch's error).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, inner: str = "gloo",
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30), interface: str | None = None,
                 latched: bool | None = None, error_grace_s: float = DEFAULT_ERROR_GRACE_S,
                 retain_limit_bytes: int = DEFAULT_RETAIN_LIMIT_BYTES, abandon_s: float = DEFAULT_ABANDON_S,
                 group_name: str = "",
                 global_ranks: Sequence[int] = (), backend_options: Any = None):
        if inner not in INNER_DEVICES:
            raise ValueError(f"inner backend must be one of {sorted(INNER_DEVICES)}, got {inner!r}")
        super().__init__(rank, world_size)
        # torchrun (c10d rendezvous, torch >= 2.4) keeps one TCPStore for every restart of the
        # worker group (dynamic_rendezvous.py: the shared TCP store), so the keys of a dead
        # attempt are still there: a restarted rank would read the dead ranks' gloo addresses
        # (``connectFullMesh failed ... Connection refused``).  Each attempt gets its own keys.
        self._store = attempt_store(store)
        self._rank, self._size = rank, world_size
        self.inner_backend = inner
        self.timeout = timeout
        self.latched = (inner == "nccl" or os.environ.get("LINKPASS_LATCHED") == "1") if latched is None else bool(latched)
        self.error_grace_s = float(error_grace_s)
        self.retain_limit_bytes = int(retain_limit_bytes)
        self.abandon_s = float(abandon_s)
        self._gname, self._global_ranks = group_name, list(global_ranks)
        self._backend_options = backend_options
        self.interface = interface if interface is not None else (
            os.environ.get("GLOO_SOCKET_IFNAME") or None if inner == "gloo" else
            os.environ.get("NCCL_IB_HCA") or os.environ.get("NCCL_SOCKET_IFNAME") or None)
        self._issue_lock = threading.RLock()   # seq order of issue (held while issuing on the inner group)
        self._lock = threading.Lock()          # state, ops (never held while calling into torch)
        self._state = _READY
        self._gen = -1
        self._inner: Any = None
        self._fds: list[tuple[int, str]] = []
        self._graveyard: list[Any] = []        # old inner groups: their destructors join gloo threads
        self._ops: dict[int, _Op] = {}
        self._bytes = 0                        # bytes of the input copies the ops in _ops hold
        self._gave_up = False                  # aborted, and no rebuild within the grace: fail new work
        self._no_park = False                  # a grace passed with no rebuild: errors go to the caller at once
        self._next_seq = 0
        self._epoch = 0
        self._dropped_upto = -1                # highest seq whose copy the byte cap dropped
        self._done_hi = -1                     # highest seq completed here on an inner group (not scratch)
        self._warned: set[str] = set()
        self._fault_listeners: list[Callable] = []
        self._issue_listeners: list[Callable] = []
        self._grace_token = 0
        # generation -> the queue of its waiter thread, for works without a future; one per
        # generation, so an old collective gloo leaves blocked (see _abandon) delays nothing new
        self._waitqs: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []   # waiters and grace timers: shutdown joins them
        self._stuck_gens: set[int] = set()            # generations with abandoned work (its waiter may never end)
        self._stats = {"rebuilds": 0, "reissued": 0, "reissued_scratch": 0, "parked": 0, "aborts": 0}
        self.events: list[dict] = []
        if inner == "gloo" and os.environ.get("TORCH_GLOO_LAZY_INIT") == "1":
            log.warning("linkpass: TORCH_GLOO_LAZY_INIT=1: gloo connects at the first collective, so abort() cannot find "
                        "and shut down the group's sockets; a fault then waits for the gloo timeout")
        self._virtual = False                  # a joining spare replaying the script: see join_hook
        self._boundary_seq = 0                 # _next_seq at the last step boundary
        join = _join_hook[0]
        if join is None:
            self._build(0, "linkpass/gen0", interface)  # None: exactly what torch would build
        else:
            self._join(join, interface)
        _LIVE.add(self)

    # ---------------------------------------------------------------- torch's ProcessGroup surface

    def getBackendName(self) -> str:
        return PREFIX + self.inner_backend

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    # torch keeps a group's name and description in its C++ backends, which this Python group
    # has none of (``ProcessGroup name not set``); DeviceMesh and FSDP2 read them from Python
    def _set_group_name(self, name: str) -> None:
        self._gname = str(name)

    @property
    def group_name(self) -> str:
        return self._gname

    def _set_group_desc(self, desc: str) -> None:
        self._gdesc = str(desc)

    @property
    def group_desc(self) -> str:
        return getattr(self, "_gdesc", "undefined")

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in INNER_DEVICES[self.inner_backend]]

    def _get_backend(self, device=None):
        """The current inner backend.  Work issued on it directly is not protected."""
        self._warn_once("_get_backend", "code took the inner backend with _get_backend(); what it issues there "
                        "is not re-issued on a rebuild")
        return self._inner

    @property
    def generation(self) -> int:
        """The generation of the current inner group (0 at start, then what :meth:`rebuild` got)."""
        return self._gen

    @property
    def inner(self) -> Any:
        """The current inner group (``ProcessGroupGloo``/``ProcessGroupNCCL``)."""
        return self._inner

    def shutdown(self) -> None:
        """Close the wrapper (``destroy_process_group``, and at interpreter exit): cancel the
        grace timers, shut the inner groups down and destroy them now.

        Destroying them here, not at interpreter finalization, matters: their destructors join
        gloo's worker threads, which may still be finishing a completion callback (Python code:
        ours, then DDP's); a thread that needs the GIL once the interpreter is finalizing is
        ended with ``pthread_exit`` through C++ frames and the process aborts ("terminate
        called without an active exception", seen in the tests).  Leaked groups (see
        :meth:`_abandon`) are left alone.

        The same holds for this group's own threads, so they are ended and joined here (at most
        ``SHUTDOWN_JOIN_S`` in all): a waiter thread (see :meth:`_watch`) that got its stop
        sentinel drops its last gloo ``Work`` when its frame is cleared, and pybind releases the
        GIL to destroy it (``IntrusivePtrNoGilDestructor``); if the main thread reached
        interpreter finalization meanwhile, the waiter's ``~gil_scoped_release`` cannot take the
        GIL back, is ended by ``pthread_exit`` inside that noexcept destructor, and the process
        aborts (gdb, FSDP2 fault-free, about 1 exit in 15 before this join).  A waiter of a
        generation with abandoned work may be blocked in gloo until the old group's timeout: it
        is not waited for.  Idempotent."""
        with self._lock:
            self._state = _CLOSED
            self._grace_token += 1
            inner, self._inner, self._fds = self._inner, None, []
            old = [g for g in self._graveyard if not any(g is o for o in _LEAKED)]
            self._graveyard = [g for g in self._graveyard if any(g is o for o in _LEAKED)]
            qs, self._waitqs = dict(self._waitqs), {}
            threads, self._threads = self._threads, []
            stuck = set(self._stuck_gens)
        for t in threads:
            if isinstance(t, threading.Timer):
                t.cancel()
        for q in qs.values():
            q.put(None)
        try:
            if inner is not None and hasattr(inner, "shutdown"):
                inner.shutdown()
        except Exception as e:  # noqa: BLE001 - closing anyway
            log.debug("inner shutdown: %s", e)
        deadline = time.monotonic() + SHUTDOWN_JOIN_S
        me = threading.current_thread()
        for t in threads:
            if t is me or t.ident is None or getattr(t, "_linkpass_gen", None) in stuck:
                continue
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("group %s: thread %s still running %.0f s after shutdown", self._gname or "?", t.name,
                            SHUTDOWN_JOIN_S)
        del inner, old  # the last references: the destructors run now (torch releases the GIL for them)
        _LIVE.discard(self)

    # ---------------------------------------------------------------- listeners, stats, steps

    def add_fault_listener(self, fn: Callable[["ResilientProcessGroup", BaseException], None]) -> None:
        """``fn(group, error)`` is called (on a torch/gloo thread: hand off, never block) the first
        time an inner collective fails while the group was not aborted.  With a listener attached,
        failed collectives park for ``error_grace_s`` instead of failing at once."""
        self._fault_listeners.append(fn)

    def add_issue_listener(self, fn: Callable[["ResilientProcessGroup", int, str], None]) -> None:
        """``fn(group, seq, kind)`` after each protected collective is issued for the first time
        (on the issuing thread, with the issue lock held: it may call :meth:`abort`, never
        :meth:`rebuild`).  For tests and tracing."""
        self._issue_listeners.append(fn)

    def mark_step(self) -> None:
        """A step boundary: the collectives issued before it were all waited for (see "Memory")."""
        with self._lock:
            self._epoch += 1
            self._boundary_seq = self._next_seq

    @property
    def boundary_seq(self) -> int:
        """The sequence number of the first collective after the last step boundary."""
        return self._boundary_seq

    def completed_since(self, seq: int) -> bool:
        """Whether a collective numbered ``seq`` or later has completed here on an inner group
        (issued again for a peer into scratch outputs, or completed locally in a spare's replay,
        does not count).  Every rank then issued it; after a step boundary, that means every
        rank finished the collectives before it (the rule the release of input copies rests on,
        see "Memory")."""
        with self._lock:
            return self._done_hi >= seq

    # ---------------------------------------------------------------- a spare taking a rank over

    def _join(self, join: Callable, interface: str | None) -> None:
        """Join the job's current generation as a spare that takes this rank over.

        ``join(self) -> (generation, low)``: the generation the other ranks are rebuilding to and
        the sequence number of the first collective this rank will issue for real (the first
        collective after the step boundary of the state it takes over).  The rank tells the
        others ``low`` as its lowest unfinished collective (so they issue again from there, the
        ones they completed into scratch outputs), builds the inner group with them, and
        completes every collective locally until :meth:`go_live` (it is replaying the script's
        control flow up to the rank's position; see torch_hooks/handover.py).

        Then it reads the other ranks' lows (waiting up to :data:`JOIN_LOWS_WAIT_S`): a rank
        whose low is below ``low`` still needs a collective the state taken over has already
        used, which this process cannot issue; the other ranks would re-issue it and pair it
        with this rank's ``low``, and every later collective with the next one (silently wrong
        results).  Then, or when the lows are not there in time, ``_join_hook[1](reason)`` is
        called (the spare's one exit path; it does not return), or without one
        :class:`RebuildError` is raised."""
        gen, low = join(self)
        prefix = f"linkpass/gen{gen}"
        st = dist.PrefixStore(prefix.rstrip("/") + "/", self._store)
        st.set(f"reissue/{self._rank}", json.dumps({"low": low}))
        self._virtual = True
        self._build(gen, prefix, interface)
        others = [r for r in range(self._size) if r != self._rank]
        try:
            # the others write theirs before they wait for this rank's, so this wait ends (gloo
            # cannot even connect before: they build only after reading every low)
            st.wait([f"reissue/{r}" for r in others], datetime.timedelta(seconds=JOIN_LOWS_WAIT_S))
            lows = {r: int(json.loads(st.get(f"reissue/{r}"))["low"]) for r in others}
        except Exception as e:  # noqa: BLE001 - one failure path, below
            why = (f"the other ranks' lowest unfinished collectives were not in the store within {JOIN_LOWS_WAIT_S:g} s "
                   f"({str(e).splitlines()[0][:160] if str(e) else type(e).__name__})")
        else:
            behind, every = peers_behind(lows, low), {**lows, self._rank: low}
            why = (f"rank(s) {sorted(behind)} of group {self._gname or '?'} have not completed collective seq "
                   f"{min(behind.values())}, which the state taken over had already completed (it resumes at seq {low}; "
                   f"lowest unfinished seq per rank: {every}): every later collective would pair with the next one, "
                   "so this rank stops instead of training on wrong data") if behind else ""
        if why:
            fail = _join_hook[1]
            if fail is not None:
                fail(why)
            raise RebuildError(f"linkpass: {why}")
        log.info("group %s: joined generation %d as rank %d; collectives complete locally until the replay reaches "
                 "seq %d", self._gname or "?", gen, self._rank, low)

    def go_live(self, next_seq: int) -> None:
        """End the replay: the next collective is ``next_seq`` and goes to the inner group."""
        with self._lock:
            self._virtual = False
            self._next_seq = self._boundary_seq = next_seq

    def _complete_locally(self, op: _Op) -> _Work:
        """A collective of the replay: no traffic; gathers get this rank's input in every slot
        (so checks that compare ranks' metadata, like DDP's parameter-shape check, pass), other
        outputs are left as they are (the state is replaced at :meth:`go_live`)."""
        op.future = torch.futures.Future()
        try:
            if op.kind == "allgather":
                for outs, t in zip(op.result, op.inputs):
                    for o in outs:
                        o.copy_(t)
            elif op.kind == "all_gather_single" and op.inputs:
                out, inp = op.result[0], op.inputs[0]
                out.view(-1, inp.numel()).copy_(inp.reshape(1, -1).expand(out.numel() // max(inp.numel(), 1), -1))
        except Exception as e:  # noqa: BLE001 - the values are replaced at go_live anyway
            log.debug("replayed %s: outputs left as they are (%s)", op.kind, e)
        self._deliver(op, None)
        return _Work(op)

    def stats(self) -> dict:
        """Counters and the current cost: ``generation``, ``issued`` (protected collectives so far),
        ``rebuilds``, ``reissued`` (collectives
        issued again into the caller's tensors), ``reissued_scratch`` (completed ones issued again
        for a peer), ``parked``, ``aborts``, ``retained_ops``, ``retained_bytes``, ``latched``,
        ``interface``."""
        with self._lock:
            return dict(self._stats, generation=self._gen, issued=self._next_seq, retained_ops=len(self._ops),
                        retained_bytes=self._bytes, latched=self.latched,
                        interface=self.interface, state=self._state)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("linkpass: group %s: %s", self._gname or "?", msg)

    # ---------------------------------------------------------------- inner groups

    def _store_ports(self) -> frozenset[int]:
        ports, st = set(), self._store
        for _ in range(16):
            if isinstance(st, dist.TCPStore):
                ports.add(st.port)
                break
            st = getattr(st, "underlying_store", None)
            if st is None:
                break
        return frozenset(ports)

    def _make_inner(self, store: dist.Store, interface: str | None):
        if self.inner_backend == "gloo":
            if interface is None:
                # exactly what torch builds for init_process_group("gloo"): GLOO_SOCKET_IFNAME or
                # gloo's default device, 2 threads per device
                pg = dist.ProcessGroupGloo(store, self._rank, self._size, self.timeout)
            else:
                opts = dist.ProcessGroupGloo._Options()
                ifaces = [i for i in interface.split(",") if i]
                opts._devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in ifaces]
                opts._timeout = self.timeout
                opts._threads = 2 * len(ifaces)
                pg = dist.ProcessGroupGloo(store, self._rank, self._size, opts)
        else:  # pragma: no cover - needs a GPU
            opts = self._backend_options or dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, self._rank, self._size, opts)
        try:
            pg.options.global_ranks_in_group = self._global_ranks
            pg.options.group_name = self._gname
        except Exception:  # noqa: BLE001,S110 - only for torch's logs
            pass
        pg._set_sequence_number_for_group()
        return pg

    def _build(self, gen: int, prefix: str, interface: str | None) -> None:
        store = dist.PrefixStore(prefix.rstrip("/") + "/", self._store)
        before = _socket_fds()
        pg = self._make_inner(store, interface)
        fds = _tcp_fds(before, _socket_fds(), self._store_ports()) if self.inner_backend == "gloo" else []
        with self._lock:
            self._inner, self._fds, self._gen = pg, fds, gen
            self.interface = interface if interface is not None else self.interface
        log.info("group %s: inner %s group generation %d built (%s, %d sockets), rank %d of %d", self._gname or "?",
                 self.inner_backend, gen, interface or self.interface or "default device", len(fds), self._rank, self._size)

    # ---------------------------------------------------------------- abort / rebuild

    def abort(self) -> None:
        """Drop the inner group at once: collectives pending on it fail within milliseconds (gloo:
        its sockets are shut down) and are parked for :meth:`rebuild`; new collectives queue.
        Never raises; a second call does nothing.  If no rebuild starts within
        ``error_grace_s``, the parked collectives fail with their errors."""
        with self._lock:
            if self._state in (_REBUILDING, _CLOSED) or (self._state == _BROKEN and self._inner is None):
                return
            self._state = _BROKEN
            inner, fds, self._inner, self._fds = self._inner, self._fds, None, []
            self._stats["aborts"] += 1
            gen = self._gen
        self._drop_inner(inner, fds, gen)
        self._arm_grace()

    def _drop_inner(self, inner, fds, gen) -> None:
        if inner is None:
            return
        try:
            inner.abort()
        except Exception as e:  # noqa: BLE001 - not every backend/version has it
            log.debug("inner abort(): %s", e)
        n = _shutdown_fds(fds)
        self._graveyard.append(inner)
        log.warning("group %s: inner group generation %d aborted (%d sockets shut down)", self._gname or "?", gen, n)

    def rebuild(self, generation: int, store_prefix: str | None = None, interface: str | None = None,
                timeout: datetime.timedelta | None = None, move_latched: bool = False) -> dict:
        """Build inner group ``generation`` and issue the interrupted collectives again on it.

        Every rank of the group must call it with the same ``generation`` (larger than the
        current one) and ``store_prefix``.  Aborts the current inner group first if
        :meth:`abort` was not called.  Blocks until every rank has joined and the new group is
        connected; the re-issued collectives then complete asynchronously.

        Args:
            generation: the new generation (the job-wide rebuild epoch).
            store_prefix: where the new group lives in the group's store; default
                ``f"linkpass/gen{generation}"``.
            interface: the gloo interface for the new group (None: keep the current one).
            timeout: for the store exchange and for waiting on old work (default: the group's).
            move_latched: a latched group may move all the same: the caller knows the process's
                own interface is healthy (NCCL: the new plan's HCAs are in the list it read).

        Returns:
            ``{"generation", "start_seq", "reissued", "reissued_scratch", "interface"}``.

        Raises:
            LatchedInterfaceError: latched mode and ``interface`` differs from the current one
                (nothing is changed).
            ValueError: ``generation`` not larger than the current one.
            RebuildError: see the class; the group stays down, collectives parked.
        """
        if self.latched and not move_latched and interface is not None and interface != self.interface:
            raise LatchedInterfaceError(
                f"linkpass: process group {self._gname or '?'} (rank {self._rank}) is latched to interface "
                f"{self.interface or 'default'!r}: like NCCL, which reads its HCA list once per process and never rescans "
                f"(shared/NCCL-REFERENCE.md 1.7), it cannot move to {interface!r} in this process; the rank must hand "
                "over to a spare process started with the new interface")
        with self._lock:
            if generation <= self._gen:
                raise ValueError(f"generation {generation} is not newer than the current {self._gen}")
            if self._state == _CLOSED:
                raise RebuildError("the group is closed")
            self._state = _REBUILDING
            self._gave_up = self._no_park = False
            self._grace_token += 1  # no grace expiry during a rebuild
            inner, fds, self._inner, self._fds = self._inner, self._fds, None, []
            if inner is not None:
                self._stats["aborts"] += 1
            old_gen = self._gen
        try:
            return self._rebuild(generation, store_prefix or f"linkpass/gen{generation}", interface, timeout or self.timeout,
                                 inner, fds, old_gen)
        except BaseException as e:
            with self._lock:
                if self._state == _REBUILDING:
                    self._state = _BROKEN
            self._arm_grace()
            if isinstance(e, (RebuildError, LatchedInterfaceError)):
                raise
            raise RebuildError(f"linkpass: rebuild of group {self._gname or '?'} to generation {generation} failed: {e}") from e

    def _rebuild(self, generation, prefix, interface, timeout, inner, fds, old_gen) -> dict:
        self._drop_inner(inner, fds, old_gen)
        if inner is None and self._graveyard:
            inner = self._graveyard[-1]  # aborted before: the group the old work ran on
        low = self._settle_old(inner, old_gen)
        st = dist.PrefixStore(prefix.rstrip("/") + "/", self._store)
        st.set(f"reissue/{self._rank}", json.dumps({"low": low}))
        keys = [f"reissue/{r}" for r in range(self._size)]
        try:
            st.wait(keys, timeout)
            lows = {r: json.loads(st.get(k))["low"] for r, k in enumerate(keys)}
        except Exception as e:
            raise RebuildError(f"linkpass: not every rank of group {self._gname or '?'} joined generation {generation} "
                               f"within {timeout.total_seconds()} s: {str(e).splitlines()[0][:200] if str(e) else e!r}") from None
        start = min(lows.values())
        with self._lock:
            missing = [s for s in range(start, self._next_seq) if s not in self._ops or (
                self._ops[s].state == "done" and self._ops[s].inputs and self._ops[s].saved is None)]
        if missing:
            why = (f"dropped at the {self.retain_limit_bytes}-byte cap: no step boundary was marked"
                   if missing[0] <= self._dropped_upto else
                   "released after a later step's collective completed: a rank issued it without waiting for its "
                   "previous step's collectives, which the release rule assumes it does")
            raise RebuildError(
                f"linkpass: a peer needs collective seq {missing[0]} again (lowest incomplete seq per rank: {lows}), "
                f"but this rank no longer holds its inputs ({why}); the job cannot continue in-process")
        self._build(generation, prefix, interface if interface is not None else self.interface)
        with self._issue_lock:
            with self._lock:
                todo = [self._ops[s] for s in sorted(self._ops) if s >= start]
                self._state = _READY
            n_real = n_scratch = 0
            for op in todo:
                if op.state == "done":
                    self._issue(op, scratch=True)
                    n_scratch += 1
                else:
                    self._issue(op)
                    n_real += 1
        with self._lock:
            self._stats["rebuilds"] += 1
            self._stats["reissued"] += n_real
            self._stats["reissued_scratch"] += n_scratch
        ev = {"generation": generation, "start_seq": start, "lows": lows, "reissued": n_real,
              "reissued_scratch": n_scratch, "interface": self.interface}
        self.events.append(ev)
        log.warning("group %s: rank %d rebuilt on generation %d (%s); issued %d collectives again from seq %d "
                    "(+%d completed ones for a peer)", self._gname or "?", self._rank, generation,
                    self.interface or "default device", n_real, start, n_scratch)
        return {k: ev[k] for k in ("generation", "start_seq", "reissued", "reissued_scratch", "interface")}

    def settled_low(self) -> int:
        """This rank's lowest unfinished collective (its sequence number; the next one's when
        every one issued completed), once the collectives of the aborted generation have finished: each one
        still in flight is waited for, ``abandon_s`` in all, then abandoned (:meth:`_abandon`).
        The value :meth:`rebuild` exchanges as this rank's ``low``.  Call it after :meth:`abort`:
        the group then stays down, so the value holds until the rebuild (a late completion of
        an abandoned collective is a stale attempt).  Never raises."""
        with self._lock:
            gen = self._gen
            old = self._graveyard[-1] if self._inner is None and self._graveyard else None
        return self._settle_old(old, gen)

    def _settle_old(self, inner, gen: int) -> int:
        """Wait for (or abandon) the collectives in flight on ``inner`` (generation ``gen``, aborted),
        then the lowest seq not completed here."""
        # the old work must be finished (failed, after the socket shutdown) before anything is
        # issued again: it could still write into the caller's tensors
        with self._lock:
            pending = [op for op in self._ops.values() if op.state == "in_flight"]
        deadline = time.monotonic() + self.abandon_s
        stuck = [op for op in pending if not op.settled.wait(max(0.0, deadline - time.monotonic()))]
        if stuck:
            self._abandon(stuck, inner, gen)
        with self._lock:
            return min((s for s, op in self._ops.items() if op.state != "done"), default=self._next_seq)

    def _abandon(self, stuck: list[_Op], inner, gen: int) -> None:
        """Old collectives that did not finish ``abandon_s`` after the abort.

        Seen with torch 2.13 gloo: an allreduce whose peer had completed it stayed blocked in
        ``gloo::transport::tcp::UnboundBuffer::waitSend`` (gdb) after its pair's socket was shut
        down; neither the shutdown nor ``ProcessGroupGloo.abort()`` wakes a send waiter, only the
        group's timeout does.  Such a collective cannot write into the caller's tensors any more
        (nothing can arrive on the dead socket, and a timed-out wait throws), so it is treated as
        failed and issued again.  Its gloo thread stays blocked until the old group's timeout, and
        the old group is never destroyed (its destructor joins that thread, which would hold up
        process exit for the timeout): it is deliberately leaked.
        """
        with self._lock:
            for op in stuck:
                if op.settled.is_set():
                    continue
                op.attempt += 1  # a late completion of the old attempt is stale
                op.state = "failed"
                op.error = RuntimeError(f"abandoned on generation {gen}: still running {self.abandon_s} s after the abort")
                op.settled.set()
        if inner is not None:
            _leak(inner)
        with self._lock:
            self._stuck_gens.add(gen)  # its waiter thread may stay in gloo: shutdown does not join it
        log.warning("group %s: %d collectives (seq %s) still blocked on generation %d %.1f s after the abort (gloo does "
                    "not wake a blocked send when its socket closes); abandoned and issued again; the old group is kept "
                    "alive", self._gname or "?", len(stuck), [op.seq for op in stuck], gen, self.abandon_s)

    def fail_parked(self, error: BaseException) -> int:
        """Give up: every parked or queued collective fails with ``error`` (its own error, if it
        had one, is chained).  Returns how many.  The group stays down until :meth:`rebuild`."""
        with self._lock:
            ops = [op for op in self._ops.values() if op.state in ("failed", "queued") and not op.delivered.is_set()]
            for op in ops:
                self._drop(op.seq)
        for op in ops:
            e = error
            if op.error is not None and op.error is not error:
                e = RuntimeError(f"{error}; {op.kind} (seq {op.seq}) had failed with: {op.error}")
            self._deliver(op, e)
        return len(ops)

    def _arm_grace(self) -> None:
        with self._lock:
            self._grace_token += 1
            token = self._grace_token
        t = threading.Timer(self.error_grace_s, self._grace_expired, args=(token,))
        t.daemon = True
        self._keep_thread(t)
        t.start()

    def _grace_expired(self, token: int) -> None:
        # the group's new state first, then the parked work fails: a caller woken by that failure
        # may submit again at once, and its collective must see the new state (parked behind a
        # grace that has already passed, it would wait forever)
        with self._lock:
            if token != self._grace_token or self._state != _BROKEN:
                return
            self._no_park = True  # until a rebuild: nobody is rebuilding, so do not make every error wait
            if self._inner is not None:
                self._state = _READY  # an error nobody rebuilt for: the group runs on, as torch's would
            else:
                self._gave_up = True  # aborted and never rebuilt: new collectives fail at once
        n = self.fail_parked(RuntimeError(
            f"linkpass: the inner group of {self._gname or '?'} failed and no rebuild followed within {self.error_grace_s} s"))
        if n:
            log.error("group %s: %d collectives failed: no rebuild within %.1f s", self._gname or "?", n, self.error_grace_s)

    # ---------------------------------------------------------------- issue / complete

    def _submit(self, op: _Op) -> _Work:
        if self._virtual:
            return self._complete_locally(op)
        op.future = torch.futures.Future()
        saved = _copies(op.inputs) if op.inplace else None  # before anything can overwrite them
        with self._issue_lock:
            with self._lock:
                if self._state == _CLOSED:
                    raise RuntimeError(f"linkpass: process group {self._gname or '?'} is closed")
                op.seq, self._next_seq = self._next_seq, self._next_seq + 1
                op.epoch = self._epoch
                gave_up = self._gave_up
                if not gave_up:
                    self._ops[op.seq] = op
                    self._hold(op, saved)
                ready = self._state == _READY
                if not ready and not gave_up:
                    self._stats["parked"] += 1
            if gave_up:
                self._deliver(op, RuntimeError(f"linkpass: process group {self._gname or '?'} was aborted and not rebuilt "
                                               f"within {self.error_grace_s} s; {op.kind} cannot run"))
                return _Work(op)
            if ready:
                try:
                    self._issue(op)
                except BaseException:
                    with self._lock:
                        self._drop(op.seq)
                    raise  # bad arguments: the caller gets torch's error, as without linkpass
            for fn in self._issue_listeners:
                fn(self, op.seq, op.kind)
        if self._bytes > self.retain_limit_bytes:
            self._enforce_cap()
        return _Work(op)

    def _hold(self, op: _Op, saved: list | None) -> None:
        """Keep ``saved`` as ``op``'s input copies (lock held; only while ``op`` is retained)."""
        if saved is not None and self._ops.get(op.seq) is op and op.saved is None:
            op.saved = saved
            self._bytes += op.nbytes()

    def _drop(self, seq: int) -> None:
        """Stop retaining op ``seq`` (lock held)."""
        op = self._ops.pop(seq, None)
        if op is not None:
            self._bytes -= op.nbytes()

    def _issue(self, op: _Op, scratch: bool = False) -> None:
        """Issue ``op`` on the current inner group (issue lock held)."""
        inner = self._inner
        op.attempt += 1
        op.gen = self._gen
        op.settled.clear()
        a = op.attempt
        if scratch:
            work = op.scratch(inner, op.saved or [])
        else:
            if a > 1 and op.inplace and op.saved:
                for t, c in zip(op.inputs, op.saved):
                    t.copy_(c)
            op.state = "in_flight"
            work = op.call(inner)
        self._watch(work, op, a, scratch)

    def _watch(self, work, op: _Op, attempt: int, scratch: bool) -> None:
        try:
            fut = work.get_future()
        except RuntimeError:
            fut = None  # gloo's _allgather_base/_reduce_scatter_base works have no future
        if fut is None:
            q = self._waitqs.get(op.gen)
            if q is None:
                q = self._waitqs[op.gen] = queue.Queue()
                for g in [g for g in self._waitqs if g < op.gen]:
                    self._waitqs.pop(g).put(None)  # its thread ends once past what it waits for
                t = threading.Thread(target=self._waiter, args=(q,), name=f"linkpass-pg-wait-gen{op.gen}", daemon=True)
                t._linkpass_gen = op.gen  # type: ignore[attr-defined] - see shutdown
                self._keep_thread(t)
                t.start()
            q.put((work, op, attempt, scratch))
            return

        def cb(f, op=op, attempt=attempt, scratch=scratch):
            try:
                f.value()
                err = None
            except BaseException as e:  # noqa: BLE001
                err = e
            self._settle(op, attempt, scratch, err)

        fut.add_done_callback(cb)

    def _waiter(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            work, op, attempt, scratch = item
            try:
                work.wait()
                err = None
            except BaseException as e:  # noqa: BLE001
                err = e
            self._settle(op, attempt, scratch, err)
            # the gloo Work goes now, not with the frame on return (see shutdown)
            item = work = op = err = None

    def _keep_thread(self, t: threading.Thread) -> None:
        """Remember a thread of this group for :meth:`shutdown` to join (finished ones are forgotten)."""
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive() or x.ident is None]  # None: not started yet
            self._threads.append(t)

    def _settle(self, op: _Op, attempt: int, scratch: bool, err: BaseException | None) -> None:
        """An attempt of ``op`` finished (torch/gloo thread)."""
        try:
            self._settle_inner(op, attempt, scratch, err)
        except BaseException:  # noqa: BLE001 - never let an exception die silently in torch's callback
            log.exception("linkpass: internal error completing %s seq %d", op.kind, op.seq)

    def _settle_inner(self, op: _Op, attempt: int, scratch: bool, err: BaseException | None) -> None:
        if scratch:
            if err is not None:
                log.info("group %s: %s seq %d issued again for a peer failed: %s", self._gname or "?", op.kind, op.seq,
                         str(err).splitlines()[0][:200] if str(err) else repr(err))
            return
        # before the caller sees the result (it may reuse the inputs): a peer may need them again
        copy = _copies(op.inputs) if err is None and not op.inplace and op.saved is None and op.inputs else None
        notify = fail_now = False
        with self._lock:
            if attempt != op.attempt or op.state == "done":
                return  # a stale attempt
            if err is None:
                op.state = "done"
                self._done_hi = max(self._done_hi, op.seq)
                self._hold(op, copy)
                self._retire(op.epoch)
            else:
                op.state, op.error = "failed", err
                if self._state == _READY and op.gen == self._gen:
                    if self._fault_listeners and not self._no_park:
                        self._state = _BROKEN
                        notify = True
                    else:
                        fail_now = True
                if fail_now:
                    self._drop(op.seq)
                else:
                    self._stats["parked"] += 1
            op.settled.set()
        if err is None:
            self._deliver(op, None)
        elif fail_now:
            self._deliver(op, err)
        elif notify:
            log.warning("group %s: %s (seq %d) failed on generation %d: %s; parked for a rebuild", self._gname or "?",
                        op.kind, op.seq, op.gen, str(err).splitlines()[0][:200] if str(err) else repr(err))
            self._arm_grace()
            for fn in self._fault_listeners:
                try:
                    fn(self, err)
                except Exception:  # noqa: BLE001
                    log.exception("fault listener failed")

    def _deliver(self, op: _Op, err: BaseException | None) -> None:
        if op.delivered.is_set():
            return
        op.delivered.set()
        if err is None:
            op.future.set_result(op.result)
        else:
            op.error = err
            op.future.set_exception(err)

    def _retire(self, epoch: int) -> None:
        """A collective of step epoch ``epoch`` completed here (lock held): every rank finished
        the collectives of earlier epochs, so their copies can go."""
        for s in [s for s, o in self._ops.items() if o.epoch < epoch and o.state == "done"]:
            self._drop(s)

    def _enforce_cap(self) -> None:
        with self._lock:
            for s in sorted(self._ops):
                if self._bytes <= self.retain_limit_bytes:
                    break
                if self._ops[s].state == "done":
                    self._drop(s)
                    self._dropped_upto = max(self._dropped_upto, s)
        self._warn_once("cap", f"input copies above {self.retain_limit_bytes} bytes and no step boundary marked: the "
                        "oldest are dropped, so a peer that lost one of those collectives cannot be helped in-process")

    # ---------------------------------------------------------------- protected collectives

    def allreduce(self, tensors, opts=None):
        if not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        if opts is None or isinstance(opts, (dist.ReduceOp, _RED_OP_TYPE)):
            o = dist.AllreduceOptions()
            if opts is not None:
                o.reduceOp = opts
            opts = o
        tensors = list(tensors)
        return self._submit(_Op("allreduce", lambda pg: pg.allreduce(tensors, opts),
                                lambda pg, s: pg.allreduce([c.clone() for c in s], opts), tensors, True, tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        tensors = list(tensors)
        return self._submit(_Op("allreduce_coalesced", lambda pg: pg.allreduce_coalesced(tensors, opts),
                                lambda pg, s: pg.allreduce_coalesced([c.clone() for c in s], opts), tensors, True, tensors))

    def broadcast(self, tensors, opts=None):
        if not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        if opts is None:
            opts = dist.BroadcastOptions()
        tensors = list(tensors)
        cap = getattr(_capture, "ddp_bucket_sync", None)
        if cap is not None:
            return self._bucket_sync(cap, tensors, opts)
        root = self._rank == opts.rootRank
        inputs = tensors if root else []

        def scratch(pg, s):
            return pg.broadcast([c.clone() for c in s] if root else [torch.empty_like(t) for t in tensors], opts)

        return self._submit(_Op("broadcast", lambda pg: pg.broadcast(tensors, opts), scratch, inputs, False, tensors))

    def _bucket_sync(self, cap: dict, tensors: list, opts) -> dist.Work:
        """A broadcast DDP's reducer issues while it rebuilds its buckets (``sync_bucket_indices``,
        after its first backward: rank 0's bucket layout for every rank).  Recorded (``"record"``:
        the values every rank received) so that a spare taking a rank over later gets the same
        layout; completed locally from that record in a spare (``"replay"``), whose peers did
        this exchange long ago and will not do it again."""
        if cap["mode"] == "replay":
            op = _Op("broadcast", None, None, [], False, tensors)
            src = cap["tensors"][cap["i"]] if cap["i"] < len(cap["tensors"]) else None
            cap["i"] += 1
            if src is not None:
                for t, v in zip(tensors, src):
                    t.copy_(v)
            op.future = torch.futures.Future()
            self._deliver(op, None)
            return _Work(op)
        _capture.ddp_bucket_sync = None
        try:
            w = self.broadcast(tensors, opts)
        finally:
            _capture.ddp_bucket_sync = cap
        cap["pending"].append(tensors)
        return w

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        outs, ins = [list(x) for x in output_tensors], list(input_tensors)
        return self._submit(_Op("allgather", lambda pg: pg.allgather(outs, ins, opts),
                                lambda pg, s: pg.allgather([[torch.empty_like(t) for t in x] for x in outs],
                                                           [c.clone() for c in s], opts),
                                ins, _overlaps(ins, _flat(outs)), outs))

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        opts = opts if opts is not None else AllgatherOptions()
        return self._submit(_Op("all_gather_single", lambda pg: pg._allgather_base(output, input, opts),
                                lambda pg, s: pg._allgather_base(torch.empty_like(output), s[0].clone(), opts),
                                [input], _overlaps([input], [output]), [output]))

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._submit(_Op("reduce_scatter_single", lambda pg: pg._reduce_scatter_base(output, input, opts),
                                lambda pg, s: pg._reduce_scatter_base(torch.empty_like(output), s[0].clone(), opts),
                                [input], _overlaps([input], [output]), [output]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outs, ins = list(output_tensors), [list(x) for x in input_tensors]
        flat = _flat(ins)

        def scratch(pg, s):
            it = iter(c.clone() for c in s)
            return pg.reduce_scatter([torch.empty_like(t) for t in outs], [[next(it) for _ in x] for x in ins], opts)

        return self._submit(_Op("reduce_scatter", lambda pg: pg.reduce_scatter(outs, ins, opts), scratch, flat,
                                _overlaps(flat, outs), outs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        opts = opts if opts is not None else dist.AllToAllOptions()
        o_s, i_s = list(output_split_sizes), list(input_split_sizes)
        return self._submit(_Op("alltoall_base", lambda pg: pg.alltoall_base(output, input, o_s, i_s, opts),
                                lambda pg, s: pg.alltoall_base(torch.empty_like(output), s[0].clone(), o_s, i_s, opts),
                                [input], _overlaps([input], [output]), [output]))

    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        if opts is None or isinstance(opts, datetime.timedelta):
            o = dist.BarrierOptions()
            if isinstance(opts, datetime.timedelta):
                o.timeout = opts
            opts = o
        return self._submit(_Op("barrier", lambda pg: pg.barrier(opts), lambda pg, s: pg.barrier(opts), [], False, []))

    # ---------------------------------------------------------------- passed through, not protected

    def _unprotected(self, name: str, *args):
        self._warn_once(name, f"{name} is not protected: it is not re-issued on a rebuild")
        inner = self._inner
        if inner is None:
            raise RuntimeError(f"linkpass: {name} while group {self._gname or '?'} is being rebuilt (not protected)")
        fn = getattr(inner, name, None)
        if fn is None:
            raise RuntimeError(f"linkpass: the {self.inner_backend} backend has no {name}")
        return fn(*args)

    def send(self, tensors, dst_rank, tag=0):
        return self._unprotected("send", tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        return self._unprotected("recv", tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._unprotected("recv_anysource", tensors, tag)

    def reduce(self, tensors, opts=None):
        return self._unprotected("reduce", tensors, opts if opts is not None else dist.ReduceOptions())

    def gather(self, output_tensors, input_tensors, opts=None):
        return self._unprotected("gather", output_tensors, input_tensors, opts if opts is not None else dist.GatherOptions())

    def scatter(self, output_tensors, input_tensors, opts=None):
        return self._unprotected("scatter", output_tensors, input_tensors,
                                 opts if opts is not None else dist.ScatterOptions())

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._unprotected("alltoall", output_tensors, input_tensors,
                                 opts if opts is not None else dist.AllToAllOptions())

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._unprotected("allgather_coalesced", output_lists, input_list,
                                 opts if opts is not None else AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """One protected ``all_gather_single`` per pair (gloo has no coalesced form; DTensor's
        ``full_tensor()`` uses this)."""
        return _AllWork([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)], list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """One protected ``reduce_scatter_single`` per pair."""
        return _AllWork([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)], list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def monitored_barrier(self, *args):
        return self._unprotected("monitored_barrier", *args)

    def __repr__(self) -> str:
        return (f"ResilientProcessGroup({self.inner_backend}, rank {self._rank}/{self._size}, gen {self._gen}, "
                f"{self._state}{', latched' if self.latched else ''})")


# -------------------------------------------------------------------- registration and injection

_LIVE: "weakref.WeakSet[ResilientProcessGroup]" = weakref.WeakSet()
_LEAKED: list = []


def _leak(obj) -> None:
    """Keep ``obj`` alive to the end of the process, through interpreter finalization too (an
    extra reference count; see :meth:`ResilientProcessGroup._abandon`)."""
    import ctypes

    if any(o is obj for o in _LEAKED):
        return
    _LEAKED.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
_group_listeners: list[Callable[[ResilientProcessGroup], None]] = []
#: set by a spare taking a rank over (torch_hooks.handover): ``[join, fail]``, every wrapper it
#: creates joins the job's current generation instead of building generation 0, and ``fail(reason)``
#: (None: raise) when it cannot (see ResilientProcessGroup._join)
_join_hook: list = [None, None]
#: per thread: ``ddp_bucket_sync`` is set while DDP's reducer rebuilds its buckets (see
#: ResilientProcessGroup._bucket_sync; torch_hooks.tracker sets it)
_capture = threading.local()
_options: dict = {}
_installed: dict = {}


def _close_all() -> None:
    """atexit: :meth:`ResilientProcessGroup.shutdown` every live wrapper while threads can still
    take the GIL (a script that never calls ``destroy_process_group``)."""
    for g in list(_LIVE):
        try:
            g.shutdown()
        except Exception:  # noqa: BLE001,S110 - exiting anyway
            pass


atexit.register(_close_all)


def groups() -> list[ResilientProcessGroup]:
    """The live wrappers of this process (every protected group)."""
    return list(_LIVE)


def add_group_listener(fn: Callable[[ResilientProcessGroup], None]) -> None:
    """``fn(group)`` for every wrapper created from now on (the bootstrap attaches its fault
    controller this way, to the groups DDP and FSDP2 make too)."""
    _group_listeners.append(fn)


def _creator(inner: str):
    def create(o, backend_options=None) -> ResilientProcessGroup:
        pg = ResilientProcessGroup(o.store, o.group_rank, o.group_size, inner=inner, timeout=o.timeout,
                                   group_name=str(o.group_id), global_ranks=list(o.global_ranks_in_group),
                                   backend_options=backend_options, **_options)
        for fn in _group_listeners:
            fn(pg)
        return pg
    create.__name__ = f"create_{PREFIX}{inner}"
    return create


def register() -> None:
    """Register ``linkpass_gloo`` and ``linkpass_nccl`` with torch (idempotent).  After this,
    ``init_process_group(backend="linkpass_gloo")`` works without :func:`install`."""
    for inner, devices in INNER_DEVICES.items():
        name = PREFIX + inner
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _creator(inner), extended_api=True, devices=devices)


def map_backend(backend: Any) -> tuple[Any, str | None]:
    """``(backend to pass to torch, why it is left alone or None)`` for a script's ``backend``.

    ``"gloo"``/``"nccl"`` (any case) -> ``"linkpass_<name>"``; None or ``""`` -> the one for this
    machine's accelerator (``cuda`` -> nccl, none -> gloo); ``"linkpass_*"`` unchanged; anything
    else (a ``"cpu:gloo,cuda:nccl"`` device map, another backend) unchanged, with why.
    """
    if backend is None or str(backend) in ("", "undefined"):
        acc = torch._C._get_accelerator().type
        inner = {"cpu": "gloo", "cuda": "nccl"}.get(acc)
        if inner is None:
            return backend, f"no linkpass backend for accelerator {acc!r}"
        return PREFIX + inner, None
    s = str(backend).lower()
    if s.startswith(PREFIX):
        return s, None
    if s in INNER_DEVICES:
        return PREFIX + s, None
    if ":" in s or "," in s:
        return backend, f"backend {backend!r} is a device map; linkpass wraps one backend per group"
    return backend, f"backend {backend!r} is not gloo or nccl"


def _note_unprotected(fn_name: str, why: str) -> None:
    msg = f"linkpass: {fn_name}: this group is NOT protected ({why}); it runs as without linkpass"
    log.warning("%s", msg)
    print(msg, file=sys.stderr, flush=True)


def install(*, latched: bool | None = None, error_grace_s: float | None = None,
            retain_limit_bytes: int | None = None, step_hook: bool = True) -> bool:
    """Make the script's ``init_process_group`` / ``new_group`` produce linkpass wrappers.

    Idempotent.  ``LINKPASS_HOOK=0`` turns it off (returns False, changes nothing).  Options go
    to every wrapper made afterwards (see :class:`ResilientProcessGroup`); ``step_hook`` registers
    a ``torch.optim`` step post-hook that marks a step boundary on every live wrapper (what frees
    retained input copies, see "Memory").

    Returns:
        True when installed (now or before).
    """
    if os.environ.get("LINKPASS_HOOK", "1").strip() == "0":
        log.info("LINKPASS_HOOK=0: process groups are not wrapped")
        return False
    for k, v in (("latched", latched), ("error_grace_s", error_grace_s), ("retain_limit_bytes", retain_limit_bytes)):
        if v is not None:
            _options[k] = v
    if _installed:
        return True
    register()
    import torch.distributed.distributed_c10d as c10d

    orig_init, orig_new = c10d.init_process_group, c10d.new_group

    def init_process_group(backend=None, *args, **kwargs):
        mapped, why = map_backend(backend)
        if why:
            _note_unprotected("init_process_group", why)
        return orig_init(mapped, *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        if backend is not None:
            mapped, why = map_backend(backend)
            if why:
                _note_unprotected("new_group", why)
            backend = mapped
        return orig_new(ranks, timeout, backend, *args, **kwargs)

    for new, orig in ((init_process_group, orig_init), (new_group, orig_new)):
        new.__doc__, new.__wrapped__ = orig.__doc__, orig  # type: ignore[attr-defined]
        new.__qualname__ = new.__name__ = orig.__name__
    _installed.update(init=(orig_init, init_process_group), new=(orig_new, new_group), rebound=[])
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "torch" or mod_name.startswith("torch.")):
            continue
        for attr, (orig, new) in (("init_process_group", _installed["init"]), ("new_group", _installed["new"])):
            if getattr(mod, attr, None) is orig:
                setattr(mod, attr, new)
                _installed["rebound"].append((mod, attr, orig))
    if step_hook:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _installed["step_hook"] = register_optimizer_step_post_hook(lambda *_a, **_k: [g.mark_step() for g in groups()])
    log.info("linkpass process groups installed (%d references rebound)", len(_installed["rebound"]))
    return True


def uninstall() -> None:
    """Undo :func:`install` (the registered backends stay: torch has no unregister)."""
    if not _installed:
        return
    for mod, attr, orig in _installed["rebound"]:
        setattr(mod, attr, orig)
    h = _installed.get("step_hook")
    if h is not None:
        h.remove()
    _installed.clear()
    _options.clear()
