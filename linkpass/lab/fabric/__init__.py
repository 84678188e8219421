"""The emulated multi-host, multi-rail fabric (`linkpass fabric`): netns + veth + bridges + nftables.

See :mod:`linkpass.lab.fabric.fabric` for the layout, addressing and fault modes.
"""

from linkpass.lab.fabric.fabric import (
    MODES,
    SCHEMA,
    STATE_ROOT,
    FabricError,
    FabricKernelError,
    cut,
    down,
    down_report,
    heal,
    link_states,
    load,
    netns_exec,
    parse_fault_mode,
    state_dir,
    up,
)

__all__ = [
    "MODES",
    "SCHEMA",
    "STATE_ROOT",
    "FabricError",
    "FabricKernelError",
    "cut",
    "down",
    "down_report",
    "heal",
    "link_states",
    "load",
    "netns_exec",
    "parse_fault_mode",
    "state_dir",
    "up",
]
