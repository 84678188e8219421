"""Device faults that reached no torch hook client yet, kept per GPU for a client that registers
on that GPU later (pure: the clock is a parameter; the hook server does the sending, counting
and logging).

Why keep them: the daemon may read a fault before the trainer's client is (back) on the
socket, e.g. right after a daemon restart.  Why only for a while: a fault older than
:data:`PENDING_FAULT_TTL_NS` is stale (the rank has died or moved by other means), and a GPU
that faults over and over keeps only its :data:`PENDING_FAULTS_PER_GPU` newest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

#: How long a device fault that reached no hook client is kept: 120 s covers a client's
#: reconnect backoff several times over.
PENDING_FAULT_TTL_NS = 120 * 1_000_000_000
#: Undelivered device faults kept per GPU (the oldest is dropped beyond this).
PENDING_FAULTS_PER_GPU = 8

T = TypeVar("T")


@dataclass(frozen=True)
class Kept(Generic[T]):
    """One kept fault: what the caller stored, and when (monotonic ns)."""

    item: T
    kept_ns: int


class PendingFaults(Generic[T]):
    """Per GPU index, the faults no client got yet, oldest first.

    Args:
        ttl_ns: a fault kept this long (ns) or longer is expired.
        per_gpu: at most this many are kept per GPU; keeping one more drops the oldest.

    Attributes:
        by_gpu: GPU index -> kept faults, oldest first (a GPU with none is absent).
    """

    def __init__(self, ttl_ns: int = PENDING_FAULT_TTL_NS, per_gpu: int = PENDING_FAULTS_PER_GPU):
        self.ttl_ns = ttl_ns
        self.per_gpu = per_gpu
        self.by_gpu: dict[int, list[Kept[T]]] = {}

    def expire(self, now_ns: int) -> dict[int, int]:
        """Drop what is ``ttl_ns`` old at ``now_ns``; returns GPU index -> how many were dropped
        (only GPUs that lost some)."""
        gone: dict[int, int] = {}
        for gpu in list(self.by_gpu):
            keep = [k for k in self.by_gpu[gpu] if now_ns - k.kept_ns < self.ttl_ns]
            if len(keep) < len(self.by_gpu[gpu]):
                gone[gpu] = len(self.by_gpu[gpu]) - len(keep)
            if keep:
                self.by_gpu[gpu] = keep
            else:
                del self.by_gpu[gpu]
        return gone

    def keep(self, gpu: int, item: T, now_ns: int) -> int:
        """Keep ``item`` for GPU ``gpu`` at ``now_ns`` (call :meth:`expire` first to drop stale
        ones); returns how many older ones were dropped to stay within ``per_gpu`` (0 or 1)."""
        kept = self.by_gpu.setdefault(gpu, [])
        kept.append(Kept(item, now_ns))
        dropped = 0
        while len(kept) > self.per_gpu:
            del kept[0]
            dropped += 1
        return dropped

    def take(self, gpu: int) -> list[Kept[T]]:
        """Everything kept for GPU ``gpu``, oldest first, now forgotten (delivered once)."""
        return self.by_gpu.pop(gpu, [])

    def __bool__(self) -> bool:
        return bool(self.by_gpu)

    def __iter__(self):
        """Every kept fault, GPU by GPU, oldest first within a GPU."""
        for ks in self.by_gpu.values():
            yield from ks
