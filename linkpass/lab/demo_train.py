"""The demo's training job: data-parallel SGD on a small MLP with torch.distributed (gloo, CPU).

One process per host, started inside the host's network namespace by ``linkpass demo``::

    python -m linkpass.lab.demo_train --rank R --world-size W --master-addr 198.19.0.1 \
        --iface lp0 --steps 300 --out /run/.../rank0.json

Traffic is bound to the host IP: ``GLOO_SOCKET_IFNAME`` names the interface holding it, so
gloo binds its sockets to that address and the kernel routes them over whatever rail the
daemon's host-IP routes choose.  Everything is deterministic for a given ``--seed``: the
initial weights, each rank's synthetic batch at each step, and the reduction (gradients are
flattened into one tensor and all-reduced as a sum, then divided by the world size), so a run
that survives a rail cut must end with bit-identical weights to a fault-free run.

With ``--hook`` (``linkpass demo --scenario rebuild``) each step runs under
:class:`torch_hooks.guard.LinkPassGuard`: the TCPStore is at ``--master-addr``, the gloo group
is bound to ``--rail``'s interface (``--rail-ifaces``), and on a link-fault notice from the
local daemon it is rebuilt on another rail and the step replayed; ``rebuilds`` in the output
lists what the guard did.

With ``--spare`` (``linkpass demo --scenario device-fault``) the process is a hot spare: it
imports torch, builds the model, connects to the store and waits (up to ``--spare-wait-s``)
for an assignment (:class:`torch_hooks.spare.Spare`); when a rank's GPU fails it takes that
rank over (``LinkPassGuard(join=...)``), receives the state from a healthy replica and trains
on from the interrupted step.  Its output then has ``"spare": id`` and the rank it took; a
spare that was never needed exits 0 with ``"spare_unused": true`` and ``"retired"``: ``"timeout"``
(``--spare-wait-s`` passed) or ``"store-lost"`` (the job's store was unreachable for 5 s: the
job ended or its store died; one line on stderr says so, exit status 0 as well, since the
spare itself did nothing wrong and the end of a job looks the same).  ``--gpu`` is the local
GPU index the hook registers (the daemon sends a device fault to the clients on that GPU).

Output (``--out``), JSON: ``{"rank", "world_size", "steps", "steps_done", "step_ms": [...],
"step_end_ns": [...], "errors": [...], "weights_sha256", "loss_first", "loss_last"}``.
Progress (``--progress``): the number of finished steps, rewritten after each step.
Exit status: 0 when every step finished, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _serve_store(a) -> int:
    """Host the job's TCPStore (no rank, no model) until SIGTERM/SIGINT; returns 0.  With the
    store outside every rank, the rank on a failed GPU can be migrated whatever its number (the
    store dies with the process hosting it)."""
    import signal
    import threading

    import torch.distributed as dist

    store = dist.TCPStore(a.master_addr, a.master_port, None, True, timeout=datetime.timedelta(seconds=a.timeout_s),
                          wait_for_workers=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if a.progress:
        _write(a.progress, "ready")
    stop.wait()
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--iface", help="interface holding the host IP (sets GLOO_SOCKET_IFNAME)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep-ms", type=float, default=10.0, help="pause per step (paces the run)")
    p.add_argument("--progress", help="file to rewrite with the finished step count")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--hook", action="store_true", help="run each step under torch_hooks.guard.LinkPassGuard "
                   "(store at --master-addr, process group on --rail's interface, rebuilt on link faults)")
    p.add_argument("--rail-ifaces", default="", help="RAIL=IFACE,... for the guard, in order of preference")
    p.add_argument("--rail", type=int, default=0, help="rail of the first process group (with --hook)")
    p.add_argument("--hooks-socket", help="the local daemon's hooks socket (with --hook)")
    p.add_argument("--peers", default="", help="daemon host names of the other ranks, comma-separated (with --hook)")
    p.add_argument("--gpu", type=int, help="local GPU index registered with the daemon (with --hook)")
    p.add_argument("--host", help="this host's daemon name (spare assignment prefers the faulty rank's host)")
    p.add_argument("--spare", action="store_true", help="be a hot spare: wait for a rank to take over (with --hook)")
    p.add_argument("--rebuild-timeout-s", type=float, default=30.0,
                   help="how long the guard waits for every rank in a rebuild or migration before exiting 76")
    p.add_argument("--external-store", action="store_true",
                   help="no rank hosts the TCPStore: a --store-only process does (so any rank can be migrated)")
    p.add_argument("--store-only", action="store_true",
                   help="only host the job's TCPStore at --master-addr:--master-port until SIGTERM (what torchrun's "
                   "agent does); writes 'ready' to --progress once it listens")
    p.add_argument("--spare-wait-s", type=float, default=300.0, help="how long a spare waits for an assignment")
    a = p.parse_args(argv)
    if a.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = a.iface
    if a.spare and not a.hook:
        p.error("--spare needs --hook")

    import torch
    import torch.distributed as dist

    if a.store_only:
        return _serve_store(a)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    result = {"rank": a.rank, "world_size": a.world_size, "steps": a.steps, "steps_done": 0, "step_ms": [], "step_end_ns": [], "errors": []}
    guard = None
    if a.hook:
        from torch_hooks.guard import LinkPassGuard

        store = dist.TCPStore(a.master_addr, a.master_port, a.world_size, a.rank == 0 and not a.spare and not a.external_store,
                              timeout=datetime.timedelta(seconds=a.timeout_s))
        ifaces = {int(k): v for k, v in (kv.split("=", 1) for kv in a.rail_ifaces.split(",") if kv)}
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{a.master_addr}:{a.master_port}", rank=a.rank,
                                world_size=a.world_size, timeout=datetime.timedelta(seconds=a.timeout_s))
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target_w = torch.randn(64, 10, generator=torch.Generator().manual_seed(a.seed + 1))
    params = [q for q in model.parameters()]
    join = None
    if a.spare:
        from torch_hooks.spare import STORE_LOST_S, Spare

        sp = Spare(store, job="demo", host=a.host)
        result["spare"] = sp.id
        if a.progress:
            _write(a.progress, "0")
        join = sp.wait(a.spare_wait_s)
        store = sp.store  # a fresh connection when the first one broke while waiting
        if join is None:
            result["spare_unused"] = True
            result["retired"] = sp.retired
            if sp.retired == "store-lost":
                print(f"linkpass: spare {sp.id} retires: the job's store at {a.master_addr}:{a.master_port} has been "
                      f"unreachable for {STORE_LOST_S:.0f} s ({sp.store_error}); the job is over or its store died",
                      file=sys.stderr, flush=True)
            _write(a.out, json.dumps(result))
            return 0
        a.rank = result["rank"] = join.rank
    if a.hook:
        guard = LinkPassGuard(store, a.rank, a.world_size, rails=ifaces, rail=a.rail, state=[model, opt], job="demo",
                              peers=[x for x in a.peers.split(",") if x], hooks_socket=a.hooks_socket,
                              timeout=datetime.timedelta(seconds=a.timeout_s), gpu=a.gpu, host=a.host, join=join,
                              rebuild_timeout_s=a.rebuild_timeout_s)

    def train_step(step: int):
        g = torch.Generator().manual_seed(a.seed * 100_003 + step * 131 + a.rank)
        x = torch.randn(128, 64, generator=g)
        y = (x @ target_w).argmax(dim=1)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        if guard is not None:
            guard.all_reduce(flat)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= a.world_size
        off = 0
        for q in params:
            n = q.numel()
            q.grad.copy_(flat[off:off + n].view_as(q))
            off += n
        opt.step()
        return loss

    try:
        for step in range(guard.step_index if guard is not None else 0, a.steps):
            t0 = time.monotonic_ns()
            loss = guard.step(train_step, step) if guard is not None else train_step(step)
            t1 = time.monotonic_ns()
            result["step_ms"].append((t1 - t0) / 1e6)
            result["step_end_ns"].append(t1)
            result["steps_done"] = step + 1
            if step == 0:
                result["loss_first"] = loss.item()
            result["loss_last"] = loss.item()
            if a.progress:
                _write(a.progress, str(step + 1))
            if a.step_sleep_ms > 0:
                time.sleep(a.step_sleep_ms / 1000)
    except Exception as e:  # a failed collective ends the run; the demo reports steps lost
        result["errors"].append(f"step {result['steps_done']}: {type(e).__name__}: {e}")
        result["error_t_ns"] = time.monotonic_ns()
    if guard is not None:
        result["rebuilds"] = guard.events
        guard.close()
    h = hashlib.sha256()
    for q in params:
        h.update(q.detach().contiguous().numpy().tobytes())
    result["weights_sha256"] = h.hexdigest()
    _write(a.out, json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0 if result["steps_done"] == a.steps else 1


if __name__ == "__main__":
    sys.exit(main())
