"""Snapshot reports of the torch hooks -> what the daemon shows of each job's snapshots (pure).

Every rank of a job that takes a snapshot (``torch_hooks/snapshot.py``) reports ``snapshot`` to its
host's daemon over the hook socket once its share is over:

* the job's rank 0 reports the **snapshot**: the whole job's outcome (``scope = "snapshot"``;
  ``bytes`` of every rank's part together, ``stall_ms`` / ``write_ms`` the slowest rank's, ``path``
  of the complete snapshot, ``reason`` why it failed);
* every other rank reports its **part** (``scope = "part"``; ``bytes``, ``stall_ms``, ``write_ms``
  of this rank alone, ``path`` None, ``reason`` why its part was not written).

So a host sees one ``snapshot`` report per snapshot when the job's rank 0 runs there, and one
``part`` report per snapshot from each other rank it runs.  A hook that does not send ``scope``
(older hooks) is taken as ``snapshot`` from rank 0 and ``part`` from the others.

The hook server (:mod:`linkpass.adapters.hook_server`) fills in ``job``, ``rank``, ``pid``,
``client_id`` and ``t_ns`` from the registration and the kernel; the other fields are the
client's word, and a hostile or broken client can send anything.  :func:`parse_report` checks
each one (type, range, length); a report that fails is dropped whole and counted by
:class:`SnapshotBook` (``rejected``), never half taken.

:class:`SnapshotBook` keeps, per job, the newest report and counts since start; at most
:data:`JOBS_KEPT` jobs (the job with the oldest newest report is forgotten first, counted in
``jobs_forgotten``).  Times are monotonic ns (the hook server's clock); ``*_ms`` milliseconds;
``bytes`` are bytes on disk.  No clock, no I/O: :class:`linkpass.core.engine.Engine` owns one
and feeds it the ``HookReport`` events.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

#: jobs whose snapshots one daemon keeps (a host runs a handful; a client cannot grow it without bound)
JOBS_KEPT = 64
#: longest ``reason`` kept (characters); a longer one is cut and ends with "..."
MAX_REASON_CHARS = 1000
#: longest ``path`` / ``id`` / ``job`` accepted (characters); longer: the report is refused
MAX_PATH_CHARS = 4096
MAX_ID_CHARS = 128
MAX_JOB_CHARS = 256
SCOPES = ("snapshot", "part")


class ReportError(ValueError):
    """A snapshot report that cannot be taken: one line naming the field and what is wrong."""


@dataclass(frozen=True)
class SnapshotReport:
    """One checked ``snapshot`` report.

    Attributes:
        job, rank, pid: who reported (the hook server's, from the registration and the kernel;
            pid None when the kernel did not say).
        scope: ``"snapshot"`` (rank 0: the whole job's outcome) or ``"part"`` (this rank's part).
        id: the snapshot's id (``g<n>`` on request, ``p<step>`` periodic), None when not sent.
        step: the optimizer step the snapshot is of (>= 0).
        ok: the snapshot is complete (``snapshot``) / the part is on disk (``part``).
        path: the complete snapshot's directory (``snapshot`` and ok), else None.
        bytes: bytes on disk (the whole snapshot, or this rank's part); None when unknown.
        stall_ms: training stopped for it (ms; the slowest rank's for ``snapshot``); None when unknown.
        write_ms: boundary -> on disk (ms; the slowest rank's for ``snapshot``); None when unknown.
        reason: why it failed (None when ok), at most :data:`MAX_REASON_CHARS` characters.
        t_ns: when the hook server got it (monotonic ns).
    """

    job: str
    rank: int
    pid: int | None
    scope: str
    id: str | None
    step: int
    ok: bool
    path: str | None
    bytes: int | None
    stall_ms: float | None
    write_ms: float | None
    reason: str | None
    t_ns: int

    def to_report(self) -> dict:
        """The report as the hook server keeps them (``event`` ``snapshot``), checked fields only:
        what :class:`~linkpass.core.model.PublishHookReport` carries to the MQTT adapter."""
        f = self.fields()
        f["id"] = f.pop("snapshot_id")  # the hook's own name for it (parse_report reads it back)
        return {"event": "snapshot", "t_ns": self.t_ns, "job": self.job, "rank": self.rank, "pid": self.pid, **f}

    def fields(self) -> dict:
        """The snapshot's own fields, as status and the MQTT event show them: ``scope``,
        ``snapshot_id`` (the report's ``id``: an event's ``id`` is its message UUID), ``step``,
        ``ok``, ``path``, ``bytes``, ``stall_ms``, ``write_ms``, ``reason``."""
        return {"scope": self.scope, "snapshot_id": self.id, "step": self.step, "ok": self.ok, "path": self.path,
                "bytes": self.bytes, "stall_ms": self.stall_ms, "write_ms": self.write_ms, "reason": self.reason}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_str(rec, name: str, limit: int) -> str | None:
    v = rec.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ReportError(f"'{name}' must be a string or null, not {type(v).__name__}")
    if len(v) > limit:
        raise ReportError(f"'{name}' is {len(v)} characters long (at most {limit})")
    return v


def _opt_ms(rec, name: str) -> float | None:
    v = rec.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ReportError(f"'{name}' must be a finite number of ms >= 0 or null, not {v!r:.40}")
    return float(v)


def parse_report(rec) -> SnapshotReport:
    """Check one hook report of event ``snapshot`` (a mapping as the hook server keeps it).

    Raises:
        ReportError: not a mapping, not a ``snapshot`` report, or a field of the wrong type or
            out of range (one line naming the field).
    """
    if not isinstance(rec, dict):
        raise ReportError(f"a report must be an object, not {type(rec).__name__}")
    if rec.get("event") != "snapshot":
        raise ReportError(f"not a snapshot report (event {rec.get('event')!r:.40})")
    job, rank, pid, t_ns = rec.get("job"), rec.get("rank"), rec.get("pid"), rec.get("t_ns")
    if not isinstance(job, str) or not job or len(job) > MAX_JOB_CHARS:
        raise ReportError(f"'job' must be a non-empty string of at most {MAX_JOB_CHARS} characters")
    if not _int(rank) or rank < 0:
        raise ReportError(f"'rank' must be an integer >= 0, not {rank!r:.40}")
    if pid is not None and not _int(pid):
        raise ReportError(f"'pid' must be an integer or null, not {pid!r:.40}")
    if not _int(t_ns):
        raise ReportError(f"'t_ns' must be an integer, not {t_ns!r:.40}")
    ok, step = rec.get("ok"), rec.get("step")
    if not isinstance(ok, bool):
        raise ReportError(f"'ok' must be true or false, not {ok!r:.40}")
    if not _int(step) or step < 0:
        raise ReportError(f"'step' must be an integer >= 0, not {step!r:.40}")
    scope = rec.get("scope")
    if scope is None:
        scope = "snapshot" if rank == 0 else "part"
    elif scope not in SCOPES:
        raise ReportError(f"'scope' must be one of {', '.join(SCOPES)}, not {scope!r:.40}")
    size = rec.get("bytes")
    if size is not None and (not _int(size) or size < 0):
        raise ReportError(f"'bytes' must be an integer >= 0 or null, not {size!r:.40}")
    reason = rec.get("reason")
    if reason is not None:
        if not isinstance(reason, str):
            raise ReportError(f"'reason' must be a string or null, not {type(reason).__name__}")
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS - 3] + "..."
    return SnapshotReport(job=job, rank=rank, pid=pid, scope=scope, id=_opt_str(rec, "id", MAX_ID_CHARS), step=step,
                          ok=ok, path=_opt_str(rec, "path", MAX_PATH_CHARS), bytes=size,
                          stall_ms=_opt_ms(rec, "stall_ms"), write_ms=_opt_ms(rec, "write_ms"),
                          reason=reason if not ok else None, t_ns=t_ns)


@dataclass(frozen=True)
class JobSnapshots:
    """What one daemon knows of one job's snapshots.

    Attributes:
        job: the job's name (``LINKPASS_JOB``).
        last: the newest report of either scope.
        ok, failed: ``snapshot`` reports (the whole job's outcome, from its rank 0 on this host)
            that said complete / failed, since start.
        parts_ok, parts_failed: ``part`` reports (the job's other ranks on this host) likewise.
    """

    job: str
    last: SnapshotReport
    ok: int
    failed: int
    parts_ok: int
    parts_failed: int


@dataclass(frozen=True)
class SnapshotsView:
    """A frozen copy of a :class:`SnapshotBook`: the jobs (sorted by name), reports refused
    since start, jobs forgotten to stay within :data:`JOBS_KEPT`."""

    jobs: tuple[JobSnapshots, ...]
    rejected: int
    jobs_forgotten: int


class SnapshotBook:
    """Per job, the newest snapshot report and counts since start (see the module docstring).

    Args:
        jobs_kept: at most this many jobs (default :data:`JOBS_KEPT`).
    """

    def __init__(self, jobs_kept: int = JOBS_KEPT):
        self.jobs_kept = jobs_kept
        self._jobs: OrderedDict[str, JobSnapshots] = OrderedDict()  # least recently reported first
        self.rejected = 0
        self.jobs_forgotten = 0

    def record(self, rec) -> SnapshotReport:
        """Take one hook report of event ``snapshot``; returns it checked.

        Raises:
            ReportError: the report was refused (counted in ``rejected``; nothing kept of it).
        """
        try:
            r = parse_report(rec)
        except ReportError:
            self.rejected += 1
            raise
        old = self._jobs.pop(r.job, None)
        ok, failed, pok, pfailed = (old.ok, old.failed, old.parts_ok, old.parts_failed) if old else (0, 0, 0, 0)
        if r.scope == "snapshot":
            ok, failed = ok + r.ok, failed + (not r.ok)
        else:
            pok, pfailed = pok + r.ok, pfailed + (not r.ok)
        self._jobs[r.job] = JobSnapshots(r.job, r, ok, failed, pok, pfailed)
        while len(self._jobs) > self.jobs_kept:
            self._jobs.popitem(last=False)
            self.jobs_forgotten += 1
        return r

    def view(self) -> SnapshotsView:
        """A frozen copy (O(jobs kept))."""
        return SnapshotsView(tuple(self._jobs[k] for k in sorted(self._jobs)), self.rejected, self.jobs_forgotten)


def snapshots_json(view: SnapshotsView, now_ns: int) -> dict:
    """``linkpass status --json`` ``snapshots``: ``{"jobs": {JOB: {"last": {...}, "ok", "failed",
    "parts_ok", "parts_failed"}}, "reports_rejected", "jobs_forgotten"}``; ``last`` has ``rank``,
    ``scope``, ``snapshot_id``, ``step``, ``ok``, ``path``, ``bytes``, ``stall_ms``, ``write_ms``, ``reason``,
    ``t_ns`` (monotonic ns the daemon got it) and ``age_s`` (s before ``now_ns``)."""
    jobs = {}
    for j in view.jobs:
        last = {"rank": j.last.rank, **j.last.fields(), "t_ns": j.last.t_ns,
                "age_s": round(max(0, now_ns - j.last.t_ns) / 1e9, 3)}
        jobs[j.job] = {"last": last, "ok": j.ok, "failed": j.failed, "parts_ok": j.parts_ok, "parts_failed": j.parts_failed}
    return {"jobs": jobs, "reports_rejected": view.rejected, "jobs_forgotten": view.jobs_forgotten}
