"""The NCCL environment for a process on this host, from the topology and current rail health.

Pure: the caller passes an analysed :class:`topology.model.Topology` (after
:func:`topology.affinity.analyse`), the daemon's view of its rails (:class:`Health`, or None when
no daemon answers) and the options; :func:`compute` returns an :class:`NcclEnv` that holds the
variables, in a fixed order, plus notes, warnings and errors.  Nothing here reads the host.

What each variable is and where the facts come from (NCCL's own user guide,
``docs/userguide/source/env.rst`` in NVIDIA/nccl, and its source; see also
``../shared/NCCL-REFERENCE.md`` sections 1.1, 1.3 and 1.7):

``NCCL_IB_HCA``
    Comma-separated entries ``<hca>[:<port>[:<rail>[:<plane>]]]``; a leading ``^`` excludes, a
    following ``=`` makes the names exact (without it ``mlx5_1`` also matches ``mlx5_10`` ..
    ``mlx5_19``).  Example from the guide: ``=mlx5_0:1,mlx5_1:1``.  At most 32 HCAs.  The rail and
    plane fields are new in 2.30 and are not used here.  We always write the exact form with
    ports, only healthy compute ports, the GPU's nearest NIC first.  An EMPTY or unset value
    means "every device", so when no compute port is healthy the variable is left out and the
    result carries an error instead.
``NCCL_SOCKET_IFNAME``
    Prefix list; ``=`` for exact names (``=eth0,eth1``).  Setting it bypasses NCCL's automatic
    interface choice (which otherwise prefers ``ib*`` and avoids ``lo``/``docker*``).  We write the
    exact form with the healthy rail netdevs that have (or may have) an address.
``NCCL_IB_GID_INDEX``
    (since 2.1.4) the GID table index used in RoCE mode; one value for every device of the
    process.  Default -1: since 2.21 NCCL picks the GID itself from ``NCCL_IB_ADDR_FAMILY``
    (default AF_INET) and ``NCCL_IB_ROCE_VERSION_NUM`` (default 2), so on 2.21+ the value we write
    is the one NCCL would pick; on older versions it is needed.  We write the index of the
    ``RoCE v2`` GID that holds the port netdev's IPv4 address (``::ffff:a.b.c.d``), from the sysfs
    GID tables, and only when all listed RoCE ports agree on it.  A RoCE port flap can move a GID
    to another index (NVIDIA/nccl PR #2183), so the daemon's file is only as fresh as its
    topology reading.
``NCCL_CROSS_NIC``
    0: always the same NIC for a ring/tree (rail-optimised fabrics whose rails are not joined, or
    only slowly); 1: different NICs allowed (all NICs reach one switch); 2 (default): prefer the
    same NIC, cross when it is faster.  A rail-only fabric with cross-rail traffic fails with
    ``ibv_modify_qp ... Connection timed out`` (NVIDIA/nccl#2013).  We choose: rails not joined by
    a spine -> 0 (and a warning when this host lost a rail, because its peers cannot be reached
    from another rail); joined by a spine -> 2 while every rail is healthy, 1 when this host lost
    a rail (its GPU whose NIC died must talk to its peers' NIC of that rail from another NIC).
``NCCL_IB_RESILIENCY_PORT_FAILOVER`` (v2.29.7+, default 0) and ``NCCL_IB_RESILIENCY_PORT_RECOVERY`` (2.30+, default 0)
    NCCL's own IB port failover and failback (``src/transport/net_ib/p2p_resiliency.cc``:
    ``NCCL_PARAM(IbResiliencyPortFailover, "IB_RESILIENCY_PORT_FAILOVER", 0)``; 2.29 release notes;
    maintainer on NVIDIA/nccl#2044 for recovery in 2.30).  Failover acts only inside a fused
    virtual NIC (two or more ports; by default only ports of one physical NIC are fused,
    ``NCCL_NET_MERGE_LEVEL=PORT``, ``NCCL_IB_MERGE_NICS=1`` since 2.20), is triggered only by
    completion errors (so still after IB timeout x retries, ~30 s by default) and survives at
    most one failed device per communicator.  A GPU with one single-port NIC cannot fail over
    (NVIDIA/nccl#2192).  So both variables are set only when failover can act: a NIC in the
    list (this GPU's own NICs, or any listed NIC for a host-wide environment) has a second
    healthy port on the same physical card (a dual-port NIC, or two PFs of one card).
    Otherwise they are left out and a note says why.  This matters beyond NCCL:
    :mod:`torch_hooks.guard` takes ``NCCL_IB_RESILIENCY_PORT_FAILOVER=1`` to mean "NCCL fails
    over by itself" and then skips its own abort + exit 75; exporting it on a one-port-per-NIC
    node would leave a job waiting out NCCL timeouts on a dead link.

NCCL reads ``NCCL_IB_HCA`` once per process and never rescans devices (NCCL-REFERENCE 1.7), so
these values only matter for a process started after they were computed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from topology.model import Gpu, Nic, Port, Topology, norm_bus_id

#: The NCCL version assumed when neither the config nor detection gives one: 2.30.0, the first
#: release that has both port failover (2.29.7) and port recovery (2.30).  Older NCCL ignores
#: variables it does not know, so assuming a newer version costs nothing.
ASSUMED_NCCL_VERSION = (2, 30, 0)
#: First NCCL with ``NCCL_IB_RESILIENCY_PORT_FAILOVER`` (2.29 release notes; NVIDIA/nccl#2044).
PORT_FAILOVER_SINCE = (2, 29, 7)
#: First NCCL with ``NCCL_IB_RESILIENCY_PORT_RECOVERY`` (maintainer answer on NVIDIA/nccl#2044).
PORT_RECOVERY_SINCE = (2, 30, 0)
#: First NCCL that picks the RoCE GID itself when ``NCCL_IB_GID_INDEX`` is unset (env.rst:
#: ``NCCL_IB_ADDR_FAMILY``/``NCCL_IB_ROCE_VERSION_NUM`` "since 2.21").
DYNAMIC_GID_SINCE = (2, 21, 0)
#: "There is a fixed upper limit of 32 Host Channel Adapter (HCA) devices supported in NCCL" (env.rst).
MAX_HCAS = 32

SCHEMA = "linkpass.nccl-env/v1"
FORMATS = ("shell", "env-file", "json")

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+][0-9A-Za-z.+-]*)?\s*$")
_V4_MAPPED = re.compile(r"^0000:0000:0000:0000:0000:ffff:([0-9a-f]{4}):([0-9a-f]{4})$")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.,:=^+@%/-]*$")
_USABLE_STATES = ("UP", "SUSPECT")


class NcclEnvError(Exception):
    """Input that cannot give an environment at all (a GPU that is not on this host, a malformed
    version or daemon status).  ``str(err)`` is one line naming what is wrong."""


def parse_nccl_version(text: str) -> tuple[int, int, int]:
    """``"2.29.7"``, ``"2.29.7-1"``, ``"v2.30"``, ``"2.21.5+cuda12.4"`` -> ``(2, 29, 7)`` etc.

    Raises:
        NcclEnvError: not a version of that shape.
    """
    m = _VERSION_RE.match(text or "")
    if not m:
        raise NcclEnvError(f"NCCL version {text!r}: expected MAJOR.MINOR[.PATCH], e.g. 2.29.7")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def version_text(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class RailHealth:
    """One rail as the daemon reports it in ``linkpass status`` (``rails[]``).

    Attributes:
        id: the daemon's rail id (in config mode not necessarily the topology's rail number).
        netdev: the netdev serving the rail.
        usable: True when the daemon may send traffic over it (UP).
        state: the rail state (UP, DOWN, HOLD_DOWN, DRAINED, UNKNOWN; an older daemon's
            SUSPECT still reads as usable).
        addresses: the netdev's addresses, ``"a.b.c.d/len"``.
    """

    id: int
    netdev: str
    usable: bool
    state: str = ""
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class Health:
    """The daemon's rails and its plan generation (None when it does not say)."""

    rails: tuple[RailHealth, ...]
    generation: int | None = None


