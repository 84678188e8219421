"""Snapshots the hook takes of an unmodified script (examples/ddp_train.py, examples/fsdp2_train.py)
under `linkpass exec` + real torchrun, 2 ranks, gloo on CPU, no daemon: a snapshot at step k (on
request with `linkpass snapshot --wait`, or periodic), a fresh run resumed from it with
`linkpass exec --resume`, final weights bitwise equal to the uninterrupted run; a rank killed
while it writes its part leaves nothing that is taken for a snapshot; bad input is one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wait import wait_until
from torch_hooks import snapdir

pytestmark = [pytest.mark.slow]
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DDP = ROOT / "examples" / "ddp_train.py"
FSDP2 = ROOT / "examples" / "fsdp2_train.py"
LINKPASS = [sys.executable, "-m", "linkpass.cli"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One `linkpass exec [EXEC_ARGS] -- torchrun --nproc-per-node N SCRIPT ARGS` in its own
    working directory, with its own job registry."""

    def __init__(self, tmp: Path, tag: str, script: Path, args: list[str], exec_args: list[str] = (), nproc: int = 2,
                 env: dict | None = None, files: dict[str, bytes] | None = None):
        self.dir = tmp / tag
        self.dir.mkdir()
        for name, data in (files or {}).items():
            (self.dir / name).write_bytes(data)
        self.tag = tag
        self.log = self.dir / "log"
        self.env = dict(os.environ, LINKPASS_JOB=tag, LINKPASS_REPORT=str(self.dir / "r{rank}.json"),
                        LINKPASS_PROGRESS=str(self.dir / "p{rank}"), LINKPASS_JOBS_DIR=str(tmp / "jobs"),
                        OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.env.update(env or {})
        self.cmd = LINKPASS + ["exec", "--no-daemon", "--no-live", *exec_args, "--", sys.executable, "-m",
                               "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                               "--master-port", str(_port()), "--max-restarts", "0", str(script), *args]
        self.nproc = nproc
        self.p = subprocess.Popen(self.cmd, cwd=self.dir, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"{self.tag} did not end within {timeout} s:\n{self.text()[-3000:]}") from None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def steps(self) -> int:
        try:
            return int((self.dir / "p0").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def reports(self) -> list[dict]:
        return [json.loads((self.dir / f"r{r}.json").read_text()) for r in range(self.nproc)]


def _same_weights(a: Job, b: Job) -> None:
    ra, rb = a.reports(), b.reports()
    for x, y in zip(ra, rb):
        assert x["steps"] == y["steps"], (x["steps"], y["steps"])
        assert x["weights_sha256"] and x["weights_sha256"] == y["weights_sha256"], f"rank {x['rank']}: weights differ"


def test_a_snapshot_requested_mid_run_resumes_a_fresh_run_to_the_uninterrupted_weights(tmp_path):
    args = ["--epochs", "4", "--samples", "32768", "--batch-size", "32"]  # 2048 steps: the request lands mid-run
    a = Job(tmp_path, "a", DDP, args)
    wait_until(lambda: a.steps() >= 5 or a.p.poll() is not None, 120, "the job's first steps")
    # a directory the ranks cannot write: the snapshot fails in one line, nothing is kept, the job trains on
    bad = subprocess.run(LINKPASS + ["snapshot", "--job", "a", "--to", "/proc/linkpass-cannot-write", "--wait",
                                     "--timeout", "120"], capture_output=True, text=True, timeout=180, env=a.env)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "snapshot 1 failed, nothing kept: rank 0:" in bad.stderr, bad.stderr
    snaps = tmp_path / "snaps"
    q = subprocess.run(LINKPASS + ["snapshot", "--job", "a", "--to", str(snaps), "--wait", "--json", "--timeout", "120"],
                       capture_output=True, text=True, timeout=180, env=a.env)
    assert q.returncode == 0, q.stderr + a.text()[-2000:]
    res = json.loads(q.stdout)
    assert a.wait() == 0, a.text()[-3000:]
    assert res["ok"] and 5 < res["step"] < 2048 and res["bytes"] > 0 and isinstance(res["stall_ms"], (int, float)) and res["stall_ms"] >= 0
    path = Path(res["path"])
    assert path == snapdir.final_path(snaps, res["step"])
    m = snapdir.read_manifest(path)
    assert m["world_size"] == 2 and m["step"] == res["step"] and m["position_known"]
    assert not [c for c in snaps.iterdir() if ".tmp-" in c.name]
    events = a.reports()[1]["snapshots"]
    assert [e["ok"] for e in events] == [False, True] and events[1]["step"] == res["step"]

    b = Job(tmp_path, "b", DDP, args, exec_args=["--resume", str(path)])
    assert b.wait() == 0, b.text()[-3000:]
    assert f"rank 0 resumed from {path} at step {res['step']}" in b.text()
    _same_weights(a, b)


def test_fsdp2_periodic_snapshots_keep_the_newest_and_resume_bitwise(tmp_path):
    args = ["--epochs", "2", "--samples", "4096"]  # 128 steps
    a = Job(tmp_path, "a", FSDP2, args, exec_args=["--snapshot-every", "30", "--snapshot-keep", "2"])
    assert a.wait() == 0, a.text()[-3000:]
    snaps = a.dir / "linkpass-snapshots"
    assert sorted(c.name for c in snaps.iterdir()) == [snapdir.step_name(90), snapdir.step_name(120)]
    b = Job(tmp_path, "b", FSDP2, args, exec_args=["--resume", str(snaps / snapdir.step_name(90))])
    assert b.wait() == 0, b.text()[-3000:]
    _same_weights(a, b)
    # a snapshots directory given to --resume: its newest complete snapshot
    c = Job(tmp_path, "c", FSDP2, args, exec_args=["--resume", str(snaps)])
    assert c.wait() == 0, c.text()[-3000:]
    assert f"resumed from {snaps / snapdir.step_name(120)} at step 120" in c.text()
    _same_weights(a, c)


KILLER = '''
import os, signal
from torch_hooks import snapshot

_save = snapshot.Snapshotter._save

def _save_then_die(self, sd, rd):
    if os.environ.get("RANK") == "1":
        (rd / "__0_0.distcp").write_bytes(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(self, sd, rd)

snapshot.Snapshotter._save = _save_then_die
'''


def test_a_rank_killed_while_it_writes_its_part_leaves_nothing_that_looks_complete(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(KILLER)  # chained by the hook's own sitecustomize
    snaps = tmp_path / "snaps"
    args = ["--epochs", "1", "--samples", "4096"]
    a = Job(tmp_path, "a", DDP, args, exec_args=["--snapshot-every", "20", "--snapshot-dir", str(snaps)],
            env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(shim)])})
    assert a.wait() != 0
    left = sorted(c.name for c in snaps.iterdir())
    assert left == [f"{snapdir.step_name(20)}.tmp-p20"], left
    with pytest.raises(snapdir.SnapshotError, match="no complete snapshot"):
        snapdir.resolve(snaps)
    for target in (snaps, snaps / left[0]):
        r = subprocess.run(LINKPASS + ["exec", "--no-daemon", "--no-live", "--resume", str(target), "--", "true"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert str(target) in r.stderr
    # the next snapshot written into the directory removes the partial one
    b = Job(tmp_path, "b", DDP, args, exec_args=["--snapshot-every", "50", "--snapshot-dir", str(snaps)])
    assert b.wait() == 0, b.text()[-3000:]
    assert sorted(c.name for c in snaps.iterdir()) == [snapdir.step_name(50)]


def test_resume_with_another_world_size_or_a_run_too_short_to_reach_it_is_refused_in_one_line(tmp_path):
    args = ["--epochs", "1", "--samples", "2048"]  # 32 steps: the snapshot kept is step 30
    a = Job(tmp_path, "a", DDP, args, exec_args=["--snapshot-every", "10", "--snapshot-keep", "1"])
    assert a.wait() == 0, a.text()[-3000:]
    snap = a.dir / "linkpass-snapshots"
    b = Job(tmp_path, "b", DDP, args, exec_args=["--resume", str(snap)], nproc=1)
    assert b.wait() != 0
    lines = [ln for ln in b.text().splitlines() if "world size" in ln]
    assert lines and "the snapshot is of world size 2, this job has world size 1" in lines[0], b.text()[-2000:]
    assert not (b.dir / "r0.json").exists() or json.loads((b.dir / "r0.json").read_text())["steps"] == 0
    # a run with half the samples (16 steps) never reaches the snapshot's batch: not a silent success
    c = Job(tmp_path, "c", DDP, ["--epochs", "1", "--samples", "1024"], exec_args=["--resume", str(snap)])
    assert c.wait() != 0
    lines = [ln for ln in c.text().splitlines() if "without reaching" in ln]
    assert len(lines) == 1 and "the snapshot's step 30 (epoch 0, batch 30)" in lines[0], c.text()[-2000:]
    assert "ended at epoch 0, batch 16" in lines[0] and "exiting with status 65" in lines[0], lines[0]


def test_a_script_that_resumes_itself_past_the_snapshot_is_refused(tmp_path):
    """examples/ddp_train.py loads its own snapshot.pt (epochs done) when it finds one: a run given
    that file and --resume of an earlier hook snapshot would train the snapshot's state on other data."""
    args = ["--epochs", "2", "--samples", "2048", "--snapshot", "snapshot.pt"]  # 32 steps per epoch
    a = Job(tmp_path, "a", DDP, args, exec_args=["--snapshot-every", "40", "--snapshot-keep", "1"])
    assert a.wait() == 0, a.text()[-3000:]
    snap = a.dir / "linkpass-snapshots" / snapdir.step_name(40)  # epoch 1
    b = Job(tmp_path, "b", DDP, ["--epochs", "3"] + args[2:], exec_args=["--resume", str(snap)],
            files={"snapshot.pt": (a.dir / "snapshot.pt").read_bytes()})  # the script's own: 2 epochs done
    assert b.wait() != 0
    assert "the script reached epoch 2 before the snapshot's epoch 1" in b.text(), b.text()[-2000:]


def test_a_snapshot_request_for_an_unknown_job_is_one_line(tmp_path):
    env = dict(os.environ, LINKPASS_JOBS_DIR=str(tmp_path / "jobs"))
    r = subprocess.run(LINKPASS + ["snapshot", "--job", "nosuchjob", "--wait"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "no protected job 'nosuchjob' on this host" in r.stderr
    r = subprocess.run(LINKPASS + ["snapshot", "--job", "x", "--store", "127.0.0.1:1", "--timeout", "2"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "does not answer" in r.stderr, r.stderr
