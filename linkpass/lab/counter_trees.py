"""Captured-sysfs counter trees over time, written from a readable spec (tests, the risk
benchmark, and counter injection on the emulated fabric).  Not the product.

A spec (``tests/fixtures/counters/sequences.json``) has a ``host`` and named ``sequences``::

    "host": {"rails": [{"rail": 0, "hca": "mlx5_0", "port": 1, "netdev": "ibp26s0",
                        "bdf": "0000:1a:00.0", "root_port": "0000:17:01.0"}, ...],
             "gpus":  [{"index": 0, "bdf": "0000:1b:00.0", "root_port": "0000:17:02.0"}, ...]}
    "sequences": {"<name>": {
        "interval_s": 10, "steps": 60,
        "failure": {"step": 45, "kind": "rail", "subject": 0, "what": "..."} | null,
        "expect_at_risk": [["rail", 0]],          # subjects a correct tracker flags (before the failure)
        "series": {"rail:0:symbol_error": SERIES, "gpu:1:aer_correctable": SERIES, ...},
        "nvml": {"0": {"ecc_corrected": SERIES, "remap": [[0,0,0,0], ...], ...}}}}

A SERIES is a list of per-step values (the last repeats; an item ``[value, n]`` is ``value``
for ``n`` steps), or ``{"base": b, "rise": [[from,
to, per_step], ...]}`` (a cumulative counter rising ``per_step`` on steps ``from``..``to-1``).
A value may be a string: ``"garbage:<text>"`` writes that text, ``"missing"`` removes the file,
``"truncated"`` (AER files) cuts the TOTAL line.  ``"vanish": {"rail:0": step}`` removes the
rail's (or GPU's) whole device directory from that step on (``[from, to]``: for those steps, a
driver reload).  Counters not named read 0.
Counter names are those of :mod:`linkpass.adapters.counters` (``aer_correctable``: the
endpoint's correctable errors, written as RxErr; ``aer_correctable_dll``: its Replay Timer
Timeouts; ``port_aer_correctable`` / ``port_aer_correctable_dll``: the same at its root port;
``state`` the IB port state).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from linkpass.adapters.counters import IB_COUNTERS, IB_HW_COUNTERS, NETDEV_COUNTERS, GpuSource, RailSource

AER_NAMES = {
    "aer_dev_correctable": (("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr",
                             "HeaderOF"), "TOTAL_ERR_COR", "RxErr"),
    "aer_dev_nonfatal": (("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
                          "MalfTLP", "ECRC", "UnsupReq", "ACSViol"), "TOTAL_ERR_NONFATAL", "CmpltTO"),
    "aer_dev_fatal": (("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO"), "TOTAL_ERR_FATAL", "SDES"),
}
AER_COUNTER = {"aer_correctable": "aer_dev_correctable", "aer_nonfatal": "aer_dev_nonfatal",
               "aer_fatal": "aer_dev_fatal"}


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _expand(series: list) -> list:
    out: list = []
    for item in series:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[1], int) and not isinstance(item[1], bool):
            out += [item[0]] * item[1]
        else:
            out.append(item)
    return out


def value_at(series: Any, step: int) -> Any:
    """A SERIES' value at ``step`` (see the module docstring)."""
    if series is None:
        return 0
    if isinstance(series, list):
        series = _expand(series)
        return series[min(step, len(series) - 1)] if series else 0
    v = series.get("base", 0)
    for a, b, per in series.get("rise", []):
        v += per * max(0, min(step, b) - a)
    return v


def rail_sources(host: dict) -> list[RailSource]:
    return [RailSource(r["rail"], r["netdev"], r.get("hca"), r.get("port"), r.get("bdf")) for r in host["rails"]]


def gpu_sources(host: dict) -> list[GpuSource]:
    return [GpuSource(g["index"], g.get("bdf")) for g in host["gpus"]]


def _devdir(root: Path, dev: dict) -> Path:
    rp = dev["root_port"]
    return root / "sys/devices" / f"pci{rp[:4]}:{rp[5:7]}" / rp / dev["bdf"]


