"""Probe timing by arrival, verdicts suspended while the prober itself is late, peer-wide
silence told from a rail's loss, request replay protection, and kernel drop counting.

The prober runs without its sockets on a fake clock (as in test_probe.py), except the last
tests, which use real UDP sockets on loopback to check the kernel's control messages."""

from __future__ import annotations

import socket

import pytest

from linkpass.config import probe_policy
from linkpass.core.model import ProbeResult
from linkpass.core.probe import REPLY, REQUEST, Probe, ProbeError, RequestGuard, encode
from test_probe import KEY, prober_for

MS = 1_000_000


def _send_all(pr, clock):
    sends = pr.schedule.poll(clock[0])
    for s in sends:
        pr._send(s, clock[0])
    return {p.rail: p for p in pr.guard._pending.values()}


def _reply(pend, host="h0"):
    return encode(Probe(REPLY, pend.peer, host, pend.rail, pend.seq, pend.sent_ns), KEY)


def test_a_reply_that_arrived_in_time_counts_although_the_loop_read_it_late():
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    clock[0] += 50 * MS  # the loop got to the socket 40 ms after the deadline
    pr.on_datagram(_reply(pend[0]), ("198.18.0.2", 7472), arrival_ns=pend[0].sent_ns + 2 * MS)
    assert events == [ProbeResult(0, "h1", True, pend[0].sent_ns + 2 * MS, 2 * MS, pend[0].seq)]
    assert pr.counters["late"] == 0


def test_a_reply_that_arrived_after_its_deadline_is_late_whatever_the_loop_did():
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    clock[0] += 20 * MS
    pr.on_datagram(_reply(pend[0]), ("198.18.0.2", 7472), arrival_ns=pend[0].deadline_ns + 1)
    assert pr.counters["late"] == 1 and events == []


def test_an_arrival_time_from_the_future_is_not_believed():
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    clock[0] += 3 * MS
    pr.on_datagram(_reply(pend[0]), ("198.18.0.2", 7472), arrival_ns=clock[0] + 10**12)
    assert events[-1].t_ns == clock[0]


def test_a_late_turn_voids_its_misses_instead_of_reporting_them():
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    deadline = min(p.deadline_ns for p in pend.values())
    pr._wake_at = deadline
    clock[0] = deadline + 200 * MS  # SIGSTOPped for 200 ms
    pr._tick()
    assert events == [] and pr.counters["voided_lag"] == 2 and pr.counters["late_wakeups"] == 1
    assert pr.counters["timeouts"] == 0 and pr.loop_lag_max_ns == 200 * MS


def test_a_turn_on_time_reports_its_misses():
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    deadline = max(p.deadline_ns for p in pend.values())
    pr._wake_at = deadline
    clock[0] = deadline + pr.lag_void_ns  # late, but not more than the limit
    pr._tick()
    assert [e.ok for e in events] == [False, False] and pr.counters["voided_lag"] == 0


def test_misses_say_whether_the_peer_answered_on_another_rail():
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    clock[0] += 2 * MS
    pr.on_datagram(_reply(pend[0]), ("198.18.0.2", 7472))  # rail 0 answers, rail 1 does not
    clock[0] = pend[1].deadline_ns
    pr._expire(clock[0])
    assert events[-1].ok is False and events[-1].rail == 1 and events[-1].peer_elsewhere is True
    # next round: nothing answers anywhere, for longer than a gap -> a peer-wide silence
    clock[0] = pr.schedule.next_tick_ns
    pend = _send_all(pr, clock)
    clock[0] = max(p.deadline_ns for p in pend.values()) + pr._gap_ns("h1")
    pr._expire(clock[0])
    assert [(e.rail, e.peer_elsewhere) for e in events[-2:]] == [(0, False), (1, False)]
    assert pr.counters["peer_silent_misses"] == 2


def test_a_single_rail_peer_cannot_be_judged_peer_wide():
    pr, clock, events = prober_for()
    assert pr._elsewhere(0, "h1", 0) is False  # h1 has two rails: known, and silent
    pr._peer_rails["h1"] = [0]
    assert pr._elsewhere(0, "h1", 0) is None


def test_probe_filter_leaves_peer_wide_misses_out_of_the_rail_loss():
    from linkpass.core.probe_filter import ProbeFilter

    pr, _, _ = prober_for()
    posted = []
    f = ProbeFilter(probe_policy(pr.cfg.probe), posted.append)
    t = 0
    for i in range(200):
        t += 10 * MS
        f(ProbeResult(0, "h1", True, t, 20_000))
        f(ProbeResult(0, "h1", False, t + 5 * MS, peer_elsewhere=False))
    assert f.rail_lost.get(0, 0) == 0
    losses = [e for e in posted if e.__class__.__name__ == "ProbeLoss"]
    assert losses and all(e.loss == 0 for e in losses)
    # the same misses with the peer answering elsewhere are loss
    f2 = ProbeFilter(probe_policy(pr.cfg.probe), posted.append)
    for i in range(10):
        t += 10 * MS
        f2(ProbeResult(0, "h1", True, t, 20_000))
        f2(ProbeResult(0, "h1", False, t + 5 * MS, peer_elsewhere=True))
    assert f2.rail_lost[0] > 0


