"""Typed, validated daemon configuration (TOML).

The file is read with :mod:`tomllib` and validated with pydantic.  Every option is
documented on its field below and in ``deploy/linkpass.example.toml``.

Errors never surface as tracebacks: :func:`load_config` raises :class:`ConfigError`
whose message is one line naming the file, the field and what is wrong, e.g.::

    /etc/linkpass/linkpass.toml: rails[1].netdev: Field required

Example (what ``linkpass fabric up`` writes for host 0 of a two-host, two-rail fabric)::

    [daemon]
    host = "h0"
    mode = "host-ip"
    host_ip = "198.19.0.1"
    control_socket = "/run/linkpass/lp/h0.sock"
    notice_key_file = "/run/linkpass/lp/notice.key"

    [[rails]]
    id = 0
    netdev = "rail0"
    address = "198.18.0.1"

    [[peers]]
    name = "h1"
    host_ip = "198.19.0.2"
    rail_ips = { "0" = "198.18.0.2", "1" = "198.18.1.2" }
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

#: Routing protocol number that tags every route linkpass installs (``ip route ... proto 201``).
#: Linux reserves 0-4 for the kernel; iproute2's rt_protos names numbers up to 192; 201 is unnamed.
DEFAULT_ROUTE_PROTOCOL = 201
DEFAULT_CONTROL_SOCKET = "/run/linkpass/linkpass.sock"
DEFAULT_NOTICE_PORT = 7471
DEFAULT_NCCL_ENV_FILE = "/run/linkpass/nccl.env"


def _ip_from_text(v: object) -> object:
    if not isinstance(v, str):
        raise ValueError(f"must be an IPv4 address in quotes, got {type(v).__name__} {v!r}")
    return v


#: An IPv4 address written as a TOML string ("198.18.0.1"); numbers are refused, not converted.
IPv4 = Annotated[ipaddress.IPv4Address, BeforeValidator(_ip_from_text)]


class ConfigError(Exception):
    """A configuration file is missing, unreadable or invalid.

    ``str(err)`` is a single line: ``<file>: <field>: <what is wrong>``.
    """


def _finite_number(v):
    """TOML numbers only (an int is fine), never a string or a boolean, never NaN or infinity."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v!r}")
    return float(v)


