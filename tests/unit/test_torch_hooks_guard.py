"""LinkPassGuard with real torch.distributed (gloo, CPU) in real processes: 2 ranks on loopback.

The daemon is played by a small thread server per rank speaking torch_hooks.protocol (the real
daemon side is tested in test_hook_server.py and the fabric integration test).  Both "rails"
are the loopback interface here: what is checked is the guard's lifecycle (abort, agree,
rebuild, replay), not the routing.

Run as a script, this file is the training worker the tests start.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.wait import wait_until  # noqa: E402
from torch_hooks import protocol as proto  # noqa: E402


# --------------------------------------------------------------------------- the worker


def worker(argv: list[str]) -> int:
    import argparse
    import datetime
    import logging

    import torch
    import torch.distributed as dist

    from torch_hooks.guard import LinkPassGuard

    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--socket")
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    p.add_argument("--progress")
    p.add_argument("--pause", default="", help="STEP:GATE: before the collective of that step, write PROGRESS.paused "
                   "and wait until the file GATE exists (at most 60 s)")
    p.add_argument("--no-daemon", action="store_true")
    p.add_argument("--die", type=int, default=-1, help="this rank dies (os._exit) before the collective of that step")
    p.add_argument("--exit-mode", action="store_true", help="on_unmovable='exit', rebuild timeout 3 s")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + str(a.rank) + " %(name)s %(message)s")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = dist.TCPStore("127.0.0.1", a.port, 2, a.rank == 0, timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pause_step, gate = (int(a.pause.split(":", 1)[0]), Path(a.pause.split(":", 1)[1])) if a.pause else (-1, None)
    peer = "h1" if a.rank == 0 else "h0"
    guard = LinkPassGuard(store, a.rank, 2, rails={0: "lo", 1: "lo"}, rail=0, state=[model, opt], job="t",
                          peers=[peer], hooks_socket=a.socket, connect=not a.no_daemon,
                          on_unmovable="exit" if a.exit_mode else "raise", rebuild_timeout_s=3.0 if a.exit_mode else 30.0,
                          timeout=datetime.timedelta(seconds=20), error_grace_s=3.0)
    params = list(model.parameters())
    paused = set()

    def train_step(step: int) -> float:
        g = torch.Generator().manual_seed(1000 * step + a.rank)
        x = torch.randn(32, 16, generator=g)
        y = torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        if step == a.die:
            # a migration/rebuild starts (the request every rank finds), then this rank is lost for
            # good before it joins: a second fault during the migration, or a fault on the spare
            guard.kv.set(f"rebuild/{guard.epoch + 1}/req", json.dumps({"rank": a.rank, "reason": "test", "unmovable": False}))
            os._exit(9)
        if step == pause_step and step not in paused:
            paused.add(step)
            Path(a.progress + ".paused").write_text(str(step))
            deadline = time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        Path(a.progress + ".at").write_text(str(step))  # this rank now enters the collective of this step
        guard.all_reduce(flat)
        flat /= 2
        off = 0
        for q in params:
            q.grad.copy_(flat[off:off + q.numel()].view_as(q))
            off += q.numel()
        opt.step()
        return loss.item()

    for step in range(a.steps):
        guard.step(train_step, step)
        Path(a.progress).write_text(str(step + 1))
        time.sleep(0.02)
    h = hashlib.sha256()
    for q in params:
        h.update(q.detach().numpy().tobytes())
    counters = dict(guard.client.counters) if guard.client else {}
    Path(a.out).write_text(json.dumps({"sha": h.hexdigest(), "events": guard.events, "steps": guard.step_index,
                                       "epoch": guard.epoch, "rail": guard.rail, "client": counters}))
    guard.close()
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker(sys.argv[2:]))


# --------------------------------------------------------------------------- fake daemon


class FakeDaemon:
    """A hooks socket that records registrations and pushes the notices a test gives it."""

    def __init__(self, path: str, host: str):
        self.path, self.host = path, host
        self.conns: list[socket.socket] = []
        self.registrations: list[dict] = []
        self.reports: list[dict] = []
        self.instance = f"fake-{time.monotonic_ns()}"
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(8)
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._read, args=(c,), daemon=True).start()

    def _read(self, c):
        f = c.makefile("rb")
        for line in f:
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if m.get("type") == "register":
                self.registrations.append(m)
                c.sendall(proto.encode({"type": "registered", "client_id": len(self.registrations), "host": self.host}))
            elif m.get("type") == "report":
                self.reports.append(m)

    def push(self, generation: int, usable, peer_usable, rail: int = 0, peers=("h1",)):
        reg = proto.Registration(job="t", rank=0, world_size=2, peers=tuple(peers), rail=rail)
        msg = proto.build_notice(generation=generation, instance=self.instance, host=self.host, all_rails=[0, 1],
                                 usable=usable, peer_usable=peer_usable, reason="test", t_ns=time.monotonic_ns(), reg=reg)
        for c in list(self.conns):
            try:
                c.sendall(proto.encode(msg))
            except OSError:
                pass

    def close(self):
        self._stop = True
        self._srv.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass
        self.conns = []
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp: Path, tag: str, steps: int, pause: dict[int, str] | None = None, no_daemon: bool = False):
    port = _free_port()
    procs = []
    for r in range(2):
        argv = [sys.executable, __file__, "worker", "--rank", str(r), "--port", str(port), "--socket", str(tmp / f"h{r}.sock"),
                "--steps", str(steps), "--out", str(tmp / f"{tag}{r}.json"), "--progress", str(tmp / f"{tag}{r}.progress")]
        if pause and r in pause:
            argv += ["--pause", pause[r]]
        if no_daemon:
            argv.append("--no-daemon")
        procs.append(subprocess.Popen(argv, stdout=open(tmp / f"{tag}{r}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def _progress(tmp: Path, tag: str, r: int) -> int:
    try:
        return int((tmp / f"{tag}{r}.progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _marker(tmp: Path, tag: str, r: int, what: str) -> int | None:
    try:
        return int((tmp / f"{tag}{r}.progress.{what}").read_text())
    except (OSError, ValueError):
        return None


def _wait_progress(tmp, tag, r, n, procs, timeout=60):
    deadline = time.monotonic() + timeout
    while _progress(tmp, tag, r) < n:
        assert all(p.poll() in (None, 0) for p in procs), (tmp / f"{tag}{r}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"rank {r} stuck before step {n}: " + (tmp / f"{tag}{r}.log").read_text()[-3000:]
        time.sleep(0.01)


def _finish(tmp, tag, procs, timeout=90):
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"rank {r} did not finish: " + (tmp / f"{tag}{r}.log").read_text()[-3000:])
        assert rc == 0, (tmp / f"{tag}{r}.log").read_text()[-3000:]
    return [json.loads((tmp / f"{tag}{r}.json").read_text()) for r in range(2)]


torch = pytest.importorskip("torch")
STEPS = 60


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A fault-free run with no daemon at all: the guard trains on (and gives the reference)."""
    tmp = tmp_path_factory.mktemp("ref")
    res = _finish(tmp, "ref", _launch(tmp, "ref", STEPS, no_daemon=True))
    assert res[0]["sha"] == res[1]["sha"]
    assert res[0]["events"] == [] and res[0]["steps"] == STEPS
    return res[0]["sha"]


