"""A warm spare does not outlive its job: a script that fails at its first line under
`linkpass exec --spares 1` leaves no spare process behind once its worker has exited (spares
used to wait for an assignment, orphaned, up to LINKPASS_SPARE_WAIT_S, while the job's store
was still up).  No root, no daemon."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wait import wait_until

pytestmark = [pytest.mark.slow]
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spares_of(job: str) -> list[int]:
    """Pids of the live processes that are spares of job ``job`` (by their environment)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if b"LINKPASS_SPARE=1" in env and f"LINKPASS_JOB={job}".encode() in env and "zombie" not in state:
            out.append(int(d.name))
    return out


def test_spares_of_a_job_that_fails_at_once_do_not_outlive_it(tmp_path):
    """The job's store stays up (hosted here, as a store process of its own or another host's
    torchrun agent would keep it): a waiting spare has nothing telling it the job is gone but
    its worker's exit (it used to wait LINKPASS_SPARE_WAIT_S, 600 s here)."""
    import torch.distributed as dist

    port = _port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    job = f"spare-life-{os.getpid()}"
    env = dict(os.environ, LINKPASS_JOB=job, LINKPASS_JOBS_DIR=str(tmp_path / "jobs"), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT), LINKPASS_SPARE_WAIT_S="600", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LINKPASS_PROGRESS=str(tmp_path / "p{rank}"))
    cmd = [sys.executable, "-m", "linkpass.cli", "exec", "--no-daemon", "--no-live", "--spares", "1", "--",
           sys.executable, str(script)]
    log = tmp_path / "log"
    try:
        p = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, timeout=300)
        assert p.returncode == 3, log.read_text()[-2000:]
        # the spare was listed (its worker waits for that before the script runs) ...
        assert list(tmp_path.glob("p0.spare*")), log.read_text()[-2000:]
        # ... and leaves with its worker
        wait_until(lambda: not _spares_of(job), 60, "the job's spares to exit")
    finally:
        for pid in _spares_of(job):
            os.kill(pid, 9)
        del store
