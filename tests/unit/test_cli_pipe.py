"""A reader of linkpass's stdout that goes away early (``linkpass status --history | head -1``)
ends the command quietly with exit 141 (128 + SIGPIPE), for every sub-command: no
BrokenPipeError traceback.  A BrokenPipeError that is not about stdout still propagates."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from linkpass.cli import app as cli

ROOT = Path(__file__).resolve().parents[2]


def run_into_closed_pipe(*argv: str) -> subprocess.CompletedProcess:
    """Run ``python -m linkpass.cli ARGV`` with stdout a pipe whose reading end is already closed."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "linkpass.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=60)
    finally:
        os.close(w)


@pytest.fixture
def fake_daemon(tmp_path):
    """A control socket that answers every request with one large JSON line, as a daemon with a
    long history does."""
    path = tmp_path / "lp.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
    reply = json.dumps({"history": [{"t_ns": i, "event": "rail_down", "rail": i % 8} for i in range(20000)]})
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.makefile("rb").readline()
                conn.sendall(reply.encode() + b"\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield str(path)
    stop.set()
    srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not, on Linux)
    srv.close()
    t.join(timeout=5)
    assert not t.is_alive()


@pytest.mark.parametrize("flag", ["--history", "--json"])
def test_status_into_a_closed_pipe_is_quiet(fake_daemon, flag):
    r = run_into_closed_pipe("status", "--socket", fake_daemon, flag)
    assert (r.returncode, r.stderr) == (cli.EXIT_BROKEN_PIPE, "")
    assert cli.EXIT_BROKEN_PIPE == 141


def test_other_sub_commands_into_a_closed_pipe_are_quiet(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "unit" / "topology"))
    import sysfs_trees as st

    st.build(tmp_path / "sys", st.hgx_h100_ib()[0])
    for argv in (("config", "show", "--defaults"), ("topology", "--sysfs-root", str(tmp_path / "sys"), "--no-live", "--json"),
                 ("topology", "--sysfs-root", str(tmp_path / "sys"), "--no-live", "--matrix")):
        r = run_into_closed_pipe(*argv)
        assert (r.returncode, r.stderr) == (cli.EXIT_BROKEN_PIPE, ""), argv
    # the table is printed by rich, which handles a closed pipe itself: quietly, exit 1
    r = run_into_closed_pipe("topology", "--sysfs-root", str(tmp_path / "sys"), "--no-live")
    assert (r.returncode, r.stderr) == (1, "")


def test_status_into_a_pipe_that_stays_open_prints_everything(fake_daemon):
    r = subprocess.run([sys.executable, "-m", "linkpass.cli", "status", "--socket", fake_daemon, "--history"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and len(json.loads(r.stdout)["history"]) == 20000


def test_a_broken_pipe_that_is_not_stdout_propagates(monkeypatch):
    def boom(args):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a socket of the command's own

    monkeypatch.setattr(cli, "_stdout_reader_gone", lambda: False)
    parser = argparse.ArgumentParser()
    parser.set_defaults(func=boom)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    with pytest.raises(BrokenPipeError):
        cli.main([])
