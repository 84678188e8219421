"""The emulated hosts' hardware counters: a sysfs tree per host that its daemon polls
(``[risk] sysfs_root``), since veth has no RDMA port counters, no AER files and no optics.

Host ``I``'s tree is ``<state_dir>/h<I>.sys``: for each rail ``R`` an RDMA port
(``sys/class/infiniband/mlx5_<R>/ports/1/counters/*``, ``hw_counters/*``) bound to the rail's
netdev (``sys/class/net/<netdev>/device`` -> the NIC's PCI function ``0000:<0x40+R>:00.0``
under root port ``0000:<0x3f+R>:01.0``), netdev statistics, AER files and an optics hwmon;
for each emulated GPU ``G`` (:mod:`linkpass.lab.fabric.gpus`) its AER files at
``0000:<0x18+G>:00.0``.  Every counter starts at 0, every temperature is normal.
``linkpass inject counters`` (:func:`linkpass.lab.inject.inject_counters`) makes them climb.
"""

from __future__ import annotations

import os
from pathlib import Path

from linkpass.lab import counter_trees
from linkpass.lab.fabric.gpus import MAX_GPUS, fake_pci_bus_id

#: GPUs with counter files per emulated host: every emulated GPU (the daemon's [device] gpus map
#: names them all, and a GPU without its files would read as vanished)
GPUS_WITH_COUNTERS = MAX_GPUS


def tree_root(desc: dict, i: int) -> str:
    """The sysfs root of emulated host ``i``."""
    return os.path.join(desc["state_dir"], f"h{i}.sys")


def nic_bus_id(rail: int) -> str:
    return f"0000:{0x40 + rail:02x}:00.0"


def host_spec(desc: dict, i: int) -> dict:
    """Host ``i`` in :mod:`linkpass.lab.counter_trees`'s spec form."""
    h = desc["hosts"][i]
    rails = [{"rail": r["rail"], "hca": f"mlx5_{r['rail']}", "port": 1, "netdev": r["netdev"],
              "bdf": nic_bus_id(r["rail"]), "root_port": f"0000:{0x3f + r['rail']:02x}:01.0"} for r in h["rails"]]
    gpus = [{"index": g, "bdf": fake_pci_bus_id(g), "root_port": f"0000:{0x08 + g:02x}:01.0"}
            for g in range(GPUS_WITH_COUNTERS)]
    return {"rails": rails, "gpus": gpus}


def build(desc: dict, i: int) -> None:
    """Write host ``i``'s tree, every counter 0."""
    root = tree_root(desc, i)
    spec = host_spec(desc, i)
    counter_trees.build_host(root, spec)
    counter_trees.write_step(root, spec, {"steps": 1, "series": {}}, 0)


def counter_path(desc: dict, i: int, kind: str, subject: int, counter: str) -> tuple[Path, str]:
    """Where ``counter`` of rail / GPU ``subject`` of host ``i`` lives, and its format
    (``"int"``: one decimal; ``"aer:<file>"``: an AER file whose TOTAL line is the count).

    Raises:
        KeyError: no such counter for that kind.
    """
    from linkpass.adapters.counters import IB_COUNTERS, IB_HW_COUNTERS, NETDEV_COUNTERS

    root = Path(tree_root(desc, i))
    spec = host_spec(desc, i)
    if counter in counter_trees.AER_COUNTER:
        devs = spec["rails"] if kind == "rail" else spec["gpus"]
        key = "rail" if kind == "rail" else "index"
        dev = next(d for d in devs if d[key] == subject)
        return root / "sys/bus/pci/devices" / dev["bdf"] / counter_trees.AER_COUNTER[counter], \
            "aer:" + counter_trees.AER_COUNTER[counter]
    if kind != "rail":
        raise KeyError(counter)
    r = next(d for d in spec["rails"] if d["rail"] == subject)
    port = root / "sys/class/infiniband" / r["hca"] / "ports" / "1"
    if counter in IB_COUNTERS:
        return port / "counters" / counter, "int"
    if counter in IB_HW_COUNTERS:
        return port / "hw_counters" / counter, "int"
    if counter in NETDEV_COUNTERS:
        return root / "sys/class/net" / r["netdev"] / "statistics" / counter, "int"
    raise KeyError(counter)


def counters_for(kind: str) -> tuple[str, ...]:
    """The counter names ``linkpass inject counters`` can raise for a rail or a GPU."""
    from linkpass.adapters.counters import IB_COUNTERS, IB_HW_COUNTERS, NETDEV_COUNTERS

    aer = tuple(counter_trees.AER_COUNTER)
    return (*IB_COUNTERS, *IB_HW_COUNTERS, *NETDEV_COUNTERS, *aer) if kind == "rail" else aer


def read_count(path: Path, fmt: str) -> int:
    """The count in ``path`` (0 when the file is missing)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    if fmt == "int":
        return int(text.strip() or 0)
    total = [ln.split()[1] for ln in text.splitlines() if ln.startswith("TOTAL_ERR_")]
    return int(total[0]) if total else 0


def write_count(path: Path, fmt: str, value: int) -> None:
    """Replace ``path`` atomically (a poll never reads half a file)."""
    text = f"{value}\n" if fmt == "int" else counter_trees.aer_text(fmt.split(":", 1)[1], value)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(text)
    os.replace(tmp, path)