def health_from_status(status: object) -> Health:
    """Read the part of a ``linkpass.status/v1`` document (``linkpass status --json``) we need.

    Raises:
        NcclEnvError: the document is not an object with a ``rails`` list of rails each having
            an int ``id``, a str ``netdev`` and a bool ``usable`` (or a ``state``).
    """
    if not isinstance(status, dict):
        raise NcclEnvError(f"daemon status: expected a JSON object, got {type(status).__name__}")
    rails = status.get("rails")
    if not isinstance(rails, list):
        raise NcclEnvError("daemon status: no 'rails' list")
    out = []
    for i, r in enumerate(rails):
        if not isinstance(r, dict):
            raise NcclEnvError(f"daemon status: rails[{i}] is not an object")
        rid, dev, usable, state = r.get("id"), r.get("netdev"), r.get("usable"), r.get("state", "")
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise NcclEnvError(f"daemon status: rails[{i}].id is not an integer")
        if not isinstance(dev, str) or not dev:
            raise NcclEnvError(f"daemon status: rails[{i}].netdev is not a name")
        if not isinstance(state, str):
            raise NcclEnvError(f"daemon status: rails[{i}].state is not text")
        if usable is None:
            usable = state in _USABLE_STATES
        if not isinstance(usable, bool):
            raise NcclEnvError(f"daemon status: rails[{i}].usable is not true/false")
        addrs = r.get("addresses") or []
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise NcclEnvError(f"daemon status: rails[{i}].addresses is not a list of addresses")
        out.append(RailHealth(rid, dev, usable, state, tuple(addrs)))
    gen = status.get("generation")
    if gen is not None and (not isinstance(gen, int) or isinstance(gen, bool)):
        raise NcclEnvError("daemon status: generation is not an integer")
    return Health(tuple(out), gen)