def test_guard_rebuilds_mid_collective_twice_ignores_other_rail_and_survives_daemon_restart(tmp_path, reference):
    d0 = FakeDaemon(str(tmp_path / "h0.sock"), "h0")
    d1 = FakeDaemon(str(tmp_path / "h1.sock"), "h1")
    try:
        # rank 1 holds before the collective of step 10 until the test opens a gate: rank 0 is in
        # that collective (it cannot complete) when its daemon says the peer's rail 0 is gone
        gate = tmp_path / "gate"
        procs = _launch(tmp_path, "run", STEPS, pause={1: f"10:{gate}"})
        wait_until(lambda: _marker(tmp_path, "run", 1, "paused") == 10, 60, "rank 1 holding before step 10")
        wait_until(lambda: _marker(tmp_path, "run", 0, "at") == 10, 60, "rank 0 entering the collective of step 10")
        d0.push(5, usable=[0, 1], peer_usable={"h1": [1]})
        # rank 0 abandons the blocked collective on the notice while rank 1 still holds (so neither the
        # collective completing nor the 20 s gloo timeout did it) ...
        wait_until(lambda: "abandoning process group epoch 0 (rail 0) in step 10" in (tmp_path / "run0.log").read_text(),
                   30, "rank 0 abandoning epoch 0 in step 10 (run0.log)")
        assert all(p.poll() is None for p in procs) and _progress(tmp_path, "run", 0) == 10
        assert not gate.exists()
        gate.write_text("")  # ... and only then does rank 1 go on
        _wait_progress(tmp_path, "run", 0, 11, procs)
        # a notice about rail 0 again (the group is on rail 1 now): no rebuild
        _wait_progress(tmp_path, "run", 0, 20, procs)
        d1.push(3, usable=[1], peer_usable={"h0": [0, 1]})
        # the daemon of host 1 restarts: the client reconnects and registers again
        _wait_progress(tmp_path, "run", 1, 28, procs)
        d1.close()
        # the daemon stays away while rank 1 trains two more steps without it (its client retries)
        _wait_progress(tmp_path, "run", 1, 30, procs)
        d1 = FakeDaemon(str(tmp_path / "h1.sock"), "h1")
        wait_until(lambda: d1.registrations, 10, "rank 1 registering with the restarted daemon")
        assert d1.registrations[-1]["rail"] == 1
        # rail 0 heals (host 0's daemon hears it from host 1): nothing to do
        _wait_progress(tmp_path, "run", 0, 34, procs)
        d0.push(6, usable=[0, 1], peer_usable={"h1": [0, 1]})
        # second fault in a row: rail 1 breaks, rail 0 is back
        _wait_progress(tmp_path, "run", 1, 40, procs)
        d1.push(1, usable=[0], peer_usable={"h0": [0, 1]})
        res = _finish(tmp_path, "run", procs)
    finally:
        d0.close()
        d1.close()
    for r in res:
        assert r["steps"] == STEPS
        assert r["sha"] == reference, "weights differ from the fault-free run"
        assert [e["rail_to"] for e in r["events"]] == [1, 0], r["events"]
        assert r["epoch"] == 2 and r["rail"] == 0
    e0, e1 = res[0]["events"], res[1]["events"]
    assert e0[0]["trigger"] == "notice" and e0[0]["interrupted_step"] == 10 and e0[0]["resume_step"] == 10
    assert e1[0]["trigger"] in ("peer", "error")  # rank 1 learnt it from rank 0 (store or failed collective)
    assert e1[1]["trigger"] == "notice" and e0[1]["trigger"] in ("peer", "error")
    assert all(e["rebuild_ms"] >= 0 for r in res for e in r["events"])  # how fast: bench/, not here
    assert res[1]["client"]["connects"] >= 2  # reconnected after the restart
    # the hooks told the daemons what they did
    assert any(m["event"] == "rebuilt" and m["rail_to"] == 1 for m in d0.reports) or any(m["event"] == "rebuilt" for m in d1.reports)


