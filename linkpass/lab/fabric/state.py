"""The fabric's state file ``/run/linkpass/fabric/{name}/fabric.json`` and the lock that
serialises every mutating call (an ``flock`` on ``/run/linkpass/fabric``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator

from linkpass.lab.fabric.errors import FabricError
from linkpass.lab.fabric.spec import SCHEMA, STATE_ROOT, _check_name


def state_dir(name: str) -> str:
    """The state directory of fabric ``name``."""
    return os.path.join(STATE_ROOT, _check_name(name))


def _state_file(name: str) -> str:
    return os.path.join(STATE_ROOT, name, "fabric.json")


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    os.makedirs(STATE_ROOT, mode=0o755, exist_ok=True)
    fd = os.open(STATE_ROOT, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_state(name: str) -> dict | None:
    path = _state_file(name)
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise FabricError(f"{path}: unreadable fabric state ({e})") from None
    if not isinstance(desc, dict) or desc.get("schema") != SCHEMA:
        raise FabricError(f"{path}: not a {SCHEMA} fabric state file")
    return desc


def _write_state(desc: dict) -> None:
    path = _state_file(desc["name"])
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(desc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _require(name: str) -> dict:
    desc = _read_state(name)
    if desc is None:
        raise FabricError(f"no fabric named {name} (create it with `linkpass fabric up --name {name} --hosts H --rails R`)")
    return desc


def _require_ready(name: str) -> dict:
    desc = _require(name)
    if desc.get("status") != "ready":
        raise FabricError(
            f"fabric {name} is incomplete (an earlier `up` did not finish); run `linkpass fabric down --name {name}`"
        )
    return desc
