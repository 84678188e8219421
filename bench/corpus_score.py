"""The classifier's and the topology readers' score on the corpus (tests/fixtures/corpus).

    .venv/bin/python bench/corpus_score.py [--corpus DIR] [--json PATH] [--list]

Logs (``"kind": "log"`` in expected.json, folders kernel_logs and nccl_errors): each file is read
as ``tests/unit/test_classify.py`` reads it and classified; it counts as

- *roots right* when its root incidents (domain, device, action, in order) are expected.json's;
- *full right* when every incident (domain, device, code, action, remedy, secondary_of, in
  order) is.

Topology entries (``"kind": "topology"``: ib_tools, nccl_topo, nvsmi_topo) are read with
``topology.importers.parse_text`` and ``topology.affinity.analyse``; an entry is right when every
field expected.json gives is: ``gpu_count`` (when not null), ``gpu_nearest_nics``,
``compute_nics`` (the NICs with role compute, as a set), ``non_compute_nics`` (the other NICs, as
a set) and ``ports`` (state, link layer, rate, netdev of each port).

Prints a table per family and per folder; ``--list`` also names each file that is not right;
``--json`` writes the figures and the per-file results.  Not a test: it never fails on the score
(exit 0), only on a corpus it cannot read (exit 2).  No network, no root, a few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linkpass.core.classify import classify_report  # noqa: E402

LOG_FAMILIES = ("kernel_logs", "nccl_errors")
ROOT_FIELDS = ("domain", "device", "action")
FIELDS = ("domain", "device", "code", "action", "remedy", "secondary_of")


def score_log(path: Path, exp: dict) -> dict:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rep = classify_report(lines)
    got = [i.to_json() for i in rep.incidents]
    want = exp.get("incidents", [])
    roots = [{k: i[k] for k in ROOT_FIELDS} for i in got if i["secondary_of"] is None]
    want_roots = [{k: i[k] for k in ROOT_FIELDS} for i in want if i["secondary_of"] is None]
    full = [{k: i[k] for k in FIELDS} for i in got]
    want_full = [{k: i[k] for k in FIELDS} for i in want]
    return {"roots_right": rep.error is None and roots == want_roots, "full_right": rep.error is None and full == want_full,
            "error": rep.error, "skipped": len(rep.skipped), "got": full, "expected": want_full}


def score_topology(path: Path, rel: str, exp: dict) -> dict:
    from topology.affinity import analyse
    from topology.importers import parse_text

    checks: dict[str, bool] = {}
    try:
        topo = analyse(parse_text(path.read_text(encoding="utf-8", errors="replace"), rel))
    except Exception as e:  # noqa: BLE001 - a reader failure is a wrong entry, said with its reason
        return {"right": False, "checks": {}, "error": f"{type(e).__name__}: {e}"}
    if exp.get("gpu_count") is not None:
        checks["gpu_count"] = len(topo.gpus) == exp["gpu_count"]
    if "gpu_nearest_nics" in exp:
        checks["gpu_nearest_nics"] = {g.key: g.nearest_nics for g in topo.gpus} == exp["gpu_nearest_nics"]
    roles = {n.name: n.role for n in topo.nics}
    if exp.get("compute_nics") is not None:
        checks["compute_nics"] = {n for n, r in roles.items() if r == "compute"} == set(exp["compute_nics"])
    if exp.get("non_compute_nics") is not None:
        checks["non_compute_nics"] = {n for n, r in roles.items() if r != "compute"} == set(exp["non_compute_nics"])
    if "ports" in exp:
        got = {f"{n.name}/{p.port}": {"state": p.state, "link_layer": p.link_layer, "rate_gbps": p.rate_gbps, "netdev": p.netdev}
               for n in topo.nics for p in n.ports}
        checks["ports"] = got == exp["ports"]
    return {"right": all(checks.values()), "checks": checks, "error": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="score the classifier and the topology readers on the corpus")
    ap.add_argument("--corpus", default=str(ROOT / "tests" / "fixtures" / "corpus"))
    ap.add_argument("--json", metavar="PATH", help="write the figures and per-file results here")
    ap.add_argument("--list", action="store_true", help="name each file that is not right")
    args = ap.parse_args(argv)
    corpus = Path(args.corpus)
    try:
        expected = json.loads((corpus / "expected.json").read_text())
    except (OSError, ValueError) as e:
        print(f"corpus_score: cannot read {corpus / 'expected.json'}: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    files: dict[str, dict] = {}
    for rel, exp in sorted(expected.items()):
        path = corpus / rel
        if not path.is_file():
            files[rel] = {"kind": exp.get("kind"), "missing": True}
            continue
        if exp.get("kind") == "log":
            files[rel] = {"kind": "log", **score_log(path, exp)}
        elif exp.get("kind") == "topology":
            files[rel] = {"kind": "topology", **score_topology(path, rel, exp)}

    def folder(rel: str) -> str:
        return rel.split("/", 1)[0]

    logs = {r: f for r, f in files.items() if f["kind"] == "log"}
    topos = {r: f for r, f in files.items() if f["kind"] == "topology"}
    by_folder: dict[str, dict] = {}
    for rel, f in logs.items():
        d = by_folder.setdefault(folder(rel), {"kind": "log", "files": 0, "roots_right": 0, "full_right": 0})
        d["files"] += 1
        d["roots_right"] += bool(f.get("roots_right"))
        d["full_right"] += bool(f.get("full_right"))
    for rel, f in topos.items():
        d = by_folder.setdefault(folder(rel), {"kind": "topology", "files": 0, "right": 0})
        d["files"] += 1
        d["right"] += bool(f.get("right"))
    total_logs = {"files": len(logs), "roots_right": sum(bool(f.get("roots_right")) for f in logs.values()),
                  "full_right": sum(bool(f.get("full_right")) for f in logs.values())}
    total_topo = {"files": len(topos), "right": sum(bool(f.get("right")) for f in topos.values())}

    print(f"corpus: {corpus} ({len(files)} entries, {time.monotonic() - t0:.1f} s)")
    print(f"{'folder':<14} {'files':>5}  {'roots right':>12}  {'full right':>12}")
    for name in LOG_FAMILIES:
        d = by_folder.get(name)
        if d:
            print(f"{name:<14} {d['files']:>5}  {d['roots_right']:>7} ({d['roots_right'] / d['files']:4.0%})  "
                  f"{d['full_right']:>7} ({d['full_right'] / d['files']:4.0%})")
    if total_logs["files"]:
        print(f"{'logs, all':<14} {total_logs['files']:>5}  {total_logs['roots_right']:>7} "
              f"({total_logs['roots_right'] / total_logs['files']:4.0%})  {total_logs['full_right']:>7} "
              f"({total_logs['full_right'] / total_logs['files']:4.0%})")
    print(f"{'folder':<14} {'files':>5}  {'right':>12}")
    for name, d in sorted(by_folder.items()):
        if d["kind"] == "topology":
            print(f"{name:<14} {d['files']:>5}  {d['right']:>7} ({d['right'] / d['files']:4.0%})")
    if total_topo["files"]:
        print(f"{'topology, all':<14} {total_topo['files']:>5}  {total_topo['right']:>7} "
              f"({total_topo['right'] / total_topo['files']:4.0%})")
    missing = [r for r, f in files.items() if f.get("missing")]
    if missing:
        print(f"missing files: {len(missing)} (first: {missing[0]})")
    if args.list:
        for rel, f in files.items():
            if f["kind"] == "log" and not f.get("full_right"):
                what = "roots and full" if not f.get("roots_right") else "full"
                print(f"  wrong ({what}): {rel}" + (f"  error: {f['error']}" if f.get("error") else ""))
            elif f["kind"] == "topology" and not f.get("right"):
                bad = [k for k, v in f.get("checks", {}).items() if not v] or [f.get("error")]
                print(f"  wrong ({', '.join(map(str, bad))}): {rel}")
    if args.json:
        out = {"corpus": str(corpus), "logs": total_logs, "topology": total_topo, "folders": by_folder, "files": files}
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
