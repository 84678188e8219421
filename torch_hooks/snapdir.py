"""The on-disk shape of a step-aligned snapshot, and the local registry of protected jobs (no torch).

Shared by the hook (:mod:`torch_hooks.snapshot`, which writes snapshots) and the CLI
(``linkpass snapshot``, ``linkpass exec --resume``, which find and check them).

A snapshot of a job after step ``S`` lives in ``DIR/step-S`` (``S`` zero-padded to 9 digits, so
names sort by step)::

    DIR/step-000000120/
        snapshot.json          the manifest: job, step, world_size, ranks, bytes, times
        rank-0/ .metadata __0_0.distcp ...   rank 0's part, a torch.distributed.checkpoint
        rank-0/extra.pt        rank 0's LR schedulers, RNG states, data position (torch.save)
        rank-1/ ...
        COMPLETE               the marker, written last

It is written as ``DIR/step-S.tmp-<id>`` and renamed to ``DIR/step-S`` only once every rank's part
and the manifest are there; the marker follows the rename.  So a directory is a snapshot only
when it has the marker: a ``.tmp-`` directory, or a ``step-S`` one without the marker (the writer
died between the rename and the marker), is never taken for one and is removed by the next
snapshot written to ``DIR`` (:func:`cleanup`).

Each rank's part is a DCP checkpoint of that rank's own state (``no_dist``: its planning does not
use the job's process groups, which belong to the training thread), so sharded (FSDP2) state is
saved as this rank's shards, and a snapshot is restored by a job of the same world size.

The **job registry**: the hook's local rank 0 on each host writes ``<jobs dir>/<job>.json``
(``job``, ``store`` ``"ADDR:PORT"``, ``world_size``, ``pid``, ``host``, ``snapshot_dir``) so that
``linkpass snapshot --job JOB`` on that host finds the job's store.  The jobs dir is
``LINKPASS_JOBS_DIR``, else ``<tmp>/linkpass-jobs-<uid>``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

MANIFEST = "snapshot.json"
MARKER = "COMPLETE"
EXTRA = "extra.pt"
#: the manifest's format; a reader refuses another one
FORMAT = 1

_FINAL = re.compile(r"^step-(\d{9})$")
_TMP = re.compile(r"^step-(\d{9})\.tmp-(.+)$")


class SnapshotError(ValueError):
    """A directory that is not a usable snapshot; the message is one line naming it."""


def step_name(step: int) -> str:
    """``120`` -> ``"step-000000120"``."""
    return f"step-{int(step):09d}"


def final_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / step_name(step)


def tmp_path(root: str | os.PathLike, step: int, sid: str) -> Path:
    """Where the snapshot with id ``sid`` (``g3``: the third requested one; ``p120``: periodic)
    after ``step`` is written before it is complete."""
    return Path(root) / f"{step_name(step)}.tmp-{sid}"


def rank_dir(snap: str | os.PathLike, rank: int) -> Path:
    return Path(snap) / f"rank-{int(rank)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def finalize(tmp: Path, final: Path, manifest: dict) -> None:
    """Make ``tmp`` (every rank's part written) the snapshot ``final``: manifest, rename, marker.

    Raises:
        OSError: the file system refused; ``tmp`` is then left as it is (never taken for a snapshot).
    """
    _write_atomic(tmp / MANIFEST, json.dumps(dict(manifest, format=FORMAT), indent=1, sort_keys=True))
    if final.exists():  # an older snapshot of the same step (a rerun writing into the same DIR)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    _write_atomic(final / MARKER, json.dumps({"step": manifest.get("step")}))
    _fsync_dir(final)


def read_manifest(snap: str | os.PathLike) -> dict:
    """The manifest of the complete snapshot ``snap``.

    Raises:
        SnapshotError: no such directory, no marker (partial), an unreadable manifest or a rank's
            part missing; one line naming the directory.
    """
    p = Path(snap)
    if not p.is_dir():
        raise SnapshotError(f"{p}: {'is not a directory' if p.exists() else 'no such snapshot directory'}")
    if not (p / MARKER).is_file():
        why = "a snapshot still being written or cut off" if _TMP.match(p.name) or (p / MANIFEST).exists() else \
            "not a snapshot directory"
        raise SnapshotError(f"{p}: no {MARKER} marker ({why}); not taken for a snapshot")
    try:
        m = json.loads((p / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{p}: its {MANIFEST} cannot be read ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("world_size"), int) \
            or not isinstance(m.get("step"), int):
        raise SnapshotError(f"{p}: {MANIFEST} is not a linkpass snapshot manifest of format {FORMAT}")
    ranks = m.get("ranks") if isinstance(m.get("ranks"), dict) else {}
    for r in range(m["world_size"]):
        d = rank_dir(p, r)
        if not (d / ".metadata").is_file() or not (d / EXTRA).is_file():
            raise SnapshotError(f"{p}: rank {r}'s part is missing ({d.name}/.metadata or {d.name}/{EXTRA})")
        want = ranks.get(str(r), {}).get("bytes") if isinstance(ranks.get(str(r)), dict) else None
        if isinstance(want, int) and not isinstance(want, bool):
            got = tree_bytes(d)
            if got != want:
                raise SnapshotError(f"{p}: rank {r}'s part is {got} bytes, it was {want} when written ({d.name} cut off "
                                    "or changed)")
    return m


def tree_bytes(path: str | os.PathLike) -> int:
    """The sizes of the files under ``path`` added up (bytes; unreadable entries count 0): what a
    manifest records of each rank's part (``ranks.R.bytes``)."""
    n = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                n += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return n


def resolve(path: str | os.PathLike, skipped: list[str] | None = None) -> Path:
    """``path`` itself when it is a snapshot (``step-S``), else the newest complete snapshot in it
    (a snapshots directory, as ``[snapshot] dir`` / ``LINKPASS_SNAPSHOT_DIR`` name it) that
    :func:`read_manifest` accepts: newer complete ones that it refuses (a part missing or cut
    off, an unreadable manifest) are passed over, each appended to ``skipped`` as one line
    ``"step-S: why"``.

    Raises:
        SnapshotError: as :func:`read_manifest`, or a directory holding no usable snapshot.
    """
    p = Path(path)
    if not p.is_dir():
        raise SnapshotError(f"{p}: {'is not a directory' if p.exists() else 'no such snapshot directory'}")
    if (p / MARKER).exists() or (p / MANIFEST).exists() or _FINAL.match(p.name) or _TMP.match(p.name):
        read_manifest(p)
        return p
    done = sorted(c for c in p.iterdir() if _FINAL.match(c.name) and (c / MARKER).is_file())
    if not done:
        partial = [c.name for c in p.iterdir() if _FINAL.match(c.name) or _TMP.match(c.name)]
        raise SnapshotError(f"{p}: no complete snapshot in it" + (f" (only partial ones: {', '.join(sorted(partial)[:3])})"
                                                                   if partial else ""))
    refused = []
    for c in reversed(done):
        try:
            read_manifest(c)
        except SnapshotError as e:
            why = str(e)
            refused.append(f"{c.name}: {why[len(str(c)) + 2:] if why.startswith(f'{c}: ') else why}")
            continue
        if skipped is not None:
            skipped.extend(refused)
        return c
    more = f"; and {len(refused) - 3} more" if len(refused) > 3 else ""
    raise SnapshotError(f"{p}: no usable snapshot in it ({'; '.join(refused[:3])}{more})")


def cleanup(root: str | os.PathLike, upto_step: int, keep: int, active: Path | None = None) -> list[str]:
    """Remove from ``root``: partial snapshots of steps up to ``upto_step`` (``.tmp-`` ones other
    than ``active``, ``step-S`` ones without the marker), and complete ones beyond the newest
    ``keep`` (``keep`` <= 0: keep all).  Later steps' ``.tmp-`` directories are left alone (ranks
    may be writing them).  Returns the names removed."""
    p = Path(root)
    removed = []
    try:
        entries = list(p.iterdir())
    except OSError:
        return removed
    complete = []
    for c in entries:
        mf, mt = _FINAL.match(c.name), _TMP.match(c.name)
        if mt and int(mt.group(1)) <= upto_step and (active is None or c != active):
            removed.append(c.name)
        elif mf and not (c / MARKER).is_file() and int(mf.group(1)) <= upto_step:
            removed.append(c.name)
        elif mf:
            complete.append(c)
    if keep > 0:
        removed += [c.name for c in sorted(complete)[:-keep]]
    for name in removed:
        shutil.rmtree(p / name, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------- the job registry


def jobs_dir() -> Path:
    return Path(os.environ.get("LINKPASS_JOBS_DIR") or os.path.join(tempfile.gettempdir(), f"linkpass-jobs-{os.getuid()}"))


def _job_file(job: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)
    return jobs_dir() / f"{safe}.json"


def register_job(info: dict) -> Path | None:
    """Write this host's entry for ``info["job"]``; None when the jobs dir cannot be written."""
    try:
        d = jobs_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        f = _job_file(info["job"])
        _write_atomic(f, json.dumps(info, sort_keys=True))
        return f
    except OSError:
        return None


def unregister_job(job: str, pid: int) -> None:
    """Remove the entry if this process (``pid``) wrote it."""
    f = _job_file(job)
    try:
        if json.loads(f.read_text()).get("pid") == pid:
            f.unlink()
    except (OSError, ValueError):
        pass


def known_jobs() -> list[str]:
    try:
        return sorted(f.stem for f in jobs_dir().glob("*.json"))
    except OSError:
        return []


def lookup_job(job: str) -> dict:
    """The registry entry of a running job on this host.

    Raises:
        SnapshotError: no entry (not a protected job on this host, or a job without the hook), or
            an entry whose process is gone.
    """
    f = _job_file(job)
    try:
        info = json.loads(f.read_text())
    except FileNotFoundError:
        known = known_jobs()
        raise SnapshotError(f"no protected job {job!r} on this host: not running (it ended, or was not started with "
                            f"linkpass exec here, or has not reached its first step yet; jobs started with linkpass exec "
                            f"here: {', '.join(known) if known else 'none'}; registry {jobs_dir()})") from None
    except (OSError, ValueError) as e:
        raise SnapshotError(f"job {job!r}: its registry entry {f} cannot be read ({e})") from None
    pid = info.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        # a worker that was killed (or exited without its atexit) leaves its entry behind
        try:
            f.unlink()
            gone = "; the stale entry is removed"
        except OSError:
            gone = ""
        raise SnapshotError(f"job {job!r} is not running: its registry entry {f} is stale (pid {pid} is gone: the job "
                            f"ended or was killed){gone}")
    return info


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
