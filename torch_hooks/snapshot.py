"""Step-aligned snapshots of an unmodified job, taken by the hook, and resuming from one.

:class:`Snapshotter` (started by :mod:`torch_hooks.bootstrap` in every worker) saves, at a step
boundary (the first batch fetch after an optimizer step, :mod:`torch_hooks.tracker`), each rank's
model, optimizer, LR schedulers, step, data position and RNG states, the same step on every
rank.  The layout on disk and what makes a snapshot complete: :mod:`torch_hooks.snapdir`.

**When.**

* Periodically: after every ``LINKPASS_SNAPSHOT_EVERY`` optimizer steps (``linkpass exec`` sets
  it from ``[snapshot] every_steps`` or ``--snapshot-every``; 0 or unset: never), into
  ``LINKPASS_SNAPSHOT_DIR`` (default ``./linkpass-snapshots`` of the worker), keeping the newest
  ``LINKPASS_SNAPSHOT_KEEP`` (default 3; 0 keeps all).  The step is a multiple of the interval:
  every rank knows it without asking.
* On request (``linkpass snapshot --job JOB [--to DIR]``): the request is generation ``g``
  (``add`` on ``snapshot/seq``) in the job's store, under ``linkpass/<job>/``:

  1. ``snapshot/<g>/req``: ``{"to": DIR or null}``; every rank's snapshot thread looks for it every
     :data:`POLL_S`;
  2. ``snapshot/<g>/prop/<rank>``: the rank's optimizer steps when its thread saw the request.
     From then on its training thread stops at its next step boundary until every proposal is
     in, so no rank is past ``max(proposals) + 1`` when it is known;
  3. ``S = max(proposals) + 1`` on every rank; each saves at boundary ``S``.

* Every snapshot (id ``g<g>`` or ``p<S>``): ``snapshot/<id>/part/<rank>`` when the rank's part is
  on disk (``ok``, ``bytes``, ``stall_ms``, ``write_ms``, ``error``), then rank 0 renames the
  directory, writes the marker and ``snapshot/<id>/result`` (``ok``, ``step``, ``path``,
  ``bytes``, ``stall_ms``, ``write_ms``, ``reason``).  A rank that does not write its part within
  ``LINKPASS_SNAPSHOT_TIMEOUT_S`` (default 300 s) fails the snapshot: its directory is removed, the
  result says which rank, and training goes on.  Each rank then reports ``snapshot`` to its daemon
  (``id``, ``step``, ``ok``, ``path``, ``bytes``, ``stall_ms``, ``write_ms``, ``reason``, ``scope``:
  ``snapshot`` from rank 0 for the whole job, ``part`` from the others; :mod:`linkpass.core.snapshots`).
* **Full disk.**  Before a part is written, the free space of its file system (``statvfs``) must be
  at least its tensors' bytes x :data:`SPACE_MARGIN` + :data:`SPACE_SLACK_BYTES`, else the part
  fails with "not enough space in DIR: the part needs about N bytes (M bytes of state), F bytes
  free".  A write that fails anyway (ENOSPC while it ran) fails the part the same way; its
  half-written files are removed at once, the rest of the snapshot by rank 0.

**How.**  ``torch.distributed.checkpoint.state_dict.get_state_dict`` per protected module and its
optimizers (FSDP2: DTensor shards), then ``dcp.async_save(..., no_dist=True)`` into the rank's own
part: the state is copied to CPU memory at the boundary (the training stall), and written by a
thread while training goes on.  ``no_dist``: DCP's planning collectives would run on the job's
process groups from another thread than the training thread, interleaved with the script's own
collectives.  Where ``async_save`` fails, the part is written with ``dcp.save`` (the reason is
logged once).  At most one snapshot per rank is in flight: the next boundary that wants one waits
for the previous one's part.

**Resume** (``LINKPASS_RESUME=DIR``, from ``linkpass exec --resume DIR``): :func:`prepare_resume`
checks the snapshot (complete, the same world size) before the script's first line, and the
script then runs as a spare's replay does (:meth:`torch_hooks.tracker.Tracker.fast_forward`):
earlier epochs yield no batch, the batches of the snapshot's epoch before its position are
skipped, ``torch.save`` does nothing; at the snapshot's batch each rank loads its part
(``dcp.load``, ``set_state_dict``), its RNG states and schedulers, and training goes on from step
``S``.

Times are ``time.monotonic_ns()``; ``*_ms`` milliseconds; bytes are file sizes on disk.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import errno
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

from torch_hooks import snapdir

log = logging.getLogger("linkpass.torch_hooks.snapshot")

#: how often the snapshot thread looks for a request (s): one store ``check`` per rank each time,
#: on the store every rank's controller already polls
POLL_S = 0.2
#: ... and, while a request is agreed or a part is in flight, for the other ranks' keys (s)
BUSY_POLL_S = 0.02
#: exit status of a worker that cannot resume from the snapshot it was given (EX_DATAERR)
EXIT_RESUME = 65
DEFAULT_DIR = "linkpass-snapshots"
#: a part needs about its tensors' bytes on disk, plus DCP's metadata and pickled extras: the free
#: space must be at least the state's bytes times this, plus SPACE_SLACK_BYTES, before it is written
SPACE_MARGIN = 1.1
SPACE_SLACK_BYTES = 1 << 20


def _quiet_dcp() -> None:
    """DCP warns on every ``no_dist`` save and load that it assumes one process: that is the intent
    here (each rank's part is a checkpoint of its own), so that one warning is not shown."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)


def _say(msg: str) -> None:
    print(f"linkpass: {msg}", file=sys.stderr, flush=True)


class SnapshotSettings:
    """The snapshot variables (see the module docstring).

    Raises:
        ValueError: a malformed variable, naming it.
    """

    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ

        def num(name: str, default: str, kind=int):
            raw = (env.get(name) or "").strip() or default
            try:
                v = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if v < 0:
                raise ValueError(f"{name}={raw!r} must be 0 or more")
            return v

        self.every = num("LINKPASS_SNAPSHOT_EVERY", "0")
        self.dir = os.path.abspath(env.get("LINKPASS_SNAPSHOT_DIR") or DEFAULT_DIR)
        self.keep = num("LINKPASS_SNAPSHOT_KEEP", "3")
        self.timeout_s = num("LINKPASS_SNAPSHOT_TIMEOUT_S", "300", float)
        self.use_async = (env.get("LINKPASS_SNAPSHOT_ASYNC") or "1").strip() != "0"
        self.resume = env.get("LINKPASS_RESUME") or None
        #: record each rank's weights sha256 in its part, and check it after a restore (hashing
        #: every parameter at the boundary: for demos and tests)
        self.verify = (env.get("LINKPASS_SNAPSHOT_VERIFY") or "").strip() == "1"


def _state_dicts(tracker: Any) -> dict:
    """``{"model<i>": ..., "optim<j>": ...}`` from ``get_state_dict`` (DTensors for FSDP2).

    Raises:
        RuntimeError: an optimizer whose parameters are in no protected module.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict = {}
    mods = list(tracker.modules)
    for i, m in enumerate(mods):
        out[f"model{i}"] = get_model_state_dict(m)
    for j, o in enumerate(tracker.optimizers):
        out[f"optim{j}"] = get_optimizer_state_dict(_owner(mods, o), o)
    return out


def _owner(mods: list, opt: Any) -> Any:
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    for m in mods:
        if first is not None and any(p is first for p in m.parameters()):
            return m
    raise RuntimeError(f"optimizer {type(opt).__name__} steps parameters of no protected module (DDP / fully_shard)")


def _real_save(obj: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        getattr(torch.save, "__wrapped__", torch.save)(obj, f)  # never the replay's no-op
        f.flush()
        os.fsync(f.fileno())


_tree_bytes = snapdir.tree_bytes


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what a rank writes of them.  A DTensor
    (FSDP2) counts its local shard only; other values (ints, param groups) are left to the slack."""
    n, stack = 0, [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        else:
            local = getattr(o, "_local_tensor", None)  # DTensor
            t = local if local is not None else o
            if hasattr(t, "element_size") and hasattr(t, "numel"):
                n += int(t.numel()) * int(t.element_size())
    return n


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system (statvfs ``f_bavail``).

    Raises:
        OSError: ``path`` cannot be looked at.
    """
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class NoSpace(OSError):
    """The file system of the snapshot directory cannot hold this rank's part (one line)."""


def check_space(rd: Path, state: int) -> int:
    """Refuse (:class:`NoSpace`) to write a part of ``state`` tensor bytes into ``rd`` when its
    file system has less than ``state * SPACE_MARGIN + SPACE_SLACK_BYTES`` free; returns that need."""
    need = int(state * SPACE_MARGIN) + SPACE_SLACK_BYTES
    free = free_bytes(rd)
    if free < need:
        raise NoSpace(errno.ENOSPC, f"not enough space in {rd.parent.parent}: the part needs about {need} bytes "
                      f"({state} bytes of state), {free} bytes free")
    return need


def error_line(err: BaseException) -> str:
    """One line for a part that was not written.  DCP wraps the writer's error in a
    ``CheckpointException`` whose text is a traceback: the first wrapped error is shown instead;
    an ``OSError`` as its strerror and file (``No space left on device: /snaps/...``)."""
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            err = inner
    if isinstance(err, NoSpace):
        return str(err.strerror)
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else str(err.strerror)
    text = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class Snapshotter:
    """See the module docstring.

    Args:
        settings: the controller's :class:`torch_hooks.controller.Settings` (rank, world size,
            job, store address).
        tracker: the process's :class:`torch_hooks.tracker.Tracker`.
        snap: :class:`SnapshotSettings`.
        client: the daemon client, for ``snapshot`` reports (None: no daemon).
    """

    def __init__(self, settings: Any, tracker: Any, snap: SnapshotSettings, client_fn=None):
        self.s, self.t, self.snap = settings, tracker, snap
        self._client_fn = client_fn or (lambda: None)
        self._kv = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_g = 1
        self._req: dict | None = None            # the request being agreed / waited for
        self._decided = threading.Event()
        self._inflight: dict | None = None       # a part being written (and, on rank 0, finished)
        self._idle = threading.Event()
        self._idle.set()
        self._async_ok = snap.use_async
        self.events: list[dict] = []              # this rank's snapshots (for the report)
        self.resume_event: dict | None = None     # the restore from LINKPASS_RESUME (for the report)
        self._registered = False
        tracker.add_boundary_listener(self.on_boundary)

    # ---------------------------------------------------------------- the store and the thread

    def start(self) -> bool:
        """Connect to the job's store, register the job on this host and start the thread
        (idempotent).  False when there is no store to reach (no MASTER_ADDR/MASTER_PORT)."""
        if self._thread is not None:
            return True
        if not (self.s.master_addr and self.s.master_port):
            return False
        import torch.distributed as dist

        from torch_hooks.pg import job_store, restart_attempt

        st = dist.TCPStore(self.s.master_addr, self.s.master_port, is_master=False,
                           timeout=datetime.timedelta(seconds=max(30.0, self.s.rebuild_timeout_s)))
        self._kv = job_store(st, self.s.job)
        if self.s.local_rank in (0, None):
            self._registered = snapdir.register_job({
                "job": self.s.job, "store": f"{self.s.master_addr}:{self.s.master_port}", "world_size": self.s.world_size,
                "pid": os.getpid(), "rank": self.s.rank, "host": self.s.host, "snapshot_dir": self.snap.dir,
                "attempt": restart_attempt()}) is not None
        self._thread = threading.Thread(target=self._run, name="linkpass-snapshot", daemon=True)
        self._thread.start()
        return True

    def close(self, wait_s: float = 30.0) -> None:
        """Wait (up to ``wait_s``) for a part in flight, then stop the thread."""
        self._idle.wait(wait_s)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        if self._registered:
            snapdir.unregister_job(self.s.job, os.getpid())

    def _run(self) -> None:
        try:  # here, not at the first snapshot's boundary: the import is most of a first stall
            import torch.distributed.checkpoint  # noqa: F401
            import torch.distributed.checkpoint.state_dict  # noqa: F401
        except ImportError as ex:  # the first snapshot says it
            log.debug("DCP not imported: %s", ex)
        while not self._stop.wait(BUSY_POLL_S if (self._req is not None or self._inflight is not None) else POLL_S):
            try:
                self._poll_request()
                self._poll_inflight()
            except Exception as ex:  # noqa: BLE001 - the store went away (end of the job) or a bug: never the script
                log.debug("snapshot thread: %s", ex)

    def _poll_request(self) -> None:
        kv = self._kv
        with self._lock:
            req = self._req
        if req is None:
            key = f"snapshot/{self._next_g}/req"
            if not kv.check([key]):
                return
            body = json.loads(kv.get(key))
            req = {"g": self._next_g, "to": body.get("to") if isinstance(body, dict) else None, "step": None,
                   "deadline": time.monotonic() + self.snap.timeout_s}
            with self._lock:
                self._req = req
                self._decided.clear()
            # the training thread stops at its next boundary from here, so the step read after
            # this is at least one less than any boundary it reaches before the decision
            kv.set(f"snapshot/{req['g']}/prop/{self.s.rank}", str(self.t.steps))
            log.info("snapshot request %d seen at step %d", req["g"], self.t.steps)
            return
        if req["step"] is not None or self._decided.is_set():
            return
        keys = [f"snapshot/{req['g']}/prop/{r}" for r in range(self.s.world_size)]
        if kv.check(keys):
            req["step"] = max(int(kv.get(k)) for k in keys) + 1
            self._decided.set()
        elif time.monotonic() > req["deadline"]:
            missing = [r for r, k in enumerate(keys) if not kv.check([k])]
            self._abandon(req, f"ranks {missing} did not answer within {self.snap.timeout_s:.0f} s")

    def _abandon(self, req: dict, why: str, write: bool = True) -> None:
        """Give request ``req`` up.  ``write``: say so in the store (the snapshot thread only: a
        store client is not shared between threads)."""
        _say(f"rank {self.s.rank}: snapshot request {req['g']} abandoned: {why}")
        if self.s.rank == 0 and write:
            try:
                self._kv.set(f"snapshot/g{req['g']}/result", json.dumps({"ok": False, "reason": why}))
            except Exception:  # noqa: BLE001,S110
                pass
        with self._lock:
            self._req = None
            self._next_g = req["g"] + 1
        self._decided.set()

    def _poll_inflight(self) -> None:
        f = self._inflight
        if f is None:
            return
        kv = self._kv
        if not f.get("part_sent"):
            if not f["future"].done():
                return
            err = f["future"].exception()
            f["write_ms"] = round((time.monotonic_ns() - f["t_write"]) / 1e6, 3)
            f["bytes"] = _tree_bytes(f["rank_dir"])
            part = {"ok": err is None, "bytes": f["bytes"], "stall_ms": f["stall_ms"], "write_ms": f["write_ms"],
                    "error": None if err is None else self._part_error(f, err)}
            kv.set(f"snapshot/{f['sid']}/part/{self.s.rank}", json.dumps(part))
            f["part_sent"] = True
            if err is not None:
                shutil.rmtree(f["rank_dir"], ignore_errors=True)  # half-written: never left behind
                _say(f"rank {self.s.rank}: snapshot at step {f['step']} not written: {part['error']}")
            if self.s.rank != 0:
                self._done(f, part)
                return
        keys = [f"snapshot/{f['sid']}/part/{r}" for r in range(self.s.world_size)]
        if not kv.check(keys):
            if time.monotonic() > f["deadline"]:
                missing = [r for r, k in enumerate(keys) if not kv.check([k])]
                self._finish(f, None, f"rank(s) {missing} did not write their part within {self.snap.timeout_s:.0f} s")
            return
        parts = {r: json.loads(kv.get(k)) for r, k in enumerate(keys)}
        bad = {r: p.get("error") for r, p in parts.items() if not p.get("ok")}
        self._finish(f, parts, "; ".join(f"rank {r}: {e}" for r, e in bad.items()) if bad else None)

    def _part_error(self, f: dict, err: BaseException) -> str:
        """:func:`error_line`, led by the free space when the file system has less than the part
        needed (a write that failed because the disk filled up while it ran)."""
        line = error_line(err)
        if isinstance(err, NoSpace) or not f.get("need"):
            return line
        try:
            free = free_bytes(f["rank_dir"] if f["rank_dir"].exists() else Path(f["root"]))
        except OSError:
            return line
        if free >= f["need"]:
            return line
        # torch's zip writer turns ENOSPC into "unexpected pos N vs M": the cause goes first
        return f"no space left in {f['root']}: {free} bytes free, the part needs about {f['need']} ({line})"

    def _finish(self, f: dict, parts: dict | None, failure: str | None) -> None:
        """Rank 0: make the snapshot complete, or remove it."""
        final = snapdir.final_path(f["root"], f["step"])
        res: dict = {"ok": False, "step": f["step"], "path": None, "id": f["sid"]}
        if failure is None:
            manifest = {"job": self.s.job, "step": f["step"], "world_size": self.s.world_size, "id": f["sid"],
                        "position": f["position"], "position_known": f["position_known"],
                        "bytes": sum(p["bytes"] for p in parts.values()),
                        "stall_ms": max(p["stall_ms"] for p in parts.values()),
                        "write_ms": max(p["write_ms"] for p in parts.values()),
                        "ranks": {str(r): p for r, p in parts.items()}, "created": time.time()}
            try:
                snapdir.finalize(f["tmp"], final, manifest)
            except OSError as ex:
                failure = f"cannot complete {final}: {ex.strerror or ex}"
            else:
                res.update(ok=True, path=str(final), bytes=manifest["bytes"], stall_ms=manifest["stall_ms"],
                           write_ms=manifest["write_ms"])
                removed = snapdir.cleanup(f["root"], f["step"], self.snap.keep, active=None)
                if removed:
                    log.info("snapshots removed from %s: %s", f["root"], ", ".join(removed))
        if failure is not None:
            shutil.rmtree(f["tmp"], ignore_errors=True)
            res["reason"] = failure
            _say(f"snapshot at step {f['step']} failed, nothing kept: {failure}")
        else:
            _say(f"snapshot at step {f['step']} complete: {final} ({res['bytes']} bytes, stall {res['stall_ms']:.1f} ms, "
                 f"write {res['write_ms']:.1f} ms)")
        self._kv.set(f"snapshot/{f['sid']}/result", json.dumps(res))
        self._done(f, res)

    def _done(self, f: dict, res: dict) -> None:
        ev = {"event": "snapshot", "id": f["sid"], "step": f["step"], "ok": bool(res.get("ok")),
              "bytes": res.get("bytes", f.get("bytes")), "stall_ms": f["stall_ms"], "write_ms": f.get("write_ms"),
              "path": res.get("path"), "reason": res.get("reason") or res.get("error"),
              "scope": "snapshot" if self.s.rank == 0 else "part"}
        self.events.append(ev)
        client = self._client_fn()
        if client is not None:
            client.report("snapshot", **{k: v for k, v in ev.items() if k != "event"})
        self._inflight = None
        self._idle.set()

    # ---------------------------------------------------------------- the training thread

    def on_boundary(self, steps: int) -> None:
        """At every step boundary (training thread): take the snapshot due here, if any."""
        t0 = time.monotonic_ns()  # the stall counts the wait for the other ranks' proposals too
        if self._thread is None and not self.start():
            if self.snap.every and steps == self.snap.every:
                _say("snapshots need the job's store (MASTER_ADDR/MASTER_PORT); none taken")
            return
        with self._lock:
            req = self._req
        if req is not None:
            if not self._decided.wait(max(0.0, req["deadline"] - time.monotonic())):
                self._abandon(req, "the ranks' proposals did not all arrive", write=False)
                req = None
            with self._lock:
                req = self._req
        taken = False
        if req is not None and req["step"] is not None:
            if req["step"] == steps:
                with self._lock:
                    self._req = None
                    self._next_g = req["g"] + 1
                self.take(f"g{req['g']}", steps, req.get("to") or self.snap.dir, t0)
                taken = True
            elif req["step"] < steps:  # cannot happen while ranks stop at their boundary; said if it does
                self._abandon(req, f"this rank is at step {steps}, past the agreed step {req['step']}", write=False)
        if not taken and self.snap.every and steps % self.snap.every == 0:
            self.take(f"p{steps}", steps, self.snap.dir, t0)

    def take(self, sid: str, step: int, root: str, t0: int | None = None) -> None:
        """Save this rank's part of snapshot ``sid`` after ``step`` into ``root`` (training thread,
        at the boundary; ``t0``: when the boundary was reached, for the stall).  Never raises: a
        failure becomes the part's error."""
        t0 = time.monotonic_ns() if t0 is None else t0
        if not self._idle.wait(self.snap.timeout_s):
            _say(f"rank {self.s.rank}: snapshot at step {step} skipped: the previous one is still being written")
            return
        self._idle.clear()
        root = os.path.abspath(root)
        tmp = snapdir.tmp_path(root, step, sid)
        rd = snapdir.rank_dir(tmp, self.s.rank)
        pos = dict(self.t.boundary_pos)
        f = {"sid": sid, "step": step, "root": root, "tmp": tmp, "rank_dir": rd, "position": pos,
             "position_known": bool(self.t.position()["known"]), "deadline": time.monotonic() + self.snap.timeout_s}
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            rd.mkdir(parents=True, exist_ok=True)
            extra = {"step": step, "rank": self.s.rank, "world_size": self.s.world_size, "position": pos,
                     "position_known": f["position_known"], "rng": self.t.boundary_rng,
                     "schedulers": [s.state_dict() for s in self.t.schedulers], "ddp_layouts": self.t.ddp_layouts,
                     "weights_sha256": self.t.weights_sha256() if self.snap.verify else None}
            _real_save(extra, rd / snapdir.EXTRA)
            with self.t.muted():
                sd = _state_dicts(self.t)
            f["need"] = check_space(rd, state_bytes(sd))
            fut = self._save(sd, rd)
        except Exception as ex:  # noqa: BLE001 - a full disk, a bug: the part fails, training goes on
            log.debug("snapshot part failed", exc_info=True)
            fut.set_exception(ex)
        f["stall_ms"] = round((time.monotonic_ns() - t0) / 1e6, 3)
        f["t_write"] = t0
        f["future"] = fut
        self._inflight = f

    def _save(self, sd: dict, rd: Path) -> concurrent.futures.Future:
        import torch.distributed.checkpoint as dcp

        _quiet_dcp()
        if self._async_ok:
            try:
                out = dcp.async_save(sd, checkpoint_id=str(rd), no_dist=True)
                return getattr(out, "upload_completion", out)
            except Exception as ex:  # noqa: BLE001 - then synchronously, said once
                self._async_ok = False
                log.warning("dcp.async_save failed (%s: %s); snapshots are written with dcp.save (training waits for "
                            "the write)", type(ex).__name__, str(ex).splitlines()[0][:200] if str(ex) else "")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            dcp.save(sd, checkpoint_id=str(rd), no_dist=True)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as ex:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: the part fails
            fut.set_exception(ex)
            return fut
        fut.set_result(None)
        return fut


# --------------------------------------------------------------------------- resume


class ResumeRefused(Exception):
    """The snapshot given to ``--resume`` cannot be used by this worker; one line."""


def prepare_resume(settings: Any, tracker: Any, path: str, exit_fn, holder: Any = None) -> dict:
    """Check the snapshot for this worker and arrange its restore at the snapshot's batch.

    Returns the manifest.  ``holder.resume_event`` (a :class:`Snapshotter`) gets ``{"event":
    "resume", "path", "step", "restore_ms", "weights_sha256_snapshot", "weights_sha256_restored",
    "match"}`` once restored (the hashes with ``LINKPASS_SNAPSHOT_VERIFY=1`` at snapshot time,
    else None; a mismatch stops the worker).

    Raises:
        ResumeRefused: an incomplete snapshot, another world size, no data position, or this
            rank's part unreadable.
    """
    import torch

    try:
        snap = snapdir.resolve(path)
        m = snapdir.read_manifest(snap)
    except snapdir.SnapshotError as e:
        raise ResumeRefused(f"--resume: {e}") from None
    if m["world_size"] != settings.world_size:
        raise ResumeRefused(f"--resume {snap}: the snapshot is of world size {m['world_size']}, this job has world size "
                            f"{settings.world_size}; a snapshot is restored by a job of the same world size")
    if not m.get("position_known"):
        raise ResumeRefused(f"--resume {snap}: the snapshot has no data position (the script does not iterate a "
                            "DataLoader over a DistributedSampler): the job could not go on at its batch")
    rd = snapdir.rank_dir(snap, settings.rank)
    try:
        with open(rd / snapdir.EXTRA, "rb") as f:
            extra = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - one line
        raise ResumeRefused(f"--resume {snap}: rank {settings.rank}'s part cannot be read ({e})") from None
    bad = part_files_problem(rd)
    if bad:
        raise ResumeRefused(f"--resume {snap}: {bad}")
    pos = extra["position"]
    step = int(extra["step"])
    with tracker._lock:
        tracker.steps = step
        tracker.boundary_pos = dict(pos)
    tracker.ddp_layout_replay = [x for x in extra.get("ddp_layouts") or [] if x]
    state = {"done": False}

    def on_live() -> None:
        t0 = time.monotonic_ns()
        if pos.get("epoch") is not None and tracker.epoch is not None and tracker.epoch != pos["epoch"]:
            # e.g. the script loaded a checkpoint of its own and starts at a later epoch
            exit_fn(EXIT_RESUME, f"rank {settings.rank}: the script reached epoch {tracker.epoch} before the snapshot's "
                    f"epoch {pos['epoch']} (did it resume from a checkpoint of its own?); not resuming on other data")
            return
        try:
            _restore(tracker, rd, extra)
            want = extra.get("weights_sha256")
            got = tracker.weights_sha256() if want else None
            ev = {"event": "resume", "path": str(snap), "step": step, "restore_ms": round((time.monotonic_ns() - t0) / 1e6, 3),
                  "weights_sha256_snapshot": want, "weights_sha256_restored": got, "match": None if not want else got == want}
            if holder is not None:
                holder.resume_event = ev
            if want and got != want:
                raise RuntimeError(f"the restored weights (sha256 {got[:12]}...) are not the snapshot's ({want[:12]}...)")
        except _restore_errors() as ex:  # one exit path, never a traceback into the script
            log.debug("restore failed", exc_info=True)
            exit_fn(EXIT_RESUME, f"rank {settings.rank}: cannot restore from {snap}: {restore_failure(ex, rd)}")
            return
        state["done"] = True
        if settings.rank == 0 or settings.local_rank in (0, None):
            _say(f"rank {settings.rank} resumed from {snap} at step {step} (epoch {pos.get('epoch')}, batch {pos.get('batch')})")

    def on_step(steps: int) -> None:
        if not state["done"]:
            exit_fn(EXIT_RESUME, f"rank {settings.rank}: the script stepped its optimizer before reaching the snapshot's "
                    f"batch (epoch {pos.get('epoch')}, batch {pos.get('batch')}); it does not run as the snapshotted job did")

    def not_reached() -> str | None:
        if state["done"]:
            return None
        now = tracker.position()
        return (f"--resume {snap}: the script ended at epoch {now['epoch']}, batch {now['batch']} (its last position) "
                f"without reaching the snapshot's step {step} (epoch {pos.get('epoch')}, batch {pos.get('batch')}): "
                "nothing was restored or trained (fewer epochs or samples than the snapshotted run?)")

    tracker.add_step_listener(on_step)
    tracker.fast_forward(pos.get("epoch"), int(pos.get("batch") or 0), on_live)
    if holder is not None:
        holder.resume_not_reached = not_reached
    return m


def resume_not_reached(holder: Any) -> str | None:
    """At the script's end: one line when ``holder`` (a :class:`Snapshotter` given to
    :func:`prepare_resume`) was to restore a snapshot and the script never reached its batch
    (it ran fewer epochs, steps or samples than the snapshotted run), else None.  The worker then
    exits :data:`EXIT_RESUME`: a run that restored nothing and trained nothing is not a success."""
    fn = getattr(holder, "resume_not_reached", None)
    return fn() if callable(fn) else None


def _restore_errors() -> tuple:
    """What a restore may raise: DCP's ``CheckpointException`` derives from ``BaseException``
    (torch/distributed/checkpoint/api.py), so ``except Exception`` alone misses a cut-off shard."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return (Exception,)
    return (Exception, CheckpointException)


def restore_failure(ex: BaseException, rd: Path) -> str:
    """One line for a failed restore of the part in ``rd``: the part's files with what is wrong
    with them (:func:`part_files_problem`) when that explains it, else the error's first line
    (for a ``CheckpointException``, the first rank's underlying error rather than its
    multi-line, traceback-carrying text)."""
    bad = part_files_problem(rd)
    if bad:
        return bad
    cause = ex
    failures = getattr(ex, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        cause = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else cause
    text = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
    files = sorted(p.name for p in rd.glob("*.distcp"))
    where = f"{rd.name}/{files[0]}" if len(files) == 1 else f"{rd.name}/{{{','.join(files)}}}" if files else rd.name
    return f"{where} cannot be loaded: {type(cause).__name__}: {text}"


def part_files_problem(rd: Path) -> str | None:
    """One line when a file of the DCP part in ``rd`` is missing or shorter than its
    ``.metadata`` says (a cut-off copy or a full disk), naming ``rank-R/FILE``; None when every
    file is long enough (the contents are not checked: DCP has no checksums) or the metadata
    cannot be read (then ``dcp.load`` says why)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(rd)).read_metadata().storage_data
    except Exception:  # noqa: BLE001 - the load says it
        return None
    need: dict[str, int] = {}
    for info in (storage or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, n in sorted(need.items()):
        f = rd / rel
        try:
            size = f.stat().st_size
        except OSError:
            return f"{rd.name}/{rel} is missing (the part's .metadata names it)"
        if size < n:
            return f"{rd.name}/{rel} is cut off: {size} bytes, the part's .metadata needs {n}"
    return None


def _restore(tracker: Any, rd: Path, extra: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from torch_hooks import tracker as tr

    _quiet_dcp()
    with tracker.muted():  # get_optimizer_state_dict steps a fresh optimizer once with zero grads
        sd = _state_dicts(tracker)
    dcp.load(sd, checkpoint_id=str(rd), no_dist=True)
    mods = list(tracker.modules)
    with tracker.muted():
        for i, m in enumerate(mods):
            set_model_state_dict(m, sd[f"model{i}"])
        for j, o in enumerate(tracker.optimizers):
            set_optimizer_state_dict(_owner(mods, o), o, sd[f"optim{j}"])
    scheds = extra.get("schedulers") or []
    if len(scheds) != len(tracker.schedulers):
        raise RuntimeError(f"the snapshot has {len(scheds)} LR schedulers, the script made {len(tracker.schedulers)}")
    for s, st in zip(tracker.schedulers, scheds):
        s.load_state_dict(st)
    tr.set_rng_state(extra.get("rng"))
