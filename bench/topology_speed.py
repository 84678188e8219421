"""Benchmark: how long `linkpass topology` takes on captured 8-GPU sysfs trees.

Builds the hand-made trees of tests/unit/topology/sysfs_trees.py (real directories, files and
symlinks shaped like the kernel's), then measures
  * in-process: read_sysfs + analyse + to_json (median / max over --runs), and
  * end to end: `linkpass topology --sysfs-root DIR --json` as a new process (Python start-up and
    imports included), median / max over --runs.
Prints a table and writes JSON.  Target (issue 3): under 0.5 s on an 8-GPU, 12-NIC tree.

    .venv/bin/python bench/topology_speed.py --runs 10 --json bench/results/topology_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "topology"))

import sysfs_trees  # noqa: E402

from topology.affinity import analyse, to_json  # noqa: E402
from topology.sysfs import read_sysfs  # noqa: E402

TARGET_S = 0.5


def measure(name: str, machine, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"lp-topo-{name}-") as d:
        sysfs_trees.build(d, machine)
        inproc = []
        for _ in range(runs):
            t0 = time.perf_counter()
            doc = to_json(analyse(read_sysfs(d)))
            inproc.append(time.perf_counter() - t0)
        e2e = []
        for _ in range(runs):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "linkpass.cli", "topology", "--sysfs-root", d, "--json"],
                               capture_output=True, text=True, cwd=ROOT)
            e2e.append(time.perf_counter() - t0)
            if p.returncode != 0:
                raise SystemExit(f"linkpass topology failed on {name}: {p.stderr[-500:]}")
    return {"tree": name, "gpus": len(doc["gpus"]), "nics": len(doc["nics"]), "rails": len(doc["rails"]),
            "inprocess_s": {"median": statistics.median(inproc), "max": max(inproc)},
            "cli_s": {"median": statistics.median(e2e), "max": max(e2e)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    rows = [measure("hgx_h100_ib", sysfs_trees.hgx_h100_ib()[0], a.runs),
            measure("dgx_a100_pxb_storage", sysfs_trees.dgx_a100_pxb_storage()[0], a.runs)]
    from rich.console import Console
    from rich.table import Table

    t = Table("tree", "GPUs", "NICs", "in-process median / max (ms)", "CLI median / max (ms)", f"target < {TARGET_S * 1000:.0f} ms")
    for r in rows:
        t.add_row(r["tree"], str(r["gpus"]), str(r["nics"]),
                  f"{r['inprocess_s']['median'] * 1e3:.1f} / {r['inprocess_s']['max'] * 1e3:.1f}",
                  f"{r['cli_s']['median'] * 1e3:.0f} / {r['cli_s']['max'] * 1e3:.0f}",
                  "ok" if r["cli_s"]["median"] < TARGET_S else "over")
    Console().print(t)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"schema": "linkpass.bench.topology_speed/v1", "runs": a.runs,
                                            "machine": {"python": platform.python_version(), "kernel": platform.release()},
                                            "trees": rows}, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
