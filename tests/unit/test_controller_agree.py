"""The controller's agreement rounds (torch_hooks.controller.Controller._agree), two ranks on a
real in-memory store: a round with no rail every rank can use is asked again, with fresh
proposals, until one comes back or the wait is over."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from torch_hooks import controller as ctl_mod  # noqa: E402
from torch_hooks.controller import Controller, Settings  # noqa: E402
from torch_hooks.tracker import Tracker  # noqa: E402


def _notice(usable):
    return SimpleNamespace(usable_common=frozenset(usable), affected_rails=frozenset({0}), unusable=frozenset())


def _ranks(store, world=2):
    out = []
    for r in range(world):
        c = Controller(Settings({"RANK": str(r), "WORLD_SIZE": str(world), "LINKPASS_RAIL_IFACES": "0=a,1=b",
                                 "GLOO_SOCKET_IFNAME": "a", "LINKPASS_REBUILD_TIMEOUT_S": "20"}), Tracker())
        c._kv_wait = dist.PrefixStore("linkpass/t", store)
        c.client = SimpleNamespace(latest=_notice(()))  # rail 0 cut, rail 1 held down after a false alarm
        out.append(c)
    return out


def _agree_all(ranks, e=1):
    got = {}

    def run(c):
        got[c.s.rank] = c._agree(c._kv_wait, e, {"rank": 0, "trigger": "notice"})[0]

    ts = [threading.Thread(target=run, args=(c,)) for c in ranks]
    for t in ts:
        t.start()
    return ts, got


def test_a_rail_that_comes_back_within_the_wait_is_taken_by_every_rank():
    ranks = _ranks(dist.HashStore())
    ts, got = _agree_all(ranks)
    ranks[0]._kv_wait.wait(["rebuild/1/prop/0", "rebuild/1/prop/1"])
    for c in ranks:  # the daemons replan: rail 1 usable everywhere again
        c.client.latest = _notice({1})
    for t in ts:
        t.join(30)
    assert [got[r].outcome for r in (0, 1)] == ["ok", "ok"] and got[0].rail == got[1].rail == 1


def test_no_rail_for_the_whole_wait_ends_in_no_rail(monkeypatch):
    monkeypatch.setattr(ctl_mod, "NO_RAIL_WAIT_S", 0.6)
    ranks = _ranks(dist.HashStore())
    ts, got = _agree_all(ranks)
    for t in ts:
        t.join(30)
    assert [got[r].outcome for r in (0, 1)] == ["no_rail", "no_rail"]
    assert "rail 1" in got[0].reason


def test_the_kernel_s_word_on_the_latched_rail_s_netdev(tmp_path, monkeypatch):
    from torch_hooks import controller as c

    monkeypatch.setattr(c, "SYS_NET", str(tmp_path))
    for name, oper, carrier in (("up0", "up", "1"), ("nocarrier", "up", "0"), ("lower", "lowerlayerdown", "0"),
                                ("down", "down", None)):
        d = tmp_path / name
        d.mkdir()
        (d / "operstate").write_text(oper + "\n")
        if carrier is not None:
            (d / "carrier").write_text(carrier + "\n")
    assert c.netdev_down("up0") is False
    assert c.netdev_down("nocarrier") is True and c.netdev_down("lower") is True and c.netdev_down("down") is True
    # unknown here: the daemon's notice decides
    assert c.netdev_down("absent") is False and c.netdev_down(None) is False and c.netdev_down("../up0") is False


def test_a_peer_that_left_the_job_ends_the_wait_for_its_proposal_at_once_with_the_reason():
    ranks = _ranks(dist.HashStore())
    ranks[1]._kv = ranks[1]._kv_wait
    ranks[1].mark_left()  # rank 1's script ended: its process is exiting
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] left the job .* rebuild epoch 1"):
        ranks[0]._agree(ranks[0]._kv_wait, 1, {"rank": 0, "trigger": "collective_error"})


def test_a_peer_that_neither_proposes_nor_left_is_named_after_the_timeout():
    ranks = _ranks(dist.HashStore())
    ranks[0].s.rebuild_timeout_s = 0.2
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not join rebuild epoch 1 within"):
        ranks[0]._agree(ranks[0]._kv_wait, 1, {"rank": 0, "trigger": "collective_error"})


class _Exited(Exception):
    pass


def _exiting(store, rank, world=2):
    codes = []

    def exit_fn(code, reason):
        codes.append((code, reason))
        raise _Exited

    c = Controller(Settings({"RANK": str(rank), "WORLD_SIZE": str(world), "LINKPASS_RAIL_IFACES": "0=a,1=b",
                             "GLOO_SOCKET_IFNAME": "a", "LINKPASS_REBUILD_TIMEOUT_S": "3"}), Tracker(), exit_fn=exit_fn)
    c._kv = c._kv_wait = dist.PrefixStore("linkpass/t", store)
    return c, codes


def test_a_peer_that_lost_its_device_with_nothing_to_take_it_stops_the_job_at_once_with_its_reason():
    """Rank 1's GPU failed and no spare can take its shard: the request says so (handover kind
    "none") and rank 1 exits; rank 0 must stop now with that reason, not wait the rebuild timeout
    for a proposal rank 1 will never write (and then exit 76 naming the wrong cause)."""
    from torch_hooks.spare import EXIT_NO_SPARE

    c, codes = _exiting(dist.HashStore(), 0)
    req = {"rank": 1, "trigger": "device_fault", "reason": "GPU 0 failed: Xid 79",
           "handover": {"kind": "none", "rank": 1, "reason": "the model is sharded (fully_shard)"}}
    with pytest.raises(_Exited):
        c._rebuild_locked(1, 0, 0, req, None)
    assert codes == [(EXIT_NO_SPARE, "rank 1 lost its device and no spare can take it: the model is sharded (fully_shard)")]
    assert c._kv.check(["left/0"])  # and rank 0 is marked gone too, for anyone still waiting on it


def test_a_rank_that_gives_up_is_marked_gone_so_its_peers_stop_waiting_for_it():
    store = dist.HashStore()
    quitter, codes = _exiting(store, 1)
    with pytest.raises(_Exited):
        quitter.exit_fn(76, "rebuild failed")
    assert codes == [(76, "rebuild failed")]
    waiter = _ranks(store)[0]
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] left the job"):
        waiter._agree(waiter._kv_wait, 1, {"rank": 0, "trigger": "collective_error"})
