"""``linkpass demo``'s entry point: picks the scenario, runs it, tears it down (also on Ctrl-C
or SIGTERM), prints its summary and writes its report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

from linkpass.lab.demo.common import DemoError
from linkpass.lab.demo.device_fault import DeviceFaultDemo, _print_device_fault_summary
from linkpass.lab.demo.rebuild import RebuildDemo, _print_rebuild_summary
from linkpass.lab.demo.reroute import Demo, _print_summary


def main(args) -> int:
    """Entry point of ``linkpass demo``.  Exit 0 when the job lost no step and the weights
    match the reference, 1 otherwise."""
    if os.geteuid() != 0:
        raise DemoError("must run as root (it creates network namespaces)", 2)
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise DemoError(f"--json {args.json}: directory {parent} does not exist or is not writable", 2)
    scenario = getattr(args, "scenario", "reroute")
    from linkpass.lab import demo_script

    if scenario not in ("reroute", "rebuild", "guard-device-fault") + demo_script.SCENARIOS:
        raise DemoError("--scenario must be reroute (kernel routes), rail, rail-latched, device-fault, snapshot or at-risk (an "
                        "unmodified --script under linkpass exec), or rebuild / guard-device-fault (the explicit LinkPassGuard API)", 2)
    if scenario in demo_script.SCENARIOS:
        demo = demo_script.ScriptDemo(getattr(args, "script", None) or str(demo_script.DEFAULT_SCRIPT),
                                      getattr(args, "script_args", None) if getattr(args, "script_args", None) is not None
                                      else (demo_script.DEFAULT_SCRIPT_ARGS if not getattr(args, "script", None) else ""),
                                      scenario, args.hosts, args.rails, args.name, args.mode, spares=getattr(args, "spares", 1),
                                      fault_host=getattr(args, "fault_host", None))
        every = getattr(args, "memory_every", 10)
        if every is None or every < 0:
            raise DemoError("--memory-every must be 0 (off) or more", 2)
        demo.memory_every = every
        demo.fault_when = fault_when_path(getattr(args, "fault_when", None), scenario)
        cache = getattr(args, "reference_cache", None)
        if cache is not None:
            if not cache.strip():
                raise DemoError("--reference-cache: empty (name a directory)", 2)
            demo.reference_cache = Path(cache).resolve()
            if not demo.reference_cache.is_dir() or not os.access(demo.reference_cache, os.W_OK):
                raise DemoError(f"--reference-cache {cache}: not a writable directory", 2)
    elif getattr(args, "reference_cache", None):
        raise DemoError("--reference-cache: only for the --script scenarios (rail, rail-latched, device-fault, snapshot, "
                        "at-risk)", 2)
    elif getattr(args, "fault_when", None):
        raise DemoError("--fault-when: only for the --script scenarios (rail, rail-latched, device-fault, at-risk)", 2)
    elif scenario == "guard-device-fault":
        if getattr(args, "fault_host", None) == "all":
            raise DemoError("--fault-host all: only for the rail scenarios (rail, rail-latched)", 2)
        demo = DeviceFaultDemo(args.hosts, args.rails, args.steps, args.name, args.mode, spares=getattr(args, "spares", 1),
                               fault_host=getattr(args, "fault_host", None))
    else:
        demo = (RebuildDemo if scenario == "rebuild" else Demo)(args.hosts, args.rails, args.steps, args.name, args.mode)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    ok = False
    keep = getattr(args, "keep_logs", False)
    result = None
    try:
        result = demo.run()
        ok = result.get("ok", result["steps_lost"] == 0 and result["weights_match_reference"])
    except KeyboardInterrupt:
        print("linkpass demo: interrupted; tearing down", file=sys.stderr)
        return 130
    except DemoError as e:
        keep = keep or e.exit_code == 1  # a failure while running: its logs explain it
        raise
    finally:
        demo.close()
        signal.signal(signal.SIGTERM, old)
        if keep or (result is not None and not ok):
            print(f"linkpass demo: logs kept in {demo.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(demo.workdir, ignore_errors=True)
            if result is not None:
                result["workdir"] = None
    {"rebuild": _print_rebuild_summary, "guard-device-fault": _print_device_fault_summary,
     **{s: demo_script.print_summary for s in demo_script.SCENARIOS}}.get(scenario, _print_summary)(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


def fault_when_path(raw: str | None, scenario: str) -> str | None:
    """``--fault-when FILE`` checked before any fabric is built: an absolute path (the workers
    run in their own directories) that does not exist yet, in a directory that does.

    Raises:
        DemoError: with what is wrong (exit status 2)."""
    if not raw:
        return None
    if scenario == "snapshot":
        raise DemoError("--fault-when: the snapshot scenario injects no fault", 2)
    p = Path(raw).absolute()
    if p.exists() or p.is_symlink():
        raise DemoError(f"--fault-when {raw}: it exists already (the fault would come at once); remove it or name a new file", 2)
    if not p.parent.is_dir():
        raise DemoError(f"--fault-when {raw}: directory {p.parent} does not exist", 2)
    return str(p)
