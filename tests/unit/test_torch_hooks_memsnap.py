"""torch_hooks.memsnap: who holds whose copy, what a part contains, how parts travel through the
store and are kept, and the refusals (bad settings, not enough host memory)."""

from __future__ import annotations

import contextlib
import datetime
import threading
import types

import pytest

torch = pytest.importorskip("torch")

from torch_hooks import handover, memsnap  # noqa: E402


class DictStore:
    """The part of a TCPStore the in-memory snapshots use (thread-safe, like the real one)."""

    def __init__(self):
        self.d: dict[str, bytes] = {}
        self.cv = threading.Condition()

    def check(self, keys):
        with self.cv:
            return all(k in self.d for k in keys)

    def get(self, k):
        with self.cv:
            return self.d[k]

    def set(self, k, v):
        with self.cv:
            self.d[k] = v.encode() if isinstance(v, str) else bytes(v)
            self.cv.notify_all()

    def delete_key(self, k):
        with self.cv:
            return self.d.pop(k, None) is not None

    def wait(self, keys, timeout: datetime.timedelta):
        with self.cv:
            if not self.cv.wait_for(lambda: all(k in self.d for k in keys), timeout.total_seconds()):
                raise RuntimeError(f"timeout waiting for {keys}")


def test_the_copy_of_a_rank_is_held_by_the_next_rank_on_another_host():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert [memsnap.holder_of(r, hosts) for r in range(4)] == [2, 2, 0, 0]
    assert memsnap.held_by(2, hosts) == [0, 1] and memsnap.held_by(1, hosts) == []
    one_per_host = {0: "a", 1: "b", 2: "c"}
    assert [memsnap.holder_of(r, one_per_host) for r in range(3)] == [1, 2, 0]
    # every rank on one host: the next rank (the copy survives a GPU, not the host)
    assert [memsnap.holder_of(r, {0: "a", 1: "a"}) for r in range(2)] == [1, 0]
    # every rank's copy has exactly one holder, never itself
    for hs in (hosts, one_per_host, {0: "a", 1: "b", 2: "a", 3: "b", 4: "c"}):
        held = sorted(r for h in hs for r in memsnap.held_by(h, hs))
        assert held == sorted(hs) and all(memsnap.holder_of(r, hs) != r for r in hs)


@pytest.mark.parametrize("env,err", [
    ({"LINKPASS_SNAPSHOT_IN_MEMORY": "maybe"}, "LINKPASS_SNAPSHOT_IN_MEMORY='maybe' is not 0 or 1"),
    ({"LINKPASS_SNAPSHOT_IN_MEMORY": "1", "LINKPASS_SNAPSHOT_MEMORY_EVERY": "ten"}, "is not a number"),
    ({"LINKPASS_SNAPSHOT_IN_MEMORY": "1", "LINKPASS_SNAPSHOT_MEMORY_EVERY": "0"}, "must be 1 or more"),
])
def test_bad_settings_are_named(env, err):
    with pytest.raises(ValueError, match=err):
        memsnap.MemorySettings(env)


def test_settings():
    assert not memsnap.MemorySettings({}).enabled
    s = memsnap.MemorySettings({"LINKPASS_SNAPSHOT_IN_MEMORY": "1", "LINKPASS_SNAPSHOT_MEMORY_EVERY": "7"})
    assert s.enabled and s.every == 7
    assert memsnap.MemorySettings({"LINKPASS_SNAPSHOT_IN_MEMORY": "true"}).every == memsnap.DEFAULT_EVERY


def test_a_cpu_copy_does_not_change_when_training_does():
    w = torch.ones(3)
    state = {"w": w, "nested": [w, (w,)], "step": 4}
    c = memsnap.cpu_copy(state)
    w.add_(1)
    assert torch.equal(c["w"], torch.ones(3)) and torch.equal(c["nested"][1][0], torch.ones(3)) and c["step"] == 4
    assert isinstance(c["nested"][1], tuple)


class Tracker:
    """What capture() and the rollback's loader read of torch_hooks.tracker.Tracker."""

    def __init__(self, model, opt, steps):
        self.modules, self.optimizers, self.schedulers = [model], [opt], []
        self.steps = steps
        self.boundary_pos = {"steps": steps, "epoch": 0, "batch": steps}
        self.boundary_rng = {"cpu": torch.get_rng_state()}
        self.ddp_layouts, self.ddp_bucket_syncs = [], []
        self.fast_forwarding = False
        self._lock = threading.Lock()
        self.listeners = []

    def add_boundary_listener(self, fn):
        self.listeners.append(fn)

    @contextlib.contextmanager
    def muted(self):
        yield


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    return model, opt


def test_a_part_restores_the_model_and_optimizer_bitwise():
    model, opt = _trained()
    t = Tracker(model, opt, 3)
    group = types.SimpleNamespace(boundary_seq=17)
    blob = memsnap.capture(t, [group])
    assert blob["position"]["boundary_seqs"] == [17] and blob["position"]["steps"] == 3
    data = memsnap.serialise(blob)
    want = [p.detach().clone() for p in model.parameters()]
    want_m = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    for _ in range(2):  # training goes on after the snapshot
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    assert not torch.equal(next(model.parameters()), want[0])
    handover._apply_state(data, t, 0, 0)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want))
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), want_m))


