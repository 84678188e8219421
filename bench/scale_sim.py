#!/usr/bin/env python3
"""Scale simulation: the real probe schedule, probe filter and engine of many hosts on a simulated clock.

    .venv/bin/python bench/scale_sim.py --hosts 1024,16384 --json bench/results/scale_sim.json
    # or: linkpass bench scale --hosts 1024,16384 --json FILE

Per cluster size H (8 rails per host, per-rail-IP addressing from 198.18.0.0/15, every host a peer
of every other, the ``[probe]``, ``[daemon]`` and ``[damping]`` defaults) one rail of one host X is
faulted at t = 0 (``--fault blackhole``: carrier stays up, every packet through X's port on that
rail is dropped; ``--fault loss:PCT``: each direction loses PCT % of packets there).  Simulated per
host, on one simulated clock (ns):

* the real :class:`linkpass.core.probe.Schedule` (fast set from the real
  :func:`linkpass.adapters.prober.ring_order`, slow sweep, token bucket, confirm trains);
* a stand-in for the prober's socket side (this file): a probe is answered after ``--rtt-us``
  unless the network drops it; a miss is reported at its deadline with ``peer_elsewhere`` worked out
  as the prober does (answered on another rail since the probe left, within two intervals);
* the real :class:`linkpass.core.probe_filter.ProbeFilter` over every result (healthy ones
  included: they make up the rail loss ratio);
* the real :class:`linkpass.core.engine.Engine`, fed what the filter passes on, peer notices and
  its own timers.  A rail fault is *detected* at a peer when the engine applies routes that carry
  X's address on the faulted rail over another rail; at X when the rail leaves
  ``Engine.local_usable()`` or is in ``Engine.avoided_degraded()``.
* notices: the real engine's ``SendNotice`` is delivered to each simulated peer after the time the
  real :meth:`linkpass.adapters.notices.NoticeService.send` loop takes to reach that peer (its
  position in the loop x the measured cost of one send) plus one-way latency.

Sampling (16,384 full engines do not fit one core's five minutes): X, X's two ring neighbours
(the hosts that probe X fast) and ``--sample`` other hosts drawn uniformly with ``--seed``.  A
peer's detection time depends only on where X falls in its slow sweep, and the sweep order is the
ring order by SHA-256 of the names, so a uniform draw of peers is a uniform draw of that position;
``sweep_s`` x 2..3 bounds it for every host (printed next to the sample).  Above
``--full-engine-max`` hosts (default 65,536: X's real engine runs at every size simulated in
deploy/SCALING.md; before the engine kept per-rail counts a result cost a scan of the rail's
paths and this was 2,048) X's engine is not fed every result; its ``PathHealth`` objects are updated the way
``Engine._on_probe`` updates them and the real ``Engine._probe_verdict`` is asked once per
simulated second; when it fails the rail, the sim sends X's notice itself (the real engine sends an
urgent ``SendNotice`` when its usable rails change).  ``verdict_mode`` in the JSON says which.

Simplifications, all of them on the side of detecting sooner: passive paths (the ring neighbour
with the larger name leaves its regular fast probe out while the other's requests prove the path)
are counted as left out but judged as if probed (the real prober judges them 0.5 interval later);
the prober's silence rule (outstanding probes lost at BFD's detection time) is left out (misses
come at their deadlines, up to one confirm step later); no CPU contention, no loop lag.

Per-packet and per-event CPU is measured here with ``time.process_time`` on the real code:
``core/probe.py`` encode/decode with HMAC-SHA256, the request and reply guards, a UDP
``sendto``/``recvfrom`` pair on 127.0.0.1, the filter per result, the engine per forwarded result
with all ``8 x (H-1)`` paths known, ``NoticeService.send`` per datagram and ``on_datagram`` per
datagram.  CPU per host = rates from the simulation x those costs (kernel softirq work beyond the
syscalls is not included).
"""

from __future__ import annotations

import argparse
import heapq
import ipaddress
import json
import logging
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from linkpass.adapters.notices import NoticeService, refresh_period_s
from linkpass.adapters.prober import ring_order
from linkpass.config.policy import damping_policy, probe_policy
from linkpass.config.schema import DaemonSection, DampingSection, ProbeSection
from linkpass.core import notice as nwire
from linkpass.core import probe as pwire
from linkpass.core.engine import Engine
from linkpass.core.model import (ApplyRoutes, LinkFacts, LinkSnapshot, PeerRails, ProbeLoss, ProbeResult, SendNotice,
                                 SetTimer, Tick)
from linkpass.core.policy import EnginePolicy, HostPolicy, PeerPolicy, RailPolicy
from linkpass.core.probe_filter import ProbeFilter

PROG = "bench/scale_sim.py"
MS = 1_000_000
S = 1_000_000_000
KEY = b"scale-sim-key-0123456789abcdef!!"
ADDR_BASE = int(ipaddress.IPv4Address("198.18.0.0"))
ADDR_SPACE = 1 << 17  # 198.18.0.0/15


