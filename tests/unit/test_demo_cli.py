"""`linkpass demo` argument handling and its first lines, without a fabric (no root, no torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from linkpass.lab import demo_script

ROOT = Path(__file__).resolve().parents[2]


def test_demo_help_lists_snapshot_for_script(capsys, monkeypatch):
    from linkpass.cli import main

    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping inside "device-fault"

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the training script for rail / rail-latched / device-fault / snapshot" in text, text


@pytest.mark.parametrize("args", ["", "--epochs 1"])
def test_the_reference_run_banner_has_single_spaces(args, monkeypatch):
    lines: list[str] = []
    d = demo_script.ScriptDemo(str(ROOT / "examples" / "ddp_train.py"), args, "snapshot", 2, 2, "lpt", "carrier-loss",
                               log=lines.append)
    monkeypatch.setattr(d, "start", lambda: None)

    def stop(*a, **kw):
        raise RuntimeError("stop here")

    monkeypatch.setattr(d, "_launch", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        d.run()
    assert lines == [f"reference run: {' '.join(['ddp_train.py', *args.split()])} under linkpass exec + torchrun, no fault"]
    assert "  " not in lines[0]


@pytest.mark.parametrize("args,why", [
    (["--scenario", "reroute", "--fault-when", "{new}"], "only for the --script scenarios"),
    (["--scenario", "snapshot", "--fault-when", "{new}"], "injects no fault"),
    (["--scenario", "rail", "--fault-when", "{tmp}/no/such/dir/f"], "does not exist"),
    (["--scenario", "rail", "--fault-when", "{tmp}"], "exists already"),
    (["--scenario", "rail", "--fault-when", "{old}"], "exists already"),
])
def test_fault_when_is_refused_before_any_fabric_with_the_reason(args, why, tmp_path, capsys):
    from linkpass.cli import main

    (tmp_path / "old").write_text("")
    args = [a.format(new=tmp_path / "new", tmp=tmp_path, old=tmp_path / "old") for a in args]
    assert main(["demo", "--name", "lpfw", *args]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_fault_when_is_made_absolute(tmp_path, monkeypatch):
    from linkpass.lab.demo.cli import fault_when_path

    monkeypatch.chdir(tmp_path)
    assert fault_when_path("cut", "rail") == str(tmp_path / "cut")
    assert fault_when_path(None, "rail") is None
