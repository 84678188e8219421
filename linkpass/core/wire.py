"""The signed-datagram framing shared by peer notices and probes.

Both are ``magic(4) | body... | HMAC-SHA256(key, everything before it)(32)``.  :func:`seal`
appends the MAC; :func:`open_sealed` checks size, magic and MAC (constant time) before any
field is trusted and returns the body, or raises the caller's error class with a ``kind``.
"""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache

MAC_LEN = 32


class WireError(ValueError):
    """A datagram was rejected; ``kind`` says why (``malformed``, ``oversized``, ``auth``, ...)."""

    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind


@lru_cache(maxsize=16)
def _keyed(key: bytes):
    h = hmac.new(key, digestmod=hashlib.sha256)
    # CPython's hmac.HMAC wraps OpenSSL's HMAC object (``_hmac``) when it has one; its copy,
    # update and digest are the same calls without the Python wrapper's per-call overhead
    inner = getattr(h, "_hmac", None)
    return inner if inner is not None and hasattr(inner, "copy") else h


def mac(key: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` (32 bytes).

    A copy of an HMAC object keyed once per key (the inner and outer pads already hashed) is
    cheaper than keying anew per datagram: 1.5 against 2.3 us on this machine, and the prober
    computes two per datagram."""
    h = _keyed(key).copy()
    h.update(body)
    return h.digest()


def seal(body: bytes, key: bytes) -> bytes:
    """``body`` followed by its MAC."""
    return body + mac(key, body)


def open_sealed(data: bytes, key: bytes, *, magic: bytes, min_len: int, max_len: int, what: str,
                error: type[WireError]) -> bytes:
    """Check a sealed datagram and return its body (magic included, MAC stripped).

    Raises:
        error: kind ``oversized`` (over ``max_len``), ``malformed`` (under ``min_len`` or bad
            magic) or ``auth`` (MAC mismatch: wrong key or forged).
    """
    n = len(data)
    if n > max_len:
        raise error("oversized", f"{what} of {n} bytes exceeds {max_len}")
    if n < min_len:
        raise error("malformed", f"{what} of {n} bytes is shorter than the minimum {min_len}")
    if data[:len(magic)] != magic:
        raise error("malformed", "bad magic")
    body, tag = bytes(data[:-MAC_LEN]), data[-MAC_LEN:]
    if not hmac.compare_digest(tag, mac(key, body)):
        raise error("auth", f"HMAC does not match (wrong key or forged {what})")
    return body
