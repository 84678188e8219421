"""DESIGN.md rules 2 and 3: linkpass/core imports nothing with side effects, and no clock,
neither itself nor through what it imports (the walk follows linkpass.*, topology.* and
torch_hooks.* imports to the end, reading source only: nothing is imported to check it)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import linkpass

CORE = Path(linkpass.__file__).resolve().parent / "core"
#: the repository root: where the walked packages live
ROOT = CORE.parent.parent
#: top-level packages of this repository whose imports the transitive walk follows
WALKED = ("linkpass", "topology", "torch_hooks")

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
    "pydantic",  # policy comes in as frozen dataclasses (linkpass.core.policy), not config models
    # layering inside linkpass: the core never reaches out to the edges
    "linkpass.config",
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


def _forbidden(mod: str, forbidden: Iterable[str]) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in forbidden)


def violations(source: str, filename: str = "<src>") -> list[str]:
    bad = []
    for line, mod in imported_modules(ast.parse(source, filename)):
        if mod.startswith("."):
            bad.append(f"{filename}:{line}: relative import {mod!r} (use linkpass.core.*)")
            continue
        if _forbidden(mod, FORBIDDEN):
            bad.append(f"{filename}:{line}: imports {mod}")
    return bad


def module_file(name: str, root: Path) -> Path | None:
    """The source file of module ``name`` under ``root`` (``a/b.py`` or ``a/b/__init__.py``), or
    None: not a module of this tree (a class or function imported from one, or another package)."""
    base = root.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _absolute(mod: str, importer: str, is_package: bool) -> str:
    """A relative import's absolute name (``from ..x import y`` inside ``a.b.c`` -> ``a.x.y``)."""
    level = len(mod) - len(mod.lstrip("."))
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    rest = mod[level:]
    return ".".join(parts + ([rest] if rest else []))