@dataclass(frozen=True)
class NcclOptions:
    """How to choose (``[nccl]`` in the config).

    Attributes:
        rails_joined_by_spine: the fabric routes between rails (a spine layer joins the rail
            switches), so a NIC on rail j can reach a peer's NIC on rail k.
        ib_resiliency: set NCCL's IB port failover/recovery variables when the version has them
            and a listed NIC has a second healthy port to fail over to.
        nccl_version: the jobs' NCCL version; None: unknown, :data:`ASSUMED_NCCL_VERSION` is used.
    """

    rails_joined_by_spine: bool = False
    ib_resiliency: bool = True
    nccl_version: tuple[int, int, int] | None = None


@dataclass
class NcclEnv:
    """The result of :func:`compute`.

    Attributes:
        env: variable -> value, in output order (only variables that are set).
        generation: the daemon's plan generation, None without a daemon.
        health_known: True when the daemon's rail states were used.
        gpu: the GPU index the environment is for (None: host-wide).
        hcas: the NCCL_IB_HCA entries (``mlx5_0:1``), healthy, nearest first.
        netdevs: the healthy interfaces of NCCL_SOCKET_IFNAME.
        lost_rails: rails of this host that are not usable, as ``"rail 1 (mlx5_3)"``.
        nccl_version / nccl_version_assumed: the version the choices were made for.
        notes: why a variable is left out or chosen, for the operator.
        warnings: something is degraded (a GPU without its own NIC, a lost rail on a rail-only
            fabric, a GID index that cannot be set).
        source_warnings: problems the topology readers met (a cut-off or unreadable file, NVML
            or netlink not usable), each starting with its source; :func:`compute` leaves this
            empty, the caller that read the topology fills it in (``linkpass nccl-env``).
        errors: the environment cannot be right: no compute port is healthy.
    """

    env: dict[str, str] = field(default_factory=dict)
    generation: int | None = None
    health_known: bool = False
    gpu: int | None = None
    host: str = ""
    hcas: list[str] = field(default_factory=list)
    netdevs: list[str] = field(default_factory=list)
    lost_rails: list[str] = field(default_factory=list)
    nccl_version: str = version_text(ASSUMED_NCCL_VERSION)
    nccl_version_assumed: bool = True
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    source_warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The ``linkpass.nccl-env/v1`` document (``warnings``: the source warnings first)."""
        return {"schema": SCHEMA, "host": self.host, "generation": self.generation, "health_known": self.health_known,
                "gpu": self.gpu, "env": dict(self.env), "hcas": list(self.hcas), "netdevs": list(self.netdevs),
                "lost_rails": list(self.lost_rails), "nccl_version": self.nccl_version,
                "nccl_version_assumed": self.nccl_version_assumed, "notes": list(self.notes),
                "warnings": list(self.source_warnings) + list(self.warnings), "errors": list(self.errors)}

    def header(self) -> list[str]:
        """Comment lines (without ``#``): what this is, the generation, notes, warnings, errors."""
        gen = "unknown (no daemon: health unknown)" if self.generation is None else str(self.generation)
        first = (f"linkpass NCCL environment: host={self.host or '-'} "
                 f"generation={self.generation if self.generation is not None else '-'} "
                 f"gpu={'all' if self.gpu is None else self.gpu} "
                 f"nccl={self.nccl_version}{' (assumed)' if self.nccl_version_assumed else ''}")
        head = [first, f"plan generation {gen}"]
        head += [f"ERROR: {e}" for e in self.errors]
        head += [f"warning: {w}" for w in self.source_warnings + self.warnings]
        head += [f"note: {n}" for n in self.notes]
        return [h.replace("\n", " ") for h in head]

    def render(self, fmt: str) -> str:
        """The environment as text: ``shell`` (``export K='V'``), ``env-file`` (``K=V``, for
        systemd ``EnvironmentFile=`` and ``docker --env-file``) or ``json``.

        Raises:
            ValueError: unknown format, or a value an env-file cannot carry (a newline or quote).
        """
        if fmt == "json":
            return json.dumps(self.to_json(), indent=2) + "\n"
        if fmt not in ("shell", "env-file"):
            raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
        lines = [f"# {h}" for h in self.header()]
        for k, v in self.env.items():
            if fmt == "shell":
                lines.append(f"export {k}={_shell_quote(v)}")
            else:
                if not _SAFE_VALUE.match(v):
                    raise ValueError(f"{k}: value {v!r} has characters an env-file cannot carry")
                lines.append(f"{k}={v}")
        return "\n".join(lines) + "\n"


def _shell_quote(v: str) -> str:
    return "'" + v.replace("'", "'\\''") + "'"


def gpu_for_local_rank(local_rank: int, cuda_visible_devices: str | None, topo: Topology) -> int:
    """The GPU index (NVML/nvidia-smi numbering) a process of local rank ``local_rank`` uses,
    assuming it takes CUDA device ``local_rank`` as torchrun's launchers do.

    ``CUDA_VISIBLE_DEVICES`` (the launcher's value; None when unset) maps CUDA ordinals to GPUs:
    an integer entry is taken as the GPU index (exact when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which
    is how nvidia-smi numbers), a ``GPU-<uuid>`` entry (or a unique prefix) is matched against
    the GPUs' UUIDs (known only from NVML).

    Raises:
        NcclEnvError: negative rank, the rank has no entry in CUDA_VISIBLE_DEVICES, or a UUID
            entry matches no known GPU.
    """
    if local_rank < 0:
        raise NcclEnvError(f"local rank {local_rank}: must be 0 or more")
    if cuda_visible_devices is None:
        return local_rank
    items = [x.strip() for x in cuda_visible_devices.split(",") if x.strip()]
    if local_rank >= len(items):
        raise NcclEnvError(f"local rank {local_rank}: CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} makes only "
                           f"{len(items)} GPU(s) visible")
    item = items[local_rank]
    if item.isdigit():
        return int(item)
    hits = [g for g in topo.gpus if g.uuid and g.index is not None and (g.uuid == item or g.uuid.startswith(item))]
    if len(hits) != 1:
        raise NcclEnvError(f"local rank {local_rank}: CUDA_VISIBLE_DEVICES entry {item!r} "
                           f"{'matches no known GPU UUID (NVML gives them)' if not hits else 'matches several GPUs'}")
    return hits[0].index  # type: ignore[return-value]


# ---------------------------------------------------------------------- the computation


@dataclass
class _PortView:
    """One port of a compute HCA (``port`` None: the source lists no port, so the entry names the
    whole HCA, which NCCL reads as "all its ports")."""

    nic: Nic
    port: Port | None
    netdev: str | None
    healthy: bool
    why: str
    rail: RailHealth | None

    @property
    def entry(self) -> str:
        return self.nic.name if self.port is None else f"{self.nic.name}:{self.port.port}"

    @property
    def state(self) -> str:
        return "UNKNOWN" if self.port is None else self.port.state


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", name))


def _is_hca(n: Nic) -> bool:
    """An RDMA device NCCL can name in NCCL_IB_HCA (not a plain netdev's PCI function)."""
    return n.kind != "ethernet" and not n.vanished and norm_bus_id(n.name) != n.name


def _link_ok(topo: Topology, dev: str | None) -> tuple[bool, str]:
    info = topo.links.get(dev or "")
    if not info:
        return True, ""
    if not info.get("carrier", True):
        return False, f"{dev} has no carrier"
    if str(info.get("operstate", "UP")).upper() not in ("UP", "UNKNOWN"):
        return False, f"{dev} operstate {info.get('operstate')}"
    return True, ""


def _port_netdev(n: Nic, p: Port | None) -> str | None:
    if p is not None and p.netdev:
        return p.netdev
    return n.netdevs[0] if len(n.ports) <= 1 and n.netdevs else None


def _pick_gpu(topo: Topology, gpu: int | None, res: NcclEnv) -> Gpu | None:
    if gpu is None:
        return None
    if gpu < 0:
        raise NcclEnvError(f"GPU {gpu}: must be 0 or more")
    if not topo.gpus:
        res.warnings.append(f"GPU {gpu} asked for, but no GPU is known on this host (no NVIDIA GPU or driver, or the "
                            "captured files list none): NICs are listed in rail order")
        return None
    if any(g.index is not None for g in topo.gpus):
        g = next((g for g in topo.gpus if g.index == gpu), None)
        if g is None:
            known = ", ".join(str(g.index) for g in topo.gpus if g.index is not None)
            raise NcclEnvError(f"GPU {gpu}: not on this host (GPU indexes: {known})")
        return g
    ordered = sorted(topo.gpus, key=lambda g: g.pci_bus_id or "")
    if gpu >= len(ordered):
        raise NcclEnvError(f"GPU {gpu}: this host has {len(ordered)} GPU(s)")
    res.notes.append(f"GPU indexes are unknown (no NVML): GPU {gpu} is taken as GPU number {gpu} (from 0) in PCI bus order "
                     f"({ordered[gpu].pci_bus_id}), which is CUDA's numbering only with CUDA_DEVICE_ORDER=PCI_BUS_ID")
    return ordered[gpu]


def _roce(p: Port | None) -> bool | None:
    """True for RoCE, False for InfiniBand, None when the source does not say."""
    if p is None:
        return None
    if p.link_layer == "Ethernet":
        return True
    if p.link_layer == "InfiniBand":
        return False
    if any(g.type and "roce v2" in g.type.lower() for g in p.gids):
        return True
    return None


def _v4_of_gid(gid: str) -> str | None:
    m = _V4_MAPPED.match(gid.lower())
    if not m:
        return None
    raw = bytes.fromhex(m.group(1) + m.group(2))
    return ".".join(str(x) for x in raw)


def roce_v2_gid_index(p: Port, addresses: list[str]) -> tuple[int | None, str]:
    """Index of the RoCE v2 GID holding the netdev's IPv4 address: ``(index, "")`` or
    ``(None, why)``.  ``addresses`` are the netdev's ``a.b.c.d/len`` (empty: unknown, then the
    only RoCE v2 IPv4 GID is taken)."""
    v2 = [(g.index, _v4_of_gid(g.gid)) for g in p.gids if g.type and "roce v2" in g.type.lower()]
    v2 = [(i, a) for i, a in v2 if a is not None]
    mine = [a.split("/")[0] for a in addresses if "." in a]
    if mine:
        hit = sorted(i for i, a in v2 if a in mine)
        if hit:
            return hit[0], ""
        return None, (f"no RoCE v2 GID holds its address {', '.join(mine)}"
                      + (f" (RoCE v2 IPv4 GIDs: {', '.join(f'{i}={a}' for i, a in sorted(v2))})" if v2 else ""))
    if len(v2) == 1:
        return v2[0][0], ""
    if not p.gids:
        return None, "its GID table is not in the source"
    if not v2:
        return None, "its GID table has no RoCE v2 GID with an IPv4 address"
    return None, f"its address is unknown and it has several RoCE v2 IPv4 GIDs ({', '.join(f'{i}={a}' for i, a in sorted(v2))})"


def compute(topo: Topology | None, health: Health | None = None, gpu: int | None = None,
            options: NcclOptions = NcclOptions(), host: str = "") -> NcclEnv:
    """The NCCL environment for a process on this host.

    Args:
        topo: the analysed topology (roles and rails filled); None or empty: nothing is known
            about RDMA devices (NCCL_IB_HCA is then left out with a note).
        health: the daemon's rails; None: no daemon, health comes from the port states and link
            facts in ``topo``.
        gpu: GPU index (NVML numbering; PCI bus order when no index is known) the process uses;
            None: a host-wide environment (every healthy compute port, in rail order).
        options: see :class:`NcclOptions`.
        host: the host name to report.

    Returns:
        :class:`NcclEnv`.  Its ``errors`` is non-empty when the host has compute ports but none is
        healthy (NCCL_IB_HCA is then left out: an unset or empty value means "all devices").

    Raises:
        NcclEnvError: ``gpu`` is not a GPU of this host.
    """
    topo = topo or Topology()
    version = options.nccl_version or ASSUMED_NCCL_VERSION
    res = NcclEnv(generation=health.generation if health else None, health_known=health is not None, gpu=gpu,
                  host=host or topo.host, nccl_version=version_text(version), nccl_version_assumed=options.nccl_version is None)
    g = _pick_gpu(topo, gpu, res)
    by_dev = {r.netdev: r for r in health.rails} if health else {}

    # ---- every port of every compute HCA, with its health
    hca_nics = sorted((n for n in topo.nics if n.role == "compute" and _is_hca(n)),
                      key=lambda n: (n.rail if n.rail is not None else 1 << 30, _natural(n.name)))
    views: list[_PortView] = []
    for n in hca_nics:
        for p in (n.ports or [None]):
            dev = _port_netdev(n, p)
            rail = by_dev.get(dev or "")
            state = "UNKNOWN" if p is None else p.state
            if rail is not None:
                ok, why = rail.usable, f"rail {rail.id} ({rail.netdev}) {rail.state or ('usable' if rail.usable else 'not usable')}"
            elif state in ("ACTIVE", "UNKNOWN"):
                ok, why = _link_ok(topo, dev)
            else:
                ok, why = False, f"port {state}"
            views.append(_PortView(n, p, dev, ok, why, rail))
    unknown = [v.entry for v in views if v.healthy and v.rail is None and v.state == "UNKNOWN"]
    if unknown:
        res.warnings.append(f"state unknown for {', '.join(unknown)} (the source does not say"
                            + ("; no port is listed, so the HCA is named without one, meaning all its ports" if any(v.port is None for v in views) else "")
                            + "); assumed usable")

    # ---- lost rails: a compute NIC with no healthy port, a daemon rail not usable
    lost: list[str] = []
    for n in hca_nics:
        mine = [v for v in views if v.nic is n]
        # a compute NIC (a GPU's nearest) none of whose ports is usable is a lost rail, whatever
        # the reason (a pulled cable polls like an uncabled port); a dead second port of a NIC
        # that still has a healthy one is only left out
        if mine and not any(v.healthy for v in mine):
            lost.append(f"rail {n.rail if n.rail is not None else '?'} ({n.name}: {'; '.join(v.why for v in mine)})")
    matched = {v.rail.netdev for v in views if v.rail}
    for r in (health.rails if health else ()):
        if r.netdev not in matched and not r.usable:
            lost.append(f"rail {r.id} ({r.netdev}: {r.state or 'not usable'})")
    res.lost_rails = lost

    # ---- NCCL_IB_HCA
    near = list(g.nearest_nics) if g is not None else []
    order = sorted(views, key=lambda v: (0 if v.nic.name in near else 1, near.index(v.nic.name) if v.nic.name in near else 0))
    healthy = [v for v in order if v.healthy]
    if g is not None and hca_nics:
        label = f"GPU {g.index if g.index is not None else gpu} ({g.pci_bus_id or '?'})"
        if not near:
            res.warnings.append(f"{label} has no local compute NIC (nearest path {g.nearest_path or 'NODE/SYS or unknown'}): "
                                "its network traffic crosses the CPU to reach any NIC")
        elif not any(v.healthy for v in views if v.nic.name in near):
            others = ", ".join(v.entry for v in healthy) or "none"
            res.warnings.append(f"{label}: its own NIC(s) {', '.join(near)} have no healthy port; its traffic goes through "
                                f"{others} (a longer PCIe path, shared with that NIC's own GPU)")
    if not hca_nics:
        res.notes.append("NCCL_IB_HCA not set: no RDMA compute NIC is known on this host (none found, or the emulated "
                         "fabric's veth rails)")
    elif not healthy:
        res.errors.append("no healthy compute port (" + "; ".join(f"{v.entry}: {v.why}" for v in views)
                          + "): NCCL_IB_HCA is left out, and NCCL would then use every RDMA device it finds, "
                          "including dead and non-compute ones; fix the rails or run this job elsewhere")
    else:
        entries = [v.entry for v in healthy]
        if len({v.nic.name for v in healthy}) > MAX_HCAS:
            keep = []
            for e in entries:
                if len({x.split(":")[0] for x in keep + [e]}) <= MAX_HCAS:
                    keep.append(e)
            res.warnings.append(f"{len({v.nic.name for v in healthy})} healthy HCAs; NCCL supports at most {MAX_HCAS}: "
                                f"left out {', '.join(e for e in entries if e not in keep)}")
            entries = keep
        res.hcas = entries
        res.env["NCCL_IB_HCA"] = "=" + ",".join(entries)
        for v in views:
            if not v.healthy:
                res.notes.append(f"{v.entry} left out: {v.why}")

    # ---- NCCL_IB_GID_INDEX (RoCE ports among the chosen)
    chosen = [v for v in healthy if v.entry in res.hcas]
    roce = [v for v in chosen if _roce(v.port)]
    if roce:
        idx: dict[int, list[str]] = {}
        bad: list[str] = []
        for v in roce:
            addrs = list(v.rail.addresses) if v.rail else list(topo.links.get(v.netdev or "", {}).get("addresses", []))
            i, why = roce_v2_gid_index(v.port, addrs)
            if i is None:
                bad.append(f"{v.entry} ({v.netdev or 'no netdev'}): {why}")
            else:
                idx.setdefault(i, []).append(v.entry)
        fallback = ("NCCL picks each device's GID itself (NCCL_IB_ADDR_FAMILY, NCCL_IB_ROCE_VERSION_NUM)"
                    if version >= DYNAMIC_GID_SINCE else f"NCCL {version_text(version)} then uses GID index 0, usually RoCE v1")
        if bad:
            res.warnings.append("NCCL_IB_GID_INDEX not set: " + "; ".join(bad) + f"; {fallback}")
        elif len(idx) > 1:
            res.warnings.append("NCCL_IB_GID_INDEX not set: the RoCE ports' IPv4 RoCE v2 GIDs sit at different indexes ("
                                + "; ".join(f"{i}: {', '.join(e)}" for i, e in sorted(idx.items())) + f") and NCCL takes one "
                                f"index for all; {fallback}")
        else:
            res.env["NCCL_IB_GID_INDEX"] = str(next(iter(idx)))

    # ---- NCCL_SOCKET_IFNAME: healthy rail netdevs with an address (or an unknown one)
    devs: list[tuple[str, bool, list[str] | None]] = []
    for v in order:
        if v.netdev:
            addrs = list(v.rail.addresses) if v.rail else topo.links.get(v.netdev, {}).get("addresses") if v.netdev in topo.links else None
            devs.append((v.netdev, v.healthy, addrs))
    for r in (health.rails if health else ()):
        if r.netdev not in matched:
            devs.append((r.netdev, r.usable, list(r.addresses)))
    seen: set[str] = set()
    for dev, ok, addrs in devs:
        if dev in seen:
            continue
        seen.add(dev)
        if not ok:
            continue
        if addrs is not None and not addrs:
            res.notes.append(f"{dev} left out of NCCL_SOCKET_IFNAME: it has no address")
            continue
        res.netdevs.append(dev)
    if res.netdevs:
        res.env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(res.netdevs)
    elif seen:
        res.warnings.append("NCCL_SOCKET_IFNAME not set: no rail netdev is healthy and addressed; NCCL chooses an "
                            "interface itself (it prefers ib*, avoids lo and docker*)")
    else:
        res.notes.append("NCCL_SOCKET_IFNAME not set: no rail netdev is known")

    # ---- NCCL_CROSS_NIC
    if not options.rails_joined_by_spine:
        res.env["NCCL_CROSS_NIC"] = "0"
        if lost:
            res.warnings.append("this host lost " + "; ".join(lost) + ". The rails are not joined by a spine "
                                "([nccl] rails_joined_by_spine = false), so a NIC on another rail cannot reach the peers' NIC "
                                "on the lost rail: NCCL traffic between this host and its peers on that rail fails "
                                "(ibv_modify_qp ... Connection timed out, NVIDIA/nccl#2013) unless every host of the job "
                                "leaves that rail out or the job runs without this host")
    else:
        res.env["NCCL_CROSS_NIC"] = "1" if lost else "2"
        if lost:
            res.notes.append("NCCL_CROSS_NIC=1: this host lost " + "; ".join(lost)
                             + "; the spine lets its other NICs reach the peers' NICs on that rail")

    # ---- NCCL's own IB port failover / recovery
    if options.ib_resiliency and res.hcas:
        if version >= PORT_FAILOVER_SINCE:
            # Only where failover can act: torch_hooks.guard reads NCCL_IB_RESILIENCY_PORT_FAILOVER=1
            # as "NCCL handles a dead port itself" and then skips its abort + exit 75, so a node
            # whose NICs have one healthy port each must not get it (it would wait out NCCL timeouts).
            fused = _fused_groups(chosen)
            targets = [v for v in chosen if v.nic.name in near] if near else chosen
            if any(len(fused.get(_physical(v.nic), ())) >= 2 for v in targets):
                res.env["NCCL_IB_RESILIENCY_PORT_FAILOVER"] = "1"
                if version >= PORT_RECOVERY_SINCE:
                    res.env["NCCL_IB_RESILIENCY_PORT_RECOVERY"] = "1"
            else:
                res.notes.append("NCCL's port failover acts only inside a fused NIC (two or more healthy ports of one "
                                 "physical NIC by default); " + ("this GPU's NIC has" if near else "the NICs here have")
                                 + " no second healthy port, so a dead link still ends its communicators (NVIDIA/nccl#2192); "
                                 "NCCL_IB_RESILIENCY_PORT_FAILOVER/_RECOVERY are left out, so the torch hook's abort "
                                 "and exit 75 stay in force")
        else:
            res.notes.append(f"NCCL {version_text(version)} has no IB port failover (NCCL_IB_RESILIENCY_PORT_FAILOVER "
                             f"needs {version_text(PORT_FAILOVER_SINCE)})")
    return res


def _physical(n: Nic) -> str:
    """The physical card of a NIC: its PCI bus id without the function (two PFs of one card
    share it); the NIC name when the bus id is unknown."""
    return n.pci_bus_id.rsplit(".", 1)[0] if n.pci_bus_id else n.name


def _fused_groups(views: list[_PortView]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in views:
        out.setdefault(_physical(v.nic), []).append(v.entry)
    return out


@dataclass(frozen=True)
class NcclContext:
    """What the daemon's NCCL environment file is computed from, besides the rails' health:
    built at the edge (``linkpass.adapters.nccl_file.context_for``: sysfs, the installed NCCL
    version) and handed to the engine, which computes the file per plan generation.

    Attributes:
        topology: this host's analysed topology (empty: no HCA known).
        options: see :class:`NcclOptions`.
        host: the host name written in the file's header.
    """

    topology: Topology
    options: NcclOptions
    host: str


def plan_env_file(ctx: NcclContext, rails: tuple[RailHealth, ...], generation: int) -> tuple[NcclEnv | None, str | None, str | None]:
    """The env file for plan ``generation``: ``(env, text, None)``, or ``(None, None, why)``
    when it cannot be computed or rendered.  Pure; never raises on content."""
    try:
        env = compute(ctx.topology, Health(rails, generation), None, ctx.options, ctx.host)
        return env, env.render("env-file"), None
    except (NcclEnvError, ValueError) as e:
        return None, None, f"cannot compute the NCCL environment for generation {generation}: {e}"
