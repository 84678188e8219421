"""``linkpass bench``: run the benchmarks of the source tree's ``bench/`` directory.

    linkpass bench detect --mode blackhole --trials 10 --json bench/results/detect_bfd_blackhole.json

``bench detect`` runs ``bench/detect_bfd.py`` (linkpass detection next to FRR's bfdd on the
emulated fabric).  The benchmarks live in the source tree, not in the installed package: when
``bench/`` is not next to the ``linkpass`` package, the command says so and exits 2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def bench_dir() -> Path | None:
    """The repository's ``bench/`` directory (next to the ``linkpass`` package), or None."""
    d = Path(__file__).resolve().parents[2] / "bench"
    return d if (d / "detect_bfd.py").is_file() and (d / "_cluster.py").is_file() else None


def _load(name: str):
    d = bench_dir()
    if d is None:
        return None
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    spec = importlib.util.spec_from_file_location(f"linkpass_bench_{name}", d / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_detect(args) -> int:
    mod = _load("detect_bfd")
    if mod is None:
        print("linkpass bench: bench/ not found next to the linkpass package "
              f"({Path(__file__).resolve().parents[1]}); the benchmarks need the source tree "
              "(run from a git checkout, e.g. `.venv/bin/linkpass bench detect` in the repository)", file=sys.stderr)
        return 2
    return mod.main(args=args)


def add_detect_options(ap) -> None:
    """The options of ``bench detect`` (shared with bench/detect_bfd.py's own parser)."""
    ap.add_argument("--mode", default="blackhole", help="admin-down | carrier-loss | blackhole | loss:PCT | flap:MS:N (default blackhole)")
    ap.add_argument("--trials", type=int, default=10, help="cuts (default 10)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--interval-ms", type=int, default=10, help="probe / BFD interval (default 10)")
    ap.add_argument("--multiplier", type=int, default=3, help="detect multiplier (default 3)")
    ap.add_argument("--hold-down-ms", type=int, default=200)
    ap.add_argument("--timeout-s", type=float, default=3.0, help="a cut not detected in this time is a miss (default 3)")
    ap.add_argument("--bfd-poll-ms", type=float, default=2.0, help="bfdd vty poll period during a cut (default 2)")
    ap.add_argument("--settle-ms", type=float, default=300.0, help="quiet time between trials (default 300)")
    ap.add_argument("--no-bfd", action="store_true", help="linkpass only (no frr install, no bfdd)")
    ap.add_argument("--damping", action="store_true",
                    help="keep flap damping on as configured by default (off otherwise: cuts a second apart would be flaps)")
    ap.add_argument("--burst-s", type=float, default=0.0,
                    help="keep the fault (e.g. a flap:MS:N burst) this long after the cut before healing (default 0: heal once seen)")
    ap.add_argument("--name", default="bnbfd", help="fabric name (default bnbfd)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here")


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="benchmarks on the emulated fabric (needs the source tree and root)")
    bs = b.add_subparsers(dest="bench_cmd", required=True)
    d = bs.add_parser("detect", help="detection/reroute latency under cuts, side by side with FRR bfdd")
    add_detect_options(d)
    d.set_defaults(func=cmd_detect)
