"""Snapshots without torch or a job: the directory rules (torch_hooks/snapdir.py: complete only with
the marker, partial ones removed, the newest kept), the job registry, the settings, exec's
variables, and the agreement on the step (torch_hooks/snapshot.py) with a store in a dict."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from torch_hooks import snapdir, snapshot


def _part(tmp: Path, world: int = 2) -> None:
    for r in range(world):
        d = snapdir.rank_dir(tmp, r)
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"m")
        (d / snapdir.EXTRA).write_bytes(b"x")


def _complete(root: Path, step: int, world: int = 2) -> Path:
    tmp = snapdir.tmp_path(root, step, f"p{step}")
    _part(tmp, world)
    final = snapdir.final_path(root, step)
    snapdir.finalize(tmp, final, {"step": step, "world_size": world, "position_known": True})
    return final


def test_a_finalized_snapshot_is_complete_and_its_tmp_dir_is_gone(tmp_path):
    final = _complete(tmp_path, 40)
    assert final.name == "step-000000040" and (final / snapdir.MARKER).is_file()
    assert snapdir.read_manifest(final)["step"] == 40
    assert [c.name for c in tmp_path.iterdir()] == [final.name]
    assert snapdir.resolve(tmp_path) == final and snapdir.resolve(final) == final


@pytest.mark.parametrize("damage,match", [
    (lambda f: (f / snapdir.MARKER).unlink(), "no COMPLETE marker"),
    (lambda f: (f / snapdir.MANIFEST).write_text("{"), "cannot be read"),
    (lambda f: (f / snapdir.MANIFEST).write_text(json.dumps({"format": 99})), "not a linkpass snapshot manifest"),
    (lambda f: (snapdir.rank_dir(f, 1) / ".metadata").unlink(), "rank 1's part is missing"),
], ids=["no-marker", "bad-manifest", "other-format", "rank-part-missing"])
def test_a_damaged_snapshot_is_refused_in_one_line_naming_it(tmp_path, damage, match):
    final = _complete(tmp_path, 10)
    damage(final)
    with pytest.raises(snapdir.SnapshotError, match=match) as ei:
        snapdir.read_manifest(final)
    assert str(final) in str(ei.value) and "\n" not in str(ei.value)


def _sized(root: Path, step: int, world: int = 2) -> Path:
    """A complete snapshot whose manifest records each rank's part size, as the hook writes it."""
    tmp = snapdir.tmp_path(root, step, f"p{step}")
    _part(tmp, world)
    ranks = {str(r): {"bytes": snapdir.tree_bytes(snapdir.rank_dir(tmp, r)), "ok": True} for r in range(world)}
    final = snapdir.final_path(root, step)
    snapdir.finalize(tmp, final, {"step": step, "world_size": world, "position_known": True, "ranks": ranks})
    return final


def test_a_part_cut_off_after_it_was_written_is_refused_naming_the_rank(tmp_path):
    final = _sized(tmp_path, 10)
    assert snapdir.read_manifest(final)["step"] == 10
    (snapdir.rank_dir(final, 1) / snapdir.EXTRA).write_bytes(b"")  # cut off: 1 byte less
    with pytest.raises(snapdir.SnapshotError, match=r"rank 1's part is 1 bytes, it was 2 when written \(rank-1 cut off") as ei:
        snapdir.read_manifest(final)
    assert str(ei.value).startswith(f"{final}: ") and "\n" not in str(ei.value)


def test_a_corrupt_newest_snapshot_is_passed_over_saying_why(tmp_path):
    old, mid, new = _sized(tmp_path, 10), _sized(tmp_path, 20), _sized(tmp_path, 30)
    (snapdir.rank_dir(new, 1) / ".metadata").unlink()
    (snapdir.rank_dir(mid, 0) / snapdir.EXTRA).write_bytes(b"")
    skipped: list[str] = []
    assert snapdir.resolve(tmp_path, skipped) == old
    assert skipped == ["step-000000030: rank 1's part is missing (rank-1/.metadata or rank-1/extra.pt)",
                       "step-000000020: rank 0's part is 1 bytes, it was 2 when written (rank-0 cut off or changed)"]
    assert snapdir.resolve(tmp_path) == old  # no list: the same choice, said by the caller or not at all
    (old / snapdir.MANIFEST).write_text("{")
    with pytest.raises(snapdir.SnapshotError) as ei:
        snapdir.resolve(tmp_path)
    msg = str(ei.value)
    assert msg.startswith(f"{tmp_path}: no usable snapshot in it (step-000000030: ") and "\n" not in msg, msg
    assert "step-000000010: its snapshot.json cannot be read" in msg
    # a snapshot named directly is never swapped for another
    with pytest.raises(snapdir.SnapshotError, match="rank 1's part is missing"):
        snapdir.resolve(new)


