"""Benchmark: the risk tracker (issue 18, part 5) on the counter fixture sequences.

  * lead time: for each failing sequence of tests/fixtures/counters/sequences.json (and the
    corpus kernel log gpuburn1_tesla_aer_replay_timeout_then_surprise_down_xid79.log), the time
    between the first at-risk verdict for the subject that fails and the failure itself;
  * false drains: at-risk verdicts on the sequences that carry no fault (goal 0);
  * daemon-side CPU: process time (all threads) of one CounterPoller.poll() + RiskTracker.observe()
    on a synthetic 8-rail 8-GPU host (sysfs tree in a temporary directory + the scripted fake
    NVML), per poll, and extrapolated to % of one core at one poll a second.  The fake NVML
    costs what a Python function call costs; a driver's NVML calls cost more (``--real-nvml``
    times the same reads through pynvml on this machine's GPUs, when it has any).

No fabric, no root.  Prints a table and writes JSON:

    .venv/bin/python bench/risk.py --polls 300 --json bench/results/risk.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linkpass.adapters.counters import CounterPoller, NvmlCounters  # noqa: E402
from linkpass.adapters.counters_fake import FakeNvml  # noqa: E402
from linkpass.core.risk import RiskTracker, log_timeline  # noqa: E402
from linkpass.lab import counter_trees as ct  # noqa: E402

SPEC = ROOT / "tests/fixtures/counters/sequences.json"
CORPUS_LOG = ROOT / "tests/fixtures/corpus/kernel_logs/gpuburn1_tesla_aer_replay_timeout_then_surprise_down_xid79.log"


def run_sequence(host: dict, name: str, seq: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="lp-risk-") as d:
        ct.build_host(d, host)
        nv = FakeNvml(ct.nvml_steps(seq, host))
        clock = [0]
        p = CounterPoller(ct.rail_sources(host), ct.gpu_sources(host), root=d, nvml=nv, clock=lambda: clock[0])
        tr = RiskTracker()
        flagged: list[dict] = []
        problems = 0
        written: dict = {}
        try:
            for n in range(seq["steps"]):
                clock[0] = int(n * seq["interval_s"] * 1e9)
                ct.write_step(d, host, seq, n, written)
                nv.n = n
                samples, probs = p.poll()
                v, pr = tr.observe([*samples, *probs], clock[0])
                problems += len(pr)
                flagged += [{"step": n, "t_s": n * seq["interval_s"], **x.to_json()} for x in v if x.at_risk]
        finally:
            p.close()
    out = {"sequence": name, "steps": seq["steps"], "interval_s": seq["interval_s"], "source_problems": problems,
           "at_risk": [{k: f[k] for k in ("t_s", "kind", "subject", "rule", "rate", "unit")} for f in flagged]}
    f = seq.get("failure")
    if f:
        t_fail = f["step"] * seq["interval_s"]
        first = next((x for x in flagged if (x["kind"], x["subject"]) == (f["kind"], f["subject"])), None)
        out.update(failure=f["what"], failure_t_s=t_fail,
                   lead_time_s=(t_fail - first["t_s"]) if first and first["t_s"] < t_fail else None,
                   rule=first["rule"] if first else None)
        out["false_drains"] = sum(1 for x in flagged if (x["kind"], x["subject"]) != (f["kind"], f["subject"]))
    else:
        expected = {tuple(e) for e in seq.get("expect_at_risk", [])}
        out["false_drains"] = sum(1 for x in flagged if (x["kind"], x["subject"]) not in expected)
        out["expected_flags"] = sorted(expected)
    return out


def run_corpus_log() -> dict:
    lines = CORPUS_LOG.read_text().splitlines(True)
    # the corpus log's GPU and the root port above it (bus 00 -> 02)
    subjects = {"0000:02:00.0": ("gpu", 0), "0000:00:02.0": ("gpu", 0)}
    tr = RiskTracker()
    flagged = failed = None
    rule = None
    for ts, samples, incs in log_timeline(lines, subjects):
        v, _ = tr.observe(samples, int(ts * 1e9))
        if flagged is None and any(x.at_risk for x in v):
            flagged = ts
            rule = next(x.rule for x in v if x.at_risk)
        if failed is None and any(i.code == "xid:79" for i in incs):
            failed = ts
    return {"sequence": "corpus:" + CORPUS_LOG.name, "failure": "Xid 79 (log line)", "rule": rule,
            "lead_time_s": round(failed - flagged, 3) if flagged is not None and failed is not None else None,
            "false_drains": 0}


def cpu_per_poll(polls: int, rails: int, gpus: int) -> dict:
    host = ct.synthetic_host(rails, gpus)
    seq = {"steps": polls, "interval_s": 1,
           "series": {f"rail:{r}:port_xmit_discards": {"base": 0, "rise": [[0, polls, 1]]} for r in range(rails)},
           "nvml": {str(g): {"ecc_corrected": {"base": 0, "rise": [[0, polls, 1]]}} for g in range(gpus)}}
    with tempfile.TemporaryDirectory(prefix="lp-risk-cpu-") as d:
        ct.build_host(d, host)
        nv = FakeNvml(ct.nvml_steps(seq, host))
        clock = [0]
        p = CounterPoller(ct.rail_sources(host), ct.gpu_sources(host), root=d, nvml=nv, clock=lambda: clock[0])
        tr = RiskTracker()
        per: list[float] = []
        wall: list[float] = []
        n_samples = 0
        written: dict = {}
        try:
            for n in range(polls):
                ct.write_step(d, host, seq, n, written)  # not measured: the kernel's side
                nv.n = n
                clock[0] = n * 1_000_000_000
                c0, w0 = time.process_time(), time.perf_counter()
                samples, probs = p.poll()
                tr.observe([*samples, *probs], clock[0])
                per.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
                n_samples = len(samples)
        finally:
            p.close()
    med = statistics.median(per)
    return {"rails": rails, "gpus": gpus, "polls": polls, "samples_per_poll": n_samples,
            "cpu_ms_per_poll_median": round(med * 1e3, 3),
            "cpu_ms_per_poll_p90": round(sorted(per)[int(0.9 * (len(per) - 1))] * 1e3, 3),
            "wall_ms_per_poll_median": round(statistics.median(wall) * 1e3, 3),
            "core_pct_at_1hz": round(med * 100.0, 3)}


def real_nvml(polls: int) -> dict | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as e:  # no nvidia-ml-py, no driver
        return {"error": f"{type(e).__name__}: {e}"}
    r = NvmlCounters(pynvml)
    per, got = [], []
    for _ in range(polls):
        c0 = time.process_time()
        w0 = time.perf_counter()
        out = [r.read(i, time.monotonic_ns) for i in range(count)]
        per.append((time.process_time() - c0, time.perf_counter() - w0))
        got = out
    samples = sum(len(s) for s, _ in got)
    problems = [p for _, b in got for p in b]
    return {"gpus": count, "name": pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if count else None,
            "samples_per_poll": samples, "problems": problems[:5],
            "cpu_ms_per_poll_median": round(statistics.median(c for c, _ in per) * 1e3, 3),
            "wall_ms_per_poll_median": round(statistics.median(w for _, w in per) * 1e3, 3),
            "cpu_ms_per_gpu": round(statistics.median(c for c, _ in per) * 1e3 / max(count, 1), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--polls", type=int, default=300, help="polls of the synthetic host for the CPU figure")
    ap.add_argument("--rails", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--real-nvml", action="store_true", help="also time the NVML reads on this machine's GPUs")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    spec = ct.load(SPEC)
    seqs = [run_sequence(spec["host"], name, seq) for name, seq in spec["sequences"].items()]
    seqs.append(run_corpus_log())
    cpu = cpu_per_poll(a.polls, a.rails, a.gpus)
    res = {"sequences": seqs, "cpu": cpu,
           "real_nvml": real_nvml(min(a.polls, 100)) if a.real_nvml else None,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                       "loadavg": os.getloadavg()}}
    print(f"{'sequence':58} {'failure':44} {'lead s':>7} {'false':>5}  rule")
    for s in seqs:
        lead = "-" if s.get("lead_time_s") is None else f"{s['lead_time_s']:.0f}"
        print(f"{s['sequence'][:58]:58} {(s.get('failure') or 'none')[:44]:44} {lead:>7} {s['false_drains']:>5}  "
              f"{s.get('rule') or ','.join(x['rule'] for x in s.get('at_risk', [])) or '-'}")
    clean = [s for s in seqs if not s.get("failure") and not s.get("expected_flags")]
    res["false_drains_on_clean"] = sum(len(s["at_risk"]) for s in clean)
    print(f"false drains on the {len(clean)} sequences without a fault ({', '.join(s['sequence'] for s in clean)}): "
          f"{res['false_drains_on_clean']}")
    print(f"poll + observe, {cpu['rails']} rails / {cpu['gpus']} GPUs, {cpu['samples_per_poll']} samples: "
          f"{cpu['cpu_ms_per_poll_median']} ms CPU median (p90 {cpu['cpu_ms_per_poll_p90']}), "
          f"{cpu['core_pct_at_1hz']} % of a core at 1 Hz")
    if res["real_nvml"]:
        print(f"real NVML: {json.dumps(res['real_nvml'])}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
