#!/usr/bin/env python3
"""Loss rate vs detection time vs false alarms: the real probe schedule, filter and engine on a
simulated clock (no sockets, no root, no sleeping).

    .venv/bin/python bench/loss_curve.py --trials 20 --soak-min 10 --json bench/results/loss_curve.json

What runs: host ``h0`` with ``--rails`` rails and ``--peers`` peers, the daemon's own pure code
(:class:`~linkpass.core.probe.Schedule` deciding what to send when, confirm trains included,
:class:`~linkpass.core.probe_filter.ProbeFilter`, :class:`~linkpass.core.engine.Engine`), fed by
a simulated prober that follows :mod:`linkpass.adapters.prober`'s rules: a probe's deadline is
one interval, a fast path that misses gets a confirm train until BFD's detection time (plus one
step) has passed since its last reply, outstanding probes of a path silent for that time are
lost at once, ``peer_elsewhere`` from the other rails' answers.  Each probe and each reply is
dropped with probability ``loss`` on the faulty rail (rail 0, to every peer: the ``loss:PCT``
fault of the emulated fabric drops that share in each direction, so a round trip is lost with
probability ``1 - (1 - loss)^2``); the other rails lose ``--base-loss`` each way.  RTT 50 us.
Passive paths (a peer's requests standing in for our probes) are not modelled: every path is
probed actively.

Figures, per setting and loss rate:

* ``detect_ms`` p50/p99: loss starts -> rail 0 DOWN in the engine's history, over ``--trials``
  seeded trials (a trial not detected within ``--timeout-s`` is a miss);
* ``downs_per_h``: rail DOWN transitions per hour of simulated time over a ``--soak-min`` run at
  that loss (false alarms where the loss is below ``lossy_loss``; loss 20 % and up is a fault,
  where they are the detections that recur after each hold-down).

Settings: ``bfd-only`` (the sequential test off: what main did), and ``p1=LOSSY_LOSS/a=LOSSY_ALPHA``
pairs of ``[probe] lossy_loss`` and ``lossy_alpha`` (healthy_loss 0.04 throughout).  Prints figures, never asserts them.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linkpass.config import parse_config, policy_from_config  # noqa: E402
from linkpass.core.engine import Engine  # noqa: E402
from linkpass.core.model import LinkFacts, LinkSnapshot, ProbeResult, PublishHistory, SetTimer, Tick  # noqa: E402
from linkpass.core.probe import Schedule  # noqa: E402
from linkpass.core.probe_filter import ProbeFilter  # noqa: E402

MS = 1_000_000
S = 1_000 * MS
RTT_NS = 50_000
SCHEMA = "linkpass.bench.loss_curve/v1"
#: name -> (lossy_loss, lossy_alpha); None: the sequential test off (BFD's rule alone)
SETTINGS = {"bfd-only": None, "p1=0.2/a=1e-9": (0.2, 1e-9), "p1=0.3/a=1e-9": (0.3, 1e-9),
            "p1=0.3/a=1e-7": (0.3, 1e-7), "p1=0.3/a=1e-6": (0.3, 1e-6), "p1=0.3/a=1e-5": (0.3, 1e-5)}


def config_text(rails: int, peers: int, interval_ms: int, multiplier: int, hold_down_ms: int) -> str:
    lines = ["[daemon]", 'host = "h0"', 'mode = "host-ip"', 'host_ip = "198.19.0.1"', f"hold_down_ms = {hold_down_ms}", ""]
    for r in range(rails):
        lines += ["[[rails]]", f"id = {r}", f'netdev = "rail{r}"', f'address = "198.18.{r}.1"', ""]
    for i in range(1, peers + 1):
        ips = ", ".join(f'"{r}" = "198.18.{r}.{i + 1}"' for r in range(rails))
        lines += ["[[peers]]", f'name = "h{i}"', f'host_ip = "198.19.0.{i + 1}"', f"rail_ips = {{ {ips} }}", ""]
    lines += ["[probe]", f"interval_ms = {interval_ms}", f"detect_multiplier = {multiplier}", "", "[damping]", "enabled = false", ""]
    return "\n".join(lines)


class Sim:
    """One host's probing and decisions on a simulated clock.

    Args:
        policy: the engine policy (its ``probe`` settings drive the schedule and the tests).
        seed: of the loss draws.
        loss: rail id -> share dropped in each direction (0..1), changed with :meth:`set_loss`.
    """

    def __init__(self, policy, seed: int, rails: int, peers: list[str]):
        self.policy = policy
        self.rng = random.Random(seed)
        pc = policy.probe
        self.interval_ns = pc.interval_ms * MS
        self.detect_ns = pc.detect_multiplier * self.interval_ns
        self.schedule = Schedule(interval_ns=self.interval_ns, slow_interval_ns=pc.slow_interval_ms * MS, fast_peers=2,
                                 max_pps=2000, paths={r: peers for r in range(rails)}, now_ns=0)
        self.engine = Engine(policy)
        self.inbox: list = []
        self.filter = ProbeFilter(pc, self.inbox.append)
        self.loss = {r: 0.0 for r in range(rails)}
        self.pending: dict[int, tuple[int, str, int, int, bool]] = {}  # seq -> rail, peer, sent, deadline, fast
        self.deadlines: list[tuple[int, int]] = []
        self.replies: list[tuple[int, int]] = []  # (arrival ns, seq)
        self.last_ok: dict[tuple[int, str], int] = {}
        self.silenced: dict[tuple[int, str], int] = {}
        self.timer: int | None = None
        self.seq = 0
        self.now = 0
        self.history: list = []
        self.results = 0
        self.decide(LinkSnapshot(tuple(LinkFacts(f"rail{r}", True, True, True, "UP") for r in range(rails)), 0))

    def set_loss(self, rail: int, loss: float) -> None:
        self.loss[rail] = loss

    def decide(self, ev) -> None:
        for a in self.engine.handle(ev, self.now):
            if isinstance(a, SetTimer):
                self.timer = a.at_ns
            elif isinstance(a, PublishHistory):
                self.history.extend(a.entries)

    def post(self, ev) -> None:
        self.results += 1
        self.filter(ev)
        while self.inbox:
            self.decide(self.inbox.pop(0))

    def _send(self, rail: int, peer: str, fast: bool, timeout_ns: int) -> None:
        self.seq += 1
        self.pending[self.seq] = (rail, peer, self.now, self.now + timeout_ns, fast)
        heapq.heappush(self.deadlines, (self.now + timeout_ns, self.seq))
        lost = self.loss[rail]
        if self.rng.random() >= lost and self.rng.random() >= lost:
            heapq.heappush(self.replies, (self.now + RTT_NS, self.seq))

    def _miss(self, seq: int) -> None:
        rail, peer, sent, _, fast = self.pending.pop(seq)
        key = (rail, peer)
        if fast and key in self.last_ok:
            self.schedule.confirm(rail, peer, self.now, self.last_ok[key] + self.detect_ns + self.schedule.confirm_step_ns)
        others = [self.last_ok.get((r, peer), -1) for r in self.loss if r != rail]
        elsewhere = None if not others else any(t >= sent for t in others)
        self.post(ProbeResult(rail, peer, False, self.now, None, seq, peer_elsewhere=elsewhere))

    def run_until(self, t_end: int) -> None:
        while True:
            nxt = [t_end, self.schedule.next_tick_ns]
            if self.replies:
                nxt.append(self.replies[0][0])
            while self.deadlines and self.deadlines[0][1] not in self.pending:
                heapq.heappop(self.deadlines)
            if self.deadlines:
                nxt.append(self.deadlines[0][0])
            if self.timer is not None:
                nxt.append(self.timer)
            now = min(nxt)
            if now >= t_end:
                self.now = t_end
                return
            self.now = now
            while self.replies and self.replies[0][0] <= now:
                _, seq = heapq.heappop(self.replies)
                p = self.pending.pop(seq, None)
                if p is None:
                    continue
                key = (p[0], p[1])
                self.last_ok[key] = now
                self.schedule.settle(*key)
                self.post(ProbeResult(p[0], p[1], True, now, now - p[2], seq))
            while self.deadlines and self.deadlines[0][0] <= now:
                _, seq = heapq.heappop(self.deadlines)
                if seq in self.pending:
                    self._miss(seq)
            for key in self.schedule.confirming():
                t_ok = self.last_ok.get(key)
                if t_ok is not None and now >= t_ok + self.detect_ns and self.silenced.get(key) != t_ok:
                    self.silenced[key] = t_ok
                    for seq in sorted(s for s, p in self.pending.items() if (p[0], p[1]) == key):
                        self._miss(seq)
            if self.timer is not None and now >= self.timer:
                self.timer = None
                self.decide(Tick(now))
            for s in self.schedule.poll(now):
                self._send(s.rail, s.peer, s.fast, s.timeout_ns)

    def rail_downs(self, rail: int | None, after_ns: int = 0) -> list[int]:
        return [e.t_ns for e in self.history if e.kind == "rail" and e.data["new"] == "DOWN" and e.t_ns >= after_ns
                and (rail is None or e.data["rail"] == rail)]


def make_sim(policy, seed: int, args, peers: list[str], test_on: bool = True) -> Sim:
    sim = Sim(policy, seed=seed, rails=args.rails, peers=peers)
    if not test_on:
        sim.filter._test = lambda key, ev: None  # the sequential test off: BFD's rule alone
    return sim


def bfdd_model(loss: float, trials: int, timeout_ms: float, seed: int = 1, interval_ms: float = 10.0, multiplier: int = 3) -> dict:
    """What FRR bfdd would do (a model from its source, not a measurement): each end sends a
    control packet every interval jittered to 75..100 % (bfd.c ptm_bfd_start_xmt_timer, RFC 5880
    6.8.7), restarts its detection timer of multiplier x interval on every packet received
    (bfd_packet.c -> bfd_recvtimer_update) and goes Down when it fires; an end that receives the
    other's Down goes Down too (bfd.c bs_up_handler), else its own timer fires within one
    detection time, the other end having fallen back to 1 s packets.  Time from the loss's start
    to the cut host's session Down; none within ``timeout_ms`` is a miss."""
    rng = random.Random(seed)
    interval, detect = float(interval_ms), float(multiplier * interval_ms)

    def first_gap() -> float:
        t, last_rx = rng.uniform(0, interval), 0.0
        while t < timeout_ms + detect:
            if t - last_rx > detect:
                return last_rx + detect
            if rng.random() >= loss:
                last_rx = t
            t += interval * rng.uniform(0.75, 1.0)
        return math.inf

    xs, misses = [], 0
    for _ in range(trials):
        mine, theirs = first_gap(), first_gap()
        told = rng.uniform(0, interval) if rng.random() >= loss else detect
        x = min(mine, theirs + told)
        if x <= timeout_ms:
            xs.append(x)
        else:
            misses += 1
    return {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "max": max(xs) if xs else None, "misses": misses}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def policy_for(args, setting: tuple[float, float] | None):
    pol = policy_from_config(parse_config(config_text(args.rails, args.peers, args.interval_ms, args.multiplier, args.hold_down_ms), "sim.toml"))
    if setting is None:
        return pol
    return replace(pol, probe=replace(pol.probe, lossy_loss=setting[0], lossy_alpha=setting[1]))