def test_gloo_abort_alone_leaves_the_collective_blocked_socket_shutdown_frees_it(tmp_path):
    """The fact the guard's abort rests on (torch 2.13): ProcessGroupGloo.abort() does not
    complete an all-reduce blocked on a silent peer; shutting its sockets down does."""
    script = r'''
import sys, time, datetime, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from torch_hooks.guard import _socket_fds, _tcp_fds, _shutdown_fds
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=20))
o = dist.ProcessGroupGloo._Options(); o._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
o._timeout = datetime.timedelta(seconds=20); o._threads = 2
before = _socket_fds(); pg = dist.ProcessGroupGloo(dist.PrefixStore("x", store), rank, 2, o); fds = _tcp_fds(before, _socket_fds())
if rank == 1:
    store.wait(["done"], datetime.timedelta(seconds=20)); sys.exit(0)
w = pg.allreduce([torch.ones(8)])
pg.abort(); time.sleep(0.5)
after_abort = w.is_completed()
t = time.monotonic(); n = _shutdown_fds(fds)
while not w.is_completed() and time.monotonic() - t < 5: time.sleep(0.001)
print(f"RESULT {after_abort} {w.is_completed()} {n}", flush=True)
store.set("done", "1")
'''
    port = _free_port()
    ps = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port), str(ROOT)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in ps]
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT"))
    _, after_abort, done, n = line.split()
    assert after_abort == "False"   # abort() alone: still blocked half a second later (the window is the input)
    assert done == "True" and int(n) >= 1, outs[0]  # shutting the sockets down frees it (within the 5 s bound)


