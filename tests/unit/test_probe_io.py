"""The C probe datapath (linkpass.adapters._probe_io) against the Python wire code, over real
UDP sockets on loopback: what C accepts it parses exactly as :func:`linkpass.core.probe.decode`
does, everything else comes back raw and byte for byte, and what it sends is what
:func:`linkpass.core.probe.encode` makes."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.adapters import prober as prober_mod
from linkpass.core.probe import MAX_LEN, REPLY, REQUEST, Probe, ProbeError, decode, encode
from tests.wait import wait_until
from test_probe import KEY as PROBER_KEY
from test_probe import prober_for

KEY = PROBER_KEY  # the key prober_for gives the prober
HOST = "h0"


def test_make_install_built_the_c_datapath():
    # `make install` installs gcc, the Python headers and libssl-dev and builds it (setup.py);
    # without it every test below would run nothing of the C code
    assert prober_mod.native_io is not None, "linkpass.adapters._probe_io is not built: run `make install`"


native = prober_mod.native_io


@pytest.fixture
def pair():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    rx.setsockopt(socket.SOL_SOCKET, prober_mod.SO_TIMESTAMPNS, 1)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    tx.setblocking(False)
    yield rx, tx
    rx.close()
    tx.close()


def _read_all(rx, n, key=KEY, host=HOST):
    """Every item of ``n`` datagrams sent to ``rx`` (loopback delivers them before sendto returns)."""
    items, ovfl, err = native.recv_batch(rx.fileno(), key, host.encode(), 1000)
    assert err == 0 and len(items) == n, (err, items)
    return items, ovfl


def _python_view(data: bytes):
    """What the Python decoder makes of ``data`` addressed to HOST: a Probe, or None (rejected)."""
    try:
        p = decode(data, KEY)
    except ProbeError:
        return None
    return p if p.target == HOST else None


GOOD = [
    Probe(REQUEST, "h1", HOST, 0, 1, 2, 3),
    Probe(REPLY, "h1", HOST, 65535, 2**64 - 1, 2**64 - 1, 0),
    Probe(REQUEST, "n" * 64, HOST, 7, 10**18, 5, 2**63),
    Probe(REQUEST, "hôte-ü", HOST, 1, 1, 1, 1),  # UTF-8 names
]


def _bad() -> list[bytes]:
    good = encode(GOOD[0], KEY)
    body = bytearray(good)
    body[-1] ^= 1  # MAC flipped
    return [
        b"", b"LPP2", good[:-1], good[:40], bytes(body),
        encode(GOOD[0], b"another key"),
        b"LPP1" + good[4:],
        encode(Probe(REQUEST, "h1", "h9", 0, 1, 2, 3), KEY),  # another target
        good + b"\0" * (MAX_LEN + 1 - len(good)),
        b"\xff" * 1400,  # longer than the read buffer: truncated, still rejected as oversized
    ]


def test_accepted_probes_parse_as_the_python_decoder_and_the_rest_come_back_raw(pair):
    rx, tx = pair
    dgrams = [encode(p, KEY) for p in GOOD] + _bad()
    for d in dgrams:
        tx.sendto(d, rx.getsockname())
    before = time.time_ns()
    items, ovfl = _read_all(rx, len(dgrams))
    assert ovfl == -1  # SO_RXQ_OVFL not asked for on this socket
    port = tx.getsockname()[1]
    for d, it in zip(dgrams, items):
        want = _python_view(d)
        if want is None:
            kind, raw, addr, rt = it
            assert kind == 0 and raw == d[:512] and addr == ("127.0.0.1", port)
        else:
            kind, sender, rail, seq, ts, ack, addr, rt = it
            assert Probe(kind, sender, HOST, rail, seq, ts, ack) == want and addr == ("127.0.0.1", port)
        assert 0 < rt <= time.time_ns() and rt > before - 10_000_000_000  # the kernel's receive time


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 255), st.sampled_from([0, 4, 5, 6, 70]))
def test_any_bytes_are_parsed_as_python_would_or_handed_back(data, byte, at):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        good = bytearray(encode(Probe(REQUEST, "h1", HOST, 3, 4, 5, 6), KEY))
        if at < len(good):
            good[at] = byte  # one field changed, MAC not: rejected unless the byte was the same
        for d in (data, bytes(good), b"LPP2" + data):
            tx.sendto(d, rx.getsockname())
        items, _ = _read_all(rx, 3)
        for d, it in zip((data, bytes(good), b"LPP2" + data), items):
            want = _python_view(d)
            if want is None:
                assert it[0] == 0 and it[1] == d
            else:
                assert Probe(it[0], it[1], HOST, *it[2:6]) == want
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("p", GOOD + [Probe(REPLY, HOST, "h1", 2, 3, 4, 0)])
def test_sent_probes_are_the_python_encoders_bytes(pair, p):
    rx, tx = pair
    ip, port = rx.getsockname()
    assert native.send_probe(tx.fileno(), ip, port, KEY, p.type, p.sender.encode(), p.target.encode(),
                             p.rail, p.seq, p.ts_ns, p.ack) == 0
    assert rx.recv(1000) == encode(p, KEY)


def test_bad_arguments_are_errors_not_crashes(pair):
    rx, tx = pair
    ip, port = rx.getsockname()
    for args, what in (((3, b"h0", b"h1", 0, 1, 1, 0), "type"), ((1, b"", b"h1", 0, 1, 1, 0), "names"),
                       ((1, b"h0", b"x" * 65, 0, 1, 1, 0), "names"), ((1, b"h0", b"h1", 70000, 1, 1, 0), "rail")):
        with pytest.raises(ValueError, match=what):
            native.send_probe(tx.fileno(), ip, port, KEY, *args)
    with pytest.raises(ValueError, match="IPv4"):
        native.send_probe(tx.fileno(), "not-an-ip", port, KEY, 1, b"h0", b"h1", 0, 1, 1, 0)
    # a closed descriptor is an errno, like OSError from sendto in the Python path
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fd = s.fileno()
    s.close()
    assert native.send_probe(fd, ip, port, KEY, 1, b"h0", b"h1", 0, 1, 1, 0) == errno.EBADF
    items, ovfl, err = native.recv_batch(fd, KEY, b"h0", 10)
    assert items == [] and err == errno.EBADF


def test_an_empty_socket_reads_nothing_and_a_full_batch_reads_on(pair):
    rx, tx = pair
    assert native.recv_batch(rx.fileno(), KEY, b"h0", 64) == ([], -1, 0)
    d = encode(GOOD[0], KEY)
    for _ in range(150):  # more than one recvmmsg batch of 64
        tx.sendto(d, rx.getsockname())
    items, _, _ = native.recv_batch(rx.fileno(), KEY, b"h0", 100)
    assert len(items) == 100  # the limit holds
    items, _, _ = native.recv_batch(rx.fileno(), KEY, b"h0", 100)
    assert len(items) == 50


def test_a_key_change_takes_effect_at_once(pair):
    rx, tx = pair
    other = b"o" * 32
    tx.sendto(encode(GOOD[0], other), rx.getsockname())
    tx.sendto(encode(GOOD[0], KEY), rx.getsockname())
    items, _, _ = native.recv_batch(rx.fileno(), KEY, b"h0", 10)
    assert [it[0] for it in items] == [0, REQUEST]
    tx.sendto(encode(GOOD[0], other), rx.getsockname())
    items, _, _ = native.recv_batch(rx.fileno(), other, b"h0", 10)
    assert [it[0] for it in items] == [REQUEST]


def test_datapath_c_without_the_module_is_a_clear_error(monkeypatch):
    from linkpass.config import parse_config

    base = ('[daemon]\nhost = "h0"\nmode = "per-rail-ip"\n[[rails]]\nid = 0\nnetdev = "rail0"\n'
            'address = "198.18.0.1"\n[probe]\n')
    cfg = parse_config(base + 'datapath = "c"\n')
    monkeypatch.setattr(prober_mod, "native_io", None)
    with pytest.raises(RuntimeError, match="make install"):
        prober_mod.native_datapath(cfg)
    assert prober_mod.native_datapath(parse_config(base + 'datapath = "auto"\n')) is False


# ----------------------------------------------------------------------------- in the prober


def _prober(datapath: str):
    pr, _clock, events = prober_for(datapath=datapath)
    pr.clock = time.monotonic_ns  # the kernel's receive times are on the real clock
    return pr, events


def _mixed_datagrams() -> list[bytes]:
    good = [encode(Probe(REQUEST, "h1", HOST, 9, seq, seq, 0), KEY) for seq in range(100, 110)]
    return good[:5] + [good[2]] + _bad() + good[5:] + [encode(Probe(REPLY, "h1", HOST, 0, 5, 5, 0), KEY)]


def test_both_datapaths_answer_reject_and_count_alike():
    """The same datagrams through each datapath, on a real responder socket: the same counters
    (answered, replays, every rejection kind) and the same replies, byte for byte."""
    results = {}
    for dp in ("c", "python"):
        pr, events = _prober(dp)
        assert pr.native is (dp == "c")
        resp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            resp.bind(("127.0.0.1", 0))
            resp.setblocking(False)
            peer.bind(("127.0.0.1", 0))
            peer.settimeout(5)
            pr._resp = resp
            for d in _mixed_datagrams():
                peer.sendto(d, resp.getsockname())
            assert pr.drain() == len(_mixed_datagrams())
            replies = [peer.recv(1000) for _ in range(pr.counters["answered"])]
            results[dp] = (dict(pr.counters), replies, events)
        finally:
            resp.close()
            peer.close()
    c, py = results["c"], results["python"]
    assert c == py
    counters = c[0]
    assert counters["answered"] == 10 and counters["rejected_replay"] == 1
    assert counters["rejected_auth"] == 3 and counters["rejected_misaddressed"] == 1  # auth: cut by a byte, MAC, key
    assert counters["rejected_oversized"] == 2 and counters["rejected_malformed"] == 4
    assert counters["rejected_unexpected"] == 1  # the reply to a probe never sent
    assert c[1] == [encode(Probe(REQUEST, "h1", HOST, 9, seq, seq, 0).reply(), KEY) for seq in range(100, 110)]


def test_the_c_drain_reads_every_rail_socket_whole_in_arrival_order(monkeypatch):
    pr, _ = _prober("c")
    socks = []
    seen = []
    monkeypatch.setattr(pr, "_on_reply", lambda p, t: seen.append((p.seq, t)))
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for rid in (0, 1):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
            s.setsockopt(socket.SOL_SOCKET, prober_mod.SO_TIMESTAMPNS, 1)
            socks.append(s)
            pr._rail_by_fd[s.fileno()] = s
            pr._rail_poll.register(s.fileno())
        order = [0, 1, 0, 0, 1] * 30  # 150 datagrams: more than one recvmmsg of 64 on each socket
        for seq, which in enumerate(order):
            tx.sendto(encode(Probe(REPLY, "h1", "h0", 0, seq, seq, 0), KEY), socks[which].getsockname())
        assert pr.drain(responder=False) == len(order)
        assert sorted(s for s, _ in seen) == list(range(len(order)))
        times = [t for _, t in seen]
        assert times == sorted(times)  # judged in kernel arrival order across the sockets
        assert [s for s, _ in seen] == list(range(len(order)))  # loopback delivers in send order
    finally:
        tx.close()
        for s in socks:
            s.close()


# ----------------------------------------------------------------------------- the responder thread


@pytest.fixture
def responder():
    """A Responder thread on a loopback socket, and a peer socket to send from."""
    resp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resp.bind(("127.0.0.1", 0))
    resp.setblocking(False)
    resp.setsockopt(socket.SOL_SOCKET, prober_mod.SO_TIMESTAMPNS, 1)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.settimeout(5)
    r = native.Responder(resp.fileno(), KEY, HOST.encode())
    yield r, resp, peer
    r.stop()
    r.stop()  # idempotent
    resp.close()
    peer.close()


def test_the_responder_thread_is_named_for_top_and_ps(responder):
    def names() -> list[str]:
        out = []
        for tid in os.listdir("/proc/self/task"):
            try:
                out.append(open(f"/proc/self/task/{tid}/comm").read().strip())
            except OSError:
                pass
        return out

    wait_until(lambda: "lp-responder" in names(), what="a thread named lp-responder")  # it names itself once it runs


def _take(r, n: int) -> tuple[list, int, int, int]:
    """Take from ``r`` until ``n`` items came (the thread reads on its own time)."""
    got: list = []
    counts = [0, 0, 0]

    def more():
        items, answered, errors, dropped, _ovfl, err = r.take()
        assert err == 0
        got.extend(items)
        for i, v in enumerate((answered, errors, dropped)):
            counts[i] += v
        return len(got) >= n

    wait_until(more, 10, f"{n} items from the responder thread")
    return got, *counts


def test_the_responder_thread_answers_as_the_python_encoder_would_and_queues_the_proof(responder):
    r, resp, peer = responder
    reqs = [Probe(REQUEST, "h1", HOST, 3, 10 + i, 1000 + i, 7) for i in range(5)] + [Probe(REQUEST, "hôte-ü", HOST, 0, 1, 1, 0)]
    for p in reqs:
        peer.sendto(encode(p, KEY), resp.getsockname())
    items, answered, errors, dropped = _take(r, len(reqs))
    assert (answered, errors, dropped) == (len(reqs), 0, 0)
    port = peer.getsockname()[1]
    for p, it in zip(reqs, items):
        kind, sender, rail, seq, ts, ack, addr, rt = it
        assert kind == prober_mod._ANSWERED_ITEM and Probe(REQUEST, sender, HOST, rail, seq, ts, ack) == p
        assert addr == ("127.0.0.1", port) and rt > 0
    # no rail socket named: the replies leave from the responder socket
    assert [peer.recvfrom(1000) for _ in reqs] == [(encode(p.reply(), KEY), resp.getsockname()) for p in reqs]


def test_the_responder_thread_replies_out_of_the_rail_socket_set_for_the_rail(responder):
    r, resp, peer = responder
    rail = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rail.bind(("127.0.0.1", 0))
        r.set_rail(4, rail.fileno())
        peer.sendto(encode(Probe(REQUEST, "h1", HOST, 4, 1, 1, 0), KEY), resp.getsockname())
        peer.sendto(encode(Probe(REQUEST, "h1", HOST, 5, 2, 2, 0), KEY), resp.getsockname())
        _take(r, 2)
        assert peer.recvfrom(1000)[1] == rail.getsockname()  # rail 4: its socket
        assert peer.recvfrom(1000)[1] == resp.getsockname()  # rail 5: none set
        r.set_rail(4, -1)
        peer.sendto(encode(Probe(REQUEST, "h1", HOST, 4, 3, 3, 0), KEY), resp.getsockname())
        _take(r, 1)
        assert peer.recvfrom(1000)[1] == resp.getsockname()  # forgotten
    finally:
        rail.close()
    with pytest.raises(ValueError, match="rail"):
        r.set_rail(70000, 3)


def test_the_responder_thread_hands_back_what_it_does_not_accept_byte_for_byte(responder):
    r, resp, peer = responder
    bad = _bad() + [encode(Probe(REQUEST, "h1", HOST, 0, 1, 1, 0), KEY).replace(b"h1", b"\xff\xfe", 1)]
    reply = encode(Probe(REPLY, "h1", HOST, 0, 5, 5, 0), KEY)
    for d in bad + [reply]:
        peer.sendto(d, resp.getsockname())
    items, answered, _errors, _dropped = _take(r, len(bad) + 1)
    assert answered == 0
    for d, it in zip(bad, items):
        assert it[0] == 0 and it[1] == d[:512], it
    assert items[-1][:6] == (REPLY, "h1", 0, 5, 5, 0)  # a reply: Python judges it


def test_the_responder_thread_guard_refuses_replays_as_the_python_guard_does(responder):
    """The C replay window against linkpass.core.probe.RequestGuard on the same requests:
    repeats, reordering inside the window, jumps past it, seqs below it, three senders."""
    import random

    from linkpass.core.probe import RequestGuard

    r, resp, peer = responder
    rnd = random.Random(17)
    guard = RequestGuard()
    hi = {"a": 10_000, "b": 50_000, "c": 3}
    reqs = []
    for _ in range(3000):
        name = rnd.choice("abc")
        step = rnd.choice([1, 1, 1, 2, 64, 65, 1023, 1024, 1025, 3000, 0, -1, -5, -63, -64, -65, -1023, -1024, -1025, -4000])
        seq = max(1, hi[name] + step)  # above the newest moves it; at or below probes the window
        hi[name] = max(hi[name], seq)
        reqs.append(Probe(REQUEST, name, HOST, 0, seq, 0, 0))
    want = []
    for p in reqs:
        try:
            guard.check(p)
            want.append(True)
        except ProbeError:
            want.append(False)
    got = []
    for i in range(0, len(reqs), 100):  # a burst at a time: the socket buffer holds it
        for p in reqs[i:i + 100]:
            peer.sendto(encode(p, KEY), resp.getsockname())
        items, _answered, _errors, dropped = _take(r, len(reqs[i:i + 100]))
        assert dropped == 0
        got += [it[0] == prober_mod._ANSWERED_ITEM for it in items]
        for p, it in zip(reqs[i:i + 100], items):
            if it[0] == prober_mod._REPLAY_ITEM:
                assert it[1:4] == (p.sender, p.rail, p.seq) and it[4] >= p.seq
    assert 200 < sum(not w for w in want) < 2800  # both verdicts well exercised
    assert got == want


def test_the_responder_thread_forgets_the_oldest_sender_beyond_its_bound(responder):
    r, resp, peer = responder
    for i in range(4097):  # one more name than it remembers
        peer.sendto(encode(Probe(REQUEST, f"s{i}", HOST, 0, 5, 0, 0), KEY), resp.getsockname())
        if i % 200 == 199:
            _take(r, 200)
    _take(r, 4097 % 200)
    # s0 forgotten: its old seq is answered again (and s1, the oldest then, forgotten); s4096 refused
    for name in ("s0", "s4096", "s1"):
        peer.sendto(encode(Probe(REQUEST, name, HOST, 0, 5, 0, 0), KEY), resp.getsockname())
    items, answered, _, _ = _take(r, 3)
    assert [it[0] for it in items] == [prober_mod._ANSWERED_ITEM, prober_mod._REPLAY_ITEM, prober_mod._ANSWERED_ITEM]
    from linkpass.core.probe import RequestGuard

    guard = RequestGuard()  # the Python guard does the same
    for i in range(4097):
        guard.check(Probe(REQUEST, f"s{i}", HOST, 0, 5, 0, 0))
    guard.check(Probe(REQUEST, "s0", HOST, 0, 5, 0, 0))
    with pytest.raises(ProbeError):
        guard.check(Probe(REQUEST, "s4096", HOST, 0, 5, 0, 0))
    guard.check(Probe(REQUEST, "s1", HOST, 0, 5, 0, 0))


def test_a_full_responder_queue_still_answers_and_counts_what_it_dropped():
    resp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    resp.bind(("127.0.0.1", 0))
    resp.setblocking(False)
    peer.bind(("127.0.0.1", 0))
    peer.settimeout(5)
    r = native.Responder(resp.fileno(), KEY, HOST.encode(), max_queue=4)
    try:
        for i in range(10):
            peer.sendto(encode(Probe(REQUEST, "h1", HOST, 0, i + 1, 0, 0), KEY), resp.getsockname())
        replies = [peer.recv(1000) for _ in range(10)]  # every request answered
        assert len(replies) == 10
        items, answered, _errors, dropped = [], 0, 0, 0
        while answered < 10:  # the counts of one burst may straddle two takes
            its, a, _e, d, _o, _err = r.take()
            items += its
            answered += a
            dropped += d
        assert len(items) + dropped == 10 and len(items) <= 4
    finally:
        r.stop()
        resp.close()
        peer.close()
    with pytest.raises(ValueError):
        native.Responder(resp.fileno(), KEY, b"", 10)  # no host name


def test_a_responder_key_change_takes_effect_at_once(responder):
    r, resp, peer = responder
    other = b"o" * 32
    r.configure(other, b"h9")
    peer.sendto(encode(Probe(REQUEST, "h1", HOST, 0, 1, 1, 0), KEY), resp.getsockname())
    peer.sendto(encode(Probe(REQUEST, "h1", "h9", 0, 2, 2, 0), other), resp.getsockname())
    items, answered, _, _ = _take(r, 2)
    assert [it[0] for it in items] == [0, prober_mod._ANSWERED_ITEM] and answered == 1
    assert decode(peer.recv(1000), other) == Probe(REPLY, "h9", "h1", 0, 2, 2, 0)


def test_the_threaded_responder_answers_rejects_and_counts_as_the_python_datapath():
    """test_both_datapaths_answer_reject_and_count_alike with the C responder thread."""
    results = {}
    for dp in ("c", "python"):
        pr, events = _prober(dp)
        resp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            resp.bind(("127.0.0.1", 0))
            resp.setblocking(False)
            peer.bind(("127.0.0.1", 0))
            peer.settimeout(5)
            pr._resp = resp
            if dp == "c":
                pr._responder = native.Responder(resp.fileno(), KEY, HOST.encode())
            n = len(_mixed_datagrams())
            for d in _mixed_datagrams():
                peer.sendto(d, resp.getsockname())
            handled = [0]
            wait_until(lambda: (handled.__setitem__(0, handled[0] + pr.drain()), handled[0] >= n)[1], 10, "every datagram")
            assert handled[0] == n
            replies = [peer.recv(1000) for _ in range(pr.counters["answered"])]
            results[dp] = (dict(pr.counters), replies, events)
        finally:
            if pr._responder is not None:
                pr._responder.stop()
            resp.close()
            peer.close()
    assert results["c"] == results["python"]
    assert results["c"][0]["answered"] == 10 and results["c"][0]["rejected_replay"] == 1


def test_a_responder_that_never_started_is_an_error_not_a_crash_and_closes_nothing():
    import os

    r = native.Responder.__new__(native.Responder)
    for call in (r.take, lambda: r.set_rail(1, 2), lambda: r.configure(KEY, b"h0")):
        with pytest.raises(RuntimeError, match="not started"):
            call()
    r.stop()
    del r
    with pytest.raises(TypeError):
        native.Responder()  # a failed __init__: dealloc must not close descriptor 0
    with pytest.raises(ValueError):
        native.Responder(0, KEY, b"")
    os.fstat(0)


def test_a_reply_that_cannot_leave_is_counted_and_the_request_still_proves_the_path(responder):
    """As the Python datapath: _answer counts the error, then _proof takes the request."""
    import os

    r, resp, peer = responder
    rd, wr = os.pipe()  # not a socket: sendto fails (ENOTSOCK)
    try:
        r.set_rail(7, wr)
        peer.sendto(encode(Probe(REQUEST, "h1", HOST, 7, 1, 1, 5), KEY), resp.getsockname())
        items, answered, errors, _dropped = _take(r, 1)
        r.set_rail(7, -1)
    finally:
        os.close(rd)
        os.close(wr)
    assert (answered, errors) == (0, 1)
    assert items[0][:6] == (prober_mod._ANSWERED_ITEM, "h1", 7, 1, 1, 5)


def test_the_daemon_refuses_datapath_c_without_the_module_in_one_line(tmp_path, monkeypatch):
    from linkpass.config import load_config
    from linkpass.daemon import Daemon, StartError

    key = tmp_path / "notice.key"
    key.write_text("0123456789abcdef0123456789abcdef\n")
    key.chmod(0o600)
    cfg = tmp_path / "lp.toml"
    cfg.write_text(f'[daemon]\nhost = "h0"\nhost_ip = "198.19.0.1"\ncontrol_socket = "{tmp_path}/c.sock"\n'
                   f'notice_key_file = "{key}"\n[[rails]]\nid = 0\nnetdev = "rail0"\n[probe]\ndatapath = "c"\n'
                   '[nccl]\nwrite_env_file = false\n')
    monkeypatch.setattr(prober_mod, "native_io", None)
    with pytest.raises(StartError) as ei:
        Daemon(str(cfg), load_config(cfg))
    msg = str(ei.value)
    assert msg.startswith(f'{cfg}: probe.datapath: "c", but linkpass.adapters._probe_io was not built') and "\n" not in msg
