"""In-memory snapshots for sharded jobs: each rank's shard of the last snapshot in host memory,
and a copy in the host memory of a peer on another host (Gemini, SOSP 2023: "Gemini: Fast
Failure Recovery in Distributed Training with In-Memory Checkpoints").

Why: a rank of a sharded job (FSDP2) holds the only copy of its shard.  When its GPU fails, a
warm spare cannot take a replica's state (there is none, :mod:`torch_hooks.handover`); without a
copy the job restarts from the last disk checkpoint.  With ``LINKPASS_SNAPSHOT_IN_MEMORY=1``
(``linkpass exec --snapshot-in-memory``, ``[snapshot] in_memory = true``) the job instead goes
back to the last in-memory snapshot whose copies are all held and redoes the steps since then
(at most ``LINKPASS_SNAPSHOT_MEMORY_EVERY`` steps plus the one in progress, or twice the interval
when the newest snapshot's copy to its holder was still in flight).

**Taking one** (:meth:`MemorySnapshots.on_boundary`, the training thread, at every step boundary
whose step is a multiple of the interval): the rank's model and optimizer state (its local
shards for DTensors), LR schedulers, RNG states and position (with each process group's
sequence number at the boundary) are copied to CPU memory; that copy is the training stall.  A
thread then serialises it (``torch.save``) into this host's memory directory (``MEMORY_DIR``:
tmpfs, ``/dev/shm/linkpass-<uid>/<job>/<host>``, RAM that outlives the process: a survivor
that re-executes itself finds it again) and sends it to its *holder* through the job's store
(``memsnap/<ns>/<S>/<rank>/<i>`` chunks, ``.../n`` last); the holder's thread writes it into
its own host's directory, deletes the keys and sets ``memsnap/<ns>/<S>/held/<rank>``.  The
holder of rank ``r`` is the next rank in ring order ``r+1, r+2, ...`` on another host (ranks
announce their host under ``memsnap/host/<rank>``); with every rank on one host, the next rank
(said once: that copy does not survive the host).  ``ns`` is the rollback generation (0, then
the process-group epoch of the last rollback), so keys of a step taken again after a rollback
are new.

Each rank keeps its own part and the copies it holds of the newest :data:`KEEP` snapshots:
host memory used is about ``2 * KEEP`` times the rank's state.  Before the first snapshot the
rank checks that this fits in ``MemAvailable`` (``/proc/meminfo``) and in the directory's file
system; if not, in-memory snapshots are off with one line (training goes on).

**Using one** after a device fault (:mod:`torch_hooks.controller`): the faulty rank picks the
newest snapshot step ``S`` whose every part is held (``held/<r>`` for every rank), hands its
rank to a spare with ``{"kind": "rollback", "step": S, "ns", "holder"}``; the holder puts the
faulty rank's part in the store for the spare (:func:`torch_hooks.handover.put_state`); every
survivor re-executes itself (``execve``, the same pid: torchrun's agent sees nothing) with
``LINKPASS_ROLLBACK`` naming its own part, and replays the script to ``S`` as a spare does;
the spare takes the faulty rank's part.  All ranks join the rebuilt process groups at the
sequence numbers of boundary ``S`` and train on from there.

Times are ``time.monotonic_ns()``; ``*_ms`` milliseconds; sizes bytes.
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("linkpass.torch_hooks.memsnap")

#: snapshots kept per rank (own part and held copies): the newest may be incomplete at a fault
KEEP = 2
#: default interval (optimizer steps) when in-memory snapshots are on and no interval is given
DEFAULT_EVERY = 10
#: host memory kept free beyond the snapshots (bytes): the job and the system need some too
MEM_RESERVE = 1 << 30
#: the holder's thread looks for incoming copies this often (s)
POLL_S = 0.05
#: the newest events kept for the worker's report
MAX_EVENTS = 200
#: store chunk size (bytes; the store's values are sent whole)
CHUNK_BYTES = 4 << 20


def _say(msg: str) -> None:
    print(f"linkpass: {msg}", file=sys.stderr, flush=True)


def default_dir(job: str, host: str) -> Path:
    """This host's in-memory snapshot directory for ``job`` (tmpfs where there is one)."""
    base = os.environ.get("LINKPASS_SNAPSHOT_MEMORY_DIR") or (
        f"/dev/shm/linkpass-{os.getuid()}" if os.path.isdir("/dev/shm") else f"/tmp/linkpass-mem-{os.getuid()}")
    return Path(base) / _safe(job) / _safe(host)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(name)) or "_"


