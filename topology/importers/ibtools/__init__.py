"""Importer for captured InfiniBand / RDMA tool outputs: ``ibstat``, ``ibstatus``,
``ibv_devinfo``, ``ibdev2netdev``, ``rdma link`` and ``ibv_devices``.

Pure: no I/O, no subprocess; stdlib and :mod:`topology.model` only.

:func:`looks_like` says whether a text holds any of these outputs; :func:`parse` reads all of
them from one text (a capture or a paste that mixes several tools with shell prompts,
comments, config files, ...) into one :class:`~topology.model.Topology`: one
:class:`~topology.model.Nic` per RDMA device (named by its RDMA device name, in the order the
text first names it, ``kind="rdma"``), with its :class:`~topology.model.Port` s.  Lines that
belong to none of the formats are ignored.  Nothing raises on bad input: what could be read
is kept, and each problem becomes a warning ``"<source>: line N: <what was wrong>"`` (or
``"<source>: <what>"`` for the input as a whole).

Each tool's format, as its program prints it, is described in its module, with its patterns
and the code that reads its lines: :mod:`~topology.importers.ibtools.ibstat`,
:mod:`~topology.importers.ibtools.ibstatus`, :mod:`~topology.importers.ibtools.ibv_devinfo`,
:mod:`~topology.importers.ibtools.ibdev2netdev`, :mod:`~topology.importers.ibtools.rdma_link`,
:mod:`~topology.importers.ibtools.ibv_devices`.  :mod:`~topology.importers.ibtools._reader`
is the one pass over the text that hands each line to its tool and merges the readings;
:mod:`~topology.importers.ibtools._common` holds what they share (name patterns, value
vocabularies, the open block).

Readings
--------

* ``Port.state``: one of ``ACTIVE DOWN INIT ARMED ACTIVE_DEFER POLLING DISABLED UNKNOWN``; a
  DOWN port whose physical state is Polling or Disabled gets that physical state as its state
  (tests/fixtures/corpus/README.md).  ibdev2netdev's ``Up``/``Down`` (netdev carrier) become
  ACTIVE/DOWN but give way to a port state printed by another tool for the same port.
* ``Port.phys_state``: ibstat's spelling (``LinkUp``, ``Polling``, ``Disabled``, ...) whatever
  tool printed it.
* ``Port.rate_gbps``: a float, None when not printed.  ``Port.link_layer``: ``InfiniBand``,
  ``Ethernet`` or None.  ``Port.netdev`` and ``Nic.netdevs`` from ibdev2netdev / rdma link.
* A device seen twice by the same tool (a duplicated block) is merged, with a warning; when
  two readings of one value differ, the first wins (a real port state beats a netdev
  carrier), with a warning naming both lines.
* A block that ends before its last line (a cut capture) gives a warning; when the text ends
  without a newline inside such a block, the values on that last, cut line are not used.
* Bounds (``_bounds``): at most 16 Mi characters are read and 200 warnings kept; a device name
  longer than 64 characters or a netdev name longer than 15 is no record (a warning).
"""

from __future__ import annotations

from topology.importers.ibtools import ibdev2netdev, ibstat, ibstatus, ibv_devices, ibv_devinfo, rdma_link
from topology.importers.ibtools._reader import _Reader
from topology.model import Topology

__all__ = ["looks_like", "parse"]

#: the tool modules; each says with ``looks_like_line`` whether a (stripped) line is its own
_TOOLS = (ibstat, ibstatus, ibv_devinfo, ibdev2netdev, ibv_devices, rdma_link)


def looks_like(text: str) -> bool:
    """True when ``text`` holds at least one line that only these tools print: an ibstat CA
    header or ibpanic line, an ibstatus port header, an ``hca_id:`` line, an ibdev2netdev
    line, an ``rdma link`` line with a state, or the ibv_devices table header."""
    if not isinstance(text, str):
        return False
    for raw in text.split("\n"):
        s = raw.strip()
        if s and any(t.looks_like_line(s) for t in _TOOLS):
            return True
    return False


def parse(text: str, source: str) -> Topology:
    """Read every ibstat / ibstatus / ibv_devinfo / ibdev2netdev / rdma link / ibv_devices
    output in ``text`` into a Topology (``sources == [source]``, NICs in order of first
    mention, warnings for what was wrong).  Never raises on bad input."""
    return _Reader(text if isinstance(text, str) else "", source).run()
