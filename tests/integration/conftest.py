"""Fixtures shared by the integration modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory) -> Path:
    """A directory for ``linkpass demo --reference-cache``: the fault-free runs' reports, shared
    by the script demos of the session.  A dozen scenarios train the same two example scripts,
    and the reference of a script is the same run every time (keyed by the script, its
    arguments, the hosts, the interpreter, torch, the CPU, the code and the environment:
    :meth:`linkpass.lab.demo_script.ScriptDemo.reference_key`).  Whichever test comes first with
    a key runs it; no result depends on which."""
    return tmp_path_factory.mktemp("reference-cache")