def detect_trials(args, policy, loss: float, test_on: bool) -> dict:
    peers = [f"h{i}" for i in range(1, args.peers + 1)]
    times, misses = [], 0
    for k in range(args.trials):
        sim = make_sim(policy, 1000 * k + int(loss * 1000), args, peers, test_on)
        for r in range(1, args.rails):
            sim.set_loss(r, args.base_loss)
        t_cut = S + sim.rng.randrange(0, args.interval_ms * MS)  # the fault starts anywhere in a probe interval
        sim.run_until(t_cut)
        sim.set_loss(0, loss)
        sim.run_until(t_cut + int(args.timeout_s * S))
        d = sim.rail_downs(0, t_cut)
        if d:
            times.append((d[0] - t_cut) / MS)
        else:
            misses += 1
    return {"n": len(times), "p50": pct(times, 0.5), "p99": pct(times, 0.99), "max": max(times) if times else None, "misses": misses}


def soak(args, policy, loss: float, test_on: bool) -> dict:
    peers = [f"h{i}" for i in range(1, args.peers + 1)]
    sim = make_sim(policy, 7 + int(loss * 1000), args, peers, test_on)
    for r in range(1, args.rails):
        sim.set_loss(r, args.base_loss)
    sim.set_loss(0, loss)
    t_end = int(args.soak_min * 60 * S)
    sim.run_until(t_end)
    downs = sim.rail_downs(None)
    return {"sim_s": args.soak_min * 60, "rail_downs": len(downs), "downs_per_h": round(len(downs) * 60 / args.soak_min, 2),
            "results": sim.results}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--losses", default="1,2,5,10,20,30,50", help="per-direction loss rates in %% (default 1,2,5,10,20,30,50)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=10.0, help="a fault not detected in this time is a miss (default 10)")
    ap.add_argument("--soak-min", type=float, default=10.0, help="simulated minutes per soak run (default 10; 0: none)")
    ap.add_argument("--soak-max-loss", type=float, default=10.0, help="soak only loss rates up to this %% (default 10)")
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--peers", type=int, default=1)
    ap.add_argument("--interval-ms", type=int, default=10)
    ap.add_argument("--multiplier", type=int, default=3)
    ap.add_argument("--hold-down-ms", type=int, default=200)
    ap.add_argument("--base-loss", type=float, default=0.0, help="per-direction loss of the other rails, 0..1 (default 0)")
    ap.add_argument("--model-trials", type=int, default=2000, help="trials of the bfdd model per loss rate (default 2000)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    try:
        losses = [float(x) / 100 for x in args.losses.split(",") if x.strip()]
    except ValueError:
        print(f"loss_curve: --losses must be comma-separated numbers, got {args.losses!r}", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [n for n in names if n not in SETTINGS]
    if bad or not losses or any(not 0 <= x < 1 for x in losses) or args.trials < 1 or args.rails < 2 or args.peers < 1:
        print(f"loss_curve: unknown setting(s) {bad} (known: {list(SETTINGS)}), or losses outside 0..100 %, "
              "or --trials < 1, --rails < 2, --peers < 1", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # the engine's own warnings, thousands over a soak
    t0 = time.monotonic()
    rows = []
    for loss in losses:
        if loss > 0:
            b = bfdd_model(loss, args.model_trials, args.timeout_s * 1000, interval_ms=args.interval_ms, multiplier=args.multiplier)
            rows.append({"setting": "bfdd model", "loss_pct": round(loss * 100, 3), "round_trip_loss": round(1 - (1 - loss) ** 2, 4),
                         "detect_ms": b})
            f = (lambda x: "       -" if x is None else f"{x:8.1f}")
            print(f"{'bfdd model':22s} loss {loss * 100:5.1f} % (rt {rows[-1]['round_trip_loss'] * 100:5.1f} %): detect p50 {f(b['p50'])} "
                  f"p99 {f(b['p99'])} ms, misses {b['misses']}/{args.model_trials}", flush=True)
    for name in names:
        pol = policy_for(args, SETTINGS[name])
        for loss in losses:
            row = {"setting": name, "loss_pct": round(loss * 100, 3), "round_trip_loss": round(1 - (1 - loss) ** 2, 4),
                   "detect_ms": detect_trials(args, pol, loss, SETTINGS[name] is not None)}
            if args.soak_min > 0 and loss * 100 <= args.soak_max_loss:
                row["soak"] = soak(args, pol, loss, SETTINGS[name] is not None)
            rows.append(row)
            d, sk = row["detect_ms"], row.get("soak")
            f = (lambda x: "-" if x is None else f"{x:8.1f}")
            print(f"{name:22s} loss {loss * 100:5.1f} % (rt {row['round_trip_loss'] * 100:5.1f} %): detect p50 {f(d['p50'])} "
                  f"p99 {f(d['p99'])} ms, misses {d['misses']}/{args.trials}"
                  + (f", rail DOWNs/h {sk['downs_per_h']} ({sk['rail_downs']} in {sk['sim_s'] / 60:g} min)" if sk else ""), flush=True)
    out = {"schema": SCHEMA, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "loadavg": list(os.getloadavg()), "wall_s": round(time.monotonic() - t0, 1),
           "params": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
