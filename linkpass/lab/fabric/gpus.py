"""The emulated hosts' GPUs: there are none, only PCI bus ids the fabric hands out.

Emulated GPU ``G`` of every emulated host has bus id ``0000:<0x18+G>:00.0`` (the same on every
host, as on identical real nodes).  ``fabric up`` writes the map into each host's daemon config
(``[device] gpus``) and ``linkpass inject device-fault`` prints Xid lines with these ids.
"""

from __future__ import annotations

#: emulated GPUs per host (index range of ``linkpass inject device-fault --gpu``)
MAX_GPUS = 8


def fake_pci_bus_id(gpu: int) -> str:
    """PCI bus id of emulated GPU ``gpu`` (0-based) on any emulated host."""
    return f"0000:{0x18 + gpu:02x}:00.0"


def gpu_map(n: int = MAX_GPUS) -> dict[str, int]:
    """bus id -> GPU index for the emulated GPUs of one host."""
    return {fake_pci_bus_id(g): g for g in range(n)}
