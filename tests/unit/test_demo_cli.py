"""`linkpass demo` argument handling and its first lines, without a fabric (no root, no torchrun)."""

from __future__ import annotations

import json
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
    (["--scenario", "reroute", "--reference-cache", "{tmp}"], "only for the --script scenarios"),
    (["--scenario", "rail", "--reference-cache", "{tmp}/no/such/dir"], "not a writable directory"),
    (["--scenario", "rail", "--reference-cache", "{old}"], "not a writable directory"),
    (["--scenario", "rail", "--reference-cache", ""], "empty"),
])
def test_fault_when_and_reference_cache_are_refused_before_any_fabric_with_the_reason(args, why, tmp_path, capsys):
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


def _cached_demo(tmp_path, monkeypatch, args="--epochs 1", script="ddp_train.py", hosts=2):
    d = demo_script.ScriptDemo(str(ROOT / "examples" / script), args, "rail", hosts, 2, "lpt", "carrier-loss", log=lambda m: None)
    d.reference_cache = tmp_path
    runs = []

    def launch(tag, port, *a, **kw):
        runs.append(tag)

    monkeypatch.setattr(d, "_launch", launch)
    monkeypatch.setattr(d, "_wait_all", lambda tag: [{"rank": r, "steps": 40, "weights_sha256": f"w{r}"} for r in range(hosts)])
    return d, runs


def test_the_reference_is_run_once_per_key_and_then_taken_from_the_cache(tmp_path, monkeypatch):
    d, runs = _cached_demo(tmp_path, monkeypatch)
    ref = d._reference()
    assert runs == ["reference"] and not d.reference_from_cache
    d2, runs2 = _cached_demo(tmp_path, monkeypatch)
    assert d2._reference() == ref and runs2 == [] and d2.reference_from_cache
    # anything the reports depend on gives another key: the reference runs again
    for kw in ({"args": "--epochs 2"}, {"script": "fsdp2_train.py"}, {"hosts": 3}):
        d3, runs3 = _cached_demo(tmp_path, monkeypatch, **kw)
        assert d3.reference_key() != d.reference_key()
        d3._reference()
        assert runs3 == ["reference"], kw
    key = d.reference_key()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # differs between callers, read by no script
    assert d.reference_key() == key
    monkeypatch.setenv("HOLD_ALLREDUCE_SEQ", "50")  # a variable the script (or a shim) may read
    assert d.reference_key() != key
    monkeypatch.delenv("HOLD_ALLREDUCE_SEQ")
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))  # a sitecustomize there runs in the workers
    k1 = d.reference_key()
    (site / "sitecustomize.py").write_text("x = 1\n")
    k2 = d.reference_key()
    (site / "sitecustomize.py").write_text("x = 2\n")
    assert len({key, k1, k2, d.reference_key()}) == 4


@pytest.mark.parametrize("content", [
    "", "{", "[]", '[{"rank": 0}]', '{"rank": 0, "steps": 3}', '[{"rank": 0, "steps": 40, "weights_sha256": "w"}]',
    '[{"rank": 0, "steps": 40, "weights_sha256": "w"}, {"rank": 0, "steps": 40, "weights_sha256": "w"}]',
    '[{"rank": 0, "steps": 40, "weights_sha256": "w"}, {"rank": 1, "steps": 40}]', "[1, 2]",
    '[{"rank": "0", "steps": 40, "weights_sha256": "w"}, {"rank": 1, "steps": 40, "weights_sha256": "w"}]'])
def test_a_bad_or_truncated_cache_entry_is_run_again_and_replaced(tmp_path, monkeypatch, content):
    d, runs = _cached_demo(tmp_path, monkeypatch)
    entry = tmp_path / f"reference-{d.reference_key()}.json"
    entry.write_text(content)
    ref = d._reference()
    assert runs == ["reference"] and not d.reference_from_cache
    assert json.loads(entry.read_text()) == ref
