"""Probe codec, reply guard, schedule and path statistics (linkpass.core.probe), plus the
Prober adapter's datagram handling driven without sockets."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from linkpass.config import probe_policy
from linkpass.core.probe import (
    MAC_LEN,
    MAX_LEN,
    MAX_NAME,
    MIN_LEN,
    REPLY,
    REQUEST,
    PathStats,
    Pending,
    Probe,
    ProbeError,
    ReplyGuard,
    Schedule,
    decode,
    encode,
)

KEY = b"k" * 32
OTHER_KEY = b"x" * 32
MS = 1_000_000

REQ = Probe(REQUEST, "h0", "h1", 3, 1_700_000_000_000_000_123, 987_654_321)


def sign(body: bytes, key: bytes = KEY) -> bytes:
    return body + hmac.new(key, body, hashlib.sha256).digest()


def body_of(ptype: int, sender: bytes, target: bytes, rail: int, seq: int, ts: int, slen: int | None = None,
            tlen: int | None = None, ack: int = 0) -> bytes:
    return (b"LPP2" + bytes((ptype, len(sender) if slen is None else slen)) + sender
            + bytes((len(target) if tlen is None else tlen,)) + target + struct.pack("!HQQQ", rail, seq, ts, ack))


# ----------------------------------------------------------------------------- codec


def test_sizes():
    assert MIN_LEN == 4 + 1 + 1 + 1 + 1 + 1 + 2 + 8 + 8 + 8 + 32 == 67
    assert MAX_LEN == 4 + 1 + 1 + 64 + 1 + 64 + 2 + 8 + 8 + 8 + 32 == 193


def test_encode_layout_is_the_documented_one():
    data = encode(REQ, KEY)
    assert data == sign(body_of(1, b"h0", b"h1", 3, REQ.seq, REQ.ts_ns))
    assert len(data) == MIN_LEN + 2
    acked = Probe(REQUEST, "h0", "h1", 3, REQ.seq, REQ.ts_ns, ack=2**64 - 1)
    assert encode(acked, KEY) == sign(body_of(1, b"h0", b"h1", 3, REQ.seq, REQ.ts_ns, ack=2**64 - 1))
    assert decode(encode(acked, KEY), KEY) == acked and acked.reply().ack == 0
    with pytest.raises(ProbeError) as e:  # the previous layout (no ack) is refused
        decode(sign(b"LPP1" + body_of(1, b"h0", b"h1", 3, 1, 1)[4:-8]), KEY)
    assert e.value.kind == "malformed"


def test_round_trip_request_and_reply():
    assert decode(encode(REQ, KEY), KEY) == REQ
    rep = REQ.reply()
    assert rep == Probe(REPLY, "h1", "h0", 3, REQ.seq, REQ.ts_ns)
    assert decode(encode(rep, KEY), KEY) == rep


names = st.text(min_size=1, max_size=MAX_NAME).filter(lambda s: 1 <= len(s.encode()) <= MAX_NAME)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([REQUEST, REPLY]), names, names, st.integers(0, 0xFFFF), u64, u64)
def test_round_trip_property(ptype, sender, target, rail, seq, ts):
    p = Probe(ptype, sender, target, rail, seq, ts)
    data = encode(p, KEY)
    assert MIN_LEN <= len(data) <= MAX_LEN
    assert decode(data, KEY) == p


def test_largest_probe_fits():
    p = Probe(REPLY, "é" * 32, "x" * 64, 0xFFFF, 2**64 - 1, 2**64 - 1)
    data = encode(p, KEY)
    assert len(data) == MAX_LEN
    assert decode(data, KEY) == p


@pytest.mark.parametrize(
    "p",
    [
        Probe(3, "a", "b", 0, 1, 1),
        Probe(0, "a", "b", 0, 1, 1),
        Probe(REQUEST, "", "b", 0, 1, 1),
        Probe(REQUEST, "a", "", 0, 1, 1),
        Probe(REQUEST, "a" * 65, "b", 0, 1, 1),
        Probe(REQUEST, "a", "é" * 33, 0, 1, 1),
        Probe(REQUEST, "a", "b", 0x10000, 1, 1),
        Probe(REQUEST, "a", "b", -1, 1, 1),
        Probe(REQUEST, "a", "b", 0, 2**64, 1),
        Probe(REQUEST, "a", "b", 0, 1, -1),
    ],
)
def test_encode_refuses_what_does_not_fit(p):
    with pytest.raises(ValueError):
        encode(p, KEY)


def test_wrong_key_is_auth():
    with pytest.raises(ProbeError) as e:
        decode(encode(REQ, KEY), OTHER_KEY)
    assert e.value.kind == "auth"


def test_reflected_request_is_not_a_reply():
    """The MAC covers the type: flipping a request into a reply breaks it."""
    data = bytearray(encode(REQ, KEY))
    data[4] = REPLY
    with pytest.raises(ProbeError) as e:
        decode(bytes(data), KEY)
    assert e.value.kind == "auth"


@pytest.mark.parametrize("i", range(MIN_LEN + 2))
def test_every_bit_flip_is_rejected(i):
    data = bytearray(encode(REQ, KEY))
    data[i] ^= 0x01
    with pytest.raises(ProbeError) as e:
        decode(bytes(data), KEY)
    assert e.value.kind in ("auth", "malformed")


def test_every_truncation_is_rejected():
    data = encode(Probe(REPLY, "host-with-a-long-name", "h1", 7, 12345, 67890), KEY)
    for n in range(len(data)):
        with pytest.raises(ProbeError) as e:
            decode(data[:n], KEY)
        assert e.value.kind in ("malformed", "auth"), n


def test_oversized():
    with pytest.raises(ProbeError) as e:
        decode(encode(REQ, KEY) + b"\0" * (MAX_LEN + 1), KEY)
    assert e.value.kind == "oversized"
    with pytest.raises(ProbeError) as e:
        decode(b"LPP2" + b"\0" * (MAX_LEN - 3), KEY)
    assert e.value.kind == "oversized"


def test_bad_magic():
    data = encode(REQ, KEY)
    with pytest.raises(ProbeError) as e:
        decode(b"LPN1" + data[4:], KEY)
    assert e.value.kind == "malformed"


@pytest.mark.parametrize(
    "body, why",
    [
        (body_of(3, b"a", b"b", 0, 1, 1), "unknown type"),
        (body_of(0, b"a", b"b", 0, 1, 1), "type 0"),
        (body_of(1, b"a", b"b", 0, 1, 1, slen=0), "sender length 0"),
        (body_of(1, b"a", b"b", 0, 1, 1, slen=65), "sender length 65"),
        (body_of(1, b"a", b"b", 0, 1, 1, tlen=0), "target length 0"),
        (body_of(1, b"a", b"b", 0, 1, 1, tlen=2), "target length too long"),
        (body_of(1, b"ab", b"b", 0, 1, 1, slen=1), "sender length too short"),
        (body_of(1, b"a", b"b", 0, 1, 1) + b"\0", "trailing byte"),
        (body_of(1, b"\xff", b"b", 0, 1, 1), "sender not UTF-8"),
        (body_of(1, b"a", b"\xc3", 0, 1, 1), "target not UTF-8"),
        (b"LPP2\x01" + b"\x40" + b"a" * 64 + b"\0" * 26, "sender fills the body, no target length"),
    ],
)
def test_signed_but_malformed(body, why):
    with pytest.raises(ProbeError) as e:
        decode(sign(body), KEY)
    assert e.value.kind == "malformed", why


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=MAX_LEN + 40))
def test_random_bytes_raise_only_probe_error(data):
    try:
        decode(data, KEY)
    except ProbeError as e:
        assert e.kind in ("malformed", "oversized", "auth")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=MAX_LEN - MAC_LEN))
def test_random_signed_bodies_raise_only_probe_error(tail):
    """Past the MAC check: whatever an authenticated sender puts there is parsed or refused cleanly."""
    try:
        p = decode(sign(b"LPP2" + tail), KEY)
    except ProbeError as e:
        assert e.kind in ("malformed", "oversized")
    else:
        assert encode(p, KEY) == sign(b"LPP2" + tail)


# ----------------------------------------------------------------------------- reply guard


def sent(g: ReplyGuard, seq: int, rail: int = 0, peer: str = "h1", at: int = 100 * MS, timeout: int = 10 * MS) -> Probe:
    g.add(Pending(rail, peer, seq, at, at + timeout))
    return Probe(REPLY, peer, "h0", rail, seq, at)


def kind_of(g: ReplyGuard, reply: Probe, now: int) -> str:
    with pytest.raises(ProbeError) as e:
        g.check(reply, now)
    return e.value.kind


def test_reply_in_time_is_accepted_once():
    g = ReplyGuard()
    r = sent(g, 5)
    p = g.check(r, 101 * MS)
    assert (p.rail, p.peer, p.seq, p.sent_ns) == (0, "h1", 5, 100 * MS)
    assert len(g) == 0
    assert kind_of(g, r, 102 * MS) == "replay"


def test_unknown_seq_is_unexpected():
    g = ReplyGuard()
    assert kind_of(g, Probe(REPLY, "h1", "h0", 0, 5, 0), 0) == "unexpected"  # nothing sent at all
    sent(g, 10)
    sent(g, 11)
    assert kind_of(g, Probe(REPLY, "h1", "h0", 0, 12, 100 * MS), 101 * MS) == "unexpected"  # never sent (above)
    assert kind_of(g, Probe(REPLY, "h1", "h0", 0, 9, 100 * MS), 101 * MS) == "unexpected"  # never sent (below)


@pytest.mark.parametrize("field, value", [("sender", "h2"), ("rail", 1), ("ts_ns", 99 * MS)])
def test_reply_not_matching_its_probe_is_unexpected_and_the_probe_stays(field, value):
    g = ReplyGuard()
    r = sent(g, 5)
    bad = r._replace(**{field: value})
    assert kind_of(g, bad, 101 * MS) == "unexpected"
    assert g.check(r, 101 * MS).seq == 5  # the real reply still counts


def test_request_is_misaddressed_for_the_guard():
    g = ReplyGuard()
    r = sent(g, 5)
    assert kind_of(g, Probe(REQUEST, r.sender, r.target, r.rail, r.seq, r.ts_ns), 101 * MS) == "misaddressed"


def test_deadline_late_and_expire():
    g = ReplyGuard()
    r = sent(g, 5, at=100 * MS, timeout=10 * MS)
    assert g.next_deadline_ns() == 110 * MS
    assert g.expire(109 * MS) == []
    # at the deadline the reply is late even before expire() ran; expire then reports it lost
    assert kind_of(g, r, 110 * MS) == "late"
    [p] = g.expire(110 * MS)
    assert p.seq == 5 and g.next_deadline_ns() is None
    assert kind_of(g, r, 111 * MS) == "late"  # still late, never accepted later


def test_expire_in_deadline_order_and_skips_answered():
    g = ReplyGuard()
    sent(g, 1, at=0, timeout=30)
    r2 = sent(g, 2, at=0, timeout=10)
    sent(g, 3, at=0, timeout=20)
    g.check(r2, 5)
    assert [p.seq for p in g.expire(100)] == [3, 1]


def test_forgotten_seq_is_replay_and_seq_reuse_refused():
    g = ReplyGuard(memory=4)
    rs = [sent(g, s, at=0, timeout=10) for s in range(1, 11)]
    for r in rs:
        g.check(r, 1)
    assert kind_of(g, rs[0], 2) == "replay"  # forgotten but within the sent range
    with pytest.raises(ValueError):
        sent(g, 10)


def test_forget_drops_paths_silently():
    g = ReplyGuard()
    sent(g, 1, rail=0)
    sent(g, 2, rail=1)
    assert g.forget({(0, "h1")}) == 1
    assert [p.seq for p in g.expire(10**12)] == [1]


# ----------------------------------------------------------------------------- schedule


def sched(peers=("a", "b", "c", "d", "e", "f"), rails=(0, 1), fast=2, interval=10 * MS, slow=100 * MS, pps=10_000, **kw) -> Schedule:
    return Schedule(interval_ns=interval, slow_interval_ns=slow, fast_peers=fast, max_pps=pps,
                    paths={r: list(peers) for r in rails}, now_ns=0, **kw)


def run(s: Schedule, until_ns: int) -> list[tuple[int, int, str, bool]]:
    out = []
    t = 0
    while t <= until_ns:
        out += [(t, x.rail, x.peer, x.fast) for x in s.poll(t)]
        t = s.next_tick_ns
    return out


def test_fast_set_is_first_peers_in_config_order_and_priority_first():
    s = sched()
    assert s.fast == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    s.set_priority(["e", "zz"], 0)
    assert s.fast == [(0, "e"), (0, "a"), (1, "e"), (1, "a")]
    assert (0, "b") in s.slow and (0, "e") not in s.slow
    assert s.is_fast(1, "e") and not s.is_fast(1, "b")


def test_peer_without_an_address_on_a_rail_is_not_probed_there():
    s = Schedule(interval_ns=10 * MS, slow_interval_ns=100 * MS, fast_peers=1, max_pps=1000,
                 paths={0: ["a", "b"], 1: ["b"]}, now_ns=0)
    assert s.fast == [(0, "a"), (1, "b")] and s.slow == [(0, "b")]


def test_fast_every_interval_slow_once_per_slow_interval():
    s = sched()
    sends = run(s, 1000 * MS - 1)  # 100 ticks
    fast = [x for x in sends if x[3]]
    slow = [x for x in sends if not x[3]]
    for path in s.fast:
        times = [t for t, r, p, _ in fast if (r, p) == path]
        assert len(times) == 100 and all(b - a == 10 * MS for a, b in itertools.pairwise(times))
    for path in s.slow:  # 8 slow paths, each once per 100 ms: 10 each in 1 s
        assert sum(1 for _, r, p, _ in slow if (r, p) == path) == 10
    assert len(slow) == 80


def test_rate_bound_slow_yields_first():
    # 4 fast paths per 10 ms = 400 pps; 8 slow paths per 100 ms = 80 pps; budget 420 pps
    s = sched(pps=420)
    sends = run(s, 2000 * MS - 1)
    fast = [x for x in sends if x[3]]
    slow = [x for x in sends if not x[3]]
    assert len(fast) == 800  # the fast set is untouched
    assert len(sends) <= 420 * 2 + 10  # bucket: the rate plus one tick's burst
    assert 0 < len(slow) < 160


def test_rate_bound_when_fast_set_alone_is_over_budget():
    s = sched(peers=[f"p{i}" for i in range(20)], fast=20, pps=1000)  # wants 4000 pps
    sends = run(s, 1000 * MS - 1)
    assert 900 <= len(sends) <= 1000 + 12
    per_path = {}
    for _, r, p, _ in sends:
        per_path[(r, p)] = per_path.get((r, p), 0) + 1
    assert len(per_path) == 40 and max(per_path.values()) - min(per_path.values()) <= 2  # shared fairly


def test_no_fast_set_ticks_at_the_sweep_rate():
    s = sched(fast=0, slow=120 * MS)
    assert s.tick_ns == 10 * MS  # 12 slow paths in 120 ms
    sends = run(s, 1200 * MS - 1)
    assert len(sends) == 120 and not any(x[3] for x in sends)


def test_stalled_loop_does_not_burst_past_the_bucket():
    s = sched(pps=1000)
    s.poll(0)
    out = s.poll(5000 * MS)  # 5 s later
    assert len(out) <= 1000 * 0.01 + 1
    assert s.next_tick_ns == 5010 * MS


def test_set_paths_keeps_sweep_position_and_prunes():
    s = sched()
    s.set_paths({0: ["a", "b", "c"]}, 0)
    assert s.fast == [(0, "a"), (0, "b")] and s.slow == [(0, "c")]
    s.set_paths({}, 0)
    assert s.paths() == [] and s.poll(10**10) == [] and s.tick_ns == 100 * MS


def test_confirm_train_probes_densely_until_settled_or_its_end():
    s = sched()
    assert s.confirm_step_ns == 2 * MS
    s.poll(0)
    assert not s.confirm(0, "c", 5 * MS, 40 * MS)  # a slow path gets no train
    assert s.confirm(0, "a", 5 * MS, 30 * MS)
    assert s.next_tick_ns == 5 * MS
    t, sends = 5 * MS, []
    while t < 31 * MS:
        sends += [(t, x.rail, x.peer) for x in s.poll(t) if (x.rail, x.peer) == (0, "a")]
        t = s.next_tick_ns
    times = [x[0] // MS for x in sends]
    # confirm probes every 2 ms, the regular ones at 10 and 20 (no doubled probe at a tick)
    assert times == [5, 7, 9, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
    assert s.confirming() == []  # the train ended at 30 ms
    s.confirm(1, "b", 31 * MS, 60 * MS)
    s.poll(31 * MS)
    s.settle(1, "b")
    assert s.confirming() == [] and s.next_tick_ns == 40 * MS


def test_confirm_probes_take_tokens_and_never_burst():
    s = sched(pps=500)  # 4 fast paths x 100/s = 400: 100/s left for trains and the sweep
    s.poll(0)
    for peer in ("a", "b"):
        for r in (0, 1):
            s.confirm(r, peer, 1 * MS, 10_000 * MS)
    t, n = 1 * MS, 0
    while t < 1000 * MS:
        n += len(s.poll(t))
        t = s.next_tick_ns
    assert n <= 500 + 10
    assert s.poll(5000 * MS) and len(s.poll(5000 * MS)) == 0  # no burst after a stall


# ----------------------------------------------------------------------------- stats


def test_path_stats():
    st_ = PathStats(window=4)
    assert st_.loss is None and st_.to_json()["last_rtt_us"] is None
    st_.record(True, 800_000)
    st_.record(True, 1_600_000)
    assert st_.last_rtt_ns == 1_600_000 and st_.ewma_rtt_ns == pytest.approx(900_000)
    st_.record(False)
    st_.record(False)
    st_.record(False)  # window now [ok, lost, lost, lost]
    assert st_.loss == pytest.approx(0.75)
    j = st_.to_json()
    assert j == {"last_rtt_us": 1600.0, "ewma_rtt_us": 900.0, "loss": 0.75, "window": 4, "replies": 2, "lost": 3}


# ----------------------------------------------------------------------------- adapter, no sockets


def prober_for(host: str = "h0", datapath: str = "python"):
    """A prober with a fake clock (python datapath: most tests hand it objects with sendto()
    only, not sockets)."""
    from linkpass.adapters.prober import Prober
    from linkpass.config import parse_config

    cfg = parse_config(f"""
