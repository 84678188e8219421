"""Peer notice sending: rail by rail, spread over event-loop turns past SEND_CHUNK datagrams, a
newer send replacing the rest of an older one, and the refresh over one usable rail at a time.

Sockets are recorders (no datagram leaves this host); the refresh loop's sleep is replaced so
the loop's turns are counted, not timed."""

from __future__ import annotations

import asyncio

import pytest

from linkpass.adapters import notices as mod
from linkpass.adapters.notices import NoticeService
from linkpass.config import parse_config
from linkpass.core import notice as wire
from linkpass.core.model import SendNotice

KEY = b"k" * 32


def _cfg(n_peers: int = 5, rails: int = 3, daemon: str = ""):
    rails_toml = "".join(f'[[rails]]\nid = {r}\nnetdev = "rail{r}"\naddress = "198.18.{r}.1"\n' for r in range(rails))
    peers_toml = "".join(
        f'[[peers]]\nname = "p{i}"\nrail_ips = {{ {", ".join(f"{chr(34)}{r}{chr(34)} = {chr(34)}198.18.{r}.{10 + i}{chr(34)}" for r in range(rails))} }}\n'
        for i in range(n_peers))
    return parse_config(f'[daemon]\nhost = "h0"\nmode = "per-rail-ip"\n{daemon}{rails_toml}{peers_toml}')


class _Rec:
    def __init__(self, rid: int, log: list):
        self.rid, self.log = rid, log

    def sendto(self, data, addr):
        self.log.append((self.rid, addr[0], wire.decode(data, KEY).generation))
        return len(data)

    def close(self):
        pass


def _service(cfg):
    sent: list = []
    ns = NoticeService(cfg, KEY, lambda ev: None)
    ns._sock = lambda rid: _Rec(rid, sent)
    return ns, sent


def _state(gen: int, usable=(0, 1, 2)):
    return SendNotice(generation=gen, usable=frozenset(usable), urgent=True)


def test_without_a_loop_a_send_goes_out_whole_rail_by_rail():
    ns, sent = _service(_cfg())
    ns.send(_state(1, usable=(0, 2)))
    assert [r for r, _, _ in sent] == [0] * 5 + [2] * 5
    assert ns.counters["sent"] == 10 and not ns.sending()


def test_a_big_send_is_spread_over_loop_turns_and_a_newer_one_replaces_its_rest(monkeypatch):
    monkeypatch.setattr(mod, "SEND_CHUNK", 4)
    ns, sent = _service(_cfg())

    async def main():
        ns.send(_state(1))
        first = list(sent)
        assert len(first) == 4 and ns.sending()  # the rest waits for later loop turns
        await asyncio.sleep(0)
        assert len(sent) == 8
        ns.send(_state(2))  # newer state: what was left of generation 1 is not sent
        while ns.sending():
            await asyncio.sleep(0)
        return first

    first = asyncio.run(main())
    assert [g for _, _, g in sent].count(1) == 8
    assert [g for _, _, g in sent].count(2) == 15
    assert [r for r, _, g in sent if g == 2] == [0] * 5 + [1] * 5 + [2] * 5
    assert first == [(0, f"198.18.0.{10 + i}", 1) for i in range(4)]


def _refresh_turns(monkeypatch, ns, state, turns: int, slept: list | None = None) -> None:
    """Run ``ns.refresh_loop`` for ``turns`` periods (its sleep counts them, no time passes;
    ``slept`` gets each period asked for, s)."""
    n = {"n": 0}

    async def fake_sleep(s):
        if slept is not None:
            slept.append(s)
        n["n"] += 1
        if n["n"] > turns:
            raise asyncio.CancelledError

    monkeypatch.setattr(mod.asyncio, "sleep", fake_sleep)

    async def main():
        ns._state = state
        with pytest.raises(asyncio.CancelledError):
            await ns.refresh_loop()

    asyncio.run(main())


def test_refresh_goes_over_one_usable_rail_at_a_time_in_turn(monkeypatch):
    ns, sent = _service(_cfg(n_peers=2))
    _refresh_turns(monkeypatch, ns, _state(7, usable=(0, 2)), 5)
    # 5 refreshes, each to both peers over one rail: 0, 2, 0, 2, 0
    assert [r for r, _, _ in sent] == [0, 0, 2, 2, 0, 0, 2, 2, 0, 0]
    assert {g for _, _, g in sent} == {7}


def test_refresh_with_no_usable_rail_sends_nothing(monkeypatch):
    ns, sent = _service(_cfg(n_peers=2))
    _refresh_turns(monkeypatch, ns, _state(3, usable=()), 3)
    assert sent == []


@pytest.mark.parametrize("n_peers,max_pps,period_s", [(5, 2000, 1.0), (30, 10, 3.0), (4, 8, 1.0), (9, 8, 1.125)])
def test_the_refresh_period_grows_past_notice_refresh_max_pps_datagrams_a_second(monkeypatch, n_peers, max_pps, period_s):
    """Every host refreshes every peer each period, so the cap bounds what each host sends and,
    the same on every host, what each receives and verifies: one datagram per peer per period
    at most ``notice_refresh_max_pps`` a second."""
    cfg = _cfg(n_peers=n_peers, daemon=f"notice_refresh_max_pps = {max_pps}\n")
    assert mod.refresh_period_s(cfg) == pytest.approx(period_s)
    ns, sent = _service(cfg)
    slept = []
    _refresh_turns(monkeypatch, ns, _state(4, usable=(0, 1)), 3, slept)
    assert slept and all(s == pytest.approx(period_s) for s in slept), slept
    assert len(sent) == 3 * n_peers  # one datagram per peer per refresh, over one rail
    assert n_peers / slept[0] <= max_pps or slept[0] == cfg.daemon.notice_refresh_ms / 1000
