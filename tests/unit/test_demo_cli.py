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
