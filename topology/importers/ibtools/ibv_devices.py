"""``ibv_devices``: a table of device names and node GUIDs.

``ibv_devices`` (rdma-core ``libibverbs/examples/device_list.c``): only names and node GUIDs::

        device                 node GUID
        ------              ----------------
        mlx5_0              0c42a10300000001
"""

from __future__ import annotations

import re

from topology.importers.ibtools._common import _Block

_IBV_DEVICES_HDR = re.compile(r"^device\s+node GUID$")
_IBV_DEVICES_RULE = re.compile(r"^-+\s+-+$")
_IBV_DEVICES_ROW = re.compile(r"^(\S+)\s+([0-9A-Fa-f]{16})$")


def looks_like_line(s: str) -> bool:
    """The table's header (``s`` stripped)."""
    return bool(_IBV_DEVICES_HDR.match(s))


class IbvDevicesLines:
    """The ibv_devices part of :class:`~topology.importers.ibtools._reader._Reader`."""

    def ibv_devices_header(self, s: str, indent: int) -> bool:
        """The table's header opens a block; False when ``s`` is none."""
        if not _IBV_DEVICES_HDR.match(s):
            return False
        self.close()
        self.block = _Block("ibv_devices", self.lineno, indent)
        return True

    def ibv_devices_row(self, s: str) -> bool:
        """One line under the ibv_devices header; False when it is not a row (the table
        ended).  A row cut at the end of the text is reported, not used."""
        if _IBV_DEVICES_RULE.match(s):
            return True
        m = _IBV_DEVICES_ROW.match(s)
        if not m:
            if self.defer and re.fullmatch(r"\S+(\s+[0-9A-Fa-f]{0,15})?", s):
                self.warn(f"the text ends in the middle of this ibv_devices row ({s[:60]!r}); not used")
                return True
            return False
        self.first(("ibv_devices", m.group(1)), f"ibv_devices {m.group(1)}")
        self.nic(m.group(1))
        return True
