"""Every latched rank hands over at once (a rail's switch failed) while one of them is a step
behind another: the peer completed allreduce K with the lagging rank's gradients, stepped and
went on; the lagging rank never got K's result.  Its spare resumes from the peer's state (DDP:
replicas) instead of a step earlier, where the peer's spare would refuse to pair with it
(torch_hooks.handover.ranks_ahead / choose_forward / forward_source / own_rng in_step).  Real
in-memory stores; no sleeps."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from torch_hooks import handover  # noqa: E402


def _pos(steps: int, boundary: int, low: int, kinds=("ddp",), group: str = "0") -> dict:
    return {"steps": steps, "epoch": 0, "batch": steps, "boundary_seqs": [boundary], "boundaries": {group: boundary},
            "lows": {group: low}, "module_kinds": list(kinds)}


# rank 0 stuck in allreduce 50 (its boundary 49), rank 1 completed it, stepped: boundary 51
BEHIND = {0: _pos(24, 49, 50), 1: _pos(25, 51, 51)}


def test_a_rank_that_has_not_completed_a_collective_before_a_peers_boundary_is_behind_that_peer_only():
    assert handover.ranks_ahead(0, BEHIND) == [1]
    assert handover.ranks_ahead(1, BEHIND) == []
    aligned = {0: _pos(25, 51, 51), 1: _pos(25, 51, 51)}
    assert handover.ranks_ahead(0, aligned) == [] and handover.ranks_ahead(1, aligned) == []


def test_positions_without_boundaries_say_nothing():
    old = {0: {"steps": 24, "lows": {"0": 50}}, 1: {"steps": 25, "boundary_seqs": [51], "lows": {"0": 51}}}
    assert handover.ranks_ahead(0, old) == []


def test_when_the_peer_ahead_hands_over_too_a_ddp_rank_resumes_from_its_state():
    src, why = handover.choose_forward(0, BEHIND, {1: "handover"})
    assert src == 1 and "rank 1's state" in why and "step 25" in why
    assert handover.choose_forward(1, BEHIND, {}) == (1, "")


def test_when_the_peer_ahead_rebuilds_in_process_the_rank_keeps_its_own_state():
    src, why = handover.choose_forward(0, BEHIND, {1: "in-process"})
    assert src == 0 and "rebuild in-process" in why
    src, why = handover.choose_forward(0, BEHIND, {})  # no word from it: the same
    assert src == 0


def test_sharded_or_unknown_modules_have_no_replica():
    for kinds in (("fsdp2",), ("ddp", "fsdp2"), ()):
        pos = {0: _pos(24, 49, 50, kinds), 1: _pos(25, 51, 51, kinds)}
        src, why = handover.choose_forward(0, pos, {1: "handover"})
        assert src == 0 and "not replicated" in why, kinds
    legacy = {0: {k: v for k, v in BEHIND[0].items() if k != "module_kinds"}, 1: BEHIND[1]}
    assert handover.choose_forward(0, legacy, {1: "handover"})[0] == 0


def test_of_several_peers_ahead_the_one_with_most_steps_then_the_lowest_rank_is_the_source():
    pos = {0: _pos(24, 49, 50), 1: _pos(25, 51, 51), 2: _pos(25, 51, 51), 3: _pos(24, 49, 50)}
    fates = {1: "handover", 2: "handover"}
    assert handover.choose_forward(0, pos, fates)[0] == 1
    assert handover.choose_forward(3, pos, fates)[0] == 1
    # one of them stays: it has completed K too, so it resumes at the same boundary as the spares
    assert handover.choose_forward(0, pos, {1: "in-process", 2: "handover"})[0] == 2
    # every one ahead stays: they issue K again for rank 0, whose own state is then right
    src, why = handover.choose_forward(0, pos, {1: "in-process", 2: "in-process"})
    assert src == 0 and "rank(s) [1, 2] rebuild in-process" in why


def test_behind_in_a_second_group_only_counts_too():
    pos = {0: {**_pos(24, 49, 49), "boundaries": {"0": 49, "sub": 7}, "lows": {"0": 49, "sub": 6}},
           1: {**_pos(25, 49, 49), "boundaries": {"0": 49, "sub": 8}, "lows": {"0": 49, "sub": 8}}}
    assert handover.ranks_ahead(0, pos) == [1]


def _store():
    return dist.HashStore()


def test_forward_source_reads_positions_and_fates_from_the_store():
    kv = _store()
    for r, p in BEHIND.items():
        kv.set(f"rebuild/3/pos/{r}", json.dumps(p))
    kv.set("rebuild/3/fate/1", "handover")
    src, why = handover.forward_source(kv, 3, 0, 2, timeout_s=5)
    assert src == 1 and why
    assert handover.forward_source(kv, 3, 1, 2, timeout_s=5) == (1, "")


def test_forward_source_with_a_fate_missing_keeps_the_own_state_and_says_so():
    kv = _store()
    for r, p in BEHIND.items():
        kv.set(f"rebuild/3/pos/{r}", json.dumps(p))
    src, why = handover.forward_source(kv, 3, 0, 2, timeout_s=0.05)
    assert src == 0 and "not all in the store" in why


def test_forward_source_with_a_malformed_position_keeps_the_own_state():
    kv = _store()
    kv.set("rebuild/3/pos/0", "{not json")
    kv.set("rebuild/3/pos/1", json.dumps(BEHIND[1]))
    src, why = handover.forward_source(kv, 3, 0, 2, timeout_s=0.05)
    assert src == 0 and "not all in the store" in why


def test_the_latched_rng_record_gives_the_draws_made_in_the_step_the_rank_did_not_finish():
    torch.manual_seed(7)
    at_boundary = torch.get_rng_state().clone()
    torch.rand(5)  # the step's forward (dropout masks)
    now = torch.get_rng_state().clone()
    tracker = SimpleNamespace(boundary_pos={"steps": 24}, rng_by_step={24: {"cpu": at_boundary}}, rng_pre_step={})
    rec = torch.load(io.BytesIO(handover.own_rng(tracker, in_step=True)), map_location="cpu", weights_only=False)
    rng, why = handover.pick_rng(rec, 25)  # the peer ahead's step
    assert torch.equal(rng["cpu"], now) and "after the draws of step 25" in why
    rng, _ = handover.pick_rng(rec, 24)
    assert torch.equal(rng["cpu"], at_boundary)
    assert handover.pick_rng(rec, 27)[0] is None


def test_a_rank_ahead_in_other_process_groups_is_not_a_replica():
    """DP x TP on 4 ranks (world group "0", DP groups "1" {0,2} / "2" {1,3}, TP groups "3" {0,1} /
    "4" {2,3}): rank 3 behind in the world group; rank 0 (another TP shard) is ahead and leaves."""
    def pos(steps, b, low, groups):
        return {"steps": steps, "boundaries": {g: b for g in groups}, "lows": {g: low for g in groups},
                "boundary_seqs": [b] * len(groups), "module_kinds": ["ddp"]}
    positions = {0: pos(25, 51, 51, ["0", "1", "3"]), 1: pos(24, 49, 50, ["0", "2", "3"]),
                 2: pos(24, 49, 50, ["0", "1", "4"]), 3: pos(24, 49, 50, ["0", "2", "4"])}
    assert handover.ranks_ahead(3, positions) == [0]
    src, why = handover.choose_forward(3, positions, {0: "handover"})
    assert src == 3 and "same process groups" in why
    # a rank in the same groups ahead of it is taken
    positions[4] = pos(25, 51, 51, ["0", "2", "4"])
    assert handover.choose_forward(3, positions, {0: "handover", 4: "handover"})[0] == 4


def test_a_rank_ahead_that_exits_instead_of_handing_over_is_named():
    src, why = handover.choose_forward(0, BEHIND, {1: "exit"})
    assert src == 0 and "do not hand over" in why and "1: exit" in why
