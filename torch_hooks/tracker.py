"""What the hook learns about an unmodified training script, without its help.

:func:`install` (called by :mod:`torch_hooks.bootstrap` before the script runs) patches a few
public torch entry points so the hook knows, at every optimizer step:

* the **modules it protects**: every module wrapped by ``DistributedDataParallel`` (its
  ``.module``) and every root module given to FSDP2's ``fully_shard`` (one that is not inside
  another sharded module);
* the **optimizers** and the **step**: ``torch.optim.Optimizer`` step post-hooks
  (``register_optimizer_step_post_hook``, a global hook for every optimizer); the step is the
  number of ``step()`` calls of the first optimizer that stepped (the one a script with several
  optimizers steps every iteration, as a rule);
* the **data position**: the epoch from ``DistributedSampler.set_epoch`` and the batches each
  ``DataLoader`` iterator has yielded in the current epoch (a wrapper around the iterator that
  ``DataLoader.__iter__`` returns).  A script that feeds batches from its own iterator has no
  known position: :attr:`Tracker.position_known` says so and :func:`set_position` is the
  one-line API for it (``torch_hooks.tracker.set_position(epoch, batch)``);
* LR schedulers (``torch.optim.lr_scheduler.LRScheduler.__init__``), for state hand-over.

Strong references are kept to what it learns (modules, optimizers, schedulers) so the final
report can hash the parameters after the script dropped its own references; they live as long
as the process does anyway.

Shapes and units: steps and batches are counts (ints from 0); times are ``time.monotonic_ns()``
nanoseconds; ``step_ms`` are milliseconds between consecutive optimizer steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("linkpass.torch_hooks.tracker")

#: the most step durations kept for the report (the oldest are dropped beyond it)
MAX_STEP_TIMES = 200_000


class Tracker:
    """The script's model, optimizer, step and data position, as torch's hooks show them."""

    def __init__(self) -> None:
        self.modules: list[Any] = []          # DDP .module / FSDP2 roots, in wrap order
        self.module_kinds: list[str] = []     # "ddp" / "fsdp2", same order
        self.optimizers: list[Any] = []
        self.schedulers: list[Any] = []
        self.samplers: list[Any] = []
        self.steps = 0
        self.epoch: int | None = None
        self.batch = 0                        # batches yielded by the current epoch's loader iterator
        self.position_known = False
        self.position_api = False             # set_position() was used
        self.ff_skipped_saves: set[str] = set()  # where torch.save was skipped during a replay (absolute paths)
        self.step_ms: list[float] = []
        self.step_end_ns: list[int] = []
        self.last_step_ns: int | None = None
        self.start_ns = time.monotonic_ns()
        self._primary: int | None = None      # id() of the optimizer whose steps are counted
        self._step_listeners: list[Callable[[int], None]] = []
        self._batch_listeners: list[Callable[[Any, int], Any]] = []
        self._boundary_listeners: list[Callable[[int], None]] = []
        self._muted = 0                           # > 0: optimizer steps are not the script's (a restore)
        self._lock = threading.Lock()
        prog = os.environ.get("LINKPASS_PROGRESS") or None
        self._progress = prog.replace("{rank}", os.environ.get("RANK", "0")) if prog else None
        #: held by the training thread while an optimizer steps (pre-hook to post-hook) and by
        #: the controller while it reads the position and the state: they are then consistent
        self.step_lock = threading.Lock()
        self._lock_held = False                   # the training thread holds step_lock
        self._boundary_due = False                # an optimizer step since the last boundary
        self.boundary_rng: dict | None = None     # RNG states at the last step boundary
        self.rng_by_step: dict[int, dict] = {}    # ... at the last two boundaries, by step
        #: RNG states when the optimizer step N is about to run ({N: states}, the latest only):
        #: after step N's forward and backward drew their random numbers, before the boundary
        self.rng_pre_step: dict[int, dict] = {}
        self.boundary_pos = {"steps": 0, "epoch": None, "batch": 0}
        self._ff: dict | None = None              # fast-forward target of a joining spare
        #: what DDP's reducers received when they rebuilt their buckets (per rebuild, the
        #: broadcast tensors), and, in a spare, what its reducers are to take instead
        self.ddp_bucket_syncs: list = []
        self.ddp_bucket_replay: list = []
        #: the bucket layouts those rebuilds produced (per reducer: lists of parameter indices),
        #: and, in a spare, the layouts its DDP constructors are to use
        self.ddp_layouts: list[list[list[int]]] = []
        self.ddp_layout_replay: list = []

    # ---------------------------------------------------------------- listeners

    def add_step_listener(self, fn: Callable[[int], None]) -> None:
        """``fn(steps)`` after every counted optimizer step (on the training thread)."""
        self._step_listeners.append(fn)

    def add_boundary_listener(self, fn: Callable[[int], None]) -> None:
        """``fn(steps)`` at every step boundary (training thread), once the optimizer may step
        again: the position, the RNG states and the state are those after ``steps`` steps."""
        self._boundary_listeners.append(fn)

    @contextlib.contextmanager
    def muted(self):
        """Optimizer steps inside are not counted and mark no boundary (DCP's
        ``get_optimizer_state_dict`` steps a fresh optimizer once, with zero gradients)."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    def add_batch_listener(self, fn: Callable[[Any, int], Any]) -> None:
        """``fn(batch, index)`` for every batch a tracked DataLoader iterator yields, before the
        script sees it; it returns the batch (possibly another one)."""
        self._batch_listeners.append(fn)

    # ---------------------------------------------------------------- what the patches call

    def on_module(self, module: Any, kind: str) -> None:
        with self._lock:
            if any(m is module for m in self.modules):
                return
            if kind == "fsdp2":
                # a parent sharded after its children replaces them as the root
                keep = [(m, k) for m, k in zip(self.modules, self.module_kinds)
                        if not (k == "fsdp2" and _is_submodule(m, module))]
                if any(k == "fsdp2" and _is_submodule(module, m) for m, k in keep):
                    return
                self.modules = [m for m, _ in keep]
                self.module_kinds = [k for _, k in keep]
            self.modules.append(module)
            self.module_kinds.append(kind)

    def on_optimizer(self, opt: Any) -> None:
        with self._lock:
            if not any(o is opt for o in self.optimizers):
                self.optimizers.append(opt)

    # The step boundary a spare resumes at is the first batch fetch after an optimizer step: by
    # then the script has also stepped its LR schedulers, zeroed its gradients and, at an epoch's
    # end, made the next epoch's loader iterator (which draws from the global RNG).  The training
    # thread holds ``step_lock`` from the optimizer step to that fetch, so the controller reads
    # the position, the state and the RNG either before the step or at the boundary, never in
    # between.  Without a tracked DataLoader the boundary is the optimizer step itself.

    def on_step_start(self, opt: Any) -> None:
        if self._muted:
            return
        if (self._primary is None or id(opt) == self._primary) and not self._lock_held:
            # taken before the lock: a controller holding it (a device hand-over) keeps this
            # rank here, and a replica that finished this step resumes the spare from this state
            self.rng_pre_step = {self.steps + 1: _rng_state()}
            self.step_lock.acquire()
            self._lock_held = True

    def on_step(self, opt: Any) -> None:
        if self._muted:
            return
        counted = False
        try:
            counted = self._on_step(opt)
        finally:
            if counted and self._lock_held and not self.position_known:
                self._boundary(self.epoch, self.batch)
        if counted:
            self._after_step(self.steps)

    def _boundary(self, epoch: int | None, batch: int) -> None:
        """Record the step boundary (position, RNG, groups' sequence numbers) and let the
        controller in (training thread)."""
        with self._lock:
            steps = self.steps
            self.boundary_pos = {"steps": steps, "epoch": epoch, "batch": batch}
            self._boundary_due = False
        self.boundary_rng = _rng_state()
        self.rng_by_step = {k: v for k, v in self.rng_by_step.items() if k >= steps - 1}
        self.rng_by_step[steps] = self.boundary_rng
        for g in self._groups():
            g.mark_step()
        if self._lock_held:
            self._lock_held = False
            self.step_lock.release()
        for fn in self._boundary_listeners:
            try:
                fn(steps)
            except Exception:  # noqa: BLE001 - a listener never breaks training
                log.exception("boundary listener failed")

    def _on_step(self, opt: Any) -> bool:
        with self._lock:
            if not any(o is opt for o in self.optimizers):
                self.optimizers.append(opt)
            if self._primary is None:
                self._primary = id(opt)
            if id(opt) != self._primary:
                return False
            self.steps += 1
            self._boundary_due = True
            now = time.monotonic_ns()
            if self.last_step_ns is not None and len(self.step_ms) < MAX_STEP_TIMES:
                self.step_ms.append((now - self.last_step_ns) / 1e6)
                self.step_end_ns.append(now)
            self.last_step_ns = now
        return True

    def _after_step(self, steps: int) -> None:
        if self._progress:
            try:
                with open(self._progress, "w") as f:
                    f.write(str(steps))
            except OSError:
                self._progress = None
        for fn in self._step_listeners:
            try:
                fn(steps)
            except Exception:  # noqa: BLE001 - a listener never breaks training
                log.exception("step listener failed")

    def on_epoch(self, sampler: Any, epoch: int) -> None:
        with self._lock:
            if not any(s is sampler for s in self.samplers):
                self.samplers.append(sampler)
            self.epoch = int(epoch)

    def _groups(self) -> list:
        from torch_hooks import pg

        return pg.groups()

    # ---------------------------------------------------------------- fast-forward (a joining spare)

    def fast_forward(self, epoch: int | None, batch: int, on_live: Callable[[], None]) -> None:
        """Skip the script's batches up to ``batch`` batches into ``epoch`` (a spare replaying the
        script's control flow to the point where the rank it replaces was), then call
        ``on_live()`` just before the next batch reaches the script.  While skipping, earlier
        epochs' loaders yield nothing, and ``torch.save`` is not run (the rank it replaces
        already wrote those files)."""
        self._ff = {"epoch": epoch, "batch": batch, "on_live": on_live}

    @property
    def fast_forwarding(self) -> bool:
        return self._ff is not None

    def _ff_skip_epoch(self) -> bool:
        ff = self._ff
        return ff is not None and ff["epoch"] is not None and self.epoch is not None and self.epoch < ff["epoch"]

    def _ff_check(self, index: int) -> bool:
        """True: skip this batch.  Goes live (once) at the first batch past the target."""
        ff = self._ff
        if ff is None:
            return False
        if ff["epoch"] is None or self.epoch == ff["epoch"]:
            if index < ff["batch"]:
                return True
        elif self.epoch is not None and self.epoch < ff["epoch"]:
            return True
        self._ff = None
        ff["on_live"]()
        return False

    def on_batch(self, batch: Any, index: int) -> Any:
        if self._boundary_due:
            self._boundary(self.epoch, index)
        with self._lock:
            self.batch = index + 1
            self.position_known = True
        for fn in self._batch_listeners:
            batch = fn(batch, index)
        return batch

    # ---------------------------------------------------------------- reports

    def position(self) -> dict:
        """``{"steps", "epoch", "batch", "known"}``: where the script is (after ``steps``
        optimizer steps, in ``epoch``, ``batch`` batches into it)."""
        with self._lock:
            return {"steps": self.steps, "epoch": self.epoch, "batch": self.batch,
                    "known": self.position_known or self.position_api}

    def describe_modules(self) -> list[dict]:
        """One entry per protected module: ``{"kind", "class", "parameters", "numel"}``."""
        out = []
        for m, k in zip(self.modules, self.module_kinds):
            ps = list(m.parameters())
            out.append({"kind": k, "class": type(m).__name__, "parameters": len(ps),
                        "numel": int(sum(_local(p).numel() for p in ps))})
        return out

    def weights_sha256(self) -> str | None:
        """sha256 over every protected module's parameters in ``named_parameters`` order, this
        rank's local part for sharded (DTensor) ones: bitwise, so two runs match only when every
        bit does.  None when no module is protected."""
        if not self.modules:
            return None
        h = hashlib.sha256()
        for m in self.modules:
            for name, p in m.named_parameters():
                t = _local(p).detach()
                h.update(name.encode())
                h.update(t.cpu().contiguous().view(-1).view(dtype=_byte_dtype()).numpy().tobytes())
        return h.hexdigest()


