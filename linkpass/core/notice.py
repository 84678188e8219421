"""Peer notice wire format: authenticated "these are my usable rails" messages.

When a rail fails on host A, A tells its peers over the surviving rails at once, so they stop
sending to A on the failed rail; the same message is repeated periodically as a full-state
refresh.  Layout (network byte order), 311 bytes at most::

    magic      4  b"LPN1"
    flags      1  reserved, 0
    name_len   1  1..64
    sender     name_len bytes, UTF-8 host name
    seq        8  unsigned, strictly increasing per sender (replay protection)
    generation 8  sender's plan generation
    n_rails    1  0..64
    rails      n_rails x (rail id u16, usable u8 0/1)
    mac        32 HMAC-SHA256(key, every byte before it)

The MAC is checked (constant time) before anything else is trusted.  Receivers keep the
highest ``seq`` accepted per sender and drop anything not above it (:class:`ReplayGuard`).
Senders start ``seq`` from the wall clock in ns, so a restarted sender continues above its
old numbers unless its clock moved back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from linkpass.core.wire import MAC_LEN, WireError, open_sealed, seal

MAGIC = b"LPN1"
MAX_NAME = 64
MAX_RAILS = 64
MAX_LEN = 4 + 1 + 1 + MAX_NAME + 8 + 8 + 1 + 3 * MAX_RAILS + MAC_LEN
MIN_LEN = 4 + 1 + 1 + 1 + 8 + 8 + 1 + MAC_LEN


class NoticeError(WireError):
    """A notice was rejected.

    ``kind`` is ``malformed``, ``oversized``, ``auth``, ``replay`` (seq below the last one
    accepted from that sender) or ``duplicate`` (the same seq again: senders send each notice
    over every usable rail, so this is normal).
    """



@dataclass(frozen=True)
class Notice:
    """A decoded notice.  ``rails`` maps rail id -> usable."""

    sender: str
    seq: int
    generation: int
    rails: dict[int, bool]

    @property
    def usable(self) -> frozenset[int]:
        return frozenset(r for r, ok in self.rails.items() if ok)


def encode(notice: Notice, key: bytes) -> bytes:
    """Serialize and sign.

    Raises:
        ValueError: sender name empty or over 64 bytes, more than 64 rails, or ids/seq out of range.
    """
    name = notice.sender.encode()
    if not 1 <= len(name) <= MAX_NAME:
        raise ValueError(f"sender name must be 1..{MAX_NAME} bytes, got {len(name)}")
    if len(notice.rails) > MAX_RAILS:
        raise ValueError(f"at most {MAX_RAILS} rails per notice, got {len(notice.rails)}")
    for what, v in (("seq", notice.seq), ("generation", notice.generation)):
        if not 0 <= v < 2**64:
            raise ValueError(f"{what} {v} does not fit an unsigned 64-bit field")
    bad = [r for r in notice.rails if not 0 <= r <= 0xFFFF]
    if bad:
        raise ValueError(f"rail ids {bad} do not fit 16 bits")
    body = bytearray(MAGIC)
    body += struct.pack("!BB", 0, len(name)) + name
    body += struct.pack("!QQB", notice.seq, notice.generation, len(notice.rails))
    for rid in sorted(notice.rails):
        body += struct.pack("!HB", rid, 1 if notice.rails[rid] else 0)
    return seal(bytes(body), key)


def decode(data: bytes, key: bytes) -> Notice:
    """Verify and parse one datagram.

    Raises:
        NoticeError: ``oversized`` (longer than any valid notice), ``malformed`` (too short,
            bad magic, inconsistent lengths) or ``auth`` (MAC mismatch).
    """
    body = open_sealed(data, key, magic=MAGIC, min_len=MIN_LEN, max_len=MAX_LEN, what="notice", error=NoticeError)
    flags, name_len = body[4], body[5]
    if flags != 0:
        raise NoticeError("malformed", f"unknown flags {flags:#x}")
    if not 1 <= name_len <= MAX_NAME:
        raise NoticeError("malformed", f"sender name length {name_len}")
    off = 6 + name_len
    if len(body) < off + 17:
        raise NoticeError("malformed", "truncated after sender name")
    try:
        sender = body[6:off].decode()
    except UnicodeDecodeError:
        raise NoticeError("malformed", "sender name is not UTF-8") from None
    seq, gen, n_rails = struct.unpack_from("!QQB", body, off)
    off += 17
    if n_rails > MAX_RAILS or len(body) != off + 3 * n_rails:
        raise NoticeError("malformed", f"{n_rails} rails do not fit the {len(body) - off} bytes left")
    rails: dict[int, bool] = {}
    for i in range(n_rails):
        rid, ok = struct.unpack_from("!HB", body, off + 3 * i)
        if ok > 1 or rid in rails:
            raise NoticeError("malformed", f"bad rail entry {i}")
        rails[rid] = bool(ok)
    return Notice(sender, seq, gen, rails)


class ReplayGuard:
    """Accepts a (sender, seq) only if seq is above every seq accepted from that sender."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def check(self, notice: Notice) -> None:
        """Record the notice's seq.

        Raises:
            NoticeError: kind ``duplicate`` when seq equals, ``replay`` when it is below, the
                last seq accepted from that sender.
        """
        last = self._last.get(notice.sender)
        if last is not None and notice.seq == last:
            raise NoticeError("duplicate", f"seq {notice.seq} from {notice.sender} already accepted (same notice over another rail)")
        if last is not None and notice.seq < last:
            raise NoticeError("replay", f"seq {notice.seq} from {notice.sender} is not above {last}")
        self._last[notice.sender] = notice.seq
