"""Rank migration on loopback with real gloo and a stand-in daemon hook socket (no root):
a device_fault message reaches rank 1's hook mid-run; a hot spare takes rank 1 over, the job
ends with weights bitwise equal to a fault-free run; with no spare every rank stops with
EXIT_NO_SPARE (69) and nobody hangs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch_hooks.spare import EXIT_FENCED, EXIT_NO_SPARE

from linkpass.lab.ports import listen_port

ROOT = Path(__file__).resolve().parents[2]


class FakeDaemon:
    """A hooks socket that registers clients and sends one device_fault on demand."""

    def __init__(self, path: str):
        self.path = path
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(8)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        f = c.makefile("rb")
        for line in f:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("type") == "register":
                c.sendall(json.dumps({"type": "registered", "v": 1, "client_id": 1, "host": "h1", "unknown_peers": []}).encode() + b"\n")

    def fault(self, gpu: int = 0):
        msg = {"type": "device_fault", "v": 1, "instance": "x", "host": "h1", "gpu": gpu, "t_ns": time.monotonic_ns(),
               "incident": {"domain": "gpu", "device": "0000:18:00.0", "code": "xid:79", "action": "migrate-rank",
                            "remedy": "reboot-node", "source": "kmsg", "summary": "GPU has fallen off the bus"}}
        for c in list(self.conns):
            try:
                c.sendall(json.dumps(msg).encode() + b"\n")
            except OSError:
                pass

    def close(self):
        self.srv.close()
        for c in self.conns:
            c.close()


def _port() -> int:
    return listen_port()  # outside the ephemeral range: see linkpass.lab.ports


def _launch(tmp: Path, tag: str, port: int, steps: int, rank: int, sock: str | None, spare: bool = False, gpu: int = 0,
            extra: tuple[str, ...] = ()):
    out, prog = tmp / f"{tag}-{'spare' if spare else rank}.json", tmp / f"{tag}-{'spare' if spare else rank}.progress"
    cmd = [sys.executable, "-m", "linkpass.lab.demo_train", "--rank", str(rank), "--world-size", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--steps", str(steps), "--hook", "--rail-ifaces", "0=lo", "--rail", "0",
           "--hooks-socket", sock or str(tmp / "nobody.sock"), "--timeout-s", "20", "--gpu", str(gpu),
           "--host", "h1" if rank == 1 or spare else "h0", "--out", str(out), "--progress", str(prog), "--spare-wait-s", "60"]
    if spare:
        cmd.append("--spare")
    cmd += extra
    log = open(tmp / f"{tag}-{'spare' if spare else rank}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), out, prog


def _progress(p: Path) -> int:
    try:
        return int(p.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _wait_for_spare(port: int, spare) -> None:
    """Until the spare has announced itself in the job's store (``Spare.__init__`` writes
    ``linkpass/<job>/spares/<id>``): on a loaded machine its torch import can take longer than
    the ranks' first third, and a fault before it is listed finds no spare."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    deadline = time.monotonic() + 60
    while not store.check(["linkpass/demo/spares/1"]):
        assert time.monotonic() < deadline, "the spare never announced itself"
        assert spare[0].poll() is None, f"the spare exited with {spare[0].returncode}"
        time.sleep(0.01)


def _run(tmp: Path, tag: str, steps: int, spare: bool, fault: bool):
    sock = str(tmp / f"{tag}.hooks.sock")
    fd = FakeDaemon(sock) if fault else None
    port = _port()
    procs = [_launch(tmp, tag, port, steps, 0, None, gpu=0), _launch(tmp, tag, port, steps, 1, sock if fault else None, gpu=0)]
    if spare:
        procs.append(_launch(tmp, tag, port, steps, 1, None, spare=True, gpu=1))
    t_fault = None
    try:
        if fault:
            deadline = time.monotonic() + 60
            while _progress(procs[1][2]) < steps // 3:
                assert time.monotonic() < deadline, "no progress"
                assert procs[1][0].poll() is None, (tmp / f"{tag}-1.log").read_text()[-2000:]
                time.sleep(0.01)
            if spare:
                _wait_for_spare(port, procs[2])
            t_fault = time.monotonic_ns()
            fd.fault(0)
        codes = [p.wait(90) for p, _, _ in procs]
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
        if fd:
            fd.close()
    res = [json.loads(o.read_text()) if o.exists() else None for _, o, _ in procs]
    return codes, res, t_fault


def test_spare_takes_over_a_faulty_rank_and_weights_match(tmp_path):
    steps = 60
    codes, ref, _ = _run(tmp_path, "ref", steps, spare=False, fault=False)
    assert codes == [0, 0]
    codes, res, t_fault = _run(tmp_path, "mig", steps, spare=True, fault=True)
    logs = "\n".join((tmp_path / f).read_text()[-1500:] for f in ("mig-0.log", "mig-1.log", "mig-spare.log"))
    # the faulty process exits 74 by itself, or the spare's fence SIGKILLs it first
    assert codes[0] == 0 and codes[2] == 0 and codes[1] in (EXIT_FENCED, -9), logs
    r0, sp = res[0], res[2]
    assert sp["rank"] == 1 and sp["spare"] == 1 and sp["steps_done"] == steps, logs
    assert r0["weights_sha256"] == sp["weights_sha256"] == ref[0]["weights_sha256"], logs
    joined = sp["rebuilds"][0]
    assert joined["event"] == "joined" and joined["epoch"] == 1 and joined["state_bytes"] > 0
    assert joined["first_step_t_ns"] > t_fault
    ev0 = r0["rebuilds"][0]
    assert ev0["trigger"] in ("migrate", "error", "peer") and ev0["migrated_rank"] == 1 and ev0["state_from"] == 0