def decode_bucket_sync(tensors: list) -> list[list[int]]:
    """The bucket layout in what DDP's ``Reducer::sync_bucket_indices`` broadcasts
    (torch/csrc/distributed/c10d/reducer.cpp): first ``[index, ..., num_buckets]`` (int32, every
    parameter index, bucket after bucket), then the bucket sizes.  Returns one list of parameter
    indices per bucket; [] when the tensors do not have that shape."""
    try:
        idx = [int(x) for x in tensors[0][0].cpu().tolist()]
        sizes = [int(x) for x in tensors[1][0].cpu().tolist()]
    except (IndexError, AttributeError, TypeError, ValueError):
        return []
    if not idx or idx[-1] != len(sizes) or sum(sizes) != len(idx) - 1:
        return []
    out, i = [], 0
    for n in sizes:
        out.append(idx[i:i + n])
        i += n
    return out


def _rng_state() -> dict:
    import torch

    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(st: dict | None) -> None:
    """Restore what :func:`_rng_state` captured (None: nothing)."""
    import torch

    if not st:
        return
    torch.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _byte_dtype():
    import torch

    return torch.uint8


def _local(p: Any) -> Any:
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def _is_submodule(child: Any, parent: Any) -> bool:
    return child is not parent and any(m is child for m in parent.modules())


