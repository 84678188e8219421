"""``linkpass bench``: run the benchmarks of the source tree's ``bench/`` directory.

    linkpass bench detect --mode blackhole --trials 10 --json bench/results/detect_bfd_blackhole.json

    linkpass bench snapshot --json bench/results/snapshot.json

``bench detect`` runs ``bench/detect_bfd.py`` (linkpass detection next to FRR's bfdd on the
emulated fabric); ``bench snapshot`` runs ``bench/snapshot.py`` (the hook's snapshots of an
unmodified FSDP2 job: step-time overhead, snapshot and restore time against state size, a
device fault under ``torchrun --max-restarts 1``; no fabric, no root); ``bench scale`` runs
``bench/scale_sim.py`` (the real probe schedule, filter and engine of 1,024-16,384 simulated
hosts on a simulated clock; no fabric, no root).  The benchmarks live in the source tree, not in the installed package: when
``bench/`` is not next to the ``linkpass`` package, the command says so and exits 2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from linkpass.cli.argtypes import float_range, int_list, int_range, one_line_errors
from linkpass.lab.fabric.spec import MAX_HOSTS, MAX_RAILS

#: ``bench scale --hosts``: each size at least 3 hosts; with ``--rails`` at least 2 the address
#: range (198.18.0.0/15, 131,072 addresses) holds at most 65,536 (bench/scale_sim.py checks the product).
SCALE_MAX_HOSTS = 65536


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
    sys.modules[spec.name] = mod  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(mod)
    return mod


def _missing(cmd: str) -> int:
    print("linkpass bench: bench/ not found next to the linkpass package "
          f"({Path(__file__).resolve().parents[1]}); the benchmarks need the source tree "
          f"(run from a git checkout, e.g. `.venv/bin/linkpass bench {cmd}` in the repository)", file=sys.stderr)
    return 2


def cmd_detect(args) -> int:
    mod = _load("detect_bfd")
    if mod is None:
        return _missing("detect")
    return mod.main(args=args)


def cmd_snapshot(args) -> int:
    mod = _load("snapshot") if bench_dir() is not None and (bench_dir() / "snapshot.py").is_file() else None
    if mod is None:
        return _missing("snapshot")
    return mod.main(args=args)


def cmd_scale(args) -> int:
    mod = _load("scale_sim") if bench_dir() is not None and (bench_dir() / "scale_sim.py").is_file() else None
    if mod is None:
        return _missing("scale")
    return mod.main(args=args)


def add_scale_options(ap) -> None:
    """The options of ``bench scale`` (shared with bench/scale_sim.py's own parser)."""
    ap.add_argument("--hosts", type=int_list(3, SCALE_MAX_HOSTS), default="1024,16384", help="cluster sizes, comma-separated (default 1024,16384)")
    ap.add_argument("--rails", type=int_range(2), default=8, help="rails per host (default 8)")
    ap.add_argument("--fault", default="blackhole", help="blackhole | loss:PCT, on one rail of one host (default blackhole)")
    ap.add_argument("--sample", type=int_range(0), default=16,
                    help="hosts simulated besides the faulted one and its 2 ring neighbours, drawn with --seed (default 16)")
    ap.add_argument("--seed", type=int, default=1, help="draws the faulted host, the sample and random loss (default 1)")
    ap.add_argument("--rtt-us", type=float_range(0, lo_open=True), default=30.0, help="round-trip time of a probe (default 30 us)")
    ap.add_argument("--window-s", type=float_range(0, lo_open=True), default=None,
                    help="simulated seconds after the fault (default 3.2 slow sweeps + 5 s; a blackhole run stops "
                    "once every simulated host has left the rail)")
    ap.add_argument("--full-engine-max", type=int_range(0), default=65536,
                    help="above this many hosts the faulted host's engine runs verdict-only (see bench/scale_sim.py)")
    ap.add_argument("--engine-calls", type=int_range(1), default=10, help="engine results timed per size (default 10)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here")


def add_detect_options(ap) -> None:
    """The options of ``bench detect`` (shared with bench/detect_bfd.py's own parser)."""
    ap.add_argument("--mode", default="blackhole", help="admin-down | carrier-loss | blackhole | loss:PCT | flap:MS:N (default blackhole)")
    ap.add_argument("--trials", type=int_range(1), default=10, help="cuts (default 10)")
    ap.add_argument("--hosts", type=int_range(2, MAX_HOSTS), default=2, help=f"emulated hosts, 2..{MAX_HOSTS} (default 2)")
    ap.add_argument("--rails", type=int_range(2, MAX_RAILS), default=2, help=f"rails per host, 2..{MAX_RAILS} (default 2)")
    ap.add_argument("--interval-ms", type=int_range(1), default=10, help="probe / BFD interval (default 10)")
    ap.add_argument("--multiplier", type=int_range(1, 255), default=3, help="detect multiplier (default 3)")
    ap.add_argument("--hold-down-ms", type=int_range(0), default=200)
    ap.add_argument("--timeout-s", type=float_range(0, lo_open=True), default=3.0, help="a cut not detected in this time is a miss (default 3)")
    ap.add_argument("--bfd-poll-ms", type=float_range(0, lo_open=True), default=2.0, help="bfdd vty poll period during a cut (default 2)")
    ap.add_argument("--settle-ms", type=float_range(0), default=300.0, help="quiet time between trials (default 300)")
    ap.add_argument("--no-bfd", action="store_true", help="linkpass only (no frr install, no bfdd)")
    ap.add_argument("--damping", action="store_true",
                    help="keep flap damping on as configured by default (off otherwise: cuts a second apart would be flaps)")
    ap.add_argument("--burst-s", type=float_range(0), default=0.0,
                    help="keep the fault (e.g. a flap:MS:N burst) this long after the cut before healing (default 0: heal once seen)")
    ap.add_argument("--name", default="bnbfd", help="fabric name (default bnbfd)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON here")


def add_snapshot_options(ap) -> None:
    """The options of ``bench snapshot`` (shared with bench/snapshot.py's own parser)."""
    ap.add_argument("--parts", default="a,b,c", help="which parts: a (overhead), b (sizes), c (device fault); default a,b,c")
    ap.add_argument("--every", type=int_range(1), default=25, help="(a), (c): a snapshot every N steps (default 25)")
    ap.add_argument("--epochs", type=int_range(1), default=2, help="(a), (c): the example's --epochs (default 2, its own)")
    ap.add_argument("--samples", type=int_range(1), default=8192, help="(a), (c): the example's --samples (default 8192, its own)")
    ap.add_argument("--batch-size", type=int_range(1), default=32, help="the example's --batch-size (default 32, its own)")
    ap.add_argument("--memory-every", type=int_list(1), default="5,10,25", help="(a), (c): in-memory snapshot intervals (steps), comma-separated: "
                    "the step-time cost of each, and a device fault of the sharded job at each (default 5,10,25)")
    ap.add_argument("--warmup", type=int_range(0), default=5, help="(a): step intervals left out of the figures (default 5)")
    ap.add_argument("--widths", type=int_list(1), default="256,1600,4096", help="(b): model widths, comma-separated (default 256,1600,4096: "
                    "about 1, 32, 205 MB of state)")
    ap.add_argument("--size-steps", type=int_range(1), default=10, help="(b): steps per job (default 10)")
    ap.add_argument("--size-every", type=int_range(1), default=4, help="(b): a snapshot every N steps (default 4)")
    ap.add_argument("--fault-frac", type=float_range(0, 1, lo_open=True, hi_open=True), default=0.4, help="(c): kill rank 1 at this share of the steps (default 0.4)")
    ap.add_argument("--rdzv", choices=("c10d", "static"), default="c10d",
                    help="(c): torchrun's rendezvous: c10d (default: --rdzv-backend c10d) or "
                    "static (--master-port P); both keep one store across the restart")
    ap.add_argument("--restart-timeout-s", type=float_range(0, lo_open=True), default=60.0, help="(c): a restarted group with no step this long "
                    "after the kill counts as failed (hung; stacks go to its log) and the pair is repeated (default 60)")
    ap.add_argument("--restart-retries", type=int_range(0), default=2, help="(c): repeat a failed torchrun restart up to N times")
    ap.add_argument("--device-fault-demo", choices=("auto", "off"), default="auto",
                    help="(c): auto (default): run `linkpass demo --scenario device-fault` with the FSDP2 example when "
                    "root; off: do not")
    ap.add_argument("--name", default="bnsnp", help="(c): fabric name of the device-fault demo (default bnsnp)")
    ap.add_argument("--timeout-s", type=float_range(0, lo_open=True), default=300.0, help="per job (default 300)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, reports, snapshots)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="benchmarks on the emulated fabric (needs the source tree and root)")
    bs = b.add_subparsers(dest="bench_cmd", required=True, metavar="detect|snapshot|scale")
    d = bs.add_parser("detect", help="detection/reroute latency under cuts, side by side with FRR bfdd")
    add_detect_options(d)
    d.set_defaults(func=cmd_detect)
    s = bs.add_parser("snapshot", help="the hook's snapshots of an unmodified FSDP2 job: step-time overhead next to a "
                      "synchronous torch.save, snapshot/restore time against state size, a device fault under torchrun "
                      "--max-restarts 1 (no root)")
    add_snapshot_options(s)
    s.set_defaults(func=cmd_snapshot)
    c = bs.add_parser("scale", help="simulation of 1,024-16,384 hosts on a simulated clock with the real schedule, probe "
                      "filter and engine: probes/s and CPU per host, detection time of a rail fault, notice fan-out (no root)")
    add_scale_options(c)
    c.set_defaults(func=cmd_scale)
    for p in (b, d, s, c):  # a bad value or an unknown option: one line naming it, exit 2, before any work
        one_line_errors(p)
    for p in (d, s, c):  # the scripts name the command they were run as in their messages
        p.set_defaults(prog=p.prog)
