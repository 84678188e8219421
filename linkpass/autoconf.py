"""Turn a ``[topology] rails = "auto"`` config plus the host's discovered topology into a fully
explicit :class:`~linkpass.config.Config` (rails and peers spelled out), which the engine runs.

Pure: the caller passes the analysed topology document (``linkpass.topology/v1``), the netdevs'
addresses (``Topology.links``) and the text of the peers file; nothing here touches the host.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

from linkpass.config import Config, ConfigError, read_text_file

#: The largest peers file read (a line is about 30 bytes: some 500,000 hosts).
MAX_PEERS_FILE_BYTES = 16 << 20


@dataclass
class Resolved:
    """The explicit config and what the operator should know about how it was made."""

    config: Config
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_peers_file(cfg: Config, source: str) -> str | None:
    """The text of ``[topology] peers_file`` (None when it is not set), read as the daemon reads
    it at start and on SIGHUP (:func:`linkpass.config.read_text_file`: a regular UTF-8 file of at
    most :data:`MAX_PEERS_FILE_BYTES`).

    Raises:
        ConfigError: ``<source>: topology.peers_file: <path>: <what is wrong>``.
    """
    path = cfg.topology.peers_file
    if not path:
        return None
    try:
        return read_text_file(path, limit=MAX_PEERS_FILE_BYTES, what="a peers file")
    except ConfigError as e:
        raise ConfigError(f"{source}: topology.peers_file: {e}") from None


def parse_peers_file(text: str, source: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``name host_ip`` lines -> [(name, ip)], warnings naming ``source`` and the line.

    Blank lines and ``#`` comments are skipped; a bad line is skipped with a warning; a
    duplicated name keeps its first line.
    """
    out: list[tuple[str, str]] = []
    warnings: list[str] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            warnings.append(f"{source}: line {n}: expected `name host_ip`, got {json.dumps(raw.strip(), ensure_ascii=False)}")
            continue
        name, ip = parts
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            warnings.append(f"{source}: line {n}: {json.dumps(ip, ensure_ascii=False)} is not an IPv4 address")
            continue
        if name in seen:
            warnings.append(f"{source}: line {n}: {name} listed twice; keeping the first")
            continue
        seen.add(name)
        out.append((name, ip))
    return out, warnings


def _rail_netdev(nic: dict) -> str | None:
    for p in nic.get("ports", []):
        if p.get("netdev"):
            return p["netdev"]
    devs = nic.get("netdevs") or []
    return devs[0] if devs else None


def resolve(cfg: Config, topo_doc: dict, links: dict[str, dict], peers_text: str | None = None,
            peers_source: str = "peers_file") -> Resolved:
    """Build the explicit config.

    Args:
        cfg: the validated config with ``[topology] rails = "auto"``.
        topo_doc: ``topology.affinity.to_json(analyse(...))`` of this host.
        links: netdev -> {"addresses": ["a.b.c.d/len", ...], ...} (``Topology.links``).
        peers_text: content of ``[topology] peers_file`` (None when not configured).

    Returns:
        :class:`Resolved`; its config lists one ``[[rails]]`` per compute NIC that has a netdev
        (rail id = the topology's rail number) and the configured peers plus those of the peers
        file, with addresses derived as documented on :class:`~linkpass.config.TopologySection`.

    Raises:
        ConfigError: discovery found no usable rail at all (the daemon cannot run).
    """
    res_notes: list[str] = []
    warnings: list[str] = []
    rails = []
    nets: dict[int, ipaddress.IPv4Network] = {}
    for nic in sorted((n for n in topo_doc.get("nics", []) if n.get("rail") is not None), key=lambda n: n["rail"]):
        dev = _rail_netdev(nic)
        if dev is None:
            warnings.append(f"rail {nic['rail']} ({nic['name']}): no netdev, so no IP rail to manage; skipped")
            continue
        addr = next((a for a in links.get(dev, {}).get("addresses", []) if ":" not in a), None)
        entry = {"id": nic["rail"], "netdev": dev}
        if addr:
            iface = ipaddress.IPv4Interface(addr)
            entry["address"] = str(iface.ip)
            nets[nic["rail"]] = iface.network
        elif dev not in links:
            warnings.append(f"rail {nic['rail']} ({nic['name']}): netdev {dev} not seen by netlink")
        rails.append(entry)
        res_notes.append(f"rail {nic['rail']}: {nic['name']} via {dev}" + (f" ({addr})" if addr else " (no IPv4 address)"))
    if not rails:
        raise ConfigError("[topology] rails = \"auto\": discovery found no compute NIC with a netdev; "
                          "check `linkpass topology`, or list [[rails]] in the config")
    peers = [p.model_dump(mode="json") for p in cfg.peers]
    known = {p["name"] for p in peers}
    if peers_text is not None:
        listed, w = parse_peers_file(peers_text, peers_source)
        warnings += w
        for name, ip in listed:
            if name == cfg.daemon.host or name in known:
                continue
            host_bits = int(ipaddress.IPv4Address(ip))
            rail_ips = {}
            for rid, net in nets.items():
                mask = (1 << (32 - net.prefixlen)) - 1
                cand = ipaddress.IPv4Address(int(net.network_address) | (host_bits & mask))
                if cand in (net.network_address, net.broadcast_address):
                    warnings.append(f"{peers_source}: {name}: host part of {ip} gives {cand} on rail {rid}, not a host address; skipped there")
                    continue
                rail_ips[str(rid)] = str(cand)
            if not rail_ips:
                warnings.append(f"{peers_source}: {name}: no rail address could be derived (no rail has an IPv4 address)")
                continue
            peers.append({"name": name, "host_ip": ip, "rail_ips": rail_ips})
            known.add(name)
    raw = cfg.model_dump(mode="json", exclude_none=True)
    raw["rails"] = rails
    raw["peers"] = peers
    raw["topology"] = {**raw.get("topology", {}), "rails": "config"}
    try:
        explicit = Config.model_validate(raw)
    except Exception as e:  # the derived config must itself be valid; say what broke
        raise ConfigError(f"[topology] rails = \"auto\": the derived config is invalid: {e}".splitlines()[0]) from None
    return Resolved(explicit, res_notes, warnings)
