"""The ``linkpass`` command line: one module per command family.

``main`` (:mod:`linkpass.cli.app`) builds the parser and registers the families:
:mod:`linkpass.cli.classify`, :mod:`linkpass.cli.config`, :mod:`linkpass.cli.nccl`,
:mod:`linkpass.cli.alerts`, and the lab's commands (fabric, demo, inject, bench) from
:mod:`linkpass.lab`, imported only when one of them runs.
"""

from linkpass.cli.app import main

__all__ = ["main"]