#: A float option: int or float in TOML; strings, booleans, nan and inf are refused.
FiniteFloat = Annotated[float, BeforeValidator(_finite_number)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaemonSection(_Strict):
    """The ``[daemon]`` table."""

    host: str = Field(min_length=1, max_length=64, description="This host's name, as peers know it.")
    mode: Literal["host-ip", "per-rail-ip"] = Field(
        "host-ip",
        description="host-ip: one host address, routes to peers' host IPs over all healthy rails. "
        "per-rail-ip: each rail has its own subnet; a failed rail's peer addresses are carried "
        "by /32 routes over a healthy rail.",
    )
    host_ip: IPv4 | None = Field(None, description="Host IP (required in host-ip mode).")
    reroute: Literal["kernel", "notify-only"] = Field(
        "kernel",
        description="kernel: install the planned routes. notify-only: the engine still plans and "
        "torch hooks still get every notice, but no kernel route is changed (the hooks move the "
        "job's traffic by rebuilding its process group).",
    )
    control_socket: str = Field(DEFAULT_CONTROL_SOCKET, description="Unix socket for `linkpass status`.")
    route_protocol: StrictInt = Field(DEFAULT_ROUTE_PROTOCOL, ge=5, le=255, description="rtm_protocol tag of our routes.")
    route_table: StrictInt = Field(254, ge=1, le=2**31 - 1, description="Routing table for our routes (254 = main).")
    route_metric: StrictInt = Field(0, ge=0, le=2**32 - 1, description="Metric (priority) of our routes.")
    hold_down_ms: StrictInt = Field(2000, ge=0, le=3_600_000, description="A rail that comes back is used again only after staying up this long.")
    notice_port: StrictInt = Field(DEFAULT_NOTICE_PORT, ge=1, le=65535, description="UDP port for peer notices.")
    notice_key_file: str | None = Field(None, description="File (mode 0600) holding the shared HMAC key for peer notices.")
    notice_refresh_ms: StrictInt = Field(1000, ge=50, le=600_000, description="Period of the full-state notice sent to every peer.")
    netlink_rcvbuf_bytes: StrictInt = Field(4 * 1024 * 1024, ge=4096, le=1 << 30, description="SO_RCVBUF of the netlink event socket; "
                                      "an overflow (ENOBUFS) loses events and forces a resync from a dump.")
    ignore_routes_with_linkdown: StrictBool = Field(True, description="Set net.ipv4.conf.<rail>.ignore_routes_with_linkdown=1 "
                                              "on every rail netdev, so the kernel itself stops choosing a nexthop "
                                              "whose carrier is gone in the milliseconds before linkpass replaces the routes.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _host_ip_for_mode(self) -> "DaemonSection":
        if self.mode == "host-ip" and self.host_ip is None:
            raise ValueError("host_ip: required when mode = \"host-ip\"")
        return self


class RailSection(_Strict):
    """One ``[[rails]]`` entry: a rail id and the netdev that serves it on this host."""

    id: StrictInt = Field(ge=0, le=65535)
    netdev: str = Field(min_length=1, max_length=15)
    address: IPv4 | None = Field(None, description="This host's address on the rail (per-rail-ip mode).")


class PeerSection(_Strict):
    """One ``[[peers]]`` entry: another host of the job and its addresses."""

    name: str = Field(min_length=1, max_length=64)
    host_ip: IPv4 | None = None
    rail_ips: dict[int, IPv4] = Field(description="Rail id -> the peer's address on that rail.")

    @field_validator("rail_ips")
    @classmethod
    def _non_empty(cls, v: dict[int, IPv4]) -> dict[int, IPv4]:
        if not v:
            raise ValueError("must name the peer's address on at least one rail")
        return v


class ProbeSection(_Strict):
    """The ``[probe]`` table: active per-rail probing for gray failures (carrier up, traffic lost)."""

    enabled: StrictBool = Field(True, description="Probe peers over every rail.")
    port: StrictInt = Field(7472, ge=1, le=65535, description="UDP port of the probe responder.")
    interval_ms: StrictInt = Field(10, ge=1, le=60_000, description="Fast-set probe interval per path (BFD: desired min TX).")
    detect_multiplier: StrictInt = Field(3, ge=1, le=255, description="A path is DOWN after this many misses in a row and no reply for this many intervals (BFD: detect mult).")
    fast_peers: StrictInt = Field(2, ge=0, le=1024, description="Peers per rail probed at the fast interval (hook-registered peers first, then ring neighbours).")
    slow_interval_ms: StrictInt = Field(1000, ge=10, le=600_000, description="Interval at which the other peers are swept.")
    max_pps: StrictInt = Field(2000, ge=1, le=1_000_000, description="Upper bound on probes sent per second by this host, whatever the peer count.")
    rail_down_share: FiniteFloat = Field(0.5, gt=0, le=1, description="A rail fails when more than this share of its answering peers are DOWN.")
    loss_window_ms: StrictInt = Field(2000, ge=100, le=600_000, description="Window for the loss ratio of a rail.")
    degraded_loss: FiniteFloat = Field(0.1, gt=0, le=1, description="Loss ratio over the window that marks a rail DEGRADED.")


class DampingSection(_Strict):
    """The ``[damping]`` table: flap damping per rail (the RFC 2439 idea)."""

    enabled: StrictBool = Field(True, description="Damp flapping rails (RFC 2439 idea).")
    penalty: StrictInt = Field(1000, ge=1, le=1_000_000, description="Penalty added per down event.")
    half_life_ms: StrictInt = Field(15_000, ge=100, le=3_600_000, description="Penalty halves every half-life.")
    suppress: StrictInt = Field(2500, ge=1, le=10_000_000, description="Above this penalty the rail stays out of use.")
    reuse: StrictInt = Field(800, ge=1, le=10_000_000, description="A suppressed rail is used again once the penalty decays below this.")
    max_penalty: StrictInt = Field(8000, ge=1, le=100_000_000, description="Penalty ceiling (bounds the longest suppression).")

    @model_validator(mode="after")
    def _limits(self) -> "DampingSection":
        if not self.reuse < self.suppress:
            raise ValueError(f"reuse: must be below suppress ({self.reuse} >= {self.suppress})")
        if not self.suppress <= self.max_penalty:
            raise ValueError(f"max_penalty: must be at least suppress ({self.max_penalty} < {self.suppress}), "
                             "or the rail could never be suppressed")
        return self


class TopologySection(_Strict):
    """The ``[topology]`` table: take rails and peers from discovery instead of spelling them out.

    With ``rails = "auto"`` the daemon reads the host's topology at start and on SIGHUP
    (``linkpass topology`` shows the same result): every compute NIC with a rail number becomes
    a rail, served by its port's netdev (the bond netdev for an RDMA bond), with that netdev's
    IPv4 address.  ``peers_file`` lists the job's hosts, one ``name host_ip`` per line (``#``
    starts a comment), e.g. generated from the scheduler's host list; a peer's address on rail
    k is rail k's subnet (from this host's address on it) with the host bits of the peer's
    host IP: the common layout where a host has the same host part on every rail.
    """

    rails: Literal["config", "auto"] = Field("config", description='"config": [[rails]] as written; "auto": from topology discovery.')
    sysfs_root: str = Field("/", description="Where discovery reads sysfs (a captured tree for tests).")
    peers_file: str | None = Field(None, description="File of `name host_ip` lines: the job's hosts (this host is skipped).")
    compute_nics: list[str] = Field(default_factory=list, description="NICs to treat as compute rails whatever discovery says.")
    exclude_nics: list[str] = Field(default_factory=list, description="NICs never to treat as compute rails.")


class NcclSection(_Strict):
    """The ``[nccl]`` table: the NCCL environment linkpass derives from the topology and rail
    health (``linkpass nccl-env``, ``linkpass exec``, and the file the daemon rewrites on every
    plan change).  See :mod:`linkpass.core.nccl_env` for what each variable is."""

    env_file: str = Field(DEFAULT_NCCL_ENV_FILE, min_length=1, description="File the daemon rewrites (atomically) "
                          "with the host-wide NCCL environment on every plan change (KEY=VALUE lines, usable as systemd "
                          "EnvironmentFile= and docker --env-file).")
    write_env_file: StrictBool = Field(True, description="Write env_file at all.")
    rails_joined_by_spine: StrictBool = Field(False, description="The rail switches are joined by a spine, so a NIC on one rail "
                                        "can reach a peer's NIC on another rail (decides NCCL_CROSS_NIC).")
    ib_resiliency: StrictBool = Field(True, description="Set NCCL's own IB port failover (NCCL >= 2.29.7) and port recovery "
                                "(>= 2.30) variables when the NCCL version has them.")
    version: str = Field("", description='NCCL version of the jobs, e.g. "2.29.7"; "" = detect it from the installed '
                         "nvidia-nccl-cu* Python package, else assume 2.30.0.")

    @field_validator("version")
    @classmethod
    def _version_shape(cls, v: str) -> str:
        if v and not re.match(r"^v?\d+\.\d+(\.\d+)?([-+][0-9A-Za-z.+-]*)?$", v.strip()):
            raise ValueError(f"must be MAJOR.MINOR[.PATCH] like \"2.29.7\" (or \"\" to detect), got {v!r}")
        return v.strip()


class HooksSection(_Strict):
    """The ``[hooks]`` table: the unix socket torch hooks (``torch_hooks.client``) connect to."""

    enabled: StrictBool = Field(True, description="Serve torch hooks.")
    socket: str | None = Field(None, description="Socket path; default: beside control_socket, "
                               "<name>.hooks.sock (/run/linkpass/linkpass.sock -> /run/linkpass/linkpass.hooks.sock).")
    max_clients: StrictInt = Field(1024, ge=1, le=65536, description="Connections beyond this are refused.")


class DeviceSection(_Strict):
    """The ``[device]`` table: live device evidence (issue 6, part 3).  Each source that cannot
    run here (no /dev/kmsg access, no GPU driver or nvidia-ml-py, no pyverbs or RDMA device) is
    off with one log line; the daemon runs without it."""

    kmsg: StrictBool = Field(True, description="Follow the kernel log and classify it (linkpass.core.classify).")
    kmsg_path: str = Field("/dev/kmsg", min_length=1, description="What to follow: /dev/kmsg, or a FIFO or a file that "
                           "is appended to with kmsg-style records (prio,seq,usec,flags;message) or plain log lines.")
    state_dir: str = Field("/var/lib/linkpass", min_length=1, description="Directory for the kmsg follower's last "
                           "sequence number (kmsg.state), so a restarted daemon resumes where it stopped; "
                           "unwritable = no resume (logged).")
    window_lines: StrictInt = Field(400, ge=10, le=100_000, description="Recent kernel-log lines kept so follow-on "
                                    "events (Xid 45, flush errors...) link to their root incident.")
    nvml: StrictBool = Field(True, description="Wait for NVML Xid events (nvidia-ml-py) when a GPU driver is present.")
    rdma: StrictBool = Field(True, description="Read RDMA async port events through pyverbs when it is installed.")


class Config(_Strict):
    """The whole validated configuration."""

    daemon: DaemonSection
    rails: list[RailSection] = Field(default_factory=list)
    peers: list[PeerSection] = Field(default_factory=list)
    topology: TopologySection = Field(default_factory=TopologySection)
    probe: ProbeSection = Field(default_factory=ProbeSection)
    damping: DampingSection = Field(default_factory=DampingSection)
    hooks: HooksSection = Field(default_factory=HooksSection)
    nccl: NcclSection = Field(default_factory=NcclSection)
    device: DeviceSection = Field(default_factory=DeviceSection)

    @property
    def auto(self) -> bool:
        """True when rails (and peers from peers_file) come from discovery at run time."""
        return self.topology.rails == "auto"

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        if self.topology.rails == "config" and not self.rails:
            raise ValueError('rails: at least one [[rails]] entry is required (or set [topology] rails = "auto")')
        if self.topology.rails == "auto" and self.rails:
            raise ValueError('rails: leave [[rails]] out when [topology] rails = "auto" (rails come from discovery)')
        ids = [r.id for r in self.rails]
        if len(set(ids)) != len(ids):
            raise ValueError(f"rails: duplicate rail id in {ids}")
        devs = [r.netdev for r in self.rails]
        if len(set(devs)) != len(devs):
            raise ValueError(f"rails: netdev used by two rails in {devs}")
        names = [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"peers: duplicate peer name in {names}")
        if self.daemon.host in names:
            raise ValueError(f"peers: this host ({self.daemon.host}) is listed as its own peer")
        for i, p in enumerate(self.peers):
            if self.daemon.mode == "host-ip" and p.host_ip is None:
                raise ValueError(f"peers[{i}].host_ip: required when mode = \"host-ip\"")
            unknown = sorted(set(p.rail_ips) - set(ids))
            if unknown and not self.auto:
                raise ValueError(f"peers[{i}].rail_ips: rail id(s) {unknown} are not in [[rails]]")
        if self.daemon.mode == "per-rail-ip":
            for i, r in enumerate(self.rails):
                if r.address is None:
                    raise ValueError(f"rails[{i}].address: required when mode = \"per-rail-ip\"")
        if self.hooks.enabled and self.hooks.socket and \
                os.path.normpath(self.hooks.socket) == os.path.normpath(self.daemon.control_socket):
            raise ValueError(f"hooks.socket: {self.hooks.socket} is also daemon.control_socket; the hooks socket needs a "
                             "path of its own (leave hooks.socket out for the default beside the control socket)")
        return self


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            out += " (key)"
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate TOML text.

    Args:
        text: the TOML document.
        source: the name used in error messages (usually the file path).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: one line ``<source>: <field>: <problem>``.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = _loc(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
            # cross-field checks name their field at the start of the message: "rails[1].address: ..."
            m = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", msg)
            if m:
                field = f"{field}.{m.group(1)}" if field else m.group(1)
                msg = m.group(2)
        field = field or "(top level)"
        more = f" (and {e.error_count() - 1} more problem(s))" if e.error_count() > 1 else ""
        raise ConfigError(f"{source}: {field}: {msg}{more}") from None


def load_config(path: str | Path) -> Config:
    """Read and validate a config file.

    Raises:
        ConfigError: missing or unreadable file, bad TOML, or invalid values; the message
            names the file and the field.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{p}: permission denied") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    return parse_config(text, str(p))


def read_key_file(path: str | Path) -> bytes:
    """Read the shared notice key.

    The file must be a regular file not readable or writable by group or others (mode 0600
    or stricter) and hold at least 16 bytes after stripping surrounding whitespace.

    Raises:
        ConfigError: naming the file and what is wrong.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{p}: notice key file does not exist") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot stat notice key file: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{p}: notice key file is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(f"{p}: notice key file has mode {st.st_mode & 0o777:04o}; it must be 0600 (no group/other access)")
    try:
        key = p.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read notice key file: {e.strerror}") from None
    if len(key) < 16:
        raise ConfigError(f"{p}: notice key is {len(key)} bytes; at least 16 are required")
    return key
