"""The daemon's NCCL environment file (``[nccl] env_file``, default ``/run/linkpass/nccl.env``).

The engine computes the host-wide environment on every plan change
(:func:`linkpass.core.nccl_env.plan_env_file`, no GPU) from the topology and options this module
reads at the edge (:attr:`NcclEnvFile.context`, handed to the engine) and its own rail states,
and returns a :class:`~linkpass.core.model.WriteNcclEnv` action with the file's text.
:class:`NcclEnvFile` only writes that text: it replaces the file atomically: a temporary
file in the same directory, written, fsynced, renamed over the old one with ``os.replace``
(rename is atomic within one file system), then the directory is fsynced.  A reader therefore
sees the old file or the new one, never a part.  Only a generation newer than the one written
is written (DESIGN.md rule 5).  The first line carries ``generation=N``.

The file holds ``KEY=VALUE`` lines and ``#`` comments: systemd's ``EnvironmentFile=`` and
``docker run --env-file`` read it as is, ``set -a; . FILE; set +a`` works in a shell.

A write that fails is logged once (then again only after it has worked in between) and never
stops the daemon.

Topology (:func:`load_topology`): in ``[topology] rails = "auto"`` mode the daemon already
discovered it; in config mode the rails only name netdevs, so sysfs under
``[topology] sysfs_root`` is read once at start (and on SIGHUP) and each rail is matched to an
HCA port by netdev.  Where no HCA is known (the emulated veth fabric), NCCL_IB_HCA is left out
with a comment and NCCL_SOCKET_IFNAME still lists the healthy rail netdevs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path

from linkpass.config import Config
from linkpass.core.model import WriteNcclEnv
from linkpass.core.nccl_env import (
    NcclContext,
    NcclEnv,
    NcclEnvError,
    NcclOptions,
    parse_nccl_version,
)
from topology.model import Topology

log = logging.getLogger("linkpass.nccl_file")

#: Python packages that ship libnccl (PyTorch's CUDA wheels depend on one of them).
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def detect_nccl_version() -> tuple[tuple[int, int, int] | None, str]:
    """The NCCL version of an installed ``nvidia-nccl-cu*`` package in this Python environment:
    ``((2, 27, 5), "nvidia-nccl-cu12 2.27.5")``, or ``(None, why)``.  It describes this
    interpreter's environment, which is the job's only when both use the same one."""
    from importlib import metadata

    for pkg in NCCL_PACKAGES:
        try:
            text = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
        try:
            return parse_nccl_version(text), f"{pkg} {text}"
        except NcclEnvError:
            return None, f"{pkg} has version {text!r}, which is not MAJOR.MINOR.PATCH"
    return None, "no nvidia-nccl-cu* package is installed here"


def options_for(cfg: Config) -> tuple[NcclOptions, str]:
    """:class:`NcclOptions` from ``[nccl]``, and a note saying where the version came from."""
    n = cfg.nccl
    if n.version:
        version, why = parse_nccl_version(n.version), f"NCCL {n.version} from [nccl] version"
    else:
        version, why = detect_nccl_version()
    return NcclOptions(n.rails_joined_by_spine, n.ib_resiliency, version), why


def load_topology(sysfs_root: str, compute_nics: list[str] | None = None, exclude_nics: list[str] | None = None) -> Topology:
    """This host's analysed topology from sysfs under ``sysfs_root`` (files only: no netlink,
    NVML or pyverbs).  Never raises: a failure gives an empty topology with a warning."""
    from topology.affinity import analyse
    from topology.sysfs import read_sysfs

    override = {n: True for n in compute_nics or []} | {n: False for n in exclude_nics or []}
    try:
        return analyse(read_sysfs(sysfs_root), override)
    except Exception as e:  # noqa: BLE001  a reader bug must not stop the daemon
        return Topology(warnings=[f"sysfs {sysfs_root}: topology not read ({type(e).__name__}: {e})"])


def write_atomic(path: str | Path, text: str, mode: int = 0o644) -> None:
    """Replace ``path`` with ``text``: temporary file in the same directory, fsync, chmod,
    ``os.replace``, fsync of the directory.

    Raises:
        OSError: the directory is missing or not writable, the disk is full, ...; the old file
            is then untouched and no temporary file is left behind.
    """
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # the rename is done; a directory that cannot be fsynced (some file systems) is not an error


class NcclEnvFile:
    """Keeps ``[nccl] env_file`` in step with the daemon's plan generation.

    Args:
        cfg: the explicit config (rails spelled out).
        topo: the analysed topology when the daemon discovered it (auto mode); None: read sysfs
            under ``[topology] sysfs_root`` now.
    """

    def __init__(self, cfg: Config, topo: Topology | None = None) -> None:
        self.written_generation = 0
        self.errors = 0
        self._failing = False
        self._pending: WriteNcclEnv | None = None
        self._scheduled = False
        self.last: NcclEnv | None = None
        self.reconfigure(cfg, topo)

    def reconfigure(self, cfg: Config, topo: Topology | None = None) -> None:
        """Take a new config (SIGHUP); re-read sysfs unless ``topo`` is given.  The next plan
        change rewrites the file with the new settings."""
        self.enabled = cfg.nccl.write_env_file
        self.path = Path(cfg.nccl.env_file)
        self.host = cfg.daemon.host
        try:
            self.options, why = options_for(cfg)
        except NcclEnvError as e:  # the config validator already checks the shape
            self.options, why = NcclOptions(cfg.nccl.rails_joined_by_spine, cfg.nccl.ib_resiliency, None), str(e)
        if not self.enabled:
            self.topology = Topology()
            self.context: NcclContext | None = None
            return
        self.topology = topo if topo is not None else load_topology(cfg.topology.sysfs_root, cfg.topology.compute_nics,
                                                                     cfg.topology.exclude_nics)
        self.context = NcclContext(self.topology, self.options, self.host)
        hcas = {p.netdev: f"{n.name}:{p.port}" for n in self.topology.nics if n.role == "compute" for p in n.ports if p.netdev}
        matched = [f"{r.netdev}={hcas[r.netdev]}" for r in cfg.rails if r.netdev in hcas]
        log.info("nccl env file %s: rails on HCAs: %s; NCCL version: %s", self.path,
                 ", ".join(matched) or "none known (NCCL_IB_HCA will be left out)",
                 why if self.options.nccl_version else f"{why}; assuming the newest this code knows")

    def write(self, a: WriteNcclEnv) -> None:
        """The engine's environment for plan ``a.generation``: written from the event loop
        right after the current callbacks (the route actuator starts first); several in a row
        give one write, of the newest.  An older or equal generation than the file's is ignored."""
        if not self.enabled or a.generation <= self.written_generation:
            return
        if self._pending is None or a.generation > self._pending.generation:
            self._pending = a
        if not self._scheduled:
            self._scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (tests, tools): write now
                self.flush()

    def flush(self) -> bool:
        """Write the pending generation now.  Returns True when the file was written."""
        self._scheduled = False
        a, self._pending = self._pending, None
        if a is None or a.generation <= self.written_generation:
            return False
        generation = a.generation
        if a.text is None:
            self._fail(a.error or f"no NCCL environment for generation {generation}")
            return False
        try:
            self._ensure_dir()
            write_atomic(self.path, a.text)
        except OSError as e:
            self._fail(f"cannot write {self.path}: {e.strerror or e}")
            return False
        if self._failing:
            log.warning("nccl env file %s written again (generation %d)", self.path, generation)
        self._failing = False
        self.written_generation = generation
        self.last = a.env
        for e in a.errors:
            log.error("nccl env (generation %d): %s", generation, e)
        return True

    def _ensure_dir(self) -> None:
        parent = self.path.parent
        if not parent.is_dir() and (parent == Path("/run/linkpass") or Path("/run/linkpass") in parent.parents):
            parent.mkdir(parents=True, exist_ok=True)

    def _fail(self, msg: str) -> None:
        self.errors += 1
        if not self._failing:
            log.error("nccl env file: %s (the daemon goes on; logged once until a write succeeds)", msg)
        else:
            log.debug("nccl env file: %s", msg)
        self._failing = True
