"""The spare assignment protocol (torch_hooks.spare) on an in-process store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist

from torch_hooks import spare as sp


def _kv(store, job="j"):
    return dist.PrefixStore(f"linkpass/{job}", store)


def test_same_host_spare_first_each_spare_once_then_none():
    store = dist.HashStore()
    a = sp.Spare(store, job="j", host="h0")
    b = sp.Spare(store, job="j", host="h1")
    c = sp.Spare(store, job="j", host="h1")
    kv = _kv(store)
    x = sp.request_migration(kv, epoch=1, rank=1, world_size=2, step=7, rail=0, reason="xid:79", host="h1", pid=12345)
    assert x.spare == b.id and x.rank == 1 and x.step == 7 and x.host == "h1"
    assert b.wait(1) == x
    # the same epoch again answers with the existing assignment
    assert sp.request_migration(kv, epoch=1, rank=1, world_size=2, step=7, rail=0, reason="again", host="h1") == x
    req = sp.read_migration(kv, 1)
    assert req["rank"] == 1 and req["spare"] == b.id
    y = sp.request_migration(kv, epoch=2, rank=1, world_size=2, step=9, rail=0, reason="xid:79", host="h1")
    assert y.spare == c.id
    z = sp.request_migration(kv, epoch=3, rank=0, world_size=2, step=11, rail=0, reason="xid:48", host="h0")
    assert z.spare == a.id
    # none left: the request says so
    assert sp.request_migration(kv, epoch=4, rank=0, world_size=2, step=12, rail=0, reason="xid:79", host="h0") is None
    assert sp.read_migration(kv, 4)["spare"] is None
    assert sp.read_migration(kv, 5) is None


def test_the_request_is_in_the_store_before_the_assignment_the_spare_fences_on():
    """The spare SIGKILLs the faulty process as soon as it reads its assignment: the request the
    other ranks need must already be written by then."""

    class Recording:
        def __init__(self, kv):
            self.kv, self.sets = kv, []

        def set(self, key, value):
            self.sets.append(key)
            return self.kv.set(key, value)

        def __getattr__(self, name):
            return getattr(self.kv, name)

    store = dist.HashStore()
    spare = sp.Spare(store, job="j", host="h1")
    kv = Recording(_kv(store))
    a = sp.request_migration(kv, epoch=1, rank=1, world_size=2, step=3, rail=0, reason="xid:79", host="h1", pid=1)
    assert kv.sets == ["migrate/1/req", f"spares/{spare.id}/assign"]
    assert spare.wait(1) == a


def test_a_retired_spare_is_never_assigned_and_a_wait_times_out():
    store = dist.HashStore()
    s = sp.Spare(store, job="j", host="h0")
    assert s.wait(0.3, poll_s=0.05) is None
    # it retired by its own claim (so it did not go on to wait for a racing claim's assignment)
    assert s.retired == "timeout" and int(_kv(store).add(f"spares/{s.id}/claimed", 0)) == 1
    assert sp.request_migration(_kv(store), epoch=1, rank=0, world_size=2, step=0, rail=0, reason="r", host="h0") is None


def test_claim_races_are_exclusive():
    store = dist.HashStore()
    spares = [sp.Spare(store, job="j", host="h0") for _ in range(3)]
    got, lock = [], threading.Lock()

    def claim():
        d = sp.claim_spare(_kv(store), "h0")
        with lock:
            got.append(None if d is None else d["id"])

    ts = [threading.Thread(target=claim) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(i for i in got if i is not None) == sorted(s.id for s in spares)
    assert got.count(None) == 5
    assert all(not s.retire() for s in spares)


def test_assignment_round_trip_and_fence_kills_only_the_recorded_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        a = sp.Assignment(epoch=1, rank=1, world_size=2, step=3, rail=0, host="h1", pid=p.pid, start=sp.proc_start(p.pid), spare=2)
        assert sp.Assignment.from_json(a.to_json()) == a
        assert sp.fence(a, host="h0") == "other-host"
        wrong = sp.Assignment(**{**json.loads(a.to_json()), "start": (a.start or 0) + 1})
        assert sp.fence(wrong, host="h1") == "gone"  # same pid, another process: left alone
        assert p.poll() is None
        assert sp.fence(a, host="h1") == "killed"
        assert p.wait(5) == -9
        assert sp.fence(a, host="h1") == "gone"
    finally:
        if p.poll() is None:
            p.kill()


def test_exit_codes_are_distinct():
    from torch_hooks.guard import EXIT_MIGRATE

    assert len({sp.EXIT_NO_SPARE, sp.EXIT_FENCED, EXIT_MIGRATE, 0, 1, 2}) == 6
    assert os.EX_UNAVAILABLE == sp.EXIT_NO_SPARE and os.EX_IOERR == sp.EXIT_FENCED


def test_a_dead_spare_is_skipped_for_a_live_one_on_another_host():
    """A spare SIGKILLed on the faulty rank's host is never claimed (its pid is gone), a spare
    whose heartbeat stopped is skipped too, and a live spare on another host is used."""
    store = dist.HashStore()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kv = _kv(store)
        dead = sp.Spare(store, job="j", host="h1")
        # pretend the spare runs in process p, then kill p: same host, pid gone
        kv.set(f"spares/{dead.id}", json.dumps({"id": dead.id, "host": "h1", "pid": p.pid, "start": sp.proc_start(p.pid)}))
        stale = sp.Spare(store, job="j", host="h1")
        kv.set(f"spares/{stale.id}/beat", repr(time.time() - 60))  # another host's spare stopped beating
        live = sp.Spare(store, job="j", host="h0")
        p.kill()
        p.wait(5)
        assert sp.spare_alive(kv, {"id": dead.id, "host": "h1", "pid": p.pid, "start": 1}, "h1")[0] is False
        ok, why = sp.spare_alive(kv, {"id": stale.id, "host": "h9", "pid": 1}, "h1")
        assert not ok and "heartbeat" in why
        a = sp.request_migration(kv, epoch=1, rank=1, world_size=2, step=5, rail=0, reason="xid:79", host="h1", pid=4242)
        assert a is not None and a.spare == live.id
        assert live.wait(1) == a
        # the skipped ones were not claimed: the stalled one can still retire (or be used) later
        assert stale.retire()
    finally:
        if p.poll() is None:
            p.kill()


def test_a_waiting_spare_beats():
    store = dist.HashStore()
    s = sp.Spare(store, job="j", host="h0")
    kv = _kv(store)
    stale = time.time() - 100
    kv.set(f"spares/{s.id}/beat", repr(stale))
    assert s.wait(1.3, poll_s=0.05) is None and s.retired == "timeout"
    assert float(kv.get(f"spares/{s.id}/beat")) > stale  # it rewrote its heartbeat while it waited


def test_two_faults_in_one_epoch_only_one_request_wins_and_the_loser_claims_nothing():
    store = dist.HashStore()
    s1 = sp.Spare(store, job="j", host="h0")
    s2 = sp.Spare(store, job="j", host="h1")
    kv = _kv(store)
    a = sp.request_migration(kv, epoch=1, rank=0, world_size=2, step=5, rail=0, reason="xid:79", host="h0", pid=100)
    assert a.spare == s1.id
    with pytest.raises(sp.MigrationConflict) as ei:
        sp.request_migration(kv, epoch=1, rank=1, world_size=2, step=5, rail=0, reason="xid:79", host="h1", pid=200)
    assert ei.value.holder == "0"
    assert sp.read_migration(kv, 1)["rank"] == 0  # the winner's request was not overwritten
    assert s2.retire()  # the loser claimed no spare


def test_two_racing_requests_one_winner():
    """Both faulty ranks pass the same checks at the same time: compare_set lets one through."""
    store = dist.HashStore()
    for h in ("h0", "h1"):
        sp.Spare(store, job="j", host=h)
    out, lock, go = [], threading.Lock(), threading.Barrier(2)

    def fault(rank):
        go.wait()
        try:
            r = sp.request_migration(_kv(store), epoch=1, rank=rank, world_size=2, step=1, rail=0, reason="r",
                                     host=f"h{rank}", pid=1000 + rank)
        except sp.MigrationConflict as e:
            r = e
        with lock:
            out.append(r)

    ts = [threading.Thread(target=fault, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wins = [r for r in out if isinstance(r, sp.Assignment)]
    assert len(wins) == 1 and sum(isinstance(r, sp.MigrationConflict) for r in out) == 1
    assert sp.read_migration(_kv(store), 1)["rank"] == wins[0].rank


def test_compare_set_expected_empty_means_absent():
    """The store semantics request_migration relies on (torch 2.13)."""
    for st in (dist.HashStore(), dist.PrefixStore("p", dist.HashStore())):
        assert st.compare_set("k", "", "a") == b"a"
        assert st.compare_set("k", "", "b") == b"a"
        assert st.get("k") == b"a"


def test_a_spare_whose_store_died_retires_quietly(tmp_path):
    """The process hosting the store dies: the spare notices within STORE_LOST_S (+ reconnect
    attempts), retires with retired == "store-lost" and never raises."""
    import datetime
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    srv = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                            f"s = d.TCPStore('127.0.0.1', {port}, None, True, wait_for_workers=False); "
                            "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert srv.stdout.readline().strip() == b"up"
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        spare = sp.Spare(store, job="j", host="h0")
        srv.kill()
        srv.wait(5)
        assert spare.wait(120, poll_s=0.05) is None
        # it noticed (a wait that ran out would have retired it as "timeout")
        assert spare.retired == "store-lost" and spare.store_error
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(5)
        srv.stdout.close()