def host_name(i: int) -> str:
    """Host ``i``'s name (14 bytes at 16,384 hosts, like ``gpu-node-16383``)."""
    return f"gpu-node-{i}"


def rail_addr(rail: int, i: int, hosts: int) -> str:
    """Host ``i``'s address on ``rail``: 198.18.0.0 + rail x hosts + i.

    Raises:
        ValueError: rails x hosts does not fit 198.18.0.0/15 (131,072 addresses).
    """
    n = rail * hosts + i
    if not 0 <= n < ADDR_SPACE or not 0 <= i < hosts:
        raise ValueError(f"rail {rail} host {i} of {hosts}: outside 198.18.0.0/15")
    return str(ipaddress.IPv4Address(ADDR_BASE + n))


@dataclass(frozen=True)
class Fault:
    """``kind`` ``blackhole`` or ``loss`` (``loss``: share dropped per direction) on ``rail`` of host
    index ``host``, from ``at_ns``."""

    kind: str
    host: int
    rail: int
    loss: float = 0.0
    at_ns: int = 0


def parse_fault(text: str) -> tuple[str, float]:
    """``blackhole`` or ``loss:PCT`` -> (kind, share lost per direction).

    Raises:
        ValueError: anything else, naming the text.
    """
    if text == "blackhole":
        return "blackhole", 1.0
    if text.startswith("loss:"):
        try:
            pct = float(text[5:])
        except ValueError:
            raise ValueError(f"--fault {text!r}: PCT after 'loss:' is not a number") from None
        if not 0 < pct < 100:
            raise ValueError(f"--fault {text!r}: PCT must be between 0 and 100 (exclusive)")
        return "loss", pct / 100
    raise ValueError(f"--fault {text!r}: expected 'blackhole' or 'loss:PCT'")


class Net:
    """The simulated network: a fixed round-trip time, and the fault (drops on one host's rail)."""

    def __init__(self, fault: Fault, rtt_ns: int, rng: random.Random):
        self.fault, self.rtt_ns, self.rng = fault, rtt_ns, rng

    def answered(self, a: int, b: int, rail: int, t_ns: int) -> bool:
        """Whether a probe from host ``a`` to ``b`` on ``rail`` sent at ``t_ns`` is answered."""
        f = self.fault
        if rail != f.rail or t_ns < f.at_ns or (a != f.host and b != f.host):
            return True
        if f.kind == "blackhole":
            return False
        keep = 1.0 - f.loss
        return self.rng.random() < keep * keep  # request and reply each cross the lossy port


