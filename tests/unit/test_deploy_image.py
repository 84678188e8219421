"""deploy/Dockerfile builds the image the DaemonSet names.  No network here, so it is linted,
not built: parsed instruction by instruction and checked against the DaemonSet and pyproject."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KNOWN = {"FROM", "LABEL", "WORKDIR", "COPY", "RUN", "ENTRYPOINT", "CMD", "ENV", "ARG", "USER", "EXPOSE"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, ``\\`` continuations joined."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word, rest.strip()))
        cur = ""
    assert not cur, "a continuation line ends the file"
    return out


def exec_form(args: str) -> list[str]:
    v = json.loads(args)  # the exec (JSON) form: no shell in between
    assert isinstance(v, list) and all(isinstance(a, str) for a in v), args
    return v


def daemonset_containers() -> list[dict]:
    (ds,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "daemonset.yaml").read_text())
             if d and d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    return spec["initContainers"] + spec["containers"]


def test_every_instruction_is_known_and_the_base_is_debian_python_311():
    ins = instructions(DOCKERFILE.read_text())
    assert {w for w, _ in ins} <= KNOWN, ins
    (base,) = [a for w, a in ins if w == "FROM"]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim-(bookworm|trixie)", base), base  # Debian, Python 3.11


def test_the_daemonset_names_the_image_this_file_builds_with_the_version_of_pyproject():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {c["image"] for c in daemonset_containers()}
    text = DOCKERFILE.read_text()
    (build,) = re.findall(r"docker build -f deploy/Dockerfile -t (\S+) \.", text)
    assert images == {build} == {f"registry.example.com/linkpass:{version}"}
    labels = dict(kv.split("=", 1) for _, a in instructions(text) if _ == "LABEL" for kv in shlex.split(a))
    assert labels["org.opencontainers.image.version"] == version


def test_copy_sources_exist_and_cover_what_pip_install_needs():
    ins = instructions(DOCKERFILE.read_text())
    sources = [s for w, a in ins if w == "COPY" for s in shlex.split(a)[:-1]]
    assert sources, "no COPY"
    for s in sources:
        assert not s.startswith("--") and (ROOT / s).exists(), s
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"pyproject.toml", pyproject["project"]["readme"], *packages} <= set(sources)


def test_pip_installs_this_repository_with_its_pinned_dependencies_only():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runs = " && ".join(a for w, a in instructions(DOCKERFILE.read_text()) if w == "RUN")
    installs = re.findall(r"pip install ((?:--?\S+ )*)(\S+)", runs)
    assert len(installs) == 1, runs
    (_, target), = installs
    m = re.fullmatch(r"""["']?\.(?:\[([\w,]+)\])?["']?""", target)
    assert m, target  # the repository itself, not packages by name
    for extra in (m.group(1) or "").split(",") if m.group(1) else []:
        assert extra in pyproject["project"]["optional-dependencies"], extra
    for dep in pyproject["project"]["dependencies"] + [d for e in (m.group(1) or "").split(",") if e
                                                       for d in pyproject["project"]["optional-dependencies"][e]]:
        assert "==" in dep, dep  # every requirement the image gets is pinned


def test_entrypoint_is_the_linkpass_run_the_daemonset_runs():
    ins = instructions(DOCKERFILE.read_text())
    (entry,) = [exec_form(a) for w, a in ins if w == "ENTRYPOINT"]
    (cmd,) = [exec_form(a) for w, a in ins if w == "CMD"]
    (main,) = [c for c in daemonset_containers() if c["name"] == "linkpass"]
    assert entry + cmd == main["command"] == ["linkpass", "run", "--config", "/etc/linkpass/config/linkpass.toml"]