def _with_parents(name: str) -> list[str]:
    """Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c`` (each package's ``__init__``)."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def transitive_violations(starts: Iterable[str], root: Path, forbidden: Iterable[str] = FORBIDDEN,
                          walked: Iterable[str] = WALKED) -> list[str]:
    """Every forbidden import in the import closure of the modules ``starts`` (dotted names).

    Follows, from each module's source (AST, nothing imported), every import of a module of a
    ``walked`` package found under ``root`` (their parent packages included, as Python runs
    them), relative imports resolved, to the end.  A forbidden module is reported, not entered.

    Returns:
        One line per forbidden import: ``a -> b -> c:LINE: imports X``, the chain being how the
        first start reached the importing module (shortest, breadth first); sorted.
    """
    forbidden, walked = tuple(forbidden), tuple(walked)
    chain: dict[str, tuple[str, ...]] = {}
    todo: list[str] = []
    for s in starts:
        for m in _with_parents(s):
            if m not in chain and module_file(m, root) is not None:
                chain[m] = (m,) if m == s else (s, m)  # a parent package: reached by importing the start
                todo.append(m)
    bad: set[str] = set()
    while todo:
        mod, todo = todo[0], todo[1:]
        path = module_file(mod, root)
        assert path is not None, mod
        is_pkg = path.name == "__init__.py"
        said: set[tuple[int, str]] = set()  # (line, module) reported: not again for its names
        for line, name in imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if name.startswith("."):
                name = _absolute(name, mod, is_pkg)
            if _forbidden(name, forbidden):
                if not any(ln == line and name.startswith(m + ".") for ln, m in said):
                    said.add((line, name))
                    bad.add(f"{' -> '.join(chain[mod])}:{line}: imports {name}")
                continue
            if not name.split(".")[0] in walked:
                continue
            for m in _with_parents(name):
                if m in chain or module_file(m, root) is None:
                    continue
                if _forbidden(m, forbidden):
                    bad.add(f"{' -> '.join(chain[mod])}:{line}: imports {m}")
                    continue
                chain[m] = chain[mod] + (m,)
                todo.append(m)
    return sorted(bad)


def core_files() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    assert files, CORE
    return files


def core_modules() -> list[str]:
    """Dotted names of every module of linkpass/core, sub-packages included."""
    out = []
    for p in core_files():
        rel = p.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append(".".join(parts))
    return out


def test_core_modules_exist():
    names = {p.name for p in core_files()}
    assert {"health.py", "engine.py", "model.py", "planner.py", "reconcile.py", "notice.py", "damping.py", "paths.py"} <= names


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_imports_nothing_forbidden(path):
    assert violations(path.read_text(encoding="utf-8"), path.name) == []


@pytest.mark.parametrize("mod", core_modules())
def test_core_module_reaches_nothing_forbidden_through_its_imports(mod):
    assert transitive_violations([mod], ROOT) == []


def test_the_walk_reaches_beyond_core():
    """The closure of the core really is walked: the engine reaches topology.model through the
    NCCL environment module (so a forbidden import there would be caught)."""
    assert transitive_violations(["linkpass.core.engine"], ROOT, forbidden=["topology.model"]) == [
        "linkpass.core.engine -> linkpass.core.nccl_env:" + _line_of(CORE / "nccl_env.py", "from topology.model") +
        ": imports topology.model"]


def _line_of(path: Path, text: str) -> str:
    return str(next(i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.startswith(text)))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src, encoding="utf-8")
    return tmp_path


def test_transitive_walk_finds_a_forbidden_import_two_hops_away(tmp_path):
    root = _tree(tmp_path, {
        "linkpass/__init__.py": "",
        "linkpass/core/__init__.py": "",
        "linkpass/core/a.py": "from linkpass.core.b import thing\n",
        "linkpass/core/b.py": "import logging\nfrom linkpass.util import helper\nthing = 1\n",
        "linkpass/util.py": "import json\n\ndef helper():\n    import asyncio\n",
    })
    assert transitive_violations(["linkpass.core.a"], root) == [
        "linkpass.core.a -> linkpass.core.b -> linkpass.util:4: imports asyncio"]


def test_transitive_walk_follows_packages_relative_imports_and_other_walked_packages(tmp_path):
    root = _tree(tmp_path, {
        "linkpass/__init__.py": "",
        "linkpass/core/__init__.py": "",
        "linkpass/core/a.py": "from topology import model\n",
        "topology/__init__.py": "from .sub import x\n",  # runs on any topology.* import
        "topology/model.py": "from . import pure\n",
        "topology/pure.py": "X = 1\n",
        "topology/sub/__init__.py": "from ..deep import y\n",
        "topology/deep.py": "import pyroute2\n",
    })
    assert transitive_violations(["linkpass.core.a"], root) == [
        "linkpass.core.a -> topology -> topology.sub -> topology.deep:1: imports pyroute2"]


def test_transitive_walk_reports_a_forbidden_package_module_and_does_not_enter_it(tmp_path):
    root = _tree(tmp_path, {
        "linkpass/__init__.py": "",
        "linkpass/core/__init__.py": "",
        "linkpass/core/a.py": "from linkpass import config\n",
        "linkpass/config.py": "import pydantic\n",
    })
    assert transitive_violations(["linkpass.core.a"], root) == ["linkpass.core.a:1: imports linkpass.config"]


def test_transitive_walk_checks_parent_packages_and_survives_cycles(tmp_path):
    root = _tree(tmp_path, {
        "linkpass/__init__.py": "import os\n",  # runs before any linkpass.* module
        "linkpass/core/__init__.py": "",
        "linkpass/core/a.py": "import linkpass.core.b\n",
        "linkpass/core/b.py": "import linkpass.core.a\n",
    })
    assert transitive_violations(["linkpass.core.a"], root) == ["linkpass.core.a -> linkpass:1: imports os"]


def test_transitive_walk_ignores_names_that_are_not_modules_and_other_packages(tmp_path):
    root = _tree(tmp_path, {
        "linkpass/__init__.py": "",
        "linkpass/core/__init__.py": "",
        "linkpass/core/a.py": "from linkpass.core.b import Thing\nimport numpy\n",
        "linkpass/core/b.py": "class Thing:\n    pass\n",
        "numpy/__init__.py": "import os\n",  # not a walked package: its own business
    })
    assert transitive_violations(["linkpass.core.a"], root) == []


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
        "from linkpass.config import Config",
        "from linkpass import config",
        "from pydantic import BaseModel",
    ],
)
def test_checker_catches_forbidden_imports(src):
    assert violations(src) != []


@pytest.mark.parametrize(
    "src",
    ["import logging", "from linkpass.core.model import Tick", "import hashlib, hmac, struct", "from linkpass.core.policy import EnginePolicy",
     "import ostree_like_name", "import timeit_like", "import pydantic_like_name"],
)
def test_checker_allows_pure_imports(src):
    assert violations(src) == []


# topology: the pure parts (model, affinity, importers) parse and decide; only the readers
# (sysfs.py, live.py, capture.py) and the CLI touch the host.
TOPOLOGY = Path(linkpass.__file__).resolve().parent.parent / "topology"
TOPOLOGY_PURE = ["model.py", "affinity.py", "importers/__init__.py", "importers/_bounds.py", "importers/nvsmi.py", "importers/nccl_xml.py",
                 # the ibtools package: one module per tool, the reader and their shared parts
                 "importers/ibtools/__init__.py", "importers/ibtools/_common.py", "importers/ibtools/_reader.py",
                 "importers/ibtools/ibstat.py", "importers/ibtools/ibstatus.py", "importers/ibtools/ibv_devinfo.py",
                 "importers/ibtools/ibdev2netdev.py", "importers/ibtools/rdma_link.py", "importers/ibtools/ibv_devices.py"]
TOPOLOGY_FORBIDDEN = (FORBIDDEN - {"os"}) | {"topology.sysfs", "topology.live", "topology.capture", "topology.cli", "linkpass"}


def test_every_importer_file_is_listed_as_pure():
    found = {str(p.relative_to(TOPOLOGY)) for p in (TOPOLOGY / "importers").rglob("*.py")}
    assert found <= set(TOPOLOGY_PURE), sorted(found - set(TOPOLOGY_PURE))


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


HOOKS_TORCH_PARTS = ["pg.py", "spare.py",
                     # LinkPassGuard, by idea (torch_hooks/guard/__init__.py says which part is where)
                     "guard/__init__.py", "guard/group.py", "guard/state.py", "guard/store.py", "guard/rebuild.py",
                     "guard/migration.py", "guard/exits.py"]


def test_every_guard_file_is_listed_as_a_torch_part():
    found = {str(p.relative_to(TOPOLOGY.parent / "torch_hooks")) for p in (TOPOLOGY.parent / "torch_hooks" / "guard").rglob("*.py")}
    assert found <= set(HOOKS_TORCH_PARTS), sorted(found - set(HOOKS_TORCH_PARTS))


@pytest.mark.parametrize("rel", HOOKS_TORCH_PARTS)
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
    assert {p.name for p in (PKG / "lab").iterdir()} >= {"fabric", "demo", "demo_train.py", "inject.py", "benchcmd.py"}
    assert not any((PKG / n).exists() for n in ("fabric", "demo.py", "demo_train.py", "inject.py", "benchcmd.py"))
