"""`make install-service` puts the command where deploy/linkpass.service's ExecStart runs it,
the unit where systemd reads it and the example config (never over an edited one), and can run
again.  Staged under DESTDIR with a stand-in venv (its pip records what it was asked and makes
the console script), so no network and nothing on this machine is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "linkpass.service"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_var(name: str) -> str:
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "--eval", f"print-{name}: ; @echo $({name})", f"print-{name}"],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def exec_start() -> list[str]:
    (line,) = [ln for ln in UNIT.read_text().splitlines() if ln.startswith("ExecStart=")]
    return line[len("ExecStart="):].split()


@pytest.fixture
def staged(tmp_path):
    dest = tmp_path / "root"
    venv = dest / make_var("SERVICE_VENV").lstrip("/")
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\nexit 0\n")
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/pip.log"\n'
                   f'printf "#!/bin/sh\\n" > "{venv}/bin/linkpass" && chmod 755 "{venv}/bin/linkpass"\n')
    py.chmod(0o755)
    pip.chmod(0o755)

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", "-C", str(ROOT), "install-service", f"DESTDIR={dest}"],
                              capture_output=True, text=True, timeout=120)

    return dest, tmp_path / "pip.log", run


def test_exec_start_is_the_path_install_service_creates(staged):
    dest, pip_log, run = staged
    r = run()
    assert r.returncode == 0, r.stderr
    exe, *args = exec_start()
    assert exe == make_var("PREFIX") + "/bin/linkpass" == "/usr/local/bin/linkpass"
    link = dest / exe.lstrip("/")
    assert link.is_symlink() and os.readlink(link) == make_var("SERVICE_VENV") + "/bin/linkpass"
    assert (dest / os.readlink(link).lstrip("/")).is_file()  # the venv's console script, made by pip
    assert args[:2] == ["run", "--config"]
    unit = dest / make_var("UNIT_DIR").lstrip("/") / "linkpass.service"
    assert unit.read_text() == UNIT.read_text()
    conf = dest / args[2].lstrip("/")  # the config the unit names is the one installed
    assert conf.read_text() == (ROOT / "deploy" / "linkpass.toml.example").read_text()
    assert pip_log.read_text() == "install -q --upgrade .\n"  # this repository, with pyproject's pins


def test_install_service_runs_again_and_keeps_an_edited_config(staged):
    dest, pip_log, run = staged
    assert run().returncode == 0
    conf = dest / exec_start()[3].lstrip("/")
    conf.write_text("# edited by the operator\n")
    r = run()
    assert r.returncode == 0, r.stderr
    assert conf.read_text() == "# edited by the operator\n"
    assert pip_log.read_text().count("--upgrade .") == 2  # upgraded in place
    assert (dest / "usr/local/bin/linkpass").is_symlink()
