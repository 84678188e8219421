"""The configuration schema: every section and option, validated with pydantic.

Every option is documented on its field (``description=``; ``examples=`` gives the value the
example file shows, commented out unless the option is required or marked
``json_schema_extra=IN_EXAMPLE``); ``deploy/linkpass.toml.example`` is generated from it
(:func:`linkpass.cli.config.render_example`).  Validators raise ValueError with one-line
messages; :mod:`linkpass.config.problems` turns them into ``<file>: <field>: <problem>``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from linkpass.config.values import _got, _shown

#: Routing protocol number that tags every route linkpass installs (``ip route ... proto 201``).
#: Linux reserves 0-4 for the kernel; iproute2's rt_protos names numbers up to 192; 201 is unnamed.
DEFAULT_ROUTE_PROTOCOL = 201
DEFAULT_CONTROL_SOCKET = "/run/linkpass/linkpass.sock"
DEFAULT_NOTICE_PORT = 7471
#: SCHED_RR priority of the daemon's threads (linkpass/adapters/sched.py; 0: the normal policy)
REALTIME_PRIORITY_DEFAULT = 10
DEFAULT_NCCL_ENV_FILE = "/run/linkpass/nccl.env"
#: ``Field(..., examples=[v], json_schema_extra=IN_EXAMPLE)``: the generated example config sets this
#: optional option to ``v`` (for options that are required in the default mode, or recommended).
IN_EXAMPLE = {"in_example": True}
#: What ``daemon.host`` may be: a host-name-like word that is safe in MQTT topics and file names
#: (no ``/``, ``+``, ``#``, spaces), 1 to 64 characters.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _ip_from_text(v: object) -> object:
    if not isinstance(v, str):
        raise ValueError(f"must be an IPv4 address in quotes, got {_got(v)}")
    return v


#: An IPv4 address written as a TOML string ("198.18.0.1"); numbers are refused, not converted.
IPv4 = Annotated[ipaddress.IPv4Address, BeforeValidator(_ip_from_text)]


def _finite_number(v):
    """TOML numbers only (an int is fine), never a string or a boolean, never NaN or infinity."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, got {_got(v)}")
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {_shown(v)}")
    return float(v)


#: A float option: int or float in TOML; strings, booleans, nan and inf are refused.
FiniteFloat = Annotated[float, BeforeValidator(_finite_number)]


def _path_text(v):
    """A file path option: a non-blank string (a path of spaces creates files named so)."""
    if isinstance(v, str) and not v.strip():
        raise ValueError(f"must be a path, got {_shown(v)}")
    return v


#: A path option (socket, file, directory): a string that is not empty or blank.
PathText = Annotated[str, BeforeValidator(_path_text)]


