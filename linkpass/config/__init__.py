"""Typed, validated daemon configuration (TOML).

The file is read with :mod:`tomllib` and validated with pydantic.  One idea per module:

- :mod:`~linkpass.config.schema`: every section and option, documented on its field
  (``description=``; ``examples=`` gives the value the example file shows, commented out unless
  the option is required or marked ``json_schema_extra=IN_EXAMPLE``);
  ``deploy/linkpass.toml.example`` is generated from it (:func:`linkpass.cli.config.render_example`,
  ``make example-config``).
- :mod:`~linkpass.config.problems`: :class:`ConfigError` and validation errors as one-line messages.
- :mod:`~linkpass.config.values`: how those messages quote the file's values.
- :mod:`~linkpass.config.loading`: reading the config file and the key and peers files it names.
- :mod:`~linkpass.config.policy`: the core's frozen view of a config (:mod:`linkpass.core.policy`).

Every name is importable from ``linkpass.config`` itself.  Secrets are never
options: an option ending in ``_file`` names a file (mode 0600) that holds the secret.

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

# the package's names, as callers import them (``from linkpass.config import Config``)
from linkpass.config.loading import (
    MAX_CONFIG_BYTES,
    MAX_KEY_FILE_BYTES,
    load_config,
    notice_key,
    parse_config,
    read_key_file,
    read_text_file,
)
from linkpass.config.policy import damping_policy, policy_from_config, probe_policy
from linkpass.config.problems import _SECRET_NAME, ConfigError, _options_at, validation_problems
from linkpass.config.schema import (
    DEFAULT_CONTROL_SOCKET,
    DEFAULT_METRICS_PORT,
    DEFAULT_MQTT_PREFIX,
    DEFAULT_NCCL_ENV_FILE,
    DEFAULT_NOTICE_PORT,
    DEFAULT_OUTBOX_PATH,
    DEFAULT_ROUTE_PROTOCOL,
    HOST_NAME,
    IN_EXAMPLE,
    Config,
    DaemonSection,
    DampingSection,
    DeviceSection,
    FiniteFloat,
    HooksSection,
    IPv4,
    MetricsSection,
    MqttSection,
    NcclSection,
    PathText,
    PeerSection,
    ProbeSection,
    RailSection,
    SnapshotSection,
    TopologySection,
)
from linkpass.config.values import huge_number_text

__all__ = [
    "MAX_CONFIG_BYTES", "MAX_KEY_FILE_BYTES", "load_config", "notice_key", "parse_config", "read_key_file",
    "read_text_file", "damping_policy", "policy_from_config", "probe_policy", "ConfigError", "validation_problems",
    "DEFAULT_CONTROL_SOCKET", "DEFAULT_METRICS_PORT", "DEFAULT_MQTT_PREFIX", "DEFAULT_NCCL_ENV_FILE",
    "DEFAULT_NOTICE_PORT", "DEFAULT_OUTBOX_PATH", "DEFAULT_ROUTE_PROTOCOL", "HOST_NAME", "IN_EXAMPLE", "Config",
    "DaemonSection", "DampingSection", "DeviceSection", "FiniteFloat", "HooksSection", "IPv4", "MetricsSection",
    "MqttSection", "NcclSection", "PathText", "PeerSection", "ProbeSection", "RailSection", "SnapshotSection",
    "TopologySection",
    "huge_number_text", "_SECRET_NAME", "_options_at",
]
