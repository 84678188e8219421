"""Bad input to the ``linkpass`` CLI: one line naming the option and the value and saying what is
allowed, exit 2, no traceback, and nothing measured, probed or built before it (the shared
checks of linkpass/cli/argtypes.py and the commands that use them)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from unit_helpers import run_cli

from linkpass.cli.argtypes import float_range, gpu_index, int_list, int_range
from torch_hooks import client as client_mod
from torch_hooks import protocol as proto

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


def one_line_exit_2(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2, (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


# ----------------------------------------------------------------------------- the shared checks


@pytest.mark.parametrize("fn, text, says", [
    (int_range(1), "-3", "-3 is negative; it must be a whole number >= 1"),
    (int_range(3), "2", "2 is too small; it must be a whole number >= 3"),
    (int_range(0, 9), "10", "10 is too large; it must be a whole number from 0 to 9"),
    (int_range(0), "abc", "'abc' is not a whole number"),
    (int_range(0), "9" * 5000, "not a whole number"),  # past Python's digit limit: still one short line
    (gpu_index, "99999999999999999999", "it must be a GPU index from 0 to 1023"),
    (float_range(0, lo_open=True), "0", "0 is out of range; it must be a number > 0"),
    (float_range(0, 1, lo_open=True, hi_open=True), "1", "it must be a number in (0, 1)"),
    (float_range(0), "nan", "nan is not a finite number"),
    (int_list(3, 10), "0", "0: must be comma-separated whole numbers from 3 to 10"),
    (int_list(3, 10), "4,x", "('x' is not)"),
    (int_list(3, 10), ",", "must be comma-separated"),
])
def test_bad_values_say_the_value_and_what_is_allowed(fn, text, says):
    with pytest.raises(argparse.ArgumentTypeError) as ei:
        fn(text)
    assert says in str(ei.value) and len(str(ei.value)) < 200


def test_good_values_pass():
    assert int_range(1)("3") == 3 and gpu_index("1023") == 1023 and float_range(0)("0") == 0.0
    assert int_list(3)("8, 16") == "8, 16"


# ----------------------------------------------------------------------------- bench


def test_bench_scale_refuses_a_bad_host_count_before_measuring(capsys, monkeypatch):
    rc, out, err = run(capsys, "bench", "scale", "--hosts", "0")
    one_line_exit_2(rc, out, err, "linkpass bench scale: ", "--hosts", "0", "from 3 to")
    assert out == "" and "scale_sim" not in err  # no "costs (us)" line: nothing was measured


def test_bench_scale_a_size_that_does_not_fit_names_the_command_and_options(capsys):
    rc, out, err = run(capsys, "bench", "scale", "--hosts", "8,20000")
    one_line_exit_2(rc, out, err, "linkpass bench scale: --rails 8 x --hosts 20000", "198.18.0.0/15")
    assert out == "" and "scale_sim" not in err


@pytest.mark.parametrize("argv, needles", [
    (["--trials", "-3"], ["argument --trials: -3 is negative", ">= 1"]),
    (["--hosts", "1"], ["argument --hosts: 1", "from 2 to"]),
    (["--timeout-s", "nan"], ["argument --timeout-s: nan"]),
    (["--mode", "bogus"], ["--mode: ", "'bogus'"]),
])
def test_bench_detect_names_the_option_not_the_script(capsys, argv, needles):
    rc, out, err = run(capsys, "bench", "detect", *argv)
    one_line_exit_2(rc, out, err, "linkpass bench detect: ", *needles)
    assert "detect_bfd" not in err and out == ""


def test_bench_snapshot_unknown_option_is_the_subcommands_error(capsys):
    rc, out, err = run(capsys, "bench", "snapshot", "--runs", "abc")
    one_line_exit_2(rc, out, err, "linkpass bench snapshot: unrecognized arguments: --runs abc")
    assert "usage: linkpass [-h]" not in err


@pytest.mark.parametrize("argv", [["bench", "snapshot", "--every", "0"], ["bench", "snapshot", "--fault-frac", "1"]])
def test_bench_snapshot_bad_numbers(capsys, argv):
    rc, out, err = run(capsys, *argv)
    one_line_exit_2(rc, out, err, "linkpass bench snapshot: argument --", argv[-1])


def test_unknown_option_of_another_subcommand_gets_its_usage(capsys):
    rc, out, err = run(capsys, "status", "--nope")
    assert rc == 2 and "usage: linkpass status" in err and "unrecognized arguments: --nope" in err


# ----------------------------------------------------------------------------- nccl-env, exec


@pytest.mark.parametrize("argv, needles", [
    (["--gpu", "99999999999999999999"], ["argument --gpu: 99999999999999999999 is too large", "from 0 to 1023"]),
    (["--gpu", "1024"], ["argument --gpu: 1024", "GPU index from 0 to 1023"]),
    (["--local-rank", "5000"], ["argument --local-rank: 5000", "from 0 to 1023"]),
])
def test_nccl_env_gpu_index_range(capsys, argv, needles):
    rc, out, err = run(capsys, "nccl-env", "--no-daemon", *argv)
    one_line_exit_2(rc, out, err, "linkpass nccl-env: ", *needles)
    assert out == "" and "warning" not in err


def _exec(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LINKPASS_HOOK")}
    return subprocess.run([sys.executable, "-m", "linkpass.cli", "exec", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**e, **(env or {})}, timeout=120)


@pytest.mark.parametrize("argv, env, needle", [
    (["--resume", "/nonexistent/snaps", "--", "true"], {}, "--resume /nonexistent/snaps: no such snapshot directory"),
    (["--", "/nonexistent/bin/x"], {}, "/nonexistent/bin/x: command not found"),
    (["--", "no-such-command-linkpass"], {}, "no-such-command-linkpass: command not found"),
    (["--", "true"], {"LOCAL_RANK": "99999"}, "LOCAL_RANK in the environment: 99999 is too large"),
    (["--resume", "/x", "--", "true"], {"LINKPASS_HOOK": "0"}, "--resume needs the hook"),
])
def test_exec_argument_errors_come_before_any_probing(tmp_path, argv, env, needle):
    # no --no-daemon: a probe would print "health unknown" and nvml lines before the error
    p = _exec("--socket", str(tmp_path / "none.sock"), *argv, env=env)
    one_line_exit_2(p.returncode, p.stdout, p.stderr, f"linkpass exec: {needle}")
    assert "health unknown" not in p.stderr and "nvml" not in p.stderr


def test_exec_says_no_daemon_once_and_tells_the_hook(tmp_path):
    p = _exec("--socket", str(tmp_path / "none.sock"), "--", "sh", "-c", 'printf "%s" "$LINKPASS_NO_DAEMON_SAID"')
    assert p.returncode == 0, p.stderr
    assert p.stdout == "1"
    said = [ln for ln in p.stderr.splitlines() if "daemon" in ln]
    assert len(said) == 1 and said[0].startswith("linkpass exec: health unknown: no usable answer from a daemon on ")


def _absent_client(tmp_path, local_rank=0) -> client_mod.DaemonClient:
    reg = dataclasses.replace(proto.Registration(job="j", rank=3, world_size=4, peers=("h1",)), local_rank=local_rank)
    c = client_mod.DaemonClient(reg, str(tmp_path / "absent.sock"))
    c._session()  # one connect attempt, as the client thread makes it
    c._session()  # a second: said once at most
    return c


def test_hook_client_says_no_daemon_once_prefixed_without_logging(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(client_mod.NO_DAEMON_SAID_ENV, raising=False)
    monkeypatch.setattr(client_mod.log, "hasHandlers", lambda: False)  # a script that set no logging up
    _absent_client(tmp_path)
    err = capsys.readouterr().err
    assert err == (f"linkpass: rank 3: no linkpass daemon at {tmp_path / 'absent.sock'} (No such file or directory); "
                   "training goes on, retrying in the background\n")


def test_hook_client_is_quiet_when_exec_said_it_or_for_other_local_ranks(tmp_path, capsys, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="linkpass.torch_hooks.client")
    monkeypatch.setenv(client_mod.NO_DAEMON_SAID_ENV, "1")
    _absent_client(tmp_path)
    monkeypatch.delenv(client_mod.NO_DAEMON_SAID_ENV)
    _absent_client(tmp_path, local_rank=1)
    assert capsys.readouterr().err == ""
    assert [r.levelno for r in caplog.records if "no linkpass daemon" in r.getMessage()] == [logging.DEBUG] * 2


def test_hook_client_warns_through_logging_when_the_script_set_it_up(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(client_mod.NO_DAEMON_SAID_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="linkpass.torch_hooks.client")
    _absent_client(tmp_path)
    assert [r.levelno for r in caplog.records if "no linkpass daemon" in r.getMessage()] == [logging.WARNING]


# ----------------------------------------------------------------------------- topology capture


@pytest.mark.parametrize("setup, needle", [
    (lambda t: "/proc/linkpass-nope", "--out /proc/linkpass-nope: cannot write there (No such file or directory)"),
    (lambda t: (t / "f").write_text("x") and str(t / "f"), "exists and is not a directory"),
    (lambda t: (t / "d").mkdir() or (t / "d" / "x").write_text("x") and str(t / "d"), "directory not empty"),
])
def test_topology_capture_unusable_out_is_bad_input(tmp_path, setup, needle):
    out = setup(tmp_path)
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "topology", "capture", "--out", out],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    one_line_exit_2(p.returncode, p.stdout, p.stderr, f"linkpass topology capture: --out {out}", needle)


def test_topology_capture_missing_sysfs_root_is_bad_input(tmp_path):
    p = subprocess.run([sys.executable, "-m", "linkpass.cli", "topology", "capture", "--out", str(tmp_path / "o"),
                        "--sysfs-root", str(tmp_path / "nope")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    one_line_exit_2(p.returncode, p.stdout, p.stderr, f"--sysfs-root {tmp_path / 'nope'}: no such directory")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- a fresh user's finds


def test_exec_spares_beyond_a_handful_is_refused(capsys):
    rc, out, err = run(capsys, "exec", "--no-daemon", "--spares", "100000", "--", "true")
    one_line_exit_2(rc, out, err, "--spares", "100000", "0 to 8")


@pytest.mark.parametrize("fh", ["7", "-1"])
def test_demo_fault_host_out_of_range_is_refused_in_the_default_scenario(capsys, fh):
    rc, out, err = run(capsys, "demo", "--hosts", "2", "--fault-host", fh)
    one_line_exit_2(rc, out, err, "--fault-host must be 0..1", fh)
    assert out == ""  # nothing built or started


def test_config_check_finds_one_address_given_to_two_peers_and_a_peer_with_our_own(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[daemon]\nhost = "h0"\nmode = "per-rail-ip"\n'
                   '[[rails]]\nid = 0\nnetdev = "rail0"\naddress = "198.18.0.1"\n'
                   '[[peers]]\nname = "h1"\nrail_ips = { "0" = "198.18.0.2" }\n'
                   '[[peers]]\nname = "h2"\nrail_ips = { "0" = "198.18.0.2" }\n'
                   '[[peers]]\nname = "h3"\nrail_ips = { "0" = "198.18.0.1" }\n')
    rc, out, err = run(capsys, "config", "check", str(cfg))
    assert rc == 2 and "Traceback" not in err, err
    assert "peers[1].rail_ips: 198.18.0.2 (rail 0) is also peer h1's address" in err, err
    assert "peers[2].rail_ips: 198.18.0.1 is this host's own rail address" in err, err
