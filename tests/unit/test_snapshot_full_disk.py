"""A full disk at snapshot time (torch_hooks/snapshot.py): the free space is checked against the
part's state before it is written; a write that fails (ENOSPC mid-write, DCP's wrapped errors)
ends the same way: one line naming the rank, the directory, needed vs free; nothing half-written
kept; the report says why; training goes on and the next snapshot is taken.

One rank (world size 1) with a real ``nn.Linear`` and real DCP, a dict for the job's store; the
file system's answers (statvfs, the writer) are replaced.  The same on a real tmpfs:
tests/integration/test_snapshot_full_disk.py."""

from __future__ import annotations

import contextlib
import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch_hooks import snapdir, snapshot  # noqa: E402


class DictStore:
    def __init__(self):
        self.d: dict[str, bytes] = {}

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, k):
        return self.d[k]

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v


class Tracker:
    """What Snapshotter.take reads of the tracker, for one module and its optimizer."""

    def __init__(self, features: int = 64):
        torch.manual_seed(0)
        self.modules = [torch.nn.Linear(features, features)]
        self.optimizers = [torch.optim.SGD(self.modules[0].parameters(), lr=0.1)]
        self.schedulers: list = []
        self.steps = 5
        self.boundary_pos = {"steps": 5, "epoch": 0, "batch": 5}
        self.boundary_rng = None
        self.ddp_layouts: list = []

    def add_boundary_listener(self, fn):
        pass

    def position(self):
        return {"known": True}

    def weights_sha256(self):
        return None

    @contextlib.contextmanager
    def muted(self):
        yield


class Client:
    def __init__(self):
        self.reports: list[tuple[str, dict]] = []

    def report(self, event, **fields):
        self.reports.append((event, fields))
        return True


def _snapshotter(root: Path, **env):
    st = SimpleNamespace(rank=0, world_size=1, job="j", master_addr=None, master_port=None, local_rank=0, host="h",
                         rebuild_timeout_s=60)
    client = Client()
    sn = snapshot.Snapshotter(st, Tracker(), snapshot.SnapshotSettings({"LINKPASS_SNAPSHOT_DIR": str(root), **env}),
                              client_fn=lambda: client)
    sn._kv, sn._thread = DictStore(), object()  # driven by hand: no thread, no TCPStore
    return sn, client


def _run(sn, step: int) -> dict:
    """Take a snapshot at ``step`` and drive the snapshot thread's side until it is decided."""
    sn.take(f"p{step}", step, sn.snap.dir)
    f = sn._inflight
    if f is not None:
        f["future"].exception(timeout=60)  # the write is over (async_save's thread)
    for _ in range(3):
        if sn._inflight is None:
            break
        sn._poll_inflight()
    assert sn._inflight is None and sn._idle.is_set()
    return json.loads(sn._kv.get(f"snapshot/p{step}/result"))