def _link(target: Path, at: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    if at.is_symlink() or at.exists():
        at.unlink()
    at.symlink_to(os.path.relpath(target, at.parent))


def build_host(root: str | Path, host: dict) -> None:
    """The directories and links of ``host`` under ``root`` (values come from :func:`write_step`)."""
    root = Path(root)
    for dev in [*host["rails"], *host["gpus"]]:
        d = _devdir(root, dev)
        d.mkdir(parents=True, exist_ok=True)
        _link(d, root / "sys/bus/pci/devices" / dev["bdf"])
        _link(d.parent, root / "sys/bus/pci/devices" / dev["root_port"])
    for r in host["rails"]:
        d = _devdir(root, r)
        nd = root / "sys/class/net" / r["netdev"]
        (nd / "statistics").mkdir(parents=True, exist_ok=True)
        _link(d, nd / "device")
        if r.get("hca"):
            pd = root / "sys/class/infiniband" / r["hca"] / "ports" / str(r["port"])
            (pd / "counters").mkdir(parents=True, exist_ok=True)
            (pd / "hw_counters").mkdir(parents=True, exist_ok=True)
            _link(d, root / "sys/class/infiniband" / r["hca"] / "device")
        if r.get("module_temp", True):
            hw = d / "hwmon" / "hwmon0"
            hw.mkdir(parents=True, exist_ok=True)
            # mlx5 hwmon.c: the firmware's sensor names, or "sensor%u" of the MTMP index (module 0: 64)
            (hw / "name").write_text("mlx5\n")
            (hw / "temp1_label").write_text("sensor0\n")
            (hw / "temp2_label").write_text("sensor64\n")


def _put(path: Path, v: Any, text_of, written: dict | None) -> None:
    if v == "missing":
        if path.exists():
            path.unlink()
        if written is not None:
            written.pop(path, None)
        return
    text = v[len("garbage:"):] if isinstance(v, str) and v.startswith("garbage:") else text_of(v)
    if written is not None and written.get(path) == text and path.exists():
        return  # unchanged since the last step: leave the file alone
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if written is not None:
        written[path] = text


def aer_text(fname: str, total: Any, dll: Any = 0) -> str:
    """``total`` errors on the file's default line (RxErr, CmpltTO, SDES), plus ``dll``
    Replay Timer Timeouts (correctable only), and the TOTAL line."""
    names, total_key, where = AER_NAMES[fname]
    if total == "truncated":
        return "".join(f"{n} 0\n" for n in names[:3])
    t, r = int(total), int(dll)
    lines = "".join(f"{n} {t if n == where else r if n == 'Timeout' else 0}\n" for n in names)
    return lines + f"{total_key} {t + r}\n"


def write_step(root: str | Path, host: dict, seq: dict, step: int, written: dict | None = None) -> None:
    """Write every value of ``seq`` at ``step`` (build the host first).  ``written``: a dict
    kept between the steps of one tree (files whose text did not change are not rewritten)."""
    root = Path(root)
    if written is None:
        written = {}
    put = lambda path, v, text_of: _put(path, v, text_of, written)  # noqa: E731
    ser = seq.get("series", {})
    vanish = seq.get("vanish", {})

    def v(kind: str, subj: int, counter: str, default: Any = 0) -> Any:
        s = ser.get(f"{kind}:{subj}:{counter}")
        return default if s is None else value_at(s, step)

    for kind, devs in (("rail", host["rails"]), ("gpu", host["gpus"])):
        for dev in devs:
            subj = dev["rail"] if kind == "rail" else dev["index"]
            d = _devdir(root, dev)
            span = vanish.get(f"{kind}:{subj}")
            if isinstance(span, int):
                span = [span, 1 << 30]
            gone = bool(span) and span[0] <= step < span[1]
            if gone:
                if d.exists():
                    shutil.rmtree(d)
                if kind == "rail" and dev.get("hca"):
                    shutil.rmtree(root / "sys/class/infiniband" / dev["hca"], ignore_errors=True)
                continue
            d.mkdir(parents=True, exist_ok=True)
            for counter, fname in AER_COUNTER.items():
                dll = v(kind, subj, "aer_correctable_dll") if counter == "aer_correctable" else 0
                pdll = v(kind, subj, "port_aer_correctable_dll") if counter == "aer_correctable" else 0
                put(d / fname, v(kind, subj, counter), lambda x, f=fname, r=dll: aer_text(f, x, r))
                put(d.parent / fname, v(kind, subj, "port_" + counter), lambda x, f=fname, r=pdll: aer_text(f, x, r))
            if kind != "rail":
                continue
            if dev.get("hca"):
                pd = root / "sys/class/infiniband" / dev["hca"] / "ports" / str(dev["port"])
                for c in IB_COUNTERS:
                    put(pd / "counters" / c, v(kind, subj, c), lambda x: f"{int(x)}\n")
                for c in IB_HW_COUNTERS:
                    put(pd / "hw_counters" / c, v(kind, subj, c), lambda x: f"{int(x)}\n")
                put(pd / "state", v(kind, subj, "state", "4: ACTIVE"), lambda x: f"{x}\n")
            nd = root / "sys/class/net" / dev["netdev"] / "statistics"
            for c in NETDEV_COUNTERS:
                put(nd / c, v(kind, subj, c), lambda x: f"{int(x)}\n")
            hw = d / "hwmon" / "hwmon0"
            if hw.is_dir():
                put(hw / "temp1_input", 55000, lambda x: f"{int(x)}\n")
                put(hw / "temp2_input", v(kind, subj, "module_temp_c", 48) * 1000, lambda x: f"{int(x)}\n")
                put(hw / "temp2_crit", v(kind, subj, "module_temp_crit_c", 75) * 1000, lambda x: f"{int(x)}\n")


def nvml_steps(seq: dict, host: dict) -> dict[int, list[dict]]:
    """The sequence's NVML readings as :class:`linkpass.adapters.counters_fake.FakeNvml` steps;
    GPUs the sequence does not name read clean (0 errors, 60 °C, slowdown 87 °C)."""
    nv = seq.get("nvml", {})
    steps = seq["steps"]
    out: dict[int, list[dict]] = {}
    for g in host["gpus"]:
        spec = nv.get(str(g["index"]), {})
        seqs = []
        for n in range(steps):
            st = {"ecc_corrected": value_at(spec.get("ecc_corrected"), n), "ecc_uncorrected": 0,
                  "remap": tuple(value_at(spec.get("remap"), n) or (0, 0, 0, 0)),
                  "retired_pending": value_at(spec.get("retired_pending"), n),
                  "nvlink": {"crc_flit": [value_at(spec.get("nvlink_crc_flit"), n)] + [0] * 17,
                             "replay": [value_at(spec.get("nvlink_replay"), n)] + [0] * 17,
                             "recovery": [0] * 18},
                  "pcie_replay": value_at(spec.get("pcie_replay"), n),
                  "temp": value_at(spec.get("temp"), n) or 60, "slowdown": 87}
            seqs.append(st)
        out[g["index"]] = seqs
    return out


def synthetic_host(rails: int = 8, gpus: int = 8) -> dict:
    """An HGX-like host: ``rails`` RDMA NICs and ``gpus`` GPUs, a NIC and a GPU under each root port."""
    host: dict = {"rails": [], "gpus": []}
    for i in range(max(rails, gpus)):
        bus = 0x18 + 0x10 * i
        rp = f"0000:{bus - 1:02x}:01.0"
        if i < rails:
            host["rails"].append({"rail": i, "hca": f"mlx5_{i}", "port": 1, "netdev": f"ibp{bus}s0",
                                  "bdf": f"0000:{bus:02x}:00.0", "root_port": rp})
        if i < gpus:
            host["gpus"].append({"index": i, "bdf": f"0000:{bus + 1:02x}:00.0", "root_port": rp.replace(":01.0", ":02.0")})
    return host
