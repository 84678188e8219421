"""Counter trends -> at-risk verdicts for rails and GPUs (issue 18, part 2).  Pure: no I/O, no
clock; time comes in as ``t_ns``, monotonic nanoseconds read at the edge.

Input: :class:`CounterSample` (one reading of one counter of one rail or GPU) and
:class:`SourceProblem` (a reading that could not be had).  Output of
:meth:`RiskTracker.observe`: only the *changes*, as :class:`RiskVerdict` (a subject became at
risk; a subject stayed clean for ``clean_hold_s`` after being at risk) and source problems,
each reported once per (kind, subject, counter, problem) until the source reads well again.

Counters come in two shapes:

- **cumulative** counters (error counts): only their increase matters.  A reading lower than
  the previous one is a reset (driver reload, ``perfquery -R``, a GPU reset clearing NVML's
  volatile counts) or, for a counter the hardware keeps in 32 bits, a wrap.  Either way the
  tracker re-baselines on the new value, reports one ``SourceProblem`` (``reset`` or ``wrap``)
  and takes no verdict from that step.  Which counters wrap and which saturate
  (:data:`COUNTER_WIDTHS`): the IBTA PortCounters error counters that the kernel reads by
  PMA MAD (``drivers/infiniband/core/sysfs.c``, ``PORT_PMA_ATTR(name, counter, width,
  offset)``: symbol_error 16 bit, link_error_recovery 8, link_downed 8, port_rcv_errors 16,
  local_link_integrity_errors 4, excessive_buffer_overrun_errors 4, ...) *saturate*: the IBTA
  specification's PortCounters attribute (vol. 1, Performance Management) makes its error
  counters stop at all ones instead of wrapping; so they never wrap, and one pinned at all ones
  (``saturated``) says nothing more about the rate.  mlx5 ``hw_counters`` are printed as u64
  (``print_hw_stat``) but hold the device's 32-bit Q counters
  (``drivers/infiniband/hw/mlx5/counters.c``, ``mlx5_ib_query_q_counters``:
  ``stats->value[i] = (u64)be32_to_cpu(val)``), which wrap at 2^32.  netdev statistics are ``rtnl_link_stats64`` (64 bit),
  PCIe AER and NVML counts are 64-bit: for those a step back is a reset.
- **gauges** (temperatures, flags such as row-remap-pending): judged by a threshold, never a
  rate.  A gauge's threshold may itself be a reading (``module_temp_crit_c``: the mlx5 hwmon
  ``temp*_crit``; ``gpu_temp_slowdown_c``: NVML's slowdown threshold).

A verdict needs the rule's evidence, never one read: a rate rule needs ``min_span_s`` of
history and rises in ``min_polls`` different polls inside its window; a gauge rule needs
``min_polls`` consecutive polls past its threshold.

Rules (:data:`DEFAULT_RULES`, each citing where its threshold comes from) are frozen data;
the daemon may pass its own.  The thresholds of NVSentinel's NIC health monitor
(NVIDIA/NVSentinel ``docs/configuration/nic-health-monitor.md``, "Default Counter
Configuration"), gpud's link-flap rule (leptonai/gpud
``components/accelerator/nvidia/infiniband/store/scan_flaps.go``), DCGM's health limits
(NVIDIA/DCGM ``DcgmGpuHardwareLimits.h``, used by ``modules/health/DcgmHealthWatch.cpp``) and
NVIDIA's "GPU Memory Error Management" document
(https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/) are used as published.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from linkpass.core.evidence.pcie import CORRECTABLE_ERRORS

KINDS = ("rail", "gpu")
PROBLEMS = ("reset", "wrap", "saturated", "vanished", "garbage", "timeout", "unreadable")

#: counter -> (bits, "saturate" | "wrap"): how the counter behaves at its top; counters not
#: listed are 64-bit (a step back is a reset).  Sources in the module docstring.
COUNTER_WIDTHS: dict[str, tuple[int, str]] = {
    "symbol_error": (16, "saturate"),
    "link_error_recovery": (8, "saturate"),
    "link_downed": (8, "saturate"),
    "port_rcv_errors": (16, "saturate"),
    "port_rcv_remote_physical_errors": (16, "saturate"),
    "port_rcv_switch_relay_errors": (16, "saturate"),
    "port_xmit_discards": (16, "saturate"),
    "port_xmit_constraint_errors": (8, "saturate"),
    "port_rcv_constraint_errors": (8, "saturate"),
    "local_link_integrity_errors": (4, "saturate"),
    "excessive_buffer_overrun_errors": (4, "saturate"),
    "VL15_dropped": (16, "saturate"),
    # mlx5 Q counters (hw_counters/): 32-bit in the device
    "out_of_sequence": (32, "wrap"),
    "packet_seq_err": (32, "wrap"),
    "local_ack_timeout_err": (32, "wrap"),
    "rnr_nak_retry_err": (32, "wrap"),
    "implied_nak_seq_err": (32, "wrap"),
    "req_transport_retries_exceeded": (32, "wrap"),
    "roce_slow_restart": (32, "wrap"),
}

#: gauges: judged by value, not by increase
GAUGES = frozenset({"gpu_temp_c", "gpu_temp_slowdown_c", "module_temp_c", "module_temp_crit_c", "row_remap_pending",
                    "row_remap_failure", "retired_pages_pending"})


@dataclass(frozen=True)
class CounterSample:
    """One reading.  ``kind``: ``"rail"`` or ``"gpu"``; ``subject``: the rail id (as in the
    daemon's rails) or the NVML GPU index; ``counter``: a stable name (see
    :data:`DEFAULT_RULES`); ``value``: a cumulative counter's raw value or a gauge's reading
    (°C for temperatures, 0/1 for flags); ``t_ns``: monotonic ns of the read; ``source``:
    where it came from (a sysfs path, ``"nvml:nvmlDeviceGetTotalEccErrors"``, ``"kmsg"``)."""

    kind: str
    subject: int
    counter: str
    value: float
    t_ns: int
    source: str


@dataclass(frozen=True)
class SourceProblem:
    """A reading that could not be used: ``problem`` one of :data:`PROBLEMS`; ``detail`` one
    line for operators (what was read, where)."""

    kind: str
    subject: int
    counter: str
    source: str
    problem: str
    detail: str
    t_ns: int

    def to_json(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "counter": self.counter, "source": self.source,
                "problem": self.problem, "detail": self.detail, "t_ns": self.t_ns}


@dataclass(frozen=True)
class RiskVerdict:
    """A change of a subject's at-risk state.  ``rule``: the rule id; ``counter``, ``rate``,
    ``unit``, ``window_s``: what was measured (for a clear verdict: the rule that had put the
    subject at risk, and its rate now); ``threshold``: the rule's threshold in words;
    ``citation``: where the threshold comes from; ``summary``: one line for operators."""

    kind: str
    subject: int
    at_risk: bool
    rule: str
    counter: str
    rate: float
    unit: str
    window_s: float
    threshold: str
    citation: str
    t_ns: int
    summary: str

    def to_json(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "at_risk": self.at_risk, "rule": self.rule,
                "counter": self.counter, "rate": self.rate, "unit": self.unit, "window_s": self.window_s,
                "threshold": self.threshold, "citation": self.citation, "t_ns": self.t_ns, "summary": self.summary}


@dataclass(frozen=True)
class Rule:
    """One rule.

    Args:
        id: stable id (``"ib.symbol_error.ber"``).
        kind: ``"rail"`` or ``"gpu"``.
        counter: the counter it reads.
        mode: ``"rate"`` (increase over the window, per ``per_s`` seconds, extrapolated from the
            history there is, at least ``min_span_s``), ``"count"`` (increase within the
            window, not extrapolated), ``"gauge"`` (the reading itself) or ``"gauge_margin"``
            (the reading against another reading of the same subject, ``limit_counter``,
            minus ``margin``).
        threshold: breach when the measured value is > threshold (``"gauge"``,
            ``"gauge_margin"``: >=).
        window_s: how far back the rule looks.
        unit: the measured value's unit in words (``"per hour"``, ``"°C"``).
        per_s: seconds per rate unit (3600 for "per hour"); unused by other modes.
        min_polls: evidence: polls inside the window in which the counter rose (rate, count),
            or consecutive polls past the threshold (gauges).
        min_span_s: rate only: history needed before the rate is judged.
        citation: where the threshold comes from.
    """

    id: str
    kind: str
    counter: str
    mode: str
    threshold: float
    window_s: float
    unit: str
    citation: str
    per_s: float = 1.0
    min_polls: int = 2
    min_span_s: float = 0.0
    limit_counter: str | None = None
    margin: float = 0.0

    def threshold_text(self) -> str:
        if self.mode == "gauge_margin":
            return f">= {self.limit_counter} - {self.margin:g} °C for {self.min_polls} polls"
        if self.mode == "gauge":
            return f">= {self.threshold:g} for {self.min_polls} polls"
        ev = f"rises in >= {self.min_polls} polls" if self.min_polls > 1 else "any rise"
        if self.mode == "count":
            return f"> {self.threshold:g} within {self.window_s:g} s ({ev})"
        return f"> {self.threshold:g} {self.unit} over <= {self.window_s:g} s (>= {self.min_span_s:g} s of history, {ev})"


NVSENTINEL = "NVIDIA/NVSentinel docs/configuration/nic-health-monitor.md (Default Counter Configuration)"
GPUD_FLAP = ("leptonai/gpud components/accelerator/nvidia/infiniband/store/scan_flaps.go "
             "(defaultIbPortFlapBackToActiveThreshold = 3 flaps in 12 h)")
DCGM_LIMITS = "NVIDIA/DCGM DcgmGpuHardwareLimits.h (used by modules/health/DcgmHealthWatch.cpp)"
NV_MEM = "NVIDIA GPU Memory Error Management, https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/"
AER_C = "torvalds/linux drivers/pci/pcie/aer.c"

#: in the order they are tried: the first rule in breach names the verdict
DEFAULT_RULES: tuple[Rule, ...] = (
    # -- rails: RDMA port counters (IB and RoCE), netdev statistics, PCIe AER, optics
    Rule("ib.symbol_error.ber", "rail", "symbol_error", "rate", 120.0, 3600.0, "per hour",
         NVSENTINEL + ": symbol_error_fatal velocity > 120/hour, the IBTA BER limit", per_s=3600.0,
         min_polls=2, min_span_s=60.0),
    Rule("ib.link_error_recovery.rate", "rail", "link_error_recovery", "rate", 5.0, 600.0, "per minute",
         NVSENTINEL + ": link_error_recovery velocity > 5/minute (link retraining)", per_s=60.0,
         min_polls=2, min_span_s=60.0),
    Rule("ib.port_rcv_errors.rate", "rail", "port_rcv_errors", "rate", 10.0, 60.0, "per second",
         NVSENTINEL + ": port_rcv_errors velocity > 10/second", per_s=1.0, min_polls=2, min_span_s=5.0),
    Rule("ib.local_ack_timeout_err.rate", "rail", "local_ack_timeout_err", "rate", 1.0, 60.0, "per second",
         NVSENTINEL + ": local_ack_timeout_err velocity > 1/second", per_s=1.0, min_polls=2, min_span_s=10.0),
    # a 4-bit counter of link integrity failures past the port's own limit: NVSentinel makes any
    # increment fatal; each increment is the port's own verdict, not a noisy reading
    Rule("ib.local_link_integrity_errors.any", "rail", "local_link_integrity_errors", "count", 0.0, 600.0,
         "per 600 s", NVSENTINEL + ": local_link_integrity_errors delta > 0", min_polls=1),
    Rule("ib.link_downed.flap", "rail", "link_downed", "count", 2.0, 43200.0, "per 12 h", GPUD_FLAP, min_polls=3),
    Rule("eth.carrier_changes.flap", "rail", "carrier_changes", "count", 5.0, 43200.0, "per 12 h",
         GPUD_FLAP + "; one flap is two carrier changes (down, up); " + NVSENTINEL + " breaches at delta > 2",
         min_polls=3),
    # NVSentinel lists rx_crc_errors with no default threshold: the IB counter of the same fault
    # (port_rcv_errors: CRC / malformed packets) lends its rate
    Rule("eth.rx_crc_errors.rate", "rail", "rx_crc_errors", "rate", 10.0, 60.0, "per second",
         NVSENTINEL + ": port_rcv_errors velocity > 10/second, applied to rx_crc_errors", per_s=1.0,
         min_polls=2, min_span_s=5.0),
    Rule("pcie.aer_nonfatal.any", "rail", "aer_nonfatal", "count", 0.0, 3600.0, "per hour",
         AER_C + ": aer_dev_nonfatal counts uncorrectable errors the device survived", min_polls=1),
    Rule("pcie.aer_correctable.burst", "rail", "aer_correctable", "rate", 10.0, 60.0, "per minute",
         AER_C + ": aer_ratelimit lets 10 reports per 5 s through; 10 a minute is past a trend", per_s=60.0,
         min_polls=2, min_span_s=10.0),
    Rule("optics.module_temp.near_crit", "rail", "module_temp_c", "gauge_margin", 0.0, 0.0, "°C",
         "torvalds/linux drivers/net/ethernet/mellanox/mlx5/core/hwmon.c: temp*_crit is the MTMP "
         "temp_threshold_hi; linkpass drains 5 °C before it", min_polls=2, limit_counter="module_temp_crit_c",
         margin=5.0),
    # -- GPUs: NVML, PCIe AER (sysfs and kernel log)
    Rule("gpu.row_remap_failure", "gpu", "row_remap_failure", "gauge", 1.0, 0.0, "flag",
         NV_MEM + ": a row-remapping failure: the GPU should be drained and reset, then replaced", min_polls=2),
    Rule("gpu.row_remap_pending", "gpu", "row_remap_pending", "gauge", 1.0, 0.0, "flag",
         NV_MEM + ": a pending row remap takes effect at the next GPU reset", min_polls=2),
    Rule("gpu.retired_pages_pending", "gpu", "retired_pages_pending", "gauge", 1.0, 0.0, "flag",
         NV_MEM + " (dynamic page retirement): pages pending retirement need a reset", min_polls=2),
    Rule("gpu.nvlink_replay.any", "gpu", "nvlink_replay", "count", 0.0, 600.0, "per 600 s",
         DCGM_LIMITS + ": DCGM_LIMIT_MAX_NVLINK_ERROR 1 (replay errors fail at >= 1)", min_polls=1),
    Rule("gpu.nvlink_recovery.any", "gpu", "nvlink_recovery", "count", 0.0, 600.0, "per 600 s",
         DCGM_LIMITS + ": DCGM_LIMIT_MAX_NVLINK_ERROR 1 (recovery errors fail at >= 1)", min_polls=1),
    Rule("gpu.nvlink_crc_flit.rate", "gpu", "nvlink_crc_flit", "rate", 100.0, 60.0, "per second",
         DCGM_LIMITS + ": DCGM_LIMIT_MAX_NVLINK_CRC_ERROR 100/s", per_s=1.0, min_polls=2, min_span_s=5.0),
    Rule("gpu.pcie_replay.rate", "gpu", "pcie_replay", "rate", 8.0, 600.0, "per minute",
         DCGM_LIMITS + ": DCGM_LIMIT_MAX_PCIREPLAY_RATE 8 per minute", per_s=60.0, min_polls=2, min_span_s=60.0),
    # NVIDIA publishes no corrected-ECC rate; DCGM's DCGM_LIMIT_MAX_SBE_RATE 10 is marked "dummy
    # value"; it is used as a per-minute rate so that only a storm of corrected errors counts
    Rule("gpu.ecc_volatile_corrected.rate", "gpu", "ecc_volatile_corrected", "rate", 10.0, 600.0, "per minute",
         DCGM_LIMITS + ": DCGM_LIMIT_MAX_SBE_RATE 10 (a placeholder there; no NVIDIA guidance)", per_s=60.0,
         min_polls=2, min_span_s=60.0),
    Rule("gpu.aer_nonfatal.any", "gpu", "aer_nonfatal", "count", 0.0, 3600.0, "per hour",
         AER_C + ": aer_dev_nonfatal counts uncorrectable errors the device survived", min_polls=1),
    Rule("gpu.aer_correctable.burst", "gpu", "aer_correctable", "rate", 10.0, 60.0, "per minute",
         AER_C + ": aer_ratelimit lets 10 reports per 5 s through; 10 a minute is past a trend", per_s=60.0,
         min_polls=2, min_span_s=10.0),
    # a corrected Data Link Layer error on the GPU's link is the link retrying TLPs (replay timer,
    # replay-number rollover, bad TLP/DLLP); one kernel-log record is the kernel's own report of
    # the AER status register, not a noisy read.  Case: wilicc/gpu-burn#1 (corpus), a Replay Timer
    # Timeout 104 s before a surprise link-down and Xid 79
    Rule("gpu.aer_log.dll_corrected", "gpu", "aer_log_corrected_dll", "count", 0.0, 600.0, "per 600 s",
         AER_C + " (aer_error_layer: Data Link Layer bits 6-8, 12) and PCIe Base Spec 3.6.2 (replay); "
         "case https://github.com/wilicc/gpu-burn/issues/1", min_polls=1),
    Rule("gpu.aer_dll_corrected.any", "gpu", "aer_correctable_dll", "count", 0.0, 600.0, "per 600 s",
         AER_C + " (aer_dev_correctable: BadTLP, BadDLLP, Rollover, Timeout lines of the GPU and the ports above "
         "it); the same evidence as gpu.aer_log.dll_corrected", min_polls=1),
    Rule("gpu.aer_log.corrected_burst", "gpu", "aer_log_corrected", "count", 9.0, 60.0, "per 60 s",
         AER_C + ": aer_ratelimit (10 per 5 s); linkpass.core.evidence.pcie BURST_COUNT in BURST_WINDOW_S",
         min_polls=1),
    Rule("gpu.temp.near_slowdown", "gpu", "gpu_temp_c", "gauge_margin", 0.0, 0.0, "°C",
         "NVML nvmlDeviceGetTemperatureThreshold(NVML_TEMPERATURE_THRESHOLD_SLOWDOWN); linkpass acts 3 °C before it",
         min_polls=2, limit_counter="gpu_temp_slowdown_c", margin=3.0),
)


@dataclass
class _Series:
    """One counter of one subject: raw last reading, increases since the first reading."""

    last_raw: float | None = None
    last_t: int | None = None
    cum: float = 0.0
    base_t: int | None = None  # when the current baseline started (first read, reset, wrap)
    points: deque = field(default_factory=deque)  # (t_ns, cum) after each poll
    rises: deque = field(default_factory=deque)   # t_ns of polls in which it rose
    over: int = 0  # gauges: consecutive polls past a threshold (per rule, see _gauge_runs)


@dataclass
class _Subject:
    at_risk: bool = False
    verdict: RiskVerdict | None = None
    dirty_t: int | None = None  # last poll in which the verdict's counter rose or a rule was in breach
    rates: dict = field(default_factory=dict)  # rule id -> last measured value


def _width(counter: str) -> tuple[int, str] | None:
    return COUNTER_WIDTHS.get(counter)


class RiskTracker:
    """Keeps the counters' history and decides.

    Args:
        rules: the rules (default :data:`DEFAULT_RULES`); tried in order.
        clean_hold_s: seconds a subject at risk must stay clean (its verdict's counter read
            and not rising, no rule in breach) before it is declared clean again.
    """

    def __init__(self, rules: Iterable[Rule] = DEFAULT_RULES, *, clean_hold_s: float = 600.0):
        self.rules = tuple(rules)
        for r in self.rules:
            if r.kind not in KINDS or r.mode not in ("rate", "count", "gauge", "gauge_margin"):
                raise ValueError(f"risk rule {r.id}: kind {r.kind!r} / mode {r.mode!r} unknown")
        self.clean_hold_s = float(clean_hold_s)
        self._by_counter: dict[tuple[str, str], list[Rule]] = {}
        for r in self.rules:
            self._by_counter.setdefault((r.kind, r.counter), []).append(r)
        self._keep_s: dict[tuple[str, str], float] = {
            k: max(r.window_s for r in rs) for k, rs in self._by_counter.items()}
        self._series: dict[tuple[str, int, str], _Series] = {}
        self._subjects: dict[tuple[str, int], _Subject] = {}
        self._problems: set[tuple[str, int, str, str]] = set()
        self._gauge_runs: dict[tuple[str, int, str], int] = {}  # (kind, subject, rule id) -> polls past
        self._rose: set[tuple[str, int, str]] = set()  # counters that rose in the poll being judged

    # -- source problems

    def missing(self, kind: str, subject: int, counter: str, source: str, t_ns: int, problem: str,
                detail: str) -> list[SourceProblem]:
        """Record that a reading could not be had; the problem once until the source reads well."""
        return self._problem(SourceProblem(kind, subject, counter, source, problem, detail, t_ns))

    def _problem(self, p: SourceProblem) -> list[SourceProblem]:
        key = (p.kind, p.subject, p.counter, p.problem)
        if key in self._problems:
            return []
        self._problems.add(key)
        return [p]

    def _healthy(self, kind: str, subject: int, counter: str, keep: str | None = None) -> None:
        for pr in PROBLEMS:
            if pr != keep:
                self._problems.discard((kind, subject, counter, pr))

    # -- samples

    def observe(self, samples: Iterable[CounterSample] | Iterable[CounterSample | SourceProblem],
                t_ns: int) -> tuple[list[RiskVerdict], list[SourceProblem]]:
        """Feed one poll (samples, and source problems the adapter met); return the changes.

        Returns:
            (verdicts, problems): verdicts only for subjects whose state changed in this poll;
            problems only the first time each (kind, subject, counter, problem) is seen since
            the source last read well.
        """
        problems: list[SourceProblem] = []
        self._rose: set[tuple[str, int, str]] = set()
        touched: dict[tuple[str, int], set[str]] = {}
        gauges: dict[tuple[str, int], dict[str, float]] = {}
        for s in samples:
            if isinstance(s, SourceProblem):
                problems += self._problem(s)
                continue
            if s.kind not in KINDS:
                continue
            v = s.value
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or (v < 0 and s.counter not in GAUGES)):  # a temperature may be below 0, a count not
                problems += self._problem(SourceProblem(s.kind, s.subject, s.counter, s.source, "garbage",
                                                        f"{s.source}: {v!r} is not a counter value", s.t_ns))
                continue
            touched.setdefault((s.kind, s.subject), set()).add(s.counter)
            if s.counter in GAUGES:
                gauges.setdefault((s.kind, s.subject), {})[s.counter] = float(v)
                self._healthy(s.kind, s.subject, s.counter)
                continue
            problems += self._cumulative(s)
        verdicts: list[RiskVerdict] = []
        for key in sorted(set(touched) | {k for k, st in self._subjects.items() if st.at_risk}):
            v = self._judge(key, touched.get(key, set()), gauges.get(key, {}), t_ns)
            if v is not None:
                verdicts.append(v)
        return verdicts, problems

    def _cumulative(self, s: CounterSample) -> list[SourceProblem]:
        key = (s.kind, s.subject, s.counter)
        ser = self._series.setdefault(key, _Series())
        v = float(s.value)
        out: list[SourceProblem] = []
        if ser.last_raw is None:
            ser.last_raw, ser.last_t, ser.base_t = v, s.t_ns, s.t_ns
            ser.points.append((s.t_ns, ser.cum))
            self._healthy(*key)
            return out
        if s.t_ns <= (ser.last_t or 0):
            return out  # a reading no newer than the last: nothing to learn
        w = _width(s.counter)
        if v < ser.last_raw:
            top = float(2 ** w[0] - 1) if w else None
            wrapped = bool(w and w[1] == "wrap" and ser.last_raw > top - top / 4 and v < top / 4)
            pr = "wrap" if wrapped else "reset"
            how = (f"went from {ser.last_raw:.0f} to {v:.0f}: a wrap at 2^{w[0]}" if wrapped
                   else f"went back from {ser.last_raw:.0f} to {v:.0f} (counter reset)")
            out += self._problem(SourceProblem(s.kind, s.subject, s.counter, s.source, pr,
                                               f"{s.source}: {how}; re-baselined, no verdict from this step", s.t_ns))
            self._healthy(*key, keep=pr)
            ser.last_raw, ser.last_t, ser.base_t = v, s.t_ns, s.t_ns
            # the history before the step stays (its increases were real); the window restarts
            ser.points.clear()
            ser.rises.clear()
            ser.points.append((s.t_ns, ser.cum))
            return out
        pinned = bool(w and w[1] == "saturate" and v >= 2 ** w[0] - 1)
        self._healthy(*key, keep="saturated" if pinned else None)
        if pinned:
            out += self._problem(SourceProblem(s.kind, s.subject, s.counter, s.source, "saturated",
                                               f"{s.source}: pinned at {v:.0f} (all ones, {w[0]} bit): its rate is no "
                                               "longer known until it is cleared", s.t_ns))
        if v > ser.last_raw:
            ser.cum += v - ser.last_raw
            ser.rises.append(s.t_ns)
            self._rose.add(key)
        ser.last_raw, ser.last_t = v, s.t_ns
        ser.points.append((s.t_ns, ser.cum))
        keep_ns = int(self._keep_s.get((s.kind, s.counter), 0.0) * 1e9)
        while len(ser.points) > 2 and ser.points[1][0] <= s.t_ns - keep_ns:
            ser.points.popleft()
        while ser.rises and ser.rises[0] <= s.t_ns - keep_ns:
            ser.rises.popleft()
        return out

    def _measure(self, r: Rule, kind: str, subject: int, t_ns: int) -> tuple[float, bool] | None:
        """(measured value, in breach) of a counter rule, or None without history."""
        ser = self._series.get((kind, subject, r.counter))
        if ser is None or not ser.points:
            return None
        start = t_ns - int(r.window_s * 1e9)
        base = None
        for t, c in ser.points:  # the last point at or before the window's start, else the first
            if t <= start:
                base = (t, c)
            else:
                break
        if base is None:
            base = ser.points[0]
        increase = ser.points[-1][1] - base[1]
        rises = sum(1 for t in ser.rises if t > max(start, base[0]))
        if r.mode == "count":
            return increase, increase > r.threshold and rises >= r.min_polls
        span_s = (ser.points[-1][0] - base[0]) / 1e9
        if span_s <= 0:
            return 0.0, False
        rate = increase / span_s * r.per_s
        return rate, rate > r.threshold and rises >= r.min_polls and span_s >= r.min_span_s

    def _judge(self, key: tuple[str, int], counters: set[str], gauges: dict[str, float],
               t_ns: int) -> RiskVerdict | None:
        kind, subject = key
        st = self._subjects.setdefault(key, _Subject())
        first: tuple[Rule, float] | None = None
        for r in self.rules:
            if r.kind != kind:
                continue
            if r.mode in ("gauge", "gauge_margin"):
                if r.counter not in gauges:
                    continue  # no reading this poll: the run of polls past the threshold is unknown
                val = gauges[r.counter]
                if r.mode == "gauge":
                    past = val >= r.threshold
                else:
                    lim = gauges.get(r.limit_counter)
                    if lim is None:
                        continue
                    past = val >= lim - r.margin
                rk = (kind, subject, r.id)
                self._gauge_runs[rk] = self._gauge_runs.get(rk, 0) + 1 if past else 0
                st.rates[r.id] = val
                breach = self._gauge_runs[rk] >= r.min_polls
            else:
                if r.counter not in counters:
                    continue
                m = self._measure(r, kind, subject, t_ns)
                if m is None:
                    continue
                st.rates[r.id] = m[0]
                breach = m[1]
            if breach:
                st.dirty_t = t_ns
                if first is None:
                    first = (r, st.rates[r.id])
        if st.at_risk and st.verdict is not None:
            if (kind, subject, st.verdict.counter) in self._rose:
                st.dirty_t = t_ns
        if not st.at_risk and first is not None:
            r, val = first
            st.at_risk = True
            st.verdict = RiskVerdict(kind, subject, True, r.id, r.counter, round(val, 3), r.unit, r.window_s,
                                     r.threshold_text(), r.citation, t_ns,
                                     f"{kind} {subject} at risk: {r.counter} {val:.3g} {r.unit} "
                                     f"(threshold {r.threshold_text()}; rule {r.id})")
            return st.verdict
        # clean only on fresh evidence: a subject whose verdict counter was not read in this poll
        # (its device gone, its source timing out) is not known to be clean
        seen = st.verdict is not None and (st.verdict.counter in counters or st.verdict.counter in gauges)
        if (st.at_risk and seen and st.dirty_t is not None
                and t_ns - st.dirty_t >= int(self.clean_hold_s * 1e9)):
            old = st.verdict
            st.at_risk = False
            st.verdict = None
            rate = float(st.rates.get(old.rule, 0.0)) if old else 0.0
            return RiskVerdict(kind, subject, False, old.rule if old else "", old.counter if old else "",
                               round(rate, 3), old.unit if old else "", old.window_s if old else 0.0,
                               old.threshold if old else "", old.citation if old else "", t_ns,
                               f"{kind} {subject} clean again: {self.clean_hold_s:g} s with no rule in breach "
                               f"(was {old.rule if old else '?'})")
        return None

    def status(self) -> dict:
        """JSON-able: ``{"rail": {"0": {"at_risk": bool, "verdict": {...} | None, "rates":
        {rule id: last measured value}}}, "gpu": {...}, "problems": [[kind, subject, counter,
        problem], ...]}``."""
        out: dict = {"rail": {}, "gpu": {}}
        for (kind, subject), st in sorted(self._subjects.items()):
            out[kind][str(subject)] = {"at_risk": st.at_risk,
                                       "verdict": st.verdict.to_json() if st.verdict else None,
                                       "rates": {k: round(v, 3) for k, v in sorted(st.rates.items())}}
        out["problems"] = [list(p) for p in sorted(self._problems, key=str)]
        return out


# -- kernel-log AER records -> counters

#: correctable AER bits of the Data Link Layer that mean the link retried TLPs (aer.c
#: aer_error_layer: Bad TLP 6, Bad DLLP 7, Rollover 8, Replay Timer Timeout 12; bit 13, Advisory
#: Non-Fatal, is left out: it is the Transaction Layer's advisory of another error)
DLL_RETRY_BITS = (6, 7, 8, 12)


#: their names as aer.c prints them (both eras: "Replay Timer Timeout" / "Timeout", ...), for
#: kernel-log summaries and the aer_dev_correctable lines
DLL_RETRY_NAMES: tuple[str, ...] = tuple(n for b in DLL_RETRY_BITS for n in CORRECTABLE_ERRORS[b])


def _dll_names() -> tuple[str, ...]:
    return DLL_RETRY_NAMES


class AerLogCounter:
    """Corrected-AER kernel-log incidents (``code "aer:corrected"``, from
    :func:`linkpass.core.classify.classify_report` or the kmsg follower's
    :class:`~linkpass.core.model.DeviceIncident`) -> running counts per GPU, as
    :class:`CounterSample` ``aer_log_corrected`` (all corrected records) and
    ``aer_log_corrected_dll`` (those naming a Data Link Layer retry error).

    Args:
        subjects: PCI bus id -> (kind, subject): the GPU (or NIC of a rail) itself *and* the
            PCIe ports above it (the root port logs errors of the link below it, as in the
            corpus case); see :meth:`linkpass.adapters.counters.CounterPoller.aer_subjects`.
    """

    def __init__(self, subjects: dict[str, tuple[str, int]]):
        self.subjects = dict(subjects)
        self.counts: dict[tuple[str, int, str], int] = {}
        self._dll = _dll_names()

    def samples(self, t_ns: int) -> list[CounterSample]:
        """The current counts of every subject (also those with none yet: 0), for one poll."""
        out = []
        for kind, subject in sorted(set(self.subjects.values())):
            for c in ("aer_log_corrected", "aer_log_corrected_dll"):
                out.append(CounterSample(kind, subject, c, float(self.counts.get((kind, subject, c), 0)), t_ns, "kmsg"))
        return out

    def record(self, code: str, device: str | None, summary: str, t_ns: int, times: int = 1) -> list[CounterSample]:
        """Count one classified record (``times`` occurrences of it); returns the new counts of
        the subject it names (empty: not a corrected AER record, or a device not watched)."""
        if code != "aer:corrected" or not device or device not in self.subjects:
            return []
        kind, subject = self.subjects[device]
        k = (kind, subject, "aer_log_corrected")
        self.counts[k] = self.counts.get(k, 0) + times
        out = [CounterSample(kind, subject, "aer_log_corrected", float(self.counts[k]), t_ns, f"kmsg:{device}")]
        kd = (kind, subject, "aer_log_corrected_dll")
        if any(n in summary for n in self._dll):
            self.counts[kd] = self.counts.get(kd, 0) + times
        out.append(CounterSample(kind, subject, "aer_log_corrected_dll", float(self.counts.get(kd, 0)), t_ns,
                                 f"kmsg:{device}"))
        return out

    def incident(self, inc) -> list[CounterSample]:
        """Count a :class:`~linkpass.core.model.DeviceIncident` (backlog records too: a count
        is history, not an action)."""
        return self.record(inc.code, inc.device, inc.summary or "", inc.t_ns)


def log_timeline(lines: list[str], subjects: dict[str, tuple[str, int]], topology=None
                 ) -> list[tuple[float, list[CounterSample], list]]:
    """A captured kernel log -> ``[(ts_s, samples, incidents_at_ts)]`` in time order: each
    corrected-AER occurrence becomes the counts after it (:class:`AerLogCounter`), each other
    incident is listed at its time (the failure a benchmark measures lead time to).  ``ts_s``
    is the log's own stamp in seconds; lines without one are skipped.  The first entry holds
    the zero counts, stamped 1 µs before the first record (a live daemon feeds
    :meth:`AerLogCounter.samples` every poll from its start, which gives the same baseline).

    Raises:
        ValueError: the classifier failed on the log (its one-line error).
    """
    from linkpass.core.classify import classify_report
    from linkpass.core.logparse import parse_lines

    rep = classify_report(lines, topology)
    if rep.error:
        raise ValueError(rep.error)
    ts_of: dict[int, float] = {}
    for rec in parse_lines(lines).records:
        if rec.ts is not None:
            for n in range(rec.first_line, rec.last_line + 1):
                ts_of[n] = rec.ts
    events: list[tuple[float, int, object]] = []
    for inc in rep.incidents:
        for n in inc.lines or (inc.first_line,):
            if n in ts_of:
                events.append((ts_of[n], n, inc))
    events.sort(key=lambda e: (e[0], e[1]))
    counter = AerLogCounter(subjects)
    out: list[tuple[float, list[CounterSample], list]] = []
    if events:  # the counts before the first record are 0: the tracker's baseline
        t0 = events[0][0] - 1e-6
        out.append((t0, counter.samples(int(t0 * 1e9)), []))
    for ts, _, inc in events:
        t_ns = int(ts * 1e9)
        got = counter.record(inc.code, inc.device, inc.summary, t_ns)
        if got:
            out.append((ts, got, []))
        else:
            out.append((ts, [], [inc]))
    return out
