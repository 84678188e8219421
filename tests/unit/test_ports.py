"""linkpass/adapters/ports.py and fakes.py: the real adapters and the fakes beside them offer
the same small Protocols the daemon drives; the engine hands history out as an action."""

from __future__ import annotations

import pytest

from linkpass.adapters import fakes, ports
from linkpass.adapters.metrics import DaemonMetrics
from linkpass.config import parse_config, policy_from_config
from linkpass.core.engine import Engine
from linkpass.core.model import LinkChanged, PublishHistory
from linkpass.daemon import Daemon

from unit_helpers import S, carrier_lost, history_of, make_cfg, make_toml, snapshot


@pytest.fixture
def d(tmp_path):
    text = make_toml(rails=(0, 1), n_peers=1).replace("[daemon]\n", f'[daemon]\ncontrol_socket = "{tmp_path}/lp.sock"\n', 1)
    dm = Daemon(str(tmp_path / "lp.toml"), parse_config(text, "lp.toml"))
    yield dm
    if dm.metrics:
        dm.metrics.stop()


def test_real_adapters_and_fakes_offer_the_same_protocols(d):
    pairs = [(ports.RouteWriter, d.routes, fakes.FakeRouteWriter()),
             (ports.HookNotifier, d.hooks, fakes.FakeHookNotifier()),
             (ports.NcclEnvWriter, d.nccl_file, fakes.FakeNcclEnvWriter()),
             (ports.HistoryReader, d.metrics, fakes.FakeHistoryReader()),
             (ports.NoticeSender, None, fakes.FakeNoticeSender()),
             (ports.ProbePriority, None, fakes.FakeProbePriority()),
             (ports.Publisher, None, fakes.FakePublisher())]
    for proto, real, fake in pairs:
        if real is not None:
            assert isinstance(real, proto), (proto, real)
        assert isinstance(fake, proto), (proto, fake)
    assert isinstance(d.metrics, DaemonMetrics)


def test_history_leaves_the_engine_last_in_the_actions_of_the_call_that_recorded_it():
    cfg = make_cfg()
    e = Engine(policy_from_config(cfg))
    acts = e.handle(snapshot(cfg), 0)
    assert isinstance(acts[-1], PublishHistory) and sum(isinstance(a, PublishHistory) for a in acts) == 1
    first = history_of(acts)
    acts = e.handle(LinkChanged(carrier_lost("rail0"), S), S)
    second = history_of(acts)
    assert [h.kind for h in second][:1] == ["rail"] and not set(map(id, first)) & set(map(id, second))
    assert list(e.history) == first + second  # the engine keeps them for the `history` command
    assert not hasattr(e, "drain_events") and not hasattr(e, "new_events")
