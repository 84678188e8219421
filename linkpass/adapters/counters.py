"""Counter sources for :mod:`linkpass.core.risk` (issue 18, part 1): sysfs and NVML readings ->
:class:`~linkpass.core.risk.CounterSample`, and what could not be read ->
:class:`~linkpass.core.risk.SourceProblem`.  Every reader takes a root directory, so tests and
benchmarks read captured trees (``tests/fixtures/counters/``).

Sources (paths under ``root``):

- RDMA port counters, ``sys/class/infiniband/<hca>/ports/<n>/counters/<name>`` and
  ``.../hw_counters/<name>``: one unsigned decimal per file (``drivers/infiniband/core/
  sysfs.c``: ``show_pma_counter`` prints ``%u``/``%llu`` + ``\\n``, ``print_hw_stat``
  ``%llu\\n``).  Widths and saturate/wrap behaviour: :data:`linkpass.core.risk.COUNTER_WIDTHS`.
- netdev statistics, ``sys/class/net/<netdev>/statistics/{rx_crc_errors,carrier_changes}``:
  one decimal (``net/core/net-sysfs.c``, ``NETSTAT_ENTRY``, ``fmt_u64``).  sysfs reads work on
  captured trees and need no netlink socket; pyroute2's ``IFLA_STATS64`` gives the same numbers.
- PCIe AER, ``sys/bus/pci/devices/<bdf>/aer_dev_{correctable,nonfatal,fatal}``
  (``drivers/pci/pcie/aer.c``, ``aer_stats_dev_attr``): one ``"<name> <count>"`` line per named
  error bit, then ``TOTAL_ERR_COR <n>`` / ``TOTAL_ERR_NONFATAL <n>`` / ``TOTAL_ERR_FATAL <n>``.
  The device's totals and those of every PCIe port above it (the directories above
  ``realpath(sys/bus/pci/devices/<bdf>)`` that are named like bus ids) are summed into one
  sample: a root port logs the errors of the link below it.  ``aer_correctable_dll`` sums the
  correctable lines of the Data Link Layer retry errors (:data:`linkpass.core.risk.DLL_RETRY_NAMES`:
  ``BadTLP``, ``BadDLLP``, ``Rollover``, ``Timeout``) the same way.
- optics temperature, ``sys/class/net/<netdev>/device/hwmon/hwmon*/temp<i>_{input,crit,label}``
  (Documentation/hwmon/sysfs-interface.rst: millidegrees Celsius).  mlx5 (Linux 6.5+,
  ``drivers/net/ethernet/mellanox/mlx5/core/hwmon.c``) registers one channel per ASIC/platform
  sensor and, when the module reports a temperature, one more for the module, whose MTMP
  sensor index is ``to_mtmp_module_sensor_idx(module) = 64 + module``; ``temp_input`` is the
  MTMP temperature, ``temp_crit`` its ``temp_threshold_hi``, ``temp_label`` the firmware's
  sensor name or, when the firmware gives none, ``"sensor%u"`` of the index.  So the module's
  channel is the one labelled ``sensor<N>`` with N >= 64, or one whose firmware name says
  "module"; it gives ``module_temp_c`` and ``module_temp_crit_c``.  No such channel: no sample
  (a firmware name that does not say what it is, is not guessed at).
- NVML (nvidia-ml-py, the ``nvml`` extra of pyproject.toml), per GPU index:
  ``nvmlDeviceGetTotalEccErrors(h, NVML_MEMORY_ERROR_TYPE_CORRECTED/UNCORRECTED,
  NVML_VOLATILE_ECC)``, ``nvmlDeviceGetRemappedRows(h)`` -> (corrected rows, uncorrected rows,
  pending, failure), ``nvmlDeviceGetRetiredPagesPendingStatus(h)``,
  ``nvmlDeviceGetNvLinkErrorCounter(h, link, NVML_NVLINK_ERROR_DL_CRC_FLIT/REPLAY/RECOVERY)``
  summed over the links that answer, ``nvmlDeviceGetPcieReplayCounter(h)``,
  ``nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)`` and
  ``nvmlDeviceGetTemperatureThreshold(h, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)``.  A call that
  raises ``NVML_ERROR_NOT_SUPPORTED`` is not a problem: that counter does not exist there.

Bounded reads: reading an RDMA PMA counter sends a MAD to the HCA's firmware and an NVML call
talks to the driver; either can hang.  :class:`CounterPoller` waits for a poll at most
``deadline_s``; a read not back by then is a ``timeout`` problem and its path (or NVML GPU) is
skipped in later polls until that read has returned ("has not returned"), so a hung file ties
up one reader thread, never the daemon.  The thread itself cannot be killed (a blocked
``read(2)`` in sysfs is uninterruptible); that is why hung paths are skipped.

How a poll reads: ONE reader thread runs the poll's reads in plan order and the polling thread
sleeps until the last is back, so a poll costs two thread hand-offs.  (A future per read in a
pool, as before, cost a GIL and condition hand-off per tiny read: ~9,400 futex calls a second
at 8 rails, most of the daemon's CPU.)  Reading in the polling thread itself would cost none,
but a hung read would then hang the poll.  If no read starts or returns for ``stall_s``
while reads are left to start, the read in progress is presumed stuck and another reader takes
the next read not started, and so on, with at most ``workers`` readers busy (stuck ones
included, those of earlier polls too); a stuck read that returns before the deadline counts,
and its thread goes on with what is left.  At ``deadline_s`` a read started and not back is a
timeout (its key is skipped until it returns) and a read never started, because every reader
was stuck, is a timeout saying so (tried again next poll).  ``stall_s`` defaults to
``min(0.25, deadline_s / 4)``: a healthy sysfs or NVML read takes microseconds to a few
milliseconds, so 250 ms is far above a slow healthy one, and a stall presumed wrongly costs
only one more reader thread for a while (the results are the same), while a real hang delays
the reads after it by at most a quarter of the 1 s poll interval; ``deadline_s / 4`` leaves
room for three stuck reads in one poll under a short deadline.  The plan (every read's paths and precomputed strings; the hwmon module channel
once found) is cached and made again every ``replan_polls`` polls (a ``hw_counters`` file that
appears later is picked up) and after a poll where a read found a file gone or unreadable (a
driver reload).

Bad input never raises: a file that is not a number is ``garbage``, a truncated AER file
without its TOTAL line is ``garbage``, a file or device that is gone is ``vanished``, any
other OSError is ``unreadable``.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkpass.core.risk import COUNTER_WIDTHS, DLL_RETRY_NAMES, CounterSample, SourceProblem

#: the RDMA port counters read (rules' counters and the rest of the IBTA PortCounters errors)
IB_COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
               "local_link_integrity_errors", "excessive_buffer_overrun_errors", "port_rcv_remote_physical_errors",
               "port_xmit_discards")
IB_HW_COUNTERS = ("rnr_nak_retry_err", "local_ack_timeout_err", "out_of_sequence", "packet_seq_err",
                  "roce_slow_restart", "req_transport_retries_exceeded")
NETDEV_COUNTERS = ("rx_crc_errors", "carrier_changes")
AER_FILES = (("aer_dev_correctable", "TOTAL_ERR_COR", "aer_correctable"),
             ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL", "aer_nonfatal"),
             ("aer_dev_fatal", "TOTAL_ERR_FATAL", "aer_fatal"))
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_SENSOR = re.compile(r"sensor(\d+)")
#: mlx5 hwmon.c to_mtmp_module_sensor_idx: module 0 is MTMP sensor 64
MODULE_SENSOR_BASE = 64
#: the most bytes read from one file: a counter is a line, an AER file a few hundred bytes
MAX_READ = 8192
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class ReadError(Exception):
    """A reading that could not be had: ``problem`` as in :class:`SourceProblem`."""

    def __init__(self, problem: str, detail: str):
        super().__init__(detail)
        self.problem = problem
        self.detail = detail


def _read(path: str | Path, shown: str | None = None) -> str:
    """A sysfs file's text; ``shown``: the path as problems name it (the path under the root).
    One ``read(2)`` of at most :data:`MAX_READ` bytes: sysfs hands an attribute's whole text to
    the first read (``kernfs_fop_read_iter``), and an open/read/close on an fd is half the cost
    of a buffered file object."""
    try:
        fd = os.open(path, _O_READ)
        try:
            data = os.read(fd, MAX_READ)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise ReadError("vanished", f"{shown or path}: gone") from None
    except OSError as e:
        raise ReadError("unreadable", f"{shown or path}: {e.strerror or e}") from None
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ReadError("garbage", f"{shown or path}: not ASCII text ({data[:16]!r})") from None


def parse_counter(text: str, where: str) -> int:
    """One sysfs counter file's text (``"123\\n"``) -> its value.

    Raises:
        ReadError: ``garbage`` (empty, truncated mid-number is indistinguishable from a short
            number so only a missing line end on an empty read is caught, not a number, a
            negative or a second word) naming ``where``.
    """
    t = text.strip()
    if not t:
        raise ReadError("garbage", f"{where}: empty")
    if not t.isdigit() or not t.isascii():
        raise ReadError("garbage", f"{where}: {t[:40]!r} is not an unsigned decimal counter")
    return int(t)


def parse_millidegrees(text: str, where: str) -> float:
    """A hwmon ``temp*_input`` / ``temp*_crit`` (signed millidegrees Celsius,
    Documentation/hwmon/sysfs-interface.rst) -> °C.

    Raises:
        ReadError: ``garbage`` naming ``where``.
    """
    t = text.strip()
    digits = t[1:] if t.startswith("-") else t
    if not digits or not digits.isdigit() or not digits.isascii():
        raise ReadError("garbage", f"{where}: {t[:40]!r} is not a temperature in millidegrees")
    return int(t) / 1000.0


def parse_aer(text: str, total_key: str, where: str) -> tuple[int, dict[str, int]]:
    """An ``aer_dev_*`` file (aer.c ``aer_stats_dev_attr``) -> (total, {error name: count}).

    Raises:
        ReadError: ``garbage`` naming ``where`` and the line: a line that is not ``name count``,
            or no ``total_key`` line (a truncated file).
    """
    total = None
    per: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ReadError("garbage", f"{where} line {n}: {line[:60]!r} is not '<name> <count>'")
        if parts[0] == total_key:
            total = int(parts[1])
        else:
            per[parts[0]] = int(parts[1])
    if total is None:
        raise ReadError("garbage", f"{where}: no {total_key} line (truncated?)")
    return total, per


@dataclass(frozen=True)
class RailSource:
    """What is read for one rail: ``hca`` / ``port`` (RDMA; None: not an RDMA rail),
    ``netdev``, ``bdf`` (the NIC's PCI bus id, for AER; None: unknown)."""

    rail: int
    netdev: str
    hca: str | None = None
    port: int | None = None
    bdf: str | None = None


@dataclass(frozen=True)
class GpuSource:
    """One GPU: NVML ``index`` and PCI ``bdf`` (for AER; None: unknown)."""

    index: int
    bdf: str | None = None


def upstream_ports(root: str | Path, bdf: str) -> list[str]:
    """The bus ids of the PCIe ports above ``bdf``, nearest first, from its sysfs device path
    (``sys/bus/pci/devices/<bdf>`` links to ``../../../devices/pci0000:00/0000:00:02.0/<bdf>``).
    Empty when the link is missing or the tree has no such path."""
    p = Path(root) / "sys/bus/pci/devices" / bdf
    try:
        real = Path(os.path.realpath(p))
    except OSError:
        return []
    out = []
    for part in reversed(real.parts[:-1]):
        if _BDF.match(part):
            out.append(part)
        elif part.startswith("pci"):
            break
    return out


#: a result slot whose read has not returned
_PENDING = object()


@dataclass(eq=False)
class _Read:
    """One planned read: a key for the hung-read bookkeeping, and what it yields.  ``fn``
    returns samples (``nvml``: ``(samples, [(counter, problem, detail)])`` as
    :meth:`NvmlCounters.read`) or raises :class:`ReadError`.  ``optional``: a file that is gone
    is no counter and no problem (which ``hw_counters`` exist depends on the driver)."""

    key: str
    fn: Callable[[], Any]
    kind: str
    subject: int
    counter: str
    source: str
    nvml: bool = False
    optional: bool = False

    @property
    def label(self) -> str:
        return f"NVML GPU {self.subject}" if self.nvml else self.source


class PollProgress:
    """One poll's reads as its reader threads go through them, in plan order: ``n`` reads, the
    first ``started`` of them started (the rest not), ``returned`` of them back, ``stalls``:
    times the poll saw no read start or return for ``stall_s`` while reads were left to start.
    Written under the poller's lock; what :attr:`CounterPoller.over` is given."""

    __slots__ = ("reads", "n", "results", "started", "returned", "stalls", "closed", "t_progress", "over")

    def __init__(self, reads: list[_Read], over: Callable[["PollProgress"], bool] | None):
        self.reads = reads
        self.n = len(reads)
        self.results: list[Any] = [_PENDING] * self.n
        self.started = self.returned = self.stalls = 0
        self.closed = False
        self.t_progress = 0.0
        self.over = over

    def done(self) -> bool:
        """True when the poll's wait is over (every read back; or what the ``over`` hook says)."""
        if self.over is None:
            return self.returned >= self.n
        try:
            return bool(self.over(self))
        except Exception:  # a broken test hook ends the wait rather than wedging a reader thread
            return True


class NvmlCounters:
    """Reads the NVML counters of GPUs by index.  ``nvml``: the ``pynvml`` module or a fake
    with the same functions (:class:`linkpass.adapters.counters_fake.FakeNvml`)."""

    def __init__(self, nvml: Any):
        self.nv = nvml
        self._handles: dict[int, Any] = {}

    def _h(self, i: int) -> Any:
        if i not in self._handles:
            self._handles[i] = self.nv.nvmlDeviceGetHandleByIndex(i)
        return self._handles[i]

    def _unsupported(self, e: Exception) -> bool:
        return getattr(e, "value", None) == getattr(self.nv, "NVML_ERROR_NOT_SUPPORTED", 3)

    def read(self, i: int, t_ns_of: Callable[[], int]) -> tuple[list[CounterSample], list[tuple[str, str, str]]]:
        """Samples of GPU ``i`` and problems as (counter, problem, detail)."""
        nv = self.nv
        out: list[CounterSample] = []
        bad: list[tuple[str, str, str]] = []

        def one(counter: str, api: str, f: Callable[[], Any]) -> None:
            try:
                v = f()
            except Exception as e:  # NVMLError and anything a broken binding raises
                if self._unsupported(e):
                    return
                bad.append((counter, "unreadable", f"nvml:{api} on GPU {i}: {e}"))
                return
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                bad.append((counter, "garbage", f"nvml:{api} on GPU {i}: {v!r}"))
                return
            out.append(CounterSample("gpu", i, counter, float(v), t_ns_of(), f"nvml:{api}"))

        try:
            h = self._h(i)
        except Exception as e:
            return [], [("nvml", "vanished", f"nvml:nvmlDeviceGetHandleByIndex({i}): {e}")]
        one("ecc_volatile_corrected", "nvmlDeviceGetTotalEccErrors",
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC))
        one("ecc_volatile_uncorrected", "nvmlDeviceGetTotalEccErrors",
            lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        try:
            rows = nv.nvmlDeviceGetRemappedRows(h)
            _c, _u, pending, failure = rows
            one("row_remap_pending", "nvmlDeviceGetRemappedRows", lambda: int(bool(pending)))
            one("row_remap_failure", "nvmlDeviceGetRemappedRows", lambda: int(bool(failure)))
        except Exception as e:
            if not self._unsupported(e):
                bad.append(("row_remap_pending", "unreadable", f"nvml:nvmlDeviceGetRemappedRows on GPU {i}: {e}"))
        one("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus",
            lambda: int(nv.nvmlDeviceGetRetiredPagesPendingStatus(h) == nv.NVML_FEATURE_ENABLED))
        for counter, kind in (("nvlink_crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
                              ("nvlink_replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
                              ("nvlink_recovery", "NVML_NVLINK_ERROR_DL_RECOVERY")):
            total, seen, err = 0, 0, None
            for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    total += int(nv.nvmlDeviceGetNvLinkErrorCounter(h, link, getattr(nv, kind)))
                    seen += 1
                except Exception as e:
                    if not self._unsupported(e) and getattr(e, "value", None) != getattr(nv, "NVML_ERROR_INVALID_ARGUMENT", 2):
                        err = e
            if err is not None:
                bad.append((counter, "unreadable", f"nvml:nvmlDeviceGetNvLinkErrorCounter on GPU {i}: {err}"))
            elif seen:
                out.append(CounterSample("gpu", i, counter, float(total), t_ns_of(), "nvml:nvmlDeviceGetNvLinkErrorCounter"))
        one("pcie_replay", "nvmlDeviceGetPcieReplayCounter", lambda: nv.nvmlDeviceGetPcieReplayCounter(h))
        one("gpu_temp_c", "nvmlDeviceGetTemperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        one("gpu_temp_slowdown_c", "nvmlDeviceGetTemperatureThreshold",
            lambda: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        return out, bad


@dataclass
class CounterPoller:
    """Reads every counter of the host once per :meth:`poll` (how, and why so: the module
    docstring, "Bounded reads").

    Args:
        rails, gpus: what to read (:meth:`from_topology` builds them from discovery).
        root: the sysfs root (``"/"`` live; a captured tree in tests).
        nvml: ``pynvml`` or a fake; None: no NVML counters.
        deadline_s: the most one poll waits for its reads.
        workers: the most reader threads busy at once, those stuck in a hung read included.
        stall_s: no read started or returned for this long while reads are left to start: the
            read in progress is presumed stuck and another reader goes on with the rest.
            None: ``min(0.25, deadline_s / 4)``.
        replan_polls: the plan (every read's paths and strings) is made again every this many
            polls, and on the poll after one where a read found a file gone or unreadable.
        clock: monotonic ns for samples and problems (tests pass a fake).
        over: test hook, ``over(progress: PollProgress) -> bool``: when given, the poll's wait
            ends as soon as it returns True (it is asked each time a read starts or returns and
            on each stall check) instead of when every read is back; ``deadline_s`` still
            bounds the wait.  What is not back then is treated as at the deadline.  Tests end a
            poll on an event with it (``lambda p: p.started == p.n and p.returned >= p.n - 1``:
            every read but the hung one back), not at a time the healthy reads must beat.
    """

    rails: list[RailSource]
    gpus: list[GpuSource] = field(default_factory=list)
    root: str | Path = "/"
    nvml: Any = None
    deadline_s: float = 2.0
    workers: int = 4
    stall_s: float | None = None
    replan_polls: int = 30
    clock: Callable[[], int] = time.monotonic_ns
    over: Callable[[PollProgress], bool] | None = None

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._pool = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="linkpass-counters")
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0  # reader threads in a poll's reads (hung ones included); under _cond
        self._closed = False
        self._hung: dict[str, tuple[PollProgress, int]] = {}
        self._nv = NvmlCounters(self.nvml) if self.nvml is not None else None
        self._ports: dict[str, list[str]] = {}
        self._plan: list[_Read] | None = None
        self._plan_of: tuple = ()
        self._plan_age = 0
        self.counters = {"polls": 0, "timeouts": 0, "not_started": 0, "stalls": 0, "plans": 0}

    @classmethod
    def from_topology(cls, rails: dict[int, str], topology: Any, **kw) -> "CounterPoller":
        """From the daemon's rails (rail id -> netdev, as ``[[rails]]`` lists them) and the
        discovered :class:`topology.model.Topology`: each rail's HCA, port and PCI bus id are
        those of the NIC whose port (or netdev list) names the rail's netdev; GPUs are the
        topology's GPUs that have an NVML index."""
        out: list[RailSource] = []
        for rail, netdev in sorted(rails.items()):
            src = RailSource(rail, netdev)
            for nic in getattr(topology, "nics", []) or []:
                port = next((p for p in nic.ports if p.netdev == netdev), None)
                if port is not None or netdev in (nic.netdevs or []):
                    rdma = nic.kind in (None, "rdma", "efa") and bool(nic.ports)
                    src = RailSource(rail, netdev, nic.name if rdma else None,
                                     (port.port if port is not None else nic.ports[0].port) if rdma else None,
                                     nic.pci_bus_id)
                    break
            out.append(src)
        gpus = [GpuSource(g.index, g.pci_bus_id) for g in getattr(topology, "gpus", []) or [] if g.index is not None]
        return cls(out, gpus, **kw)

    def aer_subjects(self) -> dict[str, tuple[str, int]]:
        """PCI bus id -> (kind, subject) for every device read and the ports above it (for
        :class:`linkpass.core.risk.AerLogCounter`); a port shared by several subjects names the
        first (GPUs before rails)."""
        out: dict[str, tuple[str, int]] = {}
        for kind, subject, bdf in ([("gpu", g.index, g.bdf) for g in self.gpus]
                                   + [("rail", r.rail, r.bdf) for r in self.rails]):
            if not bdf:
                continue
            for b in [bdf, *self._upstream(bdf)]:
                out.setdefault(b, (kind, subject))
        return out

    def _upstream(self, bdf: str) -> list[str]:
        if bdf not in self._ports:
            self._ports[bdf] = upstream_ports(self.root, bdf)
        return self._ports[bdf]

    # -- the reads of one poll (paths and strings made once per plan, not per poll)

    def _file_read(self, kind: str, subject: int, counter: str, path: Path, optional: bool = False) -> _Read:
        rel = "/" + str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)
        p = str(path)

        def fn() -> list[CounterSample]:
            v = parse_counter(_read(p, rel), rel)
            return [CounterSample(kind, subject, counter, float(v), self.clock(), rel)]
        return _Read(p, fn, kind, subject, counter, rel, optional=optional)

    def _aer_read(self, kind: str, subject: int, bdf: str, fname: str, total_key: str, counter: str) -> _Read:
        devs = [bdf, *self._upstream(bdf)]
        base = os.path.join(str(self.root), "sys/bus/pci/devices")
        src = f"/sys/bus/pci/devices/{{{','.join(devs)}}}/{fname}"
        files = [(os.path.join(base, d, fname), f"/sys/bus/pci/devices/{d}/{fname}", d == bdf) for d in devs]
        dev_dir = os.path.join(base, bdf)
        with_dll = fname == "aer_dev_correctable"

        def fn() -> list[CounterSample]:
            total = dll = 0
            for p, shown, own in files:
                try:
                    text = _read(p, shown)
                except ReadError as e:
                    if e.problem != "vanished":
                        raise
                    if not own:
                        continue  # a port without AER capability (or a host bridge) has no file
                    if os.path.exists(dev_dir):
                        return []  # the device is there without AER reporting (no capability, a VM): no counter
                    raise
                t, per = parse_aer(text, total_key, shown)
                total += t
                if with_dll:
                    dll += sum(n for name, n in per.items() if name in DLL_RETRY_NAMES)
            out = [CounterSample(kind, subject, counter, float(total), self.clock(), src)]
            if with_dll:
                out.append(CounterSample(kind, subject, "aer_correctable_dll", float(dll), self.clock(), src))
            return out
        return _Read(f"{bdf}:{fname}", fn, kind, subject, counter, src)

    def _hwmon_read(self, r: RailSource) -> _Read:
        d = os.path.join(str(self.root), "sys/class/net", r.netdev, "device/hwmon")
        src = f"/sys/class/net/{r.netdev}/device/hwmon"
        found: list[tuple[str, str, str | None, str]] = []  # the module channel's input and crit, once found

        def temp(path: str, shown: str, counter: str) -> CounterSample:
            t = parse_millidegrees(_read(path, shown), shown)
            return CounterSample("rail", r.rail, counter, t, self.clock(), shown)

        def search() -> list[CounterSample]:
            found.clear()
            try:
                hws = sorted(os.listdir(d))
            except (FileNotFoundError, NotADirectoryError):
                return []  # the driver exposes no hwmon: no optics temperature here
            except OSError as e:
                raise ReadError("unreadable", f"{src}: {e.strerror or e}") from None
            for hw in hws:
                hd = os.path.join(d, hw)
                try:
                    names = os.listdir(hd)
                except OSError:
                    continue  # not a directory
                for lab in sorted(n for n in names if len(n) >= 10 and n.startswith("temp") and n.endswith("_label")):
                    label = _read(os.path.join(hd, lab), f"{src}/{hw}/{lab}").strip()
                    m = _SENSOR.fullmatch(label)
                    if not ("module" in label.lower() or (m and int(m.group(1)) >= MODULE_SENSOR_BASE)):
                        continue
                    stem = lab[: -len("_label")]
                    inp, crit = os.path.join(hd, f"{stem}_input"), os.path.join(hd, f"{stem}_crit")
                    ishown, cshown = f"{src}/{hw}/{stem}_input", f"{src}/{hw}/{stem}_crit"
                    out = [temp(inp, ishown, "module_temp_c")]
                    has_crit = os.path.exists(crit)
                    if has_crit:
                        out.append(temp(crit, cshown, "module_temp_crit_c"))
                    found.append((inp, ishown, crit if has_crit else None, cshown))
                    return out
            return []

        def fn() -> list[CounterSample]:
            if found:  # the channel found before: its files only, no listing and no labels
                inp, ishown, crit, cshown = found[0]
                try:
                    out = [temp(inp, ishown, "module_temp_c")]
                    if crit is not None:
                        out.append(temp(crit, cshown, "module_temp_crit_c"))
                    return out
                except ReadError:
                    pass  # gone, moved or bad: search afresh, which reads and reports as ever
            return search()
        return _Read(f"hwmon:{r.netdev}", fn, "rail", r.rail, "module_temp_c", src)

    def plan(self) -> list[_Read]:
        """Every sysfs read of one poll, made afresh (a poll uses the one it cached, see
        ``replan_polls``)."""
        reads: list[_Read] = []
        for r in self.rails:
            if r.hca is not None and r.port is not None:
                pd = self.root / "sys/class/infiniband" / r.hca / "ports" / str(r.port)
                for c in IB_COUNTERS:
                    reads.append(self._file_read("rail", r.rail, c, pd / "counters" / c))
                hw = pd / "hw_counters"
                for c in IB_HW_COUNTERS:
                    if os.path.exists(hw / c):  # which hw_counters exist depends on the driver
                        reads.append(self._file_read("rail", r.rail, c, hw / c, optional=True))
            nd = self.root / "sys/class/net" / r.netdev / "statistics"
            for c in NETDEV_COUNTERS:
                reads.append(self._file_read("rail", r.rail, c, nd / c))
            if r.bdf:
                for fname, key, counter in AER_FILES:
                    reads.append(self._aer_read("rail", r.rail, r.bdf, fname, key, counter))
            reads.append(self._hwmon_read(r))
        for g in self.gpus:
            if g.bdf:
                for fname, key, counter in AER_FILES:
                    reads.append(self._aer_read("gpu", g.index, g.bdf, fname, key, counter))
        return reads

    def _nvml_reads(self) -> list[_Read]:
        if self._nv is None:
            return []
        return [_Read(f"nvml:{g.index}", (lambda i=g.index: self._nv.read(i, self.clock)), "gpu", g.index, "nvml",
                      "nvml", nvml=True) for g in self.gpus]

    def _reads(self) -> list[_Read]:
        """The cached plan, made again when it is due or the rails, GPUs or root changed."""
        of = (tuple(self.rails), tuple(self.gpus), self.root, self._nv)
        if self._plan is None or self._plan_age >= self.replan_polls or of != self._plan_of:
            self._plan = [*self.plan(), *self._nvml_reads()]
            self._plan_of, self._plan_age = of, 0
            self.counters["plans"] += 1
        self._plan_age += 1
        return self._plan

    # -- running them

    def _start(self, pp: PollProgress) -> bool:
        """A reader thread for ``pp``'s next read not started, if fewer than ``workers`` are
        busy (under ``_cond``)."""
        if self._closed or self._busy >= self.workers or pp.started >= pp.n:
            return False
        i = pp.started
        pp.started += 1
        self._busy += 1
        try:
            self._pool.submit(self._reader, pp, i)
        except RuntimeError:  # the pool is shut down
            pp.started -= 1
            self._busy -= 1
            return False
        return True

    def _reader(self, pp: PollProgress, i: int) -> None:
        """Reads ``pp``'s read ``i``, then the next not started, until none is left or the poll
        is over (a read that returns after its poll ended only records that it returned)."""
        cond = self._cond
        while True:
            rd = pp.reads[i]
            try:
                res: Any = rd.fn()
            except Exception as e:  # ReadError, and a reader bug: both reported by the poll
                res = e
            with cond:
                pp.results[i] = res
                pp.returned += 1
                pp.t_progress = time.monotonic()
                if pp.closed or pp.started >= pp.n:
                    self._busy -= 1
                    if (not pp.closed and pp.done()) or self._busy == 0:
                        cond.notify_all()
                    return
                i = pp.started
                pp.started += 1
                if pp.over is not None and pp.done():
                    cond.notify_all()

    def _run(self, reads: list[_Read]) -> tuple[PollProgress, list[Any]]:
        """Runs one poll's reads; returns when they are all back, at ``deadline_s``, or when
        ``over`` says so.  -> (the poll's progress, its results: :data:`_PENDING` where a read
        had not returned)."""
        pp = PollProgress(reads, self.over)
        if not reads:
            return pp, []
        stall = self.stall_s if self.stall_s is not None else min(0.25, self.deadline_s / 4)
        cond = self._cond
        with cond:
            now = time.monotonic()
            end = now + self.deadline_s
            pp.t_progress = now
            self._start(pp)  # none when every worker is stuck: retried at each stall check
            while not pp.done():
                now = time.monotonic()
                if now >= end or self._closed:
                    break
                if pp.started < pp.n and now - pp.t_progress >= stall:
                    pp.stalls += 1
                    self.counters["stalls"] += 1
                    self._start(pp)
                    pp.t_progress = now
                    continue  # the over hook may be waiting for this stall
                wake = pp.t_progress + stall if pp.started < pp.n else end  # all started: a return or the deadline
                cond.wait(min(end, wake) - now)
            pp.closed = True
            return pp, list(pp.results)

    def poll(self) -> tuple[list[CounterSample], list[SourceProblem]]:
        """Read everything once; never raises.  Returns (samples, problems)."""
        self.counters["polls"] += 1
        now = self.clock()
        samples: list[CounterSample] = []
        problems: list[SourceProblem] = []
        for k, (pp, i) in list(self._hung.items()):
            if pp.results[i] is not _PENDING:
                del self._hung[k]
        todo: list[_Read] = []
        for rd in self._reads():
            if rd.key in self._hung:
                verb = "call" if rd.nvml else "read"
                problems.append(SourceProblem(rd.kind, rd.subject, rd.counter, rd.source, "timeout",
                                              f"{rd.label}: an earlier {verb} has not returned; skipped", now))
            else:
                todo.append(rd)
        pp, results = self._run(todo)
        replan = False
        for i, (rd, res) in enumerate(zip(todo, results)):
            if res is _PENDING:
                if i < pp.started:
                    self.counters["timeouts"] += 1
                    self._hung[rd.key] = (pp, i)
                    why = f"no answer within {self.deadline_s:g} s"
                else:
                    self.counters["not_started"] += 1
                    why = f"not started within {self.deadline_s:g} s: every reader was stuck in an earlier read"
                problems.append(SourceProblem(rd.kind, rd.subject, rd.counter, rd.source, "timeout",
                                              f"{rd.label}: {why}", now))
            elif isinstance(res, ReadError):
                if res.problem in ("vanished", "unreadable"):
                    replan = True  # a device or driver change: what exists may have changed
                    if rd.optional and res.problem == "vanished":
                        continue
                problems.append(SourceProblem(rd.kind, rd.subject, rd.counter, rd.source, res.problem, res.detail, now))
            elif isinstance(res, Exception):  # a reader bug must not take the poll down
                problems.append(SourceProblem(rd.kind, rd.subject, rd.counter, rd.source, "unreadable",
                                              f"{rd.source}: {type(res).__name__}: {res}", now))
            elif rd.nvml:
                got, bad = res
                samples += got
                problems += [SourceProblem("gpu", rd.subject, c, "nvml", pr, d, now) for c, pr, d in bad]
            else:
                samples += res
        if replan:
            self._plan = None
        samples.sort(key=lambda s: (s.kind, s.subject, s.counter))
        return samples, problems

    def idle(self, timeout: float | None = None) -> bool:
        """Waits until no reader thread is busy (every read, hung ones included, has returned);
        True if so within ``timeout``.  For tests and shutdown."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        """Stop the workers (a hung read keeps its thread until it returns)."""
        with self._cond:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_nvml() -> Any | None:
    """``pynvml`` initialised, or None (not installed, no driver)."""
    try:
        nv = importlib.import_module("pynvml")
        nv.nvmlInit()
        return nv
    except Exception:  # ImportError, NVMLError_LibraryNotFound / DriverNotLoaded
        return None


def all_counter_names() -> Iterable[str]:
    """Every counter name a poll can produce (documentation and tests)."""
    return (*IB_COUNTERS, *IB_HW_COUNTERS, *NETDEV_COUNTERS, *(c for _, _, c in AER_FILES), "aer_correctable_dll", "module_temp_c",
            "module_temp_crit_c", "ecc_volatile_corrected", "ecc_volatile_uncorrected", "row_remap_pending",
            "row_remap_failure", "retired_pages_pending", "nvlink_crc_flit", "nvlink_replay", "nvlink_recovery",
            "pcie_replay", "gpu_temp_c", "gpu_temp_slowdown_c", *COUNTER_WIDTHS)
