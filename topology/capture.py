"""Copy the sysfs files that discovery reads into a directory, for a bug report or a test.

:func:`capture` runs :func:`topology.sysfs.read_sysfs` once with a recording reader and
writes into ``out_dir`` exactly what it touched, at the same paths: every file it read (the
bytes it read, so the copy agrees with the reading even when a counter moved meanwhile), every
symlink it crossed, as a symlink with its target text unchanged (sysfs targets are relative,
so they resolve inside the copy), and every directory it listed.  ``read_sysfs(out_dir)`` then
gives what ``read_sysfs(root)`` gave, warnings included, with two exceptions: the ``sources``
entry names the other root, and a file that could not be read at all (an I/O error) is not
copied, so the copy warns that it is missing.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from topology.sysfs import SysfsReader, read_with


def capture(out_dir: str | Path, root: str | Path = "/") -> list[str]:
    """Capture the sysfs files under ``root`` that :func:`~topology.sysfs.read_sysfs` reads
    into ``out_dir`` (created if missing; it must be empty).

    Returns:
        the in-tree paths (``/sys/...``) of the files and symlinks written, sorted.

    Raises:
        OSError: ``out_dir`` is not an empty directory or cannot be written.
    """
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    if os.listdir(out):
        raise OSError(errno.ENOTEMPTY, "directory not empty (capture writes only into an empty one)", out)
    fs = SysfsReader(root)
    read_with(fs)

    def dest(path: str) -> str:
        return out + path

    for d in sorted(fs.dirs):
        os.makedirs(dest(d), exist_ok=True)
    for p in sorted(set(fs.links) | set(fs.files)):
        os.makedirs(os.path.dirname(dest(p)), exist_ok=True)
    for p, target in sorted(fs.links.items()):
        os.symlink(target, dest(p))
    for p, data in sorted(fs.files.items()):
        with open(dest(p), "wb") as f:
            f.write(data)
    return sorted(set(fs.links) | set(fs.files))