# --------------------------------------------------------------------- request replay window


def req(seq, sender="h1"):
    return Probe(REQUEST, sender, "h0", 0, seq, 1)


def test_request_guard_answers_each_seq_once():
    g = RequestGuard(window=8)
    g.check(req(100))
    with pytest.raises(ProbeError) as e:
        g.check(req(100))
    assert e.value.kind == "replay"
    g.check(req(102))
    g.check(req(101))  # out of order within the window: once
    with pytest.raises(ProbeError):
        g.check(req(101))
    g.check(req(200))
    with pytest.raises(ProbeError) as e:
        g.check(req(150))  # too far below the newest to tell
    assert "below the newest" in str(e.value)
    g.check(req(5, sender="h2"))  # per sender


def test_request_guard_memory_is_bounded():
    g = RequestGuard(window=4, max_senders=3)
    for seq in range(1, 1000):
        g.check(req(seq))
    assert len(g._seen["h1"]) <= 8
    for name in ("a", "b", "c", "d"):
        g.check(req(1, sender=name))
    assert len(g._hi) == 3


def test_a_replayed_request_is_neither_answered_nor_proof():
    pr, clock, events = prober_for("h0")
    sent = []

    class S:
        def sendto(self, data, addr):
            sent.append(data)

    pr._resp = S()
    data = encode(Probe(REQUEST, "h1", "h0", 9, 77, 5), KEY)  # rail 9: answered from the responder
    pr.on_datagram(data, ("198.18.0.1", 7472))
    pr.on_datagram(data, ("198.18.9.9", 7472))  # the same request resent from elsewhere
    assert len(sent) == 1 and pr.counters["rejected_replay"] == 1


# --------------------------------------------------------------------- real sockets (loopback)


def _udp_pair():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return rx, tx


def test_kernel_arrival_times_reach_on_datagram():
    pr, _, _ = prober_for()
    pr.clock = __import__("time").monotonic_ns
    rx, tx = _udp_pair()
    try:
        pr._tune(rx)
        got = []
        pr.on_datagram = lambda data, addr, arrival=None: got.append(arrival)
        before = pr.clock()
        for _ in range(5):
            tx.sendto(b"x" * 80, rx.getsockname())
        import select

        select.select([rx], [], [], 5)
        n = 0
        while n < 5:
            n += pr._read(rx, 64)
            if n < 5:
                select.select([rx], [], [], 5)
        after = pr.clock()
        assert len(got) == 5 and all(a is not None for a in got)
        # converted to the monotonic clock: the kernel stamped them between the first send and the
        # last read (a sanity check of the conversion with a second's slack, not a timing)
        assert all(before - 1_000_000_000 <= a <= after + 1_000_000_000 for a in got), (before, got, after)
        assert got == sorted(got)  # one socket: in arrival order
    finally:
        rx.close()
        tx.close()


def test_kernel_drops_are_counted_from_so_rxq_ovfl():
    pr, _, _ = prober_for()
    rx, tx = _udp_pair()
    try:
        pr._tune(rx)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # tiny: most of the burst is dropped
        for _ in range(500):
            tx.sendto(b"y" * 100, rx.getsockname())
        pr.on_datagram = lambda *a: None
        pr._read(rx, 10_000)  # what fitted was queued before the drops: it carries no count yet
        # the kernel stamps the socket's drop count on each datagram as it queues it
        tx.sendto(b"z", rx.getsockname())
        import select

        select.select([rx], [], [], 5)
        pr._read(rx, 10_000)
        assert pr.counters["rx_dropped"] > 0
    finally:
        rx.close()
        tx.close()


def test_rcvbuf_is_sized_to_the_probe_rate():
    pr, _, _ = prober_for()
    assert pr.rcvbuf_bytes() >= 2 * pr.cfg.probe.max_pps * 1000
    rx, tx = _udp_pair()
    try:
        pr._tune(rx)
        # the kernel doubles what it is given (socket(7)); as root SO_RCVBUFFORCE passes rmem_max
        assert rx.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= pr.rcvbuf_bytes()
    finally:
        rx.close()
        tx.close()


