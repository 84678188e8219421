"""``linkpass snapshot --job JOB [--to DIR] [--wait]``: ask a running protected job for a snapshot.

The job is found in this host's job registry (``torch_hooks/snapdir.py``: the hook's local rank 0
writes the job's store address there), or at ``--store ADDR:PORT``.  The request goes through the
job's store (``torch_hooks/snapshot.py``: generation ``g`` from ``add`` on
``linkpass/<job>/snapshot/seq``, then ``snapshot/<g>/req``); every rank saves at the same step
boundary.  ``--wait`` waits for ``snapshot/g<g>/result`` and prints the step, the directory, the
size, the training stall and the write time (``--json``: the result itself).

Exit status: 0 requested (or, with ``--wait``, complete); 1 the job is unknown or not running,
its store does not answer, or the snapshot failed or did not come within ``--timeout``; 2 bad
arguments.  Every error is one line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from linkpass.cli.argtypes import one_line_errors

PROG = "linkpass snapshot"


def _fail(msg: str, code: int = 1) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return code


def _store(addr: str, job: str, timeout_s: float, attempt: int = 0):
    # torch's C++ store client logs a lost connection with a stack trace; this command says it in one line
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    import torch.distributed as dist

    host, _, port = addr.rpartition(":")
    st = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    from torch_hooks.pg import job_store

    # the keys of the worker group's current attempt (torchrun restarts keep the store)
    return job_store(st, job, {"TORCHELASTIC_RESTART_COUNT": str(attempt)})


def _host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not ADDR:PORT")
    return text


def cmd_snapshot(args) -> int:
    from torch_hooks import snapdir

    attempt = args.attempt or 0
    if args.attempt is not None and args.attempt < 0:
        return _fail(f"--attempt {args.attempt}: must not be negative", 2)
    if not args.job.strip():
        return _fail("--job: empty (the job's name: LINKPASS_JOB, else torchrun's run id)", 2)
    if not (args.timeout > 0 and args.timeout != float("inf")):  # also refuses nan
        return _fail(f"--timeout {args.timeout}: must be a positive number of seconds", 2)
    if args.json and not args.wait:
        return _fail("--json needs --wait (without it the command only asks for the snapshot)", 2)
    if args.store:
        addr = args.store
    else:
        try:
            entry = snapdir.lookup_job(args.job)
        except snapdir.SnapshotError as e:
            return _fail(str(e))
        addr = entry["store"]
        attempt = entry.get("attempt") if isinstance(entry.get("attempt"), int) else 0
    to = os.path.abspath(args.to) if args.to else None
    if to and os.path.exists(to) and not os.path.isdir(to):
        return _fail(f"--to {args.to}: exists and is not a directory", 2)
    try:
        kv = _store(addr, args.job, min(10.0, args.timeout), attempt)
        g = int(kv.add("snapshot/seq", 1))
        kv.set(f"snapshot/{g}/req", json.dumps({"to": to, "pid": os.getpid()}))
    except Exception as e:  # noqa: BLE001 - one line, whatever the store client raised
        return _fail(f"job {args.job!r}: its store at {addr} does not answer ({str(e).splitlines()[0][:160] if str(e) else e!r})")
    if not args.wait:
        print(f"{PROG}: snapshot {g} of job {args.job} requested: every rank saves at its next step boundary"
              f"{' into ' + to if to else ''}")
        return 0
    key = f"snapshot/g{g}/result"
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            if kv.check([key]):
                res = json.loads(kv.get(key))
                break
        except Exception as e:  # noqa: BLE001
            return _fail(f"job {args.job!r}: its store went away before snapshot {g} was complete "
                         f"({str(e).splitlines()[0][:120] if str(e) else e!r})")
        if time.monotonic() > deadline:
            return _fail(f"job {args.job!r}: snapshot {g} not complete within {args.timeout:.0f} s (ranks still writing, "
                         "or a hook without snapshots)")
        time.sleep(0.1)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    if not res.get("ok"):
        return _fail(f"job {args.job!r}: snapshot {g} failed, nothing kept: {res.get('reason')}")
    if not args.json:
        print(f"{PROG}: job {args.job}: snapshot after step {res['step']} in {res['path']} ({res['bytes']} bytes; "
              f"training stalled {res['stall_ms']:.1f} ms, written in {res['write_ms']:.1f} ms)")
    return 0


def register(subparsers) -> None:
    """Add ``snapshot`` to the ``linkpass`` parser."""
    p = subparsers.add_parser("snapshot", help="snapshot a running protected job (every rank, the same step)")
    p.add_argument("--job", required=True, help="the job's name (LINKPASS_JOB, else torchrun's run id)")
    p.add_argument("--to", metavar="DIR", help="snapshots directory (default: the job's [snapshot] dir)")
    p.add_argument("--wait", action="store_true", help="wait until the snapshot is complete and say where it is")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="how long --wait waits (default 600 s)")
    p.add_argument("--store", type=_host_port, metavar="ADDR:PORT",
                   help="the job's store (default: from this host's job registry)")
    p.add_argument("--attempt", type=int, metavar="N", help="with --store: the worker group's attempt under torchrun "
                   "(TORCHELASTIC_RESTART_COUNT; default 0; from the registry otherwise)")
    p.add_argument("--json", action="store_true", help="with --wait: print the result as JSON")
    p.set_defaults(func=cmd_snapshot)
    one_line_errors(p, PROG)
