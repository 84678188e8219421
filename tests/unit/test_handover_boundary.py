"""A spare must never resume ahead of a peer (torch_hooks.handover.behind_boundary, the
controller's put-off planned hand-over, the joining spare's check in ResilientProcessGroup._join).

The case: the moving rank completed collective K, stepped and issued K+1 (its boundary) while a
peer had not completed K when the abort came.  The peer re-issues K, a spare starting at K+1
pairs its K+1 with it, and every later collective is off by one (silently wrong weights, then a
collective with no partner at the end).  Real in-memory stores, stand-in groups; no sleeps."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from torch_hooks import controller as ctl_mod  # noqa: E402
from torch_hooks import pg  # noqa: E402
from torch_hooks.controller import Controller, Settings  # noqa: E402
from torch_hooks.handover import behind_boundary  # noqa: E402
from torch_hooks.tracker import Tracker  # noqa: E402

# --------------------------------------------------------------------------- the decision


def test_a_peer_whose_low_is_below_the_boundary_is_behind_and_one_at_or_above_is_not():
    own = {"0": 51, "1": 7}
    positions = {0: {"lows": {"0": 50, "1": 7}}, 2: {"lows": {"0": 51, "1": 9}}, 3: {"lows": {"0": 60}}}
    assert behind_boundary(own, positions) == [("0", 0, 50, 51)]


def test_a_position_without_lows_or_without_the_group_says_nothing():
    assert behind_boundary({"0": 51, "sub": 3}, {0: {"steps": 4}, 1: {"lows": {"0": 51}}}) == []


def test_the_joining_spare_compares_each_peer_with_its_own_resume_seq():
    assert pg.peers_behind({0: 50, 2: 51, 3: 52}, 51) == {0: 50}
    assert pg.peers_behind({0: 51}, 51) == {}


# --------------------------------------------------------------------------- the controller


def _moving_rank(store, done: list) -> Controller:
    c = Controller(Settings({"RANK": "1", "WORLD_SIZE": "2", "LINKPASS_REBUILD_TIMEOUT_S": "20"}), Tracker())
    c._kv = c._kv_wait = dist.PrefixStore("linkpass/t", store)
    # one group (DDP's), boundary at seq 51; completed_since: what has completed here since
    c.groups = [SimpleNamespace(group_name="0", boundary_seq=51, completed_since=lambda seq: done[0] >= seq)]
    c._planned = ({"id": 1, "pid": 1}, "GPU 1 at risk")
    c._kv.add("spares/1/claimed", 1)
    return c


def _defer_in_epoch(c: Controller, e: int, peer_low: int) -> list:
    """What _rebuild does around the at-risk branch: the step lock held, then the decision."""
    c._kv_wait.set(f"rebuild/{e}/pos/0", json.dumps({"steps": 45, "lows": {"0": peer_low}}))
    if not c._step_held:
        assert c.tracker.step_lock.acquire(timeout=5)
    c._step_locked = True
    lag = c._planned_lag(c._kv_wait, e)
    if lag:
        c._defer_planned(e, lag)
    c._step_locked = False
    if not c._step_held:
        c.tracker.step_lock.release()
    c.epoch = e
    return lag


def test_a_peer_behind_the_boundary_puts_the_hand_over_off_until_a_collective_after_it_completes():
    done = [50]  # this rank completed seq 50, and 51 is in flight
    c = _moving_rank(dist.HashStore(), done)
    assert _defer_in_epoch(c, 1, peer_low=50) == [("0", 0, 50, 51)]
    # the optimizer cannot step: the boundary (and so the spare's resume point) stays at seq 51
    assert c._step_held and not c.tracker.step_lock.acquire(blocking=False)
    c._poll_held_plan()
    assert not c._kv.check(["rebuild/2/req"])           # the peer may still be behind: no request
    done[0] = 51                                        # seq 51 completed: the peer issued it
    c._poll_held_plan()
    req = json.loads(c._kv.get("rebuild/2/req"))
    assert req["trigger"] == "at_risk" and req["rank"] == 1
    # epoch 2: the peer is past the boundary, so the hand-over goes ahead with the lock still held
    assert _defer_in_epoch(c, 2, peer_low=52) == [] and c._step_held
    assert c._planned is not None


def test_with_no_collective_after_the_boundary_by_the_deadline_the_rank_stays_and_steps_again():
    c = _moving_rank(dist.HashStore(), [50])
    _defer_in_epoch(c, 1, peer_low=50)
    c._held_plan["deadline"] = time.monotonic() - 1     # the rebuild timeout has passed
    c._poll_held_plan()
    assert c._planned is None and c._held_plan is None and not c._step_held
    assert c.tracker.step_lock.acquire(blocking=False)  # the optimizer may step again
    assert int(c._kv.add("spares/1/claimed", 0)) == 0   # the spare is given back
    assert not c._kv.check(["rebuild/2/req"])


def test_a_peer_still_behind_after_the_last_try_gives_the_move_up_inside_the_rebuild(monkeypatch):
    monkeypatch.setattr(ctl_mod, "MAX_HANDOVER_DEFERRALS", 2)
    c = _moving_rank(dist.HashStore(), [50])
    for e in (1, 2):
        _defer_in_epoch(c, e, peer_low=50)
        assert c._held_plan["tries"] == e and c._step_held
    _defer_in_epoch(c, 3, peer_low=50)  # the rebuild's end lets the lock go
    assert c._planned is None and not c._step_held and c.tracker.step_lock.acquire(blocking=False)


# --------------------------------------------------------------------------- the joining spare


@pytest.fixture
def no_inner(monkeypatch):
    """The join's own logic only: no gloo group is built (its peers are the test's store keys)."""
    monkeypatch.setattr(pg.ResilientProcessGroup, "_build", lambda self, gen, prefix, interface: None)
    monkeypatch.setattr(pg, "_join_hook", [None, None])


def test_a_spare_that_would_resume_ahead_of_a_peer_stops_with_the_reason(no_inner):
    store = dist.HashStore()
    dist.PrefixStore("linkpass/gen2/", store).set("reissue/0", json.dumps({"low": 50}))
    reasons = []
    pg._join_hook[:] = [lambda g: (2, 51), reasons.append]
    with pytest.raises(pg.RebuildError):
        pg.ResilientProcessGroup(store, 1, 2)
    assert len(reasons) == 1 and "rank(s) [0]" in reasons[0] and "seq 50" in reasons[0] and "seq 51" in reasons[0]
    assert json.loads(dist.PrefixStore("linkpass/gen2/", store).get("reissue/1"))["low"] == 51  # written first


def test_a_spare_whose_peers_are_at_or_past_its_resume_seq_joins():
    store = dist.HashStore()
    dist.PrefixStore("linkpass/gen2/", store).set("reissue/0", json.dumps({"low": 52}))
    g = None
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(pg.ResilientProcessGroup, "_build", lambda self, gen, prefix, interface: None)
            reasons = []
            m.setattr(pg, "_join_hook", [lambda g_: (2, 51), reasons.append])
            g = pg.ResilientProcessGroup(store, 1, 2)
        assert reasons == [] and g._virtual
    finally:
        if g is not None:
            g.shutdown()


def test_a_spare_that_cannot_read_its_peers_lows_stops_rather_than_guess(no_inner, monkeypatch):
    monkeypatch.setattr(pg, "JOIN_LOWS_WAIT_S", 0.2)
    pg._join_hook[:] = [lambda g: (2, 51), None]
    with pytest.raises(pg.RebuildError, match="not in the store within"):
        pg.ResilientProcessGroup(dist.HashStore(), 1, 2)
