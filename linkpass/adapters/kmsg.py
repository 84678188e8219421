"""Follows the kernel log (``/dev/kmsg``, or a FIFO / appended file) and turns it into
:class:`~linkpass.core.model.DeviceIncident` events through the pure classifier
(:func:`linkpass.core.classify.classify_report`).

/dev/kmsg semantics (Linux ``Documentation/ABI/testing/dev-kmsg``): every ``read()`` returns
exactly one record, ``prio,seq,usec,flags;message\\n`` optionally followed by dictionary lines
that start with a space (`` SUBSYSTEM=pci``); a read with no record ready fails with EAGAIN on
a non-blocking descriptor; a read that finds its next record already overwritten in the ring
buffer fails with EPIPE once (an *overrun*), and the next read returns the oldest record still
there.  ``seq`` is a 64-bit counter that starts again at 0 after a reboot.

A FIFO or a regular file (``[device] kmsg_path``, for tests and for feeding a captured log) is
read as lines: lines shaped like kmsg records are records (dictionary lines skipped), any other
line is a plain log line (``dmesg``, journal, syslog format) classified without a ``seq``.  A
FIFO is opened read-write so it never reports end-of-file when a writer goes away; a regular
file is polled.

Resume (``[device] state_dir``): after each batch the last ``seq`` read and the kernel's boot id
(``/proc/sys/kernel/random/boot_id``) go to ``kmsg-<host>.state`` (written atomically).  On
start, records with ``seq <=`` the saved one are skipped; when the boot id differs or the saved
``seq`` is ahead of every record the kernel still holds (a reboot), the follower starts over.
Records read at start without a usable saved position (first start, reboot) are *backlog*:
their incidents are recorded but never acted on (nobody knows whether they were handled).

Incremental classification: the last ``window_lines`` lines are kept and classified again as
each batch arrives (batches settle for 50 ms so a multi-line NVRM message arrives whole); an
incident that happens in the new batch (its first line, or a repeat of it: the same code on the
same device again) is posted with its arrival time as ``t_ns``; one whose root is older carries
``follows``.  The follower keeps no memory of what it posted: whether a repeat is the same
incident or a new one (the same Xid on the same GPU for a new job) is decided by the engine's
one dedup window (``INCIDENT_DEDUP_NS`` in :mod:`linkpass.core.engine`), which also merges the
same fault seen through NVML and lets backlog sightings start no window.  Nothing read can
crash the follower: bad records are counted and skipped, a classifier failure is logged and
the batch dropped.  A kmsg that cannot be opened (not root,
a container without /dev/kmsg) is one WARNING and the source is off.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import stat
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from linkpass.core.classify import classify_report
from linkpass.core.model import DeviceIncident

log = logging.getLogger("linkpass.kmsg")

#: a kmsg record is at most ~8 KiB (PRINTK_MESSAGE_MAX + dictionary); a short buffer gives EINVAL
READ_SIZE = 65536
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_REC = re.compile(r"^(\d{1,4}),(\d{1,20}),(\d{1,20}),([^;]{0,16});(.*)$", re.S)
_DICT = re.compile(r"^ [A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class KmsgRecord:
    """One /dev/kmsg record.  ``prio`` is ``facility << 3 | level``; ``dictionary`` holds the
    continuation lines without their leading space."""

    prio: int
    seq: int
    usec: int
    flags: str
    message: str
    dictionary: tuple[str, ...] = ()

    @property
    def level(self) -> int:
        return self.prio & 7

    @property
    def facility(self) -> int:
        return self.prio >> 3

    def line(self) -> str:
        """The record's first line as :mod:`linkpass.core.logparse` reads kmsg records."""
        return f"{self.prio},{self.seq},{self.usec},{self.flags};{self.message}"


