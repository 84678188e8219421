"""Start the hook inside an unmodified training process (what ``linkpass exec`` injects).

``linkpass exec`` puts ``torch_hooks/_site`` first on ``PYTHONPATH``; Python imports its
``sitecustomize`` at start-up (``site`` module: "an attempt is made to import a module named
sitecustomize"), which chains to any other ``sitecustomize`` on the path and, in a process that
has ``RANK`` and ``WORLD_SIZE`` (a worker of torchrun or of any launcher that sets them) and
unless ``LINKPASS_HOOK=0``, calls :func:`start` before the script's first line runs.

:func:`start`:

1. :func:`torch_hooks.tracker.install`: learn the model, optimizer, step and data position;
2. :func:`torch_hooks.pg.install`: every group from ``init_process_group`` / ``new_group`` is a
   :class:`~torch_hooks.pg.ResilientProcessGroup` (``LINKPASS_LATCHED=1``: the gloo wrapper
   refuses in-process interface changes, as NCCL does);
3. a :class:`torch_hooks.controller.Controller` takes every wrapper as it is created and acts on
   daemon notices and collective errors;
4. with ``LINKPASS_REPORT=FILE`` (``{rank}`` is replaced), a JSON report is written at exit:
   ``rank``, ``host``, ``steps``, ``step_ms``, ``max_step_stall_ms``, ``weights_sha256``,
   ``protected_modules``, ``rebuilds`` (the controller's events), ``groups`` (each wrapper's
   :meth:`~torch_hooks.pg.ResilientProcessGroup.stats`), ``position``, ``unprotected``,
   ``snapshots`` (this rank's snapshots: ``id``, ``step``, ``ok``, ``bytes``, ``stall_ms``,
   ``write_ms``, ``path``), ``resume`` (the restore from ``LINKPASS_RESUME``: ``step``,
   ``restore_ms``, ``match``; else null);
5. :class:`torch_hooks.snapshot.Snapshotter`: step-aligned snapshots (periodic, on request), and
   with ``LINKPASS_RESUME`` the restore from one before the script's first step.

Nothing here may break the script: a failure to start is one line on stderr and the script runs
as it would without linkpass.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys

log = logging.getLogger("linkpass.torch_hooks.bootstrap")

_state: dict = {}


def _say(msg: str) -> None:
    print(f"linkpass: {msg}", file=sys.stderr, flush=True)


def start() -> bool:
    """Install the hook in this process (idempotent).  Returns True when installed."""
    if _state:
        return True
    if os.environ.get("LINKPASS_HOOK", "1").strip() == "0":
        return False
    from torch_hooks import pg, tracker
    from torch_hooks.controller import Controller, Settings

    try:
        settings = Settings()
    except ValueError as e:
        _say(f"hook not started: {e}; the script runs unprotected")
        return False
    import faulthandler
    import signal

    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        # `kill -USR1 PID` prints every thread's stack (a hung rank says where it is)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    t = tracker.install()
    latched = os.environ.get("LINKPASS_LATCHED", "").strip() == "1" or None
    if not pg.install(latched=latched, step_hook=False):  # the tracker marks step boundaries
        return False
    ctl = Controller(settings, t)
    _state.update(settings=settings, tracker=t, controller=ctl)
    pg.add_group_listener(ctl.attach)
    t.add_step_listener(_first_step_checks)
    atexit.register(_at_exit)
    from torch_hooks import handover

    _start_snapshots(settings, t, ctl)

    if os.environ.get("LINKPASS_SPARE") == "1":
        handover.run_spare(settings, t, ctl)  # returns once this process has a rank to take
    elif os.environ.get("LINKPASS_ROLLBACK"):
        handover.run_rollback(settings, t, ctl)  # a survivor that re-executed itself: its spares still run
    else:
        try:
            n = int(os.environ.get("LINKPASS_SPARES") or 0)
        except ValueError:
            _say(f"LINKPASS_SPARES={os.environ['LINKPASS_SPARES']!r} is not a number; no spares")
            n = 0
        if n > 0:
            if not (settings.master_addr and settings.master_port):
                _say("no MASTER_ADDR/MASTER_PORT: spares need the job's store; no spares started")
            else:
                ctl.spares = handover.spawn_spares(n)
    log.info("linkpass hook installed in rank %s (job %s, rails %s)", settings.rank, settings.job, settings.rails or "unknown")
    return True


def _start_snapshots(settings, t, ctl) -> None:
    """Step-aligned snapshots (:mod:`torch_hooks.snapshot`) and, with ``LINKPASS_RESUME``, the
    restore from one.  A worker that cannot resume from the snapshot it was given stops (one
    line, exit :data:`torch_hooks.snapshot.EXIT_RESUME`): it must not train from the start as if
    it had resumed."""
    from torch_hooks import snapshot

    try:
        snap = snapshot.SnapshotSettings()
    except ValueError as e:
        _say(f"snapshots off: {e}")
        return
    _state["snapshotter"] = snapshot.Snapshotter(settings, t, snap, client_fn=lambda: ctl.client)
    _start_memory_snapshots(settings, t, ctl)
    if (snap.resume and os.environ.get("LINKPASS_SPARE") != "1"  # a spare takes the rank's state, not the snapshot's
            and not os.environ.get("LINKPASS_ROLLBACK")):
        try:
            snapshot.prepare_resume(settings, t, snap.resume, ctl.exit_fn, _state["snapshotter"])
        except snapshot.ResumeRefused as e:
            _say(f"rank {settings.rank}: {e}")
            sys.stderr.flush()
            os._exit(snapshot.EXIT_RESUME)


def _start_memory_snapshots(settings, t, ctl) -> None:
    """In-memory snapshots (:mod:`torch_hooks.memsnap`), when ``LINKPASS_SNAPSHOT_IN_MEMORY=1``."""
    import json as _json

    from torch_hooks import memsnap

    try:
        mem = memsnap.MemorySettings()
    except ValueError as e:
        _say(f"in-memory snapshots off: {e}")
        return
    if not mem.enabled:
        return
    ns = 0
    if os.environ.get("LINKPASS_ROLLBACK"):
        try:
            ns = int(_json.loads(os.environ["LINKPASS_ROLLBACK"]).get("epoch") or 0)
        except (ValueError, AttributeError):
            ns = 0
    ctl.memsnap = _state["memsnap"] = memsnap.MemorySnapshots(settings, t, ctl, mem, ns=ns)


def _first_step_checks(steps: int) -> None:
    if steps != 1:
        return
    t, ctl = _state["tracker"], _state["controller"]
    if not t.modules:
        _say("no DistributedDataParallel or fully_shard module seen before the first optimizer step: nothing to hand "
             "over to a spare on a device fault (rail faults are still handled)")
    if not t.position()["known"]:
        _say("data position unknown: the script does not iterate a DataLoader over a DistributedSampler; a spare "
             "cannot resume at the interrupted batch unless the script calls "
             "torch_hooks.tracker.set_position(epoch, batch) each step")
    if not ctl.groups:
        _say("no protected process group (a backend linkpass does not wrap?): faults are not handled")


def report() -> dict:
    """This process's report (see the module docstring)."""
    from torch_hooks import pg

    t, ctl, s = _state["tracker"], _state["controller"], _state["settings"]
    ms = t.step_ms
    return {
        "rank": s.rank, "host": s.host, "job": s.job, "pid": os.getpid(), "spare": os.environ.get("LINKPASS_SPARE") == "1",
        "steps": t.steps,
        "step_ms": [round(x, 3) for x in ms],
        "max_step_stall_ms": round(max(ms), 3) if ms else None,
        "median_step_ms": round(sorted(ms)[len(ms) // 2], 3) if ms else None,
        "weights_sha256": t.weights_sha256(),
        "protected_modules": t.describe_modules(),
        "rebuilds": ctl.events,
        "epoch": ctl.epoch, "rail": ctl.rail,
        "groups": [g.stats() for g in ctl.groups],
        "position": t.position(),
        "unprotected": sorted(pg._unprotected_notes) if hasattr(pg, "_unprotected_notes") else [],
        "snapshots": list(_state["snapshotter"].events) if _state.get("snapshotter") is not None else [],
        "resume": _state["snapshotter"].resume_event if _state.get("snapshotter") is not None else None,
        "memory_snapshots": list(_state["memsnap"].events) if _state.get("memsnap") is not None else [],
    }


def _at_exit() -> None:
    sn = _state.get("snapshotter")
    if sn is not None:
        sn.close()  # the part in flight is written (and, on rank 0, the snapshot completed) first
    ms = _state.get("memsnap")
    if ms is not None:
        ms.close(remove=True)  # the job ended here: nothing needs this rank's in-memory parts
    write_report()
    ctl = _state.get("controller")
    if ctl is not None:
        ctl.mark_left()  # before the groups close: a peer whose collective fails then knows why
        if ctl.spares and ctl._kv is not None:
            from torch_hooks import handover

            handover.retire_spares(ctl._kv, ctl.spares)
        ctl.close()
    _exit_if_resume_not_reached(sn)


def _exit_if_resume_not_reached(sn) -> None:
    """A ``--resume`` run whose script ended before the snapshot's batch exits
    :data:`torch_hooks.snapshot.EXIT_RESUME` with one line (rank 0 / each host's local rank 0
    says it), unless the script itself failed (its own exit status and traceback stand)."""
    if sn is None or getattr(sys, "last_value", None) is not None:
        return
    from torch_hooks import snapshot

    msg = snapshot.resume_not_reached(sn)
    if msg is None:
        return
    s = _state.get("settings")
    if s is None or s.rank == 0 or s.local_rank in (0, None):
        _say(f"rank {s.rank if s else '?'}: {msg}; exiting with status {snapshot.EXIT_RESUME}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(snapshot.EXIT_RESUME)


def write_report() -> None:
    """Write :func:`report` to ``LINKPASS_REPORT`` (``{rank}`` replaced), if set."""
    path = os.environ.get("LINKPASS_REPORT")
    if not path or not _state:
        return
    path = path.replace("{rank}", str(_state["settings"].rank))
    try:
        data = json.dumps(report())
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - exiting anyway
        _say(f"report not written to {path}: {e}")