class SimHost:
    """One host: real Schedule, real ProbeFilter, real Engine (or the verdict-only X, see the
    module docstring), the prober's socket side simulated."""

    def __init__(self, sim: "Sim", i: int, *, verdict_only: bool = False):
        self.sim, self.i = sim, i
        self.name = sim.names[i]
        self.verdict_only = verdict_only
        pc = sim.probe_section
        peers = [n for n in sim.names if n != self.name]
        order = ring_order(self.name, peers)
        self.schedule = pwire.Schedule(interval_ns=pc.interval_ms * MS, slow_interval_ns=pc.slow_interval_ms * MS,
                                       fast_peers=pc.fast_peers, max_pps=pc.max_pps,
                                       paths={r: order for r in range(sim.rails)}, now_ns=sim.t0)
        self.fast_peers = sorted({p for _, p in self.schedule.fast})
        self.detect_ns = pc.detect_multiplier * pc.interval_ms * MS
        self.policy = sim.policy_for(i)
        self.engine = Engine(self.policy)
        self.counts: Counter[str] = Counter()
        self.last_ok: dict[tuple[int, str], int] = {}
        self.detected_ns: int | None = None
        self.detected_how: str | None = None
        self.failed_ns: int | None = None  # X only: the rail left local_usable (the engine announces that)
        self.notices_sent: list[SendNotice] = []
        self._warm = True
        self.filter = ProbeFilter(sim.probe_policy, self._post)
        self.seq = 0
        self.timer_at: int | None = None
        self._target = f"{rail_addr(sim.fault.rail, sim.fault.host, sim.hosts)}/32"
        self._x = sim.names[sim.fault.host]

    # ------------------------------------------------------------ start-up (steady state)

    def warm(self) -> None:
        """Steady state before the fault: every rail up (one plan), every path answered once
        (so the filter absorbs healthy results, as on a running host); X's engine also knows
        every path UP (its verdict is over all of them)."""
        t0 = self.sim.t0
        self._act(self.engine.handle(LinkSnapshot(tuple(LinkFacts(f"rail{r}") for r in range(self.sim.rails)), t0), t0), t0)
        pp = self.sim.probe_policy
        for rail, peer in self.schedule.paths():
            t = t0 - MS
            self.last_ok[(rail, peer)] = t
            self.filter(ProbeResult(rail, peer, True, t, self.sim.net.rtt_ns, 0))
        if self.i == self.sim.fault.host:
            for rail, peer in self.schedule.paths():
                self.engine.path_result(rail, peer, True, t0 - MS, self.sim.net.rtt_ns)
        self._warm = False
        self.counts.clear()

    # ------------------------------------------------------------ engine side

    def _post(self, ev) -> None:
        if self._warm:
            return
        self.counts["forwarded"] += 1
        now = ev.t_ns
        if self.verdict_only and isinstance(ev, ProbeResult):
            # what Engine._on_probe does to the path, without its scan over every path
            self.engine.path_result(ev.rail, ev.peer, ev.ok, now, ev.rtt_ns, ev.since_ok_ns, ev.peer_elsewhere)
            return
        t = time.process_time()
        actions = self.engine.handle(ev, now)
        self.sim.engine_cpu_s += time.process_time() - t
        self.sim.engine_events += 1
        self._act(actions, now)

    def _act(self, actions, now: int) -> None:
        for a in actions:
            if isinstance(a, ApplyRoutes) and not self._warm and self.detected_ns is None:
                if self.i != self.sim.fault.host and any(r.dst == self._target for r in a.routes):
                    self._detect(now, "routes" if self._x not in self.engine.peer_usable else "notice")
            elif isinstance(a, SendNotice):
                self.notices_sent.append(a)
                if not self._warm:
                    self.sim.deliver_notice(self, a, now)
            elif isinstance(a, SetTimer):
                if self.timer_at is None or a.at_ns != self.timer_at:
                    self.timer_at = a.at_ns
                    self.sim.push(a.at_ns, self._timer, a.at_ns)
        if self.i == self.sim.fault.host and self.failed_ns is None and not self._warm:
            r = self.sim.fault.rail
            if r not in self.engine.local_usable():
                self.failed_ns = now
                if self.detected_ns is None:
                    self._detect(now, "rail failed")
            elif self.detected_ns is None and r in self.engine.avoided_degraded():
                self._detect(now, "degraded, avoided")

    def _detect(self, now: int, how: str) -> None:
        self.detected_ns, self.detected_how = now, how
        self.sim.on_detected(self)

    def _timer(self, at: int) -> None:
        if self.timer_at != at:
            return
        self.timer_at = None
        self._post_direct(Tick(at), at)

    def _post_direct(self, ev, now: int) -> None:
        t = time.process_time()
        actions = self.engine.handle(ev, now)
        self.sim.engine_cpu_s += time.process_time() - t
        self._act(actions, now)

    def on_notice(self, ev: PeerRails) -> None:
        self.counts["notices_rx"] += 1
        self._post_direct(ev, ev.t_ns)

    def verdict_check(self, now: int) -> None:
        """Verdict-only X: ask the real Engine._probe_verdict about the faulted rail."""
        if self.failed_ns is not None:
            return
        why = self.engine._probe_verdict(self.sim.fault.rail, now)
        if why is not None:
            self.failed_ns = now
            if self.detected_ns is None:
                self._detect(now, "rail failed (verdict-only)")
            usable = frozenset(range(self.sim.rails)) - {self.sim.fault.rail}
            a = SendNotice(self.engine.generation + 1, usable, urgent=True)
            self.notices_sent.append(a)
            self.sim.deliver_notice(self, a, now)
        else:
            self.sim.push(now + self.sim.verdict_step_ns, self.verdict_check, now + self.sim.verdict_step_ns)

    # ------------------------------------------------------------ prober side (simulated sockets)

    def tick(self, now: int) -> None:
        sched = self.schedule
        for s in sched.poll(now):
            self._send(s, now)
        self.arm()

    def arm(self) -> None:
        self.sim.push(self.schedule.next_tick_ns, self.tick, None)

    def _send(self, s: pwire.Send, now: int) -> None:
        c = self.counts
        if s.confirm:
            c["confirm"] += 1
        elif s.fast:
            c["fast"] += 1
            if s.peer < self.name:  # passive path: the real prober leaves this one out (see docstring)
                c["passive"] += 1
        else:
            c["slow"] += 1
        self.seq += 1
        j = self.sim.index[s.peer]
        key = (s.rail, s.peer)
        if self.sim.net.answered(self.i, j, s.rail, now):
            t = now + self.sim.net.rtt_ns
            self.last_ok[key] = t
            self.schedule.settle(*key)
            c["replies"] += 1
            self.filter(ProbeResult(s.rail, s.peer, True, t, self.sim.net.rtt_ns, self.seq))
        else:
            self.sim.push(now + s.timeout_ns, self._miss, (s.rail, s.peer, self.seq, now, s.fast))

    def _gap_ns(self, peer: str) -> int:
        fast = peer in self.fast_peers
        return 2 * (self.schedule.interval_ns if fast else self.schedule.slow_interval_ns)

    def _elsewhere(self, rail: int, peer: str, since_ns: int, now: int) -> bool | None:
        """Like ``Prober._elsewhere``: answered on another rail at or after ``since_ns`` and
        within a gap before ``now`` (the stalled-peer refinement is left out: no peer stalls here)."""
        others = [self.last_ok.get((r, peer), -1) for r in range(self.sim.rails) if r != rail]
        if not others:
            return None
        latest = max(others)
        return latest >= since_ns and now - latest <= self._gap_ns(peer)

    def _miss(self, arg) -> None:
        rail, peer, seq, sent, fast = arg
        now = sent + (self.schedule.interval_ns if fast else self.schedule.slow_interval_ns)
        key = (rail, peer)
        self.counts["timeouts"] += 1
        if fast:
            last = self.last_ok.get(key)
            if last is not None and self.schedule.confirm(rail, peer, now, last + self.detect_ns + self.schedule.confirm_step_ns):
                self.counts["confirm_trains"] += 1
                self.arm()
        self.filter(ProbeResult(rail, peer, False, now, None, seq, peer_elsewhere=self._elsewhere(rail, peer, sent, now)))


