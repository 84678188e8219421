"""A warm spare process takes a rank over, in an unmodified script (``linkpass exec --spares N``).

Why a process: NCCL reads its HCA list once per process (shared/NCCL-REFERENCE.md 1.7), so a
rank whose own rail died cannot rebuild in-process; and a rank whose GPU failed cannot go on at
all.  Either way a fresh process takes its place, with the rank's state, at the step boundary
the rank had reached, and the other ranks rebuild in-process and issue their interrupted
collectives again (0 steps lost).

**Spares.**  Each worker started under ``linkpass exec --spares N`` starts N copies of itself
(:func:`spawn_spares`: the same command line, ``sys.orig_argv``, with ``LINKPASS_SPARE=1``).  A
spare imports torch, the hook and the script's top-level imports (parsed with :mod:`ast`, not
run), announces itself in the job's store (:class:`torch_hooks.spare.Spare`) and waits; it has
not initialised NCCL or CUDA.

**Hand-over** (epoch ``e`` of the controller, keys under ``linkpass/<job>/``):

* ``handover/<e>/<rank>``: ``{"kind": "latched"|"planned"|"device", "rank", "spare", "src"}``: rank is
  replaced, by which spare, and whose state it takes (``src``: the rank itself when it hands over because
  its rail latched or its GPU is at risk (``planned``), its process being healthy; for a device fault, the surviving rank with the
  lowest step, a replica: DDP keeps every rank's parameters and optimizer state equal);
* ``rebuild/<e>/pos/<rank>``: each rank's position at its last step boundary, written with its
  proposal while its optimizer cannot step (the tracker's ``step_lock``): ``steps``, ``epoch``,
  ``batch`` (batches of that epoch consumed), ``boundary_seqs`` (per group, the first
  collective after the boundary), ``lows`` (per group, by name: the lowest collective the rank
  has not completed, as the groups' rebuild exchanges it);
* ``handover/<e>/<rank>/state/<i>``, ``handover/<e>/<rank>/state/n``: the state for the spare
  taking ``rank`` (several ranks may hand over in one epoch: a rail's switch failing on every
  host; sharded ranks each need their own), ``torch.save`` of
  ``{"modules", "optimizers", "schedulers", "rng", "position"}`` in chunks of
  :data:`CHUNK_BYTES`.  Through the store: fine for models up to a few hundred MB; larger ones
  need a transfer over the rebuilt group (not built yet);
* ``handover/<e>/<rank>/rng``: for a device fault, the failed rank's own RNG states at its last step
  boundary (host memory, so still readable), used when that boundary is the replica's: ranks
  that seed differently (``manual_seed(seed + rank)``) draw other dropout masks.

**The spare's replay.**  The spare runs the script from its first line with ``RANK`` set to the
rank it takes.  Every process group it creates joins generation ``e`` at once
(:meth:`torch_hooks.pg.ResilientProcessGroup._join`); its collectives complete locally (no
traffic) while it replays the script's control flow: epochs before the rank's epoch iterate no
batch, the batches of the rank's epoch before its position are skipped, ``torch.save`` does
nothing (the rank already wrote those files).  At the first batch past the position it loads
the source's state (modules, optimizers, LR schedulers, RNG at the boundary), its groups go live
at the boundary's sequence numbers, and the batch reaches the script: the step the rank was in
is computed again, with the same data, the same parameters and the same reduction order.

**No peer behind the boundary.**  The other ranks issue again every collective from the
lowest one any rank has not completed; the spare's first is the boundary's.  So a peer that has
not completed a collective from before the boundary (the moving rank completed it, stepped and
went on; the abort came before the peer had its last segment) would pair it with the spare's
next one, and every later one too.  A planned hand-over therefore compares the peers' ``lows``
with its boundary (:func:`behind_boundary`) and, when one is behind, rebuilds in-process for
that epoch and hands over once the next step's collectives are through
(:meth:`torch_hooks.controller.Controller._defer_planned`).  Whatever the path, a joining spare
reads the other ranks' lows and stops (exit ``EXIT_REBUILD_FAILED``, with the reason) rather
than train on wrong data (:meth:`torch_hooks.pg.ResilientProcessGroup._join`).  When every rank
hands over at once (a rail dead on every host) and the one behind cannot be helped by a peer
that stays, its spare resumes from the peer ahead's state when the modules are replicated
(:func:`choose_forward`; each rank writes ``rebuild/<e>/fate/<rank>``, ``handover``,
``in-process`` or ``exit``, once it has decided, and a latched rank leaves
``handover/<e>/<rank>/rng``, :func:`own_rng` with ``in_step``).

**What it cannot know.**  A script that does not iterate a ``DataLoader`` over a
``DistributedSampler`` and does not call :func:`torch_hooks.tracker.set_position`: no position,
no hand-over (the job stops, exit :data:`torch_hooks.spare.EXIT_NO_SPARE`, with the reason).
Sharded modules (FSDP2) have no replica: a device fault stops the job with a clear reason (a
later issue: snapshots); a latched hand-over works, the rank itself being the source.  Values of
collectives the script issues before its training loop (a broadcast seed, an all-reduced dataset
size) are this rank's own during the replay, not the job's.

**The replaced process** becomes a proxy (:mod:`torch_hooks.proxy`, through ``execv``: the same
pid, so torchrun's agent keeps watching it, and the CUDA context and memory are freed): it
waits for the spare and exits with its exit status.
"""

