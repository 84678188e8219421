"""`linkpass demo`: real training jobs on the emulated fabric, through a fault.

Scenarios, one module each:

* :mod:`~linkpass.lab.demo.reroute` (``--scenario reroute``, the default): the daemons reroute
  the kernel's routes around a cut rail; :class:`Demo` is also the runner the others build on;
* :mod:`~linkpass.lab.demo.rebuild` (``--scenario rebuild``): the torch hook rebuilds the
  process group on another rail, no route changes (:class:`RebuildDemo`);
* :mod:`~linkpass.lab.demo.device_fault` (``--scenario guard-device-fault``): a GPU fails and a
  hot spare takes the rank over (:class:`DeviceFaultDemo`);
* :mod:`linkpass.lab.demo_script` (``rail``, ``rail-latched``, ``device-fault``): an unmodified
  script under ``linkpass exec``.

:mod:`~linkpass.lab.demo.common` holds what they share (:class:`DemoError`, byte counters, daemon
status); :mod:`~linkpass.lab.demo.cli` is ``linkpass demo``'s entry point (:func:`main`).
"""

from linkpass.lab.demo.cli import main
from linkpass.lab.demo.common import DEMO_MODES, DemoError, _counters, _rail_bytes, _status  # noqa: F401
from linkpass.lab.demo.device_fault import DeviceFaultDemo, _print_device_fault_summary  # noqa: F401
from linkpass.lab.demo.rebuild import RebuildDemo, _print_rebuild_summary  # noqa: F401
from linkpass.lab.demo.reroute import Demo, _print_summary  # noqa: F401

__all__ = [
    "DEMO_MODES",
    "Demo",
    "DemoError",
    "DeviceFaultDemo",
    "RebuildDemo",
    "main",
]
