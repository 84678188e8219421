"""A snapshot into a file system that is really full: a 2 MiB tmpfs (root only; skipped where
mount is not allowed).  A part bigger than the free space is refused before it is written; a part
that passes the check (the free space misread on purpose) hits ENOSPC in DCP's writer, with
``dcp.async_save`` and with ``dcp.save``.  Either way: one line naming the rank, the directory and
the cause, nothing left in the directory, and the hook goes on (the next snapshot, with room, is
complete).  The same with the file system's answers replaced: tests/unit/test_snapshot_full_disk.py."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.unit.test_snapshot_full_disk import _run, _snapshotter  # noqa: E402
from torch_hooks import snapdir, snapshot  # noqa: E402


@pytest.fixture
def tiny_fs():
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="lpfull", dir="/tmp"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def _big(sn, features: int = 1024):
    """A 4 MiB model: more than the tmpfs holds."""
    torch.manual_seed(0)
    sn.t.modules = [torch.nn.Linear(features, features)]
    sn.t.optimizers = [torch.optim.SGD(sn.t.modules[0].parameters(), lr=0.1)]


def test_a_part_bigger_than_the_free_space_is_refused_before_writing(tiny_fs, capsys):
    sn, client = _snapshotter(tiny_fs)
    _big(sn)
    res = _run(sn, 5)
    assert not res["ok"] and res["reason"].startswith(f"rank 0: not enough space in {tiny_fs}: the part needs about ")
    assert res["reason"].endswith(" bytes free") and "\n" not in res["reason"]
    assert list(tiny_fs.iterdir()) == []
    assert client.reports[-1][1]["ok"] is False
    assert any(ln.startswith("linkpass: snapshot at step 5 failed, nothing kept: rank 0: not enough space in")
               for ln in capsys.readouterr().err.splitlines())


@pytest.mark.parametrize("use_async", ["1", "0"], ids=["async_save", "save"])
def test_no_space_mid_write_is_one_line_and_nothing_is_kept(tiny_fs, monkeypatch, capsys, use_async):
    real_free = snapshot.free_bytes
    calls = []

    def lie_once(p):  # the check before the write sees room; the look after the failure the truth
        calls.append(p)
        return 1 << 40 if len(calls) == 1 else real_free(p)

    monkeypatch.setattr(snapshot, "free_bytes", lie_once)
    sn, client = _snapshotter(tiny_fs, LINKPASS_SNAPSHOT_ASYNC=use_async)
    _big(sn)
    res = _run(sn, 5)  # never raises into the training thread
    reason = res["reason"]
    assert not res["ok"] and reason.startswith("rank 0: ") and "\n" not in reason, reason
    assert "CheckpointException" not in reason and "Traceback" not in reason
    # DCP's writer says ENOSPC, or torch's zip writer "unexpected pos": then the free space says it
    assert "No space left on device" in reason or reason.startswith(f"rank 0: no space left in {tiny_fs}: "), reason
    assert list(tiny_fs.iterdir()) == []  # the half-written part and the .tmp- directory are gone
    assert client.reports[-1][1]["reason"] == reason
    assert f"linkpass: snapshot at step 5 failed, nothing kept: {reason}" in capsys.readouterr().err.splitlines()
    # the hook goes on: a smaller state fits, and that snapshot is complete
    monkeypatch.setattr(snapshot, "free_bytes", real_free)
    _big(sn, features=16)
    res = _run(sn, 10)
    assert res["ok"] and snapdir.resolve(tiny_fs) == Path(res["path"])
