"""The rebuild path: after a link fault (a notice, a peer's request, a collective error) every
rank asks for epoch N+1 in the store, aborts the group, writes its proposal (step, usable
rails), reads everyone's and builds the agreed group (:mod:`torch_hooks.agreement` decides)."""

from __future__ import annotations

import datetime
import json
import logging
import time

from torch_hooks import agreement
from torch_hooks import spare as sp
from torch_hooks.guard.exits import RebuildFailed, _Interrupted

log = logging.getLogger("linkpass.torch_hooks")


class RebuildMixin:
    """The rebuild of :class:`~torch_hooks.guard.LinkPassGuard`."""

    def _usable_view(self, it: _Interrupted) -> list[int]:
        """Rails this rank may use, by its daemon's newest notice (all of ``rails`` without one)."""
        n = self.client.latest if self.client is not None else None
        if n is None:
            view = list(self.rails)
        else:
            view = [r for r in self.rails if r in n.usable_common or (r not in n.rails)]
        if it.trigger == "notice" and it.notice is not None:
            view = [r for r in view if r not in it.notice.affected_rails]
        return view

    def _rebuild(self, it: _Interrupted, in_step: int) -> int:
        e = self.epoch + 1
        self._fence_point("rebuild")
        log.warning("rank %d: %s; abandoning process group epoch %d (rail %d) in step %d", self.rank, it.reason,
                    self.epoch, self.rail, in_step)
        rail_from = self.rail
        unmovable = self.backend != "gloo"
        req_key = f"rebuild/{e}/req"

        def ask() -> bool:
            # ask the others first (they find the request as soon as their collective fails), then abort
            if not self.kv.check([req_key]):
                self.kv.set(req_key, json.dumps({"rank": self.rank, "reason": it.reason, "unmovable": unmovable}))
                return False
            try:
                return bool(json.loads(self.kv.get(req_key)).get("unmovable"))
            except ValueError:
                return False

        try:
            unmovable = self._store_retry(f"rebuild epoch {e}", ask, time.monotonic() + self.rebuild_timeout_s) or unmovable
        except Exception as ex:
            raise RebuildFailed(f"the job's store is unreachable, rebuild epoch {e} cannot be agreed: {ex}") from None
        self.abort()
        t_abort = time.monotonic_ns()
        mig = it.migration or sp.read_migration(self.kv, e)
        if mig is None and it.trigger == "error":  # the faulty rank writes its request before it exits
            mig = sp.read_migration(self.kv, e)
        if mig is not None and mig.get("spare") is None:
            self._no_spare(f"rank {mig.get('rank')} lost its device ({mig.get('reason')}) and no spare worker is left")
        if unmovable:
            self._unmovable(f"{it.reason}; the {self.backend} communicator cannot move to another NIC in this process "
                            "(NCCL reads its HCA list once per process)" if self.backend != "gloo"
                            else f"{it.reason}; another rank cannot move in-process")
        view = self._usable_view(it)
        keep = it.trigger == "error" or mig is not None  # a migration keeps the rail when every rank can use it
        resume, new_rail, t_agree = self._agree(e, in_step, view, rail_from, keep, it.reason)
        t_built = time.monotonic_ns()
        if mig is not None:
            src = min(r for r in range(self.world_size) if r != mig["rank"])
            self._sync = {"src": src, "rank": mig["rank"], "spare": mig.get("spare")}
        n = it.notice
        ev = {"event": "rebuilt", "epoch": e, "trigger": it.trigger, "reason": it.reason, "rail_from": rail_from,
              "rail_to": new_rail, "interrupted_step": in_step, "resume_step": resume,
              "notice_generation": None if n is None else n.generation, "notice_t_ns": it.t_ns,
              "aborted_t_ns": t_abort, "agreed_t_ns": t_agree, "built_t_ns": t_built,
              "abort_ms": round((t_abort - it.t_ns) / 1e6, 3), "agree_ms": round((t_agree - t_abort) / 1e6, 3),
              "build_ms": round((t_built - t_agree) / 1e6, 3)}
        if mig is not None:
            ev.update(migrated_rank=mig["rank"], spare=mig.get("spare"), state_from=self._sync["src"])
        self.events.append(ev)
        self._awaiting = ev
        log.warning("rank %d: process group epoch %d on rail %d (was %d); replaying from step %d", self.rank, e, new_rail,
                    rail_from, resume)
        return resume

    def _agree(self, e: int, in_step: int, view: list[int], rail_from: int, keep_rail: bool, reason: str,
               rank: int | None = None) -> tuple[int, int, int]:
        """Write this rank's proposal for epoch ``e``, read everyone's, build the group: returns
        ``(resume step, rail, agreed t_ns)``.  Raises RebuildFailed on a store or connect timeout."""
        rank = self.rank if rank is None else rank
        self._fence_point("agree")
        deadline = time.monotonic() + self.rebuild_timeout_s
        mine = json.dumps({"step": in_step, "usable": view, "rail": rail_from})
        keys = [f"rebuild/{e}/rank/{r}" for r in range(self.world_size)]

        def exchange():
            # a store connection that breaks here is replaced (_store_retry) and the exchange
            # repeated: setting the same proposal twice is harmless
            self.kv.set(f"rebuild/{e}/rank/{rank}", mine)
            left = max(0.001, deadline - time.monotonic())
            self.kv.wait(keys, datetime.timedelta(seconds=left))
            return [json.loads(self.kv.get(k)) for k in keys]

        try:
            props = self._store_retry(f"rebuild epoch {e}", exchange, deadline)
        except Exception as ex:
            raise RebuildFailed(f"not every rank joined rebuild epoch {e} within {self.rebuild_timeout_s} s: {ex}") from None
        t_agree = time.monotonic_ns()
        try:
            d = agreement.decide({r: agreement.Proposal.from_mapping(p) for r, p in enumerate(props)}, list(self.rails),
                                 rail_from, keep_current=keep_rail)
        except ValueError as ex:
            raise RebuildFailed(f"rebuild epoch {e}: a bad proposal in the store: {ex}") from None
        if d.outcome == "no_rail":
            self._unmovable(f"{reason}; {d.reason} (proposals {props})")
        if not d.ok:
            raise RebuildFailed(f"rebuild epoch {e} cannot complete: {d.reason}")
        log.info("rank %d: rebuild epoch %d agreed: %s", self.rank, e, d.reason)
        resume, new_rail = d.resume_step, d.rail
        try:
            self.configure(e, new_rail)
        except Exception as ex:
            raise RebuildFailed(f"could not build process group epoch {e} on rail {new_rail}: {ex}") from None
        return resume, new_rail, t_agree