class _Strict(BaseModel):
    """Base of every section: unknown keys are errors (``extra="forbid"``), values are frozen.

    Secrets only from files: no option takes a secret inline.  A secret is named by an option
    ending in ``_file`` (like ``notice_key_file``) and read from that file, which must be mode
    0600; an unknown key that looks like a secret (``password = ...``) is refused with a message
    saying so (:func:`_problem`), and tests/unit/test_config_cli.py checks the schema for it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


class DaemonSection(_Strict):
    """The ``[daemon]`` table."""

    host: str = Field(min_length=1, max_length=64, examples=["gpu-node-07"], description="This host's name, as peers know it: "
                      "letters, digits, \".\", \"-\" and \"_\", starting with a letter or digit (it names this host's MQTT "
                      "topics).")
    mode: Literal["host-ip", "per-rail-ip"] = Field(
        "host-ip",
        description="host-ip: one host address, routes to peers' host IPs over all healthy rails. "
        "per-rail-ip: each rail has its own subnet; a failed rail's peer addresses are carried "
        "by /32 routes over a healthy rail.",
    )
    host_ip: IPv4 | None = Field(None, examples=["198.19.0.7"], json_schema_extra=IN_EXAMPLE,
                                 description="Host IP (required in host-ip mode).")
    reroute: Literal["kernel", "notify-only"] = Field(
        "kernel",
        description="kernel: install the planned routes. notify-only: the engine still plans and "
        "torch hooks still get every notice, but no kernel route is changed (the hooks move the "
        "job's traffic by rebuilding its process group).",
    )
    control_socket: PathText = Field(DEFAULT_CONTROL_SOCKET, min_length=1, description="Unix socket for `linkpass status`.")
    route_protocol: StrictInt = Field(DEFAULT_ROUTE_PROTOCOL, ge=5, le=255, description="rtm_protocol tag of our routes.")
    route_table: StrictInt = Field(254, ge=1, le=2**31 - 1, description="Routing table for our routes (254 = main).")
    route_metric: StrictInt = Field(0, ge=0, le=2**32 - 1, description="Metric (priority) of our routes.")
    hold_down_ms: StrictInt = Field(2000, ge=0, le=3_600_000, description="A rail that comes back is used again only after staying up this long.")
    notice_port: StrictInt = Field(DEFAULT_NOTICE_PORT, ge=1, le=65535, description="UDP port for peer notices.")
    notice_key_file: str | None = Field(None, examples=["/etc/linkpass/notice.key"], json_schema_extra=IN_EXAMPLE,
                                        description="File (mode 0600) holding "
                                        "the shared HMAC key for peer notices and probes (unset: both are off).")
    notice_refresh_ms: StrictInt = Field(1000, ge=50, le=600_000, description="Period of the full-state notice sent to every peer (over one usable rail at a time, in turn; urgent notices go over every usable rail).")
    notice_refresh_max_pps: StrictInt = Field(2000, ge=1, le=1_000_000, description="Most refresh datagrams a second this host sends; every host sends one to each peer per period, so this is also about what each host receives and verifies. With more peers than this x notice_refresh_ms / 1000 the refresh period grows to peers / this (seconds): 8.2 s at 16,384 hosts. Urgent notices are not capped.")
    netlink_rcvbuf_bytes: StrictInt = Field(4 * 1024 * 1024, ge=4096, le=1 << 30, description="SO_RCVBUF of the netlink event socket; "
                                      "an overflow (ENOBUFS) loses events and forces a resync from a dump.")
    ignore_routes_with_linkdown: StrictBool = Field(True, description="Set net.ipv4.conf.<rail>.ignore_routes_with_linkdown=1 "
                                              "on every rail netdev, so the kernel itself stops choosing a nexthop "
                                              "whose carrier is gone in the milliseconds before linkpass replaces the routes.")
    nexthop_objects: StrictBool = Field(False, description="Install each peer route as a route to a kernel nexthop group "
                                        "(`ip nexthop`, Linux >= 5.3) instead of inline nexthops: a plan change is one atomic "
                                        "group replace, and the kernel itself removes a rail's nexthop from every group when its "
                                        "netdev loses carrier (bench/README.md, kernel_reroute).")
    nexthop_id_base: StrictInt = Field(0x4C500000, ge=1, le=2**32 - 1 - 65536, description="First id of the 65536 nexthop object "
                                       "ids linkpass owns (with route_protocol as their protocol); ids held by anything else are skipped.")
    realtime_priority: StrictInt = Field(REALTIME_PRIORITY_DEFAULT, ge=0, le=99, description="Run every thread of the daemon "
                                         "under SCHED_RR at this priority (1-99; 0: the normal policy), so busy threads on the "
                                         "host cannot delay probes into false losses (needs CAP_SYS_NICE; without it the daemon "
                                         "runs on at the normal policy and says so in status).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level (`linkpass run --log-level` overrides it).")

    @field_validator("host")
    @classmethod
    def _host_name(cls, v: str) -> str:
        if not HOST_NAME.fullmatch(v):
            raise ValueError("must be a host name: letters, digits, \".\", \"-\" and \"_\", starting with a letter or "
                             f"digit, at most 64 characters (it is part of MQTT topics), got {_shown(v)}")
        return v

    @model_validator(mode="after")
    def _host_ip_for_mode(self) -> "DaemonSection":
        if self.mode == "host-ip" and self.host_ip is None:
            raise ValueError("host_ip: required when mode = \"host-ip\"")
        return self


class RailSection(_Strict):
    """One ``[[rails]]`` entry: a rail id and the netdev that serves it on this host."""

    id: StrictInt = Field(ge=0, le=65535, examples=[0], description="Rail number, the same on every host of the job.")
    netdev: str = Field(min_length=1, max_length=15, examples=["ens1f0np0"], description="Netdev that serves this rail on this host.")
    address: IPv4 | None = Field(None, examples=["198.18.0.7"], description="This host's address on the rail (required in per-rail-ip mode).")


class PeerSection(_Strict):
    """One ``[[peers]]`` entry: another host of the job and its addresses."""

    name: str = Field(min_length=1, max_length=64, examples=["gpu-node-08"], description="The peer's host name (its daemon.host).")
    host_ip: IPv4 | None = Field(None, examples=["198.19.0.8"], json_schema_extra=IN_EXAMPLE,
                                 description="The peer's host IP (required in host-ip mode).")
    rail_ips: dict[int, IPv4] = Field(examples=[{0: "198.18.0.8"}], description="Rail id -> the peer's address on that rail.")

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
    datapath: Literal["auto", "c", "python"] = Field("auto", description='Probe datagram path: "c" (linkpass.adapters._probe_io, built by '
                                                     'make install: reads, MAC checks and sends in C, and answers requests on a '
                                                     'thread of its own, off the event loop), "python", or "auto" (c when built, '
                                                     'else python). "c" where the module was not built: the daemon does not start. '
                                                     'Decisions are the same on both.')
    rail_down_share: FiniteFloat = Field(0.5, gt=0, le=1, description="A rail fails when more than this share of its answering peers are DOWN.")
    loss_window_ms: StrictInt = Field(2000, ge=100, le=600_000, description="Window for the loss ratio of a rail.")
    degraded_loss: FiniteFloat = Field(0.1, gt=0, le=1, description="Loss ratio over the window that marks a rail DEGRADED.")
    healthy_loss: FiniteFloat = Field(0.04, gt=0, lt=1, description="Per-probe (round-trip) loss of a healthy path: H0 of the "
                                      "sequential lossy test (0.04: 2 % lost in each direction).")
    lossy_loss: FiniteFloat = Field(0.3, gt=0, lt=1, description="Per-probe loss of a path to leave: H1 of the lossy test; a "
                                    "rail whose paths lose this much goes DOWN like a dead one (Page's CUSUM of Wald's SPRT).")
    lossy_alpha: FiniteFloat = Field(1e-6, gt=0, le=0.01, description="Bound on the lossy test's false alarms per probe at "
                                     "healthy_loss (threshold ln(1/alpha); 1e-6: at most 0.06 per path in 10 min at 100 probes/s).")
    lossy_clear_alpha: FiniteFloat = Field(1e-3, gt=0, le=0.1, description="Bound on a lossy path's wrong clears per probe at "
                                           "lossy_loss (recovery needs ln(1/alpha) of evidence: 22 answers in a row at 1e-3).")

    @model_validator(mode="after")
    def _loss_order(self) -> "ProbeSection":
        if not self.healthy_loss < self.lossy_loss:
            raise ValueError(f"lossy_loss: must be above healthy_loss ({self.lossy_loss} <= {self.healthy_loss})")
        return self


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

    env_file: PathText = Field(DEFAULT_NCCL_ENV_FILE, min_length=1, description="File the daemon rewrites (atomically) "
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
            raise ValueError(f"must be MAJOR.MINOR[.PATCH] like \"2.29.7\" (or \"\" to detect), got {_shown(v)}")
        return v.strip()


class HooksSection(_Strict):
    """The ``[hooks]`` table: the unix socket torch hooks (``torch_hooks.client``) connect to."""

    enabled: StrictBool = Field(True, description="Serve torch hooks.")
    socket: str | None = Field(None, description="Socket path; default: beside control_socket, "
                               "<name>.hooks.sock (/run/linkpass/linkpass.sock -> /run/linkpass/linkpass.hooks.sock).")
    max_clients: StrictInt = Field(1024, ge=1, le=65536, description="Connections beyond this are refused.")


#: ``[snapshot] every_steps`` and ``--snapshot-every`` at most: ten million optimizer steps, beyond
#: the longest training runs (an interval no run reaches is "never", and 0 says that)
SNAPSHOT_MAX_EVERY_STEPS = 10_000_000
#: ``[snapshot] keep`` and ``--snapshot-keep`` at most (each one is a full copy of the job's state)
SNAPSHOT_MAX_KEEP = 1000


class SnapshotSection(_Strict):
    """The ``[snapshot]`` table: step-aligned snapshots the torch hook takes of a job started with
    ``linkpass exec --config`` (``torch_hooks/snapshot.py``).  The daemon does not read it:
    ``linkpass exec`` passes it to the hook as ``LINKPASS_SNAPSHOT_EVERY``/``_DIR``/``_KEEP``, and
    checks ``dir`` (a directory, or one it can create, that it can write) before it starts the job."""

    every_steps: StrictInt = Field(0, ge=0, le=SNAPSHOT_MAX_EVERY_STEPS, description="A snapshot after every this many "
                                   "optimizer steps (0: only on request, `linkpass snapshot --job JOB`; at most "
                                   f"{SNAPSHOT_MAX_EVERY_STEPS}).")
    dir: str = Field("", description="Where snapshots go: an absolute path (a config file is read from any working "
                     "directory), a directory every host of the job sees (a shared file system). Empty: "
                     "linkpass-snapshots in each worker's working directory.")
    keep: StrictInt = Field(3, ge=0, le=SNAPSHOT_MAX_KEEP, description="Complete snapshots kept in dir (the newest; 0: "
                            f"all; at most {SNAPSHOT_MAX_KEEP}).")
    in_memory: StrictBool = Field(False, description="In-memory snapshots (torch_hooks/memsnap.py): each rank keeps "
                                  "its part of the newest two in host memory (tmpfs) and a copy on a peer host, so a "
                                  "sharded (FSDP2) rank whose GPU fails goes to a warm spare and the job redoes only the "
                                  "steps since the snapshot. Host memory: about 4 times a rank's state.")
    memory_every_steps: StrictInt = Field(10, ge=1, le=10_000_000, description="An in-memory snapshot after every "
                                          "this many optimizer steps (each costs a copy of the rank's state to CPU "
                                          "memory at the step boundary).")

    @field_validator("dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if v and not v.strip():
            raise ValueError(f"must be a path, got {_shown(v)}")
        if v and not os.path.isabs(v):
            raise ValueError(f"must be an absolute path (a relative one would depend on the directory linkpass exec "
                             f"runs in), got {_shown(v)}")
        return v


#: domain:bus:device.function as lspci -D and NVML print it (domain 4 to 8 hex digits).
_PCI_BUS_ID = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


class DeviceSection(_Strict):
    """The ``[device]`` table: live device evidence (issue 6, part 3).  Each source that cannot
    run here (no /dev/kmsg access, no GPU driver or nvidia-ml-py, no pyverbs or RDMA device) is
    off with one log line; the daemon runs without it."""

    kmsg: StrictBool = Field(True, description="Follow the kernel log and classify it (linkpass.core.classify).")
    kmsg_path: PathText = Field("/dev/kmsg", min_length=1, description="What to follow: /dev/kmsg, or a FIFO or a file that "
                           "is appended to with kmsg-style records (prio,seq,usec,flags;message) or plain log lines.")
    state_dir: PathText = Field("/var/lib/linkpass", min_length=1, description="Directory for the kmsg follower's last "
                           "sequence number (kmsg.state), so a restarted daemon resumes where it stopped; "
                           "unwritable = no resume (logged).")
    window_lines: StrictInt = Field(400, ge=10, le=100_000, description="Recent kernel-log lines kept so follow-on "
                                    "events (Xid 45, flush errors...) link to their root incident.")
    nvml: StrictBool = Field(True, description="Wait for NVML Xid events (nvidia-ml-py) when a GPU driver is present.")
    rdma: StrictBool = Field(True, description="Read RDMA async port events through pyverbs when it is installed.")
    gpus: dict[str, StrictInt] = Field(default_factory=dict, max_length=256, description="PCI bus id -> GPU index "
                                       "(NVML's), for a host where NVML does not run and the discovered topology does "
                                       "not list the GPUs: tells which hook client a kernel-log Xid concerns. "
                                       "Keys like \"0000:18:00.0\"; NVML and the topology win when they know the GPU.")

    @field_validator("gpus")
    @classmethod
    def _bus_ids(cls, v: dict[str, int]) -> dict[str, int]:
        """Every bad entry in one message (``; ``-joined): keys that are not bus ids, indexes out
        of range, one bus id spelled twice (case), one index given to two bus ids."""
        out: dict[str, int] = {}
        spelled: dict[str, str] = {}
        owner: dict[int, str] = {}
        bad = []
        for bus, idx in v.items():
            if not _PCI_BUS_ID.fullmatch(bus):
                bad.append(f"key {_shown(bus)} is not a PCI bus id like \"0000:18:00.0\"")
                continue
            if not 0 <= idx < 1024:
                bad.append(f"GPU index for {bus} must be in 0..1023, got {idx}")
                continue
            key = bus.lower()
            if key in spelled:
                bad.append(f"{spelled[key]} and {bus} are the same bus id")
                continue
            if idx in owner:
                bad.append(f"GPU index {idx} is given to both {owner[idx]} and {bus}")
                continue
            spelled[key], owner[idx], out[key] = bus, bus, idx
        if bad:
            raise ValueError("; ".join(bad))
        return out


class RiskSection(_Strict):
    """The ``[risk]`` table: counter trends that drain a rail or move a GPU's rank before the
    hardware fails (linkpass.core.risk: rules, thresholds and their sources)."""

    enabled: StrictBool = Field(True, description="Poll RDMA port, netdev, PCIe AER, optics and NVML counters and act "
                                "on rails and GPUs at risk.")
    poll_interval_s: FiniteFloat = Field(1.0, ge=0.05, le=3600, description="Seconds between polls of every counter.")
    clean_hold_s: FiniteFloat = Field(600.0, ge=0, le=7 * 86400, description="Seconds a rail or GPU at risk must stay "
                                      "clean (no rule in breach, its counter not rising) before it is used again.")
    deadline_s: FiniteFloat = Field(2.0, gt=0, le=60, description="The most one poll waits for its reads; a read that "
                                    "takes longer is a timeout (one warning) and is skipped until it returns.")
    sysfs_root: PathText = Field("/", min_length=1, description="Where sys/ is read from (\"/\" live; a captured or "
                                 "emulated tree for tests and the emulated fabric).")
    nvml: StrictBool = Field(True, description="Read GPU counters through NVML (nvidia-ml-py) when a driver is present.")


DEFAULT_METRICS_PORT = 9472


class MetricsSection(_Strict):
    """The ``[metrics]`` table: the Prometheus endpoint (``GET /metrics``; linkpass.adapters.metrics)."""

    enabled: StrictBool = Field(True, description="Serve Prometheus metrics over HTTP.")
    address: str = Field("127.0.0.1", description="IP address to listen on (\"0.0.0.0\" or \"::\" for every interface).")
    port: StrictInt = Field(DEFAULT_METRICS_PORT, ge=1, le=65535, description="TCP port of the metrics endpoint.")

    @field_validator("address")
    @classmethod
    def _ip_literal(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"must be an IPv4 or IPv6 address like \"127.0.0.1\", got {_shown(v)}") from None
        return v


DEFAULT_MQTT_PREFIX = "linkpass/v1/{host}/"
DEFAULT_OUTBOX_PATH = "/var/lib/linkpass/outbox.sqlite"


class MqttSection(_Strict):
    """The ``[mqtt]`` table: alerts to an MQTT broker (linkpass.adapters.mqtt; topics and payloads
    in deploy/asyncapi.yaml).  Events go through a durable outbox first, so none is lost while
    the broker is away or the daemon restarts.  MQTT trouble (broker down, wrong password, bad
    TLS files) is logged once and never stops the daemon."""

    enabled: StrictBool = Field(False, description="Publish alerts, state and topology to an MQTT broker.")
    host: str = Field("127.0.0.1", min_length=1, max_length=253, examples=["mqtt.example.net"],
                      description="Broker host name or IP address.")
    port: StrictInt = Field(1883, ge=1, le=65535, description="Broker TCP port (8883 is the usual one for TLS).")
    prefix: str = Field(DEFAULT_MQTT_PREFIX, min_length=1, max_length=200, description="Topic prefix; it must contain "
                        "\"{host}\", which is replaced by daemon.host (so each host has topics of its own); the topics are "
                        "<prefix>status, state, topology and events.")
    client_id: str = Field("", max_length=128, description="MQTT client id; \"\" = \"linkpass-<daemon.host>\".")
    protocol: Literal["auto", "5", "3.1.1"] = Field("auto", description="MQTT version: auto = 5 (message expiry, user "
                                                    "properties), falling back to 3.1.1 when the broker refuses 5.")
    keepalive_s: StrictInt = Field(30, ge=5, le=65535, description="MQTT keepalive; a dead broker is noticed within 1.5 x this.")
    qos: Literal[1, 2] = Field(1, description="QoS of events and retained messages (an event leaves the outbox only "
                               "when the broker acknowledged it).")
    message_expiry_s: StrictInt = Field(86400, ge=0, le=2**32 - 1, description="MQTT 5 message expiry of events at the "
                                        "broker (0 = never expire); retained status, state and topology never expire.")
    tls: StrictBool = Field(False, description="Connect with TLS (on automatically when ca_file or cert_file is set).")
    ca_file: str | None = Field(None, examples=["/etc/linkpass/mqtt-ca.pem"], description="CA certificates (PEM) that "
                                "sign the broker's certificate; unset with tls = true: the system's CAs.")
    cert_file: str | None = Field(None, description="Client certificate (PEM) for TLS client authentication.")
    key_file: str | None = Field(None, description="Private key (PEM) of cert_file; must not be readable by others.")
    username: str | None = Field(None, max_length=256, description="Username for the broker (its password comes from password_file).")
    password_file: str | None = Field(None, description="File holding the broker password (first line); must not be "
                                      "readable by others.")
    outbox_path: PathText = Field(DEFAULT_OUTBOX_PATH, min_length=1, description="sqlite file of the durable event outbox "
                             "(WAL mode); events wait here until the broker acknowledged them.")
    outbox_max_events: StrictInt = Field(100_000, ge=10, le=100_000_000, description="Most events kept in the outbox; "
                                         "when full, the oldest non-critical event is dropped first (counted).")
    outbox_sync: Literal["normal", "full"] = Field("normal", description="normal: a queued event survives a daemon "
                                                   "crash; full: it also survives power loss (one disk flush per event).")
    reconnect_min_s: FiniteFloat = Field(0.5, gt=0, le=3600, description="First delay before reconnecting to the broker.")
    reconnect_max_s: FiniteFloat = Field(30.0, gt=0, le=3600, description="Longest delay between reconnects (capped "
                                         "exponential backoff with full jitter).")

    @field_validator("prefix")
    @classmethod
    def _topic_prefix(cls, v: str) -> str:
        if any(c in v for c in "+#\0"):
            raise ValueError(f"must not contain the MQTT wildcards + or # (or NUL), got {_shown(v)}")
        if v.startswith("$"):
            raise ValueError(f"must not start with $ (reserved for broker topics), got {_shown(v)}")
        if v.count("{host}") > 1 or re.search(r"\{(?!host\})", v):
            raise ValueError(f"the only placeholder allowed is one {{host}}, got {_shown(v)}")
        if "{host}" not in v:
            raise ValueError("must contain {host} (replaced by daemon.host): without it every host publishes the same "
                             f"retained topics and overwrites the others', got {_shown(v)}")
        return v if v.endswith("/") else v + "/"

    @model_validator(mode="after")
    def _backoff(self) -> "MqttSection":
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError(f"reconnect_max_s: must be at least reconnect_min_s ({self.reconnect_max_s} < {self.reconnect_min_s})")
        if self.key_file and not self.cert_file:
            raise ValueError("cert_file: required when key_file is set")
        return self


class Config(_Strict):
    """The whole validated configuration."""

    daemon: DaemonSection = Field(description="This host, its addressing and the routes linkpass owns (required).")
    rails: list[RailSection] = Field(default_factory=list, description="One entry per compute rail (required unless "
                                     "[topology] rails = \"auto\").")
    peers: list[PeerSection] = Field(default_factory=list, description="One entry per peer host of the job (or "
                                     "[topology] peers_file).")
    topology: TopologySection = Field(default_factory=TopologySection, description="Rails and peers from topology discovery.")
    probe: ProbeSection = Field(default_factory=ProbeSection, description="Active per-rail probing for gray failures.")
    damping: DampingSection = Field(default_factory=DampingSection, description="Flap damping per rail.")
    hooks: HooksSection = Field(default_factory=HooksSection, description="The unix socket torch hooks connect to.")
    snapshot: SnapshotSection = Field(default_factory=SnapshotSection, description="Step-aligned snapshots the torch "
                                      "hook takes (read by linkpass exec, not by the daemon).")
    nccl: NcclSection = Field(default_factory=NcclSection, description="The NCCL environment file for training processes.")
    device: DeviceSection = Field(default_factory=DeviceSection, description="Live device evidence: kernel log, NVML Xid "
                                  "events, RDMA port events.")
    metrics: MetricsSection = Field(default_factory=MetricsSection, description="The Prometheus metrics endpoint.")
    risk: RiskSection = Field(default_factory=RiskSection, description="Counter trends: rails drained and ranks moved "
                              "before the hardware fails.")
    mqtt: MqttSection = Field(default_factory=MqttSection, description="MQTT alerts with a durable outbox.")

    @property
    def auto(self) -> bool:
        """True when rails (and peers from peers_file) come from discovery at run time."""
        return self.topology.rails == "auto"

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        problems = cross_field_problems(self.daemon, self.rails, self.peers, self.topology, self.hooks)
        if problems:  # the first; linkpass.config.loading lists them all
            raise ValueError(problems[0])
        return self


def cross_field_problems(daemon: DaemonSection | None, rails: list[RailSection | None] | None,
                         peers: list[PeerSection | None] | None, topology: TopologySection | None,
                         hooks: HooksSection | None) -> list[str]:
    """Every problem of the checks that compare sections (:meth:`Config._cross_checks`), each
    ``"<field>: <what is wrong>"``, in the order the validator meets them.

    A section that is not valid on its own is None, and so is an invalid ``[[rails]]`` or
    ``[[peers]]`` entry in its list (a list that is not one is None): a check that needs one of
    them is skipped, so ``linkpass config check`` can report these problems together with the
    field errors without guessing at invalid values (loading.py).  A check over the entries
    (duplicates) uses the valid ones; a peer's ``rail_ips`` are compared with the rail ids only
    when every ``[[rails]]`` entry is valid.
    """
    out: list[str] = []
    valid_rails = [r for r in rails or [] if r is not None]
    valid_peers = [(i, p) for i, p in enumerate(peers or []) if p is not None]
    auto = topology is not None and topology.rails == "auto"
    if topology is not None and rails is not None:
        if topology.rails == "config" and not rails:
            out.append('rails: at least one [[rails]] entry is required (or set [topology] rails = "auto")')
        if topology.rails == "auto" and rails:
            out.append('rails: leave [[rails]] out when [topology] rails = "auto" (rails come from discovery)')
    ids = [r.id for r in valid_rails]
    if len(set(ids)) != len(ids):
        out.append(f"rails: duplicate rail id in {_shown(ids)}")
    devs = [r.netdev for r in valid_rails]
    if len(set(devs)) != len(devs):
        out.append(f"rails: netdev used by two rails in {_shown(devs)}")
    names = [p.name for _, p in valid_peers]
    if len(set(names)) != len(names):
        out.append(f"peers: duplicate peer name in {_shown(names)}")
    if daemon is not None and daemon.host in names:
        out.append(f"peers: this host ({daemon.host}) is listed as its own peer")
    own_ip = daemon.host_ip if daemon is not None else None
    for _, p in valid_peers:
        if own_ip is not None and p.host_ip is not None and p.host_ip == own_ip:
            # a route to our own address via a rail would take this host's traffic off itself
            out.append(f"peers: peer {p.name} has this host's own host_ip {own_ip}")
    # one address given to two peers (a copy-paste slip): routes and probes for one of them would
    # go to the other, and this host could not tell them apart
    host_ips = [str(p.host_ip) for _, p in valid_peers if p.host_ip is not None]
    if len(set(host_ips)) != len(host_ips):
        out.append(f"peers: host_ip used by two peers in {_shown(host_ips)}")
    seen_rail_ip: dict[str, str] = {}
    for i, p in valid_peers:
        for rid, ip in sorted(p.rail_ips.items()):
            other = seen_rail_ip.setdefault(str(ip), p.name)
            if other != p.name:
                out.append(f"peers[{i}].rail_ips: {ip} (rail {rid}) is also peer {other}'s address")
    own_rail_ips = {str(r.address) for r in valid_rails if r.address is not None}
    for i, p in valid_peers:
        mine = sorted(str(ip) for ip in p.rail_ips.values() if str(ip) in own_rail_ips)
        if mine:
            out.append(f"peers[{i}].rail_ips: {', '.join(mine)} is this host's own rail address")
    rails_known = rails is not None and topology is not None and len(valid_rails) == len(rails)
    for i, p in valid_peers:
        if daemon is not None and daemon.mode == "host-ip" and p.host_ip is None:
            out.append(f"peers[{i}].host_ip: required when mode = \"host-ip\"")
        unknown = sorted(set(p.rail_ips) - set(ids))
        if unknown and rails_known and not auto:
            out.append(f"peers[{i}].rail_ips: rail id(s) {unknown} are not in [[rails]]")
    if daemon is not None and daemon.mode == "per-rail-ip":
        for i, r in enumerate(rails or []):
            if r is not None and r.address is None:
                out.append(f"rails[{i}].address: required when mode = \"per-rail-ip\"")
    if daemon is not None and hooks is not None and hooks.enabled and hooks.socket and \
            os.path.normpath(hooks.socket) == os.path.normpath(daemon.control_socket):
        out.append(f"hooks.socket: {hooks.socket} is also daemon.control_socket; the hooks socket needs a "
                   "path of its own (leave hooks.socket out for the default beside the control socket)")
    return out