def own_file(d: Path, ns: int, step: int, rank: int) -> Path:
    return d / f"own-n{ns}-s{step}-r{rank}.pt"


def held_file(d: Path, ns: int, step: int, rank: int) -> Path:
    return d / f"held-n{ns}-s{step}-r{rank}.pt"


class MemorySettings:
    """``LINKPASS_SNAPSHOT_IN_MEMORY`` (``1``: on), ``LINKPASS_SNAPSHOT_MEMORY_EVERY`` (steps,
    default :data:`DEFAULT_EVERY`), ``LINKPASS_SNAPSHOT_MEMORY_DIR`` (the base directory).

    Raises:
        ValueError: a malformed variable, naming it.
    """

    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        raw = (env.get("LINKPASS_SNAPSHOT_IN_MEMORY") or "").strip().lower()
        if raw not in ("", "0", "1", "true", "false", "yes", "no"):
            raise ValueError(f"LINKPASS_SNAPSHOT_IN_MEMORY={raw!r} is not 0 or 1")
        self.enabled = raw in ("1", "true", "yes")
        every = (env.get("LINKPASS_SNAPSHOT_MEMORY_EVERY") or "").strip()
        try:
            self.every = int(every) if every else DEFAULT_EVERY
        except ValueError:
            raise ValueError(f"LINKPASS_SNAPSHOT_MEMORY_EVERY={every!r} is not a number") from None
        if self.every < 1:
            raise ValueError(f"LINKPASS_SNAPSHOT_MEMORY_EVERY={every!r} must be 1 or more")


def cpu_copy(x: Any) -> Any:
    """``x`` with every tensor replaced by a CPU copy (DTensors by a copy of this rank's local
    shard): a state that later training cannot change and a spare of the same rank can load."""
    import torch

    if hasattr(x, "to_local") and hasattr(x, "placements"):
        return x.to_local().detach().to("cpu", copy=True)
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: cpu_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(cpu_copy(v) for v in x)
    return x


def capture(tracker: Any, groups: list) -> dict:
    """This rank's state at its last step boundary (training thread, at the boundary), in the
    layout :func:`torch_hooks.handover._apply_state` loads: ``modules``, ``optimizers``,
    ``schedulers``, ``rng``, ``position`` (``steps``, ``epoch``, ``batch``, ``boundary_seqs`` per
    group in creation order, ``ddp_layouts``), ``ddp_bucket_syncs``."""
    import copy

    with tracker.muted():
        mods = [cpu_copy(m.state_dict()) for m in tracker.modules]
        opts = [cpu_copy(o.state_dict()) for o in tracker.optimizers]
    return {"modules": mods, "optimizers": opts,
            "schedulers": [copy.deepcopy(s.state_dict()) for s in tracker.schedulers],
            "rng": tracker.boundary_rng,
            "position": dict(tracker.boundary_pos, boundary_seqs=[g.boundary_seq for g in groups],
                             ddp_layouts=tracker.ddp_layouts),
            "ddp_bucket_syncs": list(getattr(tracker, "ddp_bucket_syncs", []) or [])}


