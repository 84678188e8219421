"""The live counter source (device source ``counters``): polls every counter of the host
(:class:`~linkpass.adapters.counters.CounterPoller`) once per ``[risk] poll_interval_s``, feeds
the pure :class:`~linkpass.core.risk.RiskTracker`, and posts a
:class:`~linkpass.core.model.RiskChanged` for each subject whose at-risk state changed.

The poll runs in a worker thread (``asyncio.to_thread``): sysfs PMA counters are MADs to the HCA
firmware and NVML calls go to the driver; the poller bounds each poll itself (its
``deadline_s``), and a poll still running when the next is due is not started twice.  Source
problems (a counter reset or wrapped, a file gone, garbage, a read that timed out) are logged
once each until the source reads well again (the tracker decides what is new) and never give a
verdict.  Corrected-AER kernel-log records (the kmsg follower's incidents) are counted too
(:class:`~linkpass.core.risk.AerLogCounter`), so a GPU whose root port keeps logging Replay
Timer Timeouts is at risk before it falls off the bus.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from linkpass.adapters.counters import CounterPoller, GpuSource, RailSource
from linkpass.core.model import Event, RiskChanged
from linkpass.core.risk import AerLogCounter, CounterSample, RiskTracker, SourceProblem

log = logging.getLogger("linkpass.risk")

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
PROBLEMS_KEPT = 32


def rail_sources_from_sysfs(root: str | Path, rails: dict[int, str]) -> list[RailSource]:
    """Rail id -> netdev (``[[rails]]``) to what is read for each, from sysfs under ``root``:
    the NIC's PCI bus id is the name of ``sys/class/net/<netdev>/device`` (resolved); its HCA
    the ``sys/class/infiniband/<hca>`` whose ``device`` resolves to the same PCI function; the
    port ``dev_port + 1`` (``sys/class/net/<netdev>/dev_port``: the kernel's 0-based port of a
    multi-port function; IB ports count from 1), else 1.  A netdev with no PCI device (veth,
    a bridge) gets its netdev counters only.  Never raises."""
    root = Path(root)
    hcas: dict[str, str] = {}
    ib = root / "sys/class/infiniband"
    try:
        for d in sorted(ib.iterdir()):
            try:
                hcas[os.path.realpath(d / "device")] = d.name
            except OSError:
                continue
    except OSError:
        pass
    out = []
    for rail, netdev in sorted(rails.items()):
        dev = root / "sys/class/net" / netdev / "device"
        real = os.path.realpath(dev) if dev.exists() else None
        bdf = os.path.basename(real) if real and _BDF.match(os.path.basename(real)) else None
        hca = hcas.get(real) if real else None
        port = 1
        try:
            port = int((root / "sys/class/net" / netdev / "dev_port").read_text().strip()) + 1
        except (OSError, ValueError):
            pass
        out.append(RailSource(rail, netdev, hca, port if hca else None, bdf))
    return out


class RiskSource:
    """Counter trends -> :class:`RiskChanged` events (see the module docstring).

    Args:
        poller: what is read each poll.
        tracker: the pure rules.
        post: puts an event on the daemon's queue.
        interval_s: seconds between polls.
        clock: monotonic ns (tests pass a fake).
    """

    name = "counters"

    def __init__(self, poller: CounterPoller, tracker: RiskTracker, post: Callable[[Event], None], interval_s: float = 1.0,
                 clock: Callable[[], int] = time.monotonic_ns):
        self.poller, self.tracker, self.post, self.interval_s, self.clock = poller, tracker, post, interval_s, clock
        self.aer = AerLogCounter(poller.aer_subjects())
        self._aer_pending: list[CounterSample] = []
        self.latest: dict[tuple[str, int], dict[str, float]] = {}
        self.problems: deque[dict] = deque(maxlen=PROBLEMS_KEPT)
        self.counters = {"polls": 0, "samples": 0, "problems": 0, "verdicts": 0, "poll_errors": 0}
        self.last_poll_ms: float | None = None

    @property
    def gpus(self) -> list[int]:
        return [g.index for g in self.poller.gpus]

    def open(self) -> bool:
        """True when there is anything to read."""
        return bool(self.poller.rails or self.poller.gpus)

    def on_incident(self, inc: Any) -> None:
        """A classified kernel-log incident (the kmsg follower's): corrected AER records count."""
        self._aer_pending += self.aer.incident(inc)

    def step(self, samples: list[CounterSample], problems: list[SourceProblem], t_ns: int) -> list[RiskChanged]:
        """One poll's readings through the tracker; posts and returns the changes.  Never raises
        on content (a tracker bug is logged and the poll dropped)."""
        self.counters["polls"] += 1
        self.counters["samples"] += len(samples)
        feed = [*samples, *self.aer.samples(t_ns), *problems]
        self._aer_pending = []
        for s in samples:
            self.latest.setdefault((s.kind, s.subject), {})[s.counter] = s.value
        try:
            verdicts, new_problems = self.tracker.observe(feed, t_ns)
        except Exception:
            self.counters["poll_errors"] += 1
            log.exception("risk tracker failed on a poll; poll dropped")
            return []
        for p in new_problems:
            self.counters["problems"] += 1
            self.problems.append(p.to_json())
            log.warning("counters: %s %d %s: %s (%s); no verdict from it", p.kind, p.subject, p.counter, p.problem, p.detail)
        out = []
        for v in verdicts:
            self.counters["verdicts"] += 1
            d = v.to_json()
            d["counters"] = {k: (int(x) if float(x).is_integer() else x)
                             for k, x in sorted(self.latest.get((v.kind, v.subject), {}).items())}
            ev = RiskChanged(v.kind, v.subject, v.at_risk, v.rule, v.summary, d, t_ns)
            out.append(ev)
            self.post(ev)
        return out

    async def run(self) -> None:
        """Poll forever (cancelled with the daemon)."""
        while True:
            t0 = time.monotonic()
            try:
                samples, problems = await asyncio.to_thread(self.poller.poll)
            except Exception:  # the poller never raises; this is a bug, and the daemon goes on
                self.counters["poll_errors"] += 1
                log.exception("counter poll failed")
                samples, problems = [], []
            self.last_poll_ms = round((time.monotonic() - t0) * 1e3, 3)
            self.step(samples, problems, self.clock())
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def status(self) -> dict:
        """JSON for ``linkpass status`` (``device_sources.counters``)."""
        return {"interval_s": self.interval_s, "rails": [r.rail for r in self.poller.rails], "gpus": self.gpus,
                "last_poll_ms": self.last_poll_ms, **self.counters, "poller": dict(self.poller.counters),
                "recent_problems": list(self.problems), "tracker": self.tracker.status()}

    def close(self) -> None:
        self.poller.close()


def sysfs_root_problem(root: str) -> str | None:
    """Why ``[risk] sysfs_root`` cannot be read as a sysfs root (None when it can): it must be an
    absolute directory holding ``sys/``."""
    if not os.path.isabs(root):
        return f"{root!r} is not an absolute path"
    if not os.path.isdir(os.path.join(root, "sys")):
        return f"{root} has no sys/ directory (not a sysfs root)"
    return None


def build(cfg: Any, post: Callable[[Event], None], topology: Any = None) -> RiskSource | None:
    """The counter source of a daemon config (``[risk]``), or None when it is off.  Rails come
    from the discovered topology when there is one, else from sysfs under ``[risk] sysfs_root``;
    NVML from nvidia-ml-py when ``[risk] nvml`` and a driver are there."""
    from linkpass.adapters.counters import load_nvml

    rc = cfg.risk
    if not rc.enabled:
        return None
    why = sysfs_root_problem(rc.sysfs_root)
    if why is not None:
        log.warning("counters: [risk] sysfs_root: %s; counter trends are off (no rail or GPU is judged at risk)", why)
        return None
    rails = {r.id: r.netdev for r in cfg.rails}
    nv = load_nvml() if rc.nvml else None
    kw = {"root": rc.sysfs_root, "deadline_s": rc.deadline_s, "nvml": nv}
    if topology is not None and getattr(topology, "nics", None) and rc.sysfs_root == "/":
        poller = CounterPoller.from_topology(rails, topology, **kw)
    else:
        poller = CounterPoller(rail_sources_from_sysfs(rc.sysfs_root, rails), [], **kw)
    if not poller.gpus and cfg.device.gpus:  # no topology: the configured PCI bus id -> GPU index map
        poller.gpus = [GpuSource(idx, bus.lower()) for bus, idx in sorted(cfg.device.gpus.items(), key=lambda x: x[1])]
    if nv is not None and not poller.gpus:
        try:
            poller.gpus = [GpuSource(i) for i in range(nv.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - NVML without a device count: no GPU counters
            pass
    tracker = RiskTracker(clean_hold_s=rc.clean_hold_s)
    return RiskSource(poller, tracker, post, rc.poll_interval_s)
