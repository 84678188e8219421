"""DESIGN.md rules 2 and 3: linkpass/core imports nothing with side effects, and no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import linkpass

CORE = Path(linkpass.__file__).resolve().parent / "core"

FORBIDDEN = {
    "asyncio",
    "socket",
    "pyroute2",
    "torch",
    "pynvml",
    "pyverbs",
    "aiomqtt",
    "prometheus_client",
    "subprocess",
    "time",  # the clock is a parameter
    "os",
    # layering inside linkpass: the core never reaches out to the edges
    "linkpass.adapters",
    "linkpass.daemon",
    "linkpass.lab",
    "linkpass.cli",
}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement (or a literal __import__/import_module call) names."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                out.append((node.lineno, node.module))
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            elif node.level:
                out.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant):
                out.append((node.lineno, str(node.args[0].value)))
    return out


def violations(source: str, filename: str = "<src>") -> list[str]:
    bad = []
    for line, mod in imported_modules(ast.parse(source, filename)):
        if mod.startswith("."):
            bad.append(f"{filename}:{line}: relative import {mod!r} (use linkpass.core.*)")
            continue
        for f in FORBIDDEN:
            if mod == f or mod.startswith(f + "."):
                bad.append(f"{filename}:{line}: imports {mod}")
    return bad


def core_files() -> list[Path]:
    files = sorted(CORE.glob("*.py"))
    assert files, CORE
    return files


def test_core_modules_exist():
    names = {p.name for p in core_files()}
    assert {"health.py", "engine.py", "model.py", "planner.py", "reconcile.py", "notice.py", "damping.py", "paths.py"} <= names


@pytest.mark.parametrize("path", core_files(), ids=lambda p: p.name)
def test_core_module_imports_nothing_forbidden(path):
    assert violations(path.read_text(encoding="utf-8"), path.name) == []


@pytest.mark.parametrize(
    "src",
    [
        "import time",
        "import os.path",
        "from os import environ",
        "import asyncio as aio",
        "from pyroute2 import IPRoute",
        "from time import monotonic_ns",
        "def f():\n    import subprocess",
        "import importlib\nimportlib.import_module('socket')",
        "__import__('torch')",
        "from linkpass.adapters.netlink import X",
        "from linkpass import daemon",
        "from . import model",
    ],
)
def test_checker_catches_forbidden_imports(src):
    assert violations(src) != []


@pytest.mark.parametrize(
    "src",
    ["import logging", "from linkpass.core.model import Tick", "import hashlib, hmac, struct", "from linkpass.config import Config", "import ostree_like_name", "import timeit_like"],
)
def test_checker_allows_pure_imports(src):
    assert violations(src) == []


# topology: the pure parts (model, affinity, importers) parse and decide; only the readers
# (sysfs.py, live.py, capture.py) and the CLI touch the host.
TOPOLOGY = Path(linkpass.__file__).resolve().parent.parent / "topology"
TOPOLOGY_PURE = ["model.py", "affinity.py", "importers/__init__.py", "importers/_bounds.py", "importers/ibtools.py", "importers/nvsmi.py", "importers/nccl_xml.py"]
TOPOLOGY_FORBIDDEN = (FORBIDDEN - {"os"}) | {"topology.sysfs", "topology.live", "topology.capture", "topology.cli", "linkpass"}


@pytest.mark.parametrize("rel", TOPOLOGY_PURE)
def test_topology_pure_parts_import_nothing_with_side_effects(rel):
    src = (TOPOLOGY / rel).read_text(encoding="utf-8")
    bad = []
    for line, mod in imported_modules(ast.parse(src, rel)):
        for f in TOPOLOGY_FORBIDDEN:
            if mod == f or mod.startswith(f + "."):
                bad.append(f"{rel}:{line}: imports {mod}")
    assert bad == []


def test_torch_hooks_imports_no_torch_at_package_level():
    src = (TOPOLOGY.parent / "torch_hooks" / "__init__.py").read_text(encoding="utf-8")
    assert violations(src, "torch_hooks/__init__.py") == []


# torch_hooks client/plan parts: no torch and no other side-effect library (the client may use
# socket/threading/time: it is an I/O edge, but it must load in a process without torch);
# protocol.py is pure (the daemon's hook_server imports it too).
HOOKS_CLIENT_FORBIDDEN = {"asyncio", "pyroute2", "torch", "pynvml", "pyverbs", "aiomqtt", "prometheus_client",
                          "subprocess", "torch_hooks.guard", "linkpass"}


@pytest.mark.parametrize("rel,forbidden", [("client.py", HOOKS_CLIENT_FORBIDDEN),
                                           ("protocol.py", HOOKS_CLIENT_FORBIDDEN | {"socket", "time", "os", "threading"}),
                                           # the rebuild decision is pure (DESIGN.md: torch_hooks/agreement.py)
                                           ("agreement.py", HOOKS_CLIENT_FORBIDDEN | {"socket", "time", "os", "threading",
                                                                                      "torch_hooks"}),
                                           ("sockets.py", HOOKS_CLIENT_FORBIDDEN | {"torch_hooks"})])
def test_torch_hooks_client_parts_import_no_torch(rel, forbidden):
    src = (TOPOLOGY.parent / "torch_hooks" / rel).read_text(encoding="utf-8")
    bad = [f"{rel}:{line}: imports {mod}" for line, mod in imported_modules(ast.parse(src, rel))
           for f in forbidden if mod == f or mod.startswith(f + ".")]
    assert bad == []


@pytest.mark.parametrize("rel", ["pg.py", "guard.py", "spare.py"])
def test_torch_hooks_torch_parts_do_not_reach_into_the_daemon(rel):
    """The in-process parts (they import torch) talk to the daemon only through client/protocol."""
    src = (TOPOLOGY.parent / "torch_hooks" / rel).read_text(encoding="utf-8")
    bad = [f"{rel}:{line}: imports {mod}" for line, mod in imported_modules(ast.parse(src, rel))
           for f in ("linkpass", "asyncio", "pyroute2", "aiomqtt") if mod == f or mod.startswith(f + ".")]
    assert bad == []


# The lab (emulated fabric, demos, inject, bench commands) is apart from the product: nothing
# the daemon runs, and nothing the training hook loads, imports it.  Only the CLI registers the
# lab's commands (imported when one of them runs).
PKG = Path(linkpass.__file__).resolve().parent
PRODUCT_FILES = sorted(p for p in PKG.rglob("*.py") if PKG / "lab" not in p.parents and PKG / "cli" not in p.parents) \
    + sorted((TOPOLOGY.parent / "torch_hooks").rglob("*.py")) + sorted(TOPOLOGY.rglob("*.py"))


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=lambda p: str(p.relative_to(TOPOLOGY.parent)))
def test_product_never_imports_the_lab(path):
    rel = str(path.relative_to(TOPOLOGY.parent))
    bad = [f"{rel}:{line}: imports {mod}" for line, mod in imported_modules(ast.parse(path.read_text(encoding="utf-8"), rel))
           if mod == "linkpass.lab" or mod.startswith("linkpass.lab.")]
    assert bad == []


def test_the_lab_is_where_the_guide_says():
    assert {p.name for p in (PKG / "lab").iterdir()} >= {"fabric", "demo.py", "demo_train.py", "inject.py", "benchcmd.py"}
    assert not any((PKG / n).exists() for n in ("fabric", "demo.py", "demo_train.py", "inject.py", "benchcmd.py"))
