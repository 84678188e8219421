#!/usr/bin/env python3
"""CPU per datagram of the prober's Python work, in a tight loop: the real
:class:`~linkpass.adapters.prober.Prober` (C datapath) in front of the real
:class:`~linkpass.core.probe_filter.ProbeFilter`, on a simulated clock, with one real UDP
socket on 127.0.0.1 that the probes are sent to (no root, no namespaces).

    .venv/bin/python bench/probe_hotpath.py --json bench/results/probe_hotpath.json
    .venv/bin/python bench/probe_hotpath.py --against OLD_CHECKOUT   # the same, for another tree

Host ``h0`` with 8 rails and 4 peers (``fast_peers`` 4), as in the 5 x 8 soak:

* ``sender``: each timer turn (``Prober._tick``: deadlines, the schedule, the sends) and then
  every probe's reply as a ``recv_batch`` item (``Prober._handle_native``); figures per probe
  sent (``send_us``; ``send_python_us`` with the C send replaced by a no-op: the kernel's share
  is the difference) and per reply (``reply_us``);
* ``passive``: host ``h9``, whose peers all probe it: every path's request, answered by the C
  responder thread, arrives as a proof item each 10 ms; ``proof_us`` per proof, the turn
  included.

This is the interpreter's work with the data in cache: inside a running daemon every wake-up
finds it out of cache, and the same work costs 2-4x as much (bench/README.md).  The daemon's
CPU is measured by ``soak.py``.  Best of ``--repeat`` runs (this VM's neighbours add noise, never
remove it).  Prints figures, never asserts them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

MS = 1_000_000
KEY = b"linkpass-bench-key-0123456789abcdef"
PEERS = ["h1", "h2", "h3", "h4"]


def _config(host: str, port: int):
    from linkpass.config import parse_config

    rails = "".join(f'[[rails]]\nid = {r}\nnetdev = "rail{r}"\naddress = "198.18.{r}.1"\n' for r in range(8))
    peers = "".join(
        f'[[peers]]\nname = "{p}"\nrail_ips = {{ '
        + ", ".join(f'"{r}" = "198.18.{r}.{i + 2}"' for r in range(8)) + " }\n"
        for i, p in enumerate(PEERS))
    return parse_config(f'[daemon]\nhost = "{host}"\nmode = "per-rail-ip"\n{rails}{peers}'
                        f'[probe]\nfast_peers = 4\nport = {port}\ndatapath = "c"\n')


def _prober(host: str):
    from linkpass.adapters.prober import Prober
    from linkpass.config import probe_policy
    from linkpass.core.probe_filter import ProbeFilter

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.setblocking(False)
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    out.bind(("127.0.0.1", 0))
    cfg = _config(host, sink.getsockname()[1])
    clock = [1_000 * MS]
    events: list = []
    pr = Prober(cfg, KEY, ProbeFilter(probe_policy(cfg.probe), events.append, {r.netdev: r.id for r in cfg.rails}),
                clock=lambda: clock[0])
    pr._rail_sock = lambda rid: out  # the rails' sockets need their netdevs; every probe leaves here
    pr._rail_socks = {r.id: out for r in cfg.rails}
    pr._peer_ip = lambda rail, peer: "127.0.0.1"
    return pr, clock, sink


def _drain(sink: socket.socket) -> None:
    try:
        while True:
            sink.recv(512)
    except BlockingIOError:
        pass


def sender(turns: int, c_send: bool) -> dict:
    from linkpass.adapters import prober as P
    from linkpass.core import probe as wire

    real = P.native_io.send_probe
    if not c_send:
        P.native_io.send_probe = lambda *a: 0
    try:
        pr, clock, sink = _prober("h0")
        t_send = t_reply = sent = replies = 0
        for i in range(turns + 50):
            a = time.perf_counter_ns()
            pr._tick()
            b = time.perf_counter_ns()
            pend = list(pr.guard._pending.values())
            clock[0] += 300_000
            items = [(wire.REPLY, p.peer, p.rail, p.seq, p.sent_ns, 0, ("127.0.0.1", 7472), p.sent_ns + 100_000)
                     for p in pend]
            c = time.perf_counter_ns()
            pr._handle_native(items, 0)
            d = time.perf_counter_ns()
            if i >= 50:  # warm-up turns left out
                t_send += b - a
                t_reply += d - c
                sent += len(pend)
                replies += len(items)
            clock[0] = max(clock[0], pr.schedule.next_tick_ns)
            _drain(sink)
        return {"send_us": t_send / max(sent, 1) / 1e3, "reply_us": t_reply / max(replies, 1) / 1e3, "probes": sent,
                "replies": replies, "timeouts": pr.counters["timeouts"]}
    finally:
        P.native_io.send_probe = real


def passive(turns: int) -> dict:
    from linkpass.adapters.prober import _ANSWERED_ITEM

    pr, clock, _sink = _prober("h9")
    seq: dict = {}
    total = n = warm_ok = 0
    for i in range(turns + 50):
        items = []
        for peer in PEERS:
            for r in range(8):
                s = seq.get((r, peer), 0) + 1
                seq[(r, peer)] = s
                items.append((_ANSWERED_ITEM, peer, r, s, clock[0], s - 1, ("127.0.0.1", 7472), clock[0]))
        a = time.perf_counter_ns()
        pr._handle_native(items, 0)
        pr._tick()
        b = time.perf_counter_ns()
        if i >= 50:
            total += b - a
            n += len(items)
        elif i == 49:
            warm_ok = pr.counters["passive_ok"]
        clock[0] += 10 * MS
    return {"proof_us": total / max(n, 1) / 1e3, "proofs": n, "passive_ok": pr.counters["passive_ok"] - warm_ok}


def measure(turns: int, repeat: int) -> dict:
    best: dict = {}
    for _ in range(repeat):
        s, s_py, p = sender(turns, True), sender(turns, False), passive(turns)
        row = {"send_us": s["send_us"], "send_python_us": s_py["send_us"], "reply_us": s["reply_us"],
               "proof_us": p["proof_us"], "probes": s["probes"], "replies": s["replies"], "proofs": p["proofs"],
               "passive_ok": p["passive_ok"]}
        for k, v in row.items():
            best[k] = v if k not in best or not k.endswith("_us") else min(best[k], v)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in best.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=2000, help="timer turns per run (default 2000: 20 s of probing)")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the best of each figure is kept (default 3)")
    ap.add_argument("--against", metavar="DIR", help="measure the checkout in DIR instead (its C module built)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    root = Path(args.against).resolve() if args.against else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    import logging

    import linkpass

    if not Path(linkpass.__file__).resolve().is_relative_to(root):
        print(f"probe_hotpath: linkpass comes from {linkpass.__file__}, not from {root} (is {root} a linkpass "
              "checkout?)", file=sys.stderr)
        return 2
    from linkpass.adapters import prober

    if prober.native_io is None:
        print(f"probe_hotpath: the C datapath (linkpass/adapters/_probe_io.c) is not built in {root}: build it "
              "(make install, or pip install -e . there) and run again", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)
    r = measure(args.turns, args.repeat)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    out = {"schema": 1, "date": datetime.date.today().isoformat(), "commit": commit or None,
           "command": " ".join(["bench/probe_hotpath.py", *sys.argv[1:]]), "tree": str(root), **r}
    print(f"{commit or root}: per probe sent {r['send_us']} us ({r['send_python_us']} us without the C send), per reply "
          f"{r['reply_us']} us, per passive proof {r['proof_us']} us ({r['probes']} probes, {r['replies']} replies, "
          f"{r['proofs']} proofs)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
