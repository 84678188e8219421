"""Peer notice codec and replay guard."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.core.notice import MAC_LEN, MAX_LEN, MIN_LEN, MAX_NAME, MAX_RAILS, Notice, NoticeError, ReplayGuard, decode, encode

KEY = b"k" * 32
OTHER_KEY = b"x" * 32

SAMPLE = Notice("h1", 1_700_000_000_000_000_000, 42, {0: True, 1: False, 3: True})


def sign(body: bytes, key: bytes = KEY) -> bytes:
    return body + hmac.new(key, body, hashlib.sha256).digest()


def body_of(sender: bytes, seq: int, gen: int, rails: list[tuple[int, int]], n_rails: int | None = None, flags: int = 0, name_len: int | None = None) -> bytes:
    b = b"LPN1" + struct.pack("!BB", flags, len(sender) if name_len is None else name_len) + sender
    b += struct.pack("!QQB", seq, gen, len(rails) if n_rails is None else n_rails)
    for rid, ok in rails:
        b += struct.pack("!HB", rid, ok)
    return b


# ----------------------------------------------------------------------------- layout


def test_sizes():
    assert MAX_LEN == 311
    assert MIN_LEN == 4 + 1 + 1 + 1 + 8 + 8 + 1 + 32


def test_encode_layout_is_the_documented_one():
    data = encode(SAMPLE, KEY)
    assert data == sign(body_of(b"h1", SAMPLE.seq, 42, [(0, 1), (1, 0), (3, 1)]))
    assert len(data) == 4 + 2 + 2 + 17 + 9 + MAC_LEN


def test_round_trip_and_usable():
    n = decode(encode(SAMPLE, KEY), KEY)
    assert n == SAMPLE
    assert n.usable == frozenset({0, 3})


names = st.text(min_size=1, max_size=MAX_NAME).filter(lambda s: 1 <= len(s.encode()) <= MAX_NAME)
rails = st.dictionaries(st.integers(0, 0xFFFF), st.booleans(), max_size=MAX_RAILS)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=150, deadline=None)
@given(names, u64, u64, rails)
def test_round_trip_property(name, seq, gen, rs):
    n = Notice(name, seq, gen, rs)
    data = encode(n, KEY)
    assert MIN_LEN <= len(data) <= MAX_LEN
    assert decode(data, KEY) == n


def test_largest_notice_fits():
    n = Notice("é" * 32, 2**64 - 1, 2**64 - 1, {i: bool(i % 2) for i in range(MAX_RAILS)})
    data = encode(n, KEY)
    assert len(data) == MAX_LEN
    assert decode(data, KEY) == n


@pytest.mark.parametrize(
    "notice",
    [
        Notice("", 1, 1, {}),
        Notice("a" * 65, 1, 1, {}),
        Notice("é" * 33, 1, 1, {}),
        Notice("a", 1, 1, {i: True for i in range(MAX_RAILS + 1)}),
    ],
    ids=["empty-name", "long-name", "long-utf8-name", "too-many-rails"],
)
def test_encode_rejects_bad_notices(notice):
    with pytest.raises(ValueError):
        encode(notice, KEY)


@pytest.mark.parametrize(
    "notice",
    [Notice("a", -1, 1, {}), Notice("a", 2**64, 1, {}), Notice("a", 1, -5, {}), Notice("a", 1, 1, {70000: True})],
    ids=["seq-negative", "seq-too-big", "gen-negative", "rail-id-too-big"],
)
def test_encode_rejects_out_of_range_numbers_with_value_error(notice):
    with pytest.raises(ValueError):
        encode(notice, KEY)


# ----------------------------------------------------------------------------- rejection


def kind_of(data: bytes, key: bytes = KEY) -> str:
    with pytest.raises(NoticeError) as ei:
        decode(data, key)
    assert str(ei.value)
    return ei.value.kind


def test_wrong_key_is_auth():
    assert kind_of(encode(SAMPLE, KEY), OTHER_KEY) == "auth"


def test_flipped_bit_anywhere_after_magic_is_auth():
    data = encode(SAMPLE, KEY)
    for i in range(4, len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        assert kind_of(bytes(bad)) == "auth", i


def test_bad_magic_is_malformed():
    data = encode(SAMPLE, KEY)
    assert kind_of(b"LPN2" + data[4:]) == "malformed"


def test_every_truncation_is_a_notice_error():
    data = encode(Notice("host-with-a-long-name", 7, 8, {i: True for i in range(10)}), KEY)
    for n in range(len(data)):
        k = kind_of(data[:n])
        assert k == ("malformed" if n < MIN_LEN else "auth"), n


def test_oversized():
    data = encode(SAMPLE, KEY)
    assert kind_of(data + b"\0" * (MAX_LEN + 1 - len(data))) == "oversized"
    assert kind_of(b"\0" * 4096) == "oversized"


@pytest.mark.parametrize(
    "body",
    [
        body_of(b"h1", 1, 1, [(0, 1), (1, 1)], n_rails=3),  # claims 3 rails, holds 2
        body_of(b"h1", 1, 1, [(0, 1), (1, 1)], n_rails=1),  # claims 1 rail, holds 2
        body_of(b"h1", 1, 1, [(0, 1)]) + b"\0",  # trailing byte
        body_of(b"h1", 1, 1, [], n_rails=65) + b"\0" * 3 * 65,  # more than 64 rails
        body_of(b"h1", 1, 1, [(0, 2)]),  # usable flag not 0/1
        body_of(b"h1", 1, 1, [(4, 1), (4, 0)]),  # rail listed twice
        body_of(b"h1", 1, 1, [], flags=1),  # unknown flags
        body_of(b"", 1, 1, [(0, 1)], name_len=0),  # empty name
        body_of(b"\xff\xfe", 1, 1, []),  # name not UTF-8
        body_of(b"h" * 65, 1, 1, []),  # name too long
        body_of(b"h1", 1, 1, [], name_len=60),  # name length runs past the end
    ],
    ids=[
        "n_rails-too-many",
        "n_rails-too-few",
        "trailing-byte",
        "over-64-rails",
        "usable-flag-2",
        "duplicate-rail",
        "flags",
        "empty-name",
        "name-not-utf8",
        "name-too-long",
        "name-len-past-end",
    ],
)
def test_validly_signed_but_malformed(body):
    data = sign(body)
    if len(data) > MAX_LEN:
        assert kind_of(data) == "oversized"
    else:
        assert kind_of(data) == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_notice_error(data):
    with pytest.raises(NoticeError) as ei:
        decode(data, KEY)
    assert ei.value.kind in ("malformed", "oversized", "auth")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=MAX_LEN - MAC_LEN - 4))
def test_random_signed_bodies_decode_or_raise_notice_error(tail):
    data = sign(b"LPN1" + tail)
    try:
        n = decode(data, KEY)
    except NoticeError as e:
        assert e.kind in ("malformed", "oversized")
    else:
        assert encode(n, KEY) == data  # anything accepted is canonical


# ----------------------------------------------------------------------------- replay guard


def n(sender: str, seq: int) -> Notice:
    return Notice(sender, seq, 1, {})


def test_replay_guard():
    g = ReplayGuard()
    g.check(n("h1", 10))
    with pytest.raises(NoticeError) as ei:
        g.check(n("h1", 10))
    assert ei.value.kind == "duplicate"
    with pytest.raises(NoticeError) as ei:
        g.check(n("h1", 9))
    assert ei.value.kind == "replay"
    # a rejected notice does not move the mark
    with pytest.raises(NoticeError) as ei:
        g.check(n("h1", 10))
    assert ei.value.kind == "duplicate"
    g.check(n("h1", 11))
    with pytest.raises(NoticeError) as ei:
        g.check(n("h1", 10))
    assert ei.value.kind == "replay"


def test_replay_guard_is_per_sender():
    g = ReplayGuard()
    g.check(n("h1", 100))
    g.check(n("h2", 5))
    g.check(n("h2", 6))
    with pytest.raises(NoticeError):
        g.check(n("h2", 6))
    g.check(n("h1", 101))


def test_replay_guard_accepts_seq_zero_first():
    g = ReplayGuard()
    g.check(n("h1", 0))
    with pytest.raises(NoticeError) as ei:
        g.check(n("h1", 0))
    assert ei.value.kind == "duplicate"