def parse_record(data: bytes | str) -> KmsgRecord | None:
    """A kmsg record from one ``read()`` (or one line of a file); None when it is not one.

    Never raises: undecodable bytes are replaced, a missing field gives None.
    """
    if isinstance(data, (bytes, bytearray)):
        data = bytes(data).decode("utf-8", errors="replace")
    if not isinstance(data, str):
        return None
    head, _, rest = data.partition("\n")
    m = _REC.match(head)
    if not m:
        return None
    try:
        prio, seq, usec = int(m.group(1)), int(m.group(2)), int(m.group(3))
    except ValueError:
        return None
    dictionary = tuple(line[1:] for line in rest.split("\n") if line.startswith(" "))
    return KmsgRecord(prio, seq, usec, m.group(4), m.group(5).rstrip("\r"), dictionary)


@dataclass(frozen=True)
class _Line:
    n: int            # absolute line number since start
    text: str
    seq: int | None
    backlog: bool


class KmsgFollower:
    """Follows one kernel-log source and posts incidents.

    Args:
        path: ``/dev/kmsg``, a FIFO, or a regular file.
        post: where incidents go (the engine queue's ``put_nowait``).
        state_dir: where the last sequence number is kept (None: no resume).
        host: this host's name (names the state file, so daemons of an emulated fabric that
            share a machine keep their own).
        window_lines: recent lines kept for the classifier.
        topology: an analysed ``topology.model.Topology`` (link events on non-compute ports are
            benign), or None.
        gpu_index: bus id -> NVML GPU index, or None when unknown.
        boot_id_path: where the kernel's boot id is read (tests point it elsewhere).

    Attributes:
        counters: ``records``, ``plain_lines``, ``bad_records``, ``overruns`` (EPIPE),
            ``seq_gaps`` (records missing between two seqs), ``skipped_resume``,
            ``skipped_duplicate``, ``incidents`` (posted, repeats included), ``classify_errors``,
            ``state_errors``, ``read_errors``.
        last_seq: the last record sequence number read (None before the first).
        active: True while the source runs.
    """

    def __init__(self, path: str, post: Callable[[DeviceIncident], Any], state_dir: str | None = None, host: str = "host",
                 window_lines: int = 400, topology: Any = None, gpu_index: Callable[[str], int | None] | None = None,
                 boot_id_path: str = BOOT_ID_PATH, settle_s: float = 0.05, poll_s: float = 0.1):
        self.path = path
        self.post = post
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host)[:64] or "host"
        self.state_file = Path(state_dir) / f"kmsg-{safe}.state" if state_dir else None
        self.topology = topology
        self.gpu_index = gpu_index
        self.boot_id_path = boot_id_path
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.counters: Counter[str] = Counter()
        self.last_seq: int | None = None
        self.active = False
        self.kind = ""  # "kmsg" (character device), "fifo" or "file"
        self._fd: int | None = None
        self._window: deque[_Line] = deque(maxlen=window_lines)
        self._next = 1
        self._buf = b""
        self._prev_kmsg = False
        self._resume_seq: int | None = None
        self._saved_seq: int | None = None
        self._saved_at = 0.0
        self._boot_id = self._read_boot_id()
        self._os_read = os.read  # tests replace it to simulate EPIPE

    # ------------------------------------------------------------------ open / state

    def open(self) -> bool:
        """Open the source; False (one WARNING) when it cannot be read: the source is off."""
        try:
            st = os.stat(self.path)
            if stat.S_ISFIFO(st.st_mode):
                self.kind, flags = "fifo", os.O_RDWR  # never EOF when a writer closes
            elif stat.S_ISCHR(st.st_mode):
                self.kind, flags = "kmsg", os.O_RDONLY
            elif stat.S_ISREG(st.st_mode):
                self.kind, flags = "file", os.O_RDONLY
            else:
                log.warning("kernel log %s: not a character device, FIFO or file: kmsg source off", self.path)
                return False
            self._fd = os.open(self.path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            log.warning("kernel log %s: cannot open (%s): kmsg source off (run as root, or give the container /dev/kmsg)",
                        self.path, e.strerror or e)
            return False
        self.active = True
        return True

    def close(self) -> None:
        self.save_state(force=True)
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        self.active = False

    def _read_boot_id(self) -> str | None:
        try:
            return Path(self.boot_id_path).read_text(encoding="ascii").strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def load_state(self) -> tuple[int | None, str | None]:
        """(saved seq, saved boot id); (None, None) when there is none or it is unreadable."""
        if self.state_file is None:
            return None, None
        try:
            d = json.loads(self.state_file.read_text(encoding="utf-8"))
            seq = d.get("seq")
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
                raise ValueError("seq")
            boot = d.get("boot_id")
            return seq, boot if isinstance(boot, str) else None
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, AttributeError) as e:
            log.warning("kmsg state %s unreadable (%s): reading the kernel log from its start", self.state_file, e)
            return None, None

    def save_state(self, force: bool = False) -> None:
        """Write the last seq (atomically); at most once a second unless ``force``."""
        if self.state_file is None or self.last_seq is None or self.last_seq == self._saved_seq:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < 1.0:
            return
        self._saved_at = now
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"seq": self.last_seq, "boot_id": self._boot_id}), encoding="utf-8")
            os.replace(tmp, self.state_file)
            self._saved_seq = self.last_seq
        except OSError as e:
            self.counters["state_errors"] += 1
            if self.counters["state_errors"] == 1:
                log.warning("kmsg state %s: cannot write (%s): a restarted daemon will read the log from its start",
                            self.state_file, e.strerror or e)

    # ------------------------------------------------------------------ reading

    def read_available(self) -> list[KmsgRecord | str]:
        """Everything readable now without blocking: records, and plain lines (FIFO/file)."""
        out: list[KmsgRecord | str] = []
        if self._fd is None:
            return out
        while True:
            try:
                data = self._os_read(self._fd, READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:  # EPIPE: records overwritten before we read them
                self.counters["overruns"] += 1
                lvl = logging.WARNING if self.counters["overruns"] == 1 else logging.DEBUG
                log.log(lvl, "kernel log %s: overrun, records were overwritten before they were read (%d so far); "
                        "continuing with the next record", self.path, self.counters["overruns"])
                continue
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                self.counters["read_errors"] += 1
                if self.counters["read_errors"] <= 3:
                    log.warning("kernel log %s: read failed: %s", self.path, e.strerror or e)
                break
            if not data:
                break  # end of a regular file
            if self.kind == "kmsg":
                rec = parse_record(data)
                if rec is None:
                    self.counters["bad_records"] += 1
                else:
                    out.append(rec)
            else:
                out += self._lines(data)
        return out

    def _lines(self, data: bytes) -> list[KmsgRecord | str]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > READ_SIZE:  # a line without an end: take what there is
            lines.append(self._buf)
            self._buf = b""
        out: list[KmsgRecord | str] = []
        for raw in lines:
            text = raw.decode("utf-8", errors="replace").rstrip("\r")
            if self._prev_kmsg and _DICT.match(text):
                continue  # a record's dictionary line
            rec = parse_record(text)
            self._prev_kmsg = rec is not None
            if rec is not None:
                out.append(rec)
            elif text.strip():
                out.append(text)
        return out

    def start_batch(self, items: list[KmsgRecord | str]) -> list[_Line]:
        """The records read at start: decide resume / start over, and mark backlog."""
        saved, boot = self.load_state()
        seqs = [r.seq for r in items if isinstance(r, KmsgRecord)]
        rebooted = saved is not None and ((boot and self._boot_id and boot != self._boot_id)
                                          or (seqs and saved > max(seqs)))
        if rebooted:
            log.info("kernel log %s: the kernel restarted since seq %d was saved: reading the log from its start",
                     self.path, saved)
            saved = None
        self._resume_seq = saved
        if saved is not None:
            log.info("kernel log %s: resuming after seq %d", self.path, saved)
            self.last_seq = saved
        return self.accept(items, backlog=saved is None, initial=True)

    def accept(self, items: list[KmsgRecord | str], backlog: bool = False, initial: bool = False) -> list[_Line]:
        """Turn records into window lines: skip what was already read, count gaps.  Plain lines
        read at start are backlog whatever the saved position says (they carry no seq)."""
        out: list[_Line] = []
        for r in items:
            if isinstance(r, str):
                self.counters["plain_lines"] += 1
                out.append(_Line(0, r, None, backlog or initial))
                continue
            if self.last_seq is not None and r.seq <= self.last_seq:
                self.counters["skipped_resume" if r.seq <= (self._resume_seq or -1) else "skipped_duplicate"] += 1
                continue
            if self.last_seq is not None and r.seq > self.last_seq + 1:
                self.counters["seq_gaps"] += r.seq - self.last_seq - 1
            self.last_seq = r.seq
            self.counters["records"] += 1
            out.append(_Line(0, r.line(), r.seq, backlog))
        return out

    # ------------------------------------------------------------------ classification

    def classify(self, lines: list[_Line], now_ns: int) -> list[DeviceIncident]:
        """Add lines to the window, classify it, post and return the incidents that happen in
        ``lines`` (a repeat of an earlier one included: the engine decides whether it is new)."""
        if not lines:
            return []
        start = self._next
        for ln in lines:
            self._window.append(_Line(self._next, ln.text, ln.seq, ln.backlog))
            self._next += 1
        window = list(self._window)
        try:
            rep = classify_report([w.text for w in window], self.topology)
        except Exception:  # a classifier bug costs this batch, never the daemon
            self.counters["classify_errors"] += 1
            log.exception("classifier failed on a kernel-log batch; batch dropped")
            return []
        if rep.error:
            self.counters["classify_errors"] += 1
            log.error("classifier failed on a kernel-log batch of %d line(s) (%s); batch dropped", len(window), rep.error)
            return []
        incs = rep.incidents
        out = []
        for inc in incs:
            fresh = [window[n - 1] for n in (inc.lines or (inc.first_line,)) if 1 <= n <= len(window) and window[n - 1].n >= start]
            if not fresh:
                continue  # nothing of it in this batch (a related event, e.g. a link back up, is not a new incident)
            w = fresh[0]
            follows = None
            if inc.secondary_of is not None and 0 <= inc.secondary_of < len(incs):
                root = incs[inc.secondary_of]
                follows = f"{root.code}@{root.device or '?'}"
            gpu = None
            if inc.device and self.gpu_index is not None:
                try:
                    gpu = self.gpu_index(inc.device)
                except Exception:
                    gpu = None
            ev = DeviceIncident("kmsg", inc.domain, inc.device, inc.code, inc.action, inc.remedy, now_ns,
                                summary=inc.summary[:300], follows=follows, backlog=w.backlog, gpu=gpu, seq=w.seq)
            out.append(ev)
            self.counters["incidents"] += 1
            try:
                self.post(ev)
            except Exception:
                log.exception("could not post a kernel-log incident")
        return out

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        """Follow the source until cancelled (call :meth:`open` first; it must have succeeded)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        watching = False
        try:
            self.classify(self.start_batch(self.read_available()), time.monotonic_ns())
            self.save_state(force=True)
            if self.kind != "file":
                try:
                    loop.add_reader(self._fd, ready.set)
                    watching = True
                except (OSError, ValueError, NotImplementedError) as e:
                    log.info("kernel log %s: cannot watch it (%s); polling every %.1f s", self.path, e, self.poll_s)
            while True:
                if watching:
                    await ready.wait()
                    ready.clear()
                else:
                    await asyncio.sleep(self.poll_s)
                    self._check_truncated()
                items = self.read_available()
                if not items:
                    continue
                await asyncio.sleep(self.settle_s)  # let the rest of a multi-line message arrive
                ready.clear()
                items += self.read_available()
                self.classify(self.accept(items), time.monotonic_ns())
                self.save_state()
        finally:
            if watching and self._fd is not None:
                loop.remove_reader(self._fd)
            self.close()

    def _check_truncated(self) -> None:
        """A regular file cut short (rotated, truncated): read it again from its start."""
        if self.kind != "file" or self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_size < os.lseek(self._fd, 0, os.SEEK_CUR):
                os.lseek(self._fd, 0, os.SEEK_SET)
                self._buf = b""
                log.info("kernel log %s: file was truncated; reading it from its start", self.path)
        except OSError:
            pass

    def status(self) -> dict:
        return {"path": self.path, "kind": self.kind, "active": self.active, "last_seq": self.last_seq,
                **dict(self.counters)}