class Sim:
    """One run: H hosts, the tracked ones simulated (see the module docstring)."""

    def __init__(self, hosts: int, *, rails: int = 8, sample: int = 32, seed: int = 1, fault: str = "blackhole",
                 rtt_us: float = 30.0, window_s: float | None = None, full_engine_max: int = 65536,
                 send_cost_ns: int = 4_000, fault_host: int | None = None, fault_rail: int = 0,
                 stop_when_left: bool = True):
        if hosts < 3:
            raise ValueError(f"--hosts {hosts}: at least 3 hosts")
        if rails < 2 or rails * hosts > ADDR_SPACE:
            raise ValueError(f"--rails {rails} x --hosts {hosts}: {rails} rails x {hosts} hosts do not fit 198.18.0.0/15 "
                             f"(at most {ADDR_SPACE} addresses; --rails at least 2)")
        self.hosts, self.rails, self.seed = hosts, rails, seed
        self.rng = random.Random(seed)
        kind, loss = parse_fault(fault)
        self.fault_text = fault
        x = self.rng.randrange(hosts) if fault_host is None else fault_host
        self.fault = Fault(kind, x, fault_rail, loss, at_ns=0)
        self.t0 = -2 * S  # steady state starts here; the fault at 0
        self.names = [host_name(i) for i in range(hosts)]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.probe_section = ProbeSection()
        self.probe_policy = probe_policy(self.probe_section)
        self.damping_policy = damping_policy(DampingSection())
        d = DaemonSection.model_fields
        self._host_defaults = dict(route_protocol=d["route_protocol"].default, route_table=d["route_table"].default,
                                   route_metric=d["route_metric"].default, hold_down_ms=d["hold_down_ms"].default)
        self.notice_refresh_ms = d["notice_refresh_ms"].default
        self._peer_pol = [PeerPolicy(n, None, {r: rail_addr(r, i, hosts) for r in range(rails)}) for i, n in enumerate(self.names)]
        self.net = Net(self.fault, int(rtt_us * 1000), random.Random(seed + 1))
        pc = self.probe_section
        # one sweep of the slow paths: at their interval, or slower when the tokens the fast set
        # leaves (max_pps - rails x fast_peers x 1000 / interval_ms) cannot keep up
        left = max(1, pc.max_pps - rails * pc.fast_peers * 1000 // pc.interval_ms)
        self.sweep_s = max(pc.slow_interval_ms / 1000, rails * max(0, hosts - 1 - pc.fast_peers) / left)
        self.window_ns = int((window_s if window_s is not None else 3.2 * self.sweep_s + 5) * S)
        self.send_cost_ns = send_cost_ns
        self.stop_when_left = stop_when_left  # False: run the whole window (X's own verdict may come after)
        self.verdict_only = hosts > full_engine_max
        self.verdict_step_ns = S
        self._heap: list = []
        self._n = 0
        self.engine_cpu_s = 0.0
        self.engine_events = 0
        # tracked hosts: X, its two ring neighbours (X's fast set), a uniform sample of the rest
        xs = self.names[x]
        ring = ring_order(xs, [n for n in self.names if n != xs])
        self.neighbours = [self.index[n] for n in ring[: pc.fast_peers]]
        rest = [i for i in range(hosts) if i != x and i not in self.neighbours]
        picked = sorted(self.rng.sample(rest, min(sample, len(rest))))
        self.tracked = [x, *self.neighbours, *picked]
        self.hosts_sim: dict[int, SimHost] = {}
        self._pending_detect = set(self.tracked)

    def policy_for(self, i: int) -> EnginePolicy:
        name = self.names[i]
        host = HostPolicy(name=name, mode="per-rail-ip", host_ip=None, **self._host_defaults)
        rails = tuple(RailPolicy(r, f"rail{r}", rail_addr(r, i, self.hosts)) for r in range(self.rails))
        peers = tuple(self._peer_pol[:i] + self._peer_pol[i + 1:])
        return EnginePolicy(host=host, rails=rails, peers=peers, probe=self.probe_policy, damping=self.damping_policy)

    def push(self, t: int, fn, arg) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, arg))

    def on_detected(self, h: SimHost) -> None:
        self._pending_detect.discard(h.i)

    def deliver_notice(self, sender: SimHost, a: SendNotice, now: int) -> None:
        """Each tracked peer gets the notice when NoticeService.send's loop (over usable rails,
        then peers in config order) reaches it: its position x one send's cost, + one-way latency."""
        self.notice_sends = getattr(self, "notice_sends", 0) + 1
        first_rail_pos = {n: k for k, n in enumerate(n for n in self.names if n != sender.name)}
        for i, h in self.hosts_sim.items():
            if i == sender.i:
                continue
            pos = first_rail_pos[h.name]
            t = now + pos * self.send_cost_ns + self.net.rtt_ns // 2
            ev = PeerRails(sender.name, a.usable, a.generation, self._n + 1, t, min(a.usable) if a.usable else None)
            self.push(t, h.on_notice, ev)

    def run(self) -> dict:
        wall0, cpu0 = time.monotonic(), time.process_time()
        for i in self.tracked:
            h = SimHost(self, i, verdict_only=self.verdict_only and i == self.fault.host)
            h.warm()
            self.hosts_sim[i] = h
        setup_cpu = time.process_time() - cpu0
        for h in self.hosts_sim.values():
            self.push(self.t0, h.tick, None)
            h.counts.clear()
        x = self.hosts_sim[self.fault.host]
        if x.verdict_only:
            self.push(0, x.verdict_check, 0)
        end = self.window_ns
        measured_from = None
        steady = {}
        while self._heap:
            t, _, fn, arg = heapq.heappop(self._heap)
            if t > end:
                break
            if measured_from is None and t >= 0:
                measured_from = t
                steady = {i: dict(h.counts) for i, h in self.hosts_sim.items()}  # the 2 s before the fault
            fn(t if arg is None else arg)
            if self.stop_when_left and not self._pending_detect and self.fault.kind == "blackhole":
                end = min(end, t)  # every tracked host has left the rail: stop here
        t_end = min(end, t)
        return self._report(steady, t_end, time.process_time() - cpu0, setup_cpu, time.monotonic() - wall0)

    def _report(self, steady: dict, t_end: int, cpu_s: float, setup_cpu: float, wall_s: float) -> dict:
        pre_s = -self.t0 / S
        per_host = []
        for i, h in self.hosts_sim.items():
            c = steady.get(i, {})
            per_host.append({
                "host": h.name, "role": "X" if i == self.fault.host else ("neighbour" if i in self.neighbours else "sample"),
                "detect_ms": None if h.detected_ns is None else round(h.detected_ns / MS, 3),
                "how": h.detected_how,
                "notices_sent": [{"usable": sorted(a.usable), "urgent": a.urgent} for a in h.notices_sent[1:]],
                "pps_schedule": round((c.get("fast", 0) + c.get("slow", 0) + c.get("confirm", 0)) / pre_s, 1),
                "pps_on_wire": round((c.get("fast", 0) - c.get("passive", 0) + c.get("slow", 0) + c.get("confirm", 0)) / pre_s, 1),
                "fast_pps": round(c.get("fast", 0) / pre_s, 1), "slow_pps": round(c.get("slow", 0) / pre_s, 1),
                "forwarded_in_fault": h.counts.get("forwarded", 0),
            })
        det = sorted(p["detect_ms"] for p in per_host if p["role"] != "X" and p["detect_ms"] is not None)
        peers = [p for p in per_host if p["role"] != "X"]
        x = next(p for p in per_host if p["role"] == "X")
        return {
            "hosts": self.hosts, "rails": self.rails, "seed": self.seed, "fault": self.fault_text,
            "fault_host": self.names[self.fault.host], "fault_rail": self.fault.rail,
            "tracked": len(self.tracked), "verdict_mode": "verdict-only" if self.verdict_only else "engine",
            "sweep_s": round(self.sweep_s, 2), "simulated_s": round(t_end / S, 3), "window_s": round(self.window_ns / S, 1),
            "x_detect_ms": x["detect_ms"], "x_how": x["how"],
            "x_rail_failed_ms": None if self.hosts_sim[self.fault.host].failed_ns is None
            else round(self.hosts_sim[self.fault.host].failed_ns / MS, 3),
            "x_announced": any(set(n["usable"]) != set(range(self.rails)) for n in x["notices_sent"]),
            "peers_detected": len(det), "peers_tracked": len(peers),
            "peer_detect_ms": {"min": det[0] if det else None, "p50": det[len(det) // 2] if det else None,
                               "max": det[-1] if det else None},
            "engine_events": self.engine_events, "engine_cpu_s": round(self.engine_cpu_s, 3),
            "sim_cpu_s": round(cpu_s, 1), "setup_cpu_s": round(setup_cpu, 1), "sim_wall_s": round(wall_s, 1),
            "per_host": per_host,
        }


# --------------------------------------------------------------------------- CPU costs


def _per_call_us(fn, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def measure_costs(n: int = 20000) -> dict:
    """Per-packet and per-call CPU of the real code, in µs (``time.process_time``)."""
    names = (host_name(16383), host_name(12))
    req = pwire.Probe(pwire.REQUEST, names[0], names[1], 3, 1 << 60, 1 << 50, 7)
    data = pwire.encode(req, KEY)
    reply = pwire.encode(req.reply(), KEY)
    out = {"probe_bytes": len(data)}
    out["probe_encode_us"] = _per_call_us(lambda: pwire.encode(req, KEY), n)
    out["probe_decode_us"] = _per_call_us(lambda: pwire.decode(reply, KEY), n)
    rg = pwire.RequestGuard()
    seqs = iter(range(1, 10 * n))
    out["request_guard_us"] = _per_call_us(lambda: rg.check(pwire.Probe(1, "a", "b", 0, next(seqs), 0)), n)
    guard = pwire.ReplyGuard()
    k = iter(range(1, 10 * n))

    def add_check():
        s = next(k)
        guard.add(pwire.Pending(0, "b", s, s, s + 10 * MS))
        guard.check(pwire.Probe(pwire.REPLY, "b", "a", 0, s, s), s + 1)
    out["reply_guard_us"] = _per_call_us(add_check, n)
    # one UDP datagram over loopback: sendto + recvfrom (the syscalls a probe costs each end)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    addr = rx.getsockname()
    t = time.process_time()
    for _ in range(n // 4):
        for _ in range(4):
            tx.sendto(data, addr)
        for _ in range(4):
            rx.recvfrom(512)
    out["udp_send_recv_us"] = (time.process_time() - t) / n * 1e6
    t = time.process_time()
    for _ in range(n):
        tx.sendto(data, addr)
        if _ % 64 == 63:
            rx.setblocking(False)
            try:
                while True:
                    rx.recvfrom(512)
            except BlockingIOError:
                pass
    out["udp_sendto_us"] = None  # filled below (send share of the pair)
    send_plus_drain = (time.process_time() - t) / n * 1e6
    out["udp_sendto_us"] = round(min(send_plus_drain, out["udp_send_recv_us"]) * 0.5 + 0.0, 3)
    rx.close()
    tx.close()
    # the filter on a healthy answer (the common case)
    pp = probe_policy(ProbeSection())
    f = ProbeFilter(pp, lambda ev: None)
    tt = iter(range(0, 10 * n * MS, MS))
    out["filter_ok_us"] = _per_call_us(lambda: f(ProbeResult(0, "b", True, next(tt), 30_000, 1)), n)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def measure_engine(sim_hosts: int, rails: int = 8, calls: int = 20) -> dict:
    """Engine.handle per forwarded probe result, with every ``rails x (H-1)`` path known (the
    steady state of a host that has swept all its peers once), and ring_order at this size."""
    s = Sim(sim_hosts, rails=rails, sample=0, fault_host=0)
    pol = s.policy_for(0)
    e = Engine(pol)
    e.handle(LinkSnapshot(tuple(LinkFacts(f"rail{r}") for r in range(rails)), 0), 0)
    pp = s.probe_policy
    for p in pol.peers:
        for r in range(rails):
            e.path_result(r, p.name, True, 0, 30_000)
    peer = pol.peers[len(pol.peers) // 2].name
    now = S
    t = time.process_time()
    for k in range(calls):
        now += MS
        ok = k % 2 == 1  # a miss then an answer: both are forwarded by the filter
        e.handle(ProbeResult(1, peer, ok, now, 30_000 if ok else None, k, since_ok_ns=None if ok else 5 * MS,
                             peer_elsewhere=None if ok else True), now)
    per = (time.process_time() - t) / calls
    names = s.names
    t = time.process_time()
    ring_order(names[0], names[1:])
    ring_s = time.process_time() - t
    return {"hosts": sim_hosts, "paths": len(e.paths), "engine_per_result_ms": round(per * 1e3, 3),
            "ring_order_ms": round(ring_s * 1e3, 2)}


def measure_notices(hosts: int, rails: int = 8) -> dict:
    """The real NoticeService: datagrams one refresh sends (to every peer over one usable rail,
    as ``refresh_loop`` does) with a counting socket, the send loop's CPU per datagram (a send
    over every rail, as an urgent notice), and on_datagram per datagram."""
    names = [host_name(i) for i in range(hosts)]
    sent = Counter()

    class CountingSock:
        def sendto(self, data, addr):
            sent["n"] += 1
            sent["bytes"] += len(data)

    peers = [SimpleNamespace(name=n, rail_ips={r: rail_addr(r, i, hosts) for r in range(rails)})
             for i, n in enumerate(names) if i != 0]
    cfg = SimpleNamespace(peers=peers, rails=[SimpleNamespace(id=r, netdev=f"rail{r}") for r in range(rails)],
                          daemon=SimpleNamespace(host=names[0], notice_port=7471,
                                                 notice_refresh_ms=DaemonSection.model_fields["notice_refresh_ms"].default,
                                                 notice_refresh_max_pps=DaemonSection.model_fields["notice_refresh_max_pps"].default))
    ns = NoticeService(cfg, KEY, lambda ev: None)
    ns._send_socks = {r: CountingSock() for r in range(rails)}
    state = SendNotice(1, frozenset(range(rails)), urgent=False)
    t = time.process_time()
    ns.send(state)
    loop_us = (time.process_time() - t) / max(1, sent["n"]) * 1e6
    sent.clear()
    ns.send(state, rails=(0,))  # a refresh: one usable rail per period, in turn
    per_refresh = sent["n"]
    # receive: refreshes, one datagram per sender (each over one rail, each accepted)
    rx = NoticeService(SimpleNamespace(peers=[SimpleNamespace(name=n, rail_ips={r: rail_addr(r, i, hosts) for r in range(rails)})
                                               for i, n in enumerate(names) if i != 1],
                                       rails=cfg.rails, daemon=SimpleNamespace(host=names[1], notice_port=7471,
                                                                                notice_refresh_ms=cfg.daemon.notice_refresh_ms)),
                       KEY, lambda ev: None)
    k = min(hosts - 1, 2000)
    datagrams = []
    for i in range(k):
        sender = names[0] if i == 0 else names[i + 1]
        d = nwire.encode(nwire.Notice(sender, 10 + i, 1, {r: True for r in range(rails)}), KEY)
        datagrams.append((d, (rail_addr(i % rails, i, hosts), 7471)))
    t = time.process_time()
    for d, a in datagrams:
        rx.on_datagram(d, a)
    rx_us = (time.process_time() - t) / len(datagrams) * 1e6
    refresh_s = refresh_period_s(cfg)
    return {"hosts": hosts, "datagrams_per_refresh": per_refresh, "refresh_period_s": round(refresh_s, 3), "bytes_per_datagram": sent["bytes"] // max(1, sent["n"]),
            "refresh_tx_per_s": round(per_refresh / refresh_s), "refresh_rx_per_s": round(per_refresh / refresh_s),
            "send_loop_us_per_datagram": round(loop_us, 3), "on_datagram_us": round(rx_us, 3),
            "urgent_burst_datagrams": 3 * (rails - 1) * (hosts - 1),
            "cluster_refresh_per_s": round(per_refresh / refresh_s * hosts)}


def cpu_per_host(r: dict, costs: dict, eng: dict, notices: dict) -> dict:
    """Share of one core per host (steady state, healthy fabric) from rates x measured costs."""
    xs = [p for p in r["per_host"] if p["role"] == "sample"] or r["per_host"]
    wire = sum(p["pps_on_wire"] for p in xs) / len(xs)
    sched = sum(p["pps_schedule"] for p in xs) / len(xs)
    udp_pair = costs["udp_send_recv_us"]
    tx = wire * (costs["probe_encode_us"] + udp_pair / 2)
    # replies to our requests, plus the requests of others (the same rate: every host runs the
    # same schedule) answered and their replies sent; proofs stand in for the passive ones
    rx_replies = wire * (udp_pair / 2 + costs["probe_decode_us"] + costs["reply_guard_us"])
    responder = wire * (udp_pair + costs["probe_decode_us"] + costs["request_guard_us"] + costs["probe_encode_us"])
    filt = sched * costs["filter_ok_us"]
    n_tx = notices["refresh_tx_per_s"] * (notices["send_loop_us_per_datagram"] + udp_pair / 2)
    n_rx = notices["refresh_rx_per_s"] * (notices["on_datagram_us"] + udp_pair / 2)
    parts = {"probe_tx": tx, "probe_replies_rx": rx_replies, "responder": responder, "filter": filt,
             "notice_tx": n_tx, "notice_rx": n_rx}
    total = sum(parts.values())
    return {"pps_schedule": round(sched, 1), "pps_on_wire": round(wire, 1),
            "parts_pct": {k: round(v / 1e4, 2) for k, v in parts.items()}, "total_pct": round(total / 1e4, 2),
            "engine_ms_per_forwarded_result": eng["engine_per_result_ms"]}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _print(res: dict) -> None:
    for size in res["sizes"]:
        r, c = size["sim"], size["cpu"]
        print(f"== {r['hosts']} hosts x {r['rails']} rails, fault {r['fault']} on {r['fault_host']} rail {r['fault_rail']} "
              f"(seed {r['seed']}, {r['tracked']} hosts tracked, X: {r['verdict_mode']})")
        print(f"  probes/s per host: schedule {c['pps_schedule']:.0f}, on the wire {c['pps_on_wire']:.0f} (passive paths left out); "
              f"slow sweep {r['sweep_s']:.1f} s")
        print(f"  CPU per host (healthy, extrapolated): {c['total_pct']:.1f} % of a core  " +
              ", ".join(f"{k} {v:.2f}" for k, v in c["parts_pct"].items()))
        e, n = size["engine"], size["notices"]
        print(f"  engine: {e['engine_per_result_ms']:.3f} ms per forwarded result with {e['paths']} paths; ring_order {e['ring_order_ms']:.1f} ms")
        print(f"  notices: {n['refresh_tx_per_s']} datagrams/s per host each way (cluster {n['cluster_refresh_per_s']:,}/s), "
              f"urgent burst {n['urgent_burst_datagrams']:,}, send loop {n['send_loop_us_per_datagram']:.2f} us/datagram, "
              f"on_datagram {n['on_datagram_us']:.2f} us")
        pd = r["peer_detect_ms"]
        print(f"  detection: X {r['x_detect_ms']} ms ({r['x_how']}), X fails the rail {r['x_rail_failed_ms']} ms, "
              f"announced to peers: {r['x_announced']}; "
              f"peers {r['peers_detected']}/{r['peers_tracked']} within {r['simulated_s']:.1f} s, "
              f"min {pd['min']} p50 {pd['p50']} max {pd['max']} ms")
        print(f"  notice fan-out: the send loop reaches the last of {r['hosts'] - 1} peers {r['notice_last_peer_ms']} ms after the first")
        print(f"  sim: {r['sim_cpu_s']} s CPU ({r['setup_cpu_s']} s set-up), {r['engine_events']} engine events")


def main(argv: list[str] | None = None, args=None) -> int:
    lg = logging.getLogger("linkpass")
    level = lg.level
    try:
        return _main(argv, args)
    finally:
        lg.setLevel(level)  # a caller in the same process (tests, `linkpass bench`) keeps its logging


def _main(argv: list[str] | None = None, args=None) -> int:
    if args is None:
        from linkpass.lab.benchcmd import add_scale_options
        ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
        add_scale_options(ap)
        try:
            args = ap.parse_args(argv)
        except SystemExit as e:  # a bad value: argparse said which, with the usage
            return e.code if isinstance(e.code, int) else 2
    prog = getattr(args, "prog", None) or PROG
    # every argument is checked before anything is measured
    try:
        sizes = [int(x) for x in str(args.hosts).split(",") if x.strip()]
        if not sizes:
            raise ValueError(f"--hosts {args.hosts!r}: comma-separated integers")
        parse_fault(args.fault)
        for h in sizes:
            Sim(h, rails=args.rails, sample=0, fault=args.fault)  # bad sizes fail before any work
    except ValueError as e:
        print(f"{prog}: {e if str(e).startswith('--') else f'--hosts {args.hosts!r}: comma-separated integers'}",
              file=sys.stderr)
        return 2
    if args.json:
        parent = Path(args.json).parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"{prog}: --json {args.json}: cannot make {str(parent)!r} ({e.strerror or e})", file=sys.stderr)
            return 2
        if Path(args.json).is_dir() or not os.access(parent, os.W_OK):
            print(f"{prog}: --json {args.json}: {'a directory' if Path(args.json).is_dir() else 'not writable'}",
                  file=sys.stderr)
            return 2
    logging.getLogger("linkpass").setLevel(logging.ERROR)  # the engines' per-event log lines, thousands of them
    costs = measure_costs()
    out = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": _commit(),
           "command": " ".join(["linkpass bench scale", *(sys.argv[1:] if argv is None else argv)]),
           "costs_us": costs, "sizes": []}
    print(f"costs (us): " + ", ".join(f"{k} {v}" for k, v in costs.items()))
    for h in sizes:
        notices = measure_notices(h, args.rails)
        # one notice datagram leaves after the send loop's own work and one sendto
        send_ns = int(1000 * (notices["send_loop_us_per_datagram"] + costs["udp_send_recv_us"] / 2))
        sim = Sim(h, rails=args.rails, sample=args.sample, seed=args.seed, fault=args.fault, rtt_us=args.rtt_us,
                  window_s=args.window_s, full_engine_max=args.full_engine_max, send_cost_ns=send_ns)
        r = sim.run()
        r["notice_send_ns"] = send_ns
        r["notice_last_peer_ms"] = round(send_ns * (h - 2) / MS, 3)  # the loop reaches the last peer this late
        eng = measure_engine(h, args.rails, calls=args.engine_calls)
        size = {"sim": r, "engine": eng, "notices": notices, "cpu": cpu_per_host(r, costs, eng, notices)}
        out["sizes"].append(size)
        _print({"sizes": [size]})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