_tracker: Tracker | None = None
_patched: dict = {}


def tracker() -> Tracker:
    """The process's tracker (created on first use)."""
    global _tracker
    if _tracker is None:
        _tracker = Tracker()
    return _tracker


def set_position(epoch: int, batch: int) -> None:
    """Tell the hook where a script that feeds its own batches is: ``batch`` batches done in
    ``epoch``.  Call it once per step, before the forward pass."""
    t = tracker()
    with t._lock:
        t.epoch, t.batch, t.position_api = int(epoch), int(batch), True


def _path_of(f: Any) -> str | None:
    """The absolute path ``torch.save`` writes to: a path, or an open file's ``name``."""
    name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
    if not isinstance(name, (str, os.PathLike)):
        return None
    try:
        return os.path.abspath(os.fspath(name))
    except (TypeError, ValueError):
        return None


def _patch_renames(t: "Tracker") -> None:
    """``os.replace`` / ``os.rename`` (and so ``Path.replace``, ``shutil.move``) while a spare
    replays: the common atomic save (``torch.save(obj, tmp); os.replace(tmp, final)``) must not
    fail because the skipped save left no ``tmp`` (``FileNotFoundError`` ended the spare), nor
    move an empty ``tmp`` the script opened itself over the rank's good file.  A rename whose
    source is missing, or is a file a skipped ``torch.save`` was to write, is not done (and that
    file, truncated by the script's own ``open``, is removed): the rank this spare replaces
    already did it.  Outside a replay both are the originals."""
    if "renames" in _patched:
        return
    orig = {"replace": os.replace, "rename": os.rename}

    def wrap(name: str):
        real = orig[name]

        def renamed(src, dst, *args, **kwargs):
            if t.fast_forwarding and not args and not kwargs:
                where = _path_of(src)
                if where is not None and (where in t.ff_skipped_saves or not os.path.lexists(where)):
                    if where in t.ff_skipped_saves and os.path.lexists(where):
                        os.unlink(where)
                    log.info("os.%s(%s, %s) skipped while this spare replays the script (the rank already did it)",
                             name, src, dst)
                    return None
            return real(src, dst, *args, **kwargs)

        renamed.__wrapped__ = real  # type: ignore[attr-defined]
        renamed.__doc__ = real.__doc__
        return renamed

    os.replace, os.rename = wrap("replace"), wrap("rename")
    _patched["renames"] = orig


