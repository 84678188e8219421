"""The prober on the emulated fabric: one Prober per host namespace, real UDP over real rails.

One run covers the healthy fabric, a blackholed rail (carrier stays up, only the probes can
tell), random loss, and forged datagrams; every prober prints each ProbeResult as it posts it,
then its stats.  Each phase lasts until the probers have posted the results it needs (waited
for with a bound), and the checks read the results by monotonic time (one clock for all
namespaces): they assert what the probes saw in each phase, never how long anything took (the
detection and recovery figures are bench/detect_reroute.py's).  Needs root, `ip` and `nft`;
skipped otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time

import pytest

from linkpass.lab import fabric as fab

from ..wait import wait_until

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("ip", "nft")), reason="needs ip and nft"),
]

MS = 1_000_000
INTERVAL_MS = 10  # the [probe] default the fabric's configs get

#: Runs a Prober until stdin closes (reloading its config on each line); prints {"ready": t},
#: each posted event as it is posted, then the stats.
RUNNER = r"""
import asyncio, dataclasses, json, resource, sys, time
from linkpass.adapters.prober import Prober
from linkpass.config import load_config, read_key_file

async def main():
    cfg, key = load_config(sys.argv[1]), read_key_file(sys.argv[2])
    def post(ev):
        print(json.dumps(dataclasses.asdict(ev)), flush=True)
    pr = Prober(cfg, key, post)
    await pr.start()
    task = asyncio.create_task(pr.run())
    ru0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    print(json.dumps({"ready": time.monotonic_ns()}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):  # "reload" lines, then EOF
        pr.reconfigure(load_config(sys.argv[1]), read_key_file(sys.argv[2]))
        pr.set_priority_peers([p.name for p in pr.cfg.peers])
    ru1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await pr.close()
    await task
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    print(json.dumps({"stats": pr.stats(), "cpu_s": cpu, "wall_s": w1 - w0}), flush=True)

asyncio.run(main())
"""

FORGER = r"""
import os, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from linkpass.core.probe import Probe, REQUEST, REPLY, encode
for i in range(n):
    s.sendto(encode(Probe(REQUEST if i % 2 else REPLY, "h1", "h0", 0, i, i), b"wrong key, wrong key!"), (ip, port))
for size in (0, 1, 66, 100, 194, 1400):
    s.sendto(b"LPP2" + os.urandom(max(0, size - 4)) if size >= 4 else os.urandom(size), (ip, port))
"""
FORGED = 20


class _Run:
    """One prober in a host namespace; a thread collects the results it prints as it posts them."""

    def __init__(self, ns: str, cfg: str, key: str):
        self.p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", RUNNER, cfg, key],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for x in self.p.stdout:
            if x.strip():
                d = json.loads(x)
                if "ready" in d:
                    self.ready.set()
                else:
                    self.lines.append(d)

    @property
    def events(self) -> list[dict]:
        return [x for x in list(self.lines) if "rail" in x]

    def count(self, rail: int, peer: str, since_ns: int, ok: bool | None = None) -> int:
        return sum(1 for e in self.events if e["rail"] == rail and e["peer"] == peer and e["t_ns"] >= since_ns
                   and (ok is None or e["ok"] == ok))

    def finish(self) -> tuple[list[dict], dict]:
        self.p.stdin.close()
        self.p.wait(timeout=20)
        self.reader.join(20)
        err = self.p.stderr.read()
        assert self.p.returncode == 0, f"prober failed ({self.p.returncode}): {err[-2000:]}"
        return self.events, next(x for x in self.lines if "stats" in x)


def _between(evs: list[dict], rail: int, t0: int, t1: int) -> list[dict]:
    return [e for e in evs if e["rail"] == rail and e["peer"] == "h1" and t0 <= e["t_ns"] < t1]


#: BFD's detect multiplier in the fabric's configs: this many consecutive misses declare a path down
DETECT_MULT = 3


def _healthy(w: list[dict], n_min: int) -> list[str]:
    """What is wrong with the results ``w`` of one path over a window where the fabric was healthy.

    A healthy path gives at least ``n_min`` results, and its misses are rare (at most 1 in 20)
    and never ``DETECT_MULT`` in a row, so BFD's rule never fires.  Not "no miss at all": on two
    cores, a responder descheduled for longer than the 10 ms interval answers late, and the
    prober rightly reports that probe as missed (its own lateness it voids, the peer's it cannot
    see); the probe filter and the detection rule are what keep such a miss from costing a rail.
    """
    bad = []
    if len(w) < n_min:
        bad.append(f"{len(w)} results, wanted >= {n_min}")
    misses = [e for e in w if not e["ok"]]
    if len(misses) * 20 > len(w):
        bad.append(f"{len(misses)} misses of {len(w)}: {misses[:5]}")
    run = 0
    for e in sorted(w, key=lambda e: e["t_ns"]):
        run = 0 if e["ok"] else run + 1
        if run >= DETECT_MULT:
            bad.append(f"{DETECT_MULT} misses in a row ending {e}")
            break
    bad += [f"ok without an RTT > 0: {e}" for e in w if e["ok"] and e["rtt_ns"] is not None and e["rtt_ns"] <= 0][:3]
    return bad


def _wait_results(runs: list["_Run"], since_ns: int, n: int, rails=(0, 1), what: str = "") -> None:
    """Until each prober posted ``n`` results for its peer on each of ``rails`` since ``since_ns``."""
    for i, r in enumerate(runs):
        peer = "h1" if i == 0 else "h0"
        for rail in rails:
            wait_until(lambda: r.count(rail, peer, since_ns) >= n, 20, f"h{i}: {n} results on rail {rail} ({what})")


@pytest.mark.parametrize("datapath", ["c", "python"])
def test_prober_on_the_fabric(datapath):
    name = "pr" + secrets.token_hex(4)
    runs: list[_Run] = []
    try:
        desc = fab.up(2, 2, name)
        key = desc["notice_key_file"]
        for h in desc["hosts"]:  # both datagram paths make the same decisions
            with open(h["config"], "a") as f:
                f.write(f'\n[probe]\ndatapath = "{datapath}"\n')
        for h in desc["hosts"]:
            runs.append(_Run(h["netns"], h["config"], key))
        for r in runs:  # wait until both run
            assert r.ready.wait(20), f"prober did not start: {r.p.stderr.read()[-2000:] if r.p.poll() is not None else ''}"
        t_start = time.monotonic_ns()
        _wait_results(runs, t_start + 50 * MS, 30, what="healthy")
        for r in runs:  # a config reload while probing loses nothing
            r.p.stdin.write("reload\n")
            r.p.stdin.flush()
        _wait_results(runs, time.monotonic_ns(), 30, what="healthy, after the reload")

        # what the daemon does in per-rail-ip mode when h1 thinks h0's rail 0 is gone: carry
        # h0's rail-0 address over rail 1.  h1's replies to h0's rail-0 probes must still go
        # back over rail 0 (or h0 could never see rail 0 recover).
        h0_rail0, h0_rail1 = (r["address"] for r in desc["hosts"][0]["rails"])
        h1ns = desc["hosts"][1]["netns"]
        route = [h0_rail0 + "/32", "via", h0_rail1, "dev", "rail1"]
        subprocess.run(["ip", "-n", h1ns, "route", "add", *route], check=True)
        t_rr0 = time.monotonic_ns()
        _wait_results(runs, t_rr0 + 5 * MS, 30, rails=(0,), what="h0's rail-0 address routed over rail 1 at h1")
        t_rr1 = time.monotonic_ns()
        subprocess.run(["ip", "-n", h1ns, "route", "del", *route], check=True)

        h0 = runs[0]
        blackhole = fab.cut(name, 1, 0, "blackhole")
        wait_until(lambda: h0.count(0, "h1", blackhole["t_done_ns"], ok=False), 20, "h0: a failed probe on rail 0 (blackhole)")
        first_fail = min(e["t_ns"] for e in _between(h0.events, 0, blackhole["t_done_ns"], 2**63) if not e["ok"])
        wait_until(lambda: h0.count(0, "h1", first_fail) >= 40, 20, "h0: 40 results on rail 0 after the first failure")
        wait_until(lambda: h0.count(1, "h1", blackhole["t_issued_ns"]) >= 40, 20, "h0: 40 results on rail 1 (blackhole)")
        healed1 = fab.heal(name, 1, 0)
        wait_until(lambda: h0.count(0, "h1", healed1["t_done_ns"], ok=True), 20, "h0: rail 0 answered again after the heal")

        lossy = fab.cut(name, 1, 0, "loss:30")
        wait_until(lambda: h0.count(0, "h1", lossy["t_done_ns"] + INTERVAL_MS * MS) >= 100, 30, "h0: 100 results on rail 0 (loss:30)")
        healed2 = fab.heal(name, 1, 0)
        wait_until(lambda: h0.count(0, "h1", healed2["t_done_ns"], ok=True), 20, "h0: rail 0 answered again after the second heal")

        subprocess.run(["ip", "netns", "exec", h1ns, sys.executable, "-c", FORGER, "198.18.0.1", "7472", str(FORGED)], check=True)
        t_forged = time.monotonic_ns()
        _wait_results(runs[:1], t_forged + 20 * MS, 20, what="after the forged datagrams")
        t_end = time.monotonic_ns()

        (ev0, st0), (ev1, st1) = (r.finish() for r in runs)
    finally:
        for r in runs:
            if r.p.poll() is None:
                r.p.kill()
                r.p.wait()
        fab.down(name)

    # ---- healthy (with a config reload half-way): the probes on both rails are answered, both
    # ways, with an RTT (h1, the larger name, is mostly passive: h0's acked requests prove its
    # paths, no RTT)
    for evs in (ev0, ev1):
        peer = "h1" if evs is ev0 else "h0"
        for rail in (0, 1):
            w = [e for e in evs if e["rail"] == rail and e["peer"] == peer and t_start + 50 * MS <= e["t_ns"] < t_rr0]
            assert not _healthy(w, 60), (peer, rail, _healthy(w, 60))

    # ---- a route of h1 carrying h0's rail-0 address over rail 1 changes nothing for the probes
    for evs in (ev0, ev1):
        peer = "h1" if evs is ev0 else "h0"
        w = [e for e in evs if e["rail"] == 0 and e["peer"] == peer and t_rr0 + 5 * MS <= e["t_ns"] < t_rr1]
        assert not _healthy(w, 30), (peer, _healthy(w, 30))

    # ---- blackhole on h1's rail-0 port: once h0 sees rail 0 fail, no probe on it succeeds until
    # the heal; rail 1 stays fine; rail 0 comes back after the heal
    bh_done = blackhole["t_done_ns"]
    during = _between(ev0, 0, first_fail, healed1["t_issued_ns"])
    assert len(during) >= 40 and not any(e["ok"] for e in during)
    other = _between(ev0, 1, blackhole["t_issued_ns"], healed1["t_done_ns"])
    assert not _healthy(other, 40), _healthy(other, 40)
    back = [e["t_ns"] for e in _between(ev0, 0, healed1["t_done_ns"], lossy["t_issued_ns"]) if e["ok"]]
    assert back, "rail 0 did not come back after heal"

    # ---- 30 % loss each way (about 51 % of round trips): some probes fail, some succeed
    lw = _between(ev0, 0, lossy["t_done_ns"] + INTERVAL_MS * MS, healed2["t_issued_ns"])
    lost = sum(not e["ok"] for e in lw) / len(lw)
    assert len(lw) >= 100 and 0.2 <= lost <= 0.85, (len(lw), lost)
    other = _between(ev0, 1, lossy["t_done_ns"], healed2["t_issued_ns"])
    assert not _healthy(other, 1), _healthy(other, 1)

    # ---- forged datagrams are counted and do not stop the prober
    c = st0["stats"]["counters"]
    # the wrong-key probes and the 100-byte "LPP2..." one fail the MAC; 0, 1 and 66 bytes are
    # too short; 194 and 1400 bytes too long
    assert (c["rejected_auth"], c.get("rejected_malformed", 0), c.get("rejected_oversized", 0)) == (FORGED + 1, 3, 2), c
    for rail in (0, 1):
        after = _between(ev0, rail, t_forged + 20 * MS, t_end)
        assert not _healthy(after, 20), (rail, _healthy(after, 20))

    # ---- stats: per path figures and counters that add up
    paths = {(p["rail"], p["peer"]): p for p in st0["stats"]["paths"]}
    assert set(paths) == {(0, "h1"), (1, "h1")} and all(p["fast"] for p in paths.values())
    assert st0["stats"]["priority_peers"] == ["h1"] and st1["stats"]["priority_peers"] == ["h0"]  # the reload ran
    assert paths[(1, "h1")]["loss"] <= 0.05 and paths[(1, "h1")]["ewma_rtt_us"] > 0, paths[(1, "h1")]  # as _healthy
    assert c["replies"] + c.get("passive_ok", 0) == sum(e["ok"] for e in ev0)
    assert c["timeouts"] + c.get("passive_misses", 0) == sum(not e["ok"] for e in ev0)
    assert c["answered"] >= st1["stats"]["counters"].get("replies", 0)
    # passive paths: h0 probes, h1 mostly answers; together about half the probes of two probers
    c1 = st1["stats"]["counters"]
    assert c1["passive"] > 2 * c1.get("sent", 0) and c["sent"] > 2 * c1.get("sent", 0), (c, c1)  # faults make h1 probe too
    print(f"\nprober CPU: h0 {100 * st0['cpu_s'] / st0['wall_s']:.1f} %, h1 {100 * st1['cpu_s'] / st1['wall_s']:.1f} % "
          f"of one core over {st0['wall_s']:.1f} s (2 rails x 1 peer at {INTERVAL_MS} ms, answering the peer's probes too); "
          f"blackhole reported {(first_fail - bh_done) / MS:.1f} ms after the cut, back {(back[0] - healed1['t_done_ns']) / MS:.1f} ms "
          f"after the heal; loss:30 -> {100 * lost:.0f} % of {len(lw)} probes lost")
