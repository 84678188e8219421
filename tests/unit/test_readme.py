"""The README is a guide for the people who adopt linkpass: it starts with the two commands a
fresh machine needs, says how to use it on a cluster, and its examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def commands(text: str) -> list[str]:
    """Shell commands in ``text``: lines joined across ``\\`` continuations, ``#`` comments cut."""
    out, cur = [], ""
    for line in text.splitlines():
        line = re.sub(r"^\s*#\s?", "", line) if line.lstrip().startswith("#") and "torchrun" in line else line
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def test_first_lines_are_the_two_commands_of_a_fresh_machine():
    lines = README.splitlines()
    assert lines[0] == "# linkpass" and lines[1] == ""
    assert re.fullmatch(r"    make demo    # as root on a fresh Debian machine with Python 3\.11: .+", lines[2])
    assert re.fullmatch(r"    make test    # same install, then the whole test suite", lines[3])
    targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M)
    assert {"demo", "test", "install-service"} <= set(targets)


def test_adopters_sections_come_first():
    heads = re.findall(r"^## (.+)$", README, re.M)
    assert heads[:2] == ["Use it on your cluster", "What changes in your training script"]
    use = README.split("## Use it on your cluster", 1)[1].split("\n## ", 1)[0]
    for needle in ("host_ip", "peers_file", "notice_key_file", "make install-service", "deploy/Dockerfile",
                   "daemonset.yaml", "linkpass config check", "linkpass exec", "torchrun"):
        assert needle in use, needle


SOURCES = ["README.md", "bench/README.md", "deploy/k8s/training-pod-example.yaml", "examples/ddp_train.py",
           "examples/fsdp2_train.py", "linkpass/cli/nccl.py"]


@pytest.mark.parametrize("name", SOURCES)
def test_torchrun_running_linkpass_exec_has_no_python(name):
    """torchrun runs its argument with python unless --no-python: `torchrun ... linkpass exec --
    python train.py` needs it, `linkpass exec -- torchrun ... train.py` does not."""
    seen = 0
    for cmd in commands((ROOT / name).read_text()):
        m = re.search(r"\btorchrun\b(.*?)\blinkpass exec\b", cmd)
        if m and "linkpass exec" not in cmd[:cmd.index("torchrun")]:
            seen += 1
            assert "--no-python" in m.group(1), f"{name}: {cmd.strip()}"
    if name in ("README.md", "deploy/k8s/training-pod-example.yaml"):
        assert seen, f"{name} shows no `torchrun ... linkpass exec` command any more"


def test_measured_figures_are_short_dated_and_found_in_bench_readme():
    sec = README.split("\n## Measured figures\n", 1)[1].split("\n## ", 1)[0]
    bullets = [b for b in re.split(r"\n- ", sec)[1:]]
    assert 3 <= len(bullets) <= 8 and len(sec.splitlines()) < 40 and "bench/README.md" in sec
    bench = (ROOT / "bench" / "README.md").read_text()
    for b in bullets:
        assert re.search(r"20\d\d-\d\d-\d\d", b) and re.search(r"`[^`]*(bench|demo|linkpass)[^`]*`", b), b
        for fig in re.findall(r"\d+\.\d+(?:–\d+\.\d+)?", b):  # every figure stands, unchanged, in bench/README.md
            assert fig in bench, (fig, b)


def test_moved_history_and_referenced_files_exist():
    for rel in re.findall(r"`((?:deploy|docs|bench|examples)/[\w./-]+)`", README):
        assert (ROOT / rel).exists(), rel
    assert "95eab36" in (ROOT / "docs" / "history.md").read_text()