class _CountingIter:
    """The iterator a tracked DataLoader returns: counts the batches it yields."""

    def __init__(self, it, t: Tracker):
        self._it, self._t, self._n = it, t, 0

    def __iter__(self):
        return self

    def __next__(self):
        t = self._t
        if t._ff_skip_epoch():
            raise StopIteration
        while True:
            b = next(self._it)
            i, self._n = self._n, self._n + 1
            if not t._ff_check(i):
                return t.on_batch(b, i)
            with t._lock:
                t.batch = i + 1

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


def install() -> Tracker:
    """Patch DDP, fully_shard, DistributedSampler.set_epoch, DataLoader.__iter__, LRScheduler
    and register the optimizer step post-hook.  Idempotent; returns the tracker."""
    t = tracker()
    if _patched:
        return t
    import torch
    import torch.distributed.fsdp as fsdp_pkg
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.lr_scheduler import LRScheduler
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    ddp_init = DistributedDataParallel.__init__

    def ddp_init_tracked(self, module, *args, **kwargs):
        ddp_init(self, module, *args, **kwargs)
        t.on_module(module, "ddp")

    DistributedDataParallel.__init__ = ddp_init_tracked

    orig_fs = getattr(fsdp_pkg, "fully_shard", None)
    if orig_fs is not None:
        def fully_shard(module, *args, **kwargs):
            out = orig_fs(module, *args, **kwargs)
            for m in (module if isinstance(module, (list, tuple)) else [module]):
                t.on_module(m, "fsdp2")
            return out

        for attr in ("__doc__", "__name__", "__qualname__", "__module__"):
            try:
                setattr(fully_shard, attr, getattr(orig_fs, attr))
            except (AttributeError, TypeError):
                pass
        for attr in ("state", "register_fsdp_forward_method"):
            if hasattr(orig_fs, attr):
                setattr(fully_shard, attr, getattr(orig_fs, attr))
        fsdp_pkg.fully_shard = fully_shard
        _patched["fully_shard"] = orig_fs

    set_epoch = DistributedSampler.set_epoch

    def set_epoch_tracked(self, epoch):
        set_epoch(self, epoch)
        t.on_epoch(self, epoch)

    DistributedSampler.set_epoch = set_epoch_tracked

    dl_iter = DataLoader.__iter__

    def dl_iter_tracked(self):
        it = dl_iter(self)
        if isinstance(getattr(self, "sampler", None), DistributedSampler) or isinstance(
                getattr(getattr(self, "batch_sampler", None), "sampler", None), DistributedSampler):
            with t._lock:
                t.batch = 0
            return _CountingIter(it, t)
        return it

    DataLoader.__iter__ = dl_iter_tracked

    sched_init = LRScheduler.__init__

    def sched_init_tracked(self, *args, **kwargs):
        sched_init(self, *args, **kwargs)
        if not any(s is self for s in t.schedulers):
            t.schedulers.append(self)

    LRScheduler.__init__ = sched_init_tracked

    try:
        from torch._C._distributed_c10d import Reducer
    except ImportError:  # pragma: no cover - a torch without distributed
        Reducer = None
    if Reducer is not None and hasattr(Reducer, "_rebuild_buckets"):
        rebuild = Reducer._rebuild_buckets

        def rebuild_tracked(self):
            from torch_hooks import pg

            rec = t.ddp_bucket_replay[0] if t.ddp_bucket_replay else None
            cap = {"mode": "replay", "tensors": rec, "i": 0} if rec is not None else {"mode": "record", "pending": []}
            pg._capture.ddp_bucket_sync = cap
            try:
                done = rebuild(self)
            finally:
                pg._capture.ddp_bucket_sync = None
            if cap["mode"] == "replay" and cap["i"]:
                t.ddp_bucket_replay.pop(0)  # used: this reducer now has the job's layout
            if done and cap["mode"] == "record" and cap["pending"]:
                t.ddp_bucket_syncs.append([[x.clone() for x in ts] for ts in cap["pending"]])
                t.ddp_layouts.append(decode_bucket_sync(t.ddp_bucket_syncs[-1]))
            return done

        Reducer._rebuild_buckets = rebuild_tracked
        _patched["reducer"] = rebuild

        import torch.distributed as dist

        assign = dist._compute_bucket_assignment_by_size

        def assign_tracked(params, limits, *args, **kwargs):
            layout = t.ddp_layout_replay.pop(0) if t.ddp_layout_replay else None
            if layout is None or sum(len(b) for b in layout) != len(params):
                return assign(params, limits, *args, **kwargs)
            # DDP reverses what this returns (distributed.py: "reverse list of buckets"), so the
            # reducer gets the job's current layout exactly
            cap = max(limits) if limits else 25 << 20
            return list(reversed(layout)), [cap] * len(layout)

        dist._compute_bucket_assignment_by_size = assign_tracked
        _patched["assign"] = assign

    opt_init = torch.optim.Optimizer.__init__

    def opt_init_tracked(self, *args, **kwargs):
        opt_init(self, *args, **kwargs)
        t.on_optimizer(self)

    torch.optim.Optimizer.__init__ = opt_init_tracked

    save = torch.save

    def save_unless_replaying(*args, **kwargs):
        if t.fast_forwarding:
            f = args[1] if len(args) > 1 else kwargs.get("f")
            where = _path_of(f)
            if where is not None:
                t.ff_skipped_saves.add(where)
            log.info("torch.save%s skipped while this spare replays the script up to the rank's position",
                     f" to {where}" if where else "")
            return None
        return save(*args, **kwargs)

    save_unless_replaying.__doc__, save_unless_replaying.__wrapped__ = save.__doc__, save  # type: ignore[attr-defined]
    torch.save = save_unless_replaying
    _patch_renames(t)

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _patched["pre_hook"] = register_optimizer_step_pre_hook(lambda opt, *_a, **_k: t.on_step_start(opt))
    _patched["step_hook"] = register_optimizer_step_post_hook(lambda opt, *_a, **_k: t.on_step(opt))
    _patched.update(ddp=ddp_init, set_epoch=set_epoch, dl_iter=dl_iter, sched=sched_init)
    del torch
    return t
