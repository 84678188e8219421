"""``[topology] rails = "auto"`` on the live host: discover, analyse, resolve.

The one place that does it, so that ``linkpass run`` (:meth:`linkpass.daemon.Daemon._resolve`)
and ``linkpass config check`` (:func:`linkpass.cli.config.file_problems`) read the host the same
way and refuse the same configs.  :mod:`linkpass.autoconf` stays pure; this module touches sysfs,
netlink and (on the real root) NVML.
"""

from __future__ import annotations

from dataclasses import dataclass

from linkpass.autoconf import Resolved, read_peers_file, resolve
from linkpass.config import Config, ConfigError


@dataclass
class LiveResolved:
    """:class:`~linkpass.autoconf.Resolved` plus what discovery read."""

    resolved: Resolved
    topology: object  # topology.model.Topology: the daemon's NCCL env file matches rails to HCA ports with it
    warnings: list[str]  # the resolver's warnings and discovery's (NVML "not used" left out)


def resolve_live(cfg: Config, source: str) -> LiveResolved:
    """Discover this host under ``[topology] sysfs_root`` and derive the explicit config.

    Raises:
        ConfigError: the peers file cannot be read (``<source>: topology.peers_file: ...``), or
            discovery found no usable rail (``<source>: [topology] rails = "auto": ...``).
    """
    from topology.affinity import analyse, to_json
    from topology.live import discover

    t = cfg.topology
    topo = discover(t.sysfs_root, use_netlink=True, use_nvml=(t.sysfs_root in ("/", "")))
    override = {n: True for n in t.compute_nics} | {n: False for n in t.exclude_nics}
    doc = to_json(analyse(topo, override))
    peers_text = read_peers_file(cfg, source)
    try:
        res = resolve(cfg, doc, topo.links, peers_text, t.peers_file or "peers_file")
    except ConfigError as e:  # name the file, as every other config problem does
        raise ConfigError(f"{source}: {e}") from None
    warnings = res.warnings + [w for w in topo.warnings if not w.startswith("nvml: not used")]
    return LiveResolved(res, topo, warnings)
