"""`linkpass nccl-env` and `linkpass exec`: the NCCL environment for a process on this host.

    linkpass nccl-env [--local-rank N | --gpu N] [--format shell|json|env-file]
                      [--config FILE] [--socket PATH | --no-daemon]
                      [--sysfs-root DIR | --from FILE ...] [--no-live] [--nccl-version X.Y.Z]
                      [--rails-joined-by-spine | --no-rails-joined-by-spine]
    linkpass exec [--local-rank N] [same options] -- CMD ARGS...

The topology comes from the live host (sysfs, netlink, NVML), a captured sysfs tree
(``--sysfs-root``) or captured tool outputs (``--from``), exactly as ``linkpass topology`` reads
them.  Rail health comes from the daemon's control socket (``--socket``, else the config's
``control_socket``, else ``/run/linkpass/linkpass.sock``); without an answering daemon the
topology's port and link states are used and stderr says that health is unknown.

``--local-rank N`` maps a torchrun-style local rank to a GPU through ``CUDA_VISIBLE_DEVICES``
(:func:`linkpass.core.nccl_env.gpu_for_local_rank`); ``exec`` takes ``LOCAL_RANK`` from the
environment when the flag is not given.  ``exec`` replaces itself (``os.execvpe``) with CMD,
whose environment is the current one plus the computed variables.

The topology readers' warnings (a cut-off or unreadable file, NVML or netlink not usable) go
to stderr, one line each (``linkpass nccl-env: FILE: what``), into the header comments and into
the json format's ``warnings``.  They do not change the exit code, as in ``linkpass topology``:
what could be read is used (a cut-off NCCL topology XML gives the NICs before the cut), and a
file from which nothing at all could be read is exit 2.

Exit codes: 0 ok (also with warnings); 1 the environment cannot be right (no healthy compute
port: the error is printed, and ``exec`` does not run CMD); 2 bad input (arguments, config,
topology, GPU, a missing or unrunnable command), one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from linkpass.cli.argtypes import MAX_GPU_INDEX, gpu_index, int_range, one_line_errors

#: spares per worker: each is a full copy of the worker process (torch imported, its memory),
#: so more than a handful per GPU worker is a typo, not a plan
MAX_SPARES = 8
from linkpass.core.nccl_env import (
    FORMATS,
    NcclEnv,
    NcclEnvError,
    NcclOptions,
    compute,
    gpu_for_local_rank,
    health_from_status,
    parse_nccl_version,
)


class _BadInput(Exception):
    """One line for stderr, exit 2."""


#: ``--local-rank N`` (and ``LOCAL_RANK``): one process per GPU, so the range of a GPU index.
_local_rank = int_range(0, MAX_GPU_INDEX, "a local rank")


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative")
    return v


def _pos(text: str) -> int:
    v = _nonneg(text)
    if v < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return v


def _check_sysfs_root(root: str) -> None:
    p = Path(root)
    if not p.is_dir():
        raise _BadInput(f"--sysfs-root {root}: {'not a directory' if p.exists() else 'no such directory'}")
    if not any((p / "sys" / sub).is_dir() for sub in ("bus/pci/devices", "class/net", "class/infiniband")):
        raise _BadInput(f"--sysfs-root {root}: not a captured sysfs tree (no sys/bus/pci/devices, sys/class/net or "
                        "sys/class/infiniband under it); make one with `linkpass topology capture --out DIR`")


def _config(args):
    if not args.config:
        return None
    from linkpass.config import ConfigError, load_config

    try:
        return load_config(args.config)
    except ConfigError as e:
        raise _BadInput(str(e)) from None


def _topology(args, cfg):
    """The analysed topology, and warnings about reading it."""
    from topology.affinity import analyse
    from topology.model import merge

    t = cfg.topology if cfg else None
    override = ({n: True for n in t.compute_nics} | {n: False for n in t.exclude_nics}) if t else {}
    sysfs_root = args.sysfs_root or (t.sysfs_root if t and t.sysfs_root not in ("", "/") and not args.from_files else None)
    parts = []
    if sysfs_root:
        _check_sysfs_root(sysfs_root)
    if args.from_files:
        from topology.importers import parse_file

        parts += [parse_file(f) for f in args.from_files]
        if not any(p.gpus or p.nics for p in parts):
            why = "; ".join(w for p in parts for w in p.warnings) or "no GPU or NIC in them"
            raise _BadInput(f"--from: nothing could be read from the files given ({why})")
    if sysfs_root or not args.from_files:
        from topology.live import discover

        live = not sysfs_root and not args.no_live
        parts.append(discover(sysfs_root or "/", use_netlink=live, use_nvml=live))
    return analyse(merge(parts), override)


def _health(args, cfg, prog: str):
    """(Health or None, the socket asked)."""
    if args.no_daemon:
        return None, None
    from linkpass.config import DEFAULT_CONTROL_SOCKET
    from linkpass.lab.fabric.cluster import ask_socket

    path = args.socket or (cfg.daemon.control_socket if cfg else DEFAULT_CONTROL_SOCKET)
    try:
        st = ask_socket(path, "status", timeout=3.0)
    except FileNotFoundError:
        why = "no such socket"
    except PermissionError:
        why = "permission denied (the control socket is for root and group, mode 0660)"
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
    except ValueError as e:
        why = f"its reply is not JSON ({e})"
    else:
        try:
            return health_from_status(st), path
        except NcclEnvError as e:
            why = str(e)
    print(f"{prog}: health unknown: no usable answer from a daemon on {path} ({why}); using the topology's port "
          "and link states only", file=sys.stderr)
    return None, path


def _options(args, cfg) -> NcclOptions:
    n = cfg.nccl if cfg else None
    spine = args.rails_joined_by_spine if args.rails_joined_by_spine is not None else (n.rails_joined_by_spine if n else False)
    resil = n.ib_resiliency if n else True
    text = args.nccl_version or (n.version if n else "")
    if text:
        try:
            version = parse_nccl_version(text)
        except NcclEnvError as e:
            raise _BadInput(f"--nccl-version: {e}" if args.nccl_version else f"{args.config}: nccl.version: {e}") from None
    else:
        from linkpass.adapters.nccl_file import detect_nccl_version

        version, _ = detect_nccl_version()
    return NcclOptions(spine, resil, version)


_NO_CONFIG = object()


def build(args, prog: str, local_rank: int | None, cfg=_NO_CONFIG) -> NcclEnv:
    """Compute the environment the arguments ask for (``cfg``: the config already loaded from
    ``args.config``, else it is loaded here).

    Raises:
        _BadInput: a bad config, topology, version or GPU.
    """
    if cfg is _NO_CONFIG:
        cfg = _config(args)
    options = _options(args, cfg)
    topo = _topology(args, cfg)
    health, _ = _health(args, cfg, prog)
    try:
        gpu = args.gpu
        if local_rank is not None:
            gpu = gpu_for_local_rank(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"), topo)
        env = compute(topo, health, gpu, options, cfg.daemon.host if cfg else "")
    except NcclEnvError as e:
        raise _BadInput(str(e)) from None
    env.source_warnings = list(topo.warnings)
    env.health = health
    env.config = cfg
    return env


def hook_env(env: NcclEnv, environ: Mapping[str, str], socket_path: str | None) -> dict[str, str]:
    """The variables that start the torch hook in the workers (torch_hooks/bootstrap.py).

    ``PYTHONPATH`` gets ``torch_hooks/_site`` (its ``sitecustomize`` starts the hook) and the
    directory holding ``torch_hooks`` in front; ``LINKPASS_RAIL_IFACES`` (rail=netdev, usable
    rails first, in rail order) comes from the daemon's status, else the config's ``[[rails]]``;
    ``LINKPASS_HOOKS_SOCKET`` and ``LINKPASS_HOST`` from the config; ``GLOO_SOCKET_IFNAME`` is
    set to the first usable rail's netdev when the environment does not set it (the rail the
    job starts on, so a fault on it is one the hook can see).  Variables already set in
    ``environ`` are kept, except ``PYTHONPATH``, which is prepended to.
    """
    import torch_hooks
    from linkpass.adapters.hook_server import default_socket_path

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(torch_hooks.__file__)))
    site = os.path.join(pkg_root, "torch_hooks", "_site")
    out: dict[str, str] = {}
    old = environ.get("PYTHONPATH", "")
    parts = [site] + ([pkg_root] if pkg_root not in old.split(os.pathsep) else []) + ([old] if old else [])
    out["PYTHONPATH"] = os.pathsep.join(parts)
    health, cfg = getattr(env, "health", None), getattr(env, "config", None)
    if health is not None and health.rails:
        rails = sorted(health.rails, key=lambda r: (not r.usable, r.id))
        pairs = [(r.id, r.netdev) for r in rails]
        first_usable = next((r.netdev for r in rails if r.usable), None)
    elif cfg is not None and cfg.rails:
        pairs = [(r.id, r.netdev) for r in sorted(cfg.rails, key=lambda r: r.id)]
        first_usable = pairs[0][1]
    else:
        pairs, first_usable = [], None
    if pairs and not environ.get("LINKPASS_RAIL_IFACES"):
        out["LINKPASS_RAIL_IFACES"] = ",".join(f"{i}={d}" for i, d in pairs)
    if first_usable and not environ.get("GLOO_SOCKET_IFNAME"):
        out["GLOO_SOCKET_IFNAME"] = first_usable
    if not environ.get("LINKPASS_HOOKS_SOCKET"):
        if cfg is not None:
            out["LINKPASS_HOOKS_SOCKET"] = cfg.hooks.socket or default_socket_path(cfg.daemon.control_socket)
        elif socket_path:
            out["LINKPASS_HOOKS_SOCKET"] = default_socket_path(socket_path)
    if cfg is not None and cfg.daemon.host and not environ.get("LINKPASS_HOST"):
        out["LINKPASS_HOST"] = cfg.daemon.host
    return out


def _report(env: NcclEnv, prog: str) -> None:
    for w in env.source_warnings:  # each starts with its source: "FILE: line 74: the topology is cut off ..."
        print(f"{prog}: {w}", file=sys.stderr)
    for w in env.warnings:
        print(f"{prog}: warning: {w}", file=sys.stderr)
    for e in env.errors:
        print(f"{prog}: ERROR: {e}", file=sys.stderr)


def cmd_nccl_env(args) -> int:
    prog = "linkpass nccl-env"
    try:
        env = build(args, prog, args.local_rank)
    except _BadInput as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(env.render(args.format))
    _report(env, prog)
    return 1 if env.errors else 0


def _local_rank_from_env(args) -> int | None:
    if args.local_rank is not None:
        return args.local_rank
    raw = os.environ.get("LOCAL_RANK")
    if raw is None or raw == "":
        return None
    try:
        return _local_rank(raw)
    except argparse.ArgumentTypeError as e:
        raise _BadInput(f"LOCAL_RANK in the environment: {e}") from None


def _command_problem(name: str, environ: Mapping[str, str]) -> str | None:
    """Why ``name`` cannot be run (os.execvpe would fail), or None: looked up on ``PATH`` as
    execvpe does, before anything is probed."""
    import shutil

    if os.sep in name:
        if not os.path.exists(name):
            return f"{name}: command not found"
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            return f"{name}: permission denied (not executable?)"
        return None
    if shutil.which(name, path=environ.get("PATH", os.defpath)) is None:
        return f"{name}: command not found"
    return None


def cmd_exec(args) -> int:
    prog = "linkpass exec"
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(f"{prog}: no command given; usage: linkpass exec [--local-rank N] -- CMD ARGS...", file=sys.stderr)
        return 2
    hook = os.environ.get("LINKPASS_HOOK", "1").strip() != "0"
    try:
        # every argument first: nothing is probed (topology, NVML, the daemon) for a bad one
        cfg = _config(args)
        local_rank = _local_rank_from_env(args)
        why = _command_problem(cmd[0], os.environ)
        if why:
            raise _BadInput(why)
        if not hook and getattr(args, "resume", None):
            raise _BadInput("--resume needs the hook, and LINKPASS_HOOK=0 turns it off")
        snap = snapshot_env(args, cfg, os.environ) if hook else {}
        env = build(args, prog, local_rank, cfg)
    except _BadInput as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    _report(env, prog)
    if env.errors:
        print(f"{prog}: not running {cmd[0]}: the NCCL environment cannot be right (see the error above)", file=sys.stderr)
        return 1
    new = dict(os.environ)
    for k, v in env.env.items():
        if k in new and new[k] != v:
            print(f"{prog}: {k}={v} replaces {k}={new[k]} from the environment", file=sys.stderr)
        new[k] = v
    if env.generation is not None:
        new["LINKPASS_NCCL_GENERATION"] = str(env.generation)
    if hook:
        new.update(hook_env(env, os.environ, args.socket))
        if args.no_daemon:
            new["LINKPASS_NO_DAEMON"] = "1"  # the hook does not look for a daemon either
        elif env.health is None:  # said above ("health unknown: no usable answer ..."): the hook's client
            from torch_hooks.client import NO_DAEMON_SAID_ENV  # does not say it again

            new[NO_DAEMON_SAID_ENV] = "1"
        if args.spares:
            new["LINKPASS_SPARES"] = str(args.spares)
        if args.latched:
            new["LINKPASS_LATCHED"] = "1"
        new.update(snap)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, new)
    except FileNotFoundError:
        print(f"{prog}: {cmd[0]}: command not found", file=sys.stderr)
    except PermissionError:
        print(f"{prog}: {cmd[0]}: permission denied (not executable?)", file=sys.stderr)
    except OSError as e:
        print(f"{prog}: {cmd[0]}: cannot run it: {e.strerror or e}", file=sys.stderr)
    return 2


def snapshot_env(args, cfg, environ) -> dict[str, str]:
    """The hook's snapshot variables (torch_hooks/snapshot.py): ``--snapshot-*`` flags, else the
    environment's own, else the config's ``[snapshot]``; ``LINKPASS_RESUME`` from ``--resume``
    (checked here: a complete snapshot; the newest complete one of a snapshots directory).

    The snapshot directory, wherever it comes from, is checked before the job starts
    (:func:`snapshot_dir_problem`); a relative ``--snapshot-dir`` is taken from the current
    directory and stderr says where that is (the config refuses a relative ``dir``).

    Raises:
        _BadInput: ``--resume`` on a missing or partial snapshot, a snapshot directory that is a
            file or cannot be made or written (one line naming where it came from).
    """
    from torch_hooks import snapdir

    out: dict[str, str] = {}
    sec = getattr(cfg, "snapshot", None)
    dir_from = rel_note = None
    for var, flag, opt in (("LINKPASS_SNAPSHOT_EVERY", "snapshot_every", "every_steps"),
                           ("LINKPASS_SNAPSHOT_DIR", "snapshot_dir", "dir"),
                           ("LINKPASS_SNAPSHOT_KEEP", "snapshot_keep", "keep"),
                           ("LINKPASS_SNAPSHOT_IN_MEMORY", "snapshot_in_memory", "in_memory"),
                           ("LINKPASS_SNAPSHOT_MEMORY_EVERY", "snapshot_memory_every", "memory_every_steps")):
        v = getattr(args, flag, None)
        src = f"--{flag.replace('_', '-')}"
        if v is None and not environ.get(var) and sec is not None and getattr(sec, opt, None) not in ("", None):
            v = getattr(sec, opt)
            src = f"{getattr(args, 'config', None) or 'the config'}: snapshot.{opt}"
        if isinstance(v, bool):
            v = "1" if v else "0"
        if v is not None:
            if var == "LINKPASS_SNAPSHOT_DIR":
                dir_from = src
                if not os.path.isabs(v):  # said once the directory is known to be usable
                    rel_note = f"linkpass exec: {src} {v} is relative: snapshots go to {os.path.abspath(v)}"
                v = os.path.abspath(v)
            out[var] = str(v)
    if out.get("LINKPASS_SNAPSHOT_IN_MEMORY") == "0":
        del out["LINKPASS_SNAPSHOT_IN_MEMORY"]
    if "LINKPASS_SNAPSHOT_IN_MEMORY" not in out and environ.get("LINKPASS_SNAPSHOT_IN_MEMORY", "") not in ("1", "true", "yes"):
        out.pop("LINKPASS_SNAPSHOT_MEMORY_EVERY", None)  # the interval of something off
    if dir_from is None and environ.get("LINKPASS_SNAPSHOT_DIR"):
        dir_from = "LINKPASS_SNAPSHOT_DIR in the environment"
    if dir_from is not None:
        why = snapshot_dir_problem(out.get("LINKPASS_SNAPSHOT_DIR") or os.path.abspath(environ["LINKPASS_SNAPSHOT_DIR"]))
        if why:
            raise _BadInput(f"{dir_from}: {why}")
    if rel_note:
        print(rel_note, file=sys.stderr)
    if getattr(args, "resume", None):
        skipped: list[str] = []
        try:
            snap = snapdir.resolve(args.resume, skipped)
        except snapdir.SnapshotError as e:
            raise _BadInput(f"--resume {e}") from None
        for why in skipped:
            print(f"linkpass exec: --resume {args.resume}: skipped {why}; using {snap.name}", file=sys.stderr)
        out["LINKPASS_RESUME"] = str(snap.resolve())
    return out


def snapshot_dir_problem(path: str) -> str | None:
    """Why snapshots cannot be written under ``path`` (absolute), one line naming it; None when
    they can: it is a directory (made, with its parents, when missing) in which a file can be
    created (one is created and removed)."""
    import tempfile

    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{p} is not a directory"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{p} cannot be created ({e.strerror or e})"
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".linkpass-write-test-"):
            pass
    except OSError as e:
        return f"{p} is not writable ({e.strerror or e})"
    return None


def _steps(text: str) -> int:
    from linkpass.config.schema import SNAPSHOT_MAX_EVERY_STEPS

    v = _nonneg(text)
    if v > SNAPSHOT_MAX_EVERY_STEPS:
        raise argparse.ArgumentTypeError(f"{v} is more than {SNAPSHOT_MAX_EVERY_STEPS} steps (0: only on request)")
    return v


def _keep(text: str) -> int:
    from linkpass.config.schema import SNAPSHOT_MAX_KEEP

    v = _nonneg(text)
    if v > SNAPSHOT_MAX_KEEP:
        raise argparse.ArgumentTypeError(f"{v} is more than {SNAPSHOT_MAX_KEEP} (0: keep all)")
    return v


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="daemon config: its control socket, [topology] and [nccl] options")
    d = p.add_mutually_exclusive_group()
    d.add_argument("--socket", metavar="PATH", help="the daemon's control socket (default: the config's, else "
                   "/run/linkpass/linkpass.sock)")
    d.add_argument("--no-daemon", action="store_true", help="do not ask a daemon: health from the topology only")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--sysfs-root", metavar="DIR", help="read a captured sysfs tree instead of the live host")
    t.add_argument("--from", dest="from_files", nargs="+", action="extend", metavar="FILE", default=None,
                   help="captured tool outputs, as `linkpass topology --from` takes them")
    p.add_argument("--no-live", action="store_true", help="do not ask netlink or NVML (sysfs only)")
    p.add_argument("--nccl-version", metavar="X.Y.Z", help="the job's NCCL version (default: [nccl] version, else the "
                   "installed nvidia-nccl-cu* package, else 2.30.0 is assumed)")
    p.add_argument("--rails-joined-by-spine", action=argparse.BooleanOptionalAction, default=None,
                   help="whether a spine joins the rails (default: [nccl] rails_joined_by_spine, else no)")


def register(subparsers) -> None:
    """Add the ``nccl-env`` and ``exec`` sub-commands to the ``linkpass`` parser."""
    p = subparsers.add_parser("nccl-env", help="print the NCCL environment (healthy HCAs, interfaces, GID index, "
                              "cross-NIC, port failover) for a process on this host")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--local-rank", type=_local_rank, metavar="N",
                   help=f"local rank, 0..{MAX_GPU_INDEX} (GPU through CUDA_VISIBLE_DEVICES)")
    g.add_argument("--gpu", type=gpu_index, metavar="N", help=f"GPU index (nvidia-smi numbering), 0..{MAX_GPU_INDEX}")
    p.add_argument("--format", choices=FORMATS, default="shell",
                   help="shell: export lines (default); env-file: KEY=VALUE lines; json: variables plus metadata")
    _common(p)
    p.set_defaults(func=cmd_nccl_env)
    one_line_errors(p, "linkpass nccl-env")

    e = subparsers.add_parser("exec", help="run a command with the NCCL environment added (for torchrun and other launchers)")
    e.add_argument("--local-rank", type=_local_rank, metavar="N",
                   help=f"local rank, 0..{MAX_GPU_INDEX} (default: LOCAL_RANK from the environment)")
    e.add_argument("--spares", type=int_range(0, MAX_SPARES), default=0, metavar="N",
                   help=f"warm spare processes per worker, 0..{MAX_SPARES}: copies of the worker, torch imported, no NCCL "
                   "yet, that take over a rank whose GPU failed or whose rail its latched NCCL cannot leave")
    e.add_argument("--latched", action="store_true",
                   help="gloo behaves as NCCL does: no in-process rail change, a spare takes the rank (for tests and demos)")
    e.add_argument("--resume", metavar="DIR", help="every rank restores from this snapshot (or the newest complete one "
                   "in this snapshots directory) before the script's first step, and the script runs on from there")
    e.add_argument("--snapshot-every", type=_steps, metavar="N", help="a snapshot after every N optimizer steps "
                   "(default: [snapshot] every_steps; 0: only on request)")
    e.add_argument("--snapshot-dir", metavar="DIR", help="where snapshots go (default: [snapshot] dir); made when "
                   "missing and checked writable before CMD starts; a relative DIR is taken from the current directory")
    e.add_argument("--snapshot-keep", type=_keep, metavar="N", help="complete snapshots kept (default: [snapshot] keep)")
    e.add_argument("--snapshot-in-memory", action="store_true", default=None,
                   help="each rank keeps its part of the last in-memory snapshot in host memory and a copy on a peer "
                   "host, so a sharded (FSDP2) rank whose GPU fails goes to a spare and the job redoes only the steps "
                   "since that snapshot (default: [snapshot] in_memory)")
    e.add_argument("--snapshot-memory-every", type=_pos, metavar="N", help="an in-memory snapshot after every N "
                   "optimizer steps (default: [snapshot] memory_every_steps, else 10)")
    _common(e)
    e.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command and its arguments")
    e.set_defaults(func=cmd_exec, gpu=None)
    one_line_errors(e, "linkpass exec")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m linkpass.cli.nccl nccl-env ...``), same as ``linkpass``."""
    p = argparse.ArgumentParser(prog="linkpass")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