def test_a_file_given_as_a_snapshot_is_not_a_directory(tmp_path):
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0")
    for fn in (snapdir.resolve, snapdir.read_manifest):
        with pytest.raises(snapdir.SnapshotError, match=f"^{f}: is not a directory$"):
            fn(f)
    with pytest.raises(snapdir.SnapshotError, match="no such snapshot directory"):
        snapdir.resolve(tmp_path / "nope")


def test_a_tmp_dir_is_never_a_snapshot_nor_the_newest_of_a_directory(tmp_path):
    old = _complete(tmp_path, 10)
    tmp = snapdir.tmp_path(tmp_path, 20, "g1")
    _part(tmp)
    assert snapdir.resolve(tmp_path) == old
    with pytest.raises(snapdir.SnapshotError, match="still being written or cut off"):
        snapdir.resolve(tmp)
    empty = tmp_path / "other"
    empty.mkdir()
    with pytest.raises(snapdir.SnapshotError, match="no complete snapshot"):
        snapdir.resolve(empty)
    with pytest.raises(snapdir.SnapshotError, match="no such snapshot directory"):
        snapdir.resolve(tmp_path / "missing")


def test_cleanup_removes_partial_ones_up_to_the_step_and_keeps_the_newest(tmp_path):
    for s in (10, 20, 30):
        _complete(tmp_path, s)
    _part(snapdir.tmp_path(tmp_path, 25, "p25"))       # a rank died writing it
    _part(snapdir.tmp_path(tmp_path, 40, "p40"))       # later: ranks may be writing it now
    cut = snapdir.final_path(tmp_path, 15)             # renamed, marker never written
    _part(cut)
    removed = snapdir.cleanup(tmp_path, 30, keep=2)
    assert sorted(removed) == sorted(["step-000000025.tmp-p25", "step-000000015", "step-000000010"])
    assert sorted(c.name for c in tmp_path.iterdir()) == ["step-000000020", "step-000000030", "step-000000040.tmp-p40"]
    assert snapdir.cleanup(tmp_path, 30, keep=0) == []


def test_the_job_registry_finds_a_running_job_and_says_which_are_known(tmp_path, monkeypatch):
    monkeypatch.setenv("LINKPASS_JOBS_DIR", str(tmp_path / "jobs"))
    with pytest.raises(snapdir.SnapshotError, match="no protected job 'j1' on this host: not running .*here: none"):
        snapdir.lookup_job("j1")
    snapdir.register_job({"job": "j1", "store": "10.0.0.1:29500", "pid": os.getpid()})
    assert snapdir.lookup_job("j1")["store"] == "10.0.0.1:29500"
    with pytest.raises(snapdir.SnapshotError, match=r"known.*j1|here: j1"):
        snapdir.lookup_job("j2")
    snapdir.register_job({"job": "gone", "store": "x:1", "pid": 2 ** 22 + 12345})
    with pytest.raises(snapdir.SnapshotError, match=r"^job 'gone' is not running: its registry entry .*gone.json is "
                       r"stale \(pid 4206649 is gone: the job ended or was killed\); the stale entry is removed$"):
        snapdir.lookup_job("gone")
    assert snapdir.known_jobs() == ["j1"]
    with pytest.raises(snapdir.SnapshotError, match="no protected job 'gone' on this host: not running"):
        snapdir.lookup_job("gone")
    snapdir.unregister_job("j1", os.getpid() + 1)  # not the writer: kept
    assert snapdir.known_jobs() == ["j1"]
    snapdir.unregister_job("j1", os.getpid())
    assert snapdir.known_jobs() == []


