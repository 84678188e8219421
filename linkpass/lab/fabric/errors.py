"""The two errors every part of the emulated fabric raises (one-line messages, CLI exit codes)."""

from __future__ import annotations


class FabricError(Exception):
    """Bad input or a refused request (not root, unknown host, name in use, ...).

    ``str(err)`` is one line.  ``exit_code`` is what the CLI exits with (2).
    """

    exit_code = 2


class FabricKernelError(FabricError):
    """A kernel or tool operation failed (``ip``, ``nft``, setns, an ioctl).  CLI exit code 1."""

    exit_code = 1
