"""Engine + flap damping: a flapping rail is kept out of use until its penalty decays."""

from __future__ import annotations

from unit_helpers import carrier_lost, make_cfg, snapshot, up

from linkpass.config import parse_config, policy_from_config
from linkpass.core.engine import Engine
from linkpass.core.model import ApplyRoutes, LinkChanged, SetTimer, Tick

S = 1_000_000_000


def route_changes(actions) -> int:
    return sum(1 for a in actions if isinstance(a, ApplyRoutes))


class Sim:
    """Drives an engine with a fake clock, firing its timers as a daemon would."""

    def __init__(self, cfg):
        self.e = Engine(policy_from_config(cfg))
        self.timer = None
        self.actions = []
        self._take(self.e.handle(snapshot(cfg, 0), 0))

    def _take(self, acts):
        self.actions += acts
        for a in acts:
            if isinstance(a, SetTimer):
                self.timer = a.at_ns

    def advance(self, t):
        while self.timer is not None and self.timer <= t:
            at, self.timer = self.timer, None
            self._take(self.e.handle(Tick(at), at))

    def link(self, t, ok):
        self.advance(t)
        self._take(self.e.handle(LinkChanged(up("rail0") if ok else carrier_lost("rail0"), t), t))


def flap(sim, start, period, count):
    t = start
    for _ in range(count):
        sim.link(t, False)
        sim.link(t + period // 2, True)
        t += period
    return t


def test_slow_flapping_rail_is_suppressed_then_released():
    cfg = make_cfg(rails=(0, 1), hold_down_ms=1000)
    sim = Sim(cfg)
    end = flap(sim, 1 * S, 4 * S, 6)  # down 2 s, up 2 s: longer than the 1 s hold-down
    d = sim.e.dampers[0]
    assert d.suppressed(end)
    assert sim.e.rails[0].state.value == "DOWN" and "flap damping" in sim.e.rails[0].reason
    changes_during = route_changes(sim.actions)
    # once suppressed, further flaps change no route
    before = route_changes(sim.actions)
    end = flap(sim, end, 4 * S, 3)
    assert route_changes(sim.actions) == before
    # release: the rail comes back only after the penalty decays and then the hold-down
    rel = d.release_at(end)
    sim.advance(rel - 1)
    assert not sim.e.rails[0].usable
    sim.advance(rel + 1000 * 1_000_000 + 1)
    assert sim.e.rails[0].usable
    assert changes_during >= 4


def test_without_damping_every_flap_moves_traffic():
    text_cfg = make_cfg(rails=(0, 1), hold_down_ms=1000)
    cfg = text_cfg.model_copy(update={"damping": text_cfg.damping.model_copy(update={"enabled": False})})
    sim = Sim(cfg)
    n0 = route_changes(sim.actions)
    flap(sim, 1 * S, 4 * S, 6)
    sim.advance(40 * S)
    assert route_changes(sim.actions) - n0 == 12  # down and back for each of the 6 flaps


def test_damping_bad_limits_are_config_errors():
    import pytest

    from linkpass.config import ConfigError

    base = "[daemon]\nhost='h'\nhost_ip='10.0.0.1'\n[[rails]]\nid=0\nnetdev='r0'\n[damping]\n"
    with pytest.raises(ConfigError) as e:
        parse_config(base + "reuse = 3000\nsuppress = 2000\n", "x.toml")
    assert "damping.reuse" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_config(base + "max_penalty = 2000\n", "x.toml")
    assert "damping.max_penalty" in str(e.value) and "at least suppress" in str(e.value)


def test_number_and_boolean_options_refuse_strings_booleans_and_nan():
    import pytest

    from linkpass.config import ConfigError

    base = "[daemon]\nhost='h'\nhost_ip='10.0.0.1'\n[[rails]]\nid=0\nnetdev='r0'\n[probe]\n"
    for bad, field, why in (('rail_down_share = "0.5"', "probe.rail_down_share", "must be a number"),
                            ("rail_down_share = true", "probe.rail_down_share", "must be a number"),
                            ("degraded_loss = nan", "probe.degraded_loss", "finite"),
                            ('enabled = "yes"', "probe.enabled", "boolean"),
                            ("enabled = 1", "probe.enabled", "boolean")):
        with pytest.raises(ConfigError) as e:
            parse_config(base + bad + "\n", "x.toml")
        assert field in str(e.value) and why in str(e.value), (bad, str(e.value))
    assert parse_config(base + "rail_down_share = 1\n", "x.toml").probe.rail_down_share == 1.0  # an int is a number
