#!/usr/bin/env python3
"""One peer's bad port must not degrade our rail: the real probe filter and engine on a simulated
clock (no sockets, no root, no sleeping), with the one-path rule of the rail's loss ratio
(:meth:`linkpass.core.probe_filter.ProbeFilter._spread`) on and off.

    .venv/bin/python bench/one_bad_peer.py --json bench/results/one_bad_peer.json

What runs: host ``h0`` with 2 rails and ``--peers`` peers (2, 3, 4), every path probed every
10 ms (results fed to :class:`~linkpass.core.probe_filter.ProbeFilter` in front of
:class:`~linkpass.core.engine.Engine`, as in the daemon).  At a start time after the daemon's
start (10 ms to 3 s: the rail's 2 s loss window is not yet full early on), peer ``h1``'s rail-0
port goes bad: ``blackhole`` (every probe over it lost) or ``lossy`` (50 % of round trips lost);
every other path loses ``--base-loss`` of its round trips (0, 1 %, 3 %).  Our rail 0 is healthy.

Figures, per fault and rule setting, over every (start, peers, base loss, seed, probe order):

* ``flagged``: runs in which rail 0 was marked DEGRADED after the fault (a status flag and a log
  line);
* ``moved``: runs in which traffic to any peer left rail 0 as a DEGRADED rail, or a notice told
  the peers that rail 0 is unusable at our end (what harms the fabric: every host then stops
  using its rail 0 to us).

Prints figures, never asserts them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss_curve import config_text  # noqa: E402

from linkpass.config import parse_config, policy_from_config  # noqa: E402
from linkpass.core import probe_filter  # noqa: E402
from linkpass.core.engine import Engine  # noqa: E402
from linkpass.core.model import LinkFacts, LinkSnapshot, ProbeResult, SendNotice  # noqa: E402

MS = 1_000_000
SCHEMA = "linkpass.bench.one_bad_peer/v1"
STARTS_MS = (10, 30, 50, 80, 100, 150, 200, 300, 400, 600, 1000, 2000, 3000)


def run(fault: str, start_ms: int, peers: int, base: float, seed: int, order: int) -> tuple[bool, bool]:
    """One run; returns (flagged, moved)."""
    policy = policy_from_config(parse_config(config_text(2, peers, 10, 3, 300)))
    e = Engine(policy)
    moved = False

    def post(ev) -> None:
        nonlocal moved
        for a in e.handle(ev, ev.t_ns):
            if isinstance(a, SendNotice) and 0 not in a.usable:
                moved = True
        if e._avoided:
            moved = True

    e.handle(LinkSnapshot(tuple(LinkFacts(f"rail{r}", True, True, True, "UP") for r in range(2)), 0), 0)
    f = probe_filter.ProbeFilter(policy.probe, post)
    rng = random.Random(seed)
    names = [f"h{i}" for i in range(1, peers + 1)]
    if order:
        names.reverse()
    steps = start_ms // 10
    t = 0
    for i in range(steps + 60):  # 600 ms of fault: well past the path's death (20 misses)
        t += 10 * MS
        for p in names:
            for rail in (0, 1):
                bad = rail == 0 and p == "h1" and i >= steps
                q = (1.0 if fault == "blackhole" else 0.5) if bad else base
                ok = i == 0 or rng.random() >= q
                f(ProbeResult(rail, p, ok, t, rtt_ns=50_000 if ok else None, peer_elsewhere=None if ok else True))
    flagged = any(h.kind == "degraded" and h.data["rail"] == 0 and h.t_ns >= steps * 10 * MS for h in e.history)
    return flagged, moved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="2,3,4", help="peer counts, comma-separated (default 2,3,4)")
    ap.add_argument("--base-loss", default="0,0.01,0.03", help="round-trip loss of the other paths (default 0,0.01,0.03)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per setting (default 3)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the engine's per-transition log lines, thousands of them
    peers = [int(x) for x in args.peers.split(",")]
    bases = [float(x) for x in args.base_loss.split(",")]
    out: dict = {"schema": SCHEMA, "date": datetime.date.today().isoformat(),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None,
                 "command": " ".join(["bench/one_bad_peer.py", *sys.argv[1:]]), "results": []}
    z = probe_filter.OUTLIER_Z
    for fault in ("blackhole", "lossy"):
        for rule in ("on", "off"):
            probe_filter.OUTLIER_Z = z if rule == "on" else math.inf
            n = flagged = moved = 0
            for start in STARTS_MS:
                for p in peers:
                    for base in bases:
                        for seed in range(args.seeds):
                            for order in (0, 1):
                                fl, mv = run(fault, start, p, base, seed, order)
                                n += 1
                                flagged += fl
                                moved += mv
            row = {"fault": fault, "one_path_rule": rule, "runs": n, "flagged": flagged, "moved": moved}
            out["results"].append(row)
            print(f"{fault:9} rule {rule:3}: {n} runs, rail 0 flagged DEGRADED in {flagged}, traffic or notice moved off it in {moved}")
    probe_filter.OUTLIER_Z = z
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
