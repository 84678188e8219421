"""Shared builders for the unit tests (configs as TOML text, link facts, action filters).

Addressing used throughout (the test-fabric convention of DESIGN.md):
host index i (0 = this host "h0", peers "h1".."hN") has host IP 198.19.0.(i+1) and, on rail
r, the address 198.18.r.(i+1); rail r is served by netdev "rail<r>".
"""

from __future__ import annotations

from collections.abc import Sequence

from linkpass.config import Config, parse_config
from linkpass.core.model import ApplyRoutes, LinkFacts, LinkSnapshot, SendNotice, SetTimer

MS = 1_000_000
S = 1_000 * MS


def host_ip(i: int) -> str:
    return f"198.19.0.{i + 1}"


def rail_ip(rail: int, i: int) -> str:
    return f"198.18.{rail}.{i + 1}"


def make_toml(
    mode: str = "host-ip",
    rails: Sequence[int] = (0, 1),
    n_peers: int = 1,
    hold_down_ms: int = 2000,
    route_protocol: int = 201,
    route_table: int = 254,
    route_metric: int = 0,
    peer_rails: dict[int, Sequence[int]] | None = None,
) -> str:
    """TOML text for host h0 with the given rails and peers h1..h<n_peers>.

    ``peer_rails`` optionally restricts, per peer index (1-based), which rails it has.
    """
    lines = [
        "[daemon]",
        'host = "h0"',
        f'mode = "{mode}"',
    ]
    if mode == "host-ip":
        lines.append(f'host_ip = "{host_ip(0)}"')
    lines += [
        f"hold_down_ms = {hold_down_ms}",
        f"route_protocol = {route_protocol}",
        f"route_table = {route_table}",
        f"route_metric = {route_metric}",
        "",
    ]
    for r in rails:
        lines += ["[[rails]]", f"id = {r}", f'netdev = "rail{r}"', f'address = "{rail_ip(r, 0)}"', ""]
    for i in range(1, n_peers + 1):
        prs = list(rails) if peer_rails is None or i not in peer_rails else list(peer_rails[i])
        ips = ", ".join(f'"{r}" = "{rail_ip(r, i)}"' for r in prs)
        lines += ["[[peers]]", f'name = "h{i}"']
        if mode == "host-ip":
            lines.append(f'host_ip = "{host_ip(i)}"')
        lines += [f"rail_ips = {{ {ips} }}", ""]
    return "\n".join(lines)


def make_cfg(**kw) -> Config:
    return parse_config(make_toml(**kw), "test.toml")


def up(netdev: str) -> LinkFacts:
    return LinkFacts(netdev)


def carrier_lost(netdev: str) -> LinkFacts:
    return LinkFacts(netdev, carrier=False, operstate="LOWERLAYERDOWN")


def admin_down(netdev: str) -> LinkFacts:
    return LinkFacts(netdev, admin_up=False, carrier=False, operstate="DOWN")


def gone(netdev: str) -> LinkFacts:
    return LinkFacts(netdev, present=False, admin_up=False, carrier=False, operstate="NOTPRESENT")


def snapshot(cfg: Config, t_ns: int = 0, down: Sequence[int] = (), missing: Sequence[int] = ()) -> LinkSnapshot:
    links = []
    for r in cfg.rails:
        if r.id in missing:
            continue
        links.append(carrier_lost(r.netdev) if r.id in down else up(r.netdev))
    return LinkSnapshot(tuple(links), t_ns)


def applies(actions) -> list[ApplyRoutes]:
    return [a for a in actions if isinstance(a, ApplyRoutes)]


def notices(actions) -> list[SendNotice]:
    return [a for a in actions if isinstance(a, SendNotice)]


def timers(actions) -> list[SetTimer]:
    return [a for a in actions if isinstance(a, SetTimer)]


def nexthop_rails(route) -> list[int]:
    return [n.rail for n in route.nexthops]


def decided(actions) -> list:
    """The engine's decisions: its actions without the :class:`PublishHistory` that carries
    the history the call recorded (tests of what the engine decides compare these)."""
    from linkpass.core.model import PublishHistory

    return [a for a in actions if not isinstance(a, PublishHistory)]


def history_of(actions) -> list:
    """The history entries the actions publish (every :class:`PublishHistory`'s), oldest first."""
    from linkpass.core.model import PublishHistory

    return [e for a in actions if isinstance(a, PublishHistory) for e in a.entries]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``linkpass ARGV`` in-process: (exit code, stdout, stderr); argparse's SystemExit is its code."""
    from linkpass.cli import main

    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
