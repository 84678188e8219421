"""`linkpass snapshot` refuses bad arguments in one line, exit 2, before it asks any store."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, says", [
    (["--job", "x", "--store", "127.0.0.1:1", "--wait", "--timeout", "-5"], "--timeout -5.0: must be a positive"),
    (["--job", "x", "--store", "127.0.0.1:1", "--wait", "--timeout", "nan"], "--timeout nan: must be a positive"),
    (["--job", "x", "--store", "127.0.0.1:1", "--json"], "--json needs --wait"),
    (["--job", " ", "--store", "127.0.0.1:1"], "--job: empty"),
    (["--job", "x", "--store", "127.0.0.1:1", "--attempt", "-1"], "--attempt -1: must not be negative"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says):
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "snapshot", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and says in p.stderr and "Traceback" not in p.stderr