def serialise(blob: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    getattr(torch.save, "__wrapped__", torch.save)(blob, buf)  # the real torch.save, never the replay's
    return buf.getvalue()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None: not readable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def holder_of(rank: int, hosts: dict[int, str]) -> int:
    """The rank that holds ``rank``'s copy: the next in ring order on another host, else the
    next rank.  ``hosts``: rank -> host name for every rank."""
    w = len(hosts)
    for k in range(1, w):
        r = (rank + k) % w
        if hosts[r] != hosts[rank]:
            return r
    return (rank + 1) % w


def held_by(rank: int, hosts: dict[int, str]) -> list[int]:
    """The ranks whose copies ``rank`` holds."""
    return [r for r in hosts if r != rank and holder_of(r, hosts) == rank]


class MemorySnapshots:
    """See the module docstring.

    Args:
        settings: the controller's :class:`torch_hooks.controller.Settings`.
        tracker: the :class:`torch_hooks.tracker.Tracker`.
        controller: the :class:`torch_hooks.controller.Controller` (its groups' sequence numbers,
            the client for reports).
        mem: :class:`MemorySettings`.
        ns: the rollback generation (0 in a fresh worker).
    """

    def __init__(self, settings: Any, tracker: Any, controller: Any, mem: MemorySettings, ns: int = 0):
        self.s, self.t, self.ctl, self.mem, self.ns = settings, tracker, controller, mem, ns
        self.dir = default_dir(settings.job, settings.host)
        self._kv = None
        self._hosts: dict[int, str] | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: list[tuple[int, dict, int]] = []   # (step, blob, t0) to serialise and send
        self._expect: list[int] = []                    # steps whose held copies are still to come
        self.taken: list[int] = []                      # steps of this rank's parts, newest last
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)  # for the report
        self.off_reason: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned_same_host = False
        tracker.add_boundary_listener(self.on_boundary)

    # ---------------------------------------------------------------- setup

    def _start(self) -> bool:
        if self._thread is not None:
            return True
        if self.off_reason:
            return False
        if not (self.s.master_addr and self.s.master_port):
            self._off("in-memory snapshots need the job's store (MASTER_ADDR/MASTER_PORT)")
            return False
        import torch.distributed as dist

        from torch_hooks.pg import job_store

        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            st = dist.TCPStore(self.s.master_addr, self.s.master_port, is_master=False,
                               timeout=datetime.timedelta(seconds=max(30.0, self.s.rebuild_timeout_s)))
            self._kv = job_store(st, self.s.job)
            self._kv.set(f"memsnap/host/{self.s.rank}", self.s.host)
        except Exception as e:  # noqa: BLE001 - training goes on without them
            self._off(f"in-memory snapshots off: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
            return False
        self._thread = threading.Thread(target=self._run, name="linkpass-memsnap", daemon=True)
        self._thread.start()
        return True

    def _off(self, why: str) -> None:
        if self.off_reason is None:
            self.off_reason = why
            _say(f"rank {self.s.rank}: {why}")

    def hosts(self, timeout_s: float = 60.0) -> dict[int, str]:
        if self._hosts is None:
            keys = [f"memsnap/host/{r}" for r in range(self.s.world_size)]
            self._kv.wait(keys, datetime.timedelta(seconds=timeout_s))
            self._hosts = {r: self._kv.get(k).decode() for r, k in enumerate(keys)}
            h = holder_of(self.s.rank, self._hosts)
            if self._hosts[h] == self.s.host and not self._warned_same_host:
                self._warned_same_host = True
                _say(f"rank {self.s.rank}: every rank is on host {self.s.host}: the copy of this rank's shard is kept by "
                     f"rank {h} on the same host (it survives a GPU fault, not the loss of the host)")
        return self._hosts

    # ---------------------------------------------------------------- the training thread

    def on_boundary(self, steps: int) -> None:
        """At every step boundary (training thread): copy this rank's state to CPU memory when
        ``steps`` is a multiple of the interval."""
        if not self.mem.enabled or steps <= 0 or steps % self.mem.every or self.t.fast_forwarding:
            return
        if not self._start():
            return
        t0 = time.monotonic_ns()
        try:
            blob = capture(self.t, list(self.ctl.groups))
        except Exception as e:  # noqa: BLE001 - a snapshot never breaks training
            self._off(f"in-memory snapshot at step {steps} not taken: {str(e).splitlines()[0][:200]}")
            return
        stall_ms = round((time.monotonic_ns() - t0) / 1e6, 3)
        if not self.taken and not self._fits(blob):
            return
        with self._work:
            if self._queue:  # the previous one is still being sent: this one replaces it
                log.warning("in-memory snapshot of step %d dropped: step %d is here before it was sent",
                            self._queue[-1][0], steps)
                self._queue.clear()
            self._queue.append((steps, blob, t0))
            self._expect = [*self._expect, steps][-(KEEP + 1):]
            self._work.notify_all()
        self.events.append({"event": "memory_snapshot", "step": steps, "stall_ms": stall_ms})

    def _fits(self, blob: dict) -> bool:
        n = sum(t.numel() * t.element_size() for t in _tensors(blob))
        need = 2 * KEEP * n
        avail = mem_available()
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = None
        if avail is not None and need + MEM_RESERVE > avail:
            self._off(f"in-memory snapshots off: this rank's part ({n} bytes) needs {need} bytes of host memory "
                      f"({KEEP} snapshots, own part and a peer's copy) and {avail} are available")
            return False
        if free is not None and need > free:
            self._off(f"in-memory snapshots off: {self.dir} has {free} bytes free, {need} needed")
            return False
        return True

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._work:
                job = self._queue.pop(0) if self._queue else None
                if job is None:
                    self._work.wait(POLL_S)
            try:
                if job is not None:
                    self._send(*job)
                self._receive()
            except Exception as e:  # noqa: BLE001 - the store went away (job ending) or a full tmpfs
                if not self._stop.is_set():
                    self._off(f"in-memory snapshots off: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
                return

    def _send(self, step: int, blob: dict, t0: int) -> None:
        data = serialise(blob)
        _write(own_file(self.dir, self.ns, step, self.s.rank), data)
        kv = self._kv
        n = max(1, (len(data) + CHUNK_BYTES - 1) // CHUNK_BYTES)
        base = f"memsnap/{self.ns}/{step}/{self.s.rank}"
        for i in range(n):
            kv.set(f"{base}/{i}", data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
        kv.set(f"{base}/n", str(n))
        with self._lock:
            self.taken.append(step)
            old = self.taken[:-KEEP]
            self.taken = self.taken[-KEEP:]
        for s in old:
            own_file(self.dir, self.ns, s, self.s.rank).unlink(missing_ok=True)
        self.events.append({"event": "memory_snapshot_sent", "step": step, "bytes": len(data),
                            "write_ms": round((time.monotonic_ns() - t0) / 1e6, 3)})

    def _receive(self) -> None:
        with self._lock:
            steps = list(self._expect)
        if not steps:
            return
        hosts = self.hosts()
        srcs = held_by(self.s.rank, hosts)
        kv = self._kv
        for step in steps:
            pending = [r for r in srcs if not held_file(self.dir, self.ns, step, r).exists()]
            for r in pending:
                base = f"memsnap/{self.ns}/{step}/{r}"
                if not kv.check([f"{base}/n"]):
                    continue
                n = int(kv.get(f"{base}/n"))
                data = b"".join(kv.get(f"{base}/{i}") for i in range(n))
                _write(held_file(self.dir, self.ns, step, r), data)
                for i in range(n):
                    kv.delete_key(f"{base}/{i}")
                kv.delete_key(f"{base}/n")
                kv.set(f"memsnap/{self.ns}/{step}/held/{r}", str(self.s.rank))
            if all(held_file(self.dir, self.ns, step, r).exists() for r in srcs):
                with self._lock:
                    self._expect.remove(step)
                keep = sorted({step, *self._held_steps()})[-KEEP:]
                for f in self.dir.glob(f"held-n{self.ns}-s*-r*.pt"):
                    try:
                        s = int(f.name.split("-s", 1)[1].split("-", 1)[0])
                    except ValueError:
                        continue
                    if s not in keep:
                        f.unlink(missing_ok=True)

    def _held_steps(self) -> list[int]:
        out = set()
        for f in self.dir.glob(f"held-n{self.ns}-s*-r*.pt"):
            try:
                out.add(int(f.name.split("-s", 1)[1].split("-", 1)[0]))
            except ValueError:
                pass
        return sorted(out)

    # ---------------------------------------------------------------- after a fault

    def usable_step(self, kv: Any) -> int | None:
        """The newest snapshot step whose every rank's part is held by its holder (None: none)."""
        with self._lock:
            steps = sorted(set(self.taken), reverse=True)
        for s in steps:
            if kv.check([f"memsnap/{self.ns}/{s}/held/{r}" for r in range(self.s.world_size)]):
                return s
        return None

    def close(self, remove: bool = True) -> None:
        """Stop the thread; with ``remove``, delete this rank's parts and the copies it holds
        (the job ended normally: nothing needs them)."""
        self._stop.set()
        with self._work:
            self._work.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        if remove:
            for pat in (f"own-n*-s*-r{self.s.rank}.pt", *(f"held-n*-s*-r{r}.pt" for r in self._held_ranks())):
                for f in self.dir.glob(pat):
                    f.unlink(missing_ok=True)

    def _held_ranks(self) -> list[int]:
        if self._hosts is None:
            return []
        return held_by(self.s.rank, self._hosts)


def _tensors(x: Any):
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def read_part(path: Path) -> bytes:
    """A part's bytes.

    Raises:
        OSError: the file is gone (its host's memory directory was cleaned)."""
    with open(path, "rb") as f:
        return f.read()


def rollback_env(environ: dict, info: dict, spare_pids: list[int]) -> dict:
    """The environment of a survivor re-executing itself to roll back: ``LINKPASS_ROLLBACK``
    (``{"epoch", "step", "ns", "file", "trigger_t_ns", "at_step"}``), ``LINKPASS_SPARE_PIDS``
    (its warm spares, still its children), and no ``LINKPASS_RESUME`` (the state comes from the
    rollback part)."""
    env = dict(environ)
    env.pop("LINKPASS_RESUME", None)
    env["LINKPASS_ROLLBACK"] = json.dumps(info)
    if spare_pids:
        env["LINKPASS_SPARE_PIDS"] = ",".join(str(p) for p in spare_pids)
    return env