@pytest.mark.parametrize("env, want", [
    ({}, False),
    ({"NCCL_IB_RESILIENCY_PORT_FAILOVER": "0"}, False),
    ({"NCCL_IB_RESILIENCY_PORT_FAILOVER": "1"}, True),  # no HCA list: trusted
    ({"NCCL_IB_RESILIENCY_PORT_FAILOVER": "1", "NCCL_IB_HCA": "=mlx4_0:1,mlx4_0:2"}, True),
    ({"NCCL_IB_RESILIENCY_PORT_FAILOVER": "1", "NCCL_IB_HCA": "^mlx5_7"}, True),
    # one port can never be fused: the guard keeps its abort + exit 75
    ({"NCCL_IB_RESILIENCY_PORT_FAILOVER": "1", "NCCL_IB_HCA": "=mlx5_0:1"}, False),
])
def test_nccl_port_failover_only_when_it_can_act(env, want):
    from torch_hooks.guard import nccl_port_failover

    ok, why = nccl_port_failover(env)
    assert ok is want and (why == "") is want


def test_nccl_env_and_guard_agree_on_a_one_port_per_nic_node(capsys):
    """`linkpass nccl-env` on a node whose NICs have one port each exports no failover variable,
    so the guard reading that environment keeps its abort + exit 75."""
    from linkpass.cli import main
    from torch_hooks.guard import nccl_port_failover

    src = ROOT / "tests" / "fixtures" / "corpus" / "ib_tools" / "gpud_a100_all_active.ibstat.txt"
    rc = main(["nccl-env", "--no-daemon", "--from", str(src), "--format", "json", "--nccl-version", "2.30.0"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["env"]["NCCL_IB_HCA"].startswith("=mlx5_1:1,")
    assert "NCCL_IB_RESILIENCY_PORT_FAILOVER" not in doc["env"]
    assert any("no second healthy port" in n for n in doc["notes"])
    assert nccl_port_failover(doc["env"])[0] is False


def test_a_rank_lost_for_good_stops_the_others_with_a_distinct_status_never_a_hang(tmp_path):
    """A rebuild starts and rank 1 is then lost for good (a second fault during a migration, or a
    fault on the spare): rank 0 finds the request, waits rebuild_timeout_s for rank 1's proposal,
    and exits with EXIT_REBUILD_FAILED (76) and one clear line, not a traceback and not a hang."""
    from torch_hooks.guard import EXIT_REBUILD_FAILED

    port = _free_port()
    procs = []
    for r in range(2):
        argv = [sys.executable, __file__, "worker", "--rank", str(r), "--port", str(port), "--socket", str(tmp_path / f"h{r}.sock"),
                "--steps", "40", "--out", str(tmp_path / f"d{r}.json"), "--progress", str(tmp_path / f"d{r}.progress"),
                "--no-daemon", "--exit-mode"] + (["--die", "5"] if r == 1 else [])
        procs.append(subprocess.Popen(argv, stdout=open(tmp_path / f"d{r}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT))
    assert procs[1].wait(60) == 9
    try:
        rc = procs[0].wait(60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise AssertionError("rank 0 hung: " + (tmp_path / "d0.log").read_text()[-3000:])
    log = (tmp_path / "d0.log").read_text()
    assert rc == EXIT_REBUILD_FAILED, log[-3000:]
    assert "REBUILD FAILED" in log and "Traceback" not in log, log[-3000:]


# --------------------------------------------------------------------------- migration edge cases (in-process)


def _tcp_pair():
    import datetime

    import torch.distributed as dist

    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return master, client, port


class _Exit(BaseException):
    pass


@pytest.fixture
def no_exit(monkeypatch):
    def fake_exit(code):
        raise _Exit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)


def _guard(store, **kw):
    from torch_hooks.guard import LinkPassGuard

    return LinkPassGuard(store, 0, 1, rails={0: "lo"}, rail=0, connect=False, job="t", gpu=0, **kw)


def test_group_sockets_never_include_store_connections_this_process_serves():
    """Root cause of the intermittent "Failed to recv, got 0 bytes" in a spare's agreement: when
    a rank hosts the store, a store client that connects while the rank builds its group was
    taken for one of the group's sockets, and shut down when the group was aborted."""
    import datetime

    import torch.distributed as dist

    from torch_hooks.guard import _socket_fds, _tcp_fds

    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    before = _socket_fds()
    late = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))  # a spare connecting
    late.set("x", "1")
    after = _socket_fds()
    assert _tcp_fds(before, after), "the late client's sockets should appear between the snapshots"
    assert _tcp_fds(before, after, frozenset({port})) == []
    g = _guard(master)
    assert port in g._store_ports()
    assert master.get("x") == b"1"


def test_agreement_survives_a_broken_store_connection(no_exit):
    """The guard's store connection is cut (shutdown) before an agreement: it reconnects and
    the rebuild completes instead of failing with "Failed to recv"."""
    import torch.distributed as dist

    from torch_hooks.guard import _socket_fds

    _master, client, port = _tcp_pair()  # _master: keeps the store's server alive
    g = _guard(client)
    for fd in _socket_fds():
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.getpeername()[1] == port:
                s.shutdown(socket.SHUT_RDWR)  # only the client's side: the master's own client is separate
        except OSError:
            pass
        finally:
            s.detach()
    resume, rail, _ = g._agree(1, 7, [0], 0, True, "test")
    assert (resume, rail, g.epoch) == (7, 0, 1)
    assert g.base_store is not client and isinstance(g.base_store, dist.TCPStore)
    assert g.kv.get("rebuild/1/rank/0")


def test_a_failed_spare_join_ends_like_a_failed_rebuild(no_exit, capsys):
    """RebuildFailed from the join (a spare's agreement) raises with "raise", exits 76 with one
    line with "exit", never a traceback."""
    import torch.distributed as dist

    from torch_hooks import spare as sp
    from torch_hooks.guard import EXIT_REBUILD_FAILED, LinkPassGuard, RebuildFailed

    a = sp.Assignment(epoch=1, rank=1, world_size=2, step=3, rail=0, host="elsewhere", pid=1, start=None, spare=1)
    kw = dict(rails={0: "lo"}, rail=0, connect=False, job="t", rebuild_timeout_s=0.3, join=a)
    with pytest.raises(RebuildFailed):
        LinkPassGuard(dist.HashStore(), 1, 2, on_unmovable="raise", **kw)
    with pytest.raises(_Exit) as ei:
        LinkPassGuard(dist.HashStore(), 1, 2, **kw)
    assert ei.value.args[0] == EXIT_REBUILD_FAILED
    assert "REBUILD FAILED" in capsys.readouterr().err


def test_a_device_fault_without_a_gpu_moves_no_rank(no_exit):
    import torch.distributed as dist

    store = dist.HashStore()
    g = _guard(store)
    g._on_device_fault({"type": "device_fault", "gpu": None, "incident": {"code": "xid:79", "device": None}})
    assert not g._fencing.is_set()
    assert not g.kv.check(["migrate/1/req"]) and not g.kv.check(["migrate/1/lock"])


def test_a_second_fault_in_the_same_epoch_stops_the_job_with_76(no_exit, capsys):
    import torch.distributed as dist

    from torch_hooks import spare as sp
    from torch_hooks.guard import EXIT_REBUILD_FAILED

    store = dist.HashStore()
    g = _guard(store)
    sp.Spare(store, job="t", host="h9")
    kv = dist.PrefixStore("linkpass/t", store)
    sp.request_migration(kv, epoch=1, rank=5, world_size=6, step=1, rail=0, reason="first", host="h9", pid=1)
    with pytest.raises(_Exit) as ei:
        g._on_device_fault({"type": "device_fault", "gpu": 0, "incident": {"code": "xid:79"}})
    assert ei.value.args[0] == EXIT_REBUILD_FAILED
    err = capsys.readouterr().err
    assert "rank 5 is already migrating" in err and "NO SPARE" not in err
    assert "failed" in json.loads(kv.get("rebuild/1/rank/0"))  # the others' agreement ends at once
    assert sp.read_migration(kv, 1)["rank"] == 5


def test_a_fault_with_the_store_gone_says_so_and_exits_76_not_69(no_exit, capsys):
    import datetime

    import torch.distributed as dist

    from torch_hooks.guard import EXIT_REBUILD_FAILED

    port = _free_port()
    srv = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                            f"s = d.TCPStore('127.0.0.1', {port}, None, True, wait_for_workers=False); "
                            "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert srv.stdout.readline().strip() == b"up"
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        g = _guard(client)
        srv.kill()
        srv.wait(5)
        with pytest.raises(_Exit) as ei:
            g._on_device_fault({"type": "device_fault", "gpu": 0, "incident": {"code": "xid:79"}})
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(5)
        srv.stdout.close()
    assert ei.value.args[0] == EXIT_REBUILD_FAILED
    err = capsys.readouterr().err
    assert "store is unreachable" in err and "NO SPARE" not in err
