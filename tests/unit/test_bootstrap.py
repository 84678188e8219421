"""The hook's start-up path for unmodified scripts: the sitecustomize chain, `linkpass exec`'s
environment, the settings it reads, the tracker's replay of data positions, and an unmodified
DDP script under `linkpass exec` + real torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from torch_hooks.controller import Settings, parse_rail_ifaces
from torch_hooks.handover import source_rank

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "torch_hooks" / "_site"


# --------------------------------------------------------------------------- pure parts


def test_rail_ifaces_keep_the_preference_order():
    assert list(parse_rail_ifaces("1=ens2, 0=ens1,")) == [1, 0]
    assert parse_rail_ifaces("") == {}


@pytest.mark.parametrize("text", ["0", "x=eth0", "0=", "=eth0", "-1=eth0"])
def test_a_malformed_rail_iface_names_the_variable(text):
    with pytest.raises(ValueError, match="LINKPASS_RAIL_IFACES"):
        parse_rail_ifaces(text)


def test_settings_name_the_bad_variable():
    with pytest.raises(ValueError, match="RANK='x'"):
        Settings({"RANK": "x", "WORLD_SIZE": "2"})
    s = Settings({"RANK": "1", "WORLD_SIZE": "2", "LINKPASS_RAIL_IFACES": "0=a,1=b", "GLOO_SOCKET_IFNAME": "b",
                  "LINKPASS_JOB": "j", "LINKPASS_HOST": "h1"})
    assert (s.rank, s.world_size, s.rail, s.job, s.host) == (1, 2, 1, "j", "h1")


def test_the_state_source_is_the_lowest_step_then_the_lowest_rank():
    assert source_rank({0: {"steps": 5}, 2: {"steps": 4}, 3: {"steps": 4}}) == 2
    assert source_rank({1: {"steps": 7}}) == 1


def test_bucket_sync_decoding_and_malformed_input():
    torch = pytest.importorskip("torch")
    from torch_hooks.tracker import decode_bucket_sync

    idx = torch.tensor([5, 4, 3, 2, 1, 0, 2], dtype=torch.int32)  # 6 indices, 2 buckets
    sizes = torch.tensor([2, 4], dtype=torch.int32)
    assert decode_bucket_sync([[idx], [sizes]]) == [[5, 4], [3, 2, 1, 0]]
    assert decode_bucket_sync([[idx]]) == []                                          # truncated
    assert decode_bucket_sync([[idx], [torch.tensor([3, 4], dtype=torch.int32)]]) == []  # sizes do not add up
    assert decode_bucket_sync([]) == []


def test_replay_skips_earlier_epochs_and_the_rank_s_batches_then_goes_live_once():
    pytest.importorskip("torch")
    from torch_hooks.tracker import Tracker, _CountingIter

    t = Tracker()
    live = []
    t.fast_forward(2, 3, lambda: live.append((t.epoch, t.batch)))
    seen = {}
    for epoch in range(4):
        t.on_epoch(object(), epoch)
        seen[epoch] = list(_CountingIter(iter(range(10)), t))
    assert seen[0] == [] and seen[1] == []          # epochs before the rank's: nothing
    assert seen[2] == list(range(3, 10))            # its epoch: from the batch after its position
    assert seen[3] == list(range(10))
    assert live == [(2, 3)] and not t.fast_forwarding


# --------------------------------------------------------------------------- sitecustomize


def _py(code: str, env_extra: dict, pythonpath: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LINKPASS_HOOK", "PYTHONPATH")}
    env.update(env_extra, PYTHONPATH=os.pathsep.join(pythonpath))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_site_s_own_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = '1'\n")
    p = _py("import os, sys; print(os.environ.get('SITE_RAN'), 'torch' in sys.modules)", {},
            [str(SITE), str(ROOT), str(tmp_path)])
    assert p.returncode == 0 and p.stdout.split() == ["1", "False"], p.stderr  # no RANK: no hook, no torch


def test_a_failing_site_sitecustomize_is_one_line_and_the_program_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("raise ValueError('broken site')\n")
    p = _py("print('ran')", {}, [str(SITE), str(ROOT), str(tmp_path)])
    assert p.stdout.strip() == "ran"
    assert "linkpass: the site's own sitecustomize failed: ValueError: broken site" in p.stderr


def test_linkpass_hook_0_leaves_a_worker_alone():
    p = _py("import sys; print('torch' in sys.modules, 'torch_hooks.bootstrap' in sys.modules)",
            {"RANK": "0", "WORLD_SIZE": "1", "LINKPASS_HOOK": "0"}, [str(SITE), str(ROOT)])
    assert p.returncode == 0 and p.stdout.split() == ["False", "False"], p.stderr


def test_a_worker_gets_the_hook_before_its_first_line():
    pytest.importorskip("torch")
    p = _py("import torch.distributed.distributed_c10d as c; print(c.init_process_group.__module__, "
            "c.init_process_group.__wrapped__.__module__)", {"RANK": "0", "WORLD_SIZE": "1"}, [str(SITE), str(ROOT)])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["torch_hooks.pg", "torch.distributed.distributed_c10d"]


def test_bad_hook_settings_are_one_line_and_the_script_runs_unprotected():
    pytest.importorskip("torch")
    p = _py("print('ran')", {"RANK": "0", "WORLD_SIZE": "1", "LINKPASS_RAIL_IFACES": "zero=eth0"}, [str(SITE), str(ROOT)])
    assert p.stdout.strip() == "ran"
    assert "hook not started" in p.stderr and "LINKPASS_RAIL_IFACES" in p.stderr and "Traceback" not in p.stderr


# --------------------------------------------------------------------------- linkpass exec


def _exec(args: list[str], env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "linkpass.cli", "exec", "--no-daemon", "--no-live", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_exec_puts_the_hook_first_on_the_path_and_hook_0_does_not():
    code = "import os; print(os.environ['PYTHONPATH'].split(os.pathsep)[0])"
    p = _exec(["--", sys.executable, "-c", code], {"PYTHONPATH": "/x"})
    assert p.returncode == 0 and p.stdout.strip() == str(SITE), p.stderr
    p = _exec(["--", sys.executable, "-c", code], {"PYTHONPATH": "/x", "LINKPASS_HOOK": "0"})
    assert p.returncode == 0 and p.stdout.strip() == "/x", p.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unmodified_ddp_script_under_exec_and_torchrun_is_protected(tmp_path):
    pytest.importorskip("torch")
    port = _free_port()
    p = _exec(["--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               str(ROOT / "examples" / "ddp_train.py"), "--epochs", "1", "--samples", "1024", "--snapshot",
               str(tmp_path / "snap.pt")],
              {"LINKPASS_REPORT": str(tmp_path / "r{rank}.json"), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2)]
    assert [x["rank"] for x in r] == [0, 1]
    for x in r:
        assert x["steps"] == 16 and x["protected_modules"][0]["kind"] == "ddp" and x["position"]["known"]
        assert x["groups"] and x["groups"][0]["issued"] > 16 and x["rebuilds"] == []
    assert r[0]["weights_sha256"] == r[1]["weights_sha256"]  # DDP replicas, bitwise
    assert (tmp_path / "snap.pt").exists()                   # the script's own torch.save ran


def test_a_script_with_its_own_batches_is_told_its_position_is_unknown(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "loop.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n"
        "m = DDP(torch.nn.Linear(4, 1)); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(3):\n"
        "    o.zero_grad(); m(torch.ones(2, 4)).sum().backward(); o.step()\n"
        "dist.destroy_process_group()\n")
    p = _exec(["--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(_free_port()), str(script)], {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data position unknown" in p.stderr and "torch_hooks.tracker.set_position" in p.stderr


def test_a_state_that_does_not_fit_the_spare_s_module_is_refused_with_what_differs():
    torch = pytest.importorskip("torch")
    from torch_hooks.handover import _copy_into, _local_tree

    m = torch.nn.Linear(4, 2)
    good = _local_tree(m.state_dict())
    other = torch.nn.Linear(4, 2)
    _copy_into(other, good)
    assert torch.equal(other.weight, m.weight) and torch.equal(other.bias, m.bias)
    with pytest.raises(RuntimeError, match=r"missing \['bias'\]"):
        _copy_into(other, {"weight": good["weight"]})
    with pytest.raises(RuntimeError, match=r"weight: shape \(3, 4\)"):
        _copy_into(other, {"weight": torch.zeros(3, 4), "bias": good["bias"]})
    nested = _local_tree({"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]})
    assert torch.equal(nested["state"][0]["exp_avg"], torch.ones(2)) and nested["param_groups"] == [{"lr": 0.1}]


def test_exec_no_daemon_tells_the_hook_and_a_worker_says_it_is_protected(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "one.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
                      "dist.destroy_process_group()\n")
    p = _exec(["--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(_free_port()), str(script)], {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "linkpass: rank 0: process groups protected (linkpass_gloo; rails unknown; no daemon" in p.stderr
    assert "no linkpass daemon at" not in p.stderr  # --no-daemon: the hook does not look for one


def test_a_script_that_does_not_compile_is_refused_before_any_fabric(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "demo", "--scenario", "rail", "--script", str(bad)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    if os.geteuid() != 0:
        pytest.skip("the demo checks root first")
    assert p.returncode == 2 and "bad.py: line 1" in p.stderr and "does not compile" in p.stderr, p.stderr


def test_the_spare_s_rng_is_the_failed_rank_s_own_when_it_can_be():
    from torch_hooks.handover import pick_rng

    rec = {"steps": 248, "by_step": {247: "s247", 248: "s248"}, "pre_step": {249: "pre249"}}
    assert pick_rng(rec, 248)[0] == "s248"
    assert pick_rng(rec, 247)[0] == "s247"
    assert pick_rng(rec, 249)[0] == "pre249"   # the replica one step ahead: the rank had drawn
    rng, why = pick_rng(rec, 251)
    assert rng is None and "251" in why
    # the rank never reached optimizer step 249: its draws for it are unknown
    assert pick_rng({"steps": 248, "by_step": {248: "s248"}, "pre_step": {248: "pre248"}}, 249)[0] is None
    assert pick_rng({"steps": None}, 3)[0] is None


REPLAY_SAVES = """
import os, sys, torch
from torch_hooks import tracker
t = tracker.install()
final, tmp, tmp2, other = (os.path.join(sys.argv[1], n) for n in ("ckpt.pt", "ckpt.pt.tmp", "ckpt2.tmp", "log.txt"))
torch.save({"good": 1}, final)                        # the rank's own checkpoint, written before the hand-over
t.fast_forward(1, 0, lambda: None)                    # the spare replays epoch 0
torch.save({"replayed": 1}, tmp); os.replace(tmp, final)                      # atomic save: source never written
with open(tmp2, "wb") as f:
    torch.save({"replayed": 2}, f)                    # the script opens the file itself: it is truncated
os.rename(tmp2, final)
open(other, "w").write("x"); os.replace(other, other + ".1")                    # not a skipped save: really moved
during = [torch.load(final), os.path.exists(tmp2), os.path.exists(other + ".1")]
t.on_epoch(object(), 1); list(tracker._CountingIter(iter(range(1)), t))      # live from epoch 1's first batch
torch.save({"live": 1}, tmp); os.replace(tmp, final)
print(repr(during + [torch.load(final), t.fast_forwarding]))
"""


def test_a_replaying_spare_skips_the_atomic_saves_the_rank_already_made(tmp_path):
    """torch.save(obj, tmp); os.replace(tmp, final) in the replayed part of the script: no
    FileNotFoundError, and the rank's checkpoint is not replaced by an empty or stale file."""
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", REPLAY_SAVES, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == repr([{"good": 1}, False, True, {"live": 1}, False])