from __future__ import annotations

import ast
import datetime
import importlib
import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("linkpass.torch_hooks.handover")

#: the state goes through the store in chunks of this size (bytes)
CHUNK_BYTES = 4 << 20
#: how long a spare waits for an assignment before retiring (s; ``LINKPASS_SPARE_WAIT_S``)
DEFAULT_SPARE_WAIT_S = 24 * 3600.0


# --------------------------------------------------------------------------- the worker's side


def spawn_spares(n: int) -> list[subprocess.Popen]:
    """Start ``n`` copies of this worker as warm spares (same command line and environment,
    plus ``LINKPASS_SPARE=1``).  They are this process's children: after a hand-over the
    proxy this process becomes waits for the one that took its rank."""
    argv = list(getattr(sys, "orig_argv", []) or [sys.executable] + sys.argv)
    parent = {"LINKPASS_SPARE_PARENT": str(os.getpid())}  # a waiting spare leaves with this worker (_watch_parent)
    out, pipes = [], []
    for _ in range(n):
        r, w = os.pipe()
        env = dict(os.environ, LINKPASS_SPARE="1", LINKPASS_SPARE_OF=os.environ.get("RANK", ""),
                   LINKPASS_SPARE_READY_FD=str(w), **parent)
        try:
            out.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, pass_fds=(w,)))
            pipes.append(r)
        except OSError as e:
            os.close(r)
            print(f"linkpass: spare not started ({e}); the job runs with fewer spares", file=sys.stderr, flush=True)
        finally:
            os.close(w)
    _wait_ready(pipes, SPARE_READY_S)
    return out


#: how often a waiting spare checks that the worker that started it still runs (s)
PARENT_CHECK_S = 1.0


def _watch_parent(parent: int, assigned: "threading.Event") -> None:
    """A waiting spare must not outlive the worker that started it: a job that fails before any
    hand-over would leave it waiting for an assignment (up to ``LINKPASS_SPARE_WAIT_S``),
    holding its memory, while the job's store is still up.  Exits this process once its parent
    is no longer ``parent`` (the worker exited; we were re-parented), until ``assigned``.

    A check of the parent pid, not prctl(PR_SET_PDEATHSIG): that signal comes when the *thread*
    that started the spare ends, and a hand-over's execve into the proxy, from the controller
    thread, ends the main thread that started it (the pid stays the worker's)."""
    while not assigned.wait(PARENT_CHECK_S):
        if os.getppid() != parent:
            print(f"linkpass: spare (pid {os.getpid()}): its worker (pid {parent}) has exited; the spare leaves too",
                  file=sys.stderr, flush=True)
            os._exit(0)


#: how long a worker waits for its spares to be listed before its script starts (s): a fault in
#: the first seconds of a job finds them ready
SPARE_READY_S = 120.0


