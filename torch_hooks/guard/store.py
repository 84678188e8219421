"""The job's store as the guard uses it: a connection that breaks is replaced and the
operation retried (a timeout is not), a second connection for the client thread, and the
store's ports (so the socket shutdown on abort spares them)."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger("linkpass.torch_hooks")


class StoreMixin:
    """Store connections of :class:`~torch_hooks.guard.LinkPassGuard` (uses and replaces its
    ``_store``, ``base_store`` and ``kv``; ``_kept_stores`` holds the replaced handles)."""

    def _store_ports(self) -> frozenset[int]:
        ports = {getattr(st, "port", None) for st in [self._store, *self._kept_stores] if isinstance(st, dist.TCPStore)}
        return frozenset(p for p in ports if p)

    @staticmethod
    def _connection_error(ex: BaseException) -> bool:
        """A broken store connection (reconnect and retry), not a timeout (give up)."""
        if isinstance(ex, dist.DistStoreError) or "timeout" in str(ex).lower():
            return False
        return isinstance(ex, (dist.DistNetworkError, ConnectionError, OSError)) or any(
            t in str(ex) for t in ("Broken pipe", "Connection reset", "Failed to recv", "Connection refused"))

    def _reconnect_store(self, deadline: float) -> bool:
        """Replace ``base_store``/``kv`` (the agreement's and the gloo rendezvous' handles) with a
        fresh client connection to the same TCPStore; True when it worked.  The old handle is
        kept (it may host the store's server)."""
        st = self._store
        if not isinstance(st, dist.TCPStore):
            return False
        left = max(1.0, min(10.0, deadline - time.monotonic()))
        try:
            new = dist.TCPStore(st.host, st.port, is_master=False, timeout=datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - the store itself is gone
            log.warning("rank %d: could not reconnect to the job's store %s:%d: %s", self.rank, st.host, st.port,
                        str(e).splitlines()[0][:200])
            return False
        self._kept_stores.append(st)
        self.base_store = self._store = new
        self.kv = dist.PrefixStore(f"linkpass/{self._job}", new)
        log.warning("rank %d: the job's store connection broke; reconnected to %s:%d", self.rank, st.host, st.port)
        return True

    def _store_retry(self, what: str, fn: Callable, deadline: float):
        """``fn()`` (store operations on ``self.kv``); after a connection error (not a timeout)
        reconnect and call it again until ``deadline`` (monotonic s)."""
        while True:
            try:
                return fn()
            except Exception as ex:
                if not self._connection_error(ex) or time.monotonic() >= deadline:
                    raise
                log.warning("rank %d: store connection failed in %s: %s", self.rank, what, str(ex).splitlines()[0][:200])
                if not self._reconnect_store(deadline):
                    time.sleep(0.2)

    def _own_kv(self):
        """A second client connection to the job's store (TCPStore), under the same prefix; the
        shared one when the store is not a TCPStore."""
        st = self._store
        if isinstance(st, dist.TCPStore):
            try:
                own = dist.TCPStore(st.host, st.port, is_master=False, timeout=datetime.timedelta(seconds=3))
                return dist.PrefixStore(f"linkpass/{self._job}", own)
            except Exception as e:  # noqa: BLE001 - fall back to the shared connection
                log.warning("second store connection failed (%s); using the shared one", e)
        return self.kv
