"""What the ibtools readers share: name patterns, value vocabularies, how much a reading is
worth, and the open multi-line block.  Pure (stdlib and :mod:`topology.model` only)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from topology.model import Nic

#: an RDMA device name: at most IB_DEVICE_NAME_MAX - 1 = 63 characters (include/rdma/ib_verbs.h),
#: 64 allowed here; a netdev name: at most IFNAMSIZ - 1 = 15 (include/uapi/linux/if.h)
_DEV = r"[^'\s]{1,64}"
_NETDEV = r"[^\s()]{1,15}"

#: control characters other than tab / CR / LF / FF, and U+FFFD (what a lenient decode of
#: bad bytes leaves): a sign of binary data
_BINARY = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")

_STATES = {"ACTIVE": "ACTIVE", "DOWN": "DOWN", "INIT": "INIT", "INITIALIZING": "INIT", "ARMED": "ARMED",
           "ACTIVE_DEFER": "ACTIVE_DEFER"}
#: printed values that mean "no state" (ibstat "???", verbs NOP, devinfo "invalid state")
_NO_STATE = {"???", "NOP", "UNKNOWN", "INVALID STATE", "NA"}

#: physical state, lower-cased with non-letters removed -> ibstat's spelling
_PHYS = {"sleep": "Sleep", "polling": "Polling", "disabled": "Disabled",
         "portconfigurationtraining": "PortConfigurationTraining",
         "portconfigurationtrainning": "PortConfigurationTraining",   # ibv_devinfo's spelling
         "armed": "PortConfigurationTraining",                         # iproute2's table (value 4)
         "linkup": "LinkUp", "linkerrorrecovery": "LinkErrorRecovery",
         "linkerrorrecover": "LinkErrorRecovery", "phytest": "PhyTest",
         "opaoffline": "OPA_OFFLINE", "opatest": "OPA_TEST"}
_NO_PHYS = {"nostatechange", "nop", "unknown", "invalidphysicalstate"}

_LINK_LAYERS = {"infiniband": "InfiniBand", "ethernet": "Ethernet"}

# how much a reading of a port's state is worth: a netdev carrier (ibdev2netdev) is weaker
# than the RDMA port state itself
_WEAK, _STRONG = 1, 2

_LABEL = {"state": "state", "phys_state": "physical state", "link_layer": "link layer", "rate_gbps": "rate",
          "netdev": "netdev"}


@dataclass
class _Block:
    """An open multi-line block: one ibstat CA, ibstatus port, ibv_devinfo HCA or ibv_devices
    table.  ``seen`` maps port number -> field names read (completeness check at the end)."""

    tool: str
    line: int
    indent: int
    nic: Nic | None = None
    alone: bool = False
    port: int | None = None
    declared_ports: int | None = None
    seen: dict[int, set[str]] = field(default_factory=dict)
    width: int | None = None
    speed: float | None = None
    rates: dict[int, tuple[int | None, float | None]] = field(default_factory=dict)
    pending: list[tuple] = field(default_factory=list)
    pending_text: str = ""
