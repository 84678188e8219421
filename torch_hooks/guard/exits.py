"""How a guarded rank stops when it cannot go on in-process: the exit statuses, the exceptions,
and the methods that log why, report it to the daemon, then exit (or raise, with
``on_unmovable="raise"``)."""

from __future__ import annotations

import logging
import os
import sys
import time

from torch_hooks import spare as sp
from torch_hooks.protocol import Notice

log = logging.getLogger("linkpass.torch_hooks")

#: Exit status when the rank cannot continue in this process (EX_TEMPFAIL): a launcher should
#: start it again (elsewhere, once rank migration exists).
EXIT_MIGRATE = 75
#: Exit status when the ranks could not agree on or build a new process group within
#: ``rebuild_timeout_s`` (a rank that died for good, a fault on the spare, a second fault during
#: a migration): 76, ``EX_PROTOCOL`` in sysexits.h.  Distinct from 75 (move the rank), 74 (this
#: rank was fenced) and 69 (no spare left).
EXIT_REBUILD_FAILED = 76


class LinkPassExit(SystemExit):
    """Raised (with ``on_unmovable="raise"``) instead of exiting with :data:`EXIT_MIGRATE`;
    ``code`` is 75 and ``reason`` says why, so an uncaught one still exits with 75."""

    def __init__(self, reason: str, code: int = EXIT_MIGRATE):
        super().__init__(code)
        self.reason = reason


class RebuildFailed(RuntimeError):
    """The ranks could not agree on or build a new process group (store timeout, connect
    failure, a rank more than one step ahead); the message says which."""


class _Interrupted(BaseException):
    """Unwinds the user's step when its process group must be dropped.  A BaseException, so a
    step's ``except Exception`` does not swallow it; it never leaves :meth:`LinkPassGuard.step`."""

    def __init__(self, trigger: str, reason: str, t_ns: int, notice: Notice | None = None):
        super().__init__(reason)
        self.trigger, self.reason, self.t_ns, self.notice = trigger, reason, t_ns, notice
        self.migration: dict | None = None


class ExitsMixin:
    """The exits of :class:`~torch_hooks.guard.LinkPassGuard` (uses its ``client``, ``rank``,
    ``pg`` and ``on_unmovable``)."""

    def _rebuild_failed(self, e: BaseException, from_thread: bool = False):
        """Log why, report ``rebuild_failed``, then raise ``e`` (``on_unmovable="raise"``, main
        thread) or exit :data:`EXIT_REBUILD_FAILED`."""
        why = (f"linkpass: REBUILD FAILED: {e}. The job cannot go on in-process; this rank exits "
               f"with status {EXIT_REBUILD_FAILED} so the launcher can restart the job.")
        log.error("%s", why)
        if self.on_unmovable == "raise" and not from_thread:
            raise e
        print(why, file=sys.stderr, flush=True)
        if self.client is not None:
            try:
                self.client.report("rebuild_failed", reason=str(e)[:500], exit_code=EXIT_REBUILD_FAILED)
                time.sleep(0.02)
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        self._flush_logs()
        os._exit(EXIT_REBUILD_FAILED)

    def _no_spare(self, reason: str, from_thread: bool = False):
        msg = (f"linkpass: NO SPARE LEFT: {reason}. The job cannot continue; every rank exits with status "
               f"{sp.EXIT_NO_SPARE}.")
        log.error("%s", msg)
        print(msg, file=sys.stderr, flush=True)
        if self.client is not None:
            self.client.report("no_spare", reason=reason[:500], exit_code=sp.EXIT_NO_SPARE)
            time.sleep(0.02)
        if self.on_unmovable == "raise" and not from_thread:
            raise LinkPassExit(reason, sp.EXIT_NO_SPARE)
        self._flush_logs()
        os._exit(sp.EXIT_NO_SPARE)

    @staticmethod
    def _flush_logs() -> None:
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass

    def _unmovable(self, reason: str):
        msg = (f"linkpass: rank {self.rank} cannot continue in this process: {reason}. "
               f"Exiting with status {EXIT_MIGRATE} so the launcher can restart it.")
        log.error("%s", msg)
        print(msg, file=sys.stderr, flush=True)
        if self.client is not None:
            self.client.report("unmovable", reason=reason[:500], exit_code=EXIT_MIGRATE)
            time.sleep(0.05)  # let the report leave before the process does
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:
                pass
        if self.on_unmovable == "raise":
            raise LinkPassExit(reason)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(EXIT_MIGRATE)
