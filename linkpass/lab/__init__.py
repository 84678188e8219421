"""The lab: everything that exists to show or measure linkpass here, apart from the product.

- :mod:`linkpass.lab.fabric`: the emulated fabric (network namespaces, veth, bridges) and
  :class:`~linkpass.lab.fabric.cluster.Cluster`, daemons on it;
- :mod:`linkpass.lab.demo`, :mod:`linkpass.lab.demo_script`, :mod:`linkpass.lab.demo_train`:
  ``linkpass demo`` and the training jobs it runs;
- :mod:`linkpass.lab.inject`: ``linkpass inject`` (device faults into an emulated host);
- :mod:`linkpass.lab.benchcmd`: ``linkpass bench``.

The daemon (:mod:`linkpass.daemon`), the core and the adapters never import this package
(tests/unit/test_layering.py); the lab reaches the daemon only as a user does: through its
config file, its control socket and the kernel.
"""
