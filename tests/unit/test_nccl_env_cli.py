"""`linkpass nccl-env`, `linkpass exec` and the daemon's env-file adapter (no root needed: a
fake daemon answers on a unix socket in a thread)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "topology"))

import sysfs_trees as st

from linkpass.config import parse_config, policy_from_config
from linkpass.adapters.nccl_file import NcclEnvFile, write_atomic
from linkpass.core.engine import Engine
from linkpass.core.model import AddrChanged, LinkChanged, WriteNcclEnv
from linkpass.core.nccl_env import health_from_status, plan_env_file
from linkpass.cli import main

ROOT = Path(__file__).resolve().parents[2]
HGX_HCA = "=mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_8:1,mlx5_9:1,mlx5_10:1"
DEVS = ["ibp24s0", "ibp64s0", "ibp79s0", "ibp94s0", "ibp154s0", "ibp192s0", "ibp206s0", "ibp220s0"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hgx")
    st.build(root, st.hgx_h100_ib()[0])
    return root


def status_doc(generation: int, down: tuple[str, ...] = ()) -> dict:
    return {"schema": "linkpass.status/v1", "generation": generation,
            "rails": [{"id": i, "netdev": d, "state": "DOWN" if d in down else "UP", "usable": d not in down,
                       "addresses": [f"10.{i}.0.1/24"]} for i, d in enumerate(DEVS)]}


class FakeDaemon:
    """Answers every connection on a unix socket with one JSON line (or raw bytes)."""

    def __init__(self, path: Path, reply: bytes):
        self.path, self.reply = str(path), reply
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(self.reply)

    def close(self):
        self.sock.close()


@pytest.fixture
def daemon(tmp_path):
    d = FakeDaemon(tmp_path / "lp.sock", json.dumps(status_doc(9, down=("ibp64s0",))).encode() + b"\n")
    yield d
    d.close()


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------- nccl-env


def test_env_file_from_a_captured_tree_without_daemon(capsys, tree):
    rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--no-daemon", "--format", "env-file",
                       "--nccl-version", "2.29.7")
    assert rc == 0, err
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    # one single-port NIC per GPU: no port failover to configure (NVIDIA/nccl#2192), so no
    # NCCL_IB_RESILIENCY_* (the torch guard would read it as "NCCL fails over" and skip exit 75)
    assert lines == [f"NCCL_IB_HCA={HGX_HCA}", "NCCL_SOCKET_IFNAME==" + ",".join(DEVS), "NCCL_CROSS_NIC=0"]
    assert "no second healthy port" in out
    assert out.splitlines()[0].startswith("# linkpass NCCL environment: host=- generation=- gpu=all nccl=2.29.7")


def test_shell_format_for_a_gpu_is_evaluable(tree):
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "nccl-env", "--sysfs-root", str(tree), "--no-daemon", "--gpu", "3"],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    sh = subprocess.run(["sh", "-c", p.stdout + 'printf "%s|%s" "$NCCL_IB_HCA" "$NCCL_CROSS_NIC"'], capture_output=True, text=True, check=False)
    assert sh.stdout == "=mlx5_5:1,mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_6:1,mlx5_8:1,mlx5_9:1,mlx5_10:1|0"


def test_daemon_health_and_generation_are_used(capsys, tree, daemon):
    rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--socket", daemon.path, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["generation"] == 9 and doc["health_known"] is True
    assert "mlx5_3:1" not in doc["env"]["NCCL_IB_HCA"] and "ibp64s0" not in doc["env"]["NCCL_SOCKET_IFNAME"]
    assert doc["lost_rails"] and doc["warnings"]  # rail-only fabric (default): warned
    assert "health unknown" not in err


def test_without_daemon_stderr_says_health_unknown(capsys, tree, tmp_path):
    rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--socket", str(tmp_path / "nothing.sock"))
    assert rc == 0
    assert "health unknown" in err and "no such socket" in err
    assert f"export NCCL_IB_HCA='{HGX_HCA}'" in out


def test_a_daemon_answering_garbage_counts_as_unknown(capsys, tree, tmp_path):
    d = FakeDaemon(tmp_path / "bad.sock", b'{"rails": [{"id": "zero"}]}\n')
    try:
        rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--socket", d.path)
    finally:
        d.close()
    assert rc == 0 and "health unknown" in err and "rails[0].id" in err
    assert f"export NCCL_IB_HCA='{HGX_HCA}'" in out  # topology only


def test_no_healthy_port_exits_1_with_the_error(capsys, tree, tmp_path):
    d = FakeDaemon(tmp_path / "down.sock", json.dumps(status_doc(3, down=tuple(DEVS))).encode() + b"\n")
    try:
        rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--socket", d.path, "--format", "env-file")
    finally:
        d.close()
    assert rc == 1
    assert not any(line.startswith("NCCL_IB_HCA=") for line in out.splitlines())
    assert "ERROR: no healthy compute port" in err


@pytest.mark.parametrize("argv, msg", [
    (["--sysfs-root", "/nonexistent/lp"], "--sysfs-root /nonexistent/lp: no such directory"),
    (["--from", "/nonexistent/ibstat.txt"], "--from: nothing could be read"),
    (["--from", "/dev/zero"], "/dev/zero: not a regular file (a character device)"),  # not read at all
    (["--nccl-version", "new"], "--nccl-version: NCCL version 'new'"),
    (["--gpu", "8"], "GPU 8: this host has 8 GPU(s)"),
    (["--config", "/nonexistent/lp.toml"], "/nonexistent/lp.toml: no such file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tree, argv, msg):
    rc, out, err = run(capsys, "nccl-env", "--no-daemon", *(["--sysfs-root", str(tree)] if "--sysfs-root" not in argv and "--from" not in argv else []), *argv)
    assert rc == 2
    assert msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("argv, msg", [
    (["--gpu", "x"], "argument --gpu: 'x' is not a whole number"),
    (["--gpu", "-2"], "argument --gpu: -2 is negative"),
    (["--gpu", "1", "--local-rank", "1"], "not allowed with argument"),
    (["--format", "yaml"], "invalid choice: 'yaml'"),
])
def test_argparse_errors_are_one_line_and_exit_2(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main(["nccl-env", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_unknown_flag_exits_2_without_traceback(capsys):
    # reported by the top-level `linkpass` parser (usage line + error line, as every sub-command)
    with pytest.raises(SystemExit) as e:
        main(["nccl-env", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in err and "Traceback" not in err


def test_local_rank_goes_through_cuda_visible_devices(capsys, tree, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--no-daemon", "--local-rank", "1", "--format", "json")
    assert rc == 0 and json.loads(out)["gpu"] == 3
    assert json.loads(out)["env"]["NCCL_IB_HCA"].startswith("=mlx5_5:1,")
    rc, out, err = run(capsys, "nccl-env", "--sysfs-root", str(tree), "--no-daemon", "--local-rank", "2")
    assert rc == 2 and "makes only 2 GPU(s) visible" in err


def test_config_supplies_socket_and_options(capsys, tree, daemon, tmp_path):
    cfg = tmp_path / "lp.toml"
    cfg.write_text(f'[daemon]\nhost = "h7"\nhost_ip = "10.9.0.1"\ncontrol_socket = "{daemon.path}"\n'
                   f'[[rails]]\nid = 0\nnetdev = "ibp24s0"\n[topology]\nsysfs_root = "{tree}"\n'
                   '[nccl]\nrails_joined_by_spine = true\nversion = "2.28.3"\n')
    rc, out, err = run(capsys, "nccl-env", "--config", str(cfg), "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["host"] == "h7" and doc["generation"] == 9 and doc["nccl_version"] == "2.28.3"
    assert doc["env"]["NCCL_CROSS_NIC"] == "1"  # spine + lost rail
    assert not any(k.startswith("NCCL_IB_RESILIENCY") for k in doc["env"])  # 2.28 has no port failover


# ---------------------------------------------------------------------- exec


def _exec(tree, *extra, env=None):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "linkpass.cli", "exec", "--sysfs-root", str(tree), "--no-daemon", *extra],
                          capture_output=True, text=True, cwd=ROOT, env=e, check=False)


def test_exec_adds_the_environment_and_takes_local_rank_from_env(tree):
    p = _exec(tree, "--", "sh", "-c", 'printf "%s|%s|%s" "$NCCL_IB_HCA" "$KEEP" "$NCCL_SOCKET_IFNAME"',
              env={"LOCAL_RANK": "2", "KEEP": "yes", "NCCL_IB_HCA": "mlx5", "CUDA_VISIBLE_DEVICES": ""})
    # CUDA_VISIBLE_DEVICES="" hides every GPU: local rank 2 has none -> bad input
    assert p.returncode == 2 and "makes only 0 GPU(s) visible" in p.stderr
    p = _exec(tree, "--", "sh", "-c", 'printf "%s|%s|%s" "$NCCL_IB_HCA" "$KEEP" "$NCCL_SOCKET_IFNAME"',
              env={"LOCAL_RANK": "2", "KEEP": "yes", "NCCL_IB_HCA": "mlx5"})
    assert p.returncode == 0, p.stderr
    hca, keep, ifname = p.stdout.split("|")
    assert hca.startswith("=mlx5_4:1,mlx5_0:1,") and keep == "yes" and ifname.startswith("=ibp79s0,")
    assert "replaces NCCL_IB_HCA=mlx5" in p.stderr


@pytest.mark.parametrize("argv, env, rc, msg", [
    ([], {}, 2, "no command given"),
    (["--"], {}, 2, "no command given"),
    (["--", "/nonexistent/bin/x"], {}, 2, "/nonexistent/bin/x: command not found"),
    (["--", "true"], {"LOCAL_RANK": "one"}, 2, "LOCAL_RANK in the environment: 'one' is not a whole number"),
    (["--local-rank", "-1", "--", "true"], {}, 2, "argument --local-rank: -1 is negative"),
])
def test_exec_bad_input(tree, argv, env, rc, msg):
    p = _exec(tree, *argv, env=env)
    assert p.returncode == rc and msg in p.stderr and "Traceback" not in p.stderr


def test_exec_runs_the_command_exit_status_passes_through(tree):
    p = _exec(tree, "--", "sh", "-c", "exit 7")
    assert p.returncode == 7


# ---------------------------------------------------------------------- the daemon's env file


def _cfg(tmp_path: Path, tree: Path | str, env_file: Path) -> object:
    return parse_config('[daemon]\nhost = "h0"\nhost_ip = "10.9.0.1"\n'
                        + "".join(f'[[rails]]\nid = {i}\nnetdev = "{d}"\n' for i, d in enumerate(DEVS))
                        + f'[topology]\nsysfs_root = "{tree}"\n[nccl]\nenv_file = "{env_file}"\nversion = "2.30.1"\n')


def _plan(f: NcclEnvFile, generation: int, status: dict) -> None:
    """What the engine hands the adapter for a plan whose rails are those of ``status``."""
    f.write(WriteNcclEnv(generation, health_from_status(status).rails, f.context))


def test_engine_computes_the_env_file_from_its_own_rails(tmp_path, tree):
    from unit_helpers import carrier_lost, decided, snapshot

    path = tmp_path / "nccl.env"
    cfg = _cfg(tmp_path, tree, path)
    f = NcclEnvFile(cfg)
    eng = Engine(policy_from_config(cfg), f.context)
    (w,) = [a for a in eng.handle(snapshot(cfg, 0), 0) if isinstance(a, WriteNcclEnv)]
    # the addresses the netlink dump brings right after the first plan are in the file it writes
    for i, d in enumerate(DEVS):
        assert decided(eng.handle(AddrChanged(d, f"10.{i}.0.1", 24, True, 0), 0)) == []
    # the same text the adapter used to compute from `linkpass status` JSON
    assert w.generation == 1 and w.error is None
    assert "NCCL_SOCKET_IFNAME==" + ",".join(DEVS) in w.text.splitlines()
    assert w.text == plan_env_file(f.context, health_from_status(eng.status(0)).rails, 1)[1]
    f.write(w)
    assert path.read_text() == w.text and f"NCCL_IB_HCA={HGX_HCA}" in w.text.splitlines()
    (w2,) = [a for a in eng.handle(LinkChanged(carrier_lost("ibp24s0"), 1), 1) if isinstance(a, WriteNcclEnv)]
    values = dict(line.split("=", 1) for line in w2.text.splitlines() if not line.startswith("#"))
    assert w2.generation == 2 and "mlx5_0:1" not in values["NCCL_IB_HCA"] and "mlx5_0:1" in HGX_HCA
    assert not [a for a in Engine(policy_from_config(cfg)).handle(snapshot(cfg, 0), 0) if isinstance(a, WriteNcclEnv)]  # no context: no file


def test_env_file_written_atomically_only_on_newer_generations(tmp_path, tree):
    path = tmp_path / "nccl.env"
    f = NcclEnvFile(_cfg(tmp_path, tree, path))
    _plan(f, 3, status_doc(3))
    text = path.read_text()
    assert text.splitlines()[0].startswith("# linkpass NCCL environment: host=h0 generation=3 gpu=all nccl=2.30.1")
    assert f"NCCL_IB_HCA={HGX_HCA}" in text.splitlines()
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    _plan(f, 2, status_doc(2, down=("ibp24s0",)))  # older: ignored
    _plan(f, 3, status_doc(3, down=("ibp24s0",)))  # same: ignored
    assert path.read_text() == text
    _plan(f, 4, status_doc(4, down=("ibp24s0",)))
    new = path.read_text()
    values = dict(line.split("=", 1) for line in new.splitlines() if not line.startswith("#"))
    assert "generation=4" in new.splitlines()[0]
    assert "mlx5_0:1" not in values["NCCL_IB_HCA"] and "ibp24s0" not in values["NCCL_SOCKET_IFNAME"]
    assert [p.name for p in tmp_path.iterdir()] == ["nccl.env"]  # no temporary file left behind


def test_env_file_without_hcas_keeps_socket_ifname(tmp_path):
    path = tmp_path / "nccl.env"
    empty = tmp_path / "empty-sysfs"
    (empty / "sys" / "class" / "net").mkdir(parents=True)
    f = NcclEnvFile(_cfg(tmp_path, empty, path))
    _plan(f, 1, status_doc(1, down=("ibp64s0",)))
    lines = path.read_text().splitlines()
    assert any(line.startswith("# note: NCCL_IB_HCA not set") for line in lines)
    assert "NCCL_SOCKET_IFNAME==" + ",".join(d for d in DEVS if d != "ibp64s0") in lines


def test_env_file_write_failure_is_logged_once_and_never_raises(tmp_path, tree, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    f = NcclEnvFile(_cfg(tmp_path, tree, blocker / "nccl.env"))
    with caplog.at_level(logging.DEBUG, logger="linkpass.nccl_file"):
        for g in (1, 2, 3):
            _plan(f, g, status_doc(g))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot write" in errors[0].getMessage()
    assert f.errors == 3 and f.written_generation == 0


def test_env_file_disabled_writes_nothing(tmp_path, tree):
    cfg = parse_config(f'[daemon]\nhost = "h0"\nhost_ip = "10.9.0.1"\n[[rails]]\nid = 0\nnetdev = "x0"\n'
                       f'[nccl]\nenv_file = "{tmp_path / "n.env"}"\nwrite_env_file = false\n')
    f = NcclEnvFile(cfg)
    assert f.context is None  # the engine gets nothing to compute from
    f.write(WriteNcclEnv(1, health_from_status(status_doc(1)).rails, f.context))
    assert not (tmp_path / "n.env").exists()


def test_write_atomic_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "f"
    write_atomic(path, "old\n")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_nccl_config_section_defaults_and_errors():
    cfg = parse_config('[daemon]\nhost = "a"\nhost_ip = "10.0.0.1"\n[[rails]]\nid = 0\nnetdev = "r0"\n')
    assert cfg.nccl.env_file == "/run/linkpass/nccl.env" and cfg.nccl.rails_joined_by_spine is False
    assert cfg.nccl.write_env_file and cfg.nccl.ib_resiliency and cfg.nccl.version == ""
    from linkpass.config import ConfigError

    for bad, msg in [('version = "latest"', "nccl.version: must be MAJOR.MINOR"),
                     ('spine = true', "nccl.spine: Extra inputs are not permitted")]:
        with pytest.raises(ConfigError, match=msg):
            parse_config(f'[daemon]\nhost = "a"\nhost_ip = "10.0.0.1"\n[[rails]]\nid = 0\nnetdev = "r0"\n[nccl]\n{bad}\n', "f.toml")


def test_topology_warnings_of_a_cut_off_file_are_shown(capsys, tmp_path):
    src = ROOT / "tests" / "fixtures" / "corpus" / "nccl_topo" / "alibaba_8xA100_mlx5bond_topo.xml"
    lines = src.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.xml"
    cut.write_text("".join(lines[:len(lines) // 2]))
    rc, out, err = run(capsys, "nccl-env", "--no-daemon", "--from", str(cut), "--format", "json")
    assert rc == 0, err  # what could be read is used, as `linkpass topology` does; the warning says it is partial
    mine = [ln for ln in err.splitlines() if ln.startswith(f"linkpass nccl-env: {cut}: ")]
    assert len(mine) == 1 and "the topology is cut off" in mine[0], err
    doc = json.loads(out)
    assert any(w.startswith(f"{cut}: ") and "cut off" in w for w in doc["warnings"])
    assert doc["env"]["NCCL_IB_HCA"] == "=mlx5_bond_1:1,mlx5_bond_2:1"  # the NICs before the cut
    # shell format: the header says it too; exec prints the same line before running CMD
    rc, out, err = run(capsys, "nccl-env", "--no-daemon", "--from", str(cut))
    assert rc == 0 and f"# warning: {cut}: " in out and f"linkpass nccl-env: {cut}: " in err
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "exec", "--no-daemon", "--from", str(cut), "--", "true"],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0 and f"linkpass exec: {cut}: " in p.stderr and "cut off" in p.stderr
    # a whole file: no such warning
    rc, out, err = run(capsys, "nccl-env", "--no-daemon", "--from", str(src))
    assert rc == 0 and "cut off" not in err