def test_notice_socket_counts_the_kernel_drops_of_a_flood():
    import asyncio

    from linkpass.adapters.notices import NoticeService
    from linkpass.config import parse_config

    probe_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe_sock.bind(("127.0.0.1", 0))
    port = probe_sock.getsockname()[1]
    probe_sock.close()
    cfg = parse_config(f"""
[daemon]
host = "h0"
mode = "per-rail-ip"
notice_port = {port}
[[rails]]
id = 0
netdev = "rail0"
address = "198.18.0.1"
[[peers]]
name = "h1"
rail_ips = {{ "0" = "198.18.0.2" }}
""")

    async def main():
        ns = NoticeService(cfg, KEY, lambda ev: None)
        await ns.start()
        try:
            tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            # the loop does not run while we send: the queue fills and the kernel drops the rest
            for _ in range(5000):
                tx.sendto(b"n" * 200, ("127.0.0.1", port))
            tx.close()
            return ns.counters["rx_dropped"]
        finally:
            ns.close()

    assert asyncio.run(main()) > 0


def test_a_miss_while_a_stalled_peer_comes_back_rail_by_rail_is_the_stall_not_the_rail():
    """The peer was silent everywhere (SIGSTOP), then answers on rail 0 a moment before rail 1:
    a rail-1 miss in that moment is peer-wide; after BFD's detection time of rail 0 answering
    while rail 1 stays silent, rail 1's misses are its own."""
    pr, clock, events = prober_for()
    pend = _send_all(pr, clock)
    clock[0] += 1 * MS
    for r in (0, 1):
        pr.on_datagram(_reply(pend[r]), ("198.18.0.2", 7472))
    clock[0] += 200 * MS  # the peer stops answering anywhere
    clock[0] = pr.schedule.next_tick_ns if pr.schedule.next_tick_ns > clock[0] else clock[0]
    pend = _send_all(pr, clock)
    clock[0] += 2 * MS
    pr.on_datagram(_reply(pend[0]), ("198.18.0.2", 7472))  # back on rail 0 first
    clock[0] = pend[1].deadline_ns
    pr._expire(clock[0])
    assert events[-1].rail == 1 and events[-1].peer_elsewhere is False
    # rail 0 keeps answering for longer than the detection time; rail 1 stays silent
    t_end = clock[0] + pr._detect_ns() + 20 * MS
    while clock[0] < t_end:
        clock[0] = max(clock[0], pr.schedule.next_tick_ns)
        pend = _send_all(pr, clock)
        clock[0] += 1 * MS
        if 0 in pend:
            pr.on_datagram(_reply(pend[0]), ("198.18.0.2", 7472))
        clock[0] = max(p.deadline_ns for p in pr.guard._pending.values()) if len(pr.guard) else clock[0]
        pr._expire(clock[0])
    assert events[-1].rail == 1 and events[-1].ok is False and events[-1].peer_elsewhere is True


def test_a_paths_own_loss_does_not_flip_with_each_probe_window():
    """Rail 0 dead, rail 1 answering: once rail 0's misses are its own, a probe window that
    happens to hold no rail-1 evidence does not turn the verdict into a peer-wide silence (each
    flip would move routes); a real peer-wide silence longer than a gap still does."""
    pr, clock, events = prober_for()
    pr._peer_rails = {"h1": [0, 1]}
    pr._last_ok[(1, "h1")] = clock[0]
    pr._peer_last["h1"] = clock[0]
    pr._post_miss(0, "h1", clock[0] + 1 * MS, 1, clock[0])
    assert events[-1].peer_elsewhere is True
    # next miss: its window starts after rail 1's last evidence, but the peer was heard 5 ms ago
    pr._post_miss(0, "h1", clock[0] + 5 * MS, 2, clock[0] + 2 * MS)
    assert events[-1].peer_elsewhere is True
    # the peer is then silent everywhere for longer than a gap
    later = clock[0] + pr._gap_ns("h1") + 10 * MS
    pr._post_miss(0, "h1", later, 3, later - 5 * MS)
    assert events[-1].peer_elsewhere is False


def test_a_peer_that_stalls_in_the_middle_of_a_send_round_is_silent_everywhere():
    """The peer's last round reached us on rail 1 a few ms after rail 0 (its loop was
    descheduled between the two sends), then nothing anywhere: rail 0's misses during the stall
    are peer-wide although rail 1's last evidence is newer than rail 0's window.  Seen in the
    3x8 load test: 6 of a stalled peer's 8 paths went DOWN with peer_elsewhere and routes moved."""
    pr, clock, events = prober_for()
    pr._peer_rails = {"h1": [0, 1]}
    t0 = clock[0]
    pr._last_ok[(0, "h1")] = t0
    pr._last_ok[(1, "h1")] = t0 + 4 * MS
    pr._peer_last["h1"] = t0 + 4 * MS
    # rail 0's third miss, judged BFD's detection time after its last answer
    judged = t0 + pr._detect_ns()
    pr._post_miss(0, "h1", judged, 3, t0 + 2 * MS)
    assert events[-1].peer_elsewhere is False
    # while rail 1 keeps answering (every interval), the same miss is rail 0's own
    pr._last_ok[(1, "h1")] = pr._peer_last["h1"] = judged - 1 * MS
    pr._post_miss(0, "h1", judged, 4, t0 + 2 * MS)
    assert events[-1].peer_elsewhere is True