def test_state_bytes_counts_tensors_of_a_nested_state_dict_and_a_dtensor_by_its_local_shard():
    sd = {"model0": {"w": torch.zeros(10, 10), "b": torch.zeros(10, dtype=torch.float64)},
          "optim0": {"state": {0: {"momentum_buffer": torch.zeros(5)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    assert snapshot.state_bytes(sd) == 400 + 80 + 20
    shard = SimpleNamespace(_local_tensor=torch.zeros(3), numel=lambda: 999, element_size=lambda: 4)  # a DTensor's shape
    assert snapshot.state_bytes([shard, (torch.zeros(2, dtype=torch.int8),)]) == 12 + 2


def test_a_part_that_would_not_fit_is_refused_before_writing_and_nothing_is_kept(tmp_path, monkeypatch, capsys):
    sn, client = _snapshotter(tmp_path)
    monkeypatch.setattr(snapshot, "free_bytes", lambda p: 1000)
    res = _run(sn, 5)
    state = 64 * 64 * 4 + 64 * 4
    need = int(state * snapshot.SPACE_MARGIN) + snapshot.SPACE_SLACK_BYTES
    want = f"not enough space in {tmp_path}: the part needs about {need} bytes ({state} bytes of state), 1000 bytes free"
    assert res == {"ok": False, "step": 5, "path": None, "id": "p5", "reason": f"rank 0: {want}"}
    assert list(tmp_path.iterdir()) == []  # neither the part nor the snapshot's .tmp- directory
    err = capsys.readouterr().err.splitlines()
    assert f"linkpass: rank 0: snapshot at step 5 not written: {want}" in err
    assert f"linkpass: snapshot at step 5 failed, nothing kept: rank 0: {want}" in err
    (event, fields), = client.reports
    assert event == "snapshot" and fields["ok"] is False and fields["reason"] == f"rank 0: {want}"
    assert fields["scope"] == "snapshot" and fields["step"] == 5 and fields["path"] is None
    # room again: the next snapshot is taken (training went on, nothing is stuck)
    monkeypatch.setattr(snapshot, "free_bytes", lambda p: 1 << 40)
    res = _run(sn, 10)
    assert res["ok"] and snapdir.resolve(tmp_path) == Path(res["path"])
    assert client.reports[-1][1]["ok"] is True and client.reports[-1][1]["reason"] is None


@pytest.mark.parametrize("use_async", ["1", "0"], ids=["async_save", "save"])
def test_no_space_mid_write_fails_the_snapshot_in_one_line_and_removes_the_half_written_part(tmp_path, monkeypatch, capsys,
                                                                                             use_async):
    """DCP wraps the writer's OSError in a CheckpointException (a BaseException, whose text is a
    traceback); the synchronous ``dcp.save`` raises it into the training thread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def full(sd, checkpoint_id, no_dist):
        part = Path(checkpoint_id) / "__0_0.distcp"
        part.write_bytes(b"half")
        raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device", str(part)), None)})

    def full_async(sd, checkpoint_id, no_dist):
        import concurrent.futures

        fut = concurrent.futures.Future()
        try:
            full(sd, checkpoint_id, no_dist)
        except BaseException as ex:  # noqa: BLE001
            fut.set_exception(ex)
        return fut

    monkeypatch.setattr(dcp, "save", full)
    monkeypatch.setattr(dcp, "async_save", full_async)
    monkeypatch.setattr(snapshot, "free_bytes", lambda p: 1 << 40)
    sn, client = _snapshotter(tmp_path, LINKPASS_SNAPSHOT_ASYNC=use_async)
    res = _run(sn, 5)  # never raises into the training thread
    tmp = snapdir.tmp_path(str(tmp_path), 5, "p5")
    line = f"No space left on device: {snapdir.rank_dir(tmp, 0)}/__0_0.distcp"
    assert res["ok"] is False and res["reason"] == f"rank 0: {line}"
    assert list(tmp_path.iterdir()) == []
    assert f"linkpass: rank 0: snapshot at step 5 not written: {line}" in capsys.readouterr().err.splitlines()
    assert client.reports[-1][1]["reason"] == f"rank 0: {line}"


def test_a_failed_write_says_how_much_was_free_when_the_disk_filled_up(tmp_path, monkeypatch):
    sn, _ = _snapshotter(tmp_path)
    free = iter([1 << 40, 10])  # room before the write, 10 bytes after it failed

    def fail(sd, rd):
        import concurrent.futures

        fut = concurrent.futures.Future()
        fut.set_exception(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
        return fut

    monkeypatch.setattr(snapshot, "free_bytes", lambda p: next(free))
    monkeypatch.setattr(sn, "_save", fail)
    res = _run(sn, 5)
    assert res["reason"].startswith(f"rank 0: no space left in {tmp_path}: 10 bytes free, the part needs about ")
    assert res["reason"].endswith(" (RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598)")


def test_error_line_unwraps_dcp_and_names_the_file():
    from torch.distributed.checkpoint.api import CheckpointException

    assert snapshot.error_line(OSError(errno.ENOSPC, "No space left on device", "/s/x")) == "No space left on device: /s/x"
    assert snapshot.error_line(CheckpointException("m", {3: (ValueError("bad\nmore"), None)})) == "ValueError: bad"
    assert snapshot.error_line(KeyError()) == "KeyError"
