"""Durable, bounded outbox for alert events: sqlite3 (stdlib) in WAL mode.

Why: an alert lost while the broker restarts is a fault nobody repairs.  The MQTT publisher
(:mod:`linkpass.adapters.mqtt`) writes every event here *before* publishing it and removes it
only after the broker acknowledged it (PUBACK for QoS 1, PUBCOMP for QoS 2).  After a broker
outage or a daemon restart the rows still here are sent again, oldest first.  Delivery is
therefore at-least-once: a row whose acknowledgement was lost is sent twice; subscribers
de-duplicate by the event's ``id``.

Schema (``user_version`` 1)::

    events(id INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER, critical INTEGER, payload BLOB)
    meta(key TEXT PRIMARY KEY, value INTEGER)   -- next_seq, dropped_total, last_ts_us

* ``seq``: per-host event sequence number, 1, 2, 3, ... assigned by :meth:`Outbox.put` in the
  same transaction as the row, so it keeps counting across restarts (``meta.next_seq``) and
  never repeats, even when the outbox was emptied.
* ``last_ts_us``: the latest event wall-clock time (µs since the epoch) handed to
  :meth:`Outbox.put`, stored in the same transaction as the row, so the publisher can keep
  event ``ts`` non-decreasing in ``seq`` order across restarts (:attr:`Outbox.last_ts_us`).
* File modes: the database, its ``-wal`` and ``-shm`` files and ``<path>.lock`` are 0600
  (the directory, when created here, 0700).  The database file is created 0600 *before*
  sqlite opens it, and sqlite creates the WAL and shared-memory files with the database
  file's permissions (sqlite os_unix.c ``findCreateFileMode()`` and
  ``unixOpenSharedMemory()``), so nothing is ever world-readable, whatever the umask; files
  left by an older linkpass with wider modes are narrowed to 0600 at open.  (No process-wide
  ``os.umask`` change.)
* Durability: ``journal_mode=WAL``; ``synchronous=NORMAL`` by default (a committed event
  survives the daemon being killed: the WAL is in the kernel's page cache; only a power loss
  or kernel crash can lose the last commits) or ``FULL`` (fsync per event: survives power
  loss, costs a disk flush per event).  See https://www.sqlite.org/wal.html and
  https://www.sqlite.org/pragma.html#pragma_synchronous.

Overflow policy (the outbox holds at most ``max_events`` rows): adding an event to a full
outbox first removes the **oldest non-critical** event (recoveries, failbacks, ...); only when
every queued event is critical is the **oldest event** removed.  The new event is always kept
(the newest news about a fault is the most useful).  Every removal adds one to
``dropped_total`` (persisted; a metric) and is logged (the first few at WARNING).

Bad data never stops the daemon: a row that cannot be used (payload not a UTF-8 JSON object,
``seq`` not an integer) is removed, counted in ``malformed`` and logged; a file that is not a
usable outbox database (corrupt, another program's, a newer schema) is moved aside to
``<path>.bad-<unix time>`` and a fresh outbox is created (logged as an error).

One process per file: the outbox holds an exclusive ``flock`` on ``<path>.lock`` while open,
so a second daemon configured with the same ``outbox_path`` (several emulated hosts on one
machine, a copy-pasted config) gets :class:`OutboxError` instead of sending the first one's
events under its own name.

Not thread-safe: one event loop thread uses it (sqlite calls here take tens of microseconds).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("linkpass.outbox")

SCHEMA_VERSION = 1
_LOUD = 5  # drops / malformed rows logged at WARNING before going quiet (DEBUG)


class OutboxError(Exception):
    """The outbox cannot be opened or created at all (directory missing and not creatable,
    no permission).  ``str(err)`` is one line naming the path."""


@dataclass(frozen=True)
class OutboxRow:
    """One queued event.

    Attributes:
        rowid: the row's key (pass it to :meth:`Outbox.ack`).
        seq: the event's sequence number (1, 2, ...; per outbox, survives restarts).
        critical: True for events the overflow policy keeps longest.
        payload: the JSON document, UTF-8 bytes.
        doc: the same document parsed (a dict).
    """

    rowid: int
    seq: int
    critical: bool
    payload: bytes
    doc: dict = field(default_factory=dict, compare=False, repr=False)


class Outbox:
    """A bounded FIFO of event payloads in an sqlite database file.

    Args:
        path: database file (its directory is created, mode 0700, when missing);
            ``":memory:"`` for a non-durable outbox (tests, or the fallback when the file
            cannot be used).
        max_events: most rows kept (>= 1); see the module docstring for the overflow policy.
        sync: ``"normal"`` (survives a daemon crash) or ``"full"`` (survives power loss).

    Raises:
        OutboxError: the file cannot be opened or created (one line naming the path).
        ValueError: ``max_events`` < 1 or an unknown ``sync``.

    Attributes:
        dropped_total: events removed by the overflow policy, ever (persisted).
        malformed: unusable rows removed since this object was created.
        moved_aside: where an unusable database file was moved, or None.
    """

    def __init__(self, path: str | os.PathLike, max_events: int = 100_000, sync: str = "normal"):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        if sync not in ("normal", "full"):
            raise ValueError(f"sync must be 'normal' or 'full', got {sync!r}")
        self.path = str(path)
        self.max_events = max_events
        self.sync = sync
        self.malformed = 0
        self.moved_aside: str | None = None
        self._drops_logged = 0
        self._lock_fd: int | None = None
        if self.path != ":memory:":
            self._lock()
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as e:  # not a database, or not ours: keep it, start afresh
            if self.path == ":memory:":
                raise
            aside = f"{self.path}.bad-{int(time.time())}"
            try:
                os.replace(self.path, aside)
                for ext in ("-wal", "-shm"):
                    if os.path.exists(self.path + ext):
                        os.replace(self.path + ext, aside + ext)
            except OSError as e2:
                raise OutboxError(f"{self.path}: not a usable outbox ({e}) and cannot move it aside: {e2.strerror or e2}") from None
            self.moved_aside = aside
            log.error("outbox %s: not a usable outbox database (%s); moved it to %s and started an empty one", self.path, e, aside)
            self._db = self._open()
        self._depth = self._db.execute("SELECT count(*) FROM events").fetchone()[0]
        self._next_seq = self._meta("next_seq", 1)
        self.dropped_total = self._meta("dropped_total", 0)
        self._last_ts_us = self._meta("last_ts_us", 0)
        # a restored or edited database may hold rows beyond next_seq: never reuse a number
        top = self._db.execute("SELECT max(seq) FROM events").fetchone()[0]
        if isinstance(top, int) and top >= self._next_seq:
            self._next_seq = top + 1

    # ---------------------------------------------------------------- open

    def _lock(self) -> None:
        parent = Path(self.path).parent
        try:
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise OutboxError(f"{self.path}: cannot create {self.path}.lock: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OutboxError(f"{self.path}: in use by another process (another linkpass daemon with the same "
                              "mqtt.outbox_path?)") from None
        self._lock_fd = fd

    def _private_files(self) -> None:
        """Create the database file 0600 if it is missing (sqlite then creates ``-wal`` and
        ``-shm`` with the same mode) and narrow existing files to 0600."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except IsADirectoryError:
            return  # sqlite says what is wrong
        except OSError as e:
            raise OutboxError(f"{self.path}: cannot create the outbox database: {e.strerror or e}") from None
        os.close(fd)
        for f in (self.path, self.path + "-wal", self.path + "-shm"):
            try:
                if os.stat(f).st_mode & 0o077:
                    os.chmod(f, 0o600)
            except FileNotFoundError:
                pass
            except OSError as e:  # not ours to change (another owner): say so once
                log.warning("outbox %s: cannot make %s private (0600): %s", self.path, f, e.strerror or e)

    def _open(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            parent = Path(self.path).parent
            try:
                parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                raise OutboxError(f"{self.path}: cannot create directory {parent}: {e.strerror or e}") from None
            self._private_files()
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        except sqlite3.OperationalError as e:
            raise OutboxError(f"{self.path}: cannot open outbox database: {e}") from None
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={'FULL' if self.sync == 'full' else 'NORMAL'}")
            ver = db.execute("PRAGMA user_version").fetchone()[0]
            if ver not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"outbox schema version {ver}, this linkpass reads version {SCHEMA_VERSION}")
            db.execute("BEGIN IMMEDIATE")
            db.execute("CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER NOT NULL, "
                       "critical INTEGER NOT NULL DEFAULT 1, payload BLOB NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
            # the columns we need must be there (a foreign table named 'events' is not ours)
            cols = {r[1] for r in db.execute("PRAGMA table_info(events)")}
            if not {"id", "seq", "critical", "payload"} <= cols:
                raise sqlite3.DatabaseError(f"table 'events' has columns {sorted(cols)}, not an outbox's")
        except sqlite3.OperationalError as e:  # locked, read-only, I/O error: the file may be fine
            db.close()
            raise OutboxError(f"{self.path}: cannot use outbox database: {e}") from None
        except sqlite3.DatabaseError:  # not a database, malformed, not ours: moved aside by the caller
            db.close()
            raise
        return db

    def _meta(self, key: str, default: int) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row and isinstance(row[0], int) else default

    # ---------------------------------------------------------------- write

    def put(self, build: Callable[[int], bytes], critical: bool = True, ts_us: int | None = None) -> int:
        """Append one event; returns its sequence number.

        Args:
            build: called with the new sequence number; returns the payload (UTF-8 JSON bytes).
            critical: False for events the overflow policy may drop first.
            ts_us: the event's wall-clock time in the payload (µs since the epoch); becomes
                :attr:`last_ts_us` when later than it.  The caller keeps ``ts`` non-decreasing
                by never passing less than :attr:`last_ts_us`.

        The row, the new ``next_seq``, ``last_ts_us`` and any overflow drop are one
        transaction: after a crash either all of it is there or none.
        """
        seq = self._next_seq
        payload = build(seq)
        db = self._db
        dropped = 0
        db.execute("BEGIN IMMEDIATE")
        try:
            while self._depth - dropped >= self.max_events:
                row = db.execute("SELECT id FROM events WHERE critical = 0 ORDER BY id LIMIT 1").fetchone() \
                    or db.execute("SELECT id FROM events ORDER BY id LIMIT 1").fetchone()
                if row is None:
                    break
                db.execute("DELETE FROM events WHERE id = ?", row)
                dropped += 1
            db.execute("INSERT INTO events (seq, critical, payload) VALUES (?, ?, ?)", (seq, 1 if critical else 0, payload))
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('next_seq', ?)", (seq + 1,))
            new_ts = ts_us if ts_us is not None and ts_us > self._last_ts_us else None
            if new_ts is not None:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('last_ts_us', ?)", (new_ts,))
            if dropped:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('dropped_total', ?)", (self.dropped_total + dropped,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._next_seq = seq + 1
        self._depth += 1 - dropped
        if new_ts is not None:
            self._last_ts_us = new_ts
        if dropped:
            self.dropped_total += dropped
            self._drops_logged += 1
            log.log(logging.WARNING if self._drops_logged <= _LOUD else logging.DEBUG,
                    "outbox %s full (%d events): dropped %d old event(s) to keep event %d (%d dropped in all)",
                    self.path, self.max_events, dropped, seq, self.dropped_total)
        return seq

    def ack(self, rowids: Iterable[int]) -> int:
        """Remove delivered rows (after the broker acknowledged them); returns how many went."""
        ids = list(rowids)
        if not ids:
            return 0
        n = 0
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for i in range(0, len(ids), 500):  # stay below sqlite's bound-parameter limit
                chunk = ids[i:i + 500]
                cur = self._db.execute(f"DELETE FROM events WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                n += cur.rowcount
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._depth -= n
        return n

    # ---------------------------------------------------------------- read

    def peek(self, limit: int = 100, after: int = 0) -> list[OutboxRow]:
        """The oldest ``limit`` rows with a row id above ``after``, oldest first.

        Unusable rows met on the way are removed, counted in ``malformed`` and logged; they are
        never returned (so one bad row cannot block every later event).
        """
        out: list[OutboxRow] = []
        bad: list[int] = []
        for rowid, seq, critical, payload in self._db.execute(
                "SELECT id, seq, critical, payload FROM events WHERE id > ? ORDER BY id LIMIT ?", (after, limit)):
            doc, why = _parse_row(seq, payload)
            if why:
                bad.append(rowid)
                self.malformed += 1
                log.log(logging.WARNING if self.malformed <= _LOUD else logging.DEBUG,
                        "outbox %s: row %s is unusable (%s); removed", self.path, rowid, why)
                continue
            out.append(OutboxRow(rowid, seq, bool(critical), bytes(payload) if not isinstance(payload, str) else payload.encode(), doc))
        if bad:
            self.ack(bad)
        return out

    def depth(self) -> int:
        """Rows waiting for delivery."""
        return self._depth

    @property
    def next_seq(self) -> int:
        """The sequence number the next :meth:`put` will use."""
        return self._next_seq

    @property
    def last_ts_us(self) -> int:
        """The latest ``ts_us`` given to :meth:`put` (µs since the epoch; 0 before any; persisted)."""
        return self._last_ts_us

    @property
    def last_seq(self) -> int:
        """The last sequence number handed out (0 before the first event, ever)."""
        return self._next_seq - 1

    def close(self) -> None:
        """Checkpoint and close (idempotent)."""
        db, self._db = getattr(self, "_db", None), None
        if db is not None:
            try:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            db.close()
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)  # releases the flock


    def __del__(self) -> None:  # an outbox dropped without close() (tests) gives its lock back
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _parse_row(seq, payload) -> tuple[dict, str | None]:
    """The row's parsed payload and None, or ``({}, why it cannot be sent)``."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        return {}, f"seq {seq!r} is not a positive integer"
    if isinstance(payload, str):
        payload = payload.encode()
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return {}, f"payload is {type(payload).__name__}, not bytes"
    try:
        doc = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return {}, f"payload is not UTF-8 JSON: {e}"
    if not isinstance(doc, dict):
        return {}, f"payload is JSON {type(doc).__name__}, not an object"
    return doc, None
