"""linkpass.core.pending: device faults kept per GPU for a hook client that registers later
(time-to-live, bound per GPU, delivered once), on a fake clock."""

from __future__ import annotations

from linkpass.core.pending import PENDING_FAULT_TTL_NS, PENDING_FAULTS_PER_GPU, PendingFaults

S = 1_000_000_000


def test_kept_until_taken_once():
    p: PendingFaults[str] = PendingFaults()
    assert not p
    assert p.keep(4, "xid:79", 10 * S) == 0
    assert p and [(k.item, k.kept_ns) for k in p] == [("xid:79", 10 * S)]
    assert p.take(2) == []  # another GPU: nothing for it
    assert [k.item for k in p.take(4)] == ["xid:79"]
    assert p.take(4) == [] and not p and p.by_gpu == {}


def test_expire_drops_what_reached_the_ttl_and_says_how_many_per_gpu():
    p: PendingFaults[int] = PendingFaults(ttl_ns=100)
    p.keep(1, 1, 0)
    p.keep(1, 2, 50)
    p.keep(2, 3, 60)
    assert p.expire(99) == {}
    assert p.expire(100) == {1: 1}  # exactly the ttl old: stale
    assert [k.item for k in p.by_gpu[1]] == [2]
    assert p.expire(160) == {1: 1, 2: 1} and p.by_gpu == {}


def test_bound_per_gpu_drops_the_oldest():
    p: PendingFaults[int] = PendingFaults(per_gpu=3)
    dropped = [p.keep(0, i, i) for i in range(5)]
    assert dropped == [0, 0, 0, 1, 1]
    assert [k.item for k in p.by_gpu[0]] == [2, 3, 4]
    assert p.keep(1, 9, 9) == 0  # bounds are per GPU


def test_defaults():
    p = PendingFaults()
    assert (p.ttl_ns, p.per_gpu) == (PENDING_FAULT_TTL_NS, PENDING_FAULTS_PER_GPU) == (120 * S, 8)