[daemon]
host = "{host}"
mode = "per-rail-ip"
[[rails]]
id = 0
netdev = "rail0"
address = "198.18.0.1"
[[rails]]
id = 1
netdev = "rail1"
address = "198.18.1.1"
[[peers]]
name = "h1"
rail_ips = {{ "0" = "198.18.0.2", "1" = "198.18.1.2" }}
[probe]
fast_peers = 1
datapath = "{datapath}"
""")
    clock = [1_000 * MS]
    events = []
    pr = Prober(cfg, KEY, events.append, clock=lambda: clock[0])
    return pr, clock, events


def test_prober_handles_replies_late_and_garbage_without_sockets():
    from linkpass.core.model import ProbeResult

    pr, clock, events = prober_for()
    sends = pr.schedule.poll(clock[0])
    assert {(s.rail, s.peer) for s in sends} == {(0, "h1"), (1, "h1")}
    for s in sends:
        pr._send(s, clock[0])  # no sockets yet: counted as send errors, still tracked
    assert pr.counters["send_errors"] == 2 and len(pr.guard) == 2
    seq0 = next(p for p in pr.guard._pending.values() if p.rail == 0).seq
    seq1 = next(p for p in pr.guard._pending.values() if p.rail == 1).seq
    clock[0] += 3 * MS
    pr.on_datagram(encode(Probe(REPLY, "h1", "h0", 0, seq0, 1_000 * MS), KEY), ("198.18.0.2", 40000))
    assert events == [ProbeResult(0, "h1", True, 1_003 * MS, 3 * MS, seq0)]
    pr.on_datagram(encode(Probe(REPLY, "h1", "h0", 0, seq0, 1_000 * MS), KEY), ("198.18.0.2", 40000))
    assert pr.counters["rejected_replay"] == 1
    clock[0] += 7 * MS  # the rail-1 probe's deadline
    pr.on_datagram(encode(Probe(REPLY, "h1", "h0", 1, seq1, 1_000 * MS), KEY), ("198.18.1.2", 40000))
    assert pr.counters["late"] == 1 and len(events) == 1  # judged late; the loss is reported by the timer
    pr._expire(clock[0])
    # h1 answered on rail 0 while the rail-1 probe was out: the loss is rail 1's
    assert events[-1] == ProbeResult(1, "h1", False, 1_010 * MS, None, seq1, peer_elsewhere=True)
    assert pr.counters["timeouts"] == 1
    for bad in (b"", b"\xff" * 1000, encode(REQ, OTHER_KEY), encode(Probe(REQUEST, "h1", "h9", 0, 1, 1), KEY)):
        pr.on_datagram(bad, ("198.18.0.2", 1))
    assert pr.counters["rejected_malformed"] == 1 and pr.counters["rejected_oversized"] == 1
    assert pr.counters["rejected_auth"] == 1 and pr.counters["rejected_misaddressed"] == 1
    s = pr.stats()
    assert s["counters"]["replies"] == 1
    p0 = next(p for p in s["paths"] if p["rail"] == 0)
    assert p0 == {"rail": 0, "peer": "h1", "fast": True, "last_rtt_us": 3000.0, "ewma_rtt_us": 3000.0,
                  "loss": 0.0, "window": 1, "replies": 1, "lost": 0}
    import json

    json.dumps(s)


def test_prober_request_without_sockets_is_an_answer_error_not_a_crash():
    pr, _, _ = prober_for()
    pr.on_datagram(encode(Probe(REQUEST, "h1", "h0", 0, 7, 7), KEY), ("198.18.0.2", 40000))
    assert pr.counters["answer_errors"] == 1 and not any(k.startswith("rejected") for k in pr.counters)


def test_prober_reconfigure_and_priority_peers():
    from linkpass.config import Config

    pr, clock, events = prober_for()
    for s in pr.schedule.poll(clock[0]):
        pr._send(s, clock[0])
    assert len(pr.guard) == 2
    data = pr.cfg.model_dump(mode="json")
    data["peers"][0]["rail_ips"] = {"1": "198.18.1.2"}
    data["peers"].append({"name": "h2", "rail_ips": {"0": "198.18.0.3", "1": "198.18.1.3"}})
    data["probe"]["interval_ms"] = 20
    pr.reconfigure(Config.model_validate(data), KEY)
    # ring order from h0: h2 before h1 (fast_peers = 1)
    assert pr.schedule.fast == [(0, "h2"), (1, "h2")] and pr.schedule.slow == [(1, "h1")]
    assert len(pr.guard) == 1  # the probe to h1 on rail 0 is dropped, not reported lost
    assert set(pr.path_stats) == {(0, "h2"), (1, "h1"), (1, "h2")}
    assert pr.schedule.tick_ns == 20 * MS
    pr.set_priority_peers(["h1"])
    assert pr.schedule.fast == [(0, "h2"), (1, "h1")] and pr.stats()["priority_peers"] == ["h1"]
    clock[0] += 20 * MS
    pr._expire(clock[0])
    assert [(e.rail, e.peer, e.ok) for e in events] == [(1, "h1", False)]


def test_prober_silent_path_gets_confirm_probes_and_is_lost_at_bfd_detection_time():
    """A path that answered at t0 and then goes silent: a confirm train starts at the first
    miss, and at exactly t0 + 3 x 10 ms every outstanding probe is reported lost (the engine's
    DOWN rule then holds); a reply ends the train."""
    from linkpass.core.probe_filter import ProbeFilter
    from linkpass.core.paths import PathHealth

    pr, clock, events = prober_for()
    pr.schedule.set_paths({0: ["h1"]}, clock[0])  # one fast path, rail 0
    t0 = clock[0]

    def step_to(t):  # what the prober's timer does, with a fake clock
        while True:
            wake = min(x for x in (pr.schedule.next_tick_ns, pr.guard.next_deadline_ns(), pr._next_silence_ns()) if x is not None)
            if wake > t:
                break
            clock[0] = wake
            pr._expire(wake)
            for s in pr.schedule.poll(wake):
                pr._send(s, wake)
        clock[0] = t

    step_to(t0)
    seq = max(pr.guard._pending)
    clock[0] = t0 + MS // 10
    pr.on_datagram(encode(Probe(REPLY, "h1", "h0", 0, seq, t0), KEY), ("198.18.0.2", 40000))
    t_ok = clock[0]
    step_to(t_ok + 40 * MS)  # silence from here on
    misses = [e for e in events if not e.ok]
    assert pr.counters["confirm_trains"] >= 1
    assert len(misses) >= 3 and pr.counters["sent"] + pr.counters["send_errors"] >= 8  # 4 regular + confirm probes
    # the path health that the engine keeps, fed through the filter as in the daemon
    fwd = []
    filt = ProbeFilter(probe_policy(pr.cfg.probe), fwd.append)
    for e in events:
        filt(e)
    ph = PathHealth(0, "h1", 3, 10 * MS)
    down_at = None
    for e in fwd:
        if getattr(e, "ok", None) is None:
            continue
        t = ph.on_result(e.ok, e.t_ns, e.rtt_ns, e.since_ok_ns)
        if t and t[1].value == "DOWN":
            down_at = e.t_ns
    assert down_at == t_ok + 30 * MS  # BFD: detection time after the last reply, not a tick later
    # a reply to a later probe ends the train
    pr.schedule.confirm(0, "h1", clock[0], clock[0] + 50 * MS)
    step_to(clock[0] + 1 * MS)
    seq = max(pr.guard._pending)
    p = pr.guard._pending[seq]
    pr.on_datagram(encode(Probe(REPLY, "h1", "h0", 0, seq, p.sent_ns), KEY), ("198.18.0.2", 40000))
    assert pr.schedule.confirming() == []


def test_guard_expire_path_takes_only_that_path():
    g = ReplyGuard()
    g.add(Pending(0, "a", 1, 0, 10))
    g.add(Pending(0, "b", 2, 0, 10))
    g.add(Pending(0, "a", 3, 1, 11))
    assert [p.seq for p in g.expire_path(0, "a")] == [1, 3]
    assert len(g) == 1 and g.next_deadline_ns() == 10
    with pytest.raises(ProbeError) as e:
        g.check(Probe(REPLY, "a", "me", 0, 1, 0), 5)
    assert e.value.kind == "late"


def test_ring_order_fast_sets_are_symmetric_and_balanced():
    from linkpass.adapters.prober import ring_order

    for n in (2, 3, 5, 16, 101):
        hosts = [f"node-{i:04d}" for i in range(n)]
        fast = {h: set(ring_order(h, [x for x in hosts if x != h])[:2]) for h in hosts}
        for a in hosts:
            assert len(ring_order(a, hosts)) == n - 1 and a not in fast[a]
            for b in fast[a]:
                assert a in fast[b]  # symmetric: one of the two can stay passive
        targets = [b for a in hosts for b in fast[a]]
        assert all(targets.count(h) == min(2, n - 1) for h in hosts)  # nobody is a hot spot


class _Wire:
    """Two probers joined back to back (no sockets): datagrams are delivered at once unless
    the wire is cut."""

    def __init__(self):
        self.cut = False
        self.queue = []

    def sock(self, src):
        wire_ = self

        class S:
            def sendto(self, data, addr):
                wire_.queue.append((src, data))

        return S()


def _pair(interval_ms=10):
    from linkpass.adapters.prober import Prober
    from linkpass.config import parse_config

    clock = [1_000 * MS]
    w = _Wire()
    probers, events = {}, {}
    for me, other, mine, theirs in (("h0", "h1", 1, 2), ("h1", "h0", 2, 1)):
        cfg = parse_config(f"""
