"""The migration path (:mod:`torch_hooks.spare`): a device fault on this rank's GPU hands the
rank to a spare through the store and fences this process; a spare joins the agreement in the
faulty rank's place and receives the state of the step to replay from a healthy replica."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from torch_hooks import spare as sp
from torch_hooks.guard.exits import RebuildFailed

log = logging.getLogger("linkpass.torch_hooks")


class MigrationMixin:
    """Rank migration for :class:`~torch_hooks.guard.LinkPassGuard`."""

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