def _wait_ready(fds: list[int], timeout_s: float) -> None:
    import select

    deadline = time.monotonic() + timeout_s
    left = list(fds)
    while left and time.monotonic() < deadline:
        ready, _, _ = select.select(left, [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:
            os.read(fd, 16)  # a byte: listed; b"": it exited (its error is on stderr)
            left.remove(fd)
    if left:
        print(f"linkpass: {len(left)} spare(s) not listed after {timeout_s:.0f} s; training starts without waiting "
              "for them", file=sys.stderr, flush=True)
    for fd in fds:
        os.close(fd)


def retire_spares(kv: Any, procs: list[subprocess.Popen]) -> None:
    """At the worker's exit: stop its spares that no rank took (one a rank took goes on)."""
    from torch_hooks.spare import list_spares

    mine = {p.pid: p for p in procs if p.poll() is None}
    if not mine:
        return
    try:
        for d in list_spares(kv):
            p = mine.get(d.get("pid"))
            if p is not None and int(kv.add(f"spares/{d['id']}/claimed", 1)) == 1:
                p.terminate()
    except Exception as e:  # noqa: BLE001 - the store is gone: the spares retire by themselves
        log.debug("spares not retired through the store: %s", e)
        for p in mine.values():
            p.terminate()


def capture_state(tracker: Any) -> bytes:
    """The bytes of this rank's state (caller holds ``tracker.step_lock``)."""
    blob = {"modules": [_local_tree(m.state_dict()) for m in tracker.modules],
            "optimizers": [_local_tree(o.state_dict()) for o in tracker.optimizers],
            "schedulers": [s.state_dict() for s in tracker.schedulers],
            "rng": tracker.boundary_rng, "position": dict(tracker.boundary_pos),
            "ddp_bucket_syncs": tracker.ddp_bucket_syncs}
    buf = io.BytesIO()
    _save(blob, buf)
    return buf.getvalue()


def _save(obj: Any, f) -> None:
    import torch

    getattr(torch.save, "__wrapped__", torch.save)(obj, f)  # the real torch.save, never the replay's


def own_rng(tracker: Any, in_step: bool = False) -> bytes:
    """This rank's RNG states for its spare (``torch.save`` bytes): at its last two step
    boundaries (``by_step``) and when its latest optimizer step was about to run (``pre_step``,
    after that step's forward and backward), with its last boundary (``steps``).  The replica's
    would be another stream when ranks seed differently (``torch.manual_seed(seed + rank)``,
    dropout masks).  Host memory only: read after a GPU failed.

    ``in_step``: also the states *now*, as ``pre_step`` of the step after the boundary: for a
    rank that leaves its process because its latched rail died, read only when its spare
    resumes one step later from a peer's state (:func:`forward_source`).  The rank is then
    behind that peer, i.e. blocked in a collective of that step's backward (DDP allreduces its
    buckets there; the forward's buffer broadcast is waited for before any of them is issued),
    so the step's random draws (dropout in the forward) are all made."""
    steps = tracker.boundary_pos.get("steps")
    pre = dict(tracker.rng_pre_step)
    if in_step:
        from torch_hooks.tracker import _rng_state

        pre[int(steps or 0) + 1] = _rng_state()
    buf = io.BytesIO()
    _save({"steps": steps, "by_step": dict(tracker.rng_by_step), "pre_step": pre}, buf)
    return buf.getvalue()


def ranks_ahead(rank: int, positions: dict[int, dict]) -> list[int]:
    """The ranks whose step boundary lies past a collective ``rank`` has not completed (in any
    process group): they completed it, took the step and went on; ``rank`` did not get its
    result.  ``positions``: every rank's ``rebuild/<e>/pos`` (``boundaries`` and ``lows`` per
    group key); a position without them says nothing."""
    me = positions.get(rank) or {}
    return sorted(r for r, pos in positions.items()
                  if r != rank and behind_boundary(pos.get("boundaries") or {}, {rank: me}))


def choose_forward(rank: int, positions: dict[int, dict], fates: dict[int, str]) -> tuple[int, str]:
    """Whose state the spare of a latched ``rank`` resumes from, and why (empty: its own, nothing
    to say).

    Every rank's spare resumes at its source's step boundary; a rank behind a peer's boundary
    (:func:`ranks_ahead`) would start one step before that peer and pair every collective with
    the peer's previous one, so that peer's spare refuses to start (``ResilientProcessGroup._join``).
    Two ways out:

    * when every peer ahead rebuilds in-process (``fates[r] == "in-process"``), they issue
      again the collectives this rank has not completed: the rank's own state is right;
    * when a peer ahead leaves its process too (a rail's switch failed: every latched rank
      hands over), its spare cannot issue them again, and the step they belong to was taken by
      the peers ahead with this rank's gradients in it (they completed its allreduces).  With
      replicated modules (DDP: every rank's parameters and optimizer state equal after a step),
      that peer's state *is* this rank's after the step: the spare resumes there (of several
      leaving, most steps first, then the lowest rank), and a peer ahead that stays has
      nothing left to issue again.  Sharded modules (FSDP2) have no replica: its own state,
      and the leaving peer's spare will refuse.

    The source must be in exactly the same process groups (``boundaries``' keys): with data
    parallel inside tensor or pipeline parallel groups, a rank ahead in a shared group may hold
    another shard (such a rank is not forwarded, even when one of its replicas is ahead).

    ``positions``: every rank's ``rebuild/<e>/pos`` (with ``module_kinds``); ``fates``: for the
    ranks ahead, ``rebuild/<e>/fate/<rank>`` (``"handover"``, ``"in-process"`` or ``"exit"``)."""
    ahead = ranks_ahead(rank, positions)
    if not ahead:
        return rank, ""
    leaving = [r for r in ahead if fates.get(r) == "handover"]
    if not leaving:
        staying = [r for r in ahead if fates.get(r) == "in-process"]
        if staying == ahead:
            return rank, f"rank(s) {ahead} rebuild in-process and issue again what rank {rank} has not completed"
        said = ", ".join(f"{r}: {fates.get(r) or 'no word'}" for r in ahead if r not in staying)
        return rank, f"rank(s) {sorted(set(ahead) - set(staying))} ahead of rank {rank} do not hand over ({said})"
    # a replica is in exactly the same process groups: with data parallel inside model
    # parallel (tensor or pipeline groups), a rank ahead in a shared group (the world's) may
    # hold another shard of the model
    groups = set(positions[rank].get("boundaries") or {})
    replicas = [r for r in leaving if set(positions[r].get("boundaries") or {}) == groups]
    if not replicas:
        return rank, (f"rank(s) {leaving} completed a step that rank {rank} had not and leave their processes too, but "
                      f"none of them is in the same process groups as rank {rank}: no peer's state is this rank's")
    src = max(replicas, key=lambda r: (int(positions[r].get("steps") or 0), -r))
    kinds = {k for r in (rank, src) for k in (positions[r].get("module_kinds") or ["unknown"])}
    if kinds != {"ddp"}:
        return rank, (f"rank(s) {leaving} completed a step that rank {rank} had not (it had not got the result of one "
                      f"of its collectives) and leave their processes too, but the modules are {sorted(kinds)}, not "
                      "replicated (DDP): no peer's state is this rank's")
    return src, (f"rank {src} completed step {positions[src].get('steps')}, which rank {rank} had not (it had not got "
                 f"the result of one of its collectives), and leaves its process too: with replicated (DDP) modules "
                 f"rank {rank} resumes from rank {src}'s state at that step")


def forward_source(kv: Any, e: int, rank: int, world: int, timeout_s: float) -> tuple[int, str]:
    """:func:`choose_forward` with the positions and fates read from the store (waiting up to
    ``timeout_s`` for them; what does not come means the rank's own state, said in the reason)."""
    try:
        kv.wait([f"rebuild/{e}/pos/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
        positions = {r: json.loads(kv.get(f"rebuild/{e}/pos/{r}")) for r in range(world)}
        ahead = ranks_ahead(rank, positions)
        if not ahead:
            return rank, ""
        kv.wait([f"rebuild/{e}/fate/{r}" for r in ahead], datetime.timedelta(seconds=timeout_s))
        fates = {r: bytes(kv.get(f"rebuild/{e}/fate/{r}")).decode() for r in ahead}
    except Exception as ex:  # noqa: BLE001 - its own state, and the join says the rest
        return rank, f"the ranks' positions or plans were not all in the store ({str(ex).splitlines()[0][:160] if str(ex) else type(ex).__name__})"
    return choose_forward(rank, positions, fates)


def pick_rng(rec: dict, resume_step: int) -> tuple[dict | None, str]:
    """The failed rank's RNG states for resuming after ``resume_step`` optimizer steps, and why.

    * a boundary it kept for that step;
    * when the replica is one step ahead of its last boundary, its state as that optimizer step
      was about to run: the replica finished the step's collectives, so this rank had finished
      the step's forward and backward (its random draws) and was only short of the optimizer
      step (which draws nothing);
    * else None (the caller says so and takes the replica's)."""
    by_step = rec.get("by_step") or {}
    pre = rec.get("pre_step") or {}
    if resume_step in by_step:
        return by_step[resume_step], f"its own, at step {resume_step}"
    if rec.get("steps") is not None and resume_step == rec["steps"] + 1 and resume_step in pre:
        return pre[resume_step], f"its own, taken after the draws of step {resume_step}"
    return None, (f"they are from steps {sorted(by_step)} (and before optimizer step {sorted(pre)}), the replica's "
                  f"state from step {resume_step}")


#: seconds a spare waits for the RNG states of the rank it replaces (then it takes the replica's)
RNG_WAIT_S = 15.0


def put_state(kv: Any, e: int, rank: int, data: bytes) -> None:
    """The state for the spare that takes ``rank`` in epoch ``e``, in chunks of :data:`CHUNK_BYTES`
    (the count written last: a reader that sees it sees every chunk)."""
    n = max(1, (len(data) + CHUNK_BYTES - 1) // CHUNK_BYTES)
    for i in range(n):
        kv.set(f"handover/{e}/{rank}/state/{i}", data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
    kv.set(f"handover/{e}/{rank}/state/n", str(n))


def get_state(kv: Any, e: int, rank: int, timeout_s: float) -> bytes:
    """What :func:`put_state` wrote for ``rank``; waits up to ``timeout_s`` for it."""
    kv.wait([f"handover/{e}/{rank}/state/n"], datetime.timedelta(seconds=timeout_s))
    n = int(kv.get(f"handover/{e}/{rank}/state/n"))
    return b"".join(kv.get(f"handover/{e}/{rank}/state/{i}") for i in range(n))


def flush_all() -> None:
    """Flush the log handlers and stdio before this process is replaced (``execve``)."""
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001,S110
            pass
    sys.stdout.flush()
    sys.stderr.flush()


def become_proxy(spare_pid: int, spare_id: int, code_if_lost: int = 1) -> None:
    """Replace this process (``execv``, same pid) with the proxy that waits for the spare."""
    flush_all()
    env = dict(os.environ, LINKPASS_HOOK="0")  # the proxy is no training process: no hook, no report
    os.execve(sys.executable, [sys.executable, "-m", "torch_hooks.proxy", "--pid", str(spare_pid),
                               "--spare", str(spare_id), "--code-if-lost", str(code_if_lost)], env)


# --------------------------------------------------------------------------- the spare's side


def _preimport(script: str) -> list[str]:
    """Import the script's top-level absolute imports (parsed, not run); returns their names."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    done = []
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:  # noqa: BLE001,S110 - the script will import it (or fail) itself
            pass
    return done


def run_spare(settings: Any, tracker: Any, controller: Any) -> None:
    """The spare's life before the script runs: wait for an assignment, then prepare the
    replay.  Returns to let the script run as the assigned rank; exits quietly (status 0) when
    no rank needed it."""
    import torch.distributed as dist

    from torch_hooks.pg import job_store
    from torch_hooks.spare import Spare

    import threading

    parent = os.environ.pop("LINKPASS_SPARE_PARENT", "")
    assigned = threading.Event()
    if parent.isdigit():
        threading.Thread(target=_watch_parent, args=(int(parent), assigned), name="linkpass-spare-parent",
                         daemon=True).start()
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    if script:
        _preimport(script)
    store = dist.TCPStore(settings.master_addr, settings.master_port, is_master=False,
                          timeout=datetime.timedelta(seconds=max(60.0, settings.rebuild_timeout_s)))
    sp = Spare(store, job=settings.job, host=settings.host)
    fd = os.environ.pop("LINKPASS_SPARE_READY_FD", "")
    if fd.isdigit():  # tell the worker that started it: listed
        try:
            os.write(int(fd), b"1")
            os.close(int(fd))
        except OSError:
            pass
    ready = os.environ.get("LINKPASS_PROGRESS")
    if ready:  # for demos and tests: this worker's spare is listed in the store
        try:
            with open(ready.replace("{rank}", os.environ.get("LINKPASS_SPARE_OF", "")) + f".spare{sp.id}", "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
    wait_s = float(os.environ.get("LINKPASS_SPARE_WAIT_S") or DEFAULT_SPARE_WAIT_S)
    a = sp.wait(wait_s)
    if a is None:
        log.info("spare %d retires (%s)", sp.id, sp.retired)
        os._exit(0)
    assigned.set()  # now the rank: its life is the job's (the old worker, now its proxy, waits for it)
    t_assigned = time.monotonic_ns()
    kv = job_store(sp.store, settings.job)
    ho = json.loads(kv.get(f"handover/{a.epoch}/{a.rank}"))
    os.environ["RANK"] = str(a.rank)
    iface = settings.rails.get(a.rail) if a.rail is not None else None
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    settings.rank = a.rank
    settings.rail = a.rail if a.rail >= 0 else None
    if ho["kind"] in ("device", "rollback", "planned"):
        settings.gpu = None  # it runs on another GPU than the failed one (which the daemon still reports)
    print(f"linkpass: spare {sp.id} takes rank {a.rank} over (epoch {a.epoch}, {ho['kind']}: {a.reason})",
          file=sys.stderr, flush=True)
    e = a.epoch
    if ho["kind"] == "rollback":  # the rank's part of an in-memory snapshot, from its holder
        ev = {"event": "rollback", "epoch": e, "kind": "rollback", "rank": a.rank, "spare": sp.id, "src": ho.get("holder"),
              "step": ho.get("step"), "at_step": ho.get("at_step"), "trigger_t_ns": ho.get("t_ns"),
              "assigned_t_ns": t_assigned, "first_step_t_ns": None}
        try:
            data = get_state(kv, e, a.rank, settings.rebuild_timeout_s)
            blob = _load(data)
        except Exception as ex:  # noqa: BLE001 - one exit path, never a traceback into the script
            from torch_hooks.controller import EXIT_REBUILD_FAILED

            controller.exit_fn(EXIT_REBUILD_FAILED, f"spare {sp.id} cannot take rank {a.rank} over: its part of the "
                               f"step-{ho.get('step')} in-memory snapshot did not arrive "
                               f"({str(ex).splitlines()[0][:200] if str(ex) else type(ex).__name__})")
            return
        replay_part(settings, tracker, controller, e, a.rank, blob, len(data), ev,
                    f"rank {a.rank} resumed in spare {sp.id} at step {blob['position']['steps']} (its part of the "
                    f"in-memory snapshot, {len(data)} bytes, from rank {ho.get('holder')})")
        return
    if ho["kind"] == "device":
        controller.propose_as_spare(kv, e)
    src = _source(kv, e, ho, settings.world_size, settings.rebuild_timeout_s)
    forwarded = False
    if ho["kind"] == "latched":
        src, why = forward_source(kv, e, a.rank, settings.world_size, settings.rebuild_timeout_s)
        forwarded = src != a.rank
        if why:
            print(f"linkpass: spare {sp.id}: {why}", file=sys.stderr, flush=True)
    pos = json.loads(kv.get(f"rebuild/{e}/pos/{src}"))
    ev = {"event": "handover", "epoch": e, "kind": ho["kind"], "rank": a.rank, "spare": sp.id, "src": src,
          "trigger_t_ns": ho.get("t_ns"), "assigned_t_ns": t_assigned, "resume_step": pos["steps"],
          "forwarded": forwarded, "first_step_t_ns": None}

    def load() -> int:
        # a device fault's source puts the state under the failed rank's key; a forwarded
        # latched spare reads the state its source left for its own spare
        data = get_state(kv, e, src if forwarded else a.rank, settings.rebuild_timeout_s)
        _apply_state(data, tracker, a.rank, src, _own_rng_for(kv, e, ho, pos, a.rank, forwarded))
        return len(data)

    replay_to(settings, tracker, controller, e, pos, load, ev, who=f"spare {sp.id} taking rank {a.rank} from rank {src}",
              live_msg=lambda n: f"rank {a.rank} resumed in the spare at step {pos['steps']} (state {n} bytes from "
              f"rank {src})")


def _load(data: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def replay_part(settings: Any, tracker: Any, controller: Any, e: int, rank: int, blob: dict, nbytes: int, ev: dict,
                live_msg: str) -> None:
    """Replay the script to the boundary of ``blob`` (a part in :func:`torch_hooks.memsnap.capture`'s
    layout) and load the part there (:func:`replay_to`); snapshots taken from then on are of
    rollback generation ``e``."""
    ms = getattr(controller, "memsnap", None)
    if ms is not None:
        ms.ns = e  # snapshots taken from here on are new keys, also for steps taken before

    def load() -> int:
        _apply_blob(blob, tracker, rank, rank)
        return nbytes

    replay_to(settings, tracker, controller, e, blob["position"], load, ev, who=f"rank {rank} rolling back",
              live_msg=lambda n: live_msg)


def replay_to(settings: Any, tracker: Any, controller: Any, e: int, pos: dict, load: Callable[[], int], ev: dict,
              who: str, live_msg: Callable[[int], str]) -> None:
    """Replay the script to boundary ``pos`` (``steps``, ``epoch``, ``batch``, ``boundary_seqs``
    per process group in creation order, ``ddp_layouts``), every group joining process-group
    epoch ``e`` at once and completing its collectives locally; there ``load()`` puts the state
    in (returns its size, bytes), the groups go live at the boundary's sequence numbers and
    ``ev`` (the report's event: ``live_t_ns``, ``state_bytes``, ``state_ms``, ``replay_ms`` added)
    goes to the controller's events.  A failure exits through ``controller.exit_fn`` naming
    ``who``."""
    from torch_hooks import pg

    seqs = list(pos.get("boundary_seqs") or [])
    with tracker._lock:  # the rank's step from now on (its proposal, should another rebuild come)
        tracker.steps = int(pos["steps"])
    # DDP's constructor in the replay builds its reducer with the buckets the job uses now, not
    # the first-iteration layout (torch/nn/parallel/distributed.py: bucketing is off for the
    # first iteration, rebuilt after it in gradient order)
    tracker.ddp_layout_replay = [x for x in pos.get("ddp_layouts") or [] if x]
    created = [0]
    t_start = time.monotonic_ns()

    def join(g) -> tuple[int, int]:
        i = created[0]
        created[0] += 1
        if i >= len(seqs):
            controller.exit_fn(pg_exit_code(), f"{who}: the script created more process groups ({i + 1}) than there "
                               f"were at the step boundary ({len(seqs)})")
        return e, seqs[i]

    def cannot_join(reason: str) -> None:
        from torch_hooks.controller import EXIT_REBUILD_FAILED

        controller.exit_fn(EXIT_REBUILD_FAILED, f"{who}: {reason}")

    pg._join_hook[:] = [join, cannot_join]
    controller.epoch = e
    controller.rail = settings.rail
    controller.handover_event = ev

    def on_live() -> None:
        t0 = time.monotonic_ns()
        try:
            nbytes = load()
        except Exception as ex:  # noqa: BLE001 - one exit path, never a traceback into the script
            from torch_hooks.controller import EXIT_REBUILD_FAILED

            controller.exit_fn(EXIT_REBUILD_FAILED, f"{who}: the state cannot be loaded: "
                               f"{str(ex).splitlines()[0][:300] if str(ex) else type(ex).__name__}")
            return
        pg._join_hook[:] = [None, None]
        groups = controller.groups
        if len(groups) != len(seqs):
            controller.exit_fn(pg_exit_code(), f"{who}: {len(groups)} process groups here, {len(seqs)} at the step "
                               "boundary")
        for g, s in zip(groups, seqs):
            g.go_live(s)
        ev.update(live_t_ns=time.monotonic_ns(), state_bytes=nbytes, state_ms=round((time.monotonic_ns() - t0) / 1e6, 3),
                  replay_ms=round((t0 - (ev.get("assigned_t_ns") or t_start)) / 1e6, 3))
        controller.events.append(ev)
        controller._after_rebuild = ev
        print(f"linkpass: {live_msg(nbytes)}", file=sys.stderr, flush=True)

    tracker.fast_forward(pos.get("epoch"), int(pos.get("batch") or 0), on_live)


class _Child:
    """A warm spare started before this process re-executed itself: still its child, known by
    pid only (what :func:`retire_spares` needs: ``pid``, ``poll()``, ``terminate()``)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        try:
            os.kill(self.pid, 15)
        except OSError:
            pass


def run_rollback(settings: Any, tracker: Any, controller: Any) -> None:
    """A survivor that re-executed itself to go back to an in-memory snapshot
    (``LINKPASS_ROLLBACK``, :mod:`torch_hooks.memsnap`): prepare the replay to the snapshot's
    step with its own part.  Returns to let the script run."""
    info = json.loads(os.environ.pop("LINKPASS_ROLLBACK"))
    controller.spares = [_Child(int(p)) for p in (os.environ.pop("LINKPASS_SPARE_PIDS", "") or "").split(",") if p.isdigit()]
    e = int(info["epoch"])
    ev = {"event": "rollback", "epoch": e, "kind": "rollback", "rank": settings.rank, "spare": None, "src": settings.rank,
          "step": info.get("step"), "at_step": info.get("at_step"), "failed_rank": info.get("failed_rank"),
          "trigger_t_ns": info.get("trigger_t_ns"), "assigned_t_ns": None, "first_step_t_ns": None}
    try:
        with open(info["file"], "rb") as f:
            data = f.read()
        blob = _load(data)
    except Exception as ex:  # noqa: BLE001 - one exit path
        from torch_hooks.controller import EXIT_REBUILD_FAILED

        controller.exit_fn(EXIT_REBUILD_FAILED, f"rank {settings.rank} cannot roll back: its part {info.get('file')} "
                           f"is not readable ({str(ex).splitlines()[0][:200] if str(ex) else type(ex).__name__})")
        return
    if info.get("last_step_ns"):
        with tracker._lock:  # the first step after the rollback counts the whole stall, from the last step before it
            tracker.last_step_ns = int(info["last_step_ns"])
    print(f"linkpass: rank {settings.rank} goes back to step {info.get('step')} (it was at step {info.get('at_step')}; "
          f"rank {info.get('failed_rank')} lost its GPU)", file=sys.stderr, flush=True)
    replay_part(settings, tracker, controller, e, settings.rank, blob, len(data), ev,
                f"rank {settings.rank} resumed at step {blob['position']['steps']} from its own part of the in-memory "
                f"snapshot ({len(data)} bytes)")


def pg_exit_code() -> int:
    from torch_hooks.spare import EXIT_NO_SPARE

    return EXIT_NO_SPARE


def _source(kv: Any, e: int, ho: dict, world: int, timeout_s: float) -> int:
    """The rank whose state the spare takes: the one named, or (device fault) the surviving
    rank with the lowest step (ties: the lowest rank)."""
    if ho.get("src") is not None:
        kv.wait([f"rebuild/{e}/pos/{ho['src']}"], datetime.timedelta(seconds=timeout_s))
        return int(ho["src"])
    others = [r for r in range(world) if r != ho["rank"]]
    kv.wait([f"rebuild/{e}/pos/{r}" for r in others], datetime.timedelta(seconds=timeout_s))
    return source_rank({r: json.loads(kv.get(f"rebuild/{e}/pos/{r}")) for r in others})


def source_rank(positions: dict[int, dict]) -> int:
    """The replica a spare takes its state from: the lowest ``steps``, then the lowest rank
    (every rank computes the same)."""
    return min(positions, key=lambda r: (positions[r]["steps"], r))


def behind_boundary(own: dict[str, int], positions: dict[int, dict]) -> list[tuple[str, int, int, int]]:
    """Where a spare resuming at this rank's step boundary would start ahead of a peer.

    ``own``: per process group (its key, see ``lows`` below), the sequence number of this rank's
    first collective after its boundary; ``positions``: the other ranks' ``rebuild/<e>/pos``, whose
    ``lows`` map each of their groups' keys to their lowest unfinished collective.  Returns
    ``(group, rank, its low, this rank's boundary seq)`` for every group and rank with the low
    below the boundary, sorted: that rank still needs a collective this rank had completed before
    its boundary, which a spare with this rank's state cannot issue.  A position without
    ``lows``, or without the group (a rank not in it), says nothing."""
    out = []
    for key, b in own.items():
        for r, pos in positions.items():
            low = (pos.get("lows") or {}).get(key)
            if low is not None and int(low) < b:
                out.append((key, r, int(low), b))
    return sorted(out)


def _local_tree(x: Any) -> Any:
    """``x`` with every DTensor (FSDP2's sharded parameters and optimizer state) replaced by
    this rank's local shard: a state a spare of the same rank loads into the same sharding."""
    to_local = getattr(x, "to_local", None)
    if callable(to_local) and hasattr(x, "placements"):
        return to_local().detach().clone()
    if isinstance(x, dict):
        return type(x)((k, _local_tree(v)) for k, v in x.items()) if not hasattr(x, "default_factory") else {
            k: _local_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_local_tree(v) for v in x)
    return x


def _copy_into(module: Any, saved: dict) -> None:
    """Copy each saved tensor into the module's own (its local shard for a DTensor), in place,
    so the spare's parameters keep their identity (the optimizer and DDP's reducer hold them)."""
    import torch

    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own))
    if missing or extra:
        raise RuntimeError(f"state mismatch in {type(module).__name__}: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for k, t in own.items():
            dst = t.to_local() if hasattr(t, "placements") else t
            src = saved[k]
            if tuple(dst.shape) != tuple(src.shape):
                raise RuntimeError(f"state mismatch in {type(module).__name__}.{k}: shape {tuple(src.shape)} from the "
                                   f"source, {tuple(dst.shape)} here")
            dst.copy_(src)


def _redistribute_optimizer_state(opt: Any) -> None:
    """After ``load_state_dict`` of local shards: each state tensor of a DTensor parameter back
    into a DTensor with the parameter's mesh and placements (what the optimizer step expects)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            st = opt.state.get(p, {})
            local_shape = tuple(p.to_local().shape)
            for k, v in list(st.items()):
                if hasattr(v, "shape") and not isinstance(v, DTensor) and tuple(v.shape) == local_shape and v.dim() > 0:
                    st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)


def _own_rng_for(kv: Any, e: int, ho: dict, pos: dict, rank: int, forwarded: bool = False) -> dict | None:
    """The RNG states the replaced rank left for the step it resumes at (None: take the
    source's, which is the rank itself for a latched hand-over that is not ``forwarded``,
    see :func:`choose_forward`)."""
    if ho.get("kind") != "device" and not forwarded:
        return None
    import torch

    try:
        # the replaced rank writes them once the survivors stopped (it may have died meanwhile)
        kv.wait([f"handover/{e}/{rank}/rng"], datetime.timedelta(seconds=RNG_WAIT_S))
        rec = torch.load(io.BytesIO(kv.get(f"handover/{e}/{rank}/rng")), map_location="cpu", weights_only=False)
    except Exception as ex:  # noqa: BLE001 - then the replica's, said loudly
        rec = None
        why = str(ex) or type(ex).__name__
    else:
        rng, why = pick_rng(rec, int(pos.get("steps") or 0))
        if rng is not None:
            print(f"linkpass: rank {rank} resumes with RNG states {why}", file=sys.stderr, flush=True)
            return rng
    print(f"linkpass: WARNING: rank {rank}'s own RNG states are not usable ({why}); the spare goes on with the "
          "replica's, which is the same stream only when every rank seeds alike", file=sys.stderr, flush=True)
    return None


def _apply_state(data: bytes, tracker: Any, rank: int, src: int, rng: dict | None = None) -> None:
    _apply_blob(_load(data), tracker, rank, src, rng)


def _apply_blob(blob: dict, tracker: Any, rank: int, src: int, rng: dict | None = None) -> None:
    from torch_hooks import tracker as tr

    mods, opts, scheds = blob["modules"], blob["optimizers"], blob["schedulers"]
    if len(mods) != len(tracker.modules) or len(opts) != len(tracker.optimizers):
        raise RuntimeError(f"state mismatch: rank {src} has {len(mods)} protected modules and {len(opts)} optimizers, "
                           f"this spare {len(tracker.modules)} and {len(tracker.optimizers)}")
    for m, sd in zip(tracker.modules, mods):
        _copy_into(m, sd)
    for o, sd in zip(tracker.optimizers, opts):
        o.load_state_dict(sd)
        _redistribute_optimizer_state(o)
    for s, sd in zip(tracker.schedulers, scheds):
        s.load_state_dict(sd)
    tr.set_rng_state(rng if rng is not None else blob.get("rng"))
    tracker.ddp_bucket_replay = list(blob.get("ddp_bucket_syncs") or [])
    p = blob["position"]
    with tracker._lock:
        tracker.steps = int(p["steps"])
        tracker.boundary_pos = dict(p)