def test_settings_from_the_environment(tmp_path):
    s = snapshot.SnapshotSettings({"LINKPASS_SNAPSHOT_EVERY": "50", "LINKPASS_SNAPSHOT_DIR": str(tmp_path),
                                   "LINKPASS_SNAPSHOT_KEEP": "0"})
    assert (s.every, s.dir, s.keep, s.use_async, s.resume) == (50, str(tmp_path), 0, True, None)
    d = snapshot.SnapshotSettings({})
    assert d.every == 0 and d.keep == 3 and d.dir == os.path.abspath(snapshot.DEFAULT_DIR)
    for bad in ({"LINKPASS_SNAPSHOT_EVERY": "ten"}, {"LINKPASS_SNAPSHOT_KEEP": "-1"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            snapshot.SnapshotSettings(bad)


def test_exec_takes_flags_over_the_environment_over_the_config(tmp_path, monkeypatch):
    from linkpass.cli.nccl import _BadInput, snapshot_env

    monkeypatch.chdir(tmp_path)

    cfg = SimpleNamespace(snapshot=SimpleNamespace(every_steps=100, dir=str(tmp_path / "cfg"), keep=5))
    none = argparse.Namespace(snapshot_every=None, snapshot_dir=None, snapshot_keep=None, resume=None)
    assert snapshot_env(none, cfg, {}) == {"LINKPASS_SNAPSHOT_EVERY": "100", "LINKPASS_SNAPSHOT_DIR": str(tmp_path / "cfg"),
                                           "LINKPASS_SNAPSHOT_KEEP": "5"}
    assert "LINKPASS_SNAPSHOT_EVERY" not in snapshot_env(none, cfg, {"LINKPASS_SNAPSHOT_EVERY": "7"})
    flags = argparse.Namespace(snapshot_every=3, snapshot_dir="rel", snapshot_keep=0, resume=None)
    assert snapshot_env(flags, cfg, {"LINKPASS_SNAPSHOT_EVERY": "7"}) == {
        "LINKPASS_SNAPSHOT_EVERY": "3", "LINKPASS_SNAPSHOT_DIR": os.path.abspath("rel"), "LINKPASS_SNAPSHOT_KEEP": "0"}
    final = _complete(tmp_path, 60)
    res = argparse.Namespace(snapshot_every=None, snapshot_dir=None, snapshot_keep=None, resume=str(tmp_path))
    assert snapshot_env(res, None, {})["LINKPASS_RESUME"] == str(final.resolve())
    (final / snapdir.MARKER).unlink()
    with pytest.raises(_BadInput, match="--resume .*no complete snapshot"):
        snapshot_env(res, None, {})


# --------------------------------------------------------------------------- the agreement


class DictStore:
    """The part of a TCPStore the snapshot thread uses."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, k):
        return self.d[k]

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def add(self, k, n):
        v = int(self.d.get(k, b"0")) + n
        self.d[k] = str(v).encode()
        return v


class FakeTracker:
    def __init__(self, steps: int):
        self.steps = steps
        self.boundary_pos = {"steps": steps, "epoch": 0, "batch": steps}
        self.listeners = []

    def add_boundary_listener(self, fn):
        self.listeners.append(fn)

    @contextlib.contextmanager
    def muted(self):
        yield


def _ranks(store, steps: list[int], **snap_env):
    out = []
    for r, s in enumerate(steps):
        st = SimpleNamespace(rank=r, world_size=len(steps), job="j", master_addr=None, master_port=None, local_rank=r,
                             host="h", rebuild_timeout_s=60)
        sn = snapshot.Snapshotter(st, FakeTracker(s), snapshot.SnapshotSettings(snap_env))
        sn._kv, sn._thread = store, object()  # driven by hand: no thread, no TCPStore
        sn.taken = []
        sn.take = lambda sid, step, root, t0=None, sn=sn: sn.taken.append((sid, step, root))
        out.append(sn)
    return out


def test_every_rank_takes_the_requested_snapshot_at_one_step_past_every_proposal(tmp_path):
    kv = DictStore()
    a, b = _ranks(kv, [10, 11], LINKPASS_SNAPSHOT_DIR=str(tmp_path))
    g = kv.add("snapshot/seq", 1)
    kv.set(f"snapshot/{g}/req", json.dumps({"to": "/snaps"}))
    a._poll_request()
    assert kv.get("snapshot/1/prop/0") == b"10" and not a._decided.is_set()
    a._poll_request()  # rank 1 has not proposed: no decision yet
    assert not a._decided.is_set()
    b._poll_request()
    for sn in (a, b):
        sn._poll_request()
        assert sn._req["step"] == 12
    b.on_boundary(11)
    a.on_boundary(11)
    assert a.taken == b.taken == []
    a.on_boundary(12)
    b.on_boundary(12)
    assert a.taken == b.taken == [("g1", 12, "/snaps")]
    assert a._req is None and a._next_g == 2
    # the next request is generation 2
    kv.set("snapshot/2/req", json.dumps({"to": None}))
    a._poll_request()
    assert a._req["g"] == 2


def test_a_rank_that_does_not_answer_makes_the_request_abandoned_not_half_taken(tmp_path, capsys):
    kv = DictStore()
    a, _b = _ranks(kv, [5, 5], LINKPASS_SNAPSHOT_TIMEOUT_S="0", LINKPASS_SNAPSHOT_DIR=str(tmp_path))
    kv.set("snapshot/1/req", json.dumps({"to": None}))
    a._poll_request()
    a._poll_request()  # past the deadline, rank 1 silent
    assert a._req is None and a._next_g == 2
    assert json.loads(kv.get("snapshot/g1/result")) == {"ok": False, "reason": "ranks [1] did not answer within 0 s"}
    a.on_boundary(6)
    assert a.taken == []
    assert "snapshot request 1 abandoned" in capsys.readouterr().err


def test_periodic_snapshots_at_multiples_of_the_interval(tmp_path):
    (a,) = _ranks(DictStore(), [0], LINKPASS_SNAPSHOT_EVERY="25", LINKPASS_SNAPSHOT_DIR=str(tmp_path))
    for s in range(1, 80):
        a.on_boundary(s)
    assert a.taken == [(f"p{s}", s, str(tmp_path)) for s in (25, 50, 75)]


# --------------------------------------------------------------------------- resume (a part on disk, no job)


class ResumeTracker:
    """The part of the tracker :func:`snapshot.prepare_resume` uses."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.steps, self.boundary_pos, self.epoch, self.batch = 0, {}, None, 0
        self.ff = None
        self.modules, self.optimizers, self.schedulers = [], [], []

    def add_step_listener(self, fn):
        pass

    def fast_forward(self, epoch, batch, on_live):
        self.ff = (epoch, batch, on_live)

    def position(self):
        return {"steps": self.steps, "epoch": self.epoch, "batch": self.batch, "known": True}

    @contextlib.contextmanager
    def muted(self):
        yield


def _real_snapshot(root: Path, step: int = 40, world: int = 1) -> Path:
    """A complete snapshot whose parts are real DCP checkpoints of a small state dict."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    snapshot._quiet_dcp()
    tmp = snapdir.tmp_path(root, step, f"p{step}")
    for r in range(world):
        rd = snapdir.rank_dir(tmp, r)
        rd.mkdir(parents=True)
        dcp.save({"model0": {"w": torch.arange(4096, dtype=torch.float32)}}, checkpoint_id=str(rd), no_dist=True)
        snapshot._real_save({"step": step, "position": {"steps": step, "epoch": 1, "batch": 8}, "rng": None,
                             "schedulers": []}, rd / snapdir.EXTRA)
    final = snapdir.final_path(root, step)
    snapdir.finalize(tmp, final, {"step": step, "world_size": world, "position_known": True})
    return final


def _settings(rank: int = 0, world: int = 1):
    return SimpleNamespace(rank=rank, world_size=world, local_rank=rank)


def test_a_script_that_ends_before_the_snapshots_batch_is_said_in_one_line(tmp_path):
    snap = _real_snapshot(tmp_path)
    t, holder = ResumeTracker(), SimpleNamespace()
    snapshot.prepare_resume(_settings(), t, str(snap), lambda code, why: None, holder)
    assert t.ff[:2] == (1, 8)
    t.epoch, t.batch = 0, 0  # the script ran one epoch, the snapshot is in the second
    msg = snapshot.resume_not_reached(holder)
    assert msg and "\n" not in msg and str(snap) in msg, msg
    assert "ended at epoch 0, batch 0" in msg and "snapshot's step 40 (epoch 1, batch 8)" in msg
    assert snapshot.resume_not_reached(SimpleNamespace()) is None  # not a resume


def test_a_cut_off_shard_is_refused_before_the_script_runs_naming_the_rank_file(tmp_path):
    snap = _real_snapshot(tmp_path)
    f = snapdir.rank_dir(snap, 0) / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(snapshot.ResumeRefused) as ei:
        snapshot.prepare_resume(_settings(), ResumeTracker(), str(snap), lambda code, why: None, SimpleNamespace())
    msg = str(ei.value)
    assert "\n" not in msg and str(snap) in msg and "rank-0/__0_0.distcp is cut off: 1000 bytes" in msg, msg


def test_a_corrupt_shard_at_restore_is_one_line_and_exit_65_not_a_traceback(tmp_path, monkeypatch):
    """DCP's CheckpointException derives from BaseException: the restore catches it too."""
    torch = pytest.importorskip("torch")
    snap = _real_snapshot(tmp_path)
    t, exits = ResumeTracker(), []
    snapshot.prepare_resume(_settings(), t, str(snap), lambda code, why: exits.append((code, why)), SimpleNamespace())
    f = snapdir.rank_dir(snap, 0) / "__0_0.distcp"
    f.write_bytes(b"\0" * f.stat().st_size)  # the same length: only the load finds it
    monkeypatch.setattr(snapshot, "_state_dicts", lambda tr: {"model0": {"w": torch.zeros(4096)}})
    t.ff[2]()  # the snapshot's batch: the restore
    [(code, why)] = exits
    assert code == snapshot.EXIT_RESUME == 65
    assert "\n" not in why and str(snap) in why and "rank-0/__0_0.distcp cannot be loaded" in why, why


def test_exec_checks_the_snapshot_dir_before_the_job_starts_naming_where_it_came_from(tmp_path, monkeypatch, capsys):
    from linkpass.cli.nccl import _BadInput, snapshot_env

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    ns = lambda **kw: argparse.Namespace(**{"snapshot_every": None, "snapshot_dir": None, "snapshot_keep": None,  # noqa: E731
                                            "resume": None, "config": "c.toml", **kw})
    with pytest.raises(_BadInput, match=r"^--snapshot-dir: .*/afile is not a directory$"):
        snapshot_env(ns(snapshot_dir="afile"), None, {})
    cfg = SimpleNamespace(snapshot=SimpleNamespace(every_steps=0, dir=str(tmp_path / "afile" / "sub"), keep=3))
    with pytest.raises(_BadInput, match=r"^c.toml: snapshot.dir: .*afile/sub cannot be created"):
        snapshot_env(ns(), cfg, {})
    with pytest.raises(_BadInput, match=r"^LINKPASS_SNAPSHOT_DIR in the environment: .*afile is not a directory"):
        snapshot_env(ns(), None, {"LINKPASS_SNAPSHOT_DIR": str(tmp_path / "afile")})
    capsys.readouterr()
    # a relative flag: from the current directory, made, and said
    assert snapshot_env(ns(snapshot_dir="a/b"), None, {})["LINKPASS_SNAPSHOT_DIR"] == str(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    assert capsys.readouterr().err == f"linkpass exec: --snapshot-dir a/b is relative: snapshots go to {tmp_path / 'a' / 'b'}\n"


def test_exec_refuses_absurd_snapshot_intervals_in_one_line(capsys):
    from linkpass.cli.nccl import main

    for flag, v in (("--snapshot-every", "1000000000000"), ("--snapshot-keep", "5000")):
        with pytest.raises(SystemExit) as ei:
            main(["exec", "--no-daemon", flag, v, "--", "true"])
        err = capsys.readouterr().err
        assert ei.value.code == 2 and err.count("\n") == 1 and flag in err and "is more than" in err, err


def test_exec_says_which_snapshot_it_passed_over(tmp_path, capsys):
    from linkpass.cli.nccl import snapshot_env

    old, new = _sized(tmp_path, 10), _sized(tmp_path, 20)
    (snapdir.rank_dir(new, 0) / ".metadata").unlink()
    res = argparse.Namespace(snapshot_every=None, snapshot_dir=None, snapshot_keep=None, resume=str(tmp_path))
    assert snapshot_env(res, None, {})["LINKPASS_RESUME"] == str(old.resolve())
    assert capsys.readouterr().err == (f"linkpass exec: --resume {tmp_path}: skipped step-000000020: rank 0's part is "
                                       "missing (rank-0/.metadata or rank-0/extra.pt); using step-000000010\n")