[daemon]
host = "{me}"
mode = "per-rail-ip"
[[rails]]
id = 0
netdev = "rail0"
address = "198.18.0.{mine}"
[[peers]]
name = "{other}"
rail_ips = {{ "0" = "198.18.0.{theirs}" }}
[probe]
interval_ms = {interval_ms}
datapath = "python"  # the wire is objects with sendto(), not sockets
""")
        events[me] = []
        pr = Prober(cfg, KEY, events[me].append, clock=lambda: clock[0])
        pr._rail_socks = {0: w.sock(me)}
        pr._resp = w.sock(me)
        probers[me] = pr
    return probers, events, clock, w


def _run(probers, clock, w, until):
    while clock[0] < until:
        wakes = []
        for pr in probers.values():
            for x in (pr.schedule.next_tick_ns, pr.guard.next_deadline_ns(), pr._next_silence_ns(),
                      min(pr._expect.values()) if pr._expect else None):
                if x is not None:
                    wakes.append(x)
        clock[0] = max(clock[0], min(min(wakes), until))
        for pr in probers.values():
            pr._expire(clock[0])
            for s in pr.schedule.poll(clock[0]):
                pr._send(s, clock[0])
        clock[0] += 20_000  # 20 us on the wire
        while w.queue:
            src, data = w.queue.pop(0)
            if not w.cut:
                probers["h1" if src == "h0" else "h0"].on_datagram(data, ("198.18.0.9", 7472))


def test_passive_path_halves_probes_and_still_detects_at_bfd_time():
    from linkpass.core.probe_filter import ProbeFilter
    from linkpass.core.paths import PathHealth

    probers, events, clock, w = _pair()
    h0, h1 = probers["h0"], probers["h1"]
    _run(probers, clock, w, clock[0] + 1000 * MS)
    # h0 (smaller name) probes; h1 answers and leaves its own probes out (h0's acks prove the path)
    assert h0.counters["sent"] >= 95 and h0.counters["replies"] >= 95
    assert h1.counters["passive"] >= 90 and h1.counters["sent"] <= 10 and h1.counters["passive_ok"] >= 90
    assert h1.counters.get("passive_misses", 0) == 0 and h0.counters.get("timeouts", 0) <= 1
    t_cut = clock[0]
    w.cut = True  # blackhole both ways
    _run(probers, clock, w, clock[0] + 100 * MS)
    for me, pr in probers.items():
        filt_out = []
        f = ProbeFilter(probe_policy(pr.cfg.probe), filt_out.append)
        for e in events[me]:
            f(e)
        ph = PathHealth(0, "h1" if me == "h0" else "h0", 3, 10 * MS)
        down = None
        last_ok = max(e.t_ns for e in events[me] if e.ok and e.t_ns <= t_cut)
        for e in filt_out:
            if getattr(e, "ok", None) is None:
                continue
            t = ph.on_result(e.ok, e.t_ns, e.rtt_ns, e.since_ok_ns)
            if t and t[1].value == "DOWN":
                down = e.t_ns
        assert down is not None, me
        assert down == last_ok + 30 * MS, (me, (down - last_ok) / MS)  # BFD's detection time after the last proof
        assert down - t_cut <= 31 * MS, (me, (down - t_cut) / MS)
    # the wire comes back: h1's confirm/regular probes and h0's acks bring both sides back
    w.cut = False
    _run(probers, clock, w, clock[0] + 200 * MS)
    assert events["h0"][-1].ok and any(e.ok for e in events["h1"][-5:])


def test_replayed_request_proves_nothing():
    probers, events, clock, w = _pair()
    h1 = probers["h1"]
    _run(probers, clock, w, clock[0] + 200 * MS)
    sent = []
    w.queue.clear()
    # capture one of h0's requests, then replay it to h1 later
    h0 = probers["h0"]
    clock[0] = h0.schedule.next_tick_ns
    for s in h0.schedule.poll(clock[0]):
        h0._send(s, clock[0])
    src, req = w.queue.pop(0)
    h1.on_datagram(req, ("198.18.0.1", 7472))
    n, answered = h1.counters["passive_ok"], h1.counters["answered"]
    for _ in range(3):
        h1.on_datagram(req, ("198.18.0.1", 7472))  # neither answered nor proof
    assert h1.counters["passive_ok"] == n and h1.counters["answered"] == answered
    assert h1.counters["rejected_replay"] == 3
