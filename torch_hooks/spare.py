"""Hot-spare workers and the spare-assignment protocol of rank migration (issue 6, part 4).

A host keeps N hot-spare worker processes: torch imported, the job's model code loaded, a
connection to the job's store, no rank.  Each one announces itself and waits for an
assignment::

    from torch_hooks.spare import Spare

    spare = Spare(store, job="llm7", host="gpu-node-08")      # announces itself
    a = spare.wait(timeout_s=600)                             # None: nobody needed it (it retired)
    guard = LinkPassGuard(store, a.rank, a.world_size, ..., join=a)   # takes rank a.rank over

Keys (under ``linkpass/<job>/`` in the job's store, the same ``PrefixStore`` the guard uses):

* ``spares/seq``: a counter; a spare's id is ``add("spares/seq", 1)``;
* ``spares/<id>``: ``{"id", "host", "pid", "start"}`` (``start``: the process's start time in
  clock ticks from ``/proc/<pid>/stat``, so a recycled pid is never mistaken for it);
* ``spares/<id>/beat``: the spare's heartbeat, wall-clock seconds (``time.time()``) rewritten
  about every second while it waits.  :func:`claim_spare` skips a spare whose beat is older
  than ``max_beat_age_s`` (10 s), and a spare on the claimer's own host whose pid is gone or
  belongs to another process (start time).  Assumption: the hosts' clocks agree within a few
  seconds (NTP); a clock more than ``max_beat_age_s`` behind makes its spares look dead (they
  are skipped, never wrongly used);
* ``spares/<id>/claimed``: a counter; whoever gets 1 from ``add(..., 1)`` owns the spare: the
  rank that assigns it, or the spare itself when it retires (timeout, shutdown).  One atomic
  add per spare, so a spare is never given twice and never given after it retired;
* ``spares/<id>/assign``: the :class:`Assignment` (JSON), written after a successful claim and
  after the migration request (the spare fences the faulty process as soon as it reads it);
* ``migrate/<epoch>/lock``: who may migrate in ``epoch``: the first faulty rank to
  ``compare_set`` it (``"<rank>:<pid>"``).  One migration per epoch: a second rank whose device
  fails while the first one's migration is under way gets :class:`MigrationConflict` and claims
  no spare (the guard then stops the job with 76, see ``torch_hooks.guard``);
* ``migrate/<epoch>/req``: the migration request the other ranks find in the store (the same
  way they find ``rebuild/<epoch>/req``): ``{"rank", "spare": id | null, "host", "pid",
  "start", "step", "rail", "reason"}``.  ``spare: null`` means no spare was left: every rank
  stops with :data:`EXIT_NO_SPARE`.

Which spare: one on the faulty rank's host first (its host can fence the faulty process by
pid, and the job keeps its host layout), then any other, lowest id first.

Fencing: the faulty process exits at once after writing the request (it never touches its GPU
or a collective again); the spare, when it is on the same host, also ``SIGKILL``s the
recorded pid if that process still exists with the recorded start time.  The new process group
lives under a new generation prefix, so nothing of the old one can be joined by accident.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("linkpass.torch_hooks")

#: Exit status of every rank when a rank must move and no spare is left (EX_UNAVAILABLE in
#: sysexits.h: "a service is unavailable").  Distinct from 75 (EXIT_MIGRATE: the launcher may
#: restart the rank) and from 1 (a plain error).
EXIT_NO_SPARE = 69
#: Exit status of the faulty process itself after it handed its rank over (EX_IOERR: its
#: device failed).  It never trains again; the job continues without it.
EXIT_FENCED = 74


class MigrationConflict(RuntimeError):
    """Another rank already migrates in this epoch (``holder``: its rank); raised by
    :func:`request_migration`, which then claimed no spare."""

    def __init__(self, epoch: int, holder: str):
        super().__init__(f"rank {holder} is already migrating in process group epoch {epoch}; "
                         "only one rank can move per epoch")
        self.epoch, self.holder = epoch, holder


#: A spare whose heartbeat is older than this (seconds, wall clock) is taken for dead.
MAX_BEAT_AGE_S = 10.0
#: How often a waiting spare rewrites its heartbeat (seconds).
BEAT_EVERY_S = 1.0
#: A waiting spare retires once its store has been unreachable for this long (seconds).
STORE_LOST_S = 5.0


def host_name() -> str:
    return os.environ.get("LINKPASS_HOST") or socket.gethostname()


def proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Assignment:
    """What a spare is told: take ``rank`` of ``world_size`` in process group ``epoch``,
    replacing the process ``pid`` (start time ``start``) on ``host``; the job was in step
    ``step`` on rail ``rail``."""

    epoch: int
    rank: int
    world_size: int
    step: int
    rail: int
    host: str
    pid: int
    start: int | None
    spare: int
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Assignment:
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _get_json(kv: Any, key: str) -> dict | None:
    try:
        return json.loads(kv.get(key))
    except Exception:
        return None


def list_spares(kv: Any) -> list[dict]:
    """Announced spares (claimed or not), lowest id first."""
    try:
        n = int(kv.add("spares/seq", 0))
    except Exception:
        return []
    out = []
    for i in range(1, n + 1):
        key = f"spares/{i}"
        if kv.check([key]):
            d = _get_json(kv, key)
            if d is not None:
                out.append(d)
    return out


def spare_alive(kv: Any, d: dict, host: str, max_beat_age_s: float = MAX_BEAT_AGE_S,
                now: float | None = None) -> tuple[bool, str]:
    """Whether announced spare ``d`` looks alive: ``(True, "")`` or ``(False, why)``.

    Its heartbeat (``spares/<id>/beat``, wall-clock seconds) must be at most ``max_beat_age_s``
    old; a spare on ``host`` (the caller's host) must also still be the same process (pid and
    start time, :func:`proc_start`)."""
    now = time.time() if now is None else now
    key = f"spares/{d['id']}/beat"
    try:
        beat = float(kv.get(key)) if kv.check([key]) else None
    except Exception:  # noqa: BLE001 - unreadable beat: not provably alive
        beat = None
    if beat is None:
        return False, "no heartbeat"
    if now - beat > max_beat_age_s:
        return False, f"heartbeat {now - beat:.1f} s old"
    if d.get("host") == host and d.get("pid") is not None:
        start = proc_start(int(d["pid"]))
        if start is None or (d.get("start") is not None and start != d["start"]):
            return False, f"process {d['pid']} is gone"
    return True, ""


def claim_spare(kv: Any, host: str, max_beat_age_s: float = MAX_BEAT_AGE_S, own_pids: Any = ()) -> dict | None:
    """Claim one free, live spare (the caller's own first, then same ``host``, lowest id next);
    returns its announcement or None when none is left.  Atomic per spare (``add`` on
    ``spares/<id>/claimed``).  Spares that look dead (:func:`spare_alive`) are skipped (not
    claimed: a stalled one that recovers can still be used later).

    ``own_pids``: the caller's own spare processes (its children).  Its own comes first because
    the replaced process, as a proxy, can pass on only a child's exit status to torchrun
    (:mod:`torch_hooks.proxy`); another worker's spare ends the job with an unknown status."""
    spares = list_spares(kv)
    own = {int(x) for x in own_pids}
    spares.sort(key=lambda d: (d.get("host") != host, not (d.get("host") == host and d.get("pid") in own), d["id"]))
    for d in spares:
        if kv.check([f"spares/{d['id']}/claimed"]) and int(kv.add(f"spares/{d['id']}/claimed", 0)) > 0:
            continue
        ok, why = spare_alive(kv, d, host, max_beat_age_s)
        if not ok:
            log.warning("spare %s on %s (pid %s) looks dead (%s); skipped", d["id"], d.get("host"), d.get("pid"), why)
            continue
        if int(kv.add(f"spares/{d['id']}/claimed", 1)) == 1:
            return d
    return None


def request_migration(kv: Any, *, epoch: int, rank: int, world_size: int, step: int, rail: int, reason: str,
                      host: str | None = None, pid: int | None = None) -> Assignment | None:
    """Called by the faulty rank: win the epoch (``compare_set`` on ``migrate/<epoch>/lock``),
    claim a spare, write the request every rank finds (``migrate/<epoch>/req``), then the
    spare's assignment.  Returns the assignment, or None when no spare is left (the request
    then says ``spare: null``).  The same rank asking again for ``epoch`` gets the existing
    answer.

    Raises:
        MigrationConflict: another rank holds ``epoch`` (two faults at once); nothing was
            claimed or written.
        Exception: the store's error when it is unreachable (``torch.distributed.DistError``).
    """
    host = host or host_name()
    pid = os.getpid() if pid is None else pid
    req_key = f"migrate/{epoch}/req"
    me = f"{rank}:{pid}"
    holder = kv.compare_set(f"migrate/{epoch}/lock", "", me)
    holder = holder.decode() if isinstance(holder, bytes) else str(holder)
    if holder != me:
        if holder.split(":")[0] != str(rank):
            raise MigrationConflict(epoch, holder.split(":")[0])
        # the same rank again (another process of it, or a retry): the existing answer
        deadline = time.monotonic() + 5.0  # the request follows the lock within milliseconds
        while not kv.check([req_key]) and time.monotonic() < deadline:
            time.sleep(0.01)
        d = _get_json(kv, req_key) or {}
        sp = d.get("spare")
        if sp is None:
            return None
        while not kv.check([f"spares/{sp}/assign"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        return Assignment.from_json(kv.get(f"spares/{sp}/assign"))
    d = claim_spare(kv, host)
    a = None
    if d is not None:
        a = Assignment(epoch=epoch, rank=rank, world_size=world_size, step=step, rail=rail, host=host, pid=pid,
                       start=proc_start(pid), spare=d["id"], reason=reason[:300])
    # the request first, the assignment second: the spare SIGKILLs this process (fence) as soon
    # as it reads its assignment, so anything written after the assignment may never be written
    # (the other ranks would then never learn of the migration)
    kv.set(req_key, json.dumps({"rank": rank, "spare": None if a is None else a.spare, "host": host, "pid": pid,
                                "start": proc_start(pid), "step": step, "rail": rail, "reason": reason[:300]}))
    if a is not None:
        kv.set(f"spares/{a.spare}/assign", a.to_json())
    return a


def read_migration(kv: Any, epoch: int) -> dict | None:
    """The migration request for ``epoch``, or None when there is none (or the store fails)."""
    try:
        if not kv.check([f"migrate/{epoch}/req"]):
            return None
    except Exception:
        return None
    return _get_json(kv, f"migrate/{epoch}/req")


def fence(a: Assignment, host: str | None = None) -> str:
    """Make sure the process ``a`` replaces cannot join a collective again: ``SIGKILL`` it when
    it is on this host and still the same process (pid and start time).  Returns what was done:
    ``"killed"``, ``"gone"``, ``"other-host"``."""
    if a.host != (host or host_name()):
        return "other-host"
    start = proc_start(a.pid)
    if start is None or (a.start is not None and start != a.start):
        return "gone"
    try:
        os.kill(a.pid, signal.SIGKILL)
    except ProcessLookupError:
        return "gone"
    return "killed"


class Spare:
    """A hot-spare worker's side of the protocol: announce, wait, take a rank or retire.

    Args:
        store: the job's store (the guard's ``base_store``: a TCPStore on the front-end network).
        job: job id (the store prefix ``linkpass/<job>/``).
        host: this host's name (default ``$LINKPASS_HOST`` or the hostname).

    After :meth:`wait` returned None, :attr:`retired` says why: ``"timeout"`` (nobody needed
    it), ``"store-lost"`` (the job's store was unreachable for :data:`STORE_LOST_S`: the job is
    over or its store died; :attr:`store_error` has the last error) or ``"no-assignment"``.
    :attr:`store` is the store handle to use afterwards (a fresh connection replaces a broken one).

    Raises:
        Exception: the store's error when the announcement cannot be written.
    """

    def __init__(self, store: Any, job: str = "job", host: str | None = None):
        from torch_hooks.pg import job_store

        self.store, self.job = store, job
        self.kv = job_store(store, job)
        self.host = host or host_name()
        self.pid = os.getpid()
        self.retired: str | None = None
        self.store_error: str | None = None
        self._kept: list[Any] = []
        self.id = int(self.kv.add("spares/seq", 1))
        self._beat()  # before the announcement: a listed spare always has a heartbeat
        self.kv.set(f"spares/{self.id}", json.dumps({"id": self.id, "host": self.host, "pid": self.pid,
                                                     "start": proc_start(self.pid)}))
        log.info("spare %d on %s (pid %d) waiting for an assignment", self.id, self.host, self.pid)

    def _beat(self) -> None:
        self.kv.set(f"spares/{self.id}/beat", repr(time.time()))
        self._last_beat = time.monotonic()

    def wait(self, timeout_s: float, poll_s: float = 0.05) -> Assignment | None:
        """Block until assigned (returns the :class:`Assignment`) or ``timeout_s`` passes; then
        retire (claim itself) and return None.  A claim that races the retirement wins: the
        spare then waits (up to 10 s more) for the assignment that claim is about to write.
        Checks the store every ``poll_s`` seconds (the delay a migration waits for its spare at
        most), rewrites its heartbeat about every :data:`BEAT_EVERY_S`.  Returns None too (never
        raises) when the store stays unreachable for :data:`STORE_LOST_S` (:attr:`retired`)."""
        key = f"spares/{self.id}/assign"
        # poll with check(), never a store wait() that can time out: a TCPStore wait that times
        # out leaves a waiter on the server, whose late answer (when the key is finally set)
        # arrives on this connection and desynchronises every later request on it (the spare
        # then hung in the next agreement, about one migration in three)
        got = self._poll(key, timeout_s, poll_s)
        if got is None:
            return None
        if got:
            return Assignment.from_json(self.kv.get(key))
        try:
            if int(self.kv.add(f"spares/{self.id}/claimed", 1)) == 1:
                log.info("spare %d: no assignment within %.0f s; retiring", self.id, timeout_s)
                self.retired = "timeout"
                return None
        except Exception as e:  # noqa: BLE001 - the store went away right at the end
            return self._lost(e)
        got = self._poll(key, 10.0, poll_s)
        if got:
            return Assignment.from_json(self.kv.get(key))
        if got is not None:
            log.error("spare %d: claimed but no assignment written within 10 s; retiring", self.id)
            self.retired = "no-assignment"
        return None

    def _lost(self, e: BaseException) -> None:
        self.retired, self.store_error = "store-lost", str(e).splitlines()[0][:200] if str(e) else type(e).__name__

    def _reconnect(self) -> bool:
        """A fresh client connection to the same TCPStore (True), replacing a broken one."""
        import torch.distributed as dist

        from torch_hooks.pg import job_store

        st = self.store
        if not isinstance(st, dist.TCPStore):
            return False
        try:
            new = dist.TCPStore(st.host, st.port, is_master=False, timeout=datetime.timedelta(seconds=1))
        except Exception:  # noqa: BLE001 - still unreachable
            return False
        self._kept.append(st)  # never drop a handle that may host the server
        self.store, self.kv = new, job_store(new, self.job)
        return True

    def _poll(self, key: str, timeout_s: float, poll_s: float) -> bool | None:
        """True once ``key`` exists (checked every ``poll_s``), False after ``timeout_s``, None
        when the store was unreachable for :data:`STORE_LOST_S` (then :attr:`retired` is set).
        A connection error is answered with a fresh connection (the store may be fine and only
        this connection broken), at most once a second."""
        deadline = time.monotonic() + timeout_s
        failing_since: float | None = None
        while True:
            try:
                if self.kv.check([key]):
                    return True
                if time.monotonic() - self._last_beat >= BEAT_EVERY_S:
                    self._beat()
                failing_since = None
            except Exception as e:  # noqa: BLE001 - store trouble: reconnect, give up after STORE_LOST_S
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("spare %d: the job's store failed (%s); reconnecting", self.id, str(e).splitlines()[0][:200])
                elif now - failing_since >= STORE_LOST_S:
                    return self._lost(e)
                if not self._reconnect():
                    time.sleep(max(poll_s, 1.0))
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def retire(self) -> bool:
        """Withdraw this spare (True) unless it was claimed already (False: call :meth:`wait`)."""
        return int(self.kv.add(f"spares/{self.id}/claimed", 1)) == 1