def test_no_spare_left_stops_every_rank_with_a_distinct_code(tmp_path):
    codes, res, _ = _run(tmp_path, "nosp", 400, spare=False, fault=True)
    logs = "\n".join((tmp_path / f).read_text()[-1500:] for f in ("nosp-0.log", "nosp-1.log"))
    assert codes == [EXIT_NO_SPARE, EXIT_NO_SPARE], logs
    assert "NO SPARE LEFT" in (tmp_path / "nosp-1.log").read_text()
    assert "NO SPARE LEFT" in (tmp_path / "nosp-0.log").read_text()


def test_a_spare_lost_after_its_assignment_stops_the_job_with_76_never_a_hang(tmp_path):
    """A fault on the spare itself: the spare is assigned rank 1 but dies before it joins.  The
    healthy rank waits rebuild_timeout_s (5 s here) for rank 1's proposal, then stops with
    EXIT_REBUILD_FAILED (76), never hangs.  The spare is held with SIGSTOP while the faulty rank
    claims it (the claim is an atomic add in the store, so it needs nothing from the spare) and
    SIGKILLed once the faulty rank has exited."""
    import signal

    from torch_hooks.guard import EXIT_REBUILD_FAILED

    tag, steps = "spdie", 5000  # never reached: rank 0 stops with 76
    sock = str(tmp_path / f"{tag}.hooks.sock")
    fd = FakeDaemon(sock)
    port = _port()
    extra = ("--rebuild-timeout-s", "5")
    procs = [_launch(tmp_path, tag, port, steps, 0, None, extra=extra), _launch(tmp_path, tag, port, steps, 1, sock, extra=extra),
             _launch(tmp_path, tag, port, steps, 1, None, spare=True, gpu=1, extra=extra)]
    spare_log = tmp_path / f"{tag}-spare.log"
    spare_announced = procs[2][2]  # the spare writes its progress file once it has announced itself
    try:
        deadline = time.monotonic() + 60
        while _progress(procs[1][2]) < 20 or not spare_announced.exists():
            assert time.monotonic() < deadline, "no progress"
            assert all(p.poll() is None for p, _, _ in procs), spare_log.read_text()[-2000:]
            time.sleep(0.01)
        procs[2][0].send_signal(signal.SIGSTOP)
        fd.fault(0)
        assert procs[1][0].wait(30) == EXIT_FENCED  # handed rank 1 to the (stopped) spare and left
        procs[2][0].kill()
        code0 = procs[0][0].wait(60)  # rebuild_timeout_s is 5 s: a timeout here is a hang
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
        fd.close()
    log0 = (tmp_path / f"{tag}-0.log").read_text()
    assert code0 == EXIT_REBUILD_FAILED, log0[-3000:]
    assert "not every rank joined rebuild epoch 1" in log0, log0[-3000:]


def test_a_dead_spare_is_skipped_and_a_live_one_on_another_host_takes_over(tmp_path):
    """h1's idle spare is SIGKILLed; then rank 1 (on h1) loses its GPU: claim_spare skips the
    dead spare (its pid is gone) and hands rank 1 to the live spare on h0; the job finishes."""
    import signal

    tag, steps = "kill", 60
    sock = str(tmp_path / f"{tag}.hooks.sock")
    fd = FakeDaemon(sock)
    port = _port()
    procs = [_launch(tmp_path, tag, port, steps, 0, None), _launch(tmp_path, tag, port, steps, 1, sock),
             _launch(tmp_path, tag, port, steps, 1, None, spare=True, gpu=1),                           # h1: dies
             _launch(tmp_path, f"{tag}b", port, steps, 1, None, spare=True, gpu=1, extra=("--host", "h0"))]  # h0: live
    try:
        deadline = time.monotonic() + 60
        while _progress(procs[1][2]) < steps // 3 or not (procs[2][2].exists() and procs[3][2].exists()):
            assert time.monotonic() < deadline, "no progress"
            assert all(p.poll() is None for p, _, _ in procs), (tmp_path / f"{tag}-1.log").read_text()[-2000:]
            time.sleep(0.01)
        procs[2][0].send_signal(signal.SIGKILL)
        procs[2][0].wait(10)
        fd.fault(0)
        codes = [procs[i][0].wait(90) for i in (0, 1, 3)]
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
        fd.close()
    logs = "\n".join((tmp_path / f).read_text()[-1500:] for f in (f"{tag}-0.log", f"{tag}-1.log", f"{tag}b-spare.log"))
    assert codes[0] == 0 and codes[2] == 0 and codes[1] in (EXIT_FENCED, -9), logs
    live = json.loads(procs[3][1].read_text())
    assert live["rank"] == 1 and live["steps_done"] == steps, logs
    assert live["rebuilds"][0]["fenced"] == "other-host"
    assert "looks dead" in (tmp_path / f"{tag}-1.log").read_text(), logs