def _snapshots(tmp_path, monkeypatch, store, rank, world, host, every=2):
    monkeypatch.setenv("LINKPASS_SNAPSHOT_MEMORY_DIR", str(tmp_path / "shm"))
    model, opt = _trained(rank)
    t = Tracker(model, opt, 0)
    settings = types.SimpleNamespace(rank=rank, world_size=world, job="j", host=host, master_addr="x", master_port=1,
                                     rebuild_timeout_s=5.0)
    ctl = types.SimpleNamespace(groups=[types.SimpleNamespace(boundary_seq=0)])
    ms = memsnap.MemorySnapshots(settings, t, ctl, memsnap.MemorySettings(
        {"LINKPASS_SNAPSHOT_IN_MEMORY": "1", "LINKPASS_SNAPSHOT_MEMORY_EVERY": str(every)}))
    ms._kv = store  # what _start() connects to
    ms.dir.mkdir(parents=True, exist_ok=True)
    store.set(f"memsnap/host/{rank}", host)
    return ms, t


def _pump(ms_list, step):
    """Run each rank's thread body once per round until every copy of ``step`` is held."""
    for _ in range(10):
        for ms in ms_list:
            with ms._work:
                job = ms._queue.pop(0) if ms._queue else None
            if job is not None:
                ms._send(*job)
            ms._receive()
        if all(step not in ms._expect for ms in ms_list):
            return
    raise AssertionError("copies not exchanged")


def test_parts_travel_to_their_holders_and_only_the_newest_are_kept(tmp_path, monkeypatch):
    store = DictStore()
    ranks = [_snapshots(tmp_path, monkeypatch, store, r, 2, f"h{r}") for r in range(2)]
    mss = [ms for ms, _ in ranks]
    monkeypatch.setattr(memsnap.MemorySnapshots, "_start", lambda self: True)
    for step in (1, 2, 3, 4, 5, 6):
        for ms, t in ranks:
            t.steps = step
            t.boundary_pos = {"steps": step, "epoch": 0, "batch": step}
            ms.on_boundary(step)
        if step % 2 == 0:
            assert mss[0].usable_step(store) is None or mss[0].usable_step(store) < step
            _pump(mss, step)
            assert mss[0].usable_step(store) == step and mss[1].usable_step(store) == step
    # only steps 4 and 6 are left, own parts and held copies; the store keeps no chunk
    for r, ms in enumerate(mss):
        assert sorted(f.name for f in ms.dir.glob(f"own-*-r{r}.pt")) == [f"own-n0-s4-r{r}.pt", f"own-n0-s6-r{r}.pt"]
        assert sorted(f.name for f in ms.dir.glob("held-*")) == [f"held-n0-s4-r{1 - r}.pt", f"held-n0-s6-r{1 - r}.pt"]
    assert not [k for k in store.d if k.count("/") == 3 and k.startswith("memsnap/0/")]
    # the held copy is the other rank's own part, byte for byte
    assert (mss[0].dir / "held-n0-s6-r1.pt").read_bytes() == (mss[1].dir / "own-n0-s6-r1.pt").read_bytes()
    # a normal end removes what this rank kept
    for ms in mss:
        ms.close(remove=True)
        assert not list(ms.dir.iterdir())


def test_a_snapshot_is_usable_only_when_every_part_is_held(tmp_path, monkeypatch):
    store = DictStore()
    (a, ta), (b, tb) = [_snapshots(tmp_path, monkeypatch, store, r, 2, f"h{r}") for r in range(2)]
    monkeypatch.setattr(memsnap.MemorySnapshots, "_start", lambda self: True)
    for ms, t in ((a, ta), (b, tb)):
        t.boundary_pos = {"steps": 2, "epoch": 0, "batch": 2}
        ms.on_boundary(2)
    a._send(*a._queue.pop(0))   # rank 0's part is sent, rank 1's not yet
    b._receive()
    assert store.check(["memsnap/0/2/held/0"]) and a.usable_step(store) is None


def test_not_enough_host_memory_turns_them_off_in_one_line(tmp_path, monkeypatch, capsys):
    store = DictStore()
    ms, t = _snapshots(tmp_path, monkeypatch, store, 0, 2, "h0")
    monkeypatch.setattr(memsnap.MemorySnapshots, "_start", lambda self: True)
    monkeypatch.setattr(memsnap, "mem_available", lambda: 1000)
    ms.on_boundary(2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in-memory snapshots off" in err[0] and "1000 are available" in err[0], err
    assert not ms._queue and ms.off_reason
    ms.on_boundary(4)  # said once, nothing taken
    assert not capsys.readouterr().err and not ms._queue


def test_rollback_env_drops_the_resume_and_names_the_part():
    env = memsnap.rollback_env({"LINKPASS_RESUME": "/snap", "RANK": "1"}, {"epoch": 3, "file": "/x"}, [11, 12])
    assert "LINKPASS_RESUME" not in env and env["RANK"] == "1" and env["LINKPASS_SPARE_PIDS"] == "11,12"
    assert '"epoch": 3' in env["LINKPASS_ROLLBACK"]
